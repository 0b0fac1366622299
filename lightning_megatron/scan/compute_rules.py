"""The compute rules of ``scan.detect``: which ranks are slow at their own work (``kind="compute"``).

The contract: measurements in (``scan.measure``: net compute per op, per layer part, per step), compute
suspects out; statistics come from ``scan.compare``. Four rules, each for what the others cannot see:

* **per op** (``compute_suspects``): per-op medians of net compute within a pipeline stage's peers, flagged
  by excess, z and superiority; the evidence adds collective arrival order and the slowest layer parts;
* **per step** (``step_suspects``): per-step sums, each rank against each peer with Wilcoxon's signed-rank
  test over steps; finds partial and bursty slowdowns that per-op medians do not move;
* **across stages**: ranks alone in their stage, on transformer layer parts (``scan.stage_rules``);
* **against itself** (``own_history_suspects``): a rank's later steps against its own earlier ones (the
  analysed steps split at a third, half or two thirds), for what no peer can show: a lone stage without layer spans, or every
  rank at once. It names a change within the analysed steps, not a rank that was slow from the start.

Then the attribution: a compute suspect is a slow GPU only if its GPU's *kernels* took longer. Where the trace
has GPU busy time (``scan.busy``), ``attribute_busy`` compares it against the same baseline as the rule that named
the suspect and keeps ``compute`` on busy excess, or names ``host`` (the GPU idled between kernels while its host
queued the work late), or drops the suspect with a note; elsewhere ``attribute_host`` decides on the queue fields.

The small helpers every rule of ``scan.detect`` shares (``peer_groups``, ``flagged``, ``make_suspect``) live
here too, so the other rules import from this module and not the other way round.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from lightning_megatron.scan.compare import (
    Comparison,
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
from lightning_megatron.scan.gpu_measure import BusyTimes
from lightning_megatron.scan.measure import RankTrace, StepTotal
from lightning_megatron.scan.report import RankSummary, Suspect

__all__ = [
    "HISTORY_RULE",
    "attribute_busy",
    "attribute_host",
    "comparison_evidence",
    "compute_suspects",
    "flagged",
    "history_alpha",
    "history_evidence",
    "make_suspect",
    "own_history_suspects",
    "peer_groups",
    "step_suspects",
]

# A suspect must be slower than a healthy peer in at least this fraction of sample pairs (``Comparison.superiority``):
# the median test assumes well-behaved noise; this one holds for heavy-tailed or two-mode noise too (CPU
# contention: a rank's op takes either 3 ms or 12 ms), where a median can move without a consistent slowdown.
_MIN_SUPERIORITY = 0.8
MIN_STEPS = 8  # steps of identical work for the per-step rule (its smallest p-value is then 1/256)
_STEP_ALPHA = 0.01  # per-step rule: one rank against all its peers (Bonferroni over them)
_STEP_ALPHA_LARGE = 0.05  # ... for an excess of at least twice min_slowdown: bursts that leave a few steps clean
_HISTORY_ALPHA = 0.01  # own-history rules: later steps against earlier ones, family-wise over the ranks tested


def peer_groups(traces: dict[int, RankTrace]) -> dict[int, list[int]]:
    """Ranks that do the same work: one group per pipeline stage (all data- and tensor-parallel ranks)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for rank, trace in sorted(traces.items()):
        groups[trace.pp].append(rank)
    return groups


def flagged(c: Comparison, min_slowdown: float, min_z: float) -> bool:
    return c.excess >= min_slowdown and c.z >= min_z and c.superiority >= _MIN_SUPERIORITY


