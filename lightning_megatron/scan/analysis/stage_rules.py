"""The rules of ``scan.analysis.detect`` for ranks alone in their pipeline stage (pipeline parallelism without data- or
tensor-parallel peers): such a rank has nobody doing its own work, but every stage runs transformer layers, and
one layer's attention or MLP is the same work on every stage.

The contract: layer measurements in (``scan.analysis.measure``: net times of ``granularity="layer"`` spans), compute
suspects out, with the statistics of ``scan.analysis.compare``, by two rules like the peer rules of
``compute_rules``; and host waits in (``scan.analysis.waits``), host suspects out, by a third:

* **per part** (``cross_stage_suspects``): per layer part (``forward attention``, ``backward mlp``, ...), each
  rank's samples against the other stages', flagged by excess, z and superiority. It sees a stage whose every
  layer is slower, also in traces too short for the per-step rule;
* **per step** (``cross_stage_step_suspects``): per step, the mean time of each layer part, summed (a typical
  layer's forward and backward), each rank against the lower half of the others with Wilcoxon's signed-rank test
  over steps. Another process time-slicing a GPU does not slow every part: it made one part of a stage's
  layers (a different one each run) severalfold slower and left the others as they were, which no
  per-part median reveals and this sum does. The mean, not the median, because time slices hit a few spans
  hard: on CPUs another process on a stage's core left the median layer part as it was (+7%) and made the mean
  +42% to +99% (the time the stage lost); the test over steps, not the mean, keeps a one-off pause out;
* **host waits** (``cross_stage_wait_suspects``): the host's gaps between steps and the GPU's waits for its host
  inside steps (``scan.analysis.waits``) are Lightning's and the user's callbacks' work, the same code on every stage:
  a stage whose host blocks (a synchronous upload, a long garbage collection) is compared with the other lone
  stages, and named ``host`` where it costs ``min_slowdown`` of the job's median step.

The two compute rules measure a suspect on the spans its GPU paced only (``measure.host_paced``): a launch-bound
forward lasts as long as its host takes to queue it, and host noise (a slow loader's process, CPU contention)
would pass for a slow stage. Their suspects therefore stay ``compute`` (``gpu_paced_only``: ``attribute_host``
leaves them). The per-step rule's baseline may also use the other stages' host-paced spans: each is an upper
bound of its GPU's time, so they can hide a slowdown but never make one, and the stage a fault spares is often
the launch-bound one whose GPU paced few spans.

Ranks are compared only with other lone stages; stages carry different extra work (the embedding, the output
layer and loss), which is why whole-stage compute is not compared, and why another stage is a weaker baseline
than a peer (``_stage_margin``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from lightning_megatron.scan.analysis.compare import (
    compare_with_peers,
    levels_of,
    lower_half_median,
    pooled_sigma,
    signed_rank_p,
    trimmed_mean,
)
from lightning_megatron.scan.analysis.measure import RankTrace
from lightning_megatron.scan.analysis.report import Suspect
from lightning_megatron.scan.analysis.rules_common import (
    MIN_STEPS,
    DetectionContext,
    comparison_evidence,
    flagged,
    make_suspect,
    peer_groups,
    wait_evidence,
)
from lightning_megatron.scan.analysis.waits import DataWaits, waited_for

__all__ = ["cross_stage_suspects", "cross_stage_step_suspects", "cross_stage_wait_suspects"]

_STEP_ALPHA = 0.01  # as the peer rules: one rank against the other lone stages
_STEP_ALPHA_LARGE = 0.05  # ... for an excess of at least twice min_slowdown (bursts that spare a few steps)
# Another stage is a weaker baseline than a peer: its layers run beside other work (the embedding, the output
# layer), with other neighbours. In clean GPU fits one stage's typical layer was at times more than min_slowdown
# slower than the other's (a few % in most), so these rules ask for twice ``min_slowdown``. Processes on CPUs share
# more than a GPU's (caches, memory bandwidth, on a VM the host's cores), so one stage's speed follows what the other
# does: with each stage pinned to one vCPU the first stage's typical layer was slower than the second's in clean
# fits by up to more than min_slowdown, and by more still under faults that did not touch its compute (host stalls,
# a delayed link, slow loaders): CPU traces ask for three times ``min_slowdown`` (docs/evaluation/megascan.md).
_STAGE_MARGIN = 2.0
_STAGE_MARGIN_CPU = 3.0
_MIN_PARTS = 2  # layer parts with GPU-paced samples on every compared rank, for a step to count
_MIN_STEPS = MIN_STEPS // 2  # steps with such parts (the forward of a launch-bound job is mostly host-paced)


def lone_stages(traces: dict[int, RankTrace], measured: dict[int, Any]) -> list[int]:
    """The ranks alone in their pipeline stage that have measurements in ``measured``."""
    return [ranks[0] for ranks in peer_groups(traces).values() if len(ranks) == 1 and measured.get(ranks[0])]


def _stage_margin(traces: dict[int, RankTrace]) -> float:
    """How many times ``min_slowdown`` a lone stage must exceed the others by (see ``_STAGE_MARGIN``)."""
    return _STAGE_MARGIN_CPU if any(t.device == "cpu" for t in traces.values()) else _STAGE_MARGIN


def cross_stage_suspects(context: DetectionContext) -> list[Suspect]:
    """The per-part rule (module docstring), on ``measure.layer_parts_per_step`` (merged over steps)."""
    traces, per_rank, parts_per_step = context.traces, context.per_rank, context.parts_per_step
    min_slowdown, min_z, min_impact_us = context.min_slowdown, context.min_z, context.min_impact_us
    alone = lone_stages(traces, parts_per_step)
    if len(alone) < 2:
        return []
    samples: dict[int, dict[str, list[float]]] = {}
    for rank in alone:
        merged: dict[str, list[float]] = defaultdict(list)
        for parts in parts_per_step[rank].values():
            for part, values in parts.items():
                merged[part] += values
        samples[rank] = dict(merged)
    floor = pooled_sigma(values for per_part in samples.values() for values in per_part.values())
    suspects = []
    margin = _stage_margin(traces)
    for c in compare_with_peers({r: levels_of(samples[r], floor) for r in alone}):
        if not flagged(c, margin * min_slowdown, min_z):
            continue
        summary = per_rank[c.member]
        compute_us = (summary.compute_ms or 0.0) * 1000 or c.median
        impact_us = compute_us * c.excess / (1 + c.excess)
        if impact_us < min_impact_us:
            continue
        evidence = {
            "rule": "layer parts across pipeline stages",
            **comparison_evidence(c, len(alone) - 1, impact_us, summary),
            "gpu_paced_only": True,
            "across_stages": True,
        }
        suspects.append(make_suspect(traces[c.member], "compute", c.excess, evidence))
    return suspects


def cross_stage_step_suspects(context: DetectionContext) -> list[Suspect]:
    """The per-step rule (module docstring) on ``measure.layer_parts_per_step`` (``parts_per_step``: the spans
    each GPU paced; ``every_part_per_step``: all spans, ``host_paced_too``); the time it costs is the excess
    share of the rank's layer spans per step (``layers``: ``measure.net_compute``'s layer samples). Adds its
    evidence to a compute suspect already named (``evidence["per_step_layers"]``) or names a new one; returns
    the new suspects."""
    traces, per_rank, layers = context.traces, context.per_rank, context.layer_samples
    parts_per_step, every_part_per_step = context.parts_per_step, context.every_part_per_step
    min_slowdown, min_impact_us = context.min_slowdown, context.min_impact_us
    alone = lone_stages(traces, every_part_per_step)  # a rank whose GPU paced no span is still a baseline
    if len(alone) < 2:
        return []
    by_rank = {s.rank: s for s in context.suspects if s.kind == "compute"}
    margin = _stage_margin(traces)
    found = []
    for rank in alone:
        others = [q for q in alone if q != rank]
        typical = _typical_layer_per_step(rank, others, parts_per_step, every_part_per_step)
        steps = sorted(typical)
        if len(steps) < _MIN_STEPS:
            continue
        own = [typical[s][0] for s in steps]
        baseline = [typical[s][1] for s in steps]
        excess = trimmed_mean([a / b - 1.0 for a, b in zip(own, baseline)])
        if excess < margin * min_slowdown:
            continue
        alpha = _STEP_ALPHA_LARGE if excess >= 2 * margin * min_slowdown else _STEP_ALPHA
        p_value = signed_rank_p([math.log(a / b) for a, b in zip(own, baseline)])
        if p_value >= alpha:
            continue
        layer_us = sum(map(sum, layers.get(rank, {}).values())) / max(per_rank[rank].steps, 1)  # per step
        impact_us = layer_us * excess / (1 + excess)
        if impact_us < min_impact_us:
            continue
        evidence: dict[str, Any] = {
            "rule": "typical layer per step across pipeline stages, signed-rank test over steps",
            "steps": len(steps),
            "p_value": p_value,
            "alpha": alpha,
            "slower_steps_fraction": sum(a > b for a, b in zip(own, baseline)) / len(steps),
            "typical_layer_ms": statistics.median(own) / 1000,
            "baseline_layer_ms": statistics.median(baseline) / 1000,
            "mean_excess": round(excess, 4),
            "impact_ms": impact_us / 1000,
            "peers": len(others),
            "gpu_paced_only": True,  # host-paced spans left out: attribute_host has nothing to add
            "across_stages": True,  # attribute_busy compares a typical layer's busy time across stages
        }
        known = by_rank.get(rank)
        if known is not None:
            known.evidence["per_step_layers"] = evidence
            continue
        evidence.update(step_ms=per_rank[rank].step_ms, compute_ms=per_rank[rank].compute_ms)
        found.append(make_suspect(traces[rank], "compute", excess, evidence))
    return found


def _typical_layer_per_step(
    rank: int,
    others: list[int],
    paced: dict[int, dict[int, dict[str, list[float]]]],
    every: dict[int, dict[int, dict[str, list[float]]]],
) -> dict[int, tuple[float, float]]:
    """Per step where ``rank``'s GPU paced at least ``_MIN_PARTS`` layer parts that every other rank ran: (its
    typical layer, the others' lower-half median), each the sum over those parts of the part's mean (µs).

    ``rank``'s side holds only the spans its GPU paced (its host's noise stays out). An other rank's part is
    the larger of the mean of the spans its GPU paced and the mean of all its spans: the stage a fault spares
    is the one whose GPU idles for its host, so in a launch-bound pipeline it paced few spans (at PP2, another
    process copying memory on the last stage's GPU left few steps where both stages had GPU-paced parts in
    common, and nothing was named). All its spans are
    an upper bound of its GPU's time, so filling in with them can only hide a slowdown, not make one."""
    typical: dict[int, tuple[float, float]] = {}
    for step, own_parts in paced.get(rank, {}).items():
        parts = [p for p in own_parts if all(p in every.get(q, {}).get(step, {}) for q in others)]
        if len(parts) < _MIN_PARTS:
            continue
        own = sum(statistics.fmean(own_parts[p]) for p in parts)
        theirs = []
        for q in others:
            mine = paced.get(q, {}).get(step, {})
            theirs.append(
                sum(max(statistics.fmean(every[q][step][p]), statistics.fmean(mine.get(p) or [0.0])) for p in parts)
            )
        baseline = lower_half_median(theirs)
        if own > 0 and baseline > 0:
            typical[step] = (own, baseline)
    return typical


