"""What every detection rule shares: the ``DetectionContext`` a rule reads, the ``Rule`` record that declares it, and
the small helpers the rules of ``scan.analysis.rules`` have in common (who is compared with whom, when a comparison
is flagged, how a suspect and its evidence are made, the own-history rule's level and evidence).

Why a module of its own: the rules import these rather than each other (only the host-wait rules borrow the
cross-stage wait comparison of ``stage_rules``), so that a rule can move, change or go without touching another,
and the order they run in is declared in one place (``rules.RULES``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

from lightning_megatron.scan.analysis.bubbles import message_transfers
from lightning_megatron.scan.analysis.compare import Comparison, HistoryChange
from lightning_megatron.scan.analysis.gpu_measure import BusyTimes, busy_times, host_pacing
from lightning_megatron.scan.analysis.measure import (
    Link,
    RankTrace,
    StepTotal,
    Transfer,
    collective_arrivals,
    layer_parts_per_step,
    link_transfers,
    net_compute,
    step_totals,
    summarize,
)
from lightning_megatron.scan.analysis.report import RankSummary, Suspect
from lightning_megatron.scan.analysis.waits import DataWaits, cpu_waits, data_waits

__all__ = [
    "HISTORY_ALPHA",
    "HISTORY_RULE",
    "MIN_STEPS",
    "RELATIVE_HISTORY_RULE",
    "DetectionContext",
    "Rule",
    "comparison_evidence",
    "flagged",
    "history_alpha",
    "history_evidence",
    "make_suspect",
    "peer_groups",
    "wait_evidence",
]

# A suspect must be slower than a healthy peer in at least this fraction of sample pairs (``Comparison.superiority``):
# the median test assumes well-behaved noise; this one holds for heavy-tailed or two-mode noise too (CPU
# contention: a rank's op takes either 3 ms or 12 ms), where a median can move without a consistent slowdown.
_MIN_SUPERIORITY = 0.8
MIN_STEPS = 8  # steps of identical work for the per-step rule (its smallest p-value is then 1/256)
HISTORY_ALPHA = 0.01  # own-history rules: later steps against earlier ones, family-wise over the ranks tested

HISTORY_RULE = "later steps against the rank's own earlier steps"
RELATIVE_HISTORY_RULE = f"{HISTORY_RULE}, relative to the other ranks'"
"""The same rule where other ranks were beside it: its change stood relative to theirs too."""


@dataclass
class DetectionContext:
    """Everything a rule reads: the traces, the thresholds, the suspects named by the rules before it, and the
    measurements, each made once on first use (``cached_property``) so that a rule pays only for what it reads.

    ``notes`` collects the warnings of measuring and of every rule, in the order they run. ``per_rank``,
    ``compute_samples``, ``layer_samples`` and ``collective_stats`` are measured when the context is made
    (``measure``): they fill the per-rank summaries the report shows and the job's median step."""

    traces: dict[int, RankTrace]
    per_rank: dict[int, RankSummary]
    min_slowdown: float = 0.08
    min_z: float = 3.5
    min_impact: float = 0.005
    notes: list[str] = field(default_factory=list)
    suspects: list[Suspect] = field(default_factory=list)
    compute_samples: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # net compute per op (µs)
    layer_samples: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # ... per layer part
    collective_stats: dict[int, dict[str, Any]] = field(default_factory=dict)  # arrival order per group

    @classmethod
    def measure(
        cls,
        traces: dict[int, RankTrace],
        notes: Optional[list[str]] = None,
        *,
        min_slowdown: float = 0.08,
        min_z: float = 3.5,
        min_impact: float = 0.005,
    ) -> DetectionContext:
        """The context of ``traces``: per-rank summaries, net compute and collective arrivals measured."""
        per_rank = {rank: summarize(trace) for rank, trace in traces.items()}
        compute_samples, layer_samples = net_compute(traces, per_rank)
        return cls(
            traces=traces,
            per_rank=per_rank,
            min_slowdown=min_slowdown,
            min_z=min_z,
            min_impact=min_impact,
            notes=[] if notes is None else notes,
            compute_samples=compute_samples,
            layer_samples=layer_samples,
            collective_stats=collective_arrivals(traces, per_rank),
        )

    @cached_property
    def median_step_us(self) -> float:
        """The job's median step (µs): the median over ranks of each rank's median step; 0 without steps."""
        steps = [r.step_ms * 1000 for r in self.per_rank.values() if r.step_ms is not None]
        return statistics.median(steps or [0.0])

    @property
    def min_impact_us(self) -> float:
        """The smallest cost per step a suspect must have (``min_impact`` of the median step)."""
        return self.min_impact * self.median_step_us

    @cached_property
    def totals(self) -> dict[int, dict[int, StepTotal]]:
        return step_totals(self.traces)

    @cached_property
    def parts_per_step(self) -> dict[int, dict[int, dict[str, list[float]]]]:
        """Layer parts per step, on the spans each GPU paced."""
        return layer_parts_per_step(self.traces)

    @cached_property
    def every_part_per_step(self) -> dict[int, dict[int, dict[str, list[float]]]]:
        """Layer parts per step, host-paced spans too."""
        return layer_parts_per_step(self.traces, host_paced_too=True)

    @cached_property
    def busy(self) -> dict[int, BusyTimes]:
        return busy_times(self.traces)

    @cached_property
    def pacing(self) -> dict[int, float]:
        return host_pacing(self.traces)

    @cached_property
    def transfers(self) -> dict[Link, list[Transfer]]:
        """p2p transfers matched per link, bubble-free where a span holds several operations
        (``measure.link_transfers``); the unmatched ones are noted when first read."""
        return link_transfers(self.traces, self.notes, message_transfers(self.traces))

    @cached_property
    def data_waits(self) -> DataWaits:
        return data_waits(self.traces)

    @cached_property
    def host_gaps(self) -> DataWaits:
        return data_waits(self.traces, "host")

    @cached_property
    def cpu_waits(self) -> DataWaits:
        return cpu_waits(self.traces)


