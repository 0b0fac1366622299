"""What the GPU recorder's fields say about each rank: how often its GPU waited for its host, and how much of its
spans' time its kernels were busy; for the attribution of compute suspects (``scan.analysis.attribution``).

The contract, as ``scan.analysis.measure``'s: rank traces in, numbers out, nothing decided here.

* **host pacing** (``host_pacing``): the fraction of a rank's compute spans that its GPU started as soon as the
  host queued them (``queued_us`` under 30 µs): a slow host, not a slow GPU;
* **GPU busy time** (``busy_times``): with ``gpu_busy``, the kernel time inside the spans that net compute sums
  (``args.busy_us``, ``scan.tracing.busy``), the host's time to queue them (``enqueue_us``) and their net lengths, per
  step (steps whose every such span has it), per op, and per layer part (GPU-paced spans only, as
  ``measure.layer_parts_per_step``): what ``attribution.attribute_busy`` compares.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from lightning_megatron.scan.analysis.measure import (
    STARVED_US,
    RankTrace,
    host_paced,
    layer_part,
    net_compute_spans,
    step_of,
)

__all__ = ["BusyTimes", "busy_times", "host_pacing"]


def host_pacing(traces: dict[int, RankTrace]) -> dict[int, float]:
    """Per rank with the GPU recorder's queue fields: the fraction of its compute spans that its GPU reached as soon
    as the host queued them (``queued_us`` under 30 µs), i.e. that the host, not the GPU, paced."""
    pacing = {}
    for rank, trace in traces.items():
        queued = [
            s["args"]["queued_us"] for s in trace.spans if s["cat"] == "compute" and "queued_us" in s.get("args", {})
        ]
        if queued:
            pacing[rank] = sum(q < STARVED_US for q in queued) / len(queued)
    return pacing


@dataclass
class BusyTimes:
    """One rank's GPU busy time (µs) and host queueing time (µs, ``enqueue_us``): per step on the spans net compute
    sums (compute spans, or layer spans where it has none); per op (``forward chunk 0``); per layer part merged
    over layers (``forward attention``: the same work on every pipeline stage; GPU-paced spans only, as
    ``layer_parts_per_step``), also per step. ``span_*``: the same spans' net lengths."""

    busy_per_step: dict[int, float] = field(default_factory=dict)
    enqueue_per_step: dict[int, float] = field(default_factory=dict)
    busy_per_key: dict[str, list[float]] = field(default_factory=dict)
    enqueue_per_key: dict[str, list[float]] = field(default_factory=dict)
    busy_per_part: dict[str, list[float]] = field(default_factory=dict)
    enqueue_per_part: dict[str, list[float]] = field(default_factory=dict)
    # the same spans' lengths: whether the sampled windows caught the slowdown a rule found over all steps
    span_per_step: dict[int, float] = field(default_factory=dict)
    span_per_key: dict[str, list[float]] = field(default_factory=dict)
    span_per_part: dict[str, list[float]] = field(default_factory=dict)
    # per sampled step, per layer part (GPU-paced spans): one window's typical layer, across stages
    busy_per_step_part: dict[int, dict[str, list[float]]] = field(default_factory=dict)


def busy_times(traces: dict[int, RankTrace]) -> dict[int, BusyTimes]:
    """Per rank whose trace has ``busy_us`` (GPU windows that measured it): ``BusyTimes``. A step is summed only
    where every summed span has ``busy_us`` (a sampled window measures all its spans or none)."""
    found: dict[int, BusyTimes] = {}
    for rank, trace in traces.items():
        summed = "compute" if any(s["cat"] == "compute" for s in trace.spans) else "compute.layer"
        times = BusyTimes()
        partial: set[int] = set()
        lists: dict[str, dict[str, list[float]]] = {
            name: defaultdict(list) for name in ("bk", "ek", "sk", "bp", "ep", "sp")
        }
        for s, net in net_compute_spans(trace):
            step = step_of(s)
            if step is None:
                continue
            args = s.get("args") or {}
            if "busy_us" not in args:
                partial.add(step)
                continue
            busy, enqueue = float(args["busy_us"]), args.get("enqueue_us")
            if s["cat"] == "compute":
                key, kind = f"{s['name']} chunk {args.get('chunk', 0)}", "k"
            elif host_paced(args, s["dur"]):
                key, kind = "", ""  # layer parts: as layer_parts_per_step, only the spans the GPU paced
            else:
                key, kind = layer_part(s), "p"
            if kind:
                lists["b" + kind][key].append(busy)
                if kind == "p":
                    times.busy_per_step_part.setdefault(step, {}).setdefault(key, []).append(busy)
                lists["s" + kind][key].append(net)
                if enqueue is not None:
                    lists["e" + kind][key].append(float(enqueue))
            if s["cat"] == summed:
                times.busy_per_step[step] = times.busy_per_step.get(step, 0.0) + busy
                times.span_per_step[step] = times.span_per_step.get(step, 0.0) + net
                if enqueue is not None:
                    times.enqueue_per_step[step] = times.enqueue_per_step.get(step, 0.0) + float(enqueue)
        for step in partial:
            times.busy_per_step.pop(step, None)
            times.enqueue_per_step.pop(step, None)
            times.span_per_step.pop(step, None)
        if lists["bk"] or lists["bp"]:
            times.busy_per_key, times.enqueue_per_key = dict(lists["bk"]), dict(lists["ek"])
            times.busy_per_part, times.enqueue_per_part = dict(lists["bp"]), dict(lists["ep"])
            times.span_per_key, times.span_per_part = dict(lists["sk"]), dict(lists["sp"])
            found[rank] = times
    return found
