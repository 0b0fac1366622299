"""The work of one pipeline rank in one step, as data: tasks, their inputs, and megatron-core's static order.

A *task* is one forward or backward of one model chunk on one microbatch. Model chunk ``c`` of pipeline rank
``r`` is global stage ``s = c·P + r`` (megatron-core's virtual-pipeline layout), so a forward needs the
activation of stage ``s − 1`` and a backward needs the gradient of stage ``s + 1`` and its own forward.
Every message is named by what it carries: ``(kind, producing stage, microbatch)``; both ends derive the
same name, and :func:`message_tag` packs it with the step into the transports' integer tag.

:func:`static_order` is megatron-core 0.16.1's order, re-derived rather than imported (its helpers are
closures): warm-up forwards, then one forward and one backward at a time, then the cool-down backwards,
walking ``get_schedule_table``'s (microbatch, chunk) table. Replaying it exactly is what makes the
``static`` policy bit-identical to the ``"interleaved"`` and ``"1f1b"`` schedules.

Pure Python and no torch: the executor and the simulator share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Optional

__all__ = [
    "ACTIVATION",
    "BACKWARD",
    "DECISION",
    "FORWARD",
    "GRADIENT",
    "Message",
    "StagePlan",
    "Task",
    "message_tag",
    "schedule_table",
    "warmup_count",
]

FORWARD, BACKWARD = "F", "B"
ACTIVATION, GRADIENT, DECISION = 0, 1, 2  # DECISION: a TP leader's choice, told to its TP peers


class Task(NamedTuple):
    phase: str  # FORWARD or BACKWARD
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.phase}{self.chunk}.{self.microbatch}"


class Message(NamedTuple):
    kind: int  # ACTIVATION (forward), GRADIENT (backward) or DECISION
    stage: int  # the global stage that produced it (DECISION: 0)
    microbatch: int  # (DECISION: the decision's sequence number in the step)


def message_tag(message: Message, step: int) -> int:
    """The transport tag of ``message`` in ``step``: unique within a job, the same on both ends, < 2**62."""
    kind, stage, microbatch = message
    if not (0 <= kind < 4 and 0 <= stage < 1 << 16 and 0 <= microbatch < 1 << 24):
        raise ValueError(f"message {message} out of the tag's range (stage < 65536, microbatch < 2**24)")
    return ((step % (1 << 20)) << 42) | (kind << 40) | (stage << 24) | microbatch


def schedule_table(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """megatron-core's ``get_schedule_table``: (microbatch, chunk) in virtual-microbatch order."""
    table: list[tuple[int, int]] = []
    for first in range(0, microbatches, group):
        last = microbatches if first + group >= microbatches else first + group
        table.extend((m, c) for c in range(chunks) for m in range(first, last))
    return table


def warmup_count(pipeline: int, rank: int, chunks: int, microbatches: int, group: int) -> int:
    """Forwards before the first backward in megatron-core's order (1F1B when ``chunks == 1``)."""
    if chunks == 1:
        warmup = pipeline - rank - 1
    else:
        warmup = (pipeline - rank - 1) * 2 + (chunks - 1) * group
    return min(warmup, microbatches * chunks)


@dataclass(frozen=True)
class StagePlan:
    """Everything rank ``rank`` of a ``pipeline``-stage pipeline runs in one step, and what each task needs."""

    pipeline: int
    rank: int
    chunks: int
    microbatches: int
    group: Optional[int] = None  # microbatch_group_size_per_vp_stage; megatron-core's default is `pipeline`
    forward_only: bool = False

    def __post_init__(self) -> None:
        if self.pipeline < 1 or not 0 <= self.rank < self.pipeline:
            raise ValueError(f"rank {self.rank} of a {self.pipeline}-stage pipeline")
        if self.chunks < 1 or self.microbatches < 1:
            raise ValueError(f"chunks={self.chunks} and microbatches={self.microbatches} must be >= 1")

    @property
    def stages(self) -> int:
        return self.pipeline * self.chunks

    def stage(self, chunk: int) -> int:
        return chunk * self.pipeline + self.rank

    @cached_property
    def warmup(self) -> int:
        if self.forward_only:
            return self.microbatches * self.chunks
        group = self.group or self.pipeline
        return warmup_count(self.pipeline, self.rank, self.chunks, self.microbatches, group)

    @cached_property
    def order(self) -> tuple[Task, ...]:
        """megatron-core's order of this rank's tasks (see the module docstring)."""
        group = self.group or self.pipeline
        table = schedule_table(self.microbatches, self.chunks, group) if self.chunks > 1 else None
        total = self.microbatches * self.chunks

        def forward(k: int) -> Task:
            m, c = table[k] if table else (k, 0)
            return Task(FORWARD, c, m)

        def backward(k: int) -> Task:
            m, c = table[k] if table else (k, 0)
            return Task(BACKWARD, self.chunks - 1 - c, m)

        if self.forward_only:
            return tuple(forward(k) for k in range(total))
        warmup = self.warmup
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(k + warmup), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        return tuple(order)

    @cached_property
    def position(self) -> dict[Task, int]:
        return {task: i for i, task in enumerate(self.order)}

    @cached_property
    def peak_inflight(self) -> int:
        """The most forwards whose backward is pending at once in the static order (activations held)."""
        held = peak = 0
        for task in self.order:
            held += 1 if task.phase == FORWARD else -1
            peak = max(peak, held)
        return peak

    # -- what a task needs and makes -------------------------------------------------------------------

    def input_of(self, task: Task) -> Optional[Message]:
        """The message ``task`` waits for from another rank (None: its inputs are local)."""
        stage = self.stage(task.chunk)
        if task.phase == FORWARD:
            return Message(ACTIVATION, stage - 1, task.microbatch) if stage > 0 else None
        return Message(GRADIENT, stage + 1, task.microbatch) if stage < self.stages - 1 else None

    def output_of(self, task: Task) -> Optional[Message]:
        """The message ``task`` sends (None: the first stage's backward, the last stage's forward)."""
        stage = self.stage(task.chunk)
        if task.phase == FORWARD:
            return None if stage == self.stages - 1 else Message(ACTIVATION, stage, task.microbatch)
        return None if stage == 0 else Message(GRADIENT, stage, task.microbatch)

    def source_rank(self, message: Message) -> int:
        """The pipeline rank that sends ``message`` (stage ``s`` lives on rank ``s mod P``)."""
        return message.stage % self.pipeline

    def destination_rank(self, message: Message) -> int:
        stage = message.stage + 1 if message.kind == ACTIVATION else message.stage - 1
        return stage % self.pipeline
