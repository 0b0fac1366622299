"""MegaDPP's executor: one step of forwards and backwards in whatever order the policy picks, over a transport.

A :class:`DppSession` lives for one fit (the strategy opens it on the first step and closes it at teardown): it
owns a tagged transport connected to this rank's pipeline neighbours (and, with tensor parallelism, to its TP
peers) and the policy, whose learned timings carry over from step to step. Each call runs one step:

* tasks are ``(phase, chunk, microbatch)`` (:mod:`~lightning_megatron.pipeline.dpp.plan`); a forward runs
  megatron-core's ``forward_step`` on the microbatch it names (the strategy's microbatches are seekable), a
  backward its ``backward_step``; a stage's output is deallocated right after its send (the transport holds
  its own reference), as megatron-core does;
* messages are matched by tags derived from what they carry, so they may arrive and be taken in any order;
  the rank takes what has arrived, asks the policy (:mod:`~lightning_megatron.pipeline.dpp.policy`), and
  waits on *any* awaited message only when nothing can run;
* with TP > 1 the TP rank 0 decides and tells its TP peers through the transport (one small message per
  task, no collective per decision); they run the same task on their shard;
* gradient sync: every chunk's reduction starts as soon as its last backward is done, in a fixed chunk order
  (last chunk first) so that every data-parallel rank issues the same collectives in the same order; then
  ``finalize_model_grads`` with the step's token count, as megatron-core's schedules do;
* GPUs: the host queues at most ``max_ahead`` tasks ahead of its GPU (CUDA events), so a decision is made on
  fresh readiness, and the events time each task for the adaptive policy;
* ``split_weight_grads`` (and the ``"zb-h1"`` schedule): a backward computes only input gradients (B, sent at
  once) and leaves the weight gradients (W, :mod:`~lightning_megatron.layers.wgrad`) for later: W tasks
  run, oldest first, whenever the device would otherwise idle waiting for a message (on GPUs: the rank waits
  and its GPU has drained its queue), when a forward needs the memory, or when more than
  ``max_deferred_weight_grads`` are pending; a chunk's gradient sync starts after its last W.

  **The memory rule of W.** What a pending W keeps (each linear layer's input and output gradient) is about as
  large as a microbatch's activations (32 of the 34 bytes per token, hidden unit and layer that a transformer
  layer saves in 16 bits), so a pending W counts as one held activation. Before a forward, Ws run until the
  activations held plus the Ws pending leave room for it under this rank's peak in megatron-core's order (plus
  ``extra_activations``): no rank holds more than 1F1B would. Counts are not bytes, and ranks differ in what
  else they hold (the last rank holds the logits), so by default (``weight_grad_memory``, a number) a byte
  budget lets a rank keep Ws beyond that count while their bytes fit what the most loaded rank's peak, measured
  in the first step and times that number, leaves it; the oldest W then runs layer by layer until the rest fit.
  Later ranks so defer part of their Ws and their input gradients reach the ranks before them sooner (speed and
  peak memory against 1F1B: docs/evaluation/schedules.md). ``"first-rank"`` counts against the first rank's
  peak on every rank, as ZB-H1 (Qi et al.) bounds it: a little faster, but the last rank, which also holds the
  logits, then goes well above the job's 1F1B peak.

Waits are bounded by the strategy's timeout (:class:`~lightning_megatron.transport.TransportTimeout` names what
was awaited); a dead peer raises :class:`~lightning_megatron.transport.PeerLost` naming it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)
from megatron.core.utils import get_model_config, get_model_type

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.wgrad import SplitLinears, split_linears
from lightning_megatron.layers.wgrad_accumulate import WeightGrad, collecting
from lightning_megatron.pipeline.dpp.options import DppOptions
from lightning_megatron.pipeline.dpp.plan import (
    ACTIVATION,
    BACKWARD,
    DECISION,
    FORWARD,
    Message,
    StagePlan,
    Task,
    message_tag,
)
from lightning_megatron.pipeline.dpp.policy import Policy, StageState, make_policy
from lightning_megatron.pipeline.gradsync import GradSync
from lightning_megatron.pipeline.registry import ScheduleContext, ScheduleGroups, StepEvents
from lightning_megatron.pipeline.tracing import traced_p2p
from lightning_megatron.transport import Transport, TransportTimeout

__all__ = ["DppSession"]

_GPU_POLL_S = 2e-4
"""With weight gradients pending and the GPU still busy: how long to wait for an input before looking again."""


class DppSession:
    """The ``"dpp"`` schedule for one fit; called like megatron-core's ``forward_backward_func``."""

    def __init__(self, context: ScheduleContext) -> None:
        self.options: DppOptions = context.options
        self.device = torch.device(context.device)
        self.timeout = float(context.timeout)
        self.groups: ScheduleGroups = context.groups
        self.events: StepEvents = context.events
        self._context = context
        self.policy: Policy = make_policy(self.options.policy, grace_fraction=self.options.grace_fraction)
        self.transport: Optional[Transport] = None
        self._split: Optional[SplitLinears] = None
        self.steps = 0
        """Steps run so far (the next step's index, part of every message tag)."""
        self.stage_ranks: list[int] = []
        """Global ranks of the pipeline stages, stage 0 first (known once connected)."""
        self.tp_ranks: list[int] = []
        """Global ranks of the tensor-parallel peers, the deciding one first; empty without tensor parallelism."""
        self.last_order: list[Task] = []
        """The tasks of the last step in the order this rank ran them (tests, tracing)."""
        self.last_sequence: list[str] = []
        """The last step as run: tasks and weight gradients (``F0.3``, ``B0.3``, ``W0.3``), in order (tests)."""
        self.last_peak = 0
        """Most activations held at once in the last step."""
        self.last_peak_held = 0
        """Most activations held plus weight gradients pending at once in the last step (the memory rule's)."""
        self.last_weight_grad_bytes = 0
        """The most bytes one microbatch's pending weight gradients kept in the last step."""
        self.weight_grad_bytes = 0
        """A byte budget's allowance: bytes of pending weight gradients this rank may keep beyond the count of
        ``"own-rank"`` (measured after the first training step; 0 until then, and without a budget)."""
        self._budget_measured = False

    # -- lifetime -------------------------------------------------------------------------------------

    def _connect(self) -> Transport:
        if self.transport is not None:
            return self.transport
        self.stage_ranks = self.groups.pipeline_ranks
        self.tp_ranks = self.groups.tensor_ranks if self.groups.tensor_size > 1 else []
        rank = dist.get_rank()
        pp_rank = self.groups.pipeline_rank
        size = len(self.stage_ranks)
        peers = {self.stage_ranks[(pp_rank - 1) % size], self.stage_ranks[(pp_rank + 1) % size]}
        if self.tp_ranks:
            leader = self.tp_ranks[0]
            peers |= set(self.tp_ranks) if rank == leader else {leader}
        peers.discard(rank)
        kwargs: dict[str, Any] = dict(self.options.transport_options)
        if self.options.link_delay is not None:
            kwargs["link_delay"] = self.options.link_delay
        transport = self._context.open_transport(self.options.transport, kwargs, peers)
        self.transport = transport
        return transport

    def close(self) -> None:
        if self._split is not None:
            self._split.restore()
            self._split = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # -- one step -------------------------------------------------------------------------------------

    def __call__(
        self,
        *,
        forward_step_func: Any,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: Optional[int] = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        **unused: Any,
    ) -> list:
        model = model if isinstance(model, list) else [model]
        data_iterator = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if not all(hasattr(it, "seek") for it in data_iterator):
            raise MegatronConfigError(
                "schedule='dpp' runs microbatches out of order and needs seekable data iterators "
                "(lightning_megatron.strategy.step.Microbatches); run it through MegatronAppStrategy."
            )
        transport = self._connect()
        if self.options.split_weight_grads and self._split is None:
            self._split = split_linears(model)
        step = _Step(self, transport, model, data_iterator, forward_step_func, num_microbatches, forward_only)
        step.first_val_step = first_val_step
        step.collect_non_loss_data = collect_non_loss_data
        records = step.run()
        self.last_order, self.last_sequence = step.order, step.sequence
        self.last_peak, self.last_peak_held = step.state.peak, step.peak_held
        self.last_weight_grad_bytes = step.largest_stash_bytes
        self.steps += 1
        if step.split and not self._budget_measured and not isinstance(self.options.weight_grad_memory, str):
            self._measure_budget(float(self.options.weight_grad_memory))
        return records

    def _measure_budget(self, factor: float) -> None:
        """The byte budget (``weight_grad_memory`` a number): after a step run under ``"own-rank"``'s count, each
        rank may keep ``factor`` times the most loaded pipeline rank's peak minus its own peak in pending weight
        gradients beyond that count. CPUs keep no allocator statistics: the allowance stays 0 (``"own-rank"``)."""
        self._budget_measured = True
        if self.device.type != "cuda":
            return
        own = torch.cuda.max_memory_allocated(self.device)
        peak = torch.tensor([float(own)], dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.groups.pipeline)
        self.weight_grad_bytes = max(0, int(factor * peak.item()) - own)


