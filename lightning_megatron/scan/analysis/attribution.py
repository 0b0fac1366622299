"""Is a compute suspect a slow GPU, a late host, or nothing? The attribution step of ``scan.analysis.detect``.

The contract: compute suspects in (from the rules of ``scan.analysis.compute_rules`` and ``scan.analysis.stage_rules``),
the same suspects out, each kept as ``compute``, renamed ``host``, or dropped with a note; the suspects of other kinds
pass through unchanged.

A compute span is GPU wall time between two events, so a slower GPU, kernels time-sliced with another process,
and a host that queued the work late all make it longer. Two measurements tell them apart:

* **GPU busy time** (``attribute_busy``, where the trace has it: ``scan.tracing.busy``, ``scan.analysis.gpu_measure``):
  the suspect's kernel time against the same baseline as the rule that named it. Kernels that took longer, over
  all or against its peers in any one sampled step, are the GPU's own work (``compute``); an excess made of
  idle time between kernels is the host's, if its host also took longer to queue the same work, by enough to
  explain the excess, and nobody's otherwise.
* **Queue fields** (``attribute_host``, elsewhere): a rank whose GPU started most spans as soon as its host queued
  them was paced by its host; it is named ``host`` only if that host queued the same ops slower than its peers'.

Either names ``host`` only where the job pays that pace: traced steps that ran eagerly in place of the job's
CUDA-graph replays (``RankTrace.eager_in_place_of_replays``) show a launch pace the replays do not have.

Kept apart from the rules because it judges their output with other measurements; the rules decide who is slow,
this module what kind of slow. Last, ``fold_consequences`` keeps one cause per rank: a lesser host-gap or link
suspect on a rank named ``compute`` becomes that suspect's evidence.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from lightning_megatron.scan.analysis.compare import lower_half_median, trimmed_mean
from lightning_megatron.scan.analysis.gpu_measure import BusyTimes
from lightning_megatron.scan.analysis.measure import RankTrace
from lightning_megatron.scan.analysis.report import Suspect
from lightning_megatron.scan.analysis.rules_common import (
    HISTORY_RULE,
    RELATIVE_HISTORY_RULE,
    DetectionContext,
    peer_groups,
)

__all__ = ["attribute_busy", "attribute_host", "fold_consequences"]

# A host named for a suspect's excess must have queued the work at least this share of that excess slower: a
# host a little slower cannot explain spans twice as long or more (at TP2 with sequence parallelism the
# tensor-parallel ranks' spans differ severalfold with the waits inside them, clean runs too, and such ranks were
# named ``host`` for a GPU or memory contention, on the rank or on its peer, by both attributions). Where the
# host did pace the spans the two excesses agree (the evaluation: docs/evaluation/megascan.md).
_HOST_EXPLAINS = 0.5


def attribute_host(context: DetectionContext) -> list[Suspect]:
    """Compute suspects whose spans the host paced become ``host`` suspects (GPU traces with queue fields), or are
    dropped where their host was no slower than their peers'. Returns the suspects kept.

    A slow GPU runs behind a full queue; a GPU whose host is slow (CPU contention, a Python-heavy step) reaches
    each span as soon as it is queued, and its spans last as long as the host takes. Where at least half of a
    suspect's compute spans were host-paced and 30 points more of them than of its peers', the host paced it.
    That alone does not make the host slow: in a launch-bound job (little GPU work per kernel) one host always
    paces the step, and its peers' GPUs, ahead, wait in the collectives, so the pacing rank's net compute looks
    several times theirs although its host is no slower. So the host is named only where it took longer than its
    peers' hosts to queue the same ops (``enqueue_us``, per op, median of the ratios) by ``min_slowdown`` and by
    half the suspect's slowdown at least (what it explains); otherwise the suspect is dropped with a note."""
    suspects, pacing, traces = context.suspects, context.pacing, context.traces
    min_slowdown, notes = context.min_slowdown, context.notes
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
            if excess < max(min_slowdown, _HOST_EXPLAINS * suspect.slowdown):
                notes.append(
                    f"rank {suspect.rank}: its GPU waited for its host (host-paced spans {100 * own:.0f}%), but "
                    f"the host queued the same ops only {100 * excess:+.0f}% slower than its peers' while its "
                    f"spans took {suspect.slowdown:+.0%}: a launch-bound job paced by one host, or waits on its "
                    "peers, not a slow host (not named)"
                )
                continue
        if _launch_pace_not_paid(suspect, traces, "unknown" if excess is None else f"{excess:+.0%}", notes):
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


