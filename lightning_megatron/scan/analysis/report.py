"""What ``scan.analysis.detect`` found, and how it is shown: suspects, per-rank medians, the text table, JSON, metrics.

The contract: plain data and its presentations, nothing else. ``Suspect`` (one slow rank, link or data loader),
``RankSummary`` (a rank's medians) and ``DetectionReport`` (both, with warnings and parameters) round-trip
through JSON (``to_json`` / ``from_json``) and print as a table (``table``); ``log_to`` hands the numbers to a
Lightning-logger-like object. It imports nothing from ``scan``: the callback broadcasts reports, and users read
JSON reports back, without the trace reader or the detector.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Protocol, Union

__all__ = [
    "KINDS",
    "REPORT_FILE",
    "DetectionReport",
    "RankSummary",
    "Suspect",
    "bubble_lines",
    "expert_lines",
    "evidence_text",
    "log_to",
]

REPORT_FILE = "megascan-report.json"  # MegaScan's report, beside the rank files (the TensorBoard plugin reads it)

KINDS = ("compute", "link", "data", "host")  # what a Suspect can be


@dataclass
class Suspect:
    """One rank (for ``kind == "link"``: one ordered link, from ``rank`` to ``peer``) that is slower than its peers.

    ``slowdown`` is a fraction (0.21: 21 % slower): for ``compute`` and ``link``, the excess over the healthy level
    of net compute time or of transfer time per byte; for ``data`` and ``host``, whose healthy waits are near
    zero, the share of the job's median step that the wait costs (its own relative excess is in
    ``evidence["wait_excess"]``). ``evidence`` holds the numbers behind it; its ``impact_ms`` (time this costs
    per step) orders the suspects."""

    rank: int
    dp: int
    pp: int
    tp: int
    host: str
    kind: str
    slowdown: float
    peer: Optional[int] = None
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def impact_ms(self) -> float:
        return float(self.evidence.get("impact_ms", 0.0))


@dataclass
class RankSummary:
    """Per-rank medians over the steps analysed (``None`` where the trace has no such spans).

    ``compute_ms`` is net compute per step (communication and data waits taken out); ``last_arrival_fraction``
    and ``imposed_wait_ms`` describe the rank's collectives (fraction of instances it started last, mean wait it
    imposed on the other members when it did)."""

    rank: int
    dp: int
    pp: int
    tp: int
    host: str
    steps: int
    step_ms: Optional[float] = None
    compute_ms: Optional[float] = None
    data_ms: Optional[float] = None
    collectives: int = 0
    last_arrival_fraction: Optional[float] = None
    imposed_wait_ms: Optional[float] = None


@dataclass
class DetectionReport:
    """What ``detect`` found: suspects ranked by severity (time lost per step), per-rank medians, warnings, and the
    ranks that could not be judged (``unjudged_ranks``: rank → why, e.g. a trace file cut short): missing data is
    never "nothing abnormal"."""

    trace_dir: str
    suspects: list[Suspect]
    per_rank: dict[int, RankSummary]
    warnings: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    unjudged_ranks: dict[int, str] = field(default_factory=dict)
    bubbles: Optional[dict[str, Any]] = None
    """Pipeline bubbles apart from transfers (``scan.analysis.bubbles.measure_bubbles``); None without pipeline messages."""
    experts: Optional[dict[str, Any]] = None
    """Tokens per expert per MoE layer (``scan.analysis.experts.expert_load``); None without MoE layers."""

    @property
    def abnormal(self) -> bool:
        return bool(self.suspects)

    @property
    def judged_ranks(self) -> list[int]:
        """The ranks the rules had data for."""
        return sorted(set(self.per_rank) - set(self.unjudged_ranks))

    @property
    def judged(self) -> bool:
        """Whether any rank could be judged (a report of none is no verdict: the CLI exits non-zero)."""
        return bool(self.judged_ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_dir": self.trace_dir,
            "suspects": [asdict(s) for s in self.suspects],
            "per_rank": {str(rank): asdict(summary) for rank, summary in sorted(self.per_rank.items())},
            "warnings": list(self.warnings),
            "params": dict(self.params),
            "steps": list(self.steps),
            "unjudged_ranks": {str(rank): why for rank, why in sorted(self.unjudged_ranks.items())},
            "bubbles": self.bubbles,
            "experts": self.experts,
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, source: Union[str, bytes, dict[str, Any]]) -> DetectionReport:
        """The report back from ``to_json()`` text (or its parsed dict)."""
        data = source if isinstance(source, dict) else json.loads(source)
        return cls(
            trace_dir=data["trace_dir"],
            suspects=[Suspect(**s) for s in data["suspects"]],
            per_rank={int(rank): RankSummary(**summary) for rank, summary in data["per_rank"].items()},
            warnings=list(data.get("warnings", [])),
            params=dict(data.get("params", {})),
            steps=list(data.get("steps", [])),
            unjudged_ranks={int(rank): why for rank, why in data.get("unjudged_ranks", {}).items()},
            bubbles=data.get("bubbles"),
            experts=data.get("experts"),
        )

    def table(self, per_rank: bool = False) -> str:
        """The warnings (first: they qualify what follows), then the verdict: a short text table of the suspects,
        most severe first, ``nothing abnormal`` when there are none; the ranks that could not be judged are named
        in the verdict's line (``nothing could be judged`` where that is every rank)."""
        steps = f"{len(self.steps)} step{'s' if len(self.steps) != 1 else ''}"
        lines = [f"warning: {w}" for w in self.warnings]
        ranks = f"{len(self.per_rank)} ranks"
        unjudged = ""
        if self.unjudged_ranks:
            total = len(set(self.per_rank) | set(self.unjudged_ranks))
            ranks = f"{len(self.judged_ranks)} of {total} ranks judged"
            groups = _grouped(self.unjudged_ranks).items()
            unjudged = "; not judged: " + "; ".join(f"{_ranks_text(group)} ({why})" for why, group in groups)
        if not self.judged:
            lines.append(f"nothing could be judged ({ranks}){unjudged}")
        elif not self.suspects:
            lines.append(f"nothing abnormal ({ranks}, {steps}){unjudged}")
        else:
            lines.append(f"{len(self.suspects)} suspect(s) in {ranks}, {steps}{unjudged or ':'}")
            header = ("rank", "dp", "pp", "tp", "host", "kind", "slowdown", "peer", "lost/step", "evidence")
            rows = [
                (
                    str(s.rank),
                    str(s.dp),
                    str(s.pp),
                    str(s.tp),
                    s.host,
                    s.kind,
                    f"+{100 * s.slowdown:.1f}%",
                    "" if s.peer is None else str(s.peer),
                    f"{s.impact_ms:.2f} ms",
                    evidence_text(s),
                )
                for s in self.suspects
            ]
            lines += _format_rows(header, rows)
        if self.params.get("granularity_reason"):  # chosen per job: say what detection could compare
            lines.append(f"granularity: {self.params['granularity']} ({self.params['granularity_reason']})")
        if per_rank:
            header = ("rank", "dp", "pp", "tp", "host", "step ms", "compute ms", "data ms", "last at coll.")
            rows = [
                (
                    str(r.rank),
                    str(r.dp),
                    str(r.pp),
                    str(r.tp),
                    r.host,
                    _fmt(r.step_ms),
                    _fmt(r.compute_ms),
                    _fmt(r.data_ms),
                    "" if r.last_arrival_fraction is None else f"{100 * r.last_arrival_fraction:.0f}%",
                )
                for r in sorted(self.per_rank.values(), key=lambda r: r.rank)
            ]
            lines += [""] + _format_rows(header, rows)
        if self.bubbles:
            lines += [""] + bubble_lines(self.bubbles)
        if self.experts:
            lines += [""] + expert_lines(self.experts)
        return "\n".join(lines)


