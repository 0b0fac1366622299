"""GPU busy time per span: how long the GPU ran this process's kernels between a span's two CUDA events.

The contract: the GPU activity records of one traced window (``Activity``: kernels, copies and memsets on the
profiler's clock) and the window's length on the CUDA-event clock in; a ``BusyTimeline`` out that answers "how
many µs of ``[start, end]`` (µs after the window's reference event) was the GPU busy" for every span. On GPUs
``KernelActivity`` collects the records with a CUDA-only ``torch.profiler`` session (Kineto/CUPTI; no CPU ops,
shapes or stacks) that runs only during the traced windows MegaScan samples; the pure functions below do the
rest, and ``scan.evaluation.synthetic`` feeds them simulated kernels, so the CPU tests run the same matching.

Why: a span is GPU wall time between two events. A host that sleeps between launches (CPU contention, Python)
stretches it with gaps in which the GPU idles; a slower GPU, or one that another process time-slices *inside*
the kernels, stretches the kernels themselves. The union of kernel intervals inside a span separates the two;
``scan.analysis.attribution.attribute_busy`` names ``compute`` only where this busy time grew.

What counts as busy: this process's kernels, memcpys and memsets, on any stream (overlaps counted once), except
communication kernels (NCCL: they spin while waiting for a peer, so their length says who was late, not how fast
this GPU is) and the two anchor kernels below. Another process's kernels are never in the records (CUPTI traces
one process): time they take from this process shows up as longer kernels or as gaps.

**Clock alignment.** CUDA events time spans on the GPU (``elapsed_time`` against the window's reference event);
Kineto reports activity on its own clock (CUPTI converts GPU timestamps to a host time base; which one depends on
the torch version). Neither absolute clock is needed: right after the window's first ``synchronize`` (nothing in
flight) the session starts and an anchor kernel (``torch.cuda._sleep``, a few hundred cycles) is launched right
before the reference event; at the window's end an event is recorded and a second anchor launched right after
it, on the same stream. The first anchor's *end* is the reference event's time, the second's *start* the end
event's time (each within the µs the GPU takes between two queued commands). That holds only if the host
queues the reference event before the first anchor ends; but the GPU, idle after the synchronize, starts the
anchor as soon as it is launched, while CUPTI can hold the host inside that launch for a few hundred µs (windows
were off by that much). So the first anchor spins ~0.5 ms, longer than that; at the end a spin of
the same length (``hold``, right before the end event: after every span, so in none of them) keeps the end
event and the second anchor queued together when the GPU has caught up with the host. A linear map through
these two points puts every record on the span clock and corrects any rate difference between the two clocks. How far
the anchors' distance and the events' distance differ (``Alignment.error_us``: the rate difference plus the
different latencies at the two ends) bounds how far the map can be off; a window whose anchors are missing, out
of order or differ by more than ``MAX_ALIGN_ERROR_US`` (or 0.1 % of the window) gets no busy time rather than a
wrong one.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_megatron.compat.cupti_teardown import detach_cupti_after_sessions

__all__ = [
    "ANCHOR_NAME",
    "Activity",
    "Alignment",
    "BusyTimeline",
    "KernelActivity",
    "MAX_ALIGN_ERROR_US",
    "align",
    "busy_timeline",
    "is_busy",
]

ANCHOR_NAME = "spin_kernel"  # torch.cuda._sleep's kernel (at::cuda::(anonymous namespace)::spin_kernel(long))
ANCHOR_CYCLES = 200  # a fraction of a µs on any recent GPU
FIRST_ANCHOR_CYCLES = 1_000_000  # ~0.5 ms: see "Clock alignment"
MAX_ALIGN_ERROR_US = 50.0
_CAPTURE_MARGIN_S = 200e-6  # twice per sampled window, outside the traced steps' spans
_COMMUNICATION = ("nccl",)  # kernel name prefixes (lower case) of communication kernels
_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")  # Kineto's activity types that occupy the GPU


@dataclass(frozen=True)
class Activity:
    """One GPU activity record on the profiler's clock (ns)."""

    name: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Alignment:
    """The map from the profiler's clock (ns) to the span clock (µs after the reference event)."""

    origin_ns: float  # the first anchor's end: span clock 0
    scale: float  # span-clock µs per profiler ns (1e-3 when both clocks run at the same rate)
    error_us: float  # |anchors' distance - events' distance|, on the span clock

    def to_span_us(self, ns: float) -> float:
        return (ns - self.origin_ns) * self.scale


def is_busy(name: str) -> bool:
    """Whether an activity's time is this GPU working (not a communication kernel waiting for peers)."""
    return not name.lower().startswith(_COMMUNICATION)


def _anchors(activities: Sequence[Activity]) -> Optional[tuple[int, int]]:
    """Indices (in ``activities``, sorted by start) of the window's first and last anchor: the first must be the
    first record of all (nothing ran before it: the window began with a synchronize), the last must be another."""
    marked = [i for i, a in enumerate(activities) if ANCHOR_NAME in a.name]
    if len(marked) < 2 or marked[0] != 0:
        return None
    return marked[0], marked[-1]