def _launch_pace_not_paid(suspect: Suspect, traces: dict[int, RankTrace], queued: str, notes: list[str]) -> bool:
    """Whether a suspect about to be named ``host`` for its launch pace was measured on steps the job replays as
    a CUDA graph (``RankTrace.eager_in_place_of_replays``); then it is dropped with a note. A replay is one launch,
    so its host's pace kernel by kernel costs the job nothing: MegaScan made the traced steps eager to look into
    them (eagerly traced DP2 steps of clean fits named a rank ``host`` for queueing slower while its kernels
    took as long as its peer's; docs/evaluation/megascan.md). Host time outside the graph (gaps between steps,
    hooks, the loader) has rules of its own, which this does not touch."""
    if not traces[suspect.rank].eager_in_place_of_replays:
        return False
    notes.append(
        f"rank {suspect.rank}: its GPU idled between kernels in eagerly traced steps ({suspect.slowdown:+.0%}, its "
        f"host's queueing {queued}), but the job replays those steps as a CUDA graph, which its host does not "
        "launch kernel by kernel: not what the job pays (not named; MegaScan(trace_replays=True) traces the "
        "replays themselves)"
    )
    return True


_HOST_AHEAD = 0.5  # queueing time under this share of the spans' time: the host was not what the GPU waited for
_BUSY_MIN_STEPS = 3  # steps with busy time on the suspect and every peer, to compare per step (else per op)


