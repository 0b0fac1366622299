"""One optimizer step's forward and backward passes through a registered pipeline schedule.

The strategy owns the forward step and the loss function it hands the schedule. That makes two things
exact that are usually approximate:

* the loss: the module's loss function returns a token-weighted *sum* and a token count; megatron-core
  (``calculate_per_token_loss``) scales gradients once by the global token count, and the logged loss is
  ``Σ loss_sum / Σ tokens`` over every microbatch and data-parallel replica, not a mean of means;
* visibility: every rank gets the global value (reduced on the last stage, broadcast down the pipeline),
  so ``train_loss`` on a first-stage rank is the real loss, not a zero.

Each model chunk reads the step's microbatches through a :class:`Microbatches`: megatron-core's schedules
iterate it in order; a dynamic schedule ``seek``s the microbatch it is about to run, so data, labels and
the index announced to listeners always belong together, whatever the order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lightning_megatron.pipeline.registry import ForwardBackwardFunc
from lightning_megatron.strategy.listeners import StepListener

__all__ = ["LossFn", "Microbatches", "StepOutput", "run_forward_backward"]

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``loss_fn(output) -> (loss_sum, num_tokens)``: the summed loss over the microbatch's counted tokens."""


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor
    """Global token-weighted mean loss of the step (fp32 scalar), identical on every rank."""
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor


class Microbatches:
    """One step's microbatches as one model chunk reads them: in order by default, or by index after ``seek``.

    ``served`` is the index of the microbatch ``next()`` returned last (what the forward step runs on)."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = items
        self._next = 0
        self.served: Optional[int] = None

    def __iter__(self) -> Microbatches:
        return self

    def __next__(self) -> Any:
        if self._next >= len(self._items):
            raise StopIteration
        self.served = self._next
        self._next += 1
        return self._items[self.served]

    def __len__(self) -> int:
        return len(self._items)

    @property
    def items(self) -> Sequence[Any]:
        """The step's microbatches, in order (a schedule that ships them to other ranks reads them here)."""
        return self._items

    def seek(self, index: int) -> None:
        """The next ``next()`` returns microbatch ``index``."""
        if not 0 <= index < len(self._items):
            raise IndexError(f"microbatch {index} of a step with {len(self._items)}")
        self._next = index


def _checked_loss(loss_fn: LossFn, output: torch.Tensor):  # noqa: ANN202
    result = loss_fn(output)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            "The loss function returned by forward_step must return (loss_sum, num_tokens): the loss summed over "
            f"the microbatch's counted tokens and their number. Got {type(result).__name__}."
        )
    loss_sum, num_tokens = result
    num_tokens = torch.as_tensor(num_tokens, device=loss_sum.device).to(torch.int)
    record = torch.stack([loss_sum.detach().float(), num_tokens.float()])
    # megatron-core's 3-tuple form: (loss to backpropagate, tokens, what the schedule collects for us).
    return loss_sum, num_tokens, record


def run_forward_backward(
    *,
    schedule: ForwardBackwardFunc,
    chunks: Sequence[torch.nn.Module],
    forward_step: Callable[[Any, torch.nn.Module], tuple[torch.Tensor, LossFn]],
    microbatches: Sequence[Any],
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    device: torch.device,
    listeners: Sequence[StepListener] = (),
) -> StepOutput:
    """Run ``schedule`` (a schedule session) over ``microbatches`` (one step) and return the exact global loss.

    ``listeners`` learn which chunk and microbatch each forward and backward belongs to: the forward is
    announced before it runs; the backward when the gradient reaches the forward's output (a tensor hook).
    """
    chunk_index = {id(chunk): i for i, chunk in enumerate(chunks)}

    def forward_step_func(data_iterator, model):  # noqa: ANN001, ANN202  (megatron-core's signature)
        item = next(data_iterator)
        if not listeners:
            output, loss_fn = forward_step(item, model)
            return output, partial(_checked_loss, loss_fn)
        chunk = chunk_index[id(model)]
        microbatch = data_iterator.served
        for listener in listeners:
            listener.microbatch("forward", chunk, microbatch)
        output, loss_fn = forward_step(item, model)
        if isinstance(output, torch.Tensor) and output.requires_grad:

            def announce_backward(grad: torch.Tensor) -> None:
                for listener in listeners:
                    listener.microbatch("backward", chunk, microbatch)

            output.register_hook(announce_backward)
        return output, partial(_checked_loss, loss_fn)

    # Each model chunk reads every microbatch; stages use the fields they need. Lists even for one
    # chunk: the non-interleaved schedules unwrap them, the interleaved one requires them.
    records = schedule(
        forward_step_func=forward_step_func,
        data_iterator=[Microbatches(microbatches) for _ in chunks],
        model=list(chunks),
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return _global_loss(records, device)


def _global_loss(records: Sequence[torch.Tensor], device: torch.device) -> StepOutput:
    totals = torch.zeros(2, dtype=torch.float32, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for record in records:
            totals += record
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            totals,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    loss_sum, num_tokens = totals[0], totals[1]
    return StepOutput(loss=loss_sum / num_tokens.clamp(min=1.0), loss_sum=loss_sum, num_tokens=num_tokens)