def _grouped(reasons: dict[int, str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, why in sorted(reasons.items()):
        groups.setdefault(why, []).append(rank)
    return groups


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def bubble_lines(bubbles: dict[str, Any]) -> list[str]:
    """The pipeline bubbles per stage (``scan.analysis.bubbles``) as text: bubble (waiting for the peer) and transfer time
    per step, and the bubble fraction beside the schedule's theoretical one."""
    theory = bubbles.get("theoretical_fraction")
    measured = bubbles.get("measured_fraction")
    m = bubbles.get("microbatches")
    lines = [
        f"pipeline bubbles ({bubbles.get('schedule')}, P={bubbles.get('pipeline_size')}, "
        f"V={bubbles.get('virtual_pipeline_size')}, M={'?' if m is None else f'{m:g}'}): bubble fraction "
        f"{'n/a' if measured is None else f'{100 * measured:.1f}%'} measured vs "
        f"{'n/a' if theory is None else f'{100 * theory:.1f}%'} in theory {bubbles.get('theoretical_formula', '')}; "
        f"clock alignment ±{bubbles.get('clock_uncertainty_us', 0):.0f} us"
    ]
    header = ("stage", "ranks", "bubble ms/step", "(range)", "transfer ms/step", "pipeline ms", "bubble", "transfer")
    rows = [
        (
            f"pp{s['stage']}",
            ",".join(str(r) for r in s["ranks"]),
            _fmt(s["bubble_ms"]),
            f"{_fmt(s['bubble_ms_low'])}-{_fmt(s['bubble_ms_high'])}",
            _fmt(s["transfer_ms"]),
            _fmt(s["pipeline_ms"]),
            "" if s["bubble_fraction"] is None else f"{100 * s['bubble_fraction']:.1f}%",
            "" if s["transfer_fraction"] is None else f"{100 * s['transfer_fraction']:.1f}%",
        )
        for s in bubbles.get("stages", [])
    ]
    return lines + _format_rows(header, rows) + [f"note: {w}" for w in bubbles.get("warnings", [])]


def _fmt(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}"


def _format_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    # the last column (free text) is not padded
    return ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1] for row in (header, *rows)]


