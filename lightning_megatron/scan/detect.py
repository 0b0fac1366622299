"""``lightning-megatron scan detect``: find the ranks that slow a run down, from MegaScan traces alone.

In synchronous training one slow GPU, one slow link or one slow data loader delays every rank: the others wait
for it inside collectives and pipeline sends/receives, so their *step* times are all equally long and say
nothing about who is to blame. Detection therefore compares only the time a rank spends on its *own* work with
the time its peers spend on the *same* work, after taking the waiting out:

* **compute** (``cat: compute``, or ``compute.layer`` when a trace has no per-microbatch spans): the peers of a
  rank are the ranks of its pipeline stage (all data- and tensor-parallel ranks with the same ``pp``), which run
  the same layers on equally sized microbatches. A compute span's time minus the part of it spent inside
  blocking communication or data waits *on that rank* (the union of its ``collective`` spans that are not
  ``async``, its ``p2p`` and its ``data`` spans) is the rank's *net* compute: a fast tensor-parallel peer that
  waits inside the all-reduce for a slow one has a long span but normal net compute.
* **links**: a p2p send ``{peer: Q, seq: k, direction: d}`` on P and the matching receive on Q (same step) give
  a transfer time, by default ``recv end - max(send start, recv start)`` on the aligned clock (the transfer
  cannot start before both sides are there); a send alone in its span measures it on one clock instead where
  that is unambiguous (see ``_transfer_us``). Per ordered link the median time per byte is compared with the
  links of the same class (direction, and whether both ends share a host: NVLink and network links are not
  peers). A span holding several ops (``send-forward-recv-backward``) can only stretch a transfer (a delayed
  send to Q also delays the receive from Q in it), so where every link of a class has enough transfers with
  both ends alone in their spans, only those are compared. The sender is named, its receiver is ``peer``.
* **data**: the ``data-wait`` per step compared with the ranks of the same pipeline stage.

Statistics, and why:

* a rank's level for one op is the **median over microbatches and steps**: one-off hiccups (a page fault, a
  preempted thread, the warm-up step) do not move it;
* the healthy level of a peer group is the **lower-half median** (the median of the ``ceil(n / 2)`` fastest
  peers' levels): unlike the plain median it stays at the healthy level while up to half of the peers are slow
  (2 of 4 data-parallel peers, or the slower of 2 tensor-parallel peers), and unlike the minimum it is not
  dragged down by a single lucky fast rank when there are 3 or more peers. Picking the faster half of noisy
  levels biases it low by about 0.6 standard errors, which is added back (``lower_half_bias``) so that healthy
  ranks do not all look a little slow;
* noise is the **MAD** (median absolute deviation, × 1.4826 = a standard deviation for normal noise) of samples
  around their own median, relative to it, corrected for small samples, pooled over the peer group and over all
  groups of the same kind (a floor: one group's few samples can make the estimate erratically small), and a
  rank's own MAD where it has at least 6 samples and is noisier. The standard error of a median of n samples is
  ``1.2533 * sigma / sqrt(n)``; that of the baseline is included too;
* a rank is flagged when its excess over the baseline is at least ``min_slowdown`` *and* its log ratio to
  the baseline is at least ``min_z`` standard errors (timing noise is multiplicative; few or noisy samples do not
  raise alarms) *and* it is slower than a healthy peer in at least 80 % of sample pairs (the *probability of
  superiority*, a rank statistic: heavy-tailed or two-mode noise, such as CPU contention where an op takes
  either 3 ms or 12 ms, can move a median without a consistent slowdown) *and* it costs at least ``min_impact``
  of a step (a data loader 2x slower than its peers' 20 µs does not matter). Suspects are ordered by the time
  they cost per step (``evidence["impact_ms"]``), the common currency of compute, link and data slowness.
* a longer data-wait only counts where the rank also ended it *later* than its peers (aligned clock): a wait
  that started early and ended with the others was spent at a synchronisation point between the batches.

Collectives give independent evidence for compute suspects: per instance ``(group, seq)`` the member with the
latest start on the aligned clock arrived last and every other member waited for it; a rank that is last in most
instances of its tensor-parallel group, imposing a wait about equal to its compute excess, is the slow one.
Clocks are aligned with the median ``offset_us`` of each rank's ``megascan.clock`` records.

Detection cannot blame a rank when its whole peer group is slow (all ranks of a stage), nor a stage whose
groups have a single rank (no peers); a slowdown that only hits a minority of microbatches or steps is hidden by
the medians (on purpose: that is how one-off hiccups are ignored).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Union

from lightning_megatron.scan.format import RANK_FILE_PATTERN, list_rank_files, read_rank_file

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

KINDS = ("compute", "link", "data")  # what a Suspect can be
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_MEDIAN_SE = 1.2533  # standard error of a median of n normal samples: 1.2533 * sigma / sqrt(n)
_SIGMA_FLOOR = 0.003  # relative noise floor: timer resolution, and MAD = 0 from identical samples


# ----------------------------------------------------------------------------------------------- statistics


def mad_sigma(values: Sequence[float]) -> float:
    """Robust standard deviation: 1.4826 × the median absolute deviation (0 for fewer than 2 values).

    Unlike the sample standard deviation it ignores a minority of outliers (a slow microbatch, a warm-up step)."""
    if len(values) < 2:
        return 0.0
    center = statistics.median(values)
    return _MAD_TO_SIGMA * statistics.median(abs(v - center) for v in values)


def lower_half_median(values: Sequence[float]) -> float:
    """The median of the ``ceil(n / 2)`` smallest values: the "healthy" level of a group of peers.

    Slowness only ever adds time, so the healthy peers are the fast ones; taking the median of the faster half
    keeps the baseline at the healthy level while up to half of the group is slow (the plain median moves as
    soon as half the group is slow), and for 3 or more peers a single unusually fast rank cannot pull it down
    the way it pulls down the minimum. For 2 peers it is the faster one."""
    if not values:
        raise ValueError("lower_half_median of no values")
    ordered = sorted(values)
    return statistics.median(ordered[: (len(ordered) + 1) // 2])


def lower_half_bias(n: int, healthy: Optional[int] = None) -> float:
    """How far (in standard deviations) the lower-half median of ``n`` levels falls below the healthy level, when
    ``healthy`` of them (default: all) are noisy copies of it and the others are clearly slower.

    Taking the faster half of noisy peers biases the baseline low, which would make every healthy rank look a
    little slow (about 0.6 standard errors for a clean group); adding this back removes that. The bias comes
    from *selecting* among equals: when only ``ceil(n / 2)`` ranks are healthy (the slower of 2 peers, 2 slow of
    4), the lower half is all of them and unbiased. Expected normal order statistics by Blom's approximation
    ``Φ⁻¹((i - 0.375) / (h + 0.25))`` (within 0.03 of the exact values); 0 for a single value."""
    half = (n + 1) // 2
    h = n if healthy is None else max(min(healthy, n), half)
    if h < 2:
        return 0.0
    normal = statistics.NormalDist()

    def order(i: int) -> float:  # expected i-th smallest of h (1-based)
        return normal.inv_cdf((i - 0.375) / (h + 0.25))

    middle = order((half + 1) // 2) if half % 2 else (order(half // 2) + order(half // 2 + 1)) / 2
    return -middle


def _small_sample(n: int) -> float:
    """Correction of a MAD taken around the sample's own median: with few samples the median sits among them
    and the deviations come out small (for 8 normal samples the scaled MAD averages 0.89 σ, for 4 0.74 σ);
    ``n / (n - 1)`` (1.2 for 2) undoes most of it. Underestimated noise would turn noise into alarms."""
    return 1.2 if n == 2 else n / (n - 1) if n > 2 else 1.0


# A suspect must be slower than a healthy peer in at least this fraction of sample pairs (see _superiority):
# the median test assumes well-behaved noise; this one holds for heavy-tailed or two-mode noise too (CPU
# contention: a rank's op takes either 3 ms or 12 ms), where a median can move without a consistent slowdown.
_MIN_SUPERIORITY = 0.8
_MIN_CLEAN = 3  # transfers per link with both ends alone in their spans, to compare only those (see links)
_OWN_NOISE_MIN_SAMPLES = 6  # below this a series' own MAD is too erratic; the group's pooled noise stands in


def _median_se(values: Sequence[float], center: float, pooled_sigma: float) -> float:
    """Standard error of the median of ``values`` (absolute units) from their relative noise: their own MAD
    when there are enough of them, never less than the group's pooled relative noise ``pooled_sigma``."""
    sigma = pooled_sigma
    if len(values) >= _OWN_NOISE_MIN_SAMPLES and center > 0:
        sigma = max(mad_sigma([v / center - 1.0 for v in values]) * _small_sample(len(values)), pooled_sigma)
    return _MEDIAN_SE * sigma * abs(center) / math.sqrt(max(len(values), 1))