def compute_suspects(
    traces: dict[int, RankTrace],
    per_rank: dict[int, RankSummary],
    compute: dict[int, dict[str, list[float]]],
    layers: dict[int, dict[str, list[float]]],
    collectives: dict[int, dict[str, Any]],
    min_slowdown: float,
    min_z: float,
    min_impact_us: float,
    notes: list[str],
) -> list[Suspect]:
    """Compare net compute within each pipeline stage; the evidence adds the rank's collective arrival order
    and, when the trace has layer spans, the layer parts that are slowest relative to the peers."""
    suspects = []
    everywhere = pooled_sigma(values for per_op in (*compute.values(), *layers.values()) for values in per_op.values())
    for pp, ranks in sorted(peer_groups(traces).items()):
        source = compute if any(compute[r] for r in ranks) else layers
        members = [r for r in ranks if source[r]]
        if len(members) < 2:
            if members and not layers[members[0]]:
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


def step_suspects(
    traces: dict[int, RankTrace],
    per_rank: dict[int, RankSummary],
    totals: dict[int, dict[int, StepTotal]],
    suspects: list[Suspect],
    min_slowdown: float,
    min_impact_us: float,
) -> list[Suspect]:
    """The per-step rule (module docstring). Adds its evidence to a compute suspect the per-op rule already
    named (``evidence["per_step"]``), or names a new one; returns all compute suspects."""
    by_rank = {s.rank: s for s in suspects}
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
            # A large excess needs less certainty: bursts that spare 2 of 8 steps give p of about 0.02 (a
            # competing process on one of 2x H200 was missed in 3 of 10 runs at 0.01 alone).
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
            suspects.append(by_rank[rank])
    return suspects


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


def comparison_evidence(c: Comparison, peers: int, impact_us: float, summary: RankSummary) -> dict[str, Any]:
    """The evidence of a compute suspect named on a ``compare_with_peers`` comparison."""
    return {
        "median_ms": c.median / 1000,
        "baseline_ms": c.baseline / 1000,
        "z": round(c.z, 2),
        "superiority": round(c.superiority, 3),
        "samples": c.n,
        "peers": peers,
        "impact_ms": impact_us / 1000,
        "step_ms": summary.step_ms,
        "compute_ms": summary.compute_ms,
    }


def wait_evidence(c: Comparison, late_us: float, peers: int, impact_us: float, summary: RankSummary) -> dict[str, Any]:
    """The evidence of a wait suspect (``data``, ``host``) named on a ``compare_with_peers`` comparison of waits per
    step; ``late_us``: how late the rank was against those it was compared with (``nan``: not measured)."""
    return {
        "median_ms": c.median / 1000,
        "baseline_ms": c.baseline / 1000,
        "late_ms": late_us / 1000 if math.isfinite(late_us) else None,
        "z": round(c.z, 2),
        "superiority": round(c.superiority, 3),
        "steps": c.n,
        "peers": peers,
        "impact_ms": impact_us / 1000,
        "step_ms": summary.step_ms,
    }


def make_suspect(
    trace: RankTrace, kind: str, slowdown: float, evidence: dict[str, Any], peer: Optional[int] = None
) -> Suspect:
    return Suspect(**trace.coordinates, kind=kind, slowdown=round(slowdown, 4), peer=peer, evidence=evidence)


def own_history_suspects(
    traces: dict[int, RankTrace],
    per_rank: dict[int, RankSummary],
    totals: dict[int, dict[int, StepTotal]],
    suspects: list[Suspect],
    min_slowdown: float,
    min_impact_us: float,
) -> list[Suspect]:
    """Ranks whose later steps are slower than their own earlier ones (module docstring); returns new suspects.

    The analysed steps of identical work (equal span counts) are split into earlier and later steps, each side
    at least ``MIN_STEPS`` (``compare.later_steps_change``); a rank is named when its later steps are slower by
    ``min_slowdown`` (10 %-trimmed means) and ``min_impact`` per step at p below ``_HISTORY_ALPHA`` shared among
    the ranks (``history_evidence``). Ranks already named are left out."""
    named = {s.rank for s in suspects}
    found = []
    for rank, per_step in sorted(totals.items()):
        if rank in named:
            continue
        steps = [s for s, t in per_step.items() if t.spans and t.compute_us > 0]
        if len({per_step[s].spans for s in steps}) != 1:
            continue
        compute = {s: per_step[s].compute_us for s in steps}
        change = later_steps_change(compute, MIN_STEPS, history_alpha(len(totals)))
        evidence = history_evidence(change, min_slowdown, min_impact_us, len(totals))
        if evidence is not None:
            evidence["step_ms"] = per_rank[rank].step_ms
            found.append(make_suspect(traces[rank], "compute", change.excess, evidence))
    return found


