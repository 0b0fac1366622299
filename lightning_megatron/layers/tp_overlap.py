"""Tensor-parallel communication overlapped with the GEMMs of megatron-core's parallel linear layers, without
Transformer Engine (``MegatronAppStrategy(tp_comm_overlap=True)``).

Contract: with :class:`TPCommOverlap` given to :func:`~lightning_megatron.layers.wgrad.split_linears`, every
``ColumnParallelLinear`` and ``RowParallelLinear`` it takes computes the same outputs and gradients as megatron-core
(the same collectives of the same group, on chunks of tokens; see :mod:`.collective_matmul`), and hands its weight
gradient to :func:`~lightning_megatron.layers.wgrad_accumulate.weight_grad` like the B/W split does (computed at once, or
stashed for a zero-bubble schedule's W; fused into fp32 ``main_grad`` where that applies).

What each layer overlaps (``s`` tokens, sequence parallelism = SP, the token dimension cut into ``chunks``):

=================  ======================================================  ===========================================
layer              forward                                                 backward (input gradient)
=================  ======================================================  ===========================================
column, SP         all-gather of the input under the GEMM (own rows first)  dgrad GEMM chunks under the previous
                                                                            chunks' reduce-scatter; the input's
                                                                            all-gather (for W) under the first chunk
column, no SP      no collective                                            dgrad GEMM chunks under the previous
                                                                            chunks' all-reduce
row, SP            GEMM chunks under the previous chunks' reduce-scatter   all-gather of the output gradient under
                                                                            the dgrad GEMM (own rows first)
row, no SP         GEMM chunks under the previous chunks' all-reduce       no collective
=================  ======================================================  ===========================================

When W runs inside the backward (no zero-bubble stash), the weight-gradient GEMM also runs under the last chunk's
reduction. The row layer's reduction lives in megatron-core's ``RowParallelLinear.forward`` (after
``_forward_impl``), so :func:`row_forward` stands in for that ``forward``; anything it does not cover (an input
that is not already split, expert layers, frozen weights, CPU offloading) goes to megatron-core's ``forward``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.collective_matmul import (
    Pending,
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from lightning_megatron.layers.wgrad_accumulate import weight_grad

__all__ = ["TPCommOverlap", "column_linear", "row_forward", "tp_comm_overlap_options"]


@dataclass(frozen=True)
class TPCommOverlap:
    """Settings of the overlapped tensor-parallel layers.

    Attributes:
        chunks: Pieces the token dimension of each GEMM is cut into (a layer with fewer local tokens uses one per
            token). More pieces hide more of the communication but make smaller GEMMs.
    """

    chunks: int = 2


def tp_comm_overlap_options(enabled: Any, chunks: Any, tensor_parallel: int) -> Optional[TPCommOverlap]:
    """The strategy's ``tp_comm_overlap`` / ``tp_comm_overlap_chunks`` checked: settings, or ``None`` (off)."""
    if not isinstance(enabled, bool):
        raise MegatronConfigError(f"`tp_comm_overlap` must be true or false, got {enabled!r}.")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise MegatronConfigError(
            f"`tp_comm_overlap_chunks` must be a positive integer (pieces of the token dimension; 2 or 4 are "
            f"typical), got {chunks!r}."
        )
    if not enabled:
        return None
    if tensor_parallel == 1:
        warnings.warn(
            "`tp_comm_overlap=True` has nothing to overlap with tensor_model_parallel_size=1 (no tensor-parallel "
            "communication); it is ignored. Set tensor_model_parallel_size > 1, or leave tp_comm_overlap off.",
            stacklevel=3,
        )
        return None
    return TPCommOverlap(chunks=chunks)


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, chunks, accumulate):  # noqa: ANN001, ANN205
        ctx.save_for_backward(input, weight)
        ctx.accumulate = accumulate
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        ctx.chunks = chunks
        if sequence_parallel:
            output, _ = all_gather_matmul(input, weight.t(), tp_group, chunks)
        else:
            output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        input, weight = ctx.saved_tensors
        group, chunks = ctx.tp_group, ctx.chunks
        grad_output = grad_output.contiguous()
        pending: Optional[Pending] = None
        total_input = input
        if ctx.sequence_parallel:  # the input for W: gathered under the first dgrad chunk (issued first)
            total_input = torch.empty(
                (input.shape[0] * dist.get_world_size(group), *input.shape[1:]), dtype=input.dtype, device=input.device
            )
            gathering = dist.all_gather_into_tensor(total_input, input.contiguous(), group=group, async_op=True)
            grad_input, pending = matmul_reduce_scatter(grad_output, weight, group, chunks)
            gathering.wait()
        elif ctx.allreduce_dgrad:
            grad_input, pending = matmul_all_reduce(grad_output, weight, group, chunks)
        else:
            grad_input = grad_output.matmul(weight)
        # the bias gradient over the 2-D view, as megatron-core sums it (a sum over dim 0 of the 3-D gradient
        # leaves autograd a second reduction: other bf16 rounding, and one more kernel)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        placeholder = weight_grad(weight, grad_output, total_input, ctx.accumulate)  # W now: under the last reduction
        if pending is not None:
            pending.wait()
        return grad_input, placeholder, grad_bias, None, None, None, None, None


