"""A discrete-event simulator of one pipeline step under MegaDPP's policies, on the policy code training runs.

The contract: a :class:`Scenario` (pipeline layout, compute times, link delays, a seed) and a policy name in,
a :class:`SimulationResult` out (step time, per-rank busy and idle time, activations held, deadlock details,
optionally the timeline); :func:`compare` runs policies × ``extra_activations`` over seeds and reports the
median step time and the speed-up over megatron-core's order (``static`` at ``extra_activations=0``).

**Same code as training.** Every rank keeps a :class:`~lightning_megatron.pipeline.dpp.policy.StageState` of
its :class:`~lightning_megatron.pipeline.dpp.plan.StagePlan` and asks a policy from
:func:`~lightning_megatron.pipeline.dpp.policy.make_policy` what to run whenever it is idle, exactly as the
executor does; the simulator only supplies time. A task's output message (``plan.output_of``) arrives at
``plan.destination_rank`` at ``end + transfer_s + delay``, never before the message sent before it on the same
``(src, dst)`` link (links are FIFO); ``Decision(None, wait_until)`` idles the rank until its next arrival or
``wait_until``.

**Same noise for every policy.** Link delays are drawn per ``(src, dst, n)`` (``n``: the link's message
counter) and compute times per ``(rank, task)``, from seeded streams and before the run, never in event order:
for one seed every policy and every ``extra_activations`` meets the same delays and the same compute times, so
differences between them are the policies' doing. A callable ``delay(src, dst, n) -> seconds`` plugs in any
other delay model (for instance one that mirrors a transport-side delay spec).

**Checked, not assumed.** The simulator raises :class:`SimulationInvariantError` if a policy runs a task that is
not ready or runs a task twice, or if a rank ever holds more than ``state.cap`` activations; at the end every task
must have run once. When no event is pending and a rank has not finished, the result says ``deadlock=True`` and
which rank waits for which message (the simulation never loops forever).

Pure Python (plus numpy for the draws), no torch, no processes: a PP4 × VPP2 × 16-microbatch step takes a few
milliseconds, so hundreds of seeds take seconds.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.dpp.plan import ACTIVATION, FORWARD, Task
from lightning_megatron.pipeline.dpp.policy import POLICIES, StageState, make_policy
from lightning_megatron.pipeline.dpp.scenario import (
    DELAY_KINDS,
    DelayModel,
    Scenario,
    _is_int,
    _is_number,
    _link_counts,
    _plan,
)

__all__ = [
    "DELAY_KINDS",
    "ComparisonRow",
    "DelayModel",
    "Scenario",
    "SimulationInvariantError",
    "SimulationResult",
    "Span",
    "Wait",
    "compare",
    "format_table",
    "simulate",
]

# Seed-stream tags: the compute and the delay draws come from independent streams of one seed.
_COMPUTE_STREAM, _DELAY_STREAM = 0xC0, 0xDE


class SimulationInvariantError(RuntimeError):
    """A policy (or the simulator) broke a rule that training relies on: a task run twice or before its input,
    or more activations held than the memory rule's cap. Never raised for a correct policy."""


# -- the draws ---------------------------------------------------------------------------------------------------


class _Draws(NamedTuple):
    compute: list[list[float]]  # [rank][index of the task in plan.order] -> seconds
    delays: dict[tuple[int, int], list[float]]  # (src, dst) -> [delay of message n]


def _draw(scenario: Scenario) -> _Draws:
    """Every random quantity of one seed, drawn up front per (rank, task) and per (src, dst, n)."""
    P, V, M, seed = scenario.pipeline, scenario.chunks, scenario.microbatches, scenario.seed
    cv = scenario.compute_jitter
    sigma = math.sqrt(math.log1p(cv * cv))
    compute: list[list[float]] = []
    for rank in range(P):
        order = _plan(P, rank, V, M).order
        base = np.array([scenario.compute_s(rank, t.phase) for t in order])
        if sigma > 0:  # log-normal: positive, mean 1, coefficient of variation cv
            rng = np.random.default_rng([seed, _COMPUTE_STREAM, rank])
            base = base * np.exp(sigma * rng.standard_normal(len(order)) - 0.5 * sigma * sigma)
        compute.append(base.tolist())
    delays: dict[tuple[int, int], list[float]] = {}
    selected = None if scenario.delay_links is None else set(scenario.delay_links)
    for (src, dst), n in sorted(_link_counts(P, V, M).items()):
        unselected = selected is not None and (src, dst) not in selected
        if unselected or (scenario.delay is None and scenario.delay_kind == "none"):
            delays[(src, dst)] = [0.0] * n
        elif scenario.delay is not None:
            delays[(src, dst)] = [_checked_delay(scenario.delay, src, dst, i) for i in range(n)]
        else:
            delays[(src, dst)] = _draw_delays(scenario, src, dst, n)
    return _Draws(compute, delays)


