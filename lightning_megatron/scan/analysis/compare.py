"""Robust comparison of one member of a peer group with the others: levels, healthy baseline, noise, superiority.

The contract: given, per member (a rank, or a link), samples per op (the same work measured on every member),
say how much slower each member is than the group's healthy level and how sure that is. Pure statistics on
numbers: nothing here knows traces, ranks or thresholds (``scan.analysis.measure`` produces the samples,
``scan.analysis.detect`` decides which comparisons name a suspect).

* a member's **level** for one op is the median of its samples (``levels_of``): one-off hiccups (a page fault,
  a preempted thread, the warm-up step) do not move it;
* the healthy level of a group is the **lower-half median** (the median of the ``ceil(n / 2)`` fastest members'
  levels): unlike the plain median it stays at the healthy level while up to half of the group is slow (2 of 4
  data-parallel peers, or the slower of 2 tensor-parallel peers), and unlike the minimum it is not dragged down
  by a single lucky fast member when there are 3 or more. Picking the faster half of noisy levels biases it low
  by about 0.6 standard errors, which is added back (``lower_half_bias``) so that healthy members do not all
  look a little slow;
* noise is the **MAD** (median absolute deviation, × 1.4826 = a standard deviation for normal noise) of samples
  around their own median, relative to it, corrected for small samples; the caller pools it over a group and
  over all groups of the same kind (``pooled_sigma``: a floor, one group's few samples can make the estimate
  erratically small), and a member's own MAD counts where it has at least 6 samples and is noisier. The
  standard error of a median of n samples is ``1.2533 * sigma / sqrt(n)``; that of the baseline is included;
* ``Comparison.z`` is the log ratio to the baseline in standard errors (timing noise is multiplicative), and
  ``Comparison.superiority`` the probability that a sample of the member is slower than one of a healthy peer
  (a rank statistic, which heavy-tailed or two-mode noise cannot push the way it can push a median);
* paired over steps, ``signed_rank_p`` is Wilcoxon's signed-rank test: is one member's per-step total above
  another's in a way that the ranks of the differences cannot explain by chance? Paired by step, so what all
  members share in a step (its data, a slow collective) cancels; rank-based, so one burst, however large, weighs
  as one step; and it uses the size of the differences, so a slowdown that hits 40 % of the steps hard is found
  where a sign test would need far more steps. ``trimmed_mean`` gives the size of such an excess;
* ``sign_flip_p`` is the same pairing with the differences' sizes kept: for waits that are near zero when
  healthy and large when hit;
* against itself, ``later_steps_change`` compares a member's later steps with its own earlier ones, split
  wherever the change looks likeliest: a change during the run, where there is no peer to compare with.
  Unpaired, by two tests: ``rank_sum_p`` (a shift of all the later steps) and ``exceedance_p`` (some of them
  far above every earlier step: bursts, which hit one step in two and leave the rank sum short of
  significance), family-wise over the tests and splits by permutation; sizes as 10 %-trimmed means, which a
  slowdown in part of the later steps moves by that part's share, where a median need not move.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any, Optional

__all__ = [
    "Comparison",
    "HistoryChange",
    "Level",
    "compare_with_peers",
    "exceedance_p",
    "later_steps_change",
    "levels_of",
    "lower_half_bias",
    "lower_half_median",
    "mad_sigma",
    "pooled_sigma",
    "probability_of_superiority",
    "rank_sum_p",
    "signed_rank_p",
    "trimmed_mean",
]

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_MEDIAN_SE = 1.2533  # standard error of a median of n normal samples: 1.2533 * sigma / sqrt(n)
_SIGMA_FLOOR = 0.003  # relative noise floor: timer resolution, and MAD = 0 from identical samples
_OWN_NOISE_MIN_SAMPLES = 6  # below this a series' own MAD is too erratic; the group's pooled noise stands in


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


def _median_se(values: Sequence[float], center: float, sigma_floor: float) -> float:
    """Standard error of the median of ``values`` (absolute units) from their relative noise: their own MAD
    when there are enough of them, never less than the group's pooled relative noise ``sigma_floor``."""
    sigma = sigma_floor
    if len(values) >= _OWN_NOISE_MIN_SAMPLES and center > 0:
        sigma = max(mad_sigma([v / center - 1.0 for v in values]) * _small_sample(len(values)), sigma_floor)
    return _MEDIAN_SE * sigma * abs(center) / math.sqrt(max(len(values), 1))


