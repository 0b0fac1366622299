"""The compute rules of ``scan.analysis.detect``: which ranks are slow at their own work (``kind="compute"``).

The contract: measurements in (``scan.analysis.measure``: net compute per op, per layer part, per step), compute
suspects out; statistics come from ``scan.analysis.compare``. Four rules, each for what the others cannot see:

* **per op** (``compute_suspects``): per-op medians of net compute within a pipeline stage's peers, flagged
  by excess, z and superiority; the evidence adds collective arrival order and the slowest layer parts;
* **per step** (``step_suspects``): per-step sums, each rank against each peer with Wilcoxon's signed-rank
  test over steps; finds partial and bursty slowdowns that per-op medians do not move;
* **across stages**: ranks alone in their stage, on transformer layer parts (``scan.analysis.stage_rules``);
* **against itself** (``own_history_suspects``): a rank's later steps against its own earlier ones (every split
  of the analysed steps), for what the peers' rules cannot show: one process, a lone stage without layer spans,
  a slowdown in too few steps to win most of them. Beside other ranks it is relative to theirs (a change all of
  them share is the job's: a note, no suspect). It names a change within the analysed steps, not a rank that was
  slow from the start.

Whether a suspect of these rules is a slow GPU, a late host or nothing is decided afterwards, on GPU busy time
and queue fields (``scan.analysis.attribution``).

The helpers every rule shares (``peer_groups``, ``flagged``, ``make_suspect``, the context) are in
``scan.analysis.rules_common``; the order the rules run in is ``scan.analysis.rules.RULES``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any, Optional

from lightning_megatron.scan.analysis.compare import (
    HistoryChange,
    Level,
    compare_with_peers,
    later_steps_change,
    levels_of,
    lower_half_median,
    pooled_sigma,
    signed_rank_p,
    trimmed_mean,
)
from lightning_megatron.scan.analysis.report import Suspect
from lightning_megatron.scan.analysis.rules_common import (
    HISTORY_ALPHA,
    MIN_STEPS,
    RELATIVE_HISTORY_RULE,
    DetectionContext,
    comparison_evidence,
    flagged,
    history_alpha,
    history_evidence,
    make_suspect,
    peer_groups,
)

__all__ = ["compute_suspects", "own_history_suspects", "step_suspects"]

_STEP_ALPHA = 0.01  # per-step rule: one rank against all its peers (Bonferroni over them)
_STEP_ALPHA_LARGE = 0.05  # ... for an excess of at least twice min_slowdown: bursts that leave a few steps clean


def compute_suspects(context: DetectionContext) -> list[Suspect]:
    """Compare net compute within each pipeline stage; the evidence adds the rank's collective arrival order
    and, when the trace has layer spans, the layer parts that are slowest relative to the peers."""
    traces, per_rank, notes = context.traces, context.per_rank, context.notes
    compute, layers, collectives = context.compute_samples, context.layer_samples, context.collective_stats
    min_slowdown, min_z, min_impact_us = context.min_slowdown, context.min_z, context.min_impact_us
    suspects = []
    everywhere = pooled_sigma(values for per_op in (*compute.values(), *layers.values()) for values in per_op.values())
    for pp, ranks in sorted(peer_groups(traces).items()):
        source = compute if any(compute[r] for r in ranks) else layers
        members = [r for r in ranks if source[r]]
        if len(members) < 2:
            if members and len(traces) == 1:  # one process: no other stage either
                notes.append(
                    "one rank, no peers: it is compared with its own earlier steps only (a rank slow from its "
                    "first traced step on is not seen)"
                )
            elif members and len(ranks) > 1:  # its peers' traces hold no compute: lost data, not a lone stage
                without = ", ".join(str(r) for r in ranks if r not in members)
                notes.append(
                    f"stage pp{pp}: rank(s) {without} without compute spans, so rank {members[0]} has no peer to "
                    "compare with"
                )
            elif members and not layers[members[0]]:
                notes.append(
                    f"stage pp{pp}: a single rank with compute spans, no peers to compare with (trace with "
                    "granularity='layer' to compare layer parts across stages)"
                )
            continue
        floor = max(pooled_sigma(values for r in members for values in source[r].values()), everywhere)
        comparisons = compare_with_peers({r: levels_of(source[r], floor) for r in members})
        # per-layer-part levels localise the slowness (which layer part is slow), when the trace has them
        layer_levels = {r: levels_of(layers[r], floor) for r in members if layers[r]}
        for c in comparisons:
            if not flagged(c, min_slowdown, min_z):
                continue
            rank = c.member
            summary = per_rank[rank]
            compute_us = (summary.compute_ms or 0.0) * 1000 or c.median
            impact_us = compute_us * c.excess / (1 + c.excess)
            if impact_us < min_impact_us:
                continue
            evidence = comparison_evidence(c, len(members) - 1, impact_us, summary)
            evidence.update(_collective_evidence(collectives.get(rank, {})))
            if rank in layer_levels and len(layer_levels) >= 2:
                evidence["slowest_layer_parts"] = _slowest_parts(rank, layer_levels)
            suspects.append(make_suspect(traces[rank], "compute", c.excess, evidence))
    return suspects


def step_suspects(context: DetectionContext) -> list[Suspect]:
    """The per-step rule (module docstring). Adds its evidence to a compute suspect the per-op rule already
    named (``evidence["per_step"]``), or names a new one; returns the new ones."""
    traces, per_rank, totals = context.traces, context.per_rank, context.totals
    min_slowdown, min_impact_us = context.min_slowdown, context.min_impact_us
    by_rank = {s.rank: s for s in context.suspects}
    found = []
    for _pp, ranks in sorted(peer_groups(traces).items()):
        members = [r for r in ranks if totals.get(r)]
        if len(members) < 2:
            continue
        steps = sorted(set.intersection(*(set(totals[r]) for r in members)))
        steps = [s for s in steps if len({totals[r][s].spans for r in members}) == 1 and totals[members[0]][s].spans]
        if len(steps) < MIN_STEPS:
            continue
        compute = {r: [totals[r][s].compute_us for s in steps] for r in members}
        if any(v <= 0 for values in compute.values() for v in values):
            continue
        for rank in members:
            peers = [q for q in members if q != rank]
            p_values = {q: signed_rank_p([math.log(a / b) for a, b in zip(compute[rank], compute[q])]) for q in peers}
            baseline = [lower_half_median([compute[q][i] for q in peers]) for i in range(len(steps))]
            excess = trimmed_mean([a / b - 1.0 for a, b in zip(compute[rank], baseline)])
            impact_us = trimmed_mean([a - b for a, b in zip(compute[rank], baseline)])
            if excess < min_slowdown or impact_us < min_impact_us:
                continue
            # A large excess needs less certainty: bursts that spare 2 of 8 steps give p of about 0.02 (at 0.01
            # alone, a competing process on one of two GPUs was missed in several runs).
            alpha = _STEP_ALPHA_LARGE if excess >= 2 * min_slowdown else _STEP_ALPHA
            slower_than = [q for q, p in p_values.items() if p < alpha / len(peers)]
            if not slower_than or len(slower_than) < len(peers) / 2:
                continue
            waits = {r: [totals[r][s].wait_us for s in steps] for r in members}
            peers_wait = [statistics.fmean(waits[q][i] for q in peers) - waits[rank][i] for i in range(len(steps))]
            evidence: dict[str, Any] = {
                "rule": "per-step net compute, signed-rank test over steps",
                "steps": len(steps),
                "p_value": max(p_values[q] for q in slower_than),
                "alpha": alpha,
                "slower_than": slower_than,
                "slower_steps_fraction": sum(a > b for a, b in zip(compute[rank], baseline)) / len(steps),
                "mean_excess": round(excess, 4),
                "impact_ms": impact_us / 1000,
                "peers_wait_ms": statistics.median(peers_wait) / 1000,
            }
            known = by_rank.get(rank)
            if known is not None and known.kind == "compute":
                known.evidence["per_step"] = evidence
                continue
            evidence.update(step_ms=per_rank[rank].step_ms, compute_ms=per_rank[rank].compute_ms, peers=len(peers))
            by_rank[rank] = make_suspect(traces[rank], "compute", excess, evidence)
            found.append(by_rank[rank])
    return found


def _collective_evidence(by_name: dict[str, Any]) -> dict[str, Any]:
    """Last-arrival numbers for the most telling group: tensor-parallel if the rank has one, else the group
    the rank shares with the fewest ranks (where being last points at the rank itself most directly)."""
    if not by_name:
        return {}
    name = "tp" if "tp" in by_name else min(by_name, key=lambda n: (by_name[n].get("group_size", 0), n))
    entry = by_name[name]
    return {
        "collective_group": name,
        "collective_instances": int(entry["instances"]),
        "last_arrival_fraction": entry["last"] / entry["instances"] if entry["instances"] else None,
        "expected_last_fraction": 1.0 / entry.get("group_size", 2),
        "imposed_wait_ms": entry["imposed_us"] / entry["last"] / 1000 if entry["last"] else 0.0,
    }


def _slowest_parts(rank: int, levels: dict[int, dict[str, Level]], top: int = 3) -> list[dict[str, Any]]:
    ratios = []
    for key, level in levels[rank].items():
        peers = [lv[key].median for lv in levels.values() if key in lv]
        if len(peers) >= 2:
            base = lower_half_median(peers)
            if base > 0:
                ratios.append({"op": key, "slowdown": level.median / base - 1.0, "ms": level.median / 1000})
    return sorted(ratios, key=lambda r: -r["slowdown"])[:top]


def own_history_suspects(context: DetectionContext) -> list[Suspect]:
    """Ranks whose later steps are slower than their own earlier ones (module docstring); returns new suspects.

    The analysed steps of identical work (equal span counts) are split into earlier and later steps, each side
    at least ``MIN_STEPS`` (``compare.later_steps_change``); a rank is named when its later steps are slower by
    ``min_slowdown`` (10 %-trimmed means) and ``min_impact`` per step at p below ``HISTORY_ALPHA`` shared among
    the ranks (``history_evidence``). Ranks already named are left out.

    With other ranks beside it, the change must also stand relative to theirs (the rank's compute step by step
    over the median of the others', the same test, sized by the smaller of the two): a change they all share is
    the job's, not the rank's, and a rank whose peers sped up did not turn slow. On a small CPU machine the
    ranks' compute drifts between the halves of a DP2 fit, the ranks together, and the relative test names
    fewer clean ranks than the test alone (docs/evaluation/megascan.md). GPUs share clock and cooling changes
    the same way. A change every rank shares is reported in ``notes`` instead."""
    traces, per_rank, totals, notes = context.traces, context.per_rank, context.totals, context.notes
    min_slowdown, min_impact_us = context.min_slowdown, context.min_impact_us
    series = {}
    for rank, per_step in sorted(totals.items()):
        steps = [s for s, t in per_step.items() if t.spans and t.compute_us > 0]
        if len({per_step[s].spans for s in steps}) == 1:
            series[rank] = {s: per_step[s].compute_us for s in steps}
    common = sorted(set.intersection(*(set(v) for v in series.values()))) if len(series) >= 2 else []
    relative = len(common) >= 2 * MIN_STEPS
    named = {s.rank for s in context.suspects}
    alpha = history_alpha(len(totals))
    found = []
    for rank, compute in series.items():
        if rank in named:
            continue
        change = later_steps_change(compute, MIN_STEPS, alpha)
        evidence = history_evidence(change, min_slowdown, min_impact_us, len(totals))
        if relative and evidence is not None:
            others = [q for q in series if q != rank]
            ratio = {s: compute[s] / statistics.median(series[q][s] for q in others) for s in common}
            change = _in_own_time(later_steps_change(ratio, MIN_STEPS, alpha), compute)
            evidence = history_evidence(change, min_slowdown, min_impact_us, len(totals))
        if change is None or evidence is None:
            continue
        evidence["step_ms"] = per_rank[rank].step_ms
        if relative:
            evidence.update(_relative_evidence(change, compute, [series[q] for q in others]))
        found.append(make_suspect(traces[rank], "compute", change.excess, evidence))
    if relative:
        _note_a_shared_change(series, common, min_slowdown, notes)
    return found


def _split_means(change: HistoryChange, per_step: dict[int, float]) -> tuple[float, float]:
    """Trimmed means of ``per_step`` over the earlier and the later steps of ``change``."""
    first, last = change.earlier_steps[0], change.later_steps[1]
    earlier = [v for s, v in per_step.items() if first <= s <= change.earlier_steps[1]]
    later = [v for s, v in per_step.items() if change.later_steps[0] <= s <= last]
    return trimmed_mean(earlier), trimmed_mean(later)


def _in_own_time(change: Optional[HistoryChange], compute: dict[int, float]) -> Optional[HistoryChange]:
    """A change found in a rank's compute relative to the others', sized in the rank's own time: its earlier
    steps' compute, grown by the smaller of the relative excess (the part of its change the others do not share)
    and its own measured change (a rank whose peers sped up while it stayed as it was did not turn slow)."""
    if change is None:
        return None
    before, after = _split_means(change, compute)
    excess = min(change.excess, after / before - 1.0) if before > 0 else change.excess
    return replace(change, before=before, after=before * (1.0 + excess), excess=excess)


def _relative_evidence(
    change: HistoryChange, compute: dict[int, float], others: list[dict[int, float]]
) -> dict[str, Any]:
    """What the rank's own compute and the others' did over the split: the measured sides of both."""
    before, after = _split_means(change, compute)
    theirs = [_split_means(change, other) for other in others]
    return {
        "rule": RELATIVE_HISTORY_RULE,
        "earlier_ms": before / 1000,
        "later_ms": after / 1000,
        "others_change": round(statistics.median(b / a - 1.0 for a, b in theirs if a > 0), 4),
    }


def _note_a_shared_change(
    series: dict[int, dict[int, float]], common: list[int], min_slowdown: float, notes: list[str]
) -> None:
    """A note where every rank's compute grew: each rank's own later steps against its earlier ones, all past the
    bar, the least of the changes reported. (A median across ranks is no test of "every": of two ranks it is
    their mean, and one rank 30% slower moved it 15%.)"""
    changes = [later_steps_change({s: series[r][s] for s in common}, MIN_STEPS, HISTORY_ALPHA) for r in series]
    if all(c is not None and c.excess >= min_slowdown and c.p < HISTORY_ALPHA for c in changes):
        least = min(changes, key=lambda c: c.excess)
        notes.append(
            f"every rank's compute {least.excess:+.0%} or more from step {least.later_steps[0]} on "
            f"(p={max(c.p for c in changes):.2g}): the job slowed as a whole, no rank apart from the others (a "
            "shared cause: the machine's clocks or cooling, another tenant)"
        )