def attribute_busy(context: DetectionContext) -> list[Suspect]:
    """Compute suspects judged on GPU busy time where the trace has it (``scan.tracing.busy``); returns the suspects
    kept.

    A span's excess is either kernel time (a slower GPU, or kernels time-sliced with another process: the GPU's
    own work took longer) or time in which the GPU idled between kernels (a host that queued the work late,
    launch gaps). The suspect's busy time is compared with the same baseline as the rule that named it (its
    stage's peers per step, or per op where fewer than 3 steps have busy time everywhere; the other lone stages
    per layer part; its own earlier steps): ``busy_excess``; only if the same spans in those windows were slower
    too (the span excess; else the windows missed the slowdown and the suspect is kept as named, with
    ``busy_window_span_excess``). At least ``min_slowdown`` of busy excess keeps it ``compute``, and so does as
    much in any one sampled step against its peers, or across stages the typical layer of one sampled step against
    the other stages' (``busy_window_excess``: a GPU slowed in bursts; nothing on the host lengthens a rank's own
    kernels). Below that, its excess is time the GPU did not run the rank's
    kernels. On layer parts across stages, where the host queued the spans in under half their length
    (``queue_share``), the host was ahead: the GPU ran another process's work between them, and it stays
    ``compute``. Otherwise it becomes ``host`` where its host also took longer to queue the same work
    (``enqueue_us``, same baseline) by ``min_slowdown`` and by half the spans' excess at least (what it explains),
    and is dropped with a note otherwise (idle time that neither its kernels nor its host explain: a launch-bound
    job paced by one host, or waits on another stream). Suspects without busy time on both sides are left as
    they are (``attribute_host``)."""
    suspects, traces, busy = context.suspects, context.traces, context.busy
    min_slowdown, notes = context.min_slowdown, context.notes
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
        window = compared.window_excess
        if window is not None and window >= min_slowdown:
            # Kernels longer than the peers' in one sampled window: only the GPU makes a rank's own kernels longer
            # (a host, a loader or the CPU cannot), so the GPU was slowed part of the time, and the slower queueing
            # is what a shared GPU does to the launches of a host-paced step (eager DP2, another process on the
            # GPU in bursts: kernels much longer in one of two windows and as before in the other, host queueing
            # slower too; fits without a GPU fault stayed within a few percent in each window).
            evidence["busy_window_excess"] = round(window, 4)
            evidence["why_compute"] = (
                f"its GPU's kernels took {window:+.0%} longer than on {basis} in one sampled step ({busy_excess:+.0%} "
                "over all): its GPU was slowed part of the time (another process, bursts); a host cannot make its "
                "own kernels longer"
            )
            kept.append(suspect)
            continue
        if host_excess is not None:
            evidence["host_queue_excess"] = round(host_excess, 4)
        share = compared.queue_share
        if share is not None and share < _HOST_AHEAD:
            # Its host had queued each span's work in a fraction of the span, so it was not late: the GPU ran
            # other work between this rank's kernels (a second process on the GPU: one layer part of the slow
            # stage queued in a third of its span; where the time slices fell between kernels, not inside them,
            # its busy time grew only a little).
            evidence["queue_share"] = round(share, 3)
            evidence["why_compute"] = (
                f"its host queued the work in {share:.0%} of the spans' length, yet its kernels took only "
                f"{busy_excess:+.0%} against {basis}: its GPU ran other work between them (another process)"
            )
            kept.append(suspect)
            continue
        if host_excess is not None and host_excess >= max(min_slowdown, _HOST_EXPLAINS * span_excess):
            if _launch_pace_not_paid(suspect, traces, f"{host_excess:+.0%}", notes):
                continue
            suspect.kind = "host"
            evidence["why_host"] = (
                f"its GPU's kernels took {busy_excess:+.0%} against {basis}: the excess is time its GPU idled "
                f"between kernels, and its host queued the same work {host_excess:+.0%} slower"
            )
            kept.append(suspect)
            continue
        queued = f"{host_excess:+.0%}" if host_excess is not None else "unknown"
        notes.append(
            f"rank {suspect.rank}: spans {suspect.slowdown:+.0%} against {basis} ({span_excess:+.0%} in the busy "
            f"windows), but its GPU's kernels only {busy_excess:+.0%} and its host's queueing {queued}: idle GPU "
            "time that neither explains (a launch-bound job paced by one host, or waits on another stream), not named"
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
    window_excess: Optional[float] = None  # the largest busy excess over the peers in one sampled step


def _busy_comparison(
    suspect: Suspect, busy: dict[int, BusyTimes], groups: dict[int, list[int]]
) -> Optional[_BusyComparison]:
    """The suspect's ``_BusyComparison``; None without busy time on both sides."""
    own = busy.get(suspect.rank)
    if own is None:
        return None
    rule = suspect.evidence.get("rule", "")
    if rule in (HISTORY_RULE, RELATIVE_HISTORY_RULE):  # its busy time against its own earlier steps
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
        # another process stretched one part's kernels severalfold and left the others alone, which a median
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
            _largest_layer_excess(own.busy_per_step_part, [t.busy_per_step_part for t in others]),
        )
    peers = [busy[r] for r in groups.get(suspect.pp, []) if r != suspect.rank and r in busy]
    if not peers:
        return None
    steps = sorted(set(own.busy_per_step).intersection(*(p.busy_per_step for p in peers)))
    window = _largest_step_excess(own.busy_per_step, [p.busy_per_step for p in peers], steps)
    if len(steps) >= _BUSY_MIN_STEPS:
        found = _step_excess(own.busy_per_step, [p.busy_per_step for p in peers], steps)
        spans = _step_excess(own.span_per_step, [p.span_per_step for p in peers], steps)
        queued = [s for s in steps if s in own.enqueue_per_step and all(s in p.enqueue_per_step for p in peers)]
        host = _step_excess(own.enqueue_per_step, [p.enqueue_per_step for p in peers], queued) if queued else None
        return _BusyComparison(
            found[0],
            host[0] if host else None,
            "its peers per step",
            found[1],
            found[2],
            spans[0],
            window_excess=window,
        )
    found = _key_excess(own.busy_per_key, [p.busy_per_key for p in peers])
    spans = _key_excess(own.span_per_key, [p.span_per_key for p in peers])
    if found is None or spans is None:
        return None
    host = _key_excess(own.enqueue_per_key, [p.enqueue_per_key for p in peers])
    return _BusyComparison(
        found[0], host[0] if host else None, "its peers per op", found[1], found[2], spans[0], window_excess=window
    )


