"""Which task a pipeline rank runs next: MegaDPP's policies, and the memory rule that keeps every one deadlock-free.

:class:`StageState` is what one rank has done and received so far in a step; the executor
(:mod:`~lightning_megatron.pipeline.dpp.schedule`) and the simulator (:mod:`~lightning_megatron.pipeline.dpp.simulate`)
both write it, and a :class:`Policy` reads it and returns a :class:`Decision`: run this task, or wait (until a
message arrives, or until a given time). The same code decides in training and in simulation.

Policies (``policy=`` of the ``"dpp"`` schedule):

* ``static``: megatron-core's order, exactly (waits for each task's input in turn);
* ``depth-first`` / ``breadth-first``: any ready task, backwards first; forwards of later chunks first (push a
  microbatch through the model) or of earlier chunks first (push every microbatch through a chunk);
* ``adaptive``: megatron-core's order, unless the next task's input is later than a grace time (a fraction of the
  measured forward time); then the earliest ready task of that order, until the late input arrives.

**Memory rule.** A rank holds the activations of every forward whose backward has not run. Backwards are always
allowed. A forward ahead of megatron-core's order is allowed only if megatron-core's order, continued from the
current state with that forward done, never holds more than ``cap`` activations, where ``cap`` is the static
order's own peak (its warm-up + 1) plus ``extra_activations``. The static continuation therefore always fits, and
it is deadlock-free (it is megatron-core's schedule, with some tasks done early), so whatever a policy picks, every
rank can always fall back to it: no policy can deadlock, whatever the delays. The simulator checks this over many
seeds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple, Optional

from lightning_megatron.pipeline.dpp.plan import BACKWARD, FORWARD, Message, StagePlan, Task

__all__ = ["POLICIES", "Decision", "Policy", "StageState", "make_policy"]

POLICIES = ("static", "adaptive", "depth-first", "breadth-first")


class Decision(NamedTuple):
    task: Optional[Task]
    """The task to run now, or None: wait for a message (or until ``wait_until``)."""
    wait_until: Optional[float] = None
    """With ``task=None``: decide again at this time (the adaptive policy's grace expiry) even if nothing arrives."""


class StageState:
    """One rank's progress through a step: tasks done, messages arrived, activations held."""

    def __init__(self, plan: StagePlan, extra_activations: int = 0) -> None:
        if extra_activations < 0:
            raise ValueError(f"extra_activations={extra_activations} must be >= 0")
        self.plan = plan
        self.cap = math.inf if plan.forward_only else plan.peak_inflight + extra_activations
        self.done: set[Task] = set()
        self.arrived: set[Message] = set()
        self.inflight = 0
        self.peak = 0
        self._next = 0  # index of the first task of plan.order not done
        self._ready: set[Task] = set()
        self._consumer: dict[Message, Task] = {}
        for task in plan.order:
            message = plan.input_of(task)
            if message is None:
                if task.phase == FORWARD:
                    self._ready.add(task)
            else:
                self._consumer[message] = task
        self.stalled_since: Optional[float] = None  # when the static next task was first found not ready
        self._fits_cache: dict[Task, bool] = {}

    # -- reading --------------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.plan.order)

    def static_next(self) -> Optional[Task]:
        order = self.plan.order
        while self._next < len(order) and order[self._next] in self.done:
            self._next += 1
        return order[self._next] if self._next < len(order) else None

    def ready(self, task: Task) -> bool:
        return task in self._ready

    def ready_tasks(self) -> Iterable[Task]:
        return self._ready

    def awaited(self) -> list[Message]:
        """Messages this rank still expects (for a wait on any of them)."""
        return [m for m, t in self._consumer.items() if m not in self.arrived and t not in self.done]

    def admissible(self, task: Task) -> bool:
        """The memory rule (module docstring). Backwards always; the static next task always."""
        if task.phase == BACKWARD or self.plan.forward_only or task == self.static_next():
            return True
        fits = self._fits_cache.get(task)
        if fits is None:
            fits = self._fits_cache[task] = self._static_continuation_fits(task)
        return fits

    def _static_continuation_fits(self, early: Task) -> bool:
        held = self.inflight + 1
        if held > self.cap:
            return False
        order, done = self.plan.order, self.done
        for i in range(self._next, len(order)):
            task = order[i]
            if task in done or task == early:
                continue
            if task.phase == FORWARD:
                held += 1
                if held > self.cap:
                    return False
            else:
                held -= 1
        return True

    # -- writing --------------------------------------------------------------------------------------

    def arrive(self, message: Message) -> None:
        """``message`` was received (its tensor is the executor's to keep)."""
        self.arrived.add(message)
        task = self._consumer.get(message)
        if task is None:
            raise ValueError(f"message {message} is not an input of rank {self.plan.rank}")
        if task.phase == FORWARD or Task(FORWARD, task.chunk, task.microbatch) in self.done:
            self._ready.add(task)

    def complete(self, task: Task) -> None:
        if task in self.done:
            raise ValueError(f"task {task} ran twice")
        if task == self.static_next():  # (before it is done: static_next skips done tasks)
            self.stalled_since = None
        self.done.add(task)
        self._ready.discard(task)
        self._fits_cache.clear()
        if self.plan.forward_only:
            return
        if task.phase == FORWARD:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            backward = Task(BACKWARD, task.chunk, task.microbatch)
            grad = self.plan.input_of(backward)
            if grad is None or grad in self.arrived:
                self._ready.add(backward)
        else:
            self.inflight -= 1


class Policy:
    """Picks the next task. ``observe`` learns from measured task times (only the adaptive policy uses it).

    ``choose(state, now, idle_at)``: ``now`` is the host's clock; ``idle_at``, where the host queues work ahead
    of a GPU, the time the GPU will have finished what is queued (a task's input is late only after that)."""

    name = ""

    def choose(self, state: StageState, now: float, idle_at: Optional[float] = None) -> Decision:
        raise NotImplementedError

    def observe(self, task: Task, seconds: float) -> None:
        pass

    def expected_seconds(self, task: Task) -> Optional[float]:
        """How long ``task`` is expected to take on the device, from what :meth:`observe` learned (None: unknown;
        the executor then counts it as no time when it estimates when queued work ends)."""
        return None


class StaticPolicy(Policy):
    name = "static"

    def choose(self, state: StageState, now: float, idle_at: Optional[float] = None) -> Decision:
        task = state.static_next()
        return Decision(task if task is not None and state.ready(task) else None)


class GreedyPolicy(Policy):
    """Any ready, admissible task; backwards first, then by chunk (depth- or breadth-first), then microbatch."""

    def __init__(self, depth_first: bool) -> None:
        self.name = "depth-first" if depth_first else "breadth-first"
        self._sign = -1 if depth_first else 1

    def _key(self, task: Task) -> tuple[int, int, int]:
        if task.phase == BACKWARD:  # a backward runs chunks downwards: depth-first continues to lower chunks
            return (0, -self._sign * task.chunk, task.microbatch)
        return (1, self._sign * task.chunk, task.microbatch)

    def choose(self, state: StageState, now: float, idle_at: Optional[float] = None) -> Decision:
        best = min((t for t in state.ready_tasks() if state.admissible(t)), key=self._key, default=None)
        return Decision(best)


class AdaptivePolicy(Policy):
    """megatron-core's order unless its next input is late by more than ``grace_fraction`` × a forward's time."""

    name = "adaptive"

    def __init__(self, grace_fraction: float = 0.1, grace_s: Optional[float] = None) -> None:
        self.grace_fraction = grace_fraction
        self._fixed = grace_s
        self.forward_s: Optional[float] = None  # moving averages of measured task times
        self.backward_s: Optional[float] = None

    @property
    def grace(self) -> float:
        if self._fixed is not None:
            return self._fixed
        return math.inf if self.forward_s is None else self.grace_fraction * self.forward_s

    def observe(self, task: Task, seconds: float) -> None:
        if seconds <= 0:
            return
        if task.phase == FORWARD:
            self.forward_s = seconds if self.forward_s is None else 0.8 * self.forward_s + 0.2 * seconds
        else:
            self.backward_s = seconds if self.backward_s is None else 0.8 * self.backward_s + 0.2 * seconds

    def expected_seconds(self, task: Task) -> Optional[float]:
        return self.forward_s if task.phase == FORWARD else self.backward_s

    def choose(self, state: StageState, now: float, idle_at: Optional[float] = None) -> Decision:
        task = state.static_next()
        if task is None or state.ready(task):
            return Decision(task)
        if state.stalled_since is None:  # late counts from when the device would run out of queued work
            state.stalled_since = now if idle_at is None else max(now, idle_at)
        deadline = state.stalled_since + self.grace
        if now < deadline:
            return Decision(None, deadline)
        position = state.plan.position
        best = min((t for t in state.ready_tasks() if state.admissible(t)), key=position.__getitem__, default=None)
        return Decision(best)


def make_policy(name: str, *, grace_fraction: float = 0.1, grace_s: Optional[float] = None) -> Policy:
    if name == "static":
        return StaticPolicy()
    if name == "adaptive":
        return AdaptivePolicy(grace_fraction, grace_s)
    if name in ("depth-first", "breadth-first"):
        return GreedyPolicy(depth_first=name == "depth-first")
    raise ValueError(f"policy={name!r}: choose one of {', '.join(POLICIES)}")
