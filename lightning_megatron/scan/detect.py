"""``lightning-megatron scan detect``: find the ranks that slow a run down, from MegaScan traces alone.

The contract: a trace directory in, a ``DetectionReport`` out; this module holds the rules that decide what is
slow (who is compared with whom, the thresholds, the lateness rule) and the CLI; the compute rules are in
``scan.compute_rules`` (peers) and ``scan.stage_rules`` (lone pipeline stages). ``scan.measure`` and
``scan.waits`` turn the rank files into measurements, ``scan.compare`` compares a member with its peers
statistically, and ``scan.report`` holds (and prints, serialises, logs) the result.

In synchronous training one slow GPU, one slow link or one slow data loader delays every rank: the others wait
for it inside collectives and pipeline sends/receives, so their *step* times are all equally long and say
nothing about who is to blame. Detection therefore compares only the time a rank spends on its *own* work with
the time its peers spend on the *same* work, after taking the waiting out:

* **compute**: net compute per op (per layer part when a trace has no per-microbatch spans), compared with the
  ranks of the same pipeline stage (all data- and tensor-parallel ranks with the same ``pp``), which run the
  same layers on equally sized microbatches;
* **links**: per ordered link the median transfer time per byte, compared with the links of the same class
  (direction, and whether both ends share a host: NVLink and network links are not peers). A span holding
  several ops (``send-forward-recv-backward``) can only stretch a transfer (a delayed send to Q also delays the
  receive from Q in it), so where every link of a class has enough transfers with both ends alone in their
  spans, only those are compared; a transfer whose span its host paced (posted late by a slow host) is left
  out. The sender is named, its receiver is ``peer``;
* **compute, per step**: the same net compute summed per step (steps with identical work: the same number of
  spans), each rank against each peer with Wilcoxon's signed-rank test over the steps (``compare``), then the
  10 %-trimmed mean excess over the healthy peers. Per-op medians cannot see a slowdown that hits fewer than
  about half of the spans (bursty contention: 40 % of the spans 50 % longer is 20 % per step); per-step sums
  do, and the paired rank test ignores a one-off burst. A rank is named when it is slower than at least half
  of its peers (p < 0.01 over its peers, Bonferroni) by ``min_slowdown`` and ``min_impact``;
  ``evidence["peers_wait_ms"]`` says how much longer its peers waited in collectives and gradient sync per
  step (who waited for whom, without clocks);
* **compute across stages** (``scan.stage_rules``): where a stage has a single rank (pipeline parallelism alone)
  and the trace has layer spans (``granularity="layer"``), transformer layer parts (attention, MLP, forward and
  backward) are the same work on every stage: those ranks are compared on them, per part and per step (a
  typical layer), on the spans their GPU paced;
* **compute against itself**: a rank's later steps against its own earlier ones (every split that leaves 8 steps
  on each side; a rank-sum and an exceedance test, family-wise by permutation), for what no peer can show: a
  lone stage without layer spans, one process alone, or every rank at once;
* **data**: the time in ``data`` spans per step compared with the ranks of the same pipeline stage: the
  loader's own fetches (``data-fetch``; traces before it recorded the whole host gap between steps as
  ``data-wait``, which also held Lightning's per-step work and named host slowness "data"); and, as compute,
  each rank against its own earlier steps (a loader that turned slow during the run; one process has no peer);
* **busy, not idle**: where GPU traces carry busy time (``busy_us``, ``scan.busy``), a compute suspect stays
  ``compute`` only if its kernel time grew too (``attribution.attribute_busy``); an excess of idle GPU time is
  ``host`` where its host queued the work slower, and otherwise dropped with a note;
* **host inside steps**: on GPUs without busy time, a compute suspect whose GPU reached most spans as soon as the
  host queued them (``queued_us``, ``scan.recorder``) is named ``host``: the host paced it, the GPU waited;
* **host**: the same rule on the host's gaps between steps (``host-gap``: Lightning's per-step work, logging,
  callbacks), less the fetches and the waits at Lightning's per-batch synchronisation of the ranks
  (``step-sync``): a rank whose host is slow (CPU contention) ends them late, or keeps the others waiting at
  that synchronisation (a stall before it ends every rank's gap together: only the waits say who was late,
  clock-free); and against its own earlier steps;
* **host inside steps**: the time a rank's GPU waited for its host between the step's traced spans (a callback
  that blocks before the step ends), by the same two rules, where it costs ``min_slowdown`` of a step; a stall
  before a collective inside the step (the optimizer's all-reduce) ends every peer's step together, so there the
  peers' longer waits inside the step say who was late (``waits.waited_for``, clock-free);
* **host across stages** (``scan.stage_rules``): ranks alone in their stage compare both kinds of host wait with
  the other lone stages, where the excess costs ``min_slowdown`` of a step;
* **waits for a CPU** (``scan.cpu_rules``): a rank whose training thread was runnable but had no CPU (the
  kernel's run-queue delay, ``scan.sched``: another process's time slices, a container's CPU limit) for
  ``min_slowdown`` of a step more than the other ranks', or than in its own earlier steps, is ``host``, wherever
  the lost time fell.

A member is flagged when its excess over the peers' healthy level is at least ``min_slowdown`` *and* its log
ratio to that level is at least ``min_z`` standard errors (timing noise is multiplicative; few or noisy samples
do not raise alarms) *and* it is slower than a healthy peer in at least 80 % of sample pairs (the *probability
of superiority*, a rank statistic: heavy-tailed or two-mode noise, such as CPU contention where an op takes
either 3 ms or 12 ms, can move a median without a consistent slowdown) *and* it costs at least ``min_impact`` of
a step (a data loader 2x slower than its peers' 20 µs does not matter). Suspects are ordered by the time they
cost per step (``evidence["impact_ms"]``), the common currency of compute, link and data slowness. A longer
data-wait only counts where the rank also ended it *later* than its peers (aligned clock): a wait that started
early and ended with the others was spent at a synchronisation point between the batches.

Collectives give independent evidence for compute suspects: a rank that is last in most instances of its
tensor-parallel group, imposing a wait about equal to its compute excess, is the slow one.

Detection cannot blame a rank when its whole peer group is slow (all ranks of a stage), nor a stage whose
groups have a single rank unless the trace has layer spans; a slowdown in fewer than about a third of the steps
is taken for hiccups (on purpose), and the per-step rule needs at least 8 traced steps.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

from lightning_megatron.scan.attribution import attribute_busy, attribute_host
from lightning_megatron.scan.compare import (
    compare_with_peers,
    later_steps_change,
    levels_of,
    lower_half_bias,
    lower_half_median,
    mad_sigma,
    pooled_sigma,
)
from lightning_megatron.scan.compute_rules import (
    MIN_STEPS,
    compute_suspects,
    flagged,
    history_alpha,
    history_evidence,
    make_suspect,
    own_history_suspects,
    peer_groups,
    step_suspects,
    wait_evidence,
)
from lightning_megatron.scan.cpu_rules import cpu_wait_history_suspects, cpu_wait_suspects, merge_cpu_waits
from lightning_megatron.scan.gpu_measure import busy_times, host_pacing
from lightning_megatron.scan.measure import (
    Link,
    RankTrace,
    Transfer,
    clock_sigma,
    collective_arrivals,
    keep_finished_steps,
    layer_parts_per_step,
    link_transfers,
    net_compute,
    read_traces,
    step_totals,
    summarize,
)
from lightning_megatron.scan.report import KINDS, DetectionReport, RankSummary, Suspect, log_to
from lightning_megatron.scan.stage_rules import (
    cross_stage_step_suspects,
    cross_stage_suspects,
    cross_stage_wait_suspects,
)
from lightning_megatron.scan.waits import DataWaits, cpu_waits, data_waits, host_waits_in_steps, waited_for

# the report's names and three statistics helpers were defined here before measuring, comparing and reporting
# became modules of their own; they stay importable from here
__all__ = [
    "KINDS",
    "Suspect",
    "RankSummary",
    "DetectionReport",
    "detect",
    "register_cli",
    "log_to",
    "lower_half_median",
    "lower_half_bias",
    "mad_sigma",
]


_MIN_CLEAN = 3  # transfers per link with both ends alone in their spans, to compare only those (see links)


def detect(
    trace_dir: Union[str, Path],
    *,
    min_slowdown: float = 0.08,
    min_z: float = 3.5,
    min_impact: float = 0.005,
    skip_steps: int = 0,
    since_step: Optional[int] = None,
) -> DetectionReport:
    """Rank the ranks (and links) of a MegaScan trace directory that are slower than their peers.

    ``min_slowdown``: smallest excess over the peers' healthy level that is reported (fraction, 0.08 = 8 %).
    ``min_z``: the log ratio to the baseline must also be this many standard errors (from the samples' MAD);
    with few samples and a lot of noise (CPU test runs) this is the test that binds.
    ``min_impact``: ... and the slowness must cost at least this fraction of the median step time per step.
    ``skip_steps``: leave out the first recorded steps (warm-up). ``since_step``: analyse only that step and
    later (MegaScan's online detection: a sliding window of recent steps, read in bounded memory).
    Besides, a suspect must be slower than a healthy peer in 80 % of sample pairs (see the module docstring).
    Missing or truncated rank files only produce warnings (in the report, and as Python warnings); a directory
    without rank files raises ``FileNotFoundError``."""
    trace_dir = Path(trace_dir)
    notes: list[str] = []
    traces = read_traces(trace_dir, notes, since_step)
    all_steps = keep_finished_steps(traces, skip_steps, notes)

    per_rank = {rank: summarize(trace) for rank, trace in traces.items()}
    compute_samples, layer_samples = net_compute(traces, per_rank)
    collective_stats = collective_arrivals(traces, per_rank)
    median_step_us = statistics.median([r.step_ms * 1000 for r in per_rank.values() if r.step_ms is not None] or [0.0])
    min_impact_us = min_impact * median_step_us

    suspects: list[Suspect] = []
    suspects += compute_suspects(
        traces,
        per_rank,
        compute_samples,
        layer_samples,
        collective_stats,
        min_slowdown,
        min_z,
        min_impact_us,
        notes,
    )
    totals = step_totals(traces)
    suspects = step_suspects(traces, per_rank, totals, suspects, min_slowdown, min_impact_us)
    parts_per_step = layer_parts_per_step(traces)
    suspects += cross_stage_suspects(traces, per_rank, parts_per_step, min_slowdown, min_z, min_impact_us)
    suspects += cross_stage_step_suspects(
        traces,
        per_rank,
        parts_per_step,
        layer_parts_per_step(traces, host_paced_too=True),
        layer_samples,
        suspects,
        min_slowdown,
        min_impact_us,
    )
    suspects += own_history_suspects(traces, per_rank, totals, suspects, min_slowdown, min_impact_us, notes)
    suspects = attribute_busy(suspects, traces, busy_times(traces), min_slowdown, notes)
    suspects = attribute_host(suspects, host_pacing(traces), traces, min_slowdown, notes)
    # transfers are matched here, not with the other measurements above, so that the warnings keep their order
    suspects += _link_suspects(traces, link_transfers(traces, notes), min_slowdown, min_z, min_impact_us, notes)
    for kind, waits in (("data", data_waits(traces)), ("host", data_waits(traces, "host"))):
        found = _data_suspects(traces, per_rank, waits, min_slowdown, min_z, min_impact_us, kind)
        if kind == "host":
            found += cross_stage_wait_suspects(
                traces, per_rank, waits, min_slowdown * median_step_us, min_slowdown, min_z
            )
        # Against its own history a host gap must cost min_slowdown of a step, as inside steps: with no peer to
        # compare with, a gap a fraction of a millisecond longer than before (under 1% of a step, seen in a
        # clean fit whose rank had one CPU) is drift, not a slow host.
        history_bar_us = max(min_impact_us, min_slowdown * median_step_us) if kind == "host" else min_impact_us
        found += _history_suspects(traces, per_rank, waits, suspects + found, min_slowdown, history_bar_us, kind)
        suspects += _as_share_of_step(found, median_step_us)
    suspects += _host_in_step_suspects(traces, per_rank, suspects, median_step_us, min_slowdown, min_z)
    waited = cpu_waits(traces)
    found = cpu_wait_suspects(traces, per_rank, waited, median_step_us, min_slowdown)
    found += cpu_wait_history_suspects(traces, per_rank, waited, suspects + found, median_step_us, min_slowdown)
    suspects = merge_cpu_waits(suspects, found)
    suspects = _fold_consequences(suspects)
    suspects.sort(key=lambda s: (-s.impact_ms, -s.slowdown, s.rank))

    for note in notes:
        warnings.warn(f"megascan detect: {note}", stacklevel=2)
    return DetectionReport(
        trace_dir=str(trace_dir),
        suspects=suspects,
        per_rank=per_rank,
        warnings=notes,
        params={"min_slowdown": min_slowdown, "min_z": min_z, "min_impact": min_impact, "skip_steps": skip_steps},
        steps=all_steps,
    )


_CONSEQUENCE_SHARE = 0.25
"""A host-gap or link suspect costing less than this share of its rank's compute suspect is a consequence of it."""


def _fold_consequences(suspects: list[Suspect]) -> list[Suspect]:
    """One rank, one cause: a slower GPU also lengthens what runs on it or waits for it, so a lesser suspect on a
    rank already named ``compute`` for several times as much per step (``_CONSEQUENCE_SHARE``) is kept as that
    suspect's evidence, not named as a second cause:

    * a longer host gap between steps (it holds round trips to the GPU, such as Lightning's per-step
      synchronisation): ``host_gap_ms`` (another process competing for one GPU: a host gap per step of a few
      percent of the compute it added, every such run);
    * a slower link from that rank (its communication kernels share the GPU too): ``link_ms`` and the link's
      ``link_peer`` (at PP2, the same fault: transfers longer by a tenth of the compute's excess)."""
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


def _link_suspects(
    traces: dict[int, RankTrace],
    transfers: dict[Link, list[Transfer]],
    min_slowdown: float,
    min_z: float,
    min_impact_us: float,
    notes: list[str],
) -> list[Suspect]:
    """Compare the links' transfer time per byte within a link class (direction, and whether both ends are on
    one host: NVLink and network links are not peers).

    A span that holds several ops (megatron-core's ``send-forward-recv-backward``) ends when the slowest of
    them is done and starts before the last of them is posted, so a transfer measured through it can only come
    out too long: a delayed send to Q also stretches the receive from Q in the same span, and the healthy
    reverse link would look slow too. Where every link of a class has at least ``_MIN_CLEAN`` transfers with
    both ends alone in their spans (pipeline warm-up and cool-down have them), only those are compared."""
    classes: dict[tuple[str, bool], list[Link]] = defaultdict(list)
    for link in transfers:
        src, dst, direction = link
        classes[(direction, traces[src].host == traces[dst].host)].append(link)
    # Two stages have one link each way: no link has a peer in its direction. Activations forward and their
    # gradients backward have the same shape, so the two directions become one class there (per byte).
    for same_host in (False, True):
        lone = [key for key, links in classes.items() if key[1] == same_host and len(links) < 2]
        if len(lone) == 2:
            classes[("both", same_host)] = [link for key in lone for link in classes.pop(key)]
    # Transfers whose span measured a slow host, not the link (``measure.host_paced``), are left out; a class
    # with a link left too few of them is not compared.
    paced = {link: [t for t in samples if not t.host_paced] for link, samples in transfers.items()}
    for key, links in list(classes.items()):
        if any(len(paced[link]) < _MIN_CLEAN for link in links):
            if any(len(paced[link]) < len(transfers[link]) for link in links):
                notes.append(
                    f"{key[0]} links: fewer than {_MIN_CLEAN} transfers of a link were not paced by their host; "
                    "links not compared"
                )
            del classes[key]
    transfers = paced
    chosen: dict[Link, list[Transfer]] = {}
    for links in classes.values():
        clean = all(sum(t.clean for t in transfers[link]) >= _MIN_CLEAN for link in links)
        for link in links:
            chosen[link] = [t for t in transfers[link] if t.clean or not clean]
    everywhere = pooled_sigma([t.us / t.bytes for t in samples] for samples in chosen.values())
    suspects = []
    for (direction, same_host), links in sorted(classes.items()):
        if len(links) < 2:
            continue
        floor = max(pooled_sigma([t.us / t.bytes for t in chosen[link]] for link in links), everywhere)
        levels = {}
        for link in links:
            samples = chosen[link]
            level = levels_of({"per_byte": [t.us / t.bytes for t in samples]}, floor)["per_byte"]
            # a clock error is systematic for a link: no number of samples averages it away. It counts when
            # the median rests on cross-clock samples.
            if sum(t.cross_clock for t in samples) >= 0.25 * len(samples):
                typical_bytes = statistics.median(t.bytes for t in samples)
                level.se = math.hypot(level.se, clock_sigma(traces[link[0]], traces[link[1]]) / typical_bytes)
            levels[link] = {"per_byte": level}
        for c in compare_with_peers(levels):
            if not flagged(c, min_slowdown, min_z):
                continue
            src, dst, _ = c.member
            samples = chosen[c.member]
            median_us = statistics.median(t.us for t in samples)
            per_step = len(transfers[c.member]) / max(len({t.step for t in transfers[c.member]}), 1)
            impact_us = per_step * median_us * c.excess / (1 + c.excess)
            if impact_us < min_impact_us:
                continue
            evidence = {
                "direction": direction,
                "link_class": f"{direction} {'intra-host' if same_host else 'inter-host'}",
                "median_us_per_mb": c.median * 1e6,
                "baseline_us_per_mb": c.baseline * 1e6,
                "median_transfer_ms": median_us / 1000,
                "transfers": len(samples),
                "clean_only": len(samples) < len(transfers[c.member]),
                "transfers_per_step": per_step,
                "z": round(c.z, 2),
                "superiority": round(c.superiority, 3),
                "compared_links": len(links) - 1,
                "impact_ms": impact_us / 1000,
            }
            suspects.append(make_suspect(traces[src], "link", c.excess, evidence, peer=dst))
    return suspects


def _data_suspects(
    traces: dict[int, RankTrace],
    per_rank: dict[int, RankSummary],
    waits: DataWaits,
    min_slowdown: float,
    min_z: float,
    min_impact_us: float,
    kind: str = "data",
) -> list[Suspect]:
    """Compare the data-wait per step with every other rank's (``kind="host"``: the host gap, with the ranks of
    the same pipeline stage).

    A longer data-wait is only blamed on data loading where it also made the rank *late*: slow loading ends
    the wait after the peers' waits end (on the aligned clock). A wait that began earlier than the peers' and
    ended with them was spent waiting for them at a synchronisation point between the batches (an untraced
    collective, e.g. the trainer's per-batch stop decision); that is their slowness, not this rank's loading.
    The part of the excess that is not lateness is left out (``evidence["late_ms"]``)."""
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
    traces: dict[int, RankTrace],
    per_rank: dict[int, RankSummary],
    waits: DataWaits,
    suspects: list[Suspect],
    min_slowdown: float,
    min_impact_us: float,
    kind: str,
) -> list[Suspect]:
    """Ranks not yet named ``kind`` whose fetches (``kind="data"``) or host gaps (``"host"``) took longer in their
    later steps than in their own earlier ones (the compute rule against itself, ``HISTORY_RULE``): a loader or
    host that turned slow during the run. The peer rule cannot see that: one process has no peer, and a change
    in half of the steps does not make a rank slower than its peers in most of them."""
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


def _host_in_step_suspects(
    traces: dict[int, RankTrace],
    per_rank: dict[int, RankSummary],
    suspects: list[Suspect],
    median_step_us: float,
    min_slowdown: float,
    min_z: float,
) -> list[Suspect]:
    """``host`` suspects for the time a rank's GPU waited for its host *inside* its steps
    (``measure.host_waits_in_steps``: a callback that blocks before the step ends), by the rules of the host gaps
    between steps: against the peers of its stage (who also ended late), and against its own earlier steps.

    The healthy level of that time is small (about 1% of a step), so a relative excess says little;
    a suspect must cost ``min_slowdown`` of the job's median step (a stall worth naming slows the job) and its
    ``slowdown`` is that share. Ranks already named ``host`` (between steps) are left out: one cause, one name."""
    if not median_step_us:
        return []
    named = {s.rank for s in suspects if s.kind == "host"}
    waits = host_waits_in_steps(traces).without(named)
    bar_us = min_slowdown * median_step_us
    found = _data_suspects(traces, per_rank, waits, min_slowdown, min_z, bar_us, "host")
    found += cross_stage_wait_suspects(traces, per_rank, waits, bar_us, min_slowdown, min_z)
    found += _history_suspects(traces, per_rank, waits, found, min_slowdown, bar_us, "host")
    for suspect in found:
        suspect.evidence["where"] = "inside steps: the GPU waited for the host"
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


# ----------------------------------------------------------------------------------------------- CLI


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``detect TRACE_DIR [--json OUT.json] [--min-slowdown 0.08]``: print the suspects table (exit code 0
    whether or not there are suspects: this is a report, not a check)."""
    parser = subparsers.add_parser(
        "detect",
        help="rank the slow ranks, links and data loaders of a MegaScan trace directory",
        description="Compare every rank with the ranks doing the same work and name the slow ones.",
    )
    parser.add_argument(
        "trace_dir", type=Path, metavar="TRACE_DIR", help="a MegaScan trace directory (one file per rank)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="also write the report as JSON")
    parser.add_argument("--min-slowdown", type=float, default=0.08, help="smallest reported excess (fraction)")
    parser.add_argument("--min-z", type=float, default=3.5, help="standard errors above the baseline (log ratio)")
    parser.add_argument("--min-impact", type=float, default=0.005, help="smallest cost per step (fraction of a step)")
    parser.add_argument("--skip-steps", type=int, default=0, help="leave out the first N steps (warm-up)")
    parser.add_argument("--per-rank", action="store_true", help="also print the per-rank medians")
    parser.set_defaults(func=_run_cli)
    return parser


def _run_cli(args: argparse.Namespace) -> int:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the table repeats the warnings
            report = detect(
                args.trace_dir,
                min_slowdown=args.min_slowdown,
                min_z=args.min_z,
                min_impact=args.min_impact,
                skip_steps=args.skip_steps,
            )
    except (FileNotFoundError, NotADirectoryError) as err:
        print(f"lightning-megatron scan detect: error: {err}", file=sys.stderr)
        return 2
    print(report.table(per_rank=args.per_rank))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.to_json() + "\n")
        print(f"report written to {args.json}")
    return 0
