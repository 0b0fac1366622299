"""The rule of ``scan.analysis.detect`` for a rank whose training thread waited for a CPU: ``host``, whatever its spans
say.

The contract: ``scan.analysis.waits.cpu_waits`` in (the run-queue delay of each rank's training thread per step, from
the kernel, ``scan.tracing.sched``), ``host`` suspects out, with the statistics of ``scan.analysis.compare``.

A thread that is runnable but gets no CPU loses that time wherever it is: in a compute span (which then looks like
a slower GPU or CPU), in a host gap, or inside a collective it had entered (which then looks like waiting for the
others). Span lengths put the loss in the wrong place, or on the wrong rank: on CPUs at TP2 the peer of a rank
sharing its CPU with another process measured the slower compute. The counter does not: a training thread with
a CPU of its own waits for none, whatever its stage or its work, so each rank is compared with every other rank of
the job, step by step:

* per step, the rank's wait against the median of the others' in that step (what all ranks share in a step
  cancels; the median, not the lower half's, so that healthy steps give differences centred on zero for the
  test); the mean of these excesses is the time the rank lost per step, reported as its share of the job's median
  step (``slowdown``) and named where it is at least ``min_slowdown`` of it;
* the excesses must be above zero beyond chance: ``compare.sign_flip_p``, at ``_ALPHA`` (or ``_ALPHA_LARGE`` for
  twice the bar, bursts that spare some steps: a CPU limit stops the process in the periods it overran, not in
  every step), Bonferroni over the ranks tested.

A rank whose waits grew during the run is also compared with its own earlier steps
(``cpu_wait_history_suspects``: the compute rule against itself, ``rules_common.HISTORY_RULE``): one process has
no other rank, and a machine whose every rank lost its CPUs at once has no healthy one.

One rank, one name (``merge_cpu_waits``): a rank already named ``host`` keeps one ``host`` suspect, the one that
costs more per step (the other's figures become its evidence: a host gap 1 ms longer than before is not what a
training thread that waits 28 ms a step for a CPU lost), and a ``compute`` suspect whose excess the CPU wait
explains (on CPUs, a compute span that lost time slices) becomes evidence of the ``host`` suspect.

Ranks without the counter (not Linux, older traces) are left out; the comparison with the others needs two ranks
with it, the one with its own earlier steps 16 analysed steps (8 on each side of a split).
"""

from __future__ import annotations

import statistics
from typing import Any

from lightning_megatron.scan.analysis.compare import later_steps_change, sign_flip_p
from lightning_megatron.scan.analysis.report import Suspect
from lightning_megatron.scan.analysis.rules_common import (
    HISTORY_RULE,
    MIN_STEPS,
    DetectionContext,
    history_alpha,
    history_evidence,
    make_suspect,
)

__all__ = ["cpu_wait_history_suspects", "cpu_wait_rule", "cpu_wait_suspects", "merge_cpu_waits"]

_ALPHA = 0.01
_ALPHA_LARGE = 0.05
_MIN_STEPS = 6  # steps every compared rank has: 2^-6 is the smallest p a sign flip can give with fewer


def cpu_wait_suspects(context: DetectionContext) -> list[Suspect]:
    """``host`` suspects from the training threads' waits for a CPU (module docstring)."""
    traces, per_rank, waits = context.traces, context.per_rank, context.cpu_waits
    median_step_us, min_slowdown = context.median_step_us, context.min_slowdown
    ranks = sorted(r for r in waits.samples if r in traces)
    if len(ranks) < 2 or not median_step_us:
        return []
    per_step = {r: dict(zip(waits.ends[r], waits.samples[r])) for r in ranks}
    steps = sorted(set.intersection(*(set(per_step[r]) for r in ranks)))
    if len(steps) < _MIN_STEPS:
        return []
    bar_us = min_slowdown * median_step_us
    suspects = []
    for rank in ranks:
        others = [q for q in ranks if q != rank]
        excess = [per_step[rank][s] - statistics.median([per_step[q][s] for q in others]) for s in steps]
        lost_us = statistics.fmean(excess)
        if lost_us < bar_us:
            continue
        alpha = (_ALPHA_LARGE if lost_us >= 2 * bar_us else _ALPHA) / len(ranks)
        p_value = sign_flip_p(excess)
        if p_value >= alpha:
            continue
        evidence: dict[str, Any] = {
            "rule": "training thread's waits for a CPU (run-queue delay) per step against the other ranks'",
            "cpu_wait_ms": statistics.fmean(per_step[rank][s] for s in steps) / 1000,
            "baseline_ms": statistics.fmean(statistics.median([per_step[q][s] for q in others]) for s in steps) / 1000,
            "hit_steps_fraction": round(sum(e >= bar_us for e in excess) / len(steps), 3),
            "steps": len(steps),
            "p_value": p_value,
            "alpha": alpha,
            "peers": len(others),
            "impact_ms": lost_us / 1000,
            "step_ms": per_rank[rank].step_ms,
        }
        suspects.append(make_suspect(traces[rank], "host", lost_us / median_step_us, evidence))
    return suspects