HISTORY_RULE = "later steps against the rank's own earlier steps"


def history_alpha(ranks_tested: int) -> float:
    """The level of the own-history test of each of ``ranks_tested`` ranks (Bonferroni over them)."""
    return _HISTORY_ALPHA / max(1, ranks_tested)


def history_evidence(
    change: Optional[HistoryChange], min_slowdown: float, min_impact_us: float, ranks_tested: int
) -> Optional[dict[str, Any]]:
    """The evidence of a suspect named against its own history (``HISTORY_RULE``), or None where ``change`` is not
    a slowdown by ``min_slowdown`` and ``min_impact_us`` per step at p below ``_HISTORY_ALPHA`` shared among the
    ``ranks_tested`` (Bonferroni: 1% for one process, 0.125% per rank for eight)."""
    if change is None or change.excess < min_slowdown or change.after - change.before < min_impact_us:
        return None
    alpha = history_alpha(ranks_tested)
    if change.p >= alpha:
        return None
    return {
        "rule": HISTORY_RULE,
        "earlier_steps": list(change.earlier_steps),
        "later_steps": list(change.later_steps),
        "later_ms": change.after / 1000,
        "earlier_ms": change.before / 1000,
        "p_value": change.p,
        "alpha": alpha,
        "impact_ms": (change.after - change.before) / 1000,
    }


def attribute_host(
    suspects: list[Suspect],
    pacing: dict[int, float],
    traces: dict[int, RankTrace],
    min_slowdown: float,
    notes: list[str],
) -> list[Suspect]:
    """Compute suspects whose spans the host paced become ``host`` suspects (GPU traces with queue fields), or are
    dropped where their host was no slower than their peers'. Returns the suspects kept.

    A slow GPU runs behind a full queue; a GPU whose host is slow (CPU contention, a Python-heavy step) reaches
    each span as soon as it is queued, and its spans last as long as the host takes. Where at least half of a
    suspect's compute spans were host-paced and 30 points more of them than of its peers', the host paced it.
    That alone does not make the host slow: in a launch-bound job (little GPU work per kernel) one host always
    paces the step, and its peers' GPUs, ahead, wait in the collectives, so the pacing rank's net compute looks
    several times theirs although its host is no slower. So the host is named only where it took at least
    ``min_slowdown`` longer than its peers' hosts to queue the same ops (``enqueue_us``, per op, median of the
    ratios); otherwise the suspect is dropped with a note."""
    groups = peer_groups(traces)
    kept = []
    for suspect in suspects:
        if suspect.kind != "compute" or suspect.rank not in pacing or "busy_excess" in suspect.evidence:
            kept.append(suspect)  # busy time, where there is some, has decided already (attribute_busy)
            continue
        if suspect.evidence.get("gpu_paced_only"):
            kept.append(suspect)  # its rule measured only spans the GPU paced: the host did not make them longer
            continue
        peer_ranks = [r for r in groups[suspect.pp] if r != suspect.rank and r in pacing]
        peers = [pacing[r] for r in peer_ranks]
        own = pacing[suspect.rank]
        suspect.evidence["host_paced_fraction"] = round(own, 3)
        if peers:
            suspect.evidence["peers_host_paced_fraction"] = round(statistics.median(peers), 3)
        if not (own >= 0.5 and own >= (statistics.median(peers) if peers else 0.0) + 0.3):
            kept.append(suspect)
            continue
        excess = _host_excess(traces, suspect.rank, peer_ranks)
        if excess is not None:
            suspect.evidence["host_queue_excess"] = round(excess, 4)
            if excess < min_slowdown:
                notes.append(
                    f"rank {suspect.rank}: its GPU waited for its host (host-paced spans {100 * own:.0f}%), but "
                    f"the host queued the same ops only {100 * excess:+.0f}% slower than its peers': a launch-bound "
                    "job paced by one host, not a slow rank (not named)"
                )
                continue
        suspect.kind = "host"
        suspect.evidence["why_host"] = (
            "its GPU started most compute spans as soon as the host queued them: the host paced the work"
        )
        kept.append(suspect)
    return kept


