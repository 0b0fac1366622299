"""Fault sources this project did not build, for ``megascan_eval.py``: MegaScan's detector was designed against
``scan.evaluation.faults`` and ``scan.evaluation.inject``, so an evaluation only against those proves little.

* ``StressNg``: `stress-ng <https://github.com/ColinIanKing/stress-ng>`_ (Debian: ``apt-get install stress-ng``),
  the stress tool kernel and hardware people use, run on the CPUs the rank's process may use (its affinity set)
  from a given step on. Its ``--cpu`` stressors cycle through integer, floating-point and bit-twiddling methods
  and touch memory, unlike our own spinning loop (``CompetingProcess(kind="cpu")``).

* ``CpuQuota``: the kernel's CFS bandwidth control on the rank's process, what a container's CPU limit is
  (Kubernetes ``resources.limits.cpu``, ``docker run --cpus``): the process runs at full speed until it has used
  ``cpus`` x ``period`` of CPU time in a period, then nothing runs until the next one. A known cause of stragglers
  in pods: not a competitor (nothing else runs), not a slower CPU, but pauses at the kernel's rhythm.

Nothing is left behind: stress-ng runs in its own process group, is killed with it at fit end, at teardown and at
interpreter exit, and carries its own ``--timeout`` in case all of those are skipped (``kill -9`` of the rank).
The quota's cgroup is left and removed at the same moments; one whose process was killed (``kill -9``) is removed
by the next ``CpuQuota`` that starts on the machine.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl

STRESS_NG = "stress-ng"
TIMEOUT_S = 900  # the tool's own limit: longer than any fit of the evaluation


def stress_ng_available() -> bool:
    return shutil.which(STRESS_NG) is not None


class _FromStepUntilFitEnd(pl.Callback):
    """A fault on rank ``rank`` from global step ``start_step`` until fit end, exception, teardown or interpreter
    exit, whichever comes first: subclasses say how it starts (``_start``) and stops (``_stop``)."""

    def __init__(self, rank: int, start_step: int) -> None:
        self.rank, self.start_step, self.active = rank, start_step, False

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active and trainer.global_rank == self.rank and trainer.global_step >= self.start_step:
            self._start()
            self.active = True
            atexit.register(self.stop)  # while it acts only: a finished instance is not kept alive by atexit

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            atexit.unregister(self.stop)
            self._stop()

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError


class StressNg(_FromStepUntilFitEnd):
    """``stress-ng --cpu N --taskset CPUS`` on rank ``rank``'s CPUs from global step ``start_step`` until fit end
    (``N``: one stressor per CPU of the set, ``cpu_load`` percent busy each)."""

    def __init__(self, rank: int, start_step: int = 0, cpu_load: int = 100) -> None:
        if not stress_ng_available():
            raise RuntimeError(
                f"StressNg needs the {STRESS_NG} tool on PATH (Debian/Ubuntu: apt-get install stress-ng)"
            )
        if not 1 <= cpu_load <= 100:
            raise ValueError(f"StressNg(cpu_load={cpu_load}): a percentage from 1 to 100")
        super().__init__(rank, start_step)
        self.cpu_load = cpu_load
        self._process: Optional[subprocess.Popen] = None

    def _start(self) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        argv = [STRESS_NG, "--cpu", str(len(cpus)), "--cpu-load", str(self.cpu_load)]
        argv += ["--taskset", ",".join(map(str, cpus)), "--timeout", f"{TIMEOUT_S}s", "--quiet"]
        self._process = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL)

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the stressors are its children, in its process group
        except ProcessLookupError:
            pass
        process.wait(timeout=10)


def _cpu_cgroup() -> Optional[tuple[Path, str]]:
    """The cgroup directory that holds this process for the CPU controller, and the hierarchy's version
    (``"v1"``: a ``cpu`` hierarchy with ``cpu.cfs_quota_us``; ``"v2"``: ``cpu.max``), or ``None``."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            for mount in (Path("/sys/fs/cgroup") / controllers, Path("/sys/fs/cgroup/cpu")):
                if (mount / "cpu.cfs_quota_us").exists():
                    return mount / path.lstrip("/"), "v1"
    for line in lines:
        if line.startswith("0::"):
            here = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            if "cpu" in (Path("/sys/fs/cgroup") / "cgroup.controllers").read_text(errors="ignore").split():
                return here, "v2"
    return None