# ----------------------------------------------------------------------------------------------- report


@dataclass
class Suspect:
    """One rank (for ``kind == "link"``: one ordered link, from ``rank`` to ``peer``) that is slower than its peers.

    ``slowdown`` is the excess over the peers' healthy level as a fraction (0.21: 21 % slower): of net compute
    time, of transfer time per byte, or of data-wait time. ``evidence`` holds the numbers behind it; its
    ``impact_ms`` (time this costs per step) orders the suspects."""

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
    """What ``detect`` found: suspects ranked by severity (time lost per step), per-rank medians, warnings."""

    trace_dir: str
    suspects: list[Suspect]
    per_rank: dict[int, RankSummary]
    warnings: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)

    @property
    def abnormal(self) -> bool:
        return bool(self.suspects)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_dir": self.trace_dir,
            "suspects": [asdict(s) for s in self.suspects],
            "per_rank": {str(rank): asdict(summary) for rank, summary in sorted(self.per_rank.items())},
            "warnings": list(self.warnings),
            "params": dict(self.params),
            "steps": list(self.steps),
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
        )

    def table(self, per_rank: bool = False) -> str:
        """A short text table of the suspects, most severe first; ``nothing abnormal`` when there are none."""
        steps = f"{len(self.steps)} step{'s' if len(self.steps) != 1 else ''}"
        lines: list[str] = []
        if not self.suspects:
            lines.append(f"nothing abnormal ({len(self.per_rank)} ranks, {steps})")
        else:
            lines.append(f"{len(self.suspects)} suspect(s) in {len(self.per_rank)} ranks, {steps}:")
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
                    _evidence_text(s),
                )
                for s in self.suspects
            ]
            lines += _format_rows(header, rows)
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
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _fmt(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}"


def _format_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    # the last column (free text) is not padded
    return ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1] for row in (header, *rows)]