@dataclass
class Level:
    """A rank's (or link's) median for one op, with the standard error of that median."""

    median: float
    se: float
    n: int
    samples: list[float] = field(default_factory=list)


def levels_of(samples: dict[str, list[float]], sigma_floor: float) -> dict[str, Level]:
    """Per op: the median of its samples and that median's standard error (relative noise never below
    ``sigma_floor``); ops without samples are left out."""
    levels = {}
    for key, values in samples.items():
        if values:
            median = statistics.median(values)
            levels[key] = Level(median, _median_se(values, median, sigma_floor), len(values), sorted(values))
    return levels


def probability_of_superiority(levels: dict[Any, dict[str, Level]], member: Any, keys: Sequence[str]) -> float:
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


def pooled_sigma(samples: Iterable[list[float]]) -> float:
    """Relative noise of single samples pooled over many series (each normalised by its own median)."""
    residuals: list[float] = []
    for values in samples:
        if len(values) >= 2:
            center = statistics.median(values)
            if center > 0:
                residuals += [(v / center - 1.0) * _small_sample(len(values)) for v in values]
    return max(mad_sigma(residuals), _SIGMA_FLOOR) if len(residuals) >= 2 else _SIGMA_FLOOR


@dataclass
class Comparison:
    """One member of a peer group against the group's healthy level (summed over the ops it has)."""

    member: Any
    median: float  # sum over ops of the member's medians
    baseline: float  # sum over the same ops of the group's healthy levels
    noise: float  # standard error of ``log(median / baseline)``
    n: int
    levels: dict[Any, dict[str, Level]] = field(repr=False, default_factory=dict)  # the whole group's
    keys: list[str] = field(default_factory=list)  # the ops compared
    _superiority: Optional[float] = None

    @property
    def superiority(self) -> float:
        """P(a sample of this member > a sample of a healthy peer): computed on first use (for candidates)."""
        if self._superiority is None:
            self._superiority = probability_of_superiority(self.levels, self.member, self.keys)
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


