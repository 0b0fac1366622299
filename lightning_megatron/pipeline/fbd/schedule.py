"""MegaFBD's rank split: forward replicas run forwards, backward replicas run backwards, over a tagged transport.

A :class:`FbdSession` lives for one fit. Each training step (see :mod:`~lightning_megatron.pipeline.fbd.roles`
for who is who):

* every backward rank sends each microbatch of its step (the tensors of it) to that microbatch's feeder, the
  forward rank at the same stage and tensor rank of the forward replica that runs it (``Roles.feeder``), which
  runs them: stage after stage along the forward replica's pipeline, one partner's microbatch after another's;
* ``recompute`` mode: the forward runs without autograd; forward stage ``s``'s output (the input of stage
  ``s + 1``) goes to backward stage ``s + 1``, with the RNG state it ran under when the model has dropout, so
  the recompute draws the forward's masks (the last stage's forward is skipped, as nobody needs its output,
  unless the model has dropout). A backward stage recomputes each microbatch from that input (stage 0 from its
  own data) and runs its backward as soon as the next stage's gradient arrives: one activation in flight, and
  only gradients travel between backward stages;
* ``ship`` mode: the forward runs with autograd and :class:`~lightning_megatron.pipeline.fbd.replay.Capture`
  records what its backward needs; the bundle goes to the backward rank at the same stage, which rebuilds the
  graph around it without the GEMMs (:func:`~lightning_megatron.pipeline.fbd.replay.replaying`) and runs the
  backward. The last stage's loss record (loss and token count) travels with the bundle. A forward rank stays at most
  ``prefetch`` microbatches ahead of each partner (the partner acknowledges each bundle it starts);
* the loss and token counts of the step are the backward replicas' (forward replicas report none), the gradient
  reduction follows megatron-core's protocol on every replica (:class:`~lightning_megatron.pipeline.gradsync.GradSync`;
  forward replicas add zeros), so the optimizer step leaves every replica with the same weights.

Validation steps (``forward_only``) run megatron-core's own schedule on the backward replicas (the forward
replicas read no data and report nothing). The second and third training steps are measured (device events
around every piece of work; the link was calibrated when the session opened) and composed into the performance
model of :mod:`~lightning_megatron.pipeline.fbd.perfmodel`, printed on rank 0 and kept as ``session.prediction``.
Waits are bounded by the strategy's timeout; a dead peer raises :class:`~lightning_megatron.transport.PeerLost`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import backward_step, deallocate_output_tensor, forward_step
from megatron.core.utils import get_model_config, get_model_type
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.fbd.options import FbdOptions
from lightning_megatron.pipeline.fbd.perfmodel import Parts, describe, predict
from lightning_megatron.pipeline.fbd.replay import Bundle, Capture, replaying
from lightning_megatron.pipeline.fbd.roles import Roles
from lightning_megatron.pipeline.fbd.wiring import (
    ACTIVATION,
    CREDIT,
    DATA,
    GRADIENT,
    HEADER,
    ITEM,
    LOSS,
    RNG,
    SHAPE,
    STAGE_INPUT,
    calibrate,
    dropout_of,
    forward_stages,
    message_tag,
    peers,
)
from lightning_megatron.pipeline.gradsync import GradSync
from lightning_megatron.pipeline.registry import ScheduleContext, ScheduleGroups, StepEvents
from lightning_megatron.pipeline.tracing import traced_p2p
from lightning_megatron.transport import Transport

__all__ = ["FbdSession"]

_MEASURED_STEPS = (1, 2)
"""The steps whose parts feed the performance model (the first one warms allocators and links up)."""
_TRACED = {STAGE_INPUT: "forward", ACTIVATION: "forward", DATA: "forward", GRADIENT: "backward"}
"""The messages traced for MegaScan (the rest are small: microbatch tensors, RNG states, headers, credits)."""


class _Clock:
    """Seconds of device work between marks (CUDA events on GPUs, read once at the end; wall time on CPUs), and
    the host's seconds for the same spans: where the two agree on a GPU, the work is host-bound."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self.spans: dict[str, list[Any]] = {}
        self.syncs: list[float] = []

    def mark(self) -> Any:
        if not self.enabled:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, time.perf_counter()
        return None, time.perf_counter()

    def add(self, name: str, start: Any, end: Any) -> None:
        if self.enabled:
            self.spans.setdefault(name, []).append((start, end))

    def mean(self, name: str) -> float:
        spans = self.spans.get(name, [])
        if not spans:
            return 0.0
        if self.cuda:
            spans[-1][1][0].synchronize()
            return sum(s[0].elapsed_time(e[0]) for s, e in spans) / 1e3 / len(spans)
        return self.mean_host(name)

    def mean_host(self, name: str) -> float:
        spans = self.spans.get(name, [])
        return sum(e[1] - s[1] for s, e in spans) / len(spans) if spans else 0.0


class FbdSession:
    """The ``"fbd"`` schedule for one fit; called like megatron-core's ``forward_backward_func``."""

    def __init__(self, context: ScheduleContext) -> None:
        self.options: FbdOptions = context.options
        self.device = torch.device(context.device)
        self.timeout = float(context.timeout)
        self.groups: ScheduleGroups = context.groups
        self.events: StepEvents = context.events
        self._context = context
        self.transport: Optional[Transport] = None
        self.roles: Optional[Roles] = None
        self.link = (0.0, float("inf"))
        """(latency s, bytes/s) between partners, calibrated when the session opens."""
        self.prediction: Optional[float] = None
        """The performance model's step seconds (after the third step), on every rank."""
        self.parts: Optional[Parts] = None
        self.clock: Optional[_Clock] = None
        """The device-time clock over the measured steps (one for all of them)."""
        self.forward_stages = 0
        """How many pipeline stages' forwards the forward replicas run (see :func:`forward_stages`)."""
        self.steps = 0
        """Steps run so far (the next training step's index, part of every message tag)."""

    # -- lifetime -------------------------------------------------------------------------------------

    def _connect(self, config: Any) -> tuple[Roles, Transport]:
        if self.roles is not None and self.transport is not None:
            return self.roles, self.transport
        roles = Roles.discover(self.options.forward_replicas, self.device, self.groups)
        self.forward_stages = forward_stages(self.options.mode, roles.stages, dropout_of(config))
        partners = peers(roles, self.options.mode, self.forward_stages)
        transport = self._context.open_transport(self.options.transport, self.options.transport_options, partners)
        try:
            self.link = calibrate(roles, self.forward_stages, transport, self.timeout)
        except BaseException:
            transport.close()
            raise
        self.roles, self.transport = roles, transport
        return roles, transport

    def close(self) -> None:
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
        forward_only: bool = False,
        **kwargs: Any,
    ) -> list:
        model = model if isinstance(model, list) else [model]
        data_iterator = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        if len(model) != 1:
            raise MegatronConfigError("schedule='fbd' runs one model chunk per rank; unset the virtual pipeline size.")
        if not hasattr(data_iterator[0], "items"):
            raise MegatronConfigError(
                "schedule='fbd' ships microbatches between ranks and needs the strategy's microbatches "
                "(lightning_megatron.strategy.step.Microbatches); run it through MegatronAppStrategy."
            )
        roles, transport = self._connect(get_model_config(model[0]))
        if forward_only:
            if roles.is_forward:
                return []
            return get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator[0],
                model=model,
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=True,
                **kwargs,
            )
        step = _Step(self, roles, transport, model[0], data_iterator[0], forward_step_func, num_microbatches)
        records = step.run_forward() if roles.is_forward else step.run_backward()
        if self.steps == _MEASURED_STEPS[-1]:
            self._model(step)
        self.steps += 1
        return records

    def _model(self, step: _Step) -> None:
        """Gather every rank's measured parts, compose the prediction, print it on rank 0."""
        roles, clock = step.roles, step.clock
        mine = torch.tensor(
            [
                float(roles.is_forward),
                float(roles.stage),
                clock.mean("forward"),
                clock.mean("recompute"),
                clock.mean("backward"),
                step.bytes.get(STAGE_INPUT, 0.0),
                step.bytes.get(DATA, 0.0),
                step.bytes.get(GRADIENT, 0.0),
                sum(clock.syncs) / max(len(clock.syncs), 1),
                self.link[0],
                self.link[1] if self.link[1] != float("inf") else 0.0,
                clock.mean_host("recompute"),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        rows = [t.tolist() for t in every]

        def per_stage(forward: bool, column: int) -> list[float]:
            values = []
            for s in range(roles.stages):
                picked = [r[column] for r in rows if bool(r[0]) == forward and int(r[1]) == s]
                values.append(sum(picked) / max(len(picked), 1))
            return values

        sync = [r[8] for r in rows if not r[0]]
        links = [(r[9], r[10]) for r in rows if not r[0] and r[10] > 0]
        self.parts = Parts(
            mode=self.options.mode,
            microbatches=step.num_microbatches,
            backward_replicas=roles.backward_replicas,
            forward_replicas=roles.forward_replicas,
            prefetch=self.options.prefetch,
            forward_s=per_stage(True, 2),
            recompute_s=per_stage(False, 3),
            backward_s=per_stage(False, 4),
            input_bytes=per_stage(True, 5),
            bundle_bytes=per_stage(True, 6),
            grad_bytes=per_stage(False, 7),
            latency_s=max((lat for lat, _ in links), default=0.0),
            bandwidth=min((bw for _, bw in links), default=float("inf")),
            sync_s=max(sync) if sync else 0.0,
            forward_stages=self.forward_stages,
            recompute_host_s=per_stage(False, 11),
        )
        self.prediction = predict(self.parts)
        if self.options.report and dist.get_rank() == 0:
            print(describe(self.parts, self.prediction), flush=True)


class _Step:
    """One training step on one rank: :meth:`run_forward` on a forward replica, :meth:`run_backward` otherwise."""

    def __init__(
        self,
        session: FbdSession,
        roles: Roles,
        transport: Transport,
        model: torch.nn.Module,
        microbatches: Any,
        forward_step_func: Any,
        num_microbatches: int,
    ) -> None:
        self.session, self.roles, self.transport, self.model = session, roles, transport, model
        self.microbatches, self.forward_step_func = microbatches, forward_step_func
        self.num_microbatches = num_microbatches
        self.config = get_model_config(model)
        self.model_type = get_model_type(model)
        self.step = session.steps
        self.ship = session.options.mode == "ship"
        self.device = session.device
        self.timeout = session.timeout
        self.events = session.events
        if session.clock is None or session.steps in (_MEASURED_STEPS[0], _MEASURED_STEPS[-1] + 1):
            session.clock = _Clock(self.device, session.steps in _MEASURED_STEPS)
        self.clock = session.clock  # one clock over the measured steps
        self.bytes: dict[int, float] = {}
        self.sync_s = 0.0
        self.dropout = dropout_of(self.config)
        self.last = roles.stage == roles.stages - 1
        self.runs_forward = roles.stage < session.forward_stages
        """Whether the forward replicas run this rank's stage (else this stage's data and RNG travel nowhere)."""

    # -- messages -------------------------------------------------------------------------------------

    def _send(
        self, replica: int, stage: int, kind: int, backward_replica: int, m: int, tensor: torch.Tensor, part: int = 0
    ) -> None:
        payload = tensor.detach()
        if payload.device.type not in self.transport.devices:
            payload = payload.to("cpu")
        if m == 0 and part == 0:
            self.bytes[kind] = float(payload.numel() * payload.element_size())
        peer, tag = self.roles.rank(replica, stage), message_tag(self.step, kind, backward_replica, m, part)
        self._traced("send", kind, peer, tag, m, lambda: (self.transport.isend(peer, tag, payload), payload)[1])

    def _recv(self, replica: int, stage: int, kind: int, backward_replica: int, m: int, part: int = 0) -> torch.Tensor:
        peer, tag = self.roles.rank(replica, stage), message_tag(self.step, kind, backward_replica, m, part)
        tensor = self._traced("recv", kind, peer, tag, m, lambda: self.transport.recv(peer, tag, timeout=self.timeout))
        return tensor.to(self.device) if tensor.device != self.device else tensor

    def _traced(self, way: str, kind: int, peer: int, tag: int, m: int, action: Any) -> torch.Tensor:
        """``action()`` reported as megatron-core's p2p span (``forward-send``, ...) for the messages MegaScan draws as
        flows (stage inputs, bundles, gradients), with the tag as the ``seq`` both ends share."""
        direction = _TRACED.get(kind)
        if direction is None:
            return action()
        return traced_p2p(self.events, way, direction, action, peer=peer, seq=tag, microbatch=m, stage=self.roles.stage)

    def _forward(self, microbatches: Any, m: int, input_tensor: Optional[torch.Tensor], store: list) -> tuple:
        microbatches.seek(m)
        return forward_step(
            self.forward_step_func,
            microbatches,
            self.model,
            self.num_microbatches,
            input_tensor,
            store,
            self.config,
            cp_group_size=1,
            is_first_microbatch=m == 0,
            current_microbatch=m,
            is_last_stage=self.last,
        )

    def _finish(self, grad_sync: GradSync, tokens: torch.Tensor) -> None:
        """Gradient reduction with megatron-core's protocol (the same collectives on both roles), timed."""
        start = time.perf_counter()
        if self.clock.enabled and self.clock.cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
        grad_sync.finish()
        grad_sync.enable()
        self.transport.wait_sends(self.step, timeout=self.timeout)
        if self.config.finalize_model_grads_func is not None:
            per_token = tokens if self.config.calculate_per_token_loss else None
            self.config.finalize_model_grads_func([self.model], per_token, force_all_reduce=False)
        if self.clock.enabled and self.clock.cuda:
            torch.cuda.synchronize()
        self.sync_s = time.perf_counter() - start
        if self.clock.enabled:
            self.clock.syncs.append(self.sync_s)

    # -- forward replica ------------------------------------------------------------------------------

    def run_forward(self) -> list:
        roles, stage = self.roles, self.roles.stage
        self.transport.begin_step(self.step)
        grad_sync = GradSync(self.config, [self.model], self.num_microbatches, False)
        grad_sync.disable()
        if self.runs_forward:
            assigned = roles.assigned(self.num_microbatches)
            template = self.microbatches.items[0]
            leaves, spec = tree_flatten(template)
            slots = {b: [None] * self.num_microbatches for b in roles.partners()}
            streams = {b: type(self.microbatches)(slots[b]) for b in slots}
            ran: dict[int, list[int]] = {b: [] for b in slots}  # each partner's microbatches run here so far
            parameters = list(self.model.parameters())
            prefetch = self.session.options.prefetch
            for m, b in assigned:
                if self.ship and len(ran[b]) >= prefetch:  # at most `prefetch` of this partner's bundles ahead
                    self._recv(b, stage, CREDIT, b, ran[b][-prefetch])
                item = [
                    self._recv(b, stage, ITEM, b, m, i) if isinstance(leaf, torch.Tensor) else leaf
                    for i, leaf in enumerate(leaves)
                ]
                slots[b][m] = tree_unflatten(item, spec)
                self._forward_one(b, m, streams[b], parameters)
                ran[b].append(m)
                # Let go of what has been sent: a send keeps its tensor (a whole bundle in ship mode) until
                # someone asks whether it is done.
                self.transport.sends_done(self.step)
        self._finish(grad_sync, torch.zeros([], dtype=torch.int, device=self.device))
        return []

    def _forward_one(self, b: int, m: int, stream: Any, parameters: list[torch.Tensor]) -> None:
        roles, stage = self.roles, self.roles.stage
        input_tensor = None if stage == 0 else self._recv(roles.replica, stage - 1, ACTIVATION, b, m)
        store: list = []
        start = self.clock.mark()
        if not self.ship:
            if self.dropout > 0:
                for part, state in enumerate(_rng_states(self.device)):
                    self._send(b, stage, RNG, b, m, state, part)
            with torch.no_grad():
                output, _ = self._forward(stream, m, input_tensor, store)
        else:
            if input_tensor is not None:
                input_tensor.requires_grad_(True)
                self._send(b, stage, SHAPE, b, m, torch.tensor(list(input_tensor.shape), dtype=torch.int64))
            with Capture(parameters) as capture:
                output, _ = self._forward(stream, m, input_tensor, store)
            bundle = capture.bundle(self.device)
            if store:
                self._send(b, stage, LOSS, b, m, store[-1])
            self._send(b, stage, HEADER, b, m, bundle.header)
            self._send(b, stage, DATA, b, m, bundle.data)
        self.clock.add("forward", start, self.clock.mark())
        if stage < roles.stages - 1:
            out = output.detach()
            if stage + 1 < self.session.forward_stages:
                self._send(roles.replica, stage + 1, ACTIVATION, b, m, out)
            if not self.ship:
                self._send(b, stage + 1, STAGE_INPUT, b, m, out)

    # -- backward replica -----------------------------------------------------------------------------

    def run_backward(self) -> list:
        roles, stage, b = self.roles, self.roles.stage, self.roles.replica
        self.transport.begin_step(self.step)
        if self.runs_forward:
            for m, item in enumerate(self.microbatches.items):
                leaves, _ = tree_flatten(item)
                for i, leaf in enumerate(leaves):
                    if isinstance(leaf, torch.Tensor):
                        self._send(roles.feeder(b, m), stage, ITEM, b, m, leaf, i)
        grad_sync = GradSync(self.config, [self.model], self.num_microbatches, False)
        grad_sync.disable()
        tokens = torch.zeros([], dtype=torch.int, device=self.device)
        records: list = []
        for m in range(self.num_microbatches):
            feeder = roles.feeder(b, m)
            store: list = []
            start = self.clock.mark()
            if self.ship:
                input_tensor, bundle, record = self._receive_bundle(feeder, m)
            else:
                input_tensor = None
                if stage > 0:
                    input_tensor = self._recv(feeder, stage - 1, STAGE_INPUT, b, m).requires_grad_(True)
            received = self.clock.mark()
            self.clock.add("receive", start, received)
            if self.ship:
                with replaying(bundle), _named_recompute(self.config):
                    output, num_tokens = self._forward(self.microbatches, m, input_tensor, store)
                if record is not None:
                    records.append(record)
                self._send(feeder, stage, CREDIT, b, m, torch.zeros(1))
            else:
                with _rng_from(self, feeder, m), _named_recompute(self.config):
                    output, num_tokens = self._forward(self.microbatches, m, input_tensor, store)
                records += store
            tokens += num_tokens
            if not self.last:  # only its graph is needed now (megatron-core's backward expects it freed)
                deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
            middle = self.clock.mark()
            self.clock.add("recompute", received, middle)
            output_grad = None if self.last else self._recv(b, stage + 1, GRADIENT, b, m)
            middle = self.clock.mark()
            input_grad = backward_step(input_tensor, output, output_grad, self.model_type, self.config)
            self.clock.add("backward", middle, self.clock.mark())
            if stage > 0:
                self._send(b, stage - 1, GRADIENT, b, m, input_grad)
            grad_sync.backward_done(0)
            self.transport.sends_done(self.step)
        self._finish(grad_sync, tokens)
        return records

    def _receive_bundle(self, feeder: int, m: int) -> tuple[Optional[torch.Tensor], Bundle, Optional[torch.Tensor]]:
        """Ship mode: the stage's saved tensors for microbatch ``m``, the stand-in for its input (the replay needs
        its shape only) and, on the last stage, the loss record the forward computed."""
        stage, replica = self.roles.stage, self.roles.replica
        record = self._recv(feeder, stage, LOSS, replica, m) if self.last else None
        input_tensor = None
        if stage > 0:
            shape = self._recv(feeder, stage, SHAPE, replica, m).tolist()
            input_tensor = torch.zeros(shape, dtype=self.config.pipeline_dtype, device=self.device, requires_grad=True)
        header = self._recv(feeder, stage, HEADER, replica, m).cpu()
        return input_tensor, Bundle(header, self._recv(feeder, stage, DATA, replica, m)), record


class _RecomputeTimers:
    """megatron-core's timers, with the forward of a recompute (or replay) named ``recompute-compute``, so traces
    tell a backward replica's recompute from a forward."""

    def __init__(self, timers: Any) -> None:
        self._timers = timers

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._timers("recompute-compute" if name == "forward-compute" else name, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._timers, name)


class _named_recompute:  # noqa: N801  (a context manager used like a function)
    def __init__(self, config: Any) -> None:
        self.config, self.timers = config, config.timers

    def __enter__(self) -> None:
        if self.timers is not None:
            self.config.timers = _RecomputeTimers(self.timers)

    def __exit__(self, *exc: Any) -> None:
        self.config.timers = self.timers


# -- RNG: recompute draws the masks the forward drew ----------------------------------------------------------


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    """The default generator's state (and the device's), then megatron-core's tracker states (its tensor-parallel
    regions' dropout; CPU generator states on CPU runs), as megatron-core's activation checkpointing saves them."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state())
    tracker = get_cuda_rng_tracker().get_states()
    return states + [tracker[name] for name in sorted(tracker)]


class _rng_from:  # noqa: N801  (a context manager used like a function)
    """Recompute under the forward rank's RNG states (when the model has dropout), then restore this rank's."""

    def __init__(self, step: _Step, feeder: int, m: int) -> None:
        self.step, self.feeder, self.m = step, feeder, m
        self.saved: Optional[list[torch.Tensor]] = None

    def __enter__(self) -> None:
        step = self.step
        if step.dropout <= 0:
            return
        self.saved = _rng_states(step.device)
        received = [
            step._recv(self.feeder, step.roles.stage, RNG, step.roles.replica, self.m, part).cpu()
            for part in range(len(self.saved))
        ]
        _set_rng_states(received, step.device)

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            _set_rng_states(self.saved, self.step.device)


def _set_rng_states(states: Sequence[torch.Tensor], device: torch.device) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1])
    tracker = get_cuda_rng_tracker()
    names = sorted(tracker.get_states())
    tracker.set_states(dict(zip(names, states[2 if device.type == "cuda" else 1 :])))