def cpu_quota_available() -> bool:
    """Whether this process may make a cgroup with a CPU limit and move itself into it (root, a writable
    hierarchy with the CPU controller)."""
    found = _cpu_cgroup()
    if found is None:
        return False
    probe = found[0] / f"lightning-megatron-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        return False
    quota_file = "cpu.cfs_quota_us" if found[1] == "v1" else "cpu.max"
    usable = (probe / quota_file).exists() and os.access(probe / "cgroup.procs", os.W_OK)
    probe.rmdir()
    return usable


_QUOTA_PREFIX = "lightning-megatron-quota-"


class CpuQuota(_FromStepUntilFitEnd):
    """Rank ``rank``'s process under a CPU limit of ``cpus`` CPUs per ``period_ms`` (CFS bandwidth control) from
    global step ``start_step`` until fit end: a cgroup of its own, the process (all its threads) moved in, and
    moved back out and the cgroup removed at the end."""

    def __init__(self, rank: int, start_step: int = 0, cpus: float = 0.5, period_ms: float = 100.0) -> None:
        if not cpus > 0:
            raise ValueError(f"CpuQuota(cpus={cpus}): a positive number of CPUs (0.5: half of one)")
        if not 1.0 <= period_ms <= 1000.0:
            raise ValueError(f"CpuQuota(period_ms={period_ms}): the kernel takes 1 ms to 1 s")
        if not cpu_quota_available():
            raise RuntimeError(
                "CpuQuota needs a writable cgroup hierarchy with the CPU controller (root, /sys/fs/cgroup "
                "mounted read-write); run as root or leave the cpu-quota case out"
            )
        super().__init__(rank, start_step)
        self.cpus, self.period_us = cpus, int(period_ms * 1000)
        self.cgroup: Optional[Path] = None
        self._home: Optional[Path] = None

    def _start(self) -> None:
        home, version = _cpu_cgroup()  # type: ignore[misc]  (checked in __init__)
        for stale in home.glob(f"{_QUOTA_PREFIX}*"):  # left by killed processes
            pid = stale.name[len(_QUOTA_PREFIX) :]
            if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
                _empty_and_remove(stale, home)
        cgroup = home / f"{_QUOTA_PREFIX}{os.getpid()}"
        if cgroup.exists():
            _empty_and_remove(cgroup, home)
        cgroup.mkdir()
        quota_us = max(1000, int(self.cpus * self.period_us))
        if version == "v1":
            (cgroup / "cpu.cfs_period_us").write_text(str(self.period_us))
            (cgroup / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (cgroup / "cpu.max").write_text(f"{quota_us} {self.period_us}")
        self.cgroup, self._home = cgroup, home
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))  # every thread of the process moves with it

    def _stop(self) -> None:
        cgroup, home, self.cgroup = self.cgroup, self._home, None
        if cgroup is not None and home is not None:
            _empty_and_remove(cgroup, home)

    def throttled(self) -> Optional[dict[str, int]]:
        """The cgroup's ``cpu.stat`` while it acts (``nr_throttled``: periods in which the limit stopped it)."""
        if self.cgroup is None:
            return None
        return {k: int(v) for k, v in (line.split() for line in (self.cgroup / "cpu.stat").read_text().splitlines())}


def _empty_and_remove(cgroup: Path, home: Path) -> None:
    """Move every process of ``cgroup`` (the rank, and children it forked inside) back to ``home``, then remove it."""
    try:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            try:
                (home / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass
        cgroup.rmdir()
    except FileNotFoundError:  # removed meanwhile (another rank's CpuQuota cleaning up)
        pass