def _host_excess(traces: dict[int, RankTrace], rank: int, peers: list[int]) -> Optional[float]:
    """How much longer ``rank``'s host took to queue its compute ops than its peers' hosts (median over ops of
    the ratio of median ``enqueue_us``, minus 1); None without queue fields on both sides."""

    def per_op(r: int) -> dict[str, float]:
        samples: dict[str, list[float]] = defaultdict(list)
        for s in traces[r].spans:
            if s["cat"] == "compute" and "enqueue_us" in (s.get("args") or {}):
                samples[s["name"]].append(float(s["args"]["enqueue_us"]))
        return {op: statistics.median(values) for op, values in samples.items()}

    own = per_op(rank)
    theirs = [per_op(p) for p in peers]
    ratios = []
    for op, value in own.items():
        base = [t[op] for t in theirs if op in t and t[op] > 0]
        if base:
            ratios.append(value / statistics.median(base))
    return statistics.median(ratios) - 1.0 if ratios else None


_HOST_AHEAD = 0.5  # queueing time under this share of the spans' time: the host was not what the GPU waited for
_BUSY_MIN_STEPS = 3  # steps with busy time on the suspect and every peer, to compare per step (else per op)


def attribute_busy(
    suspects: list[Suspect],
    traces: dict[int, RankTrace],
    busy: dict[int, BusyTimes],
    min_slowdown: float,
    notes: list[str],
) -> list[Suspect]:
    """Compute suspects judged on GPU busy time where the trace has it (``scan.busy``); returns the suspects kept.

    A span's excess is either kernel time (a slower GPU, or kernels time-sliced with another process: the GPU's
    own work took longer) or time in which the GPU idled between kernels (a host that queued the work late,
    launch gaps). The suspect's busy time is compared with the same baseline as the rule that named it (its
    stage's peers per step, or per op where fewer than 3 steps have busy time everywhere; the other lone stages
    per layer part; its own earlier steps): ``busy_excess``; only if the same spans in those windows were slower
    too (the span excess; else the windows missed the slowdown and the suspect is kept as named, with
    ``busy_window_span_excess``). At least ``min_slowdown`` of busy excess keeps it ``compute``. Below that,
    its excess is time the GPU did not run the rank's kernels. On layer parts across stages, where the host
    queued the spans in under half their length (``queue_share``), the host was ahead: the GPU ran another
    process's work between them, and it stays ``compute``. Otherwise it becomes ``host`` where its host also
    took ``min_slowdown`` longer to queue the same work (``enqueue_us``, same baseline), and is dropped with a
    note otherwise (idle time that neither its kernels nor its host explain: a launch-bound job paced by one
    host, or waits on another stream). Suspects without busy time on both sides are left as they are
    (``attribute_host``)."""
    groups = peer_groups(traces)
    kept = []
    for suspect in suspects:
        compared = _busy_comparison(suspect, busy, groups) if suspect.kind == "compute" else None
        if compared is None:
            kept.append(suspect)
            continue
        busy_excess, host_excess, basis = compared.busy_excess, compared.host_excess, compared.basis
        own_us, base_us, span_excess = compared.own_us, compared.base_us, compared.span_excess
        evidence = suspect.evidence
        if span_excess < min_slowdown:
            # The windows that measured busy time did not catch the slowdown (bursts, or a slowdown that began
            # later): their kernels cannot say what the other steps' excess was made of.
            evidence.update(busy_window_span_excess=round(span_excess, 4), busy_baseline=basis)
            kept.append(suspect)
            continue
        evidence.update(
            busy_excess=round(busy_excess, 4),
            busy_ms=own_us / 1000,
            baseline_busy_ms=base_us / 1000,
            busy_baseline=basis,
        )
        if busy_excess >= min_slowdown:
            evidence["why_compute"] = f"its GPU's kernels took {busy_excess:+.0%} longer than on {basis}"
            kept.append(suspect)
            continue
        if host_excess is not None:
            evidence["host_queue_excess"] = round(host_excess, 4)
        share = compared.queue_share
        if share is not None and share < _HOST_AHEAD:
            # Its host had queued each span's work in a fraction of the span, so it was not late: the GPU ran
            # other work between this rank's kernels (2x H200, a second process on the GPU: one layer part of
            # the slow stage 2.7 ms, queued in 0.9 ms; where the time slices fell between kernels, not inside
            # them, its busy time grew only 6%).
            evidence["queue_share"] = round(share, 3)
            evidence["why_compute"] = (
                f"its host queued the work in {share:.0%} of the spans' length, yet its kernels took only "
                f"{busy_excess:+.0%} against {basis}: its GPU ran other work between them (another process)"
            )
            kept.append(suspect)
            continue
        if host_excess is not None and host_excess >= min_slowdown:
            suspect.kind = "host"
            evidence["why_host"] = (
                f"its GPU's kernels took {busy_excess:+.0%} against {basis}: the excess is time its GPU idled "
                f"between kernels, and its host queued the same work {host_excess:+.0%} slower"
            )
            kept.append(suspect)
            continue
        queued = f"{host_excess:+.0%}" if host_excess is not None else "unknown"
        notes.append(
            f"rank {suspect.rank}: spans {suspect.slowdown:+.0%} against {basis}, but its GPU's kernels only "
            f"{busy_excess:+.0%} and its host's queueing {queued}: idle GPU time that neither explains (a "
            "launch-bound job paced by one host, or waits on another stream), not named"
        )
    return kept