def cross_stage_wait_suspects(context: DetectionContext, waits: DataWaits, bar_us: float) -> list[Suspect]:
    """``host`` suspects among the ranks alone in their stage: their host waits per step (``scan.analysis.waits``: gaps
    between steps, or the GPU's waits for its host inside them) against the other lone stages', flagged as a
    compute comparison is (with the stage margin) where the excess costs at least ``bar_us`` per step.

    A stage's own work is in its spans, not in these waits, but a stage can still wait on its host for work of its
    own (the last stage reads its loss back for the progress bar: a GPU round trip): hence the bar in time, a
    share of the step, as for the waits inside steps. ``evidence["late_ms"]`` is how much longer the others waited
    for the rank (``waits.waited_for``, clock-free); between stages it is only evidence, not a condition: a
    pipeline's stages wait for each other in every step, whatever their hosts do."""
    traces, per_rank, min_slowdown, min_z = context.traces, context.per_rank, context.min_slowdown, context.min_z
    alone = lone_stages(traces, waits.samples)
    if len(alone) < 2:
        return []
    floor = pooled_sigma(waits.samples[r] for r in alone)
    margin = _stage_margin(traces)
    suspects = []
    for c in compare_with_peers({r: levels_of({"host-wait": waits.samples[r]}, floor) for r in alone}):
        impact_us = c.median - c.baseline
        if not flagged(c, margin * min_slowdown, min_z) or impact_us < bar_us:
            continue
        late_us = waited_for(c.member, alone, waits.synced)
        evidence = wait_evidence(c, late_us, len(alone) - 1, impact_us, per_rank[c.member])
        evidence["across_stages"] = True
        suspects.append(make_suspect(traces[c.member], "host", c.excess, evidence))
    return suspects
