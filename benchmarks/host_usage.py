"""What a rank's host did during a fit: how fast its CPU ran a fixed piece of Python after each step (the probe),
the main thread's CPU time per step against the step's wall time, the CPUs it ran on, how often it was preempted,
and the machine's steal time (a virtual machine's CPUs taken by the hypervisor).

Why: on a host-bound job, a rank whose Python runs slower holds the other ranks back, and MegaScan names it
``host``. In a clean run nothing was injected, so the evaluation has to tell whether that rank's host really was
slower (the probe: the same fixed work took longer on its CPU) or was kept off its CPU (preemption, steal), and
on which CPUs. The main thread's CPU time alone cannot say it: the backward pass runs on autograd's own thread,
and a rank that waits for its peer spins in ``synchronize`` (CPU time without work). Linux only (``/proc``);
elsewhere every field is ``None``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl

__all__ = ["HostUsage"]


def _thread_stat() -> tuple[Optional[int], Optional[int]]:
    """(the CPU the calling thread last ran on, its involuntary context switches so far)."""
    try:
        fields = Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()
        cpu = int(fields[36])  # field 39 of stat(5), counted after the ")" that ends the command name
        status = Path("/proc/thread-self/status").read_text()
        switches = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        return cpu, switches
    except (OSError, IndexError, ValueError):
        return None, None


def _probe_ms() -> float:
    """Wall ms of a fixed piece of pure-Python work (about 0.2 ms on a 2020s server core): how fast this thread's
    CPU runs Python now, independent of the GPU and of MegaScan's spans. It runs between two steps, inside
    MegaScan's ``host-gap``, so it is kept short: three 20,000-iteration probes (4.5-5.5 ms on a 2 x H200 VM)
    lengthened every gap sixfold, and one rank's slower probes alone were named ``host`` once (2.2 ms a step)."""
    started = time.perf_counter()
    total = 0
    for i in range(5_000):
        total += i * i
    return 1000 * (time.perf_counter() - started)


def _steal_ticks() -> Optional[int]:
    """The machine's steal time so far, in clock ticks (``/proc/stat``, all CPUs)."""
    try:
        return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])
    except (OSError, IndexError, ValueError):
        return None


class HostUsage(pl.Callback):
    """Per step, on this rank: main-thread CPU ms, wall ms, the CPU at step end, involuntary switches, and a fixed
    CPU probe timed after the step; read with ``summary()`` after the fit."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._mark: Optional[tuple[float, float, Optional[int]]] = None
        self._steal: Optional[int] = None

    def on_train_start(self, *args: Any) -> None:
        self._steal = _steal_ticks()

    def on_train_batch_start(self, *args: Any) -> None:
        self._mark = (time.thread_time(), time.perf_counter(), _thread_stat()[1])

    def on_train_batch_end(self, *args: Any) -> None:
        if self._mark is None:
            return
        cpu_s, wall_s, switches = self._mark
        cpu, now_switches = _thread_stat()
        self.steps.append(
            {
                "probe_ms": _probe_ms(),
                "cpu_ms": 1000 * (time.thread_time() - cpu_s),
                "wall_ms": 1000 * (time.perf_counter() - wall_s),
                "cpu": cpu,
                "preempted": None if switches is None or now_switches is None else now_switches - switches,
            }
        )

    def summary(self, skip: int = 2) -> dict[str, Any]:
        """Medians over the steps after the first ``skip`` (MegaScan's untraced ones), the CPUs seen, and the
        machine's steal seconds during the fit."""
        steps = self.steps[skip:] or self.steps
        steal = _steal_ticks()
        return {
            "probe_ms": round(statistics.median(s["probe_ms"] for s in steps), 3) if steps else None,
            "probe_ms_by_step": [round(s["probe_ms"], 3) for s in steps],
            "main_thread_cpu_ms": round(statistics.median(s["cpu_ms"] for s in steps), 2) if steps else None,
            "step_wall_ms": round(statistics.median(s["wall_ms"] for s in steps), 2) if steps else None,
            "preempted_per_step": statistics.median(s["preempted"] or 0 for s in steps) if steps else None,
            "cpus": sorted({s["cpu"] for s in steps if s["cpu"] is not None}),
            "machine_steal_s": None
            if steal is None or self._steal is None
            else (steal - self._steal) / os.sysconf("SC_CLK_TCK"),
        }