@dataclass
class _BusyComparison:
    """A suspect's busy time against the baseline of the rule that named it (``basis``)."""

    busy_excess: float
    host_excess: Optional[float]  # the host's queueing time, compared the same way
    basis: str
    own_us: float
    base_us: float
    span_excess: float  # the same spans' net lengths compared the same way: did the sampled windows catch it?
    queue_share: Optional[float] = None  # own queueing time over own span time (GPU-paced layer parts)


def _busy_comparison(
    suspect: Suspect, busy: dict[int, BusyTimes], groups: dict[int, list[int]]
) -> Optional[_BusyComparison]:
    """The suspect's ``_BusyComparison``; None without busy time on both sides."""
    own = busy.get(suspect.rank)
    if own is None:
        return None
    rule = suspect.evidence.get("rule", "")
    if rule == HISTORY_RULE:
        (a, b), (c, d) = suspect.evidence["earlier_steps"], suspect.evidence["later_steps"]

        def halves(per_step: dict[int, float]) -> tuple[list[float], list[float]]:
            return [v for s, v in per_step.items() if a <= s <= b], [v for s, v in per_step.items() if c <= s <= d]

        before, after = halves(own.busy_per_step)
        if min(len(before), len(after)) < _BUSY_MIN_STEPS:
            return None
        # trimmed means, as the rule that named it (``compare.later_steps_change``)
        queue_before, queue_after = halves(own.enqueue_per_step)
        host = None
        if queue_before and queue_after:
            host = trimmed_mean(queue_after) / trimmed_mean(queue_before) - 1.0
        span_before, span_after = halves(own.span_per_step)
        span = trimmed_mean(span_after) / trimmed_mean(span_before) - 1.0
        base, value = trimmed_mean(before), trimmed_mean(after)
        return _BusyComparison(value / base - 1.0, host, "its own earlier steps", value, base, span)
    if suspect.evidence.get("across_stages"):
        # A typical layer (the sum of the parts' medians), as the per-step rule compares: time slicing with
        # another process stretched one part's kernels 3x and left the others alone (2x H200), which a median
        # over the parts hides.
        alone = [r for ranks in groups.values() if len(ranks) == 1 for r in ranks if r != suspect.rank]
        others = [busy[r] for r in alone if r in busy and busy[r].busy_per_part]
        found = _key_excess(own.busy_per_part, [t.busy_per_part for t in others])
        spans = _key_excess(own.span_per_part, [t.span_per_part for t in others])
        if found is None or spans is None or found[2] <= 0 or spans[2] <= 0:
            return None
        host = _key_excess(own.enqueue_per_part, [t.enqueue_per_part for t in others])
        host_excess = host[1] / host[2] - 1.0 if host and host[2] > 0 else None
        return _BusyComparison(
            found[1] / found[2] - 1.0,
            host_excess,
            "the other stages' same layer parts",
            found[1],
            found[2],
            spans[1] / spans[2] - 1.0,
            host[1] / spans[1] if host and spans[1] > 0 else None,
        )
    peers = [busy[r] for r in groups.get(suspect.pp, []) if r != suspect.rank and r in busy]
    if not peers:
        return None
    steps = sorted(set(own.busy_per_step).intersection(*(p.busy_per_step for p in peers)))
    if len(steps) >= _BUSY_MIN_STEPS:
        found = _step_excess(own.busy_per_step, [p.busy_per_step for p in peers], steps)
        spans = _step_excess(own.span_per_step, [p.span_per_step for p in peers], steps)
        queued = [s for s in steps if s in own.enqueue_per_step and all(s in p.enqueue_per_step for p in peers)]
        host = _step_excess(own.enqueue_per_step, [p.enqueue_per_step for p in peers], queued) if queued else None
        return _BusyComparison(found[0], host[0] if host else None, "its peers per step", found[1], found[2], spans[0])
    found = _key_excess(own.busy_per_key, [p.busy_per_key for p in peers])
    spans = _key_excess(own.span_per_key, [p.span_per_key for p in peers])
    if found is None or spans is None:
        return None
    host = _key_excess(own.enqueue_per_key, [p.enqueue_per_key for p in peers])
    return _BusyComparison(found[0], host[0] if host else None, "its peers per op", found[1], found[2], spans[0])


