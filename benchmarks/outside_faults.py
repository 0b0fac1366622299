"""Fault sources this project did not build, for ``megascan_eval.py``: MegaScan's detector was designed against
``scan.faults`` and ``scan.inject``, so an evaluation only against those proves little.

* ``StressNg``: `stress-ng <https://github.com/ColinIanKing/stress-ng>`_ (Debian: ``apt-get install stress-ng``),
  the stress tool kernel and hardware people use, run on the CPUs the rank's process may use (its affinity set)
  from a given step on. Its ``--cpu`` stressors cycle through integer, floating-point and bit-twiddling methods
  and touch memory, unlike our own spinning loop (``CompetingProcess(kind="cpu")``).

Nothing is left behind: the tool runs in its own process group, is killed with it at fit end, at teardown and at
interpreter exit, and carries its own ``--timeout`` in case all of those are skipped (``kill -9`` of the rank).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
from typing import Any, Optional

import lightning.pytorch as pl

STRESS_NG = "stress-ng"
TIMEOUT_S = 900  # the tool's own limit: longer than any fit of the evaluation


def stress_ng_available() -> bool:
    return shutil.which(STRESS_NG) is not None


class StressNg(pl.Callback):
    """``stress-ng --cpu N --taskset CPUS`` on rank ``rank``'s CPUs from global step ``start_step`` until fit end
    (``N``: one stressor per CPU of the set, ``cpu_load`` percent busy each)."""

    def __init__(self, rank: int, start_step: int = 0, cpu_load: int = 100) -> None:
        if not stress_ng_available():
            raise RuntimeError(
                f"StressNg needs the {STRESS_NG} tool on PATH (Debian/Ubuntu: apt-get install stress-ng)"
            )
        if not 1 <= cpu_load <= 100:
            raise ValueError(f"StressNg(cpu_load={cpu_load}): a percentage from 1 to 100")
        self.rank, self.start_step, self.cpu_load = rank, start_step, cpu_load
        self._process: Optional[subprocess.Popen] = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._process is None and trainer.global_rank == self.rank and trainer.global_step >= self.start_step:
            cpus = sorted(os.sched_getaffinity(0))
            argv = [STRESS_NG, "--cpu", str(len(cpus)), "--cpu-load", str(self.cpu_load)]
            argv += ["--taskset", ",".join(map(str, cpus)), "--timeout", f"{TIMEOUT_S}s", "--quiet"]
            self._process = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL)
            atexit.register(self.stop)  # while it runs only: a finished instance is not kept alive by atexit

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.stop()

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the stressors are its children, in its process group
        except ProcessLookupError:
            pass
        process.wait(timeout=10)