class _Step:
    """One step's bookkeeping (tensors in flight, gradient sync, timing); :meth:`run` is the loop."""

    def __init__(
        self,
        session: DppSession,
        transport: Transport,
        model: list[torch.nn.Module],
        data_iterator: list[Any],
        forward_step_func: Any,
        num_microbatches: int,
        forward_only: bool,
    ) -> None:
        self.session, self.transport, self.model = session, transport, model
        self.data_iterator, self.forward_step_func = data_iterator, forward_step_func
        self.config = get_model_config(model[0])
        if self.config.defer_embedding_wgrad_compute:
            raise MegatronConfigError("schedule='dpp' does not support defer_embedding_wgrad_compute; turn it off.")
        self.model_type = get_model_type(model[0])
        self.forward_only = forward_only
        self.num_microbatches = num_microbatches
        pipeline = session.groups.pipeline_size
        self.plan = StagePlan(
            pipeline,
            session.groups.pipeline_rank,
            len(model),
            num_microbatches,
            group=self.config.microbatch_group_size_per_vp_stage or pipeline,
            forward_only=forward_only,
        )
        self.state = StageState(self.plan, 0 if forward_only else session.options.extra_activations)
        self.step = session.steps
        self.rank = dist.get_rank()
        self.stage_ranks = session.stage_ranks
        tp = self.tp_ranks = session.tp_ranks
        self.leader = not tp or self.rank == tp[0]
        self.followers = [r for r in tp if r != self.rank] if self.leader else []
        self.decisions = 0
        self.first_val_step: Optional[bool] = None
        self.collect_non_loss_data = False
        self.cp_size = session.groups.context_parallel_size
        self.device = session.device
        self.received: dict[Message, torch.Tensor] = {}
        self.inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.records: dict[int, Any] = {}
        self.tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.grad_sync = GradSync(self.config, model, num_microbatches, forward_only)
        self.order: list[Task] = []
        self.on_gpu = self.device.type == "cuda"
        self.in_flight: deque[tuple[Task, Any, Any]] = deque()
        self.events = session.events
        self.split = session.options.split_weight_grads and not forward_only
        self.pending_w: deque[tuple[Task, list[WeightGrad]]] = deque()
        self.last_event: Optional[Any] = None  # GPUs: the end of the last task queued (W included)
        limit = session.options.max_deferred_weight_grads
        self.w_limit = self.plan.microbatches * self.plan.chunks if limit is None else limit
        bound = (
            dataclasses.replace(self.plan, rank=0) if session.options.weight_grad_memory == "first-rank" else self.plan
        )
        self.memory_cap = bound.peak_inflight + (0 if forward_only else session.options.extra_activations)
        """Activations held + weight gradients pending before a forward, at most (the memory rule)."""
        self.peak_held = 0
        """The most activations + pending weight gradients this rank held at once in the step."""
        self.largest_stash_bytes = 0
        """The most bytes one microbatch's pending weight gradients kept in the step."""
        self.sequence: list[str] = []

    # -- the loop -------------------------------------------------------------------------------------

    def run(self) -> list:
        self.transport.begin_step(self.step)
        self.grad_sync.disable()
        try:
            while not self.state.finished:
                task = self._decide()
                if task is not None:
                    self._execute(task)
            while self.pending_w:
                self._run_weight_grads()
            self.grad_sync.finish()
        finally:
            self.grad_sync.enable()
        while self.in_flight:
            self._retire()
        self.transport.wait_sends(self.step, timeout=self.session.timeout)
        if not self.forward_only and self.config.finalize_model_grads_func is not None:
            tokens = self.tokens if self.config.calculate_per_token_loss else None
            self.config.finalize_model_grads_func(self.model, tokens, force_all_reduce=False)
        return [self.records[m] for m in sorted(self.records)]

    def _decide(self) -> Optional[Task]:
        """The next task, after taking whatever has arrived; None after waiting (decide again)."""
        if not self.leader:
            task = self._told()
            self._need_input(task)
            return task
        self._drain()
        decision = self.session.policy.choose(self.state, time.monotonic(), self._idle_at())
        if decision.task is None:
            if self.pending_w and not self._gpu_busy():  # the device would idle: fill it with a weight gradient
                self._run_weight_grads()
            elif self.pending_w:  # the device still has queued work: the input may yet come in time
                self._wait(time.monotonic() + _GPU_POLL_S)
            else:
                self._wait(decision.wait_until)
            return None
        for follower in self.followers:
            code = torch.tensor([decision.task.phase == BACKWARD, decision.task.chunk, decision.task.microbatch])
            tag = message_tag(Message(DECISION, 0, self.decisions), self.step)
            self.transport.isend(follower, tag, code)
        self.decisions += 1
        return decision.task

    def _idle_at(self) -> Optional[float]:
        """GPUs: when the queued tasks will be done, from the learned task times (None: nothing queued)."""
        if not self.in_flight:
            return None
        policy = self.session.policy
        queued = 0.0
        for task, _start, end in self.in_flight:
            if not end.query():
                queued += policy.expected_seconds(task) or 0.0
        return time.monotonic() + queued

    def _told(self) -> Task:
        leader = self.tp_ranks[0]
        tag = message_tag(Message(DECISION, 0, self.decisions), self.step)
        code = None
        while self.pending_w and code is None:  # while the leader has not decided, fill with weight gradients
            code = self.transport.poll(leader, tag)
            if code is None and not self._gpu_busy():
                self._run_weight_grads()
            elif code is None:
                time.sleep(_GPU_POLL_S)
        if code is None:
            code = self.transport.recv(leader, tag, timeout=self.session.timeout)
        code = code.tolist()
        self.decisions += 1
        return Task(BACKWARD if code[0] else FORWARD, int(code[1]), int(code[2]))

    def _keys(self, messages: Sequence[Message]) -> list[tuple[int, int]]:
        return [(self.stage_ranks[self.plan.source_rank(m)], message_tag(m, self.step)) for m in messages]

    def _drain(self) -> None:
        awaited = self.state.awaited()
        if not awaited:
            return
        keys = self._keys(awaited)
        while True:
            hit = self.transport.poll_any(keys)
            if hit is None:
                return
            index, tensor = hit
            self._arrived(awaited[index], tensor)
            del awaited[index], keys[index]
            if not keys:
                return

    def _wait(self, until: Optional[float]) -> None:
        awaited = self.state.awaited()
        now = time.monotonic()
        if not awaited:
            if until is not None:
                time.sleep(max(until - now, 0.0))
                return
            raise RuntimeError(f"dpp on rank {self.rank}: nothing can run and nothing is awaited (a bug).")
        timeout = self.session.timeout if until is None else max(min(until - now, self.session.timeout), 0.0)
        try:
            index, tensor = self.transport.wait_any(self._keys(awaited), timeout=timeout)
        except TransportTimeout as err:
            if until is not None and time.monotonic() < now + self.session.timeout:
                return  # the adaptive policy's grace ran out: decide again
            names = ", ".join(
                f"{'activation' if m.kind == ACTIVATION else 'gradient'} of stage {m.stage} microbatch {m.microbatch}"
                for m in awaited[:4]
            )
            raise TransportTimeout(
                f"dpp on rank {self.rank} (pipeline rank {self.plan.rank}) waited {timeout:.0f} s for any of "
                f"{len(awaited)} messages ({names}{', ...' if len(awaited) > 4 else ''}) in step {self.step}: "
                "a peer is stuck or slower than the strategy's `timeout`."
            ) from err
        self._arrived(awaited[index], tensor)

    def _need_input(self, task: Task) -> None:
        message = self.plan.input_of(task)
        if message is None or message in self.received:
            return
        ((peer, tag),) = self._keys([message])
        self._arrived(message, self.transport.recv(peer, tag, timeout=self.session.timeout))

    def _arrived(self, message: Message, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            tensor = tensor.to(self.device, non_blocking=True)
        if message.kind == ACTIVATION and not self.forward_only:
            tensor.requires_grad_()
        self.received[message] = tensor
        self.state.arrive(message)
        self._traced("recv", message, lambda: tensor)

    # -- running tasks --------------------------------------------------------------------------------

    def _execute(self, task: Task) -> None:
        start = torch.cuda.Event(enable_timing=True) if self.on_gpu else time.perf_counter()
        if self.on_gpu:
            start.record()
        if task.phase == FORWARD:
            self._make_room()
            self._forward(task)
        else:
            self._backward(task)
        self.state.complete(task)
        self.sequence.append(str(task))
        self.peak_held = max(self.peak_held, self.state.inflight + len(self.pending_w))
        self.order.append(task)
        if self.on_gpu:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.in_flight.append((task, start, end))
            self.last_event = end
            while len(self.in_flight) > self.session.options.max_ahead:
                self._retire()
        else:
            self.session.policy.observe(task, time.perf_counter() - start)

    def _retire(self) -> None:
        task, start, end = self.in_flight.popleft()
        end.synchronize()
        self.session.policy.observe(task, start.elapsed_time(end) / 1e3)

    def _forward(self, task: Task) -> None:
        chunk, microbatch = task.chunk, task.microbatch
        message = self.plan.input_of(task)
        input_tensor = self.received.pop(message) if message is not None else None
        self.data_iterator[chunk].seek(microbatch)
        store: list = []
        is_last = self.plan.stage(chunk) == self.plan.stages - 1
        output, num_tokens = forward_step(
            self.forward_step_func,
            self.data_iterator[chunk],
            self.model[chunk],
            self.num_microbatches,
            input_tensor,
            store,
            self.config,
            cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=check_first_val_step(self.first_val_step, self.forward_only, microbatch == 0),
            current_microbatch=microbatch,
            vp_stage=chunk,
            is_last_stage=is_last,
        )
        self.tokens += num_tokens
        if store:
            self.records[microbatch] = store[0]
        out_message = self.plan.output_of(task)
        if out_message is not None:
            self._send(out_message, output)
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
        if not self.forward_only:
            self.inputs[(chunk, microbatch)] = input_tensor
            self.outputs[(chunk, microbatch)] = output

    def _backward(self, task: Task) -> None:
        chunk, microbatch = task.chunk, task.microbatch
        message = self.plan.input_of(task)
        output_grad = self.received.pop(message) if message is not None else None
        if output_grad is not None:
            output_grad = output_grad.detach()
        input_tensor = self.inputs.pop((chunk, microbatch))
        output = self.outputs.pop((chunk, microbatch))
        if not self.split:
            input_grad = backward_step(input_tensor, output, output_grad, self.model_type, self.config)
        else:
            with collecting([]) as stash:
                input_grad = backward_step(input_tensor, output, output_grad, self.model_type, self.config)
            self.pending_w.append((task, stash))
            self.largest_stash_bytes = max(self.largest_stash_bytes, _stash_bytes(stash))
        out_message = self.plan.output_of(task)
        if out_message is not None:
            self._send(out_message, input_grad)
        if not self.split:
            self.grad_sync.backward_done(chunk)
        while len(self.pending_w) > self.w_limit:
            self._run_weight_grads()

    def _make_room(self) -> None:
        """The memory rule before a forward (module docstring): the oldest Ws run until the activations held and
        the Ws pending leave room for one more activation under the count, or, with a byte budget, until what the
        Ws over the count still keep fits the allowance (the oldest of them then runs layer by layer)."""
        allowance = self.session.weight_grad_bytes
        while self.pending_w:
            over = self.state.inflight + len(self.pending_w) + 1 - self.memory_cap
            if over <= 0:
                return
            if not allowance:
                self._run_weight_grads()
                continue
            kept = sum(_stash_bytes(stash) for _, stash in itertools.islice(self.pending_w, over))
            if kept <= allowance:
                return
            self._run_weight_grads(free_bytes=kept - allowance)

    def _run_weight_grads(self, free_bytes: Optional[int] = None) -> None:
        """W: the oldest deferred weight gradients (a chunk's in microbatch order, as megatron-core adds them);
        with ``free_bytes``, only its first layers, until they release that many bytes (a part: ``w`` in
        :attr:`sequence`; the layer order within a W does not change any sum)."""
        task, stash = self.pending_w[0]
        count = len(stash)
        if free_bytes is not None:
            count, freed = 0, 0
            while count < len(stash) and freed < free_bytes:
                freed += _stash_bytes(stash[count : count + 1])
                count += 1
        whole = count == len(stash)
        self.sequence.append(f"{'W' if whole else 'w'}{task.chunk}.{task.microbatch}")
        with self.events.span("weight-grad-compute"):
            self.events.microbatch("weight-grad", task.chunk, task.microbatch)
            for weight_grad in stash[:count]:
                weight_grad.run()
        del stash[:count]  # what ran releases its tensors
        if self.on_gpu:
            self.last_event = torch.cuda.Event()
            self.last_event.record()
        if whole:
            self.pending_w.popleft()
            self.grad_sync.backward_done(task.chunk)

    def _gpu_busy(self) -> bool:
        """Whether the GPU still has queued work (a wait on the host is then no bubble on the device yet)."""
        if not self.on_gpu:
            return False
        last = self.last_event if self.last_event is not None else (self.in_flight[-1][2] if self.in_flight else None)
        return last is not None and not last.query()

    def _send(self, message: Message, tensor: torch.Tensor) -> None:
        peer = self.stage_ranks[self.plan.destination_rank(message)]
        payload = tensor.detach()
        if payload.device.type not in self.transport.devices:
            payload = payload.to("cpu")
        tag = message_tag(message, self.step)
        self._traced("send", message, lambda: (self.transport.isend(peer, tag, payload), payload)[1])

    # -- tracing ------------------------------------------------------------------------------------

    def _traced(self, way: str, message: Message, action: Any) -> None:
        """``action`` reported as megatron-core's p2p span of the message (its tag is the ``seq`` both ends share,
        so flows pair up whatever the order)."""
        peer_rank = self.plan.destination_rank(message) if way == "send" else self.plan.source_rank(message)
        traced_p2p(
            self.events,
            way,
            "forward" if message.kind == ACTIVATION else "backward",
            action,
            peer=self.stage_ranks[peer_rank],
            seq=message_tag(message, self.step),
            microbatch=message.microbatch,
            stage=message.stage,
        )


def _stash_bytes(stash: Sequence[WeightGrad]) -> int:
    """What weight gradients keep alive: each layer's output gradient and (gathered) input."""
    return sum(t.numel() * t.element_size() for w in stash for t in (w.grad_output, w.total_input))
