"""Kineto traces (``torch.profiler``) of chosen training steps, written where torch-tb-profiler and HTA look.

The contract: ``StepProfiler(steps, out_dir, worker_name, cuda)`` profiles exactly the global steps in ``steps``
and nothing else. The caller says when a step begins (``begin(step)``, at the batch start) and ends (``end()``,
at the batch end); each contiguous run of profiled steps becomes one ``<worker_name>.<time_ns>.pt.trace.json``
in ``out_dir`` (``torch.profiler.tensorboard_trace_handler``'s layout, one worker name per rank), with every
step marked ``ProfilerStep#<global step>`` by ``profile.step()``. ``close()`` stops a profiler still running
(the fit ended or failed inside a run) and saves what it recorded; afterwards nothing of ``torch.profiler`` is
left running.

Why a module of its own: ``torch.profiler.profile`` is a state machine (schedule actions, step markers, the
trace handler) whose details have nothing to do with MegaScan's span recording; the callback only forwards
batch boundaries here. Why one profiler per run of steps rather than one per fit with a schedule: the profiler
then exists only while it records, and ``profile_steps`` can be any list (``[2, 3, 40]``), not only a periodic
pattern that ``torch.profiler.schedule`` can express.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import torch

__all__ = ["PROFILE_OPTIONS", "StepProfiler"]

# What users may pass on to ``torch.profiler.profile`` (all off by default: they cost time and trace size).
PROFILE_OPTIONS = frozenset({"record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules"})


class StepProfiler:
    """Profile the global steps ``steps`` of this rank into ``out_dir`` as ``worker_name``.

    ``cuda`` adds CUDA activity (kernels, memcpy) to the CPU activity; ``options`` are ``PROFILE_OPTIONS``
    for ``torch.profiler.profile``; ``gzip`` writes ``.pt.trace.json.gz``."""

    def __init__(
        self,
        steps: Iterable[int],
        out_dir: Path,
        worker_name: str,
        cuda: bool = False,
        options: Optional[dict[str, bool]] = None,
        gzip: bool = False,
    ) -> None:
        self.steps = frozenset(steps)
        self.out_dir, self.worker_name, self.cuda, self.gzip = Path(out_dir), worker_name, cuda, gzip
        self.options = dict(options or {})
        self._profiler: Optional[torch.profiler.profile] = None
        self._exit = ExitStack()
        self._step: Optional[int] = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def begin(self, step: int) -> None:
        """Global step ``step`` starts: start a run of profiled steps, mark the next step of a run, or pass."""
        self._step = step
        if step not in self.steps:
            self.close()  # a run cut short (a skipped step): save it rather than profile unrequested steps
            return
        if self._profiler is not None:
            self._profiler.step()  # closes ProfilerStep#<step - 1>, opens ProfilerStep#<step>
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            # Any schedule makes the profiler record ``ProfilerStep#N`` markers (which tb-profiler and HTA split
            # steps by); a constant RECORD keeps it recording until ``stop()``, which saves through the handler.
            schedule=lambda _: torch.profiler.ProfilerAction.RECORD,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.out_dir), self.worker_name, self.gzip),
            **self.options,
        )
        profiler.step_num = step  # the markers count global steps, not the profiler's own
        self._exit = ExitStack()  # the context manager's exit also releases what start() registered
        self._exit.enter_context(profiler)
        self._profiler = profiler

    def end(self) -> None:
        """The step of the last ``begin`` ends: save the run if the next step is not profiled."""
        if self._step is not None and self._step + 1 not in self.steps:
            self.close()

    def close(self) -> None:
        """Stop the profiler if it runs, saving what it recorded; never raises (it runs on error paths too)."""
        if self._profiler is None:
            return
        self._profiler = None
        try:
            self._exit.close()
        except Exception as err:  # noqa: BLE001  (a failed export must not hide the error that ended the fit)
            warnings.warn(f"MegaScan: the Kineto trace of {self.worker_name} was not saved: {err}", stacklevel=2)