def align(activities: Sequence[Activity], window_us: float) -> tuple[Optional[Alignment], str]:
    """The alignment of a window's records (sorted by start) whose end event is ``window_us`` after its reference
    event; ``(None, why)`` when the anchors cannot be found or disagree (see the module docstring)."""
    found = _anchors(activities)
    if found is None:
        return None, "the window's anchor kernels are not in the profiler's records"
    first, last = activities[found[0]], activities[found[1]]
    distance_ns = last.start_ns - first.end_ns
    if distance_ns <= 0 or window_us <= 0:
        return None, f"anchor kernels out of order ({distance_ns} ns apart for a {window_us:.0f} µs window)"
    scale = window_us / distance_ns
    error_us = abs(distance_ns / 1000.0 - window_us)
    if error_us > max(MAX_ALIGN_ERROR_US, 1e-3 * window_us):
        return None, f"anchor kernels {distance_ns / 1000:.0f} µs apart, events {window_us:.0f} µs: clocks disagree"
    return Alignment(float(first.end_ns), scale, error_us), ""


class BusyTimeline:
    """The union of busy intervals on the span clock; ``busy(start, end)`` in O(log n)."""

    def __init__(self, intervals: Iterable[tuple[float, float]], error_us: float = 0.0) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        for start, end in sorted(intervals):
            if end <= start:
                continue
            if self.starts and start <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], end)
            else:
                self.starts.append(start)
                self.ends.append(end)
        self._before: list[float] = [0.0]  # busy time before the i-th interval starts
        for start, end in zip(self.starts, self.ends):
            self._before.append(self._before[-1] + end - start)
        self.error_us = error_us

    def _until(self, t: float) -> float:
        """Busy time in ``(-inf, t]``."""
        i = bisect.bisect_right(self.starts, t)
        if i == 0:
            return 0.0
        return self._before[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def busy(self, start: float, end: float) -> float:
        """µs of ``[start, end]`` in which the GPU was busy."""
        return max(self._until(end) - self._until(start), 0.0) if end > start else 0.0

    @property
    def total(self) -> float:
        return self._before[-1]


def busy_timeline(activities: Iterable[Activity], window_us: float) -> tuple[Optional[BusyTimeline], str]:
    """A window's records (any order) → its ``BusyTimeline`` on the span clock, or ``(None, why)``.

    The anchors are found and taken out, communication kernels left out, and every other record mapped through
    ``align``; the timeline's ``error_us`` is the alignment's."""
    ordered = sorted(activities, key=lambda a: (a.start_ns, a.end_ns))
    alignment, why = align(ordered, window_us)
    if alignment is None:
        return None, why
    first, last = _anchors(ordered)  # type: ignore[misc]
    intervals = [
        (alignment.to_span_us(a.start_ns), alignment.to_span_us(a.end_ns))
        for i, a in enumerate(ordered)
        if i not in (first, last) and is_busy(a.name)
    ]
    return BusyTimeline(intervals, alignment.error_us), ""


def _clear_of_the_capture_window() -> None:
    """Wait ``_CAPTURE_MARGIN_S`` on the host. Kineto drops GPU records outside its capture window (host times of
    start and stop, compared with GPU times converted to the host's clock): a margin keeps an anchor that ran
    right after the start, or right before the stop, inside it whatever the conversion's error."""
    time.sleep(_CAPTURE_MARGIN_S)


class KernelActivity:
    """A CUDA-only ``torch.profiler`` session over one traced window (CUDA builds of torch only).

    ``start()`` after the window's synchronize, ``anchor()`` right before its reference event, ``hold()`` right
    before its end event and ``anchor()`` right after it, ``stop()`` after the final synchronize: the GPU activity
    records of the window. A session never nests in another one (``Trainer(profiler="pytorch")``, ``MegaScan(profile_steps=...)``, a user's): ``start``
    returns False while another runs, and the window goes without busy time. Each session ends by detaching CUPTI
    (``compat/cupti_teardown.py``): left attached, it slowed every later kernel launch of the fit."""

    def __init__(self) -> None:
        self._session: Any = None
        self._anchored = False

    @staticmethod
    def available() -> bool:
        import torch

        return (
            torch.cuda.is_available() and torch.profiler.ProfilerActivity.CUDA in torch.profiler.supported_activities()
        )

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> bool:
        import torch

        if self._session is not None or torch.autograd._profiler_enabled():
            return False
        detach_cupti_after_sessions()  # or every launch after the session pays for CUPTI's callbacks
        session = torch.autograd.profiler.profile(use_cpu=False, use_device="cuda", use_kineto=True)
        session.__enter__()
        self._session, self._anchored = session, False
        _clear_of_the_capture_window()
        return True

    def anchor(self) -> None:
        """Launch an anchor kernel; the session's first one spins long enough for the reference event to queue."""
        import torch

        torch.cuda._sleep(ANCHOR_CYCLES if self._anchored else FIRST_ANCHOR_CYCLES)
        self._anchored = True

    @staticmethod
    def hold() -> None:
        """Keep the GPU busy while the host queues the window's end event and last anchor (see the docstring)."""
        import torch

        torch.cuda._sleep(FIRST_ANCHOR_CYCLES)

    def stop(self) -> list[Activity]:
        """End the session (it synchronizes) and return its GPU activity records."""
        import torch

        session, self._session = self._session, None
        if session is None:
            return []
        _clear_of_the_capture_window()
        session.__exit__(None, None, None)
        results = session.kineto_results
        if results is None:
            return []
        records = []
        for event in results.events():
            if event.device_type() == torch.autograd.DeviceType.CPU:
                continue  # the CUDA runtime calls CUPTI records on the host
            kind = event.activity_type() if hasattr(event, "activity_type") else "kernel"
            if kind.lower() in _KINDS:
                records.append(Activity(event.name(), event.start_ns(), event.end_ns()))
        return records

    def close(self) -> None:
        """Stop a session still running (the fit failed inside a window); never raises."""
        if self._session is None:
            return
        try:
            self.stop()
        except Exception:  # noqa: BLE001  (an error path: the error that ended the fit matters, not this one)
            self._session = None