def _draw_delays(scenario: Scenario, src: int, dst: int, n: int) -> list[float]:
    rng = np.random.default_rng([scenario.seed, _DELAY_STREAM, src, dst])
    mean, kind = scenario.delay_mean_s, scenario.delay_kind
    if kind == "constant":
        return [mean] * n
    if kind == "exponential":
        return rng.exponential(mean, n).tolist()
    if kind == "uniform":
        return rng.uniform(0.0, 2.0 * mean, n).tolist()
    return np.where(rng.random(n) < scenario.delay_probability, mean, 0.0).tolist()  # spike


def _checked_delay(delay: DelayModel, src: int, dst: int, n: int) -> float:
    value = delay(src, dst, n)
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise MegatronConfigError(
            f"Scenario(delay=...): delay({src}, {dst}, {n}) returned {value!r}; it must return seconds >= 0."
        )
    return float(value)


# -- the result --------------------------------------------------------------------------------------------------


class Span(NamedTuple):
    """One task on one rank's timeline."""

    task: Task
    start: float
    end: float


class Wait(NamedTuple):
    """At a deadlock: what rank ``rank`` waits for (megatron-core's next task there and its missing input)."""

    rank: int
    task: Optional[Task]
    message: Optional[str]
    from_rank: Optional[int]

    def __str__(self) -> str:
        if self.task is None:
            return f"rank {self.rank}: finished"
        if self.message is None:
            return f"rank {self.rank}: {self.task} is ready but the policy does not run it"
        return f"rank {self.rank}: {self.task} waits for the {self.message} from rank {self.from_rank}"


