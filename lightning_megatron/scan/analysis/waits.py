"""How long each rank waited, per step: for its data loader, for its host, and for the other ranks.

The contract: ``RankTrace`` s in (``scan.analysis.measure`` reads them), ``DataWaits`` out, one per kind of wait; which
waits are too long is decided in ``scan.analysis.detect``. A wait is what a slow loader, a slow host or a slow peer adds
to a
rank's step without any compute of its own, so each is measured apart from the compute of ``scan.analysis.measure``:

* **data** (``data_waits``): the loader's fetches (``data-fetch`` spans) per step, and when the step's last one
  ended on the aligned clock;
* **host gaps** (``data_waits(cat="host")``): the host's time between two steps (Lightning's per-step work,
  logging, callbacks) less the fetches and the waits at Lightning's synchronisation of the ranks (``step-sync``
  spans), which are kept apart as ``synced``: how long the rank waited there for the others;
* **host inside steps** (``host_waits_in_steps``): the gaps between a step's traced spans in which the GPU had
  nothing queued (a callback that blocks before the step ends), with the rank's waits for the others inside the
  step (``measure.blocking_waits_per_step``) as ``synced``, and how long its stage peers were blocked in
  communication during those very gaps as ``waited_during``;
* **waits for a CPU** (``cpu_waits``): how long the training thread was runnable but had no CPU, in the step and
  in the host gap before it (``cpu_wait_us``, ``scan.tracing.sched``): another process's time slices, a CPU limit.

``synced`` is clock-free evidence of lateness: each wait is a duration on its own rank's clock, and the ranks that
waited longer than a rank did waited for it.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_megatron.scan.analysis.measure import (
    STARVED_US,
    RankTrace,
    blocking_waits_per_step,
    covered_length,
    merge_intervals,
    step_of,
    waits_for_others,
)

__all__ = ["DataWaits", "cpu_waits", "data_waits", "host_waits_in_steps", "waited_for"]


@dataclass
class DataWaits:
    """Per rank that has waits of the kind: its wait time (µs) of each step, and when (aligned clock, µs) the
    step's last wait ended. Host waits also give ``synced``: per rank and step, how long it waited for the other
    ranks in the same stretch of time (between steps: at Lightning's synchronisation of the ranks, ``step-sync``,
    absent in traces made before it was traced; inside steps: in blocking communication)."""

    samples: dict[int, list[float]] = field(default_factory=dict)
    ends: dict[int, dict[int, float]] = field(default_factory=dict)
    synced: dict[int, dict[int, float]] = field(default_factory=dict)
    # host waits inside steps: per rank and step, its stage peers' (median) blocking communication during its gaps
    waited_during: dict[int, dict[int, float]] = field(default_factory=dict)

    def without(self, ranks: set[int]) -> DataWaits:
        """The same waits, less those of ``ranks``."""
        parts = (self.samples, self.ends, self.synced, self.waited_during)
        return DataWaits(*({r: v for r, v in part.items() if r not in ranks} for part in parts))


def data_waits(traces: dict[int, RankTrace], cat: str = "data") -> DataWaits:
    """``cat="data"``: the loader's fetches; ``cat="host"``: the host's gaps between steps (same shape), less the
    fetches (data time) and the waits at Lightning's synchronisation of the ranks (time spent on the others)."""
    waits = DataWaits()
    for rank, trace in traces.items():
        per_step: dict[int, float] = defaultdict(float)
        end: dict[int, float] = {}
        taken = merge_intervals(
            (s["ts"], s["ts"] + s["dur"]) for s in trace.spans if cat == "host" and s["cat"] in ("data", "sync")
        )
        for s in trace.spans:
            if s["cat"] == cat:
                step = int(step_of(s))  # type: ignore[arg-type]
                per_step[step] += s["dur"] - covered_length(s["ts"], s["ts"] + s["dur"], taken)
                end[step] = max(end.get(step, -math.inf), s["ts"] + s["dur"] + trace.offset_us)
            elif s["cat"] == "sync" and cat == "host":
                synced = waits.synced.setdefault(rank, defaultdict(float))
                synced[int(step_of(s))] += s["dur"]  # type: ignore[arg-type]
        if per_step:
            waits.samples[rank] = list(per_step.values())
            waits.ends[rank] = end
    return waits