def cpu_wait_history_suspects(context: DetectionContext, suspects: list[Suspect]) -> list[Suspect]:
    """``host`` suspects whose training thread waited longer for a CPU in its later steps than in its earlier ones,
    by ``min_slowdown`` of the job's median step; ranks the comparison with the others (in ``suspects``) already
    named for their CPU waits are left out. A rank named ``host`` by another rule is tested too:
    ``merge_cpu_waits`` keeps one name, with the larger cost."""
    traces, per_rank, waits = context.traces, context.per_rank, context.cpu_waits
    median_step_us, min_slowdown = context.median_step_us, context.min_slowdown
    if not median_step_us:
        return []
    named = {s.rank for s in suspects if s.kind == "host" and "cpu_wait_ms" in s.evidence}
    tested = [r for r in sorted(waits.samples) if r in traces]
    found = []
    for rank in tested:
        if rank in named:
            continue
        per_step = dict(zip(waits.ends[rank], waits.samples[rank]))
        change = later_steps_change(per_step, MIN_STEPS, history_alpha(len(tested)))
        evidence = history_evidence(change, min_slowdown, min_slowdown * median_step_us, len(tested))
        if change is None or evidence is None:
            continue
        evidence.update(rule=f"{HISTORY_RULE}: the training thread's waits for a CPU", step_ms=per_rank[rank].step_ms)
        found.append(make_suspect(traces[rank], "host", (change.after - change.before) / median_step_us, evidence))
    return found


def cpu_wait_rule(context: DetectionContext) -> list[Suspect]:
    """The rule as the pipeline runs it: against the others, then against its own history, merged into the
    suspects named so far (one name per rank); returns the whole revised list."""
    found = cpu_wait_suspects(context)
    found += cpu_wait_history_suspects(context, context.suspects + found)
    return merge_cpu_waits(context.suspects, found)


def _cpu_wait_ms(evidence: dict[str, Any]) -> float:
    """The CPU wait per step a suspect of this module found: against the others, or in its later steps."""
    return evidence["cpu_wait_ms"] if "cpu_wait_ms" in evidence else evidence["later_ms"]


_EXPLAINS = 1.5  # a compute excess up to this many times the CPU wait is the CPU wait (slack for noise)


def merge_cpu_waits(suspects: list[Suspect], found: list[Suspect]) -> list[Suspect]:
    """``suspects`` with the CPU-wait suspects ``found`` merged in, one name per rank (module docstring)."""
    merged = list(suspects)
    for suspect in found:
        named_host = [s for s in merged if s.rank == suspect.rank and s.kind == "host"]
        if named_host:
            other = named_host[0]
            if suspect.impact_ms <= other.impact_ms:
                other.evidence["cpu_wait_ms"] = round(_cpu_wait_ms(suspect.evidence), 3)
                continue
            # the CPU wait costs more than what the other rule found: it is the headline, the other its evidence
            suspect.evidence["host_gap"] = {
                "slowdown": other.slowdown,
                "impact_ms": other.impact_ms,
                "rule": other.evidence.get("rule", "host gaps against the peers'"),
            }
            merged.remove(other)
        for compute in [s for s in merged if s.rank == suspect.rank and s.kind == "compute"]:
            if compute.evidence.get("impact_ms", 0.0) <= _EXPLAINS * suspect.evidence["impact_ms"]:
                rule = compute.evidence.get("rule", "per-op medians")
                suspect.evidence["compute"] = {
                    "slowdown": compute.slowdown,
                    "impact_ms": compute.evidence.get("impact_ms"),
                    "rule": rule,
                }
                merged.remove(compute)
        merged.append(suspect)
    return merged
