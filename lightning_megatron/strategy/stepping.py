"""How the strategy runs one step: eagerly through the pipeline schedule, or as a replay of the step's CUDA graph.

The contract: a ``StepRunner`` holds what a step needs beyond the model and lives from the first step to the
fit's teardown:

* the schedule's session, opened on the first step (the device is known then) and closed by ``close``;
* the step listeners (MegaScan, MegaScope, fault injectors) and what they follow inside megatron-core: its
  timers (``config.timers``, set only while a listener exists, so an unobserved step pays nothing) and its
  pipeline messages (``compat.megatron_p2p``);
* the step graph, when the fit replays steps (``graph``, set by the strategy's ``setup``);
* for a block (``using``), another schedule in place of the fit's: a benchmark's cases inside one fit.

``run(...)`` decides per step. A forward-only step, and a step that a listener which is not graph-safe looks
into, run eagerly (the graph is told why). Any other step of a graphed fit is the graph's: eager warm-up steps,
then the capture and replays, with the graph-safe listeners told about both. A capture that gave up (automatic
graphs, warned) did not run the step's work, so the runner clears the gradients and runs it eagerly. A graph holds
the work of the session it began with: a step under any other session (``using``, or the fit's own after one) runs
eagerly.

Why a module of its own: the strategy is Lightning's plumbing (processes, setup, collectives, checkpoints);
choosing how a step runs is a decision with state of its own that outlives each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from lightning_megatron.compat import megatron_p2p
from lightning_megatron.pipeline.registry import Schedule, ScheduleContext, ScheduleGroups, ScheduleSession
from lightning_megatron.strategy.graphs import StepGraph, StepNotRun
from lightning_megatron.strategy.listeners import ListenerEvents, StepListener, TimersDispatcher
from lightning_megatron.strategy.microbatch import context_parallel_share, infer_seq_length, split_microbatches
from lightning_megatron.strategy.parallel import ParallelLayout
from lightning_megatron.strategy.step import StepOutput, run_forward_backward

__all__ = ["StepRunner"]


class StepRunner:
    """Runs the strategy's steps with ``schedule`` (its checked ``options``), ``micro_batch_size`` samples per
    microbatch, on ``layout``; a schedule session gives up on a silent peer after ``timeout``."""

    def __init__(
        self,
        schedule: Schedule,
        options: dict[str, Any],
        micro_batch_size: int,
        layout: ParallelLayout,
        timeout: timedelta,
    ) -> None:
        self.schedule, self.options = schedule, options
        self.micro_batch_size, self.layout, self.timeout = micro_batch_size, layout, timeout
        self.session: Optional[ScheduleSession] = None
        self.graph: Optional[StepGraph] = None
        self._graphed_session: Optional[ScheduleSession] = None  # the session whose steps the graph holds
        self.listeners: list[StepListener] = []
        self._p2p_messages: Optional[megatron_p2p.P2PMessages] = None  # while a listener of the user's exists

    # -- listeners ----------------------------------------------------------------------------------
    def add_listener(self, listener: StepListener, chunks: Sequence[torch.nn.Module]) -> None:
        if listener not in self.listeners:
            self.listeners.append(listener)
            self.follow(chunks)

    def remove_listener(self, listener: StepListener, chunks: Sequence[torch.nn.Module]) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)
            self.follow(chunks)

    def follow(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Point megatron-core's timers and p2p messages of ``chunks`` at the listeners (or at nothing)."""
        self._p2p_messages = megatron_p2p.follow(self.listeners, self._p2p_messages)
        for config in _configs(chunks):
            config.timers = TimersDispatcher(self.listeners) if self.listeners else None

    # -- another schedule for a block ---------------------------------------------------------------
    @contextmanager
    def using(self, schedule: Schedule, options: Any, device: torch.device) -> Iterator[ScheduleSession]:
        """Steps inside the block run under ``schedule`` with its parsed ``options`` (a session opened here and
        closed at the end); then the fit's own schedule and session again."""
        session = schedule.open(self._context(options, device))
        saved = self.schedule, self.options, self.session
        self.schedule, self.options, self.session = schedule, options, session
        try:
            yield session
        finally:
            self.schedule, self.options, self.session = saved
            session.close()

    def _context(self, options: Any, device: torch.device) -> ScheduleContext:
        """What a schedule session is handed: its options, device and timeout, megatron-core's process groups of
        this rank, and the step's listeners (also those registered later)."""
        groups = ScheduleGroups(
            pipeline=parallel_state.get_pipeline_model_parallel_group(),
            tensor=parallel_state.get_tensor_model_parallel_group(),
            data=parallel_state.get_data_parallel_group(),
            context_parallel_size=parallel_state.get_context_parallel_world_size(),
        )
        return ScheduleContext(
            options=options,
            device=device,
            timeout=self.timeout.total_seconds(),
            groups=groups,
            events=ListenerEvents(self.listeners),
        )

    # -- one step -----------------------------------------------------------------------------------
    def run(
        self,
        module: Any,
        chunks: Sequence[torch.nn.Module],
        batch: Any,
        device: torch.device,
        *,
        forward_only: bool,
        clear_grads: Callable[[], None],
    ) -> StepOutput:
        """``batch`` (one global batch's share of this data-parallel rank) through ``chunks``: the exact global
        loss, and with ``forward_only=False`` the step's gradients (``clear_grads`` first drops the last ones)."""
        microbatches = split_microbatches(batch, self.micro_batch_size)
        self.schedule.validate_microbatches(
            len(microbatches), pipeline=self.layout.pipeline, virtual=self.layout.virtual_pipeline
        )
        seq_of = getattr(module, "microbatch_seq_length", infer_seq_length)
        if not forward_only:
            clear_grads()
        if self.session is None:
            self.session = self.schedule.open(self._context(self.options, device))
        session, watching = self.session, tuple(self.listeners)

        # The schedule's activation shapes take the whole sequence (megatron-core divides it by the context size).
        seq_length = seq_of(microbatches[0])
        if self.layout.context > 1:
            self.layout.check_seq_length(seq_length)
            cp_rank = parallel_state.get_context_parallel_rank()
            microbatches = [context_parallel_share(m, seq_length, self.layout.context, cp_rank) for m in microbatches]

        def step(microbatches: list[Any]) -> StepOutput:
            return run_forward_backward(
                schedule=session,
                chunks=chunks,
                forward_step=module.forward_step,
                microbatches=microbatches,
                seq_length=seq_length,
                micro_batch_size=self.micro_batch_size,
                forward_only=forward_only,
                device=device,
                listeners=watching,
            )

        graph = None if forward_only else self.graph
        if graph is not None and self._graphed_session not in (None, session):
            graph = None  # another session (``using``, a benchmark's cases): the graph holds the first one's work
        if graph is not None and not all(getattr(listener, "graph_safe", False) for listener in watching):
            graph.note_eager_step(
                "a step listener that is not graph-safe (MegaScope, a fault injector, MegaScan's traced steps at "
                "TP/DP) looks into this step"
            )
        elif graph is not None:  # e.g. MegaScan in a one-process fit: its events are graph nodes, it traces replays
            self._graphed_session = session
            try:
                return graph(step, microbatches, watching, key=tuple(map(id, watching)))
            except StepNotRun:  # automatic graphs gave up during the capture (warned): run this step eagerly
                clear_grads()
        return step(microbatches)

    def close(self) -> None:
        """End the fit's steps: the graph's memory pool (its counters stay for a look after the fit), the
        schedule session, and the p2p message follower."""
        if self.graph is not None:
            self.graph.close()
        if self.session is not None:
            self.session.close()
            self.session = None
        self._graphed_session = None
        self._p2p_messages = megatron_p2p.follow(self.listeners, self._p2p_messages, active=False)


def _configs(chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """The distinct megatron-core model configs of ``chunks`` (virtual stages share one)."""
    return list({id(get_model_config(c)): get_model_config(c) for c in chunks}.values())