def evidence_text(suspect: Suspect) -> str:
    """One line of evidence, from whichever rule named the suspect (each rule keeps its own evidence fields); the
    table's Evidence column, and the TensorBoard tab's (one wording for both)."""
    e = suspect.evidence
    if suspect.kind == "link":
        return (
            f"{e['direction']} {suspect.rank}->{suspect.peer}: {e['median_us_per_mb']:.1f} us/MB vs "
            f"{e['baseline_us_per_mb']:.1f} us/MB on {e['link_class']} links"
        )
    if "hit_steps_fraction" in e:  # the training thread's waits for a CPU (scan.analysis.cpu_rules)
        return (
            f"training thread waited for a CPU {e['cpu_wait_ms']:.2f} ms per step vs {e['baseline_ms']:.2f} ms on "
            f"the others (runnable, not running; {100 * e['hit_steps_fraction']:.0f}% of {e['steps']} steps hit, "
            f"p={e['p_value']:.2g})"
        )
    if "later_ms" in e:  # against its own earlier steps
        text = (
            f"{e['rule']} ({e['later_steps'][0]}-{e['later_steps'][1]} against {e['earlier_steps'][0]}-"
            f"{e['earlier_steps'][1]}): {e['later_ms']:.2f} ms vs {e['earlier_ms']:.2f} ms per step "
            f"(10%-trimmed means, p={e['p_value']:.2g})"
        )
    elif "median_ms" in e and "baseline_ms" in e:
        if suspect.kind == "data" or "late_ms" in e:
            text = f"data-wait {e['median_ms']:.2f} ms vs peers {e['baseline_ms']:.2f} ms per step"
        elif "rule" in e:
            text = f"{e['rule']}: {e['median_ms']:.2f} ms vs {e['baseline_ms']:.2f} ms"
        else:
            text = f"net compute {e['median_ms']:.2f} ms vs {e['baseline_ms']:.2f} ms on peers per microbatch"
    elif "mean_excess" in e:  # the per-step rule alone
        text = (
            f"per-step net compute {100 * e['mean_excess']:.0f}% above its peers', slower in "
            f"{100 * e['slower_steps_fraction']:.0f}% of {e['steps']} steps (p={e['p_value']:.2g})"
        )
    else:
        text = e.get("rule", "")
    if "where" in e:  # the host waits inside steps (wait_rules.host_in_step_suspects)
        text = f"GPU waiting for its host inside steps: {text}"
    if "cpu_wait_ms" in e:  # merged in by scan.analysis.cpu_rules.merge_cpu_waits
        text += f"; its training thread waited for a CPU {e['cpu_wait_ms']:.2f} ms per step"
    if e.get("last_arrival_fraction") is not None:
        text += (
            f"; last at {100 * e['last_arrival_fraction']:.0f}% of its {e['collective_group']} collectives"
            f" (imposed {e['imposed_wait_ms']:.2f} ms)"
        )
    if "busy_excess" in e:  # GPU busy time decided compute or host (attribution.attribute_busy)
        text += f"; GPU busy {e['busy_ms']:.2f} ms vs {e['baseline_busy_ms']:.2f} ms ({100 * e['busy_excess']:+.0f}%)"
        if "host_queue_excess" in e and suspect.kind == "host":
            text += f", host queueing {100 * e['host_queue_excess']:+.0f}%"
    elif suspect.kind == "host" and "host_paced_fraction" in e:
        text += f"; host-paced spans {100 * e['host_paced_fraction']:.0f}%"
        if "peers_host_paced_fraction" in e:
            text += f" vs {100 * e['peers_host_paced_fraction']:.0f}% on peers"
    return text