def _evidence_text(suspect: Suspect) -> str:
    e = suspect.evidence
    if suspect.kind == "compute":
        text = f"net compute {e['median_ms']:.2f} ms vs {e['baseline_ms']:.2f} ms on peers per microbatch"
        if e.get("last_arrival_fraction") is not None:
            text += (
                f"; last at {100 * e['last_arrival_fraction']:.0f}% of its {e['collective_group']} collectives"
                f" (imposed {e['imposed_wait_ms']:.2f} ms)"
            )
        return text
    if suspect.kind == "link":
        return (
            f"{e['direction']} {suspect.rank}->{suspect.peer}: {e['median_us_per_mb']:.1f} us/MB vs "
            f"{e['baseline_us_per_mb']:.1f} us/MB on {e['link_class']} links"
        )
    return f"data-wait {e['median_ms']:.2f} ms vs peers {e['baseline_ms']:.2f} ms per step"


# ----------------------------------------------------------------------------------------------- reading


@dataclass
class _RankTrace:
    """The parts of one rank file detection uses, on the rank's own clock (``offset_us`` maps to rank 0's)."""

    rank: int
    dp: int = 0
    pp: int = 0
    tp: int = 0
    host: str = "?"
    world_size: Optional[int] = None
    offsets: list[float] = field(default_factory=list)
    uncertainties: list[float] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    offset_us: float = 0.0
    uncertainty_us: float = 0.0


def _read(path: Path, rank: int) -> _RankTrace:
    trace = _RankTrace(rank=rank)
    match = RANK_FILE_PATTERN.match(path.name)
    if match:
        trace.dp, trace.pp, trace.tp = int(match.group(2)), int(match.group(3)), int(match.group(4))
    for event in read_rank_file(path):
        phase = event.get("ph")
        if phase == "X" and "cat" in event:
            trace.spans.append(event)
        elif phase == "M":
            args = event.get("args") or {}
            if event.get("name") == "megascan.rank":
                trace.dp = int(args.get("dp", trace.dp))
                trace.pp = int(args.get("pp", trace.pp))
                trace.tp = int(args.get("tp", trace.tp))
                trace.host = str(args.get("host", trace.host))
                if args.get("world_size") is not None:
                    trace.world_size = int(args["world_size"])
            elif event.get("name") == "megascan.clock" and "offset_us" in args:
                trace.offsets.append(float(args["offset_us"]))
                trace.uncertainties.append(float(args.get("uncertainty_us", 0.0)))
    if trace.offsets:
        trace.offset_us = statistics.median(trace.offsets)
        trace.uncertainty_us = statistics.median(trace.uncertainties)
    return trace


def _step_of(event: dict[str, Any]) -> Optional[int]:
    step = (event.get("args") or {}).get("step")
    return None if step is None else int(step)


