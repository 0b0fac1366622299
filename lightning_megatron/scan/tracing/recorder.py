"""Span timing for one traced window: CUDA events from a preallocated pool on GPUs, the host clock on CPUs.

On a GPU the host runs ahead of the device, so a host timestamp says when work was *queued*, not when it
ran. Each span therefore records a CUDA event at its start and end on the current stream (no
synchronisation: recording an event is asynchronous) and the events are read only after the window, when
one ``synchronize`` resolves them all. Event objects come from a pool created before the window, so the
hot path allocates nothing. GPU times are mapped onto the host clock through a reference event recorded
right after a synchronisation at the window start (the one sync per window, outside the traced steps'
work).

A GPU span also keeps the host time of its two records, written as ``args.enqueue_us`` (how long the host took
to queue the span's work) and ``args.queued_us`` (how long after the host queued the span's start the GPU
reached it). A GPU that is the bottleneck runs behind a full queue (``queued_us`` large); a GPU starved by a
slow host reaches each span as soon as it is queued (``queued_us`` near 0) and its spans last as long as the
host takes to enqueue them: such a span is paced by the host, not by the GPU (``scan.analysis.compute_rules``).

With a ``KernelActivity`` (``scan.tracing.busy``) a window can also measure GPU busy time: ``begin_window(busy=True)``
starts its CUDA-only profiler session after the window's synchronize and launches the first anchor kernel right
before the reference event; ``end_window`` records an end event, launches the second anchor, and writes
``args.busy_us`` (the union of this process's non-communication kernels between the span's two events) on every
GPU span, and ``args.busy_align_us`` (the alignment's residual) on step spans. A window without it, or whose
anchors do not align, writes neither (CPUs never do).

A step replayed as a CUDA graph (``strategy.graphs``) runs no Python, so no span opens during it. Its spans are
opened once, while the step is captured (``begin_capture`` … ``end_capture``): their events come from a pool of
``external`` events, which a capture turns into graph nodes that every replay records again. Those spans are the
step's *template*; ``replayed`` adds a copy of it to the window after each traced replay, with ``args.graph``
set and without the enqueue fields (the whole step is one launch, so the host paces none of its spans). The next
replay overwrites the events, so ``before_replay`` first waits for the last of them and turns the copies into
host times.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_megatron.scan.analysis.format import complete
from lightning_megatron.scan.tracing.busy import BusyTimeline, KernelActivity, busy_timeline
from lightning_megatron.scan.tracing.clock import now_us

__all__ = ["SpanRecorder", "Span"]

_BUSY_TRIES = 3  # windows without busy time, none with, before the recorder stops trying


@dataclass
class Span:
    name: str
    cat: str
    tid: int
    args: dict[str, Any] = field(default_factory=dict)
    start: Any = None  # host µs (float) or a CUDA event
    end: Any = None
    host: bool = False  # timed on the host clock even on GPUs (data waiting, for example)
    enqueued: Optional[float] = None  # GPU spans: host µs when the start event was recorded
    enqueue_end: Optional[float] = None  # ... and the end event


class SpanRecorder:
    """Collects spans between ``begin_window`` and ``end_window`` and turns them into trace events."""

    def __init__(self, rank: int, use_cuda: bool, pool_size: int = 4096, busy: Optional[KernelActivity] = None) -> None:
        self.rank = rank
        self.use_cuda = use_cuda
        self.busy = busy if use_cuda else None
        self.busy_windows = 0  # windows that got busy time
        self.busy_failures = 0  # windows that tried and did not
        self.busy_failure = ""  # why the last one did not
        self._busy_on = False
        self.active = False
        self._spans: list[Span] = []
        self._pool: list[Any] = []
        self._used = 0
        self._grow(pool_size if use_cuda else 0)
        self._ref_event: Any = None
        self._ref_host = 0.0
        self._graph_pool: list[Any] = []  # external events: recorded by a CUDA graph's replays
        self._graph_used = 0
        self._capturing = False
        self._graph_short = False
        self._active_before_capture = False
        self._template: list[Span] = []  # the spans of the captured step (see the module's docstring)
        self._unresolved: list[Span] = []  # copies of the template whose events the next replay overwrites

    def _grow(self, count: int) -> None:
        self._pool += [torch.cuda.Event(enable_timing=True) for _ in range(count)]

    def _stamp(self, host: bool) -> Any:
        if not self.use_cuda or host:
            return now_us()
        if self._capturing:
            if self._graph_used == len(self._graph_pool):
                self._graph_short = True  # creating an event inside a capture is not allowed: the span is left out
                return None
            event = self._graph_pool[self._graph_used]
            self._graph_used += 1
            event.record()
            return event
        if self._used == len(self._pool):
            # Grows the pool for this and later windows; allocating here is slower but still sync-free.
            warnings.warn(f"MegaScan: CUDA event pool of {len(self._pool)} exhausted; growing it", stacklevel=3)
            self._grow(max(len(self._pool), 256))
        event = self._pool[self._used]
        self._used += 1
        event.record()
        return event

    # -- window ------------------------------------------------------------------------------------
    def begin_window(self, busy: bool = False) -> None:
        """Start a window; ``busy``: also measure GPU busy time in it (GPUs with a ``KernelActivity`` only)."""
        self._spans = []
        self._used = 0
        if self.use_cuda:
            torch.cuda.synchronize()
            # after the synchronize, so that the first record of the session is the anchor (scan.tracing.busy)
            self._busy_on = busy and self._start_busy()
            self._ref_host = now_us()
            self._ref_event = self._stamp(host=False)
        self.active = True

    def end_window(self) -> list[dict[str, Any]]:
        """Resolve every span of the window into complete trace events (sorted by start time)."""
        self.active = False
        self._unresolved = []  # resolved below, after the synchronize
        timeline = None
        if self.use_cuda:
            end_event = None
            if self._busy_on:
                self.busy.hold()
                end_event = self._stamp(host=False)
                self.busy.anchor()
            torch.cuda.synchronize()
            if self._busy_on:
                timeline = self._busy_timeline(end_event)
        events = []
        for span in self._spans:
            if span.end is None:
                continue  # opened but never closed (an exception unwound the step)
            start, end = self._host_time(span.start), self._host_time(span.end)
            args = dict(span.args)
            if span.enqueued is not None and span.enqueue_end is not None:
                args["enqueue_us"] = round(span.enqueue_end - span.enqueued, 1)
                args["queued_us"] = round(start - span.enqueued, 1)
            if timeline is not None and not span.host:
                args["busy_us"] = round(timeline.busy(start - self._ref_host, end - self._ref_host), 1)
                if span.cat == "step":
                    args["busy_align_us"] = round(timeline.error_us, 1)
            events.append(complete(span.name, span.cat, self.rank, span.tid, start, max(end - start, 0.0), args))
        events.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
        self._spans = []
        return events

    def _start_busy(self) -> bool:
        """Start the window's profiler session and its first anchor; False when it cannot run (another session)."""
        if self.busy is None:
            return False
        try:
            if not self.busy.start():
                return False
            self.busy.anchor()
        except Exception as err:  # noqa: BLE001  (busy time is an extra: a profiler failure must not end the fit)
            self.busy.close()
            self._busy_failed(f"the profiler did not start: {err}")
            return False
        return True

    def _busy_timeline(self, end_event: Any) -> Optional[BusyTimeline]:
        """Stop the window's profiler session and turn its records into a timeline on the span clock."""
        self._busy_on = False
        try:
            records = self.busy.stop()
            timeline, why = busy_timeline(records, self._ref_event.elapsed_time(end_event) * 1000.0)
        except Exception as err:  # noqa: BLE001
            timeline, why = None, f"the profiler failed: {err}"
        if timeline is None:
            self._busy_failed(why)
        else:
            self.busy_windows += 1
        return timeline

    def _busy_failed(self, why: str) -> None:
        """Warn once; after ``_BUSY_TRIES`` failures without a success, stop trying (each try costs time)."""
        if not self.busy_failures:
            warnings.warn(f"MegaScan: no GPU busy time for a traced window: {why}", stacklevel=4)
        self.busy_failures += 1
        self.busy_failure = why
        if self.busy_failures >= _BUSY_TRIES and not self.busy_windows:
            warnings.warn(f"MegaScan: GPU busy time turned off after {self.busy_failures} failed windows", stacklevel=4)
            self.busy = None

    def shutdown(self) -> None:
        """Leave no profiler session running (a fit that ended inside a window); never raises."""
        self.active = False
        self._busy_on = False
        if self.busy is not None:
            self.busy.close()

    # -- a step replayed as a CUDA graph ---------------------------------------------------------------
    def begin_capture(self) -> None:
        """The step now running is being captured: the spans opened until ``end_capture`` are its template.
        Called before the capture starts, so that the pool's events can be created (recorded once) here."""
        if not self.use_cuda:
            return
        missing = max(len(self._pool), 2 * len(self._template)) - len(self._graph_pool)
        for _ in range(max(missing, 0)):
            event = torch.cuda.Event(enable_timing=True, external=True)
            event.record()  # creates the CUDA event now: not allowed inside the capture
            self._graph_pool.append(event)
        self._template, self._unresolved = [], []
        self._graph_used, self._graph_short = 0, False
        self._active_before_capture, self.active, self._capturing = self.active, True, True

    def end_capture(self) -> None:
        """The capture ended (or failed): back to the window's own spans."""
        if not self._capturing:
            return
        self._capturing = False
        self.active = self._active_before_capture
        if self._graph_short:
            warnings.warn(
                f"MegaScan: the captured step opened more spans than its {len(self._graph_pool)} graph events; the "
                "rest are not traced in replayed steps (the next capture makes twice as many)",
                stacklevel=3,
            )

    def before_replay(self) -> None:
        """The next replay overwrites the template's events: turn the last replay's copies into host times."""
        if not self._unresolved:
            return
        for event in reversed(self._graph_pool[: self._graph_used]):  # the last first: then the rest are done
            event.synchronize()
        for span in self._unresolved:
            span.start, span.end = self._host_time(span.start), self._host_time(span.end)
        self._unresolved = []

    def replayed(self, args: dict[str, Any]) -> None:
        """The captured step was just replayed in a traced window: add the template's spans, with ``args``."""
        if not self.active or self._capturing:
            return
        for span in self._template:
            if span.start is None or span.end is None:
                continue
            copy = Span(span.name, span.cat, span.tid, {**span.args, **args, "graph": True}, span.start, span.end)
            self._spans.append(copy)
            self._unresolved.append(copy)

    def _host_time(self, stamp: Any) -> float:
        if isinstance(stamp, float):
            return stamp
        return self._ref_host + self._ref_event.elapsed_time(stamp) * 1000.0

    # -- spans -------------------------------------------------------------------------------------
    def open(self, name: str, cat: str, tid: int, args: Optional[dict[str, Any]] = None, host: bool = False) -> Span:
        span = Span(name, cat, tid, dict(args or {}), host=host)
        span.start = self._stamp(host)
        if self._capturing and not host:
            self._template.append(span)  # no enqueue times: the replays queue the whole step at once
            return span
        if self.use_cuda and not host:
            span.enqueued = now_us()
        self._spans.append(span)
        return span

    def close(self, span: Span) -> None:
        span.end = self._stamp(span.host)
        if span.enqueued is not None:
            span.enqueue_end = now_us()

    def add(self, name: str, cat: str, tid: int, start_us: float, end_us: float, args: dict[str, Any]) -> None:
        """A span measured elsewhere on the host clock (for example the data wait before a step)."""
        self._spans.append(Span(name, cat, tid, args, start=start_us, end=end_us, host=True))