_MIN_WINDOW_PARTS = 2  # layer parts with busy time on every stage in a sampled step, to compare that step


def _largest_layer_excess(
    own: dict[int, dict[str, list[float]]], others: list[dict[int, dict[str, list[float]]]]
) -> Optional[float]:
    """The largest, over the sampled steps, of the typical layer's busy time (the sum over the layer parts every
    stage has that step of each part's median) against the other stages' lower-half median, minus 1; None
    without such a step. The across-stages ``window_excess``: a GPU shared with another process in bursts, or
    whose kernels one window sampled while the other process ran (in a PP2 x VPP2 fit with another process on
    the first stage's GPU every layer part's kernels took 8-9% longer than the other stage's in one window, 5-7%
    in the other; 1-2% in the clean fit)."""
    ratios = []
    for step, parts in own.items():
        theirs = [o.get(step, {}) for o in others]
        shared = [p for p in parts if parts[p] and all(t.get(p) for t in theirs)]
        if len(shared) < _MIN_WINDOW_PARTS:
            continue
        value = sum(statistics.median(parts[p]) for p in shared)
        base = lower_half_median([sum(statistics.median(t[p]) for p in shared) for t in theirs])
        if base > 0:
            ratios.append(value / base - 1.0)
    return max(ratios) if ratios else None


def _largest_step_excess(own: dict[int, float], peers: list[dict[int, float]], steps: list[int]) -> Optional[float]:
    """The largest own / the peers' lower-half median, minus 1, over ``steps`` (None without any)."""
    ratios = [own[s] / base - 1.0 for s in steps if (base := lower_half_median([p[s] for p in peers])) > 0]
    return max(ratios) if ratios else None


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


_CONSEQUENCE_SHARE = 0.25
"""A host-gap or link suspect costing less than this share of its rank's compute suspect is a consequence of it."""


def fold_consequences(context: DetectionContext) -> list[Suspect]:
    """One rank, one cause: a slower GPU also lengthens what runs on it or waits for it, so a lesser suspect on a
    rank already named ``compute`` for several times as much per step (``_CONSEQUENCE_SHARE``) is kept as that
    suspect's evidence, not named as a second cause:

    * a longer host gap between steps (it holds round trips to the GPU, such as Lightning's per-step
      synchronisation): ``host_gap_ms`` (another process competing for one GPU: a host gap per step of a few
      percent of the compute it added, every such run);
    * a slower link from that rank (its communication kernels share the GPU too): ``link_ms`` and the link's
      ``link_peer`` (at PP2, the same fault: transfers longer by a tenth of the compute's excess)."""
    suspects = context.suspects
    compute = {s.rank: s for s in suspects if s.kind == "compute"}
    kept = []
    for suspect in suspects:
        cause = compute.get(suspect.rank)
        minor = cause is not None and suspect.impact_ms < _CONSEQUENCE_SHARE * cause.impact_ms
        if minor and suspect.kind == "host" and "late_ms" in suspect.evidence:  # from the host-gap comparison
            key = "host_in_step_ms" if "where" in suspect.evidence else "host_gap_ms"
            cause.evidence[key] = round(suspect.impact_ms, 3)
            continue
        if minor and suspect.kind == "link":
            cause.evidence.update(link_ms=round(suspect.impact_ms, 3), link_peer=suspect.peer)
            continue
        kept.append(suspect)
    return kept