@dataclass(frozen=True)
class SimulationResult:
    """One simulated step of one policy."""

    policy: str
    extra_activations: int
    seed: int
    step_s: float
    """The makespan: when the last task of the step ends (inf at a deadlock)."""
    busy_s: tuple[float, ...]
    """Per rank: time spent computing."""
    idle_s: tuple[float, ...]
    """Per rank: ``step_s - busy_s`` (bubbles and waits; inf at a deadlock)."""
    peak_activations: tuple[int, ...]
    """Per rank: the most activations held at once (``StageState.peak``)."""
    cap: tuple[float, ...]
    """Per rank: the memory rule's cap (megatron-core's own peak + ``extra_activations``)."""
    deadlock: bool = False
    waiting: tuple[Wait, ...] = ()
    """At a deadlock: every unfinished rank and what it waits for."""
    stuck_at_s: Optional[float] = None
    """At a deadlock: the time of the last event."""
    timeline: Optional[tuple[tuple[Span, ...], ...]] = None
    """Per rank, the tasks run (with ``timeline=True``)."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time in the step."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_s) if math.isfinite(self.step_s) else 1.0

    def describe_deadlock(self) -> str:
        return "; ".join(str(w) for w in self.waiting if w.task is not None)


# -- the simulation ----------------------------------------------------------------------------------------------

_END, _ARRIVE, _WAKE = 0, 1, 2


def simulate(scenario: Scenario, policy: str = "static", *, timeline: bool = False) -> SimulationResult:
    """Simulate one step of ``scenario`` with ``policy`` (one of :data:`~lightning_megatron.pipeline.dpp.policy.POLICIES`).

    ``timeline=True`` also records every rank's tasks with their start and end times (for plotting).
    """
    if policy not in POLICIES:
        raise MegatronConfigError(f"simulate(policy={policy!r}): choose one of {', '.join(POLICIES)}.")
    return _simulate(scenario, policy, scenario.extra_activations, _draw(scenario), timeline)


def _simulate(scenario: Scenario, policy: str, extra: int, draws: _Draws, record: bool) -> SimulationResult:
    P, V, M = scenario.pipeline, scenario.chunks, scenario.microbatches
    plans = [_plan(P, r, V, M) for r in range(P)]
    states = [StageState(plan, extra) for plan in plans]
    policies = [make_policy(policy, grace_fraction=scenario.grace_fraction) for _ in range(P)]
    positions = [plan.position for plan in plans]
    compute, delays = draws.compute, draws.delays
    transfer = scenario.transfer_s

    heap: list[tuple[float, int, int, int, Any]] = []
    seq = count()
    running: list[Optional[Task]] = [None] * P
    wake: list[Optional[float]] = [None] * P  # the pending wake-up of each rank (stale ones are skipped)
    busy = [0.0] * P
    sent: dict[tuple[int, int], int] = dict.fromkeys(delays, 0)
    last_arrival: dict[tuple[int, int], float] = dict.fromkeys(delays, 0.0)
    spans: list[list[Span]] = [[] for _ in range(P)]
    total = sum(len(plan.order) for plan in plans)
    ran = 0
    max_events = 64 * total + 10_000  # a policy that keeps asking to be woken without running anything
    events = 0
    now = 0.0
    end_time = 0.0

    def decide(rank: int) -> None:
        state = states[rank]
        decision = policies[rank].choose(state, now)
        task = decision.task
        if task is not None:
            if task in state.done or not state.ready(task):
                raise SimulationInvariantError(
                    f"policy {policy!r} on rank {rank} chose {task}, which is "
                    + ("done already" if task in state.done else "not ready (its input has not arrived)")
                    + f" at t={now:g}"
                )
            running[rank] = task
            duration = compute[rank][positions[rank][task]]
            if record:
                spans[rank].append(Span(task, now, now + duration))
            heapq.heappush(heap, (now + duration, next(seq), _END, rank, task))
        elif decision.wait_until is not None and math.isfinite(decision.wait_until):
            if decision.wait_until <= now:
                raise SimulationInvariantError(
                    f"policy {policy!r} on rank {rank} waits until t={decision.wait_until:g}, not after now={now:g}"
                )
            if wake[rank] != decision.wait_until:
                wake[rank] = decision.wait_until
                heapq.heappush(heap, (decision.wait_until, next(seq), _WAKE, rank, None))

    for rank in range(P):
        decide(rank)
    while heap:
        now = heap[0][0]
        touched: set[int] = set()
        while heap and heap[0][0] == now:  # every event of this instant first, then the decisions
            _, _, kind, rank, payload = heapq.heappop(heap)
            events += 1
            if kind == _END:
                state, task = states[rank], payload
                state.complete(task)
                ran += 1
                if state.inflight > state.cap:
                    raise SimulationInvariantError(
                        f"policy {policy!r}: rank {rank} holds {state.inflight} activations after {task}, "
                        f"over its cap {state.cap} (extra_activations={extra})"
                    )
                duration = compute[rank][positions[rank][task]]
                busy[rank] += duration
                policies[rank].observe(task, duration)
                running[rank] = None
                end_time = now
                plan = plans[rank]
                message = plan.output_of(task)
                if message is not None:
                    dst = plan.destination_rank(message)
                    link = (rank, dst)
                    n = sent[link]
                    sent[link] = n + 1
                    arrival = max(now + transfer + delays[link][n], last_arrival[link])  # links are FIFO
                    last_arrival[link] = arrival
                    heapq.heappush(heap, (arrival, next(seq), _ARRIVE, dst, message))
            elif kind == _ARRIVE:
                states[rank].arrive(payload)
            elif wake[rank] == now:
                wake[rank] = None
            else:
                continue  # a stale wake-up
            touched.add(rank)
        if events > max_events:
            raise SimulationInvariantError(
                f"policy {policy!r}: {events} events for {total} tasks; a rank keeps waking without progress"
            )
        for rank in sorted(touched):
            if running[rank] is None and not states[rank].finished:
                decide(rank)

    finished = all(state.finished for state in states)
    if finished and ran != total:
        raise SimulationInvariantError(f"policy {policy!r}: {ran} tasks ran, the step has {total}")
    waiting: tuple[Wait, ...] = ()
    if not finished:
        waiting = tuple(_wait_of(r, states[r]) for r in range(P) if not states[r].finished)
    step = end_time if finished else math.inf
    return SimulationResult(
        policy=policy,
        extra_activations=extra,
        seed=scenario.seed,
        step_s=step,
        busy_s=tuple(busy),
        idle_s=tuple(step - b for b in busy),
        peak_activations=tuple(state.peak for state in states),
        cap=tuple(state.cap for state in states),
        deadlock=not finished,
        waiting=waiting,
        stuck_at_s=None if finished else now,
        timeline=tuple(tuple(s) for s in spans) if record else None,
    )


def _wait_of(rank: int, state: StageState) -> Wait:
    task = state.static_next()
    if task is None:
        return Wait(rank, None, None, None)
    plan = state.plan
    message = plan.input_of(task)
    if message is None or message in state.arrived:
        if task.phase != FORWARD and Task(FORWARD, task.chunk, task.microbatch) not in state.done:
            return Wait(rank, task, f"forward {Task(FORWARD, task.chunk, task.microbatch)} (not run)", rank)
        return Wait(rank, task, None, None)
    what = "activation" if message.kind == ACTIVATION else "gradient"
    return Wait(
        rank, task, f"{what} of stage {message.stage}, microbatch {message.microbatch}", plan.source_rank(message)
    )


# -- comparisons -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComparisonRow:
    """One (policy, extra_activations) cell of :func:`compare`, over all seeds."""

    policy: str
    extra_activations: int
    median_step_s: float
    """Median step time over the seeds (inf if half of them deadlocked)."""
    speedup: float
    """The baseline's median step time (``static`` at ``extra_activations=0``) divided by this row's."""
    p90_step_s: float
    median_bubble: float
    """Median over the seeds of the idle share of all ranks' time."""
    peak_activations: int
    """The most activations any rank held, over all seeds."""
    cap: int
    """The memory rule's cap (the largest over the ranks)."""
    deadlocks: int
    seeds: int