def host_waits_in_steps(traces: dict[int, RankTrace]) -> DataWaits:
    """Per rank and step: how long, inside the step's span, its GPU waited for its host (µs), in the shape of
    ``data_waits``. A host that blocks inside the step (a user's callback uploading metrics before the step
    ends, a garbage collection) leaves gaps between the step's traced spans in which the GPU has nothing to do.

    A gap counts where the GPU reached the span after it as soon as the host queued it (``queued_us`` under
    ``STARVED_US``): it had run out of work. A gap before a span the GPU reached late had work queued, which
    it ran or which another process's time slices delayed (a contended GPU: not the host's doing); gaps
    between the spans of a replayed CUDA graph are never the host's (one launch). The step's tail, after its
    last span, counts where the GPU reached the step's end as soon as the host recorded it. Host-timed traces
    (CPUs) have no GPU to wait: every gap in their steps is the host's. ``synced``: the rank's waits for the
    others in the same steps (a peer that stalled before the optimizer's all-reduce kept this rank waiting in it).

    ``waited_during``: per rank and step, how long its stage peers (their median) were blocked in communication
    while its GPU waited for its host, on the aligned clock. ``synced`` sums every wait of the step, and at TP,
    where the peers meet in hundreds of collectives a step, which of them waits there swings by hundreds of
    milliseconds from step to step (TP2 with sequence parallelism); the waits that overlap the rank's own gaps
    are the ones its host caused."""
    waits = DataWaits()
    gaps: dict[int, dict[int, list[tuple[float, float]]]] = {}
    for rank, trace in traces.items():
        on_gpu = any("queued_us" in (s.get("args") or {}) for s in trace.spans)
        inside: dict[int, list[dict[str, Any]]] = defaultdict(list)
        steps = []
        for s in trace.spans:
            if s["cat"] == "step":
                steps.append(s)
            elif s["cat"] not in ("data", "host") and step_of(s) is not None:
                inside[int(step_of(s))].append(s)  # type: ignore[arg-type]
        per_step: dict[int, float] = {}
        end: dict[int, float] = {}
        own_gaps = gaps[rank] = {}
        for step_span in steps:
            step = int(step_of(step_span))  # type: ignore[arg-type]
            start, stop = step_span["ts"], step_span["ts"] + step_span["dur"]
            cursor, starved = start, []
            for s in sorted(inside[step], key=lambda s: s["ts"]):
                if s["ts"] > cursor and s["ts"] < stop and _starved(s.get("args") or {}, on_gpu):
                    starved.append((cursor, s["ts"]))
                cursor = max(cursor, min(s["ts"] + s["dur"], stop))
            args = step_span.get("args") or {}
            if stop > cursor:
                queued, enqueue = args.get("queued_us"), args.get("enqueue_us")
                at_end = None if queued is None or enqueue is None else float(queued) + step_span["dur"] - enqueue
                if not on_gpu or (at_end is not None and at_end < STARVED_US):
                    starved.append((cursor, stop))
            per_step[step] = sum(b - a for a, b in starved)
            own_gaps[step] = [(a + trace.offset_us, b + trace.offset_us) for a, b in starved]
            end[step] = stop + trace.offset_us
        if per_step:
            waits.samples[rank] = list(per_step.values())
            waits.ends[rank] = end
            others = blocking_waits_per_step(trace)
            waits.synced[rank] = {step: others.get(step, 0.0) for step in per_step}
    blocked = {rank: _blocking_union(trace) for rank, trace in traces.items() if rank in waits.samples}
    for rank, by_step in gaps.items():
        peers = [m for m in blocked if m != rank and traces[m].pp == traces[rank].pp]
        if peers and rank in waits.samples:
            waits.waited_during[rank] = {
                step: statistics.median(sum(covered_length(a, b, blocked[m]) for a, b in spans) for m in peers)
                for step, spans in by_step.items()
            }
    return waits


def _blocking_union(trace: RankTrace) -> tuple[list[float], list[float]]:
    """The rank's blocking communication (what ``blocking_waits_per_step`` sums) as one union, aligned clock."""
    offset = trace.offset_us
    return merge_intervals((s["ts"] + offset, s["ts"] + s["dur"] + offset) for s in trace.spans if waits_for_others(s))


def _starved(args: dict[str, Any], on_gpu: bool) -> bool:
    """Whether the gap before a span with these ``args`` was its GPU waiting for its host (``host_waits_in_steps``)."""
    if not on_gpu:
        return True
    queued = args.get("queued_us")
    return queued is not None and not args.get("graph") and float(queued) < STARVED_US


def cpu_waits(traces: dict[int, RankTrace]) -> DataWaits:
    """Per rank whose trace has them and step: the training thread's run-queue delay (µs) in the step and in the
    host gap before it, in the shape of ``data_waits`` (``ends``: the step's end, aligned clock)."""
    waits = DataWaits()
    for rank, trace in traces.items():
        per_step: dict[int, float] = defaultdict(float)
        end: dict[int, float] = {}
        for s in trace.spans:
            args = s.get("args") or {}
            if s["cat"] in ("step", "host") and "cpu_wait_us" in args and step_of(s) is not None:
                step = int(step_of(s))  # type: ignore[arg-type]
                per_step[step] += max(float(args["cpu_wait_us"]), 0.0)
                if s["cat"] == "step":
                    end[step] = s["ts"] + s["dur"] + trace.offset_us
        steps = sorted(step for step in per_step if step in end)  # a gap without its step is not a step
        if steps:
            waits.samples[rank] = [per_step[step] for step in steps]
            waits.ends[rank] = {step: end[step] for step in steps}
    return waits


def waited_for(rank: int, members: Sequence[int], synced: dict[int, dict[int, float]]) -> float:
    """Median over steps of how much longer the rank's peers (``members``, their median) waited for the others
    (``DataWaits.synced``) than the rank itself did: the time they spent waiting for it. Clock-free: each wait is a
    duration on its own rank's clock. ``-inf`` where no step has both."""
    late = []
    for step, own in synced.get(rank, {}).items():
        others = [synced[m][step] for m in members if m != rank and step in synced.get(m, {})]
        if others:
            late.append(statistics.median(others) - own)
    return statistics.median(late) if late else -math.inf
