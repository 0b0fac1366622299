"""The wait rules of ``scan.analysis.rules``: ranks whose loader (``kind="data"``) or host (``kind="host"``) keeps
the others waiting, from the waits of ``scan.analysis.waits``.

The contract: waits per rank and step in (through the context: the loader's fetches, the host's gaps between
steps, the GPU's waits for its host inside steps), ``data`` and ``host`` suspects out, with the statistics of
``scan.analysis.compare``. Three rules, each by the same means:

* **data** (``data_wait_suspects``): the fetches per step against every other rank's, and against the rank's own
  earlier steps;
* **host gaps** (``host_gap_suspects``): the host's gaps between steps (Lightning's per-step work, logging,
  callbacks) against the ranks of the same stage, the other lone stages, and its own earlier steps;
* **host inside steps** (``host_in_step_suspects``): the time the GPU waited for its host inside the step's
  traced spans, by the same three comparisons, where it costs ``min_slowdown`` of a step.

A longer wait against the peers counts only where the rank also ended it *later* than they did (aligned clock),
or kept them waiting at a synchronisation (clock-free); waits are reported as the share of the job's median step
they cost (``_as_share_of_step``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from lightning_megatron.scan.analysis.compare import (
    compare_with_peers,
    later_steps_change,
    levels_of,
    lower_half_median,
    pooled_sigma,
)
from lightning_megatron.scan.analysis.measure import clock_sigma
from lightning_megatron.scan.analysis.report import Suspect
from lightning_megatron.scan.analysis.rules_common import (
    MIN_STEPS,
    DetectionContext,
    flagged,
    history_alpha,
    history_evidence,
    make_suspect,
    peer_groups,
    wait_evidence,
)
from lightning_megatron.scan.analysis.stage_rules import cross_stage_wait_suspects
from lightning_megatron.scan.analysis.waits import DataWaits, host_waits_in_steps, waited_for

__all__ = ["data_wait_suspects", "host_gap_suspects", "host_in_step_suspects"]


def _peer_suspects(context: DetectionContext, waits: DataWaits, min_impact_us: float, kind: str) -> list[Suspect]:
    """Compare the data-wait per step with every other rank's (``kind="host"``: the host gap, with the ranks of
    the same pipeline stage).

    A longer data-wait is only blamed on data loading where it also made the rank *late*: slow loading ends
    the wait after the peers' waits end (on the aligned clock). A wait that began earlier than the peers' and
    ended with them was spent waiting for them at a synchronisation point between the batches (an untraced
    collective, e.g. the trainer's per-batch stop decision); that is their slowness, not this rank's loading.
    The part of the excess that is not lateness is left out (``evidence["late_ms"]``)."""
    traces, per_rank, min_slowdown, min_z = context.traces, context.per_rank, context.min_slowdown, context.min_z
    samples, ends = waits.samples, waits.ends
    suspects = []
    everywhere = pooled_sigma(samples.values())
    # Every rank fetches the same batch, whatever its stage, so fetches are compared across the whole job (a
    # pipeline without data parallelism has no other peers); host gaps depend on the stage's work, so those are
    # compared within a stage.
    stages = peer_groups(traces)
    groups = {0: sorted(traces)} if kind == "data" else stages
    for _pp, ranks in sorted(groups.items()):
        members = [r for r in ranks if r in samples]
        if len(members) < 2:
            continue
        floor = max(pooled_sigma(samples[r] for r in members), everywhere)
        comparisons = compare_with_peers({r: levels_of({"data-wait": samples[r]}, floor) for r in members})
        for c in comparisons:
            if not flagged(c, min_slowdown, min_z):
                continue
            rank = c.member
            excess_us = c.median - c.baseline
            stage = [r for r in stages[traces[rank].pp] if r in samples]
            if len(stage) >= 2:
                late_us = _lateness(rank, stage, ends)
                # the clock alignment is only good to its uncertainty: lateness within it is no evidence either way
                tolerance = max(clock_sigma(traces[rank], traces[m]) for m in stage)
                if kind == "host" and all(m in waits.synced for m in stage):
                    # A stall before the ranks synchronise (Lightning's per-batch synchronisation between steps,
                    # a collective inside them) ends every rank's wait together: the others waited it out there,
                    # which says who was late without any clock.
                    late_us = max(late_us, waited_for(rank, stage, waits.synced))
                if rank in waits.waited_during:
                    # ... and inside steps, how long the peers were blocked during the rank's own gaps (at TP
                    # the step's other waits swing too much between steps to show it: ``host_waits_in_steps``)
                    late_us = max(late_us, statistics.median(waits.waited_during[rank].values()))
                if late_us + 2 * tolerance < 0.5 * excess_us:
                    continue  # mostly waiting for the others, not loading
                impact_us = min(excess_us, max(late_us, 0.0) + 2 * tolerance)
            else:
                # Alone in its stage: other stages end their steps at other moments, so lateness says nothing;
                # a fetch is the rank's own work (``kind="data"`` only: host gaps are compared within a stage).
                late_us = math.nan
                impact_us = excess_us
            if impact_us < min_impact_us:
                continue
            evidence = wait_evidence(c, late_us, len(members) - 1, impact_us, per_rank[rank])
            suspects.append(make_suspect(traces[rank], kind, c.excess, evidence))
    return suspects


def _history_suspects(
    context: DetectionContext, waits: DataWaits, suspects: list[Suspect], min_impact_us: float, kind: str
) -> list[Suspect]:
    """Ranks not yet named ``kind`` whose fetches (``kind="data"``) or host gaps (``"host"``) took longer in their
    later steps than in their own earlier ones (the compute rule against itself, ``HISTORY_RULE``): a loader or
    host that turned slow during the run. The peer rule cannot see that: one process has no peer, and a change
    in half of the steps does not make a rank slower than its peers in most of them."""
    traces, per_rank, min_slowdown = context.traces, context.per_rank, context.min_slowdown
    named = {s.rank for s in suspects if s.kind == kind}
    found = []
    for rank in sorted(waits.samples):
        if rank in named:
            continue
        per_step = dict(zip(waits.ends[rank], waits.samples[rank]))  # both filled step by step, in one order
        change = later_steps_change(per_step, MIN_STEPS, history_alpha(len(waits.samples)))
        evidence = history_evidence(change, min_slowdown, min_impact_us, len(waits.samples))
        if evidence is None:
            continue
        evidence.update(late_ms=None, step_ms=per_rank[rank].step_ms)  # against itself: lateness not measured
        found.append(make_suspect(traces[rank], kind, change.excess, evidence))
    return found


def host_in_step_suspects(context: DetectionContext) -> list[Suspect]:
    """``host`` suspects for the time a rank's GPU waited for its host *inside* its steps
    (``measure.host_waits_in_steps``: a callback that blocks before the step ends), by the rules of the host gaps
    between steps: against the peers of its stage (who also ended late), and against its own earlier steps.

    The healthy level of that time is small (about 1% of a step), so a relative excess says little;
    a suspect must cost ``min_slowdown`` of the job's median step (a stall worth naming slows the job) and its
    ``slowdown`` is that share. Ranks already named ``host`` (between steps) are left out: one cause, one name."""
    traces, suspects = context.traces, context.suspects
    median_step_us, min_slowdown = context.median_step_us, context.min_slowdown
    if not median_step_us:
        return []
    named = {s.rank for s in suspects if s.kind == "host"}
    waits = host_waits_in_steps(traces).without(named)
    bar_us = min_slowdown * median_step_us
    found = _peer_suspects(context, waits, bar_us, "host")
    found += cross_stage_wait_suspects(context, waits, bar_us)
    found += _history_suspects(context, waits, found, bar_us, "host")
    for suspect in found:
        suspect.evidence["where"] = "inside steps: the GPU waited for the host"
    return _as_share_of_step(found, median_step_us)


def data_wait_suspects(context: DetectionContext) -> list[Suspect]:
    """``data`` suspects: the loader's fetches per step against every other rank's (``_peer_suspects``; every rank
    fetches the same batch), and against the rank's own earlier steps (``_history_suspects``)."""
    waits, min_impact_us = context.data_waits, context.min_impact_us
    found = _peer_suspects(context, waits, min_impact_us, "data")
    found += _history_suspects(context, waits, context.suspects + found, min_impact_us, "data")
    return _as_share_of_step(found, context.median_step_us)


def host_gap_suspects(context: DetectionContext) -> list[Suspect]:
    """``host`` suspects for the host's gaps between steps: against the peers of the stage (``_peer_suspects``),
    against the other lone stages (``stage_rules.cross_stage_wait_suspects``, where the excess costs
    ``min_slowdown`` of a step) and against the rank's own earlier steps."""
    waits, median_step_us, min_slowdown = context.host_gaps, context.median_step_us, context.min_slowdown
    found = _peer_suspects(context, waits, context.min_impact_us, "host")
    found += cross_stage_wait_suspects(context, waits, min_slowdown * median_step_us)
    # Against its own history a host gap must cost min_slowdown of a step, as inside steps: with no peer to
    # compare with, a gap a fraction of a millisecond longer than before (under 1% of a step, seen in a
    # clean fit whose rank had one CPU) is drift, not a slow host.
    history_bar_us = max(context.min_impact_us, min_slowdown * median_step_us)
    found += _history_suspects(context, waits, context.suspects + found, history_bar_us, "host")
    return _as_share_of_step(found, median_step_us)


def _as_share_of_step(suspects: list[Suspect], median_step_us: float) -> list[Suspect]:
    """Waits (fetches, host gaps) are reported as the share of the job's median step they cost: their healthy
    level is near zero, so their own relative excess is huge and says nothing about the job (a 50 ms stall after
    a 0.9 ms gap read "+5360%"). That excess stays in ``evidence["wait_excess"]``."""
    for suspect in suspects:
        suspect.evidence["wait_excess"] = suspect.slowdown
        if median_step_us:
            suspect.slowdown = round(suspect.evidence["impact_ms"] * 1000 / median_step_us, 4)
    return suspects


def _lateness(rank: int, members: Sequence[int], ends: dict[int, dict[int, float]]) -> float:
    """Median over steps of how much later the rank's data-wait ended than its peers' (their lower-half median
    end: the healthy ones end first), on the aligned clock."""
    late = []
    for step, end in ends[rank].items():
        others = [ends[m][step] for m in members if m != rank and step in ends[m]]
        if others:
            late.append(end - lower_half_median(others))
    return statistics.median(late) if late else math.inf