def compare(
    scenario: Scenario,
    policies: Sequence[str] = POLICIES,
    extra: Sequence[int] = (0, 2, 4),
    seeds: Union[int, Iterable[int]] = 20,
    *,
    progress: bool = False,
) -> list[ComparisonRow]:
    """Every policy at every ``extra`` activations, over ``seeds`` (a count from ``scenario.seed``, or the seeds).

    Each seed's draws are shared by all rows, so the rows differ only by policy and memory slack. The baseline
    of ``speedup`` is ``static`` at ``extra_activations=0`` (megatron-core's order), run whether or not
    ``policies`` names it. ``static`` ignores the memory slack, so it is run once per seed and its row repeated.
    ``progress=True`` shows a progress bar (tqdm if installed) on stderr.
    """
    for name in policies:
        if name not in POLICIES:
            raise MegatronConfigError(
                f"compare(policies=...): {name!r} is not a policy; choose from {', '.join(POLICIES)}."
            )
    extras = tuple(extra)
    if not extras or any(not _is_int(e) or e < 0 for e in extras):
        raise MegatronConfigError(f"compare(extra={extra!r}): give one or more integers >= 0.")
    seed_list = list(range(scenario.seed, scenario.seed + seeds)) if _is_int(seeds) else [int(s) for s in seeds]
    if not seed_list:
        raise MegatronConfigError(f"compare(seeds={seeds!r}): give at least one seed.")
    runs = [(p, e) for p in policies for e in extras if p != "static"]
    per_seed = 1 + len(runs)
    results: dict[tuple[str, int], list[SimulationResult]] = {(p, e): [] for p in policies for e in extras}
    baseline: list[SimulationResult] = []
    with _progress(len(seed_list) * per_seed, progress) as bar:
        for seed in seed_list:
            seeded = scenario.replace(seed=seed)
            draws = _draw(seeded)
            static = _simulate(seeded, "static", 0, draws, False)
            baseline.append(static)
            for e in extras:
                if ("static", e) in results:
                    capped = tuple(c + e for c in static.cap)  # the cap it would have; static ignores it
                    results[("static", e)].append(dataclasses.replace(static, extra_activations=e, cap=capped))
            bar(1)
            for p, e in runs:
                results[(p, e)].append(_simulate(seeded, p, e, draws, False))
                bar(1)
    base = statistics.median(r.step_s for r in baseline)
    rows = []
    for (p, e), rs in results.items():
        steps = sorted(r.step_s for r in rs)
        median = statistics.median(steps)
        rows.append(
            ComparisonRow(
                policy=p,
                extra_activations=e,
                median_step_s=median,
                speedup=base / median if math.isfinite(median) and median > 0 else 0.0,
                p90_step_s=steps[min(len(steps) - 1, math.ceil(0.9 * len(steps)) - 1)],
                median_bubble=statistics.median(r.bubble_fraction for r in rs),
                peak_activations=max(max(r.peak_activations) for r in rs),
                cap=int(max(max(r.cap) for r in rs)),
                deadlocks=sum(r.deadlock for r in rs),
                seeds=len(rs),
            )
        )
    return rows


class _progress:
    """A progress callback: tqdm on stderr when asked for and installed, a plain percentage otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self._bar, self._shown = total, enabled, 0, None, -1
        if enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total, desc="simulating", unit="run", leave=False, file=sys.stderr)
            except ImportError:  # pragma: no cover - tqdm is a dependency of the dev environment
                pass

    def __enter__(self) -> Callable[[int], None]:
        return self.update

    def update(self, n: int) -> None:
        if not self.enabled:
            return
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        percent = 100 * self.done // max(1, self.total)
        if percent // 10 != self._shown // 10:
            self._shown = percent
            print(f"\rsimulating: {percent}%", end="", file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def format_table(rows: Sequence[ComparisonRow]) -> str:
    """A plain-text table of :func:`compare`'s rows, one line per (policy, extra)."""
    header = ("policy", "extra", "median step", "p90 step", "speed-up", "bubble", "peak act (cap)", "deadlocks")
    lines = [header]
    for r in rows:
        lines.append(
            (
                r.policy,
                str(r.extra_activations),
                f"{r.median_step_s:.3f}",
                f"{r.p90_step_s:.3f}",
                f"{r.speedup:.3f}x",
                f"{100 * r.median_bubble:.1f}%",
                f"{r.peak_activations} ({r.cap})",
                f"{r.deadlocks}/{r.seeds}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for i, line in enumerate(lines):
        cells = [c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
