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
host takes to enqueue them: such a span is paced by the host, not by the GPU (``scan.compute_rules``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_megatron.scan.clock import now_us
from lightning_megatron.scan.format import complete

__all__ = ["SpanRecorder", "Span"]


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

    def __init__(self, rank: int, use_cuda: bool, pool_size: int = 4096) -> None:
        self.rank = rank
        self.use_cuda = use_cuda
        self.active = False
        self._spans: list[Span] = []
        self._pool: list[Any] = []
        self._used = 0
        self._grow(pool_size if use_cuda else 0)
        self._ref_event: Any = None
        self._ref_host = 0.0

    def _grow(self, count: int) -> None:
        self._pool += [torch.cuda.Event(enable_timing=True) for _ in range(count)]

    def _stamp(self, host: bool) -> Any:
        if not self.use_cuda or host:
            return now_us()
        if self._used == len(self._pool):
            # Grows the pool for this and later windows; allocating here is slower but still sync-free.
            warnings.warn(f"MegaScan: CUDA event pool of {len(self._pool)} exhausted; growing it", stacklevel=3)
            self._grow(max(len(self._pool), 256))
        event = self._pool[self._used]
        self._used += 1
        event.record()
        return event

    # -- window ------------------------------------------------------------------------------------
    def begin_window(self) -> None:
        self._spans = []
        self._used = 0
        if self.use_cuda:
            torch.cuda.synchronize()
            self._ref_host = now_us()
            self._ref_event = self._stamp(host=False)
        self.active = True

    def end_window(self) -> list[dict[str, Any]]:
        """Resolve every span of the window into complete trace events (sorted by start time)."""
        self.active = False
        if self.use_cuda:
            torch.cuda.synchronize()
        events = []
        for span in self._spans:
            if span.end is None:
                continue  # opened but never closed (an exception unwound the step)
            start, end = self._host_time(span.start), self._host_time(span.end)
            args = span.args
            if span.enqueued is not None and span.enqueue_end is not None:
                args = {
                    **args,
                    "enqueue_us": round(span.enqueue_end - span.enqueued, 1),
                    "queued_us": round(start - span.enqueued, 1),
                }
            events.append(complete(span.name, span.cat, self.rank, span.tid, start, max(end - start, 0.0), args))
        events.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
        self._spans = []
        return events

    def _host_time(self, stamp: Any) -> float:
        if isinstance(stamp, float):
            return stamp
        return self._ref_host + self._ref_event.elapsed_time(stamp) * 1000.0

    # -- spans -------------------------------------------------------------------------------------
    def open(self, name: str, cat: str, tid: int, args: Optional[dict[str, Any]] = None, host: bool = False) -> Span:
        span = Span(name, cat, tid, dict(args or {}), host=host)
        span.start = self._stamp(host)
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