class _MetricsLogger(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> Any: ...


def log_to(logger: _MetricsLogger, report: DetectionReport, step: Optional[int] = None) -> dict[str, float]:
    """Log the report through a Lightning-logger-like object (``log_metrics(dict, step)``); returns the metrics.

    ``megascan/rank{R}_step_ms`` and ``megascan/rank{R}_compute_ms`` per rank, ``megascan/suspects`` (count),
    ``megascan/max_slowdown``, ``megascan/rank{R}_{kind}_slowdown`` per suspect, and with pipeline bubbles
    ``megascan/pp{S}_bubble_ms``, ``..._transfer_ms`` and ``..._bubble_fraction`` per stage."""
    metrics: dict[str, float] = {}
    for rank, summary in sorted(report.per_rank.items()):
        if summary.step_ms is not None:
            metrics[f"megascan/rank{rank}_step_ms"] = float(summary.step_ms)
        if summary.compute_ms is not None:
            metrics[f"megascan/rank{rank}_compute_ms"] = float(summary.compute_ms)
    for stage in (report.bubbles or {}).get("stages", []):  # pipeline bubbles apart from transfers, per stage
        for key in ("bubble_ms", "transfer_ms", "bubble_fraction"):
            if stage.get(key) is not None:
                metrics[f"megascan/pp{stage['stage']}_{key}"] = float(stage[key])
    metrics["megascan/suspects"] = float(len(report.suspects))
    metrics["megascan/max_slowdown"] = max((s.slowdown for s in report.suspects), default=0.0)
    for s in report.suspects:
        name = f"megascan/rank{s.rank}_{s.kind}_slowdown" + (f"_to{s.peer}" if s.peer is not None else "")
        metrics[name] = max(metrics.get(name, 0.0), float(s.slowdown))
    logger.log_metrics(metrics, step=step)
    return metrics


def expert_lines(experts: dict[str, Any]) -> list[str]:
    """The report table's lines for the experts' load (``DetectionReport.table``)."""
    lines = ["experts (tokens per step; max/mean: the busiest expert over the mean, median over steps):"]
    for layer, entry in experts["layers"].items():
        lines.append(
            f"  layer {layer}: {entry['tokens_per_step']:g} tokens over {entry['experts']} experts, max/mean "
            f"{entry['imbalance']:.2f} (worst step {entry['imbalance_max']:.2f}), busiest expert "
            f"{entry['busiest_expert']} ({entry['per_expert'][str(entry['busiest_expert'])]:g} tokens)"
        )
    return lines