def _merge(intervals: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The union of intervals as sorted, disjoint (starts, ends)."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(intervals):
        if starts and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _overlap(start: float, end: float, union: tuple[list[float], list[float]]) -> float:
    """Length of ``[start, end]`` covered by a union from ``_merge``."""
    starts, ends = union
    total = 0.0
    i = bisect.bisect_right(ends, start)
    while i < len(starts) and starts[i] < end:
        total += max(0.0, min(end, ends[i]) - max(start, starts[i]))
        i += 1
    return total


# ----------------------------------------------------------------------------------------------- analysis


@dataclass
class _Level:
    """A rank's (or link's) median for one op, with the standard error of that median."""

    median: float
    se: float
    n: int
    samples: list[float] = field(default_factory=list)


def _levels(samples: dict[str, list[float]], sigma_floor: float) -> dict[str, _Level]:
    levels = {}
    for key, values in samples.items():
        if values:
            median = statistics.median(values)
            levels[key] = _Level(median, _median_se(values, median, sigma_floor), len(values), sorted(values))
    return levels


def _superiority(levels: dict[Any, dict[str, _Level]], member: Any, keys: Sequence[str]) -> float:
    """P(a sample of ``member`` > a sample of a healthy peer), over the ops ``keys`` (ties count half).

    The healthy peers of an op are the faster half of the others. A rank-based measure that no outlier and no
    odd-shaped distribution can push: a really slow rank is slower in nearly every sample pair (P near 1);
    heavy-tailed noise that happens to move a median (a few lucky or unlucky samples) leaves it near 0.5."""
    wins = pairs = 0.0
    for key in keys:
        own = levels[member][key].samples
        others = sorted((lv[key] for m, lv in levels.items() if m != member and key in lv), key=lambda lv: lv.median)
        for peer in others[: (len(others) + 1) // 2]:
            for y in peer.samples:
                below = bisect.bisect_left(own, y)
                ties = bisect.bisect_right(own, y) - below
                wins += len(own) - below - ties + 0.5 * ties
                pairs += len(own)
    return wins / pairs if pairs else 0.5


def _pooled_sigma(samples: Iterable[list[float]]) -> float:
    """Relative noise of single samples pooled over many series (each normalised by its own median)."""
    residuals: list[float] = []
    for values in samples:
        if len(values) >= 2:
            center = statistics.median(values)
            if center > 0:
                residuals += [(v / center - 1.0) * _small_sample(len(values)) for v in values]
    return max(mad_sigma(residuals), _SIGMA_FLOOR) if len(residuals) >= 2 else _SIGMA_FLOOR


@dataclass
class _Comparison:
    """One member of a peer group against the group's healthy level (summed over the ops it has)."""

    member: Any
    median: float  # sum over ops of the member's medians
    baseline: float  # sum over the same ops of the group's healthy levels
    noise: float  # standard error of ``log(median / baseline)``
    n: int
    levels: dict[Any, dict[str, _Level]] = field(repr=False, default_factory=dict)  # the whole group's
    keys: list[str] = field(default_factory=list)  # the ops compared
    _superiority: Optional[float] = None

    @property
    def superiority(self) -> float:
        """P(a sample of this member > a sample of a healthy peer): computed on first use (for candidates)."""
        if self._superiority is None:
            self._superiority = _superiority(self.levels, self.member, self.keys)
        return self._superiority

    @property
    def excess(self) -> float:
        return self.median / self.baseline - 1.0 if self.baseline > 0 else 0.0

    @property
    def z(self) -> float:
        """How many standard errors the member is above the baseline, on a log scale: timing noise is
        multiplicative (a rank 30x slower than a noisy baseline is far more certain than 30 linear standard
        errors of the baseline suggest), and on a log scale a ratio's error is that of its two parts combined."""
        if self.median <= 0 or self.baseline <= 0:
            return 0.0
        return math.log(self.median / self.baseline) / self.noise if self.noise > 0 else math.inf


def _compare(levels: dict[Any, dict[str, _Level]]) -> list[_Comparison]:
    """Compare every member of a peer group with the lower-half median of the group, op by op.

    A member's ratio is ``sum(own medians) / sum(baselines)`` over the ops it has, i.e. the ratios of the ops
    weighted by their length; its noise (relative, i.e. of the log ratio) combines the standard errors of its own
    medians with those of the baseline (a median of about ``n / 2`` peers' medians)."""
    keys = {key for per_member in levels.values() for key in per_member}
    baseline: dict[str, float] = {}
    baseline_se: dict[str, float] = {}
    for key in keys:
        values = [(lv.median, lv.se) for per_member in levels.values() if (lv := per_member.get(key)) is not None]
        if len(values) < 2:
            continue
        healthy = sorted(values)[: (len(values) + 1) // 2]
        typical_se = statistics.median(se for _, se in healthy)
        lower = lower_half_median([v for v, _ in values])
        # the lower half of noisy copies of one level sits below that level by lower_half_bias noise units; the
        # copies are the members within noise of the lower half (clearly slower ones were never candidates)
        cluster = sum(1 for v, se in values if v <= lower + 3.0 * math.hypot(se, typical_se))
        baseline[key] = lower + lower_half_bias(len(values), cluster) * typical_se
        baseline_se[key] = typical_se / math.sqrt(len(healthy))
    comparisons = []
    for member, per_member in levels.items():
        own = [key for key in per_member if key in baseline]
        if not own:
            continue
        median = sum(per_member[k].median for k in own)
        base = sum(baseline[k] for k in own)
        if median <= 0 or base <= 0:
            continue
        own_rel = math.sqrt(sum(per_member[k].se ** 2 for k in own)) / median
        base_rel = math.sqrt(sum(baseline_se[k] ** 2 for k in own)) / base
        comparisons.append(
            _Comparison(
                member=member,
                median=median,
                baseline=base,
                noise=math.hypot(own_rel, base_rel),
                n=min(per_member[k].n for k in own),
                levels=levels,
                keys=own,
            )
        )
    # the spread of the healthy half's ratios bounds rank-to-rank differences that are not noise within a rank
    healthy_logs = sorted(math.log(c.median / c.baseline) for c in comparisons)
    healthy_logs = healthy_logs[: (len(healthy_logs) + 1) // 2]
    if len(healthy_logs) >= 3:
        spread = mad_sigma(healthy_logs) * _small_sample(len(healthy_logs))
        for c in comparisons:
            c.noise = max(c.noise, spread)
    return comparisons


def detect(
    trace_dir: Union[str, Path],
    *,
    min_slowdown: float = 0.08,
    min_z: float = 3.5,
    min_impact: float = 0.005,
    skip_steps: int = 0,
) -> DetectionReport:
    """Rank the ranks (and links) of a MegaScan trace directory that are slower than their peers.

    ``min_slowdown``: smallest excess over the peers' healthy level that is reported (fraction, 0.08 = 8 %).
    ``min_z``: the log ratio to the baseline must also be this many standard errors (from the samples' MAD);
    with few samples and a lot of noise (CPU test runs) this is the test that binds.
    ``min_impact``: ... and the slowness must cost at least this fraction of the median step time per step.
    ``skip_steps``: leave out the first recorded steps (warm-up).
    Besides, a suspect must be slower than a healthy peer in 80 % of sample pairs (see the module docstring).
    Missing or truncated rank files only produce warnings (in the report, and as Python warnings); a directory
    without rank files raises ``FileNotFoundError``."""
    trace_dir = Path(trace_dir)
    files = list_rank_files(trace_dir)
    if not files:
        raise FileNotFoundError(f"no MegaScan rank files in {trace_dir}")
    notes: list[str] = []
    traces: dict[int, _RankTrace] = {}
    for rank, path in sorted(files.items()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traces[rank] = _read(path, rank)
        notes += [str(w.message) for w in caught]
    world = max([t.world_size for t in traces.values() if t.world_size] + [max(traces) + 1])
    missing = sorted(set(range(world)) - set(traces))
    if missing:
        notes.append(f"no trace for rank(s) {', '.join(map(str, missing))} of {world}")
    no_clock = sorted(rank for rank, t in traces.items() if not t.offsets)
    if no_clock and len(traces) > 1:
        notes.append(f"no megascan.clock record for rank(s) {', '.join(map(str, no_clock))}: offset 0 assumed")

    steps = _select_steps(traces, skip_steps, notes)
    for trace in traces.values():
        trace.spans = [s for s in trace.spans if _step_of(s) in steps.get(trace.rank, set())]
    all_steps = sorted(set().union(*steps.values())) if steps else []
    if not all_steps:
        notes.append("no finished step with spans to analyse")

    per_rank = {rank: _summary(trace) for rank, trace in traces.items()}
    compute_samples, layer_samples = _compute_samples(traces, per_rank)
    collective_stats = _collective_stats(traces, per_rank)
    median_step_us = statistics.median([r.step_ms * 1000 for r in per_rank.values() if r.step_ms is not None] or [0.0])
    min_impact_us = min_impact * median_step_us

    suspects: list[Suspect] = []
    suspects += _compute_suspects(
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
    suspects += _link_suspects(traces, min_slowdown, min_z, min_impact_us, notes)
    suspects += _data_suspects(traces, per_rank, min_slowdown, min_z, min_impact_us)
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


def _select_steps(traces: dict[int, _RankTrace], skip_steps: int, notes: list[str]) -> dict[int, set[int]]:
    """Per rank, the steps to analyse: those the rank finished (its ``step`` span was written, so every span
    inside the step was written too; a truncated file's last step is partial), less the first ``skip_steps``."""
    every = sorted({step for t in traces.values() for s in t.spans if (step := _step_of(s)) is not None})
    skipped = set(every[:skip_steps])
    selected: dict[int, set[int]] = {}
    for rank, trace in traces.items():
        finished = {_step_of(s) for s in trace.spans if s["cat"] == "step"} - {None}
        seen = {_step_of(s) for s in trace.spans} - {None}
        use = finished if finished else seen
        if finished and seen - finished and max(seen) > max(finished):
            notes.append(f"rank {rank}: step(s) {sorted(seen - finished)} unfinished in its trace, left out")
        selected[rank] = {s for s in use if s is not None} - skipped
    return selected


def _summary(trace: _RankTrace) -> RankSummary:
    step_durs = [s["dur"] for s in trace.spans if s["cat"] == "step"]
    data_per_step: dict[int, float] = defaultdict(float)
    for s in trace.spans:
        if s["cat"] == "data":
            data_per_step[_step_of(s)] += s["dur"]  # type: ignore[index]
    return RankSummary(
        rank=trace.rank,
        dp=trace.dp,
        pp=trace.pp,
        tp=trace.tp,
        host=trace.host,
        steps=len({_step_of(s) for s in trace.spans}),
        step_ms=statistics.median(step_durs) / 1000 if step_durs else None,
        data_ms=statistics.median(data_per_step.values()) / 1000 if data_per_step else None,
    )


def _blocking(span: dict[str, Any]) -> bool:
    """Whether a span is time the rank spent waiting (for peers or input) rather than computing."""
    cat = span["cat"]
    if cat == "collective":
        return not (span.get("args") or {}).get("async", False)
    return cat in ("p2p", "data")


def _compute_samples(
    traces: dict[int, _RankTrace], per_rank: dict[int, RankSummary]
) -> tuple[dict[int, dict[str, list[float]]], dict[int, dict[str, list[float]]]]:
    """Per rank, per op: net compute times (µs) — span length minus its overlap with the rank's own waits."""
    compute: dict[int, dict[str, list[float]]] = {}
    layers: dict[int, dict[str, list[float]]] = {}
    for rank, trace in traces.items():
        waits = _merge((s["ts"], s["ts"] + s["dur"]) for s in trace.spans if _blocking(s))
        by_op: dict[str, list[float]] = defaultdict(list)
        by_layer: dict[str, list[float]] = defaultdict(list)
        op_per_step: dict[int, float] = defaultdict(float)
        layer_per_step: dict[int, float] = defaultdict(float)
        for s in trace.spans:
            if s["cat"] not in ("compute", "compute.layer"):
                continue
            args = s.get("args") or {}
            net = max(s["dur"] - _overlap(s["ts"], s["ts"] + s["dur"], waits), 0.0)
            if s["cat"] == "compute":
                by_op[f"{s['name']} chunk {args.get('chunk', 0)}"].append(net)
                op_per_step[int(args.get("step", -1))] += net
            else:
                key = f"{args.get('direction', '?')} layer {args.get('layer', '?')} {args.get('part', s['name'])}"
                by_layer[key].append(net)
                layer_per_step[int(args.get("step", -1))] += net
        compute[rank] = dict(by_op)
        layers[rank] = dict(by_layer)
        per_step = op_per_step or layer_per_step
        if per_step:
            per_rank[rank].compute_ms = statistics.median(per_step.values()) / 1000
    return compute, layers


def _collective_stats(traces: dict[int, _RankTrace], per_rank: dict[int, RankSummary]) -> dict[int, dict[str, Any]]:
    """Per rank and group name: instances, how often the rank started last, and the wait it then imposed.

    One instance is ``(group, seq)``; its members' starts are compared on the aligned clock. The wait imposed by
    the last member is the mean over the other members of ``last start - their start``."""
    instances: dict[tuple[tuple[int, ...], int], dict[int, float]] = defaultdict(dict)
    names: dict[tuple[int, ...], str] = {}
    for rank, trace in traces.items():
        for s in trace.spans:
            if s["cat"] != "collective":
                continue
            args = s.get("args") or {}
            if "group" not in args or "seq" not in args:
                continue
            group = tuple(sorted(int(r) for r in args["group"]))
            names[group] = str(args.get("group_name", "?"))
            instances[(group, int(args["seq"]))][rank] = s["ts"] + trace.offset_us
    stats: dict[int, dict[str, dict[str, float]]] = defaultdict(
        lambda: defaultdict(lambda: {"instances": 0, "last": 0, "imposed_us": 0.0})
    )
    for (group, _seq), starts in instances.items():
        if len(starts) < 2:
            continue
        last = max(starts, key=lambda r: (starts[r], r))
        imposed = statistics.fmean(starts[last] - t for r, t in starts.items() if r != last)
        for rank in starts:
            entry = stats[rank][names[group]]
            entry["instances"] += 1
            entry["group_size"] = len(group)
            if rank == last:
                entry["last"] += 1
                entry["imposed_us"] += imposed
    for rank, by_name in stats.items():
        total = sum(e["instances"] for e in by_name.values())
        last = sum(e["last"] for e in by_name.values())
        imposed = sum(e["imposed_us"] for e in by_name.values())
        if rank in per_rank and total:
            per_rank[rank].collectives = int(total)
            per_rank[rank].last_arrival_fraction = last / total
            per_rank[rank].imposed_wait_ms = imposed / last / 1000 if last else 0.0
    return {rank: dict(by_name) for rank, by_name in stats.items()}


def _peer_groups(traces: dict[int, _RankTrace]) -> dict[int, list[int]]:
    """Ranks that do the same work: one group per pipeline stage (all data- and tensor-parallel ranks)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for rank, trace in sorted(traces.items()):
        groups[trace.pp].append(rank)
    return groups


def _flagged(c: _Comparison, min_slowdown: float, min_z: float) -> bool:
    return c.excess >= min_slowdown and c.z >= min_z and c.superiority >= _MIN_SUPERIORITY


def _compute_suspects(
    traces: dict[int, _RankTrace],
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
    everywhere = _pooled_sigma(values for per_op in (*compute.values(), *layers.values()) for values in per_op.values())
    for pp, ranks in sorted(_peer_groups(traces).items()):
        source = compute if any(compute[r] for r in ranks) else layers
        members = [r for r in ranks if source[r]]
        if len(members) < 2:
            if members:
                notes.append(f"stage pp{pp}: a single rank with compute spans, no peers to compare with")
            continue
        floor = max(_pooled_sigma(values for r in members for values in source[r].values()), everywhere)
        comparisons = _compare({r: _levels(source[r], floor) for r in members})
        # per-layer-part levels localise the slowness (which layer part is slow), when the trace has them
        layer_levels = {r: _levels(layers[r], floor) for r in members if layers[r]}
        for c in comparisons:
            if not _flagged(c, min_slowdown, min_z):
                continue
            rank = c.member
            summary = per_rank[rank]
            compute_us = (summary.compute_ms or 0.0) * 1000 or c.median
            impact_us = compute_us * c.excess / (1 + c.excess)
            if impact_us < min_impact_us:
                continue
            evidence: dict[str, Any] = {
                "median_ms": c.median / 1000,
                "baseline_ms": c.baseline / 1000,
                "z": round(c.z, 2),
                "superiority": round(c.superiority, 3),
                "samples": c.n,
                "peers": len(members) - 1,
                "impact_ms": impact_us / 1000,
                "step_ms": summary.step_ms,
                "compute_ms": summary.compute_ms,
            }
            evidence.update(_collective_evidence(collectives.get(rank, {})))
            if rank in layer_levels and len(layer_levels) >= 2:
                evidence["slowest_layer_parts"] = _slowest_parts(rank, layer_levels)
            suspects.append(_suspect(traces[rank], "compute", c.excess, evidence))
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


def _slowest_parts(rank: int, levels: dict[int, dict[str, _Level]], top: int = 3) -> list[dict[str, Any]]:
    ratios = []
    for key, level in levels[rank].items():
        peers = [lv[key].median for lv in levels.values() if key in lv]
        if len(peers) >= 2:
            base = lower_half_median(peers)
            if base > 0:
                ratios.append({"op": key, "slowdown": level.median / base - 1.0, "ms": level.median / 1000})
    return sorted(ratios, key=lambda r: -r["slowdown"])[:top]


def _suspect(
    trace: _RankTrace, kind: str, slowdown: float, evidence: dict[str, Any], peer: Optional[int] = None
) -> Suspect:
    return Suspect(
        rank=trace.rank,
        dp=trace.dp,
        pp=trace.pp,
        tp=trace.tp,
        host=trace.host,
        kind=kind,
        slowdown=round(slowdown, 4),
        peer=peer,
        evidence=evidence,
    )


def _transfer_us(
    send: tuple[float, float, bool], recv: tuple[float, float], margin: float
) -> tuple[Optional[float], bool]:
    """One transfer's duration (µs) from a matched send (start, end, alone in its span) and receive (start, end)
    on the aligned clock, and whether it rests on the alignment of two clocks; ``None`` when ambiguous.

    The reference is ``recv end - max(send start, recv start)``: the data cannot move before both sides are
    there. Two things spoil it: when the receiver was there first it is a difference across two clocks (only
    known within their uncertainty, tens of µs, the order of a whole activation transfer), and with eager sends
    (the data travels before the receiver posts) a late receiver finds the data already there. When the send is
    alone in its span, its own duration measures the transfer on one clock in both cases (receiver first, or
    send complete before the receiver came), so it is used instead; when the receiver came *during* the send,
    rendezvous semantics (transfer = receive span) and eager ones (transfer = send span) disagree and the
    sample is ambiguous. Spans holding several ops (``send-forward-recv-backward``) use the reference."""
    send_start, send_end, alone = send
    recv_start, recv_end = recv
    gap = recv_start - send_start
    send_dur = send_end - send_start
    if not alone:
        return max(recv_end - max(send_start, recv_start), 0.0), gap < 0
    if gap <= margin or gap >= send_dur + margin:
        return max(send_dur, 0.0), False
    return None, False


@dataclass
class _Transfer:
    us: float
    bytes: float
    step: int
    cross_clock: bool  # rests on the alignment of two ranks' clocks
    clean: bool  # both ends alone in their spans: nothing else in either span can have delayed it


def _link_suspects(
    traces: dict[int, _RankTrace], min_slowdown: float, min_z: float, min_impact_us: float, notes: list[str]
) -> list[Suspect]:
    """Match p2p sends with receives, and compare the links' transfer time per byte within a link class
    (direction, and whether both ends are on one host: NVLink and network links are not peers).

    A span that holds several ops (megatron-core's ``send-forward-recv-backward``) ends when the slowest of
    them is done and starts before the last of them is posted, so a transfer measured through it can only come
    out too long: a delayed send to Q also stretches the receive from Q in the same span, and the healthy
    reverse link would look slow too. Where every link of a class has at least ``_MIN_CLEAN`` transfers with
    both ends alone in their spans (pipeline warm-up and cool-down have them), only those are compared."""
    Key = tuple[int, int, str, int, int]  # (src, dst, direction, step, seq)
    sends: dict[Key, tuple[float, float, bool, float]] = {}
    recvs: dict[Key, tuple[float, float, bool, float]] = {}
    for rank, trace in traces.items():
        for s in trace.spans:
            if s["cat"] != "p2p":
                continue
            args = s.get("args") or {}
            step = int(args.get("step", -1))
            start, end = s["ts"] + trace.offset_us, s["ts"] + s["dur"] + trace.offset_us
            send_ops, recv_ops = args.get("sends") or [], args.get("recvs") or []
            for op in send_ops:
                key = (rank, int(op["peer"]), str(op.get("direction", "?")), step, int(op.get("seq", 0)))
                sends[key] = (start, end, len(send_ops) == 1 and not recv_ops, float(op.get("bytes", 0) or 0))
            for op in recv_ops:
                key = (int(op["peer"]), rank, str(op.get("direction", "?")), step, int(op.get("seq", 0)))
                recvs[key] = (start, end, len(recv_ops) == 1 and not send_ops, float(op.get("bytes", 0) or 0))
    transfers: dict[tuple[int, int, str], list[_Transfer]] = defaultdict(list)
    unmatched = 0
    for key, (send_start, send_end, send_alone, send_bytes) in sends.items():
        src, dst, direction, step, _seq = key
        recv = recvs.get(key)
        if recv is None or src not in traces or dst not in traces:
            unmatched += 1
            continue
        recv_start, recv_end, recv_alone, recv_bytes = recv
        margin = _clock_sigma(traces[src], traces[dst])
        us, cross = _transfer_us((send_start, send_end, send_alone), (recv_start, recv_end), margin)
        if us is not None:
            size = max(send_bytes, recv_bytes, 1.0)
            transfers[(src, dst, direction)].append(_Transfer(us, size, step, cross, send_alone and recv_alone))
    if unmatched:
        notes.append(f"{unmatched} of {len(sends)} p2p sends without a matching receive (missing or cut traces)")
    classes: dict[tuple[str, bool], list[tuple[int, int, str]]] = defaultdict(list)
    for link in transfers:
        src, dst, direction = link
        classes[(direction, traces[src].host == traces[dst].host)].append(link)
    chosen: dict[tuple[int, int, str], list[_Transfer]] = {}
    for links in classes.values():
        clean = all(sum(t.clean for t in transfers[link]) >= _MIN_CLEAN for link in links)
        for link in links:
            chosen[link] = [t for t in transfers[link] if t.clean or not clean]
    everywhere = _pooled_sigma([t.us / t.bytes for t in samples] for samples in chosen.values())
    suspects = []
    for (direction, same_host), links in sorted(classes.items()):
        if len(links) < 2:
            continue
        floor = max(_pooled_sigma([t.us / t.bytes for t in chosen[link]] for link in links), everywhere)
        levels = {}
        for link in links:
            samples = chosen[link]
            level = _levels({"per_byte": [t.us / t.bytes for t in samples]}, floor)["per_byte"]
            # a clock error is systematic for a link: no number of samples averages it away. It counts when
            # the median rests on cross-clock samples.
            if sum(t.cross_clock for t in samples) >= 0.25 * len(samples):
                typical_bytes = statistics.median(t.bytes for t in samples)
                level.se = math.hypot(level.se, _clock_sigma(traces[link[0]], traces[link[1]]) / typical_bytes)
            levels[link] = {"per_byte": level}
        for c in _compare(levels):
            if not _flagged(c, min_slowdown, min_z):
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
            suspects.append(_suspect(traces[src], "link", c.excess, evidence, peer=dst))
    return suspects


def _clock_sigma(a: _RankTrace, b: _RankTrace) -> float:
    """Standard deviation (µs) of the error of a difference between two ranks' aligned times.

    ``uncertainty_us`` is a ± bound of a clock offset; it is taken as two standard deviations."""
    return math.hypot(a.uncertainty_us, b.uncertainty_us) / 2.0


def _data_suspects(
    traces: dict[int, _RankTrace],
    per_rank: dict[int, RankSummary],
    min_slowdown: float,
    min_z: float,
    min_impact_us: float,
) -> list[Suspect]:
    """Compare the data-wait per step with the ranks of the same pipeline stage.

    A longer data-wait is only blamed on data loading where it also made the rank *late*: slow loading ends
    the wait after the peers' waits end (on the aligned clock). A wait that began earlier than the peers' and
    ended with them was spent waiting for them at a synchronisation point between the batches (an untraced
    collective, e.g. the trainer's per-batch stop decision); that is their slowness, not this rank's loading.
    The part of the excess that is not lateness is left out (``evidence["late_ms"]``)."""
    samples: dict[int, list[float]] = {}
    ends: dict[int, dict[int, float]] = {}
    for rank, trace in traces.items():
        per_step: dict[int, float] = defaultdict(float)
        end: dict[int, float] = {}
        for s in trace.spans:
            if s["cat"] == "data":
                step = int(_step_of(s))  # type: ignore[arg-type]
                per_step[step] += s["dur"]
                end[step] = max(end.get(step, -math.inf), s["ts"] + s["dur"] + trace.offset_us)
        if per_step:
            samples[rank] = list(per_step.values())
            ends[rank] = end
    suspects = []
    everywhere = _pooled_sigma(samples.values())
    for _pp, ranks in sorted(_peer_groups(traces).items()):
        members = [r for r in ranks if r in samples]
        if len(members) < 2:
            continue
        floor = max(_pooled_sigma(samples[r] for r in members), everywhere)
        comparisons = _compare({r: _levels({"data-wait": samples[r]}, floor) for r in members})
        for c in comparisons:
            if not _flagged(c, min_slowdown, min_z):
                continue
            rank = c.member
            late_us = _lateness(rank, members, ends)
            excess_us = c.median - c.baseline
            # the clock alignment is only good to its uncertainty: lateness within it is no evidence either way
            tolerance = max(_clock_sigma(traces[rank], traces[m]) for m in members)
            if late_us + 2 * tolerance < 0.5 * excess_us:
                continue  # mostly waiting for the others, not loading
            impact_us = min(excess_us, max(late_us, 0.0) + 2 * tolerance)
            if impact_us < min_impact_us:
                continue
            evidence = {
                "median_ms": c.median / 1000,
                "baseline_ms": c.baseline / 1000,
                "late_ms": late_us / 1000 if math.isfinite(late_us) else None,
                "z": round(c.z, 2),
                "superiority": round(c.superiority, 3),
                "steps": c.n,
                "peers": len(members) - 1,
                "impact_ms": impact_us / 1000,
                "step_ms": per_rank[rank].step_ms,
            }
            suspects.append(_suspect(traces[rank], "data", c.excess, evidence))
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


# ----------------------------------------------------------------------------------------------- CLI, logging


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``detect TRACE_DIR [--json OUT.json] [--min-slowdown 0.08]``: print the suspects table (exit code 0
    whether or not there are suspects: this is a report, not a check)."""
    parser = subparsers.add_parser(
        "detect",
        help="rank the slow ranks, links and data loaders of a MegaScan trace directory",
        description="Compare every rank with the ranks doing the same work and name the slow ones.",
    )
    parser.add_argument("trace_dir", type=Path, metavar="TRACE_DIR")
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
        print(f"error: {err}")
        return 2
    print(report.table(per_rank=args.per_rank))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.to_json() + "\n")
        print(f"report written to {args.json}")
    return 0


class _MetricsLogger(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> Any: ...


def log_to(logger: _MetricsLogger, report: DetectionReport, step: Optional[int] = None) -> dict[str, float]:
    """Log the report through a Lightning-logger-like object (``log_metrics(dict, step)``); returns the metrics.

    ``megascan/rank{R}_step_ms`` and ``megascan/rank{R}_compute_ms`` per rank, ``megascan/suspects`` (count),
    ``megascan/max_slowdown``, and ``megascan/rank{R}_{kind}_slowdown`` per suspect."""
    metrics: dict[str, float] = {}
    for rank, summary in sorted(report.per_rank.items()):
        if summary.step_ms is not None:
            metrics[f"megascan/rank{rank}_step_ms"] = float(summary.step_ms)
        if summary.compute_ms is not None:
            metrics[f"megascan/rank{rank}_compute_ms"] = float(summary.compute_ms)
    metrics["megascan/suspects"] = float(len(report.suspects))
    metrics["megascan/max_slowdown"] = max((s.slowdown for s in report.suspects), default=0.0)
    for s in report.suspects:
        name = f"megascan/rank{s.rank}_{s.kind}_slowdown" + (f"_to{s.peer}" if s.peer is not None else "")
        metrics[name] = max(metrics.get(name, 0.0), float(s.slowdown))
    logger.log_metrics(metrics, step=step)
    return metrics