def compare_with_peers(levels: dict[Any, dict[str, Level]]) -> list[Comparison]:
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
            Comparison(
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


def signed_rank_p(differences: Sequence[float]) -> float:
    """One-sided p-value of Wilcoxon's signed-rank test that ``differences`` are centred above 0.

    Zeros are dropped (Wilcoxon's convention); ties in ``|d|`` get their average rank. Exact (the null
    distribution of the positive rank sum, by dynamic programming over doubled ranks) up to 60 differences
    without ties, the normal approximation with continuity and tie corrections beyond. Under the null
    hypothesis (the two members are exchangeable within a step) every difference is as likely positive as
    negative, whatever its distribution. 1.0 for no differences."""
    d = [x for x in differences if x != 0 and math.isfinite(x)]
    n = len(d)
    if n == 0:
        return 1.0
    order = sorted(range(n), key=lambda i: abs(d[i]))
    ranks = [0.0] * n
    i = 0
    tied = False
    while i < n:
        j = i
        while j + 1 < n and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        tied |= j > i
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    positive = sum(r for r, x in zip(ranks, d) if x > 0)
    if n <= 60 and not tied:
        # counts[w] = number of sign patterns whose positive rank sum is w (ranks 1..n)
        total = n * (n + 1) // 2
        counts = [1] + [0] * total
        for r in range(1, n + 1):
            for w in range(total, r - 1, -1):
                counts[w] += counts[w - r]
        at_least = sum(counts[int(round(positive)) :])
        return at_least / float(2**n)
    mean = n * (n + 1) / 4.0
    ties = defaultdict(int)
    for r in ranks:
        ties[r] += 1
    variance = n * (n + 1) * (2 * n + 1) / 24.0 - sum(t**3 - t for t in ties.values()) / 48.0
    if variance <= 0:
        return 1.0
    z = (positive - mean - 0.5) / math.sqrt(variance)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def sign_flip_p(differences: Sequence[float], draws: int = 5_000) -> float:
    """One-sided p-value that the mean of ``differences`` is above 0, by flipping their signs (paired
    permutation): under the null hypothesis each difference is as likely negative. Unlike ``signed_rank_p`` it
    weighs the differences by their size, so a few huge ones in many near zero (a CPU limit that stops a process
    in some steps and not others) count for what they are; the most it can say with k nonzero differences is
    2^-k. Exact up to 14 differences, else ``draws`` random flips (seeded: the same input, the same p)."""
    d = [x for x in differences if x != 0 and math.isfinite(x)]
    n = len(d)
    if n == 0:
        return 1.0
    observed = sum(d) * (1 - 1e-12)  # a flip as extreme as the observed signs counts
    if n <= 14:
        patterns = range(2**n)
        signs = ((1 if (bits >> i) & 1 else -1 for i in range(n)) for bits in patterns)
        return sum(sum(x * z for x, z in zip(d, flip)) >= observed for flip in signs) / 2**n
    rng = random.Random(0)
    extreme = sum(sum(x if rng.random() < 0.5 else -x for x in d) >= observed for _ in range(draws))
    return (extreme + 1) / (draws + 1)


def trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    """The mean of ``values`` without the ``cut`` fraction at each end (at least one each from 10 values on):
    a slowdown in 40 % of the steps moves it by 40 % of its size, a single burst barely."""
    if not values:
        raise ValueError("trimmed_mean of no values")
    ordered = sorted(values)
    k = int(len(ordered) * cut)
    kept = ordered[k : len(ordered) - k] or ordered
    return statistics.fmean(kept)


def rank_sum_p(slower: Sequence[float], faster: Sequence[float]) -> float:
    """One-sided p-value of the Mann-Whitney rank-sum test that ``slower`` tends to exceed ``faster``.

    Unpaired (two stretches of one rank's steps), rank-based (a burst weighs as one sample), by the normal
    approximation with tie and continuity corrections: meant for 8 or more values on each side."""
    n1, n2 = len(slower), len(faster)
    if not n1 or not n2:
        return 1.0
    values = sorted([(v, 0) for v in slower] + [(v, 1) for v in faster])
    ranks = [0.0] * len(values)
    ties = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2.0 + 1.0
        ties.append(j - i + 1)
        i = j + 1
    u = sum(r for r, (_, side) in zip(ranks, values) if side == 0) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    variance = n1 * n2 / 12.0 * ((n + 1) - sum(t**3 - t for t in ties) / (n * (n - 1)))
    if variance <= 0:
        return 1.0
    z = (u - n1 * n2 / 2.0 - 0.5) / math.sqrt(variance)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def exceedance_p(later: Sequence[float], earlier: Sequence[float]) -> float:
    """One-sided p-value that as many of ``later`` lie above every value of ``earlier`` by chance: with k of them
    above the earlier maximum, the k largest of all values are all later ones, which for exchangeable values
    has probability C(n, k) / C(n + m, k). Exact, no distribution assumed; a single earlier hiccup only makes it
    conservative."""
    if not later or not earlier:
        return 1.0
    top = max(earlier)
    k = sum(1 for v in later if v > top)
    return math.comb(len(later), k) / math.comb(len(later) + len(earlier), k)


@dataclass(frozen=True)
class HistoryChange:
    """A member's later steps against its own earlier ones: trimmed means, relative excess, one-sided p-value."""

    earlier_steps: tuple[int, int]
    later_steps: tuple[int, int]
    before: float
    after: float
    excess: float
    p: float


_MAX_CUTS = 48  # split points tried at most (evenly spread): the permutations' cost grows with them
_PERMUTATIONS = (2_000, 20_000)  # fewest and most, for a family-wise p-value down to about 20 / the most


def later_steps_change(per_step: dict[int, float], min_steps: int, alpha: float = 0.01) -> Optional[HistoryChange]:
    """Whether the later steps are slower than the earlier ones, wherever between them the change began.

    Every split leaving at least ``min_steps`` on each side is tried (None if not even the halves do); each is
    tested by ``rank_sum_p`` and ``exceedance_p`` (see the module docstring), and the split with the smallest of
    these p-values is the change point: its trimmed means (10 %) give the sizes. Its ``p`` is family-wise over the
    splits and the two tests, by permutation: how often do the steps in a random order give as small a p-value at
    some split? Exact for exchangeable steps, and tight where a Bonferroni bound is not: neighbouring splits test
    nearly the same thing. The permutations run only where the Bonferroni bound (2 x splits x the smallest
    p-value) is above ``alpha`` and the smallest p-value below it, that is where they can change the decision,
    with enough of them to resolve ``alpha``; elsewhere ``p`` is that bound. A zero baseline returns None.

    Why all splits: fixed ones see a change near them only. On synthetic one-process runs (34 steps, compute 1.8x
    from the onset, ``benchmarks/megascan_onsets.py``) the halves, and then the splits at a third, half and two
    thirds with Bonferroni, missed changes that began early or late, and bursts (a 60 % share of the later
    steps hit) at most onsets."""
    steps = sorted(per_step)
    n = len(steps)
    if n // 2 < min_steps:
        return None
    values = [per_step[s] for s in steps]
    cuts = _spread(list(range(min_steps, n - min_steps + 1)), _MAX_CUTS)
    best: Optional[HistoryChange] = None
    smallest = 1.0
    for cut in cuts:
        earlier, later = values[:cut], values[cut:]
        before, after = trimmed_mean(earlier), trimmed_mean(later)
        if before <= 0:
            return None
        p = min(rank_sum_p(later, earlier), exceedance_p(later, earlier))
        change = HistoryChange(
            earlier_steps=(steps[0], steps[cut - 1]),
            later_steps=(steps[cut], steps[-1]),
            before=before,
            after=after,
            excess=after / before - 1.0,
            p=p,
        )
        if best is None or (p, -change.excess) < (best.p, -best.excess):
            best, smallest = change, p
    assert best is not None
    bound = min(1.0, 2.0 * len(cuts) * smallest)
    if bound < alpha or smallest >= alpha:
        return replace(best, p=bound)
    return replace(best, p=min(bound, _permutation_p(values, cuts, smallest, alpha)))


def _spread(cuts: list[int], most: int) -> list[int]:
    if len(cuts) <= most:
        return cuts
    return sorted({cuts[round(i * (len(cuts) - 1) / (most - 1))] for i in range(most)})


def _permutation_p(values: Sequence[float], cuts: Sequence[int], smallest: float, alpha: float) -> float:
    """The share of random orders of ``values`` (the observed one counted in) whose smallest p-value over ``cuts``
    and both tests is at most ``smallest``. Stops early once that share is surely above ``alpha``.

    In rank space, with each split's thresholds computed once: the rank sum of the later steps against the sum
    at which ``rank_sum_p`` reaches ``smallest``, and their count above every earlier step (which, as the earlier
    maximum is in front, is the count of all steps above it) against the count at which ``exceedance_p`` does.
    Seeded by the number of steps: the same steps give the same p-value."""
    n = len(values)
    ranks = _average_ranks(values)
    ties = sum(t**3 - t for t in Counter(ranks).values())
    ordered = sorted(ranks)
    above = {r: n - bisect.bisect_right(ordered, r) for r in set(ranks)}  # steps ranked above r
    z = -NormalDist().inv_cdf(max(smallest, 1e-300))
    slack = 1.0 + 1e-9  # a permutation as extreme as the observed order counts
    sum_needed, count_needed = [], []
    for cut in cuts:
        n1, n2 = n - cut, cut
        variance = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1)))
        sd = math.sqrt(variance) if variance > 0 else math.inf
        sum_needed.append(n1 * (n1 + 1) / 2.0 + n1 * n2 / 2.0 + 0.5 + z * sd - 1e-9)
        count_needed.append(_exceedance_count_needed(n1, n, smallest * slack))
    most = min(_PERMUTATIONS[1], max(_PERMUTATIONS[0], math.ceil(20.0 / alpha)))
    give_up = math.ceil(alpha * (most + 1))  # this many as extreme: p above alpha whatever the rest
    rng = random.Random(n)
    order = list(ranks)
    extreme = 0
    for done in range(1, most + 1):
        rng.shuffle(order)
        suffix = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            suffix[i] = suffix[i + 1] + order[i]
        prefix_max, position = -math.inf, 0
        for cut, sum_need, count_need in zip(cuts, sum_needed, count_needed):
            while position < cut:
                prefix_max = max(prefix_max, order[position])
                position += 1
            if suffix[cut] >= sum_need or above[prefix_max] >= count_need:
                extreme += 1
                break
        if extreme >= give_up:
            return (1 + extreme) / (done + 1)
    return (1 + extreme) / (most + 1)


def _exceedance_count_needed(later: int, total: int, p: float) -> int:
    """The fewest later steps above every earlier one for ``exceedance_p`` at most ``p`` (more than ``total``:
    none). C(later, k) / C(total, k), built up one factor at a time (no huge binomials)."""
    ratio = 1.0
    for k in range(1, later + 1):
        ratio *= (later - k + 1) / (total - k + 1)
        if ratio <= p:
            return k
    return total + 1


def _average_ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks
