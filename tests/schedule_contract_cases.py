"""A pipeline schedule written against the public contract alone (``lightning_megatron.pipeline``), for
``test_schedule_contract.py``: GPipe's order (every forward, then every backward), over a tagged transport the
context opens, with its messages reported through the shared tracing helper.

It imports nothing of the project but the contract, megatron-core's public step functions and the transport's
public names: what a user plugging in a schedule of their own has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from megatron.core.pipeline_parallel.schedules import backward_step, deallocate_output_tensor, forward_step
from megatron.core.utils import get_model_config, get_model_type
from typing_extensions import override

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline import Schedule, ScheduleContext, register_schedule
from lightning_megatron.pipeline.tracing import traced_p2p

NAME = "test-gpipe"
_ACTIVATION, _GRADIENT = 0, 1


def _tag(step: int, kind: int, microbatch: int) -> int:
    return (step << 32) | (kind << 24) | microbatch


class GPipe(Schedule):
    name = NAME
    description = "all forwards, then all backwards (a test of the schedule contract)"
    virtual_stages = False

    @override
    def parse_options(self, raw: Mapping[str, Any]) -> str:
        unknown = sorted(set(raw) - {"transport"})
        if unknown:
            raise MegatronConfigError(f"schedule={NAME!r} takes schedule_options 'transport' only; got {unknown}.")
        return str(raw.get("transport", "auto"))

    @override
    def check_layout(self, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        if pipeline < 2:
            return "it needs pipeline_model_parallel_size >= 2"
        return super().check_layout(pipeline, virtual)

    @override
    def open(self, context: ScheduleContext) -> GPipeSession:
        return GPipeSession(context)


class GPipeSession:
    def __init__(self, context: ScheduleContext) -> None:
        groups = context.groups
        self.context, self.ranks = context, groups.pipeline_ranks
        self.stage, self.stages = groups.pipeline_rank, groups.pipeline_size
        neighbours = [self.ranks[s] for s in (self.stage - 1, self.stage + 1) if 0 <= s < self.stages]
        self.transport = context.open_transport(context.options, {}, neighbours)
        self.steps = 0

    def _send(self, stage: int, kind: int, m: int, tensor: torch.Tensor) -> None:
        peer, tag = self.ranks[stage], _tag(self.steps, kind, m)
        payload = tensor.detach()
        if payload.device.type not in self.transport.devices:
            payload = payload.cpu()
        direction = "forward" if kind == _ACTIVATION else "backward"
        traced_p2p(
            self.context.events,
            "send",
            direction,
            lambda: (self.transport.isend(peer, tag, payload), payload)[1],
            peer=peer,
            seq=tag,
            microbatch=m,
            stage=self.stage,
        )

    def _recv(self, stage: int, kind: int, m: int) -> torch.Tensor:
        peer, tag = self.ranks[stage], _tag(self.steps, kind, m)
        direction = "forward" if kind == _ACTIVATION else "backward"
        tensor = traced_p2p(
            self.context.events,
            "recv",
            direction,
            lambda: self.transport.recv(peer, tag, timeout=self.context.timeout),
            peer=peer,
            seq=tag,
            microbatch=m,
            stage=self.stage,
        )
        return tensor.to(self.context.device)

    def __call__(
        self,
        *,
        forward_step_func: Any,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        forward_only: bool = False,
        **unused: Any,
    ) -> list:
        model = model[0] if isinstance(model, list) else model
        data_iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        config = get_model_config(model)
        first, last = self.stage == 0, self.stage == self.stages - 1
        self.transport.begin_step(self.steps)
        records: list = []
        saved = []
        tokens = torch.zeros([], dtype=torch.int, device=self.context.device)
        for m in range(num_microbatches):
            input_tensor = None if first else self._recv(self.stage - 1, _ACTIVATION, m)
            if input_tensor is not None and not forward_only:
                input_tensor.requires_grad_()
            output, num_tokens = forward_step(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                input_tensor,
                records,
                config,
                cp_group_size=1,
                is_first_microbatch=m == 0,
                current_microbatch=m,
                is_last_stage=last,
            )
            tokens += num_tokens
            if not last:
                self._send(self.stage + 1, _ACTIVATION, m, output)
                deallocate_output_tensor(output, config.deallocate_pipeline_outputs)  # as megatron-core's do
            saved.append((input_tensor, output))
        if not forward_only:
            no_sync = config.no_sync_func() if config.no_sync_func is not None else None
            if no_sync is not None:
                no_sync.__enter__()
            try:
                for m, (input_tensor, output) in enumerate(saved):
                    output_grad = None if last else self._recv(self.stage + 1, _GRADIENT, m)
                    input_grad = backward_step(input_tensor, output, output_grad, get_model_type(model), config)
                    if not first:
                        self._send(self.stage - 1, _GRADIENT, m, input_grad)
            finally:
                if no_sync is not None:
                    no_sync.__exit__(None, None, None)
        self.transport.wait_sends(self.steps, timeout=self.context.timeout)
        if not forward_only and config.finalize_model_grads_func is not None:
            per_token = tokens if config.calculate_per_token_loss else None
            config.finalize_model_grads_func([model], per_token, force_all_reduce=False)
        self.steps += 1
        return records

    def close(self) -> None:
        self.transport.close()


def register() -> None:
    register_schedule(GPipe(), override=True)


def fit_with(world_size: int, **strategy: Any) -> dict[str, Any]:
    """``dpp_cases.fit_recording`` (losses and every step's gradients) with the test schedule registered."""
    from dpp_cases import fit_recording

    register()
    return fit_recording(world_size, **strategy)