class _RowLinear(torch.autograd.Function):
    """The row-parallel GEMM with the reduction megatron-core's ``RowParallelLinear.forward`` does after it."""

    @staticmethod
    def forward(ctx, input, weight, sequence_parallel, tp_group, chunks, accumulate):  # noqa: ANN001, ANN205
        ctx.save_for_backward(input, weight)
        ctx.accumulate = accumulate
        ctx.sequence_parallel, ctx.tp_group, ctx.chunks = sequence_parallel, tp_group, chunks
        if sequence_parallel:
            output, pending = matmul_reduce_scatter(input, weight.t(), tp_group, chunks)
        else:
            output, pending = matmul_all_reduce(input, weight.t(), tp_group, chunks)
        pending.wait()
        return output

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        input, weight = ctx.saved_tensors
        if ctx.sequence_parallel:  # the reduce-scatter's gradient is an all-gather: under the dgrad GEMM
            grad_input, grad_output = all_gather_matmul(grad_output, weight, ctx.tp_group, ctx.chunks, True)
        else:  # the all-reduce's gradient is the identity
            grad_output = grad_output.contiguous()
            grad_input = grad_output.matmul(weight)
        placeholder = weight_grad(weight, grad_output, input, ctx.accumulate)
        return grad_input, placeholder, None, None, None, None


def column_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: Any,
    overlap: TPCommOverlap,
    accumulate: bool = True,
) -> torch.Tensor:
    """What megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` computes, overlapped
    (``accumulate``: see :func:`~lightning_megatron.layers.wgrad_accumulate.weight_grad`)."""
    return _ColumnLinear.apply(
        input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, overlap.chunks, accumulate
    )


def row_forward(
    self: torch.nn.Module, input_: torch.Tensor, *, overlap: TPCommOverlap, accumulate: bool = True
) -> tuple[Any, Any]:
    """Stands in for a ``RowParallelLinear``'s ``forward`` (bound per instance by ``split_linears``)."""
    config = self.config
    offloading = getattr(config, "_cpu_offloading_context", None) is not None
    if (
        not self.input_is_parallel
        or self.explicit_expert_comm
        or offloading
        or self.weight is None
        or not self.weight.requires_grad
        or self.weight is not self._parameters.get("weight")  # e.g. MegaScope's weight noise: see wgrad.py
    ):
        return type(self).forward(self, input_)
    output = _RowLinear.apply(
        input_, self.weight, bool(self.sequence_parallel), self.tp_group, overlap.chunks, accumulate
    )
    if self.skip_bias_add:
        return output, self.bias
    return (output + self.bias if self.bias is not None else output), None