def _step_excess(own: dict[int, float], peers: list[dict[int, float]], steps: list[int]) -> tuple[float, float, float]:
    """Trimmed mean over ``steps`` of own / the peers' lower-half median, minus 1; and own and baseline medians."""
    base = [lower_half_median([p[s] for p in peers]) for s in steps]
    ratios = [own[s] / b - 1.0 for s, b in zip(steps, base) if b > 0]
    if not ratios:
        return 0.0, 0.0, 0.0
    return trimmed_mean(ratios), statistics.median(own[s] for s in steps), statistics.median(base)


def _key_excess(
    own: dict[str, list[float]], others: list[dict[str, list[float]]]
) -> Optional[tuple[float, float, float]]:
    """Median over the keys both sides have of own median / the others' lower-half median of medians, minus 1;
    and the sums of those medians (own, baseline). None when no key is shared."""
    ratios, own_sum, base_sum = [], 0.0, 0.0
    for key, values in own.items():
        theirs = [statistics.median(o[key]) for o in others if o.get(key)]
        if not values or not theirs:
            continue
        base = lower_half_median(theirs)
        if base > 0:
            value = statistics.median(values)
            ratios.append(value / base)
            own_sum, base_sum = own_sum + value, base_sum + base
    if not ratios:
        return None
    return statistics.median(ratios) - 1.0, own_sum, base_sum