@dataclass(frozen=True)
class Rule:
    """One step of detection, as ``rules.RULES`` declares it.

    ``name``: what the rule is, as the docs call it; ``names``: the suspect kind it names (``"compute"``, ...;
    a rule that judges earlier suspects says what it can turn them into, e.g. ``"compute -> host"``); ``reads``:
    the earlier rules whose suspects it reads (to add its evidence to theirs, leave their ranks out, or judge
    them), each the ``name`` of a rule before it. ``run`` takes the context; a rule that ``finds`` returns new
    suspects, appended to ``context.suspects``; one that does not returns the whole revised list (it renames,
    merges or drops suspects)."""

    name: str
    names: str
    reads: tuple[str, ...]
    run: Callable[[DetectionContext], list[Suspect]]
    finds: bool = True

    def apply(self, context: DetectionContext) -> None:
        result = self.run(context)
        context.suspects = [*context.suspects, *result] if self.finds else list(result)


def peer_groups(traces: dict[int, RankTrace]) -> dict[int, list[int]]:
    """Ranks that do the same work: one group per pipeline stage (all data- and tensor-parallel ranks)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for rank, trace in sorted(traces.items()):
        groups[trace.pp].append(rank)
    return groups


def flagged(c: Comparison, min_slowdown: float, min_z: float) -> bool:
    """Whether a member of ``compare_with_peers`` is slow: by ``min_slowdown``, ``min_z`` and superiority."""
    return c.excess >= min_slowdown and c.z >= min_z and c.superiority >= _MIN_SUPERIORITY


def make_suspect(
    trace: RankTrace, kind: str, slowdown: float, evidence: dict[str, Any], peer: Optional[int] = None
) -> Suspect:
    return Suspect(**trace.coordinates, kind=kind, slowdown=round(slowdown, 4), peer=peer, evidence=evidence)


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


def history_alpha(ranks_tested: int) -> float:
    """The level of the own-history test of each of ``ranks_tested`` ranks (Bonferroni over them)."""
    return HISTORY_ALPHA / max(1, ranks_tested)


def history_evidence(
    change: Optional[HistoryChange], min_slowdown: float, min_impact_us: float, ranks_tested: int
) -> Optional[dict[str, Any]]:
    """The evidence of a suspect named against its own history (``HISTORY_RULE``), or None where ``change`` is not
    a slowdown by ``min_slowdown`` and ``min_impact_us`` per step at p below ``HISTORY_ALPHA`` shared among the
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
