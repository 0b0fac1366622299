"""The weight-gradient split (B/W) for megatron-core's tensor-parallel linear layers.

Zero-bubble schedules split a backward into B, the input gradient (on the pipeline's critical path: the previous
stage waits for it), and W, the weight gradient (needed only by the optimizer), and run W in the bubbles.
megatron-core 0.16.1 cannot: its ``LinearWithGradAccumulationAndAsyncCommunication`` always computes the weight
gradient inside the backward (the ``delay_wgrad_compute`` path needs Transformer Engine and MoE overlap).

:func:`split_linears` gives every ``ColumnParallelLinear`` and ``RowParallelLinear`` of the model chunks (the
output layer included) an autograd function of ours, per instance (installed by ``compat.megatron_linear``) and
undone by :meth:`SplitLinears.restore`:

* its forward is megatron-core's (the sequence-parallel all-gather, the matmul, the bias);
* its backward computes the input gradient with megatron-core's tensor-parallel all-reduce or reduce-scatter and
  the bias gradient, and hands the weight gradient to :func:`.wgrad_accumulate.weight_grad`: computed at once,
  as megatron-core does, or, while a schedule is ``collecting``, stashed as a ``WeightGrad`` (the layer's input
  and output gradient) for W. In fp32 the result equals the unsplit backward's when each layer's W runs in
  microbatch order; on GPUs with bf16/fp16 activations the GEMM accumulates straight into the fp32 ``main_grad``.

megatron-core's DDP hook on the weight still runs at B time (autograd calls a parameter's accumulate-grad hooks
even without a gradient), and with ``overlap_grad_reduce`` it insists on a gradient: B hands it an uninitialised
placeholder marked ``grad_added_to_main_grad`` (the flag megatron-core's fused-accumulation path sets), so the hook
adds nothing and drops it. The schedule runs every backward inside ``no_sync`` and starts a chunk's reduction
itself (``start_grad_sync``) after the chunk's last W, so nothing is reduced before every W has been added.

With sequence parallelism B all-gathers the layer input for W (W then needs no collective, so tensor-parallel
ranks may run their W tasks at different moments).

With ``overlap`` (``tp_comm_overlap``) :func:`split_linears` installs the overlapped layers of :mod:`.tp_overlap`
instead, which hand their weight gradients over the same way. With ``accumulate=False`` (``tp_comm_overlap``
without ``gradient_accumulation_fusion``) a gradient computed inside the backward goes back through autograd as
megatron-core's does, so the overlap alone does not change the accumulation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from lightning_megatron.compat import megatron_linear, symmetric_all_reduce
from lightning_megatron.layers.collective_matmul import all_gather_rows
from lightning_megatron.layers.float8 import Float8Linear, Float8Recipe, float8_shape_problem
from lightning_megatron.layers.tp_overlap import column_linear, row_forward
from lightning_megatron.layers.wgrad_accumulate import weight_grad

__all__ = ["SplitLinears", "split_linears"]


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, accumulate):  # noqa: ANN001, ANN205
        ctx.save_for_backward(input, weight)
        ctx.accumulate = accumulate
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total_input = all_gather_rows(input, tp_group) if sequence_parallel else input
        output = torch.matmul(total_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        # megatron-core's order, so the collectives overlap the GEMMs: the sequence-parallel all-gather of the
        # input runs under the input-gradient GEMM, the input gradient's reduction under the weight-gradient GEMM.
        input, weight = ctx.saved_tensors
        tp_group = ctx.tp_group
        gathering = None
        if ctx.sequence_parallel:
            gathering, total_input = all_gather_rows(input, tp_group, async_op=True)
        else:
            total_input = input
        grad_input = grad_output.matmul(weight)
        if gathering is not None:
            gathering.wait()
        reducing = None
        # ``symmetric_ar_type``: the all-reduce on symmetric memory, on this stream after the weight-gradient GEMM
        symmetric = symmetric_all_reduce.installed_for(tp_group) if ctx.allreduce_dgrad else None
        if ctx.sequence_parallel:
            sub_grad_input = torch.empty(input.shape, dtype=input.dtype, device=input.device)
            reducing = dist.reduce_scatter_tensor(sub_grad_input, grad_input, group=tp_group, async_op=True)
            grad_input = sub_grad_input
        elif ctx.allreduce_dgrad and symmetric is None:
            reducing = dist.all_reduce(grad_input, group=tp_group, async_op=True)
        # the bias gradient over the 2-D view, as megatron-core sums it (a sum over dim 0 of the 3-D gradient
        # leaves autograd a second reduction: other bf16 rounding, and one more kernel)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        placeholder = weight_grad(weight, grad_output, total_input, ctx.accumulate)
        if reducing is not None:
            reducing.wait()
        elif symmetric is not None:  # (with sequence parallelism ``reducing`` is the reduce-scatter)
            symmetric(grad_input, tp_group)
        return grad_input, placeholder, grad_bias, None, None, None, None


def _split_forward_impl(
    self: torch.nn.Module,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer: Any = None,
    wgrad_deferral_limit: Any = None,
    tp_group: Any = None,
    *,
    overlap: Any = None,
    accumulate: bool = True,
    float8: Optional[Float8Recipe] = None,
) -> torch.Tensor:
    """Stands in for the layer's ``_forward_impl`` (megatron-core calls it with these keywords).

    A weight that is not the layer's own parameter keeps megatron-core's backward, whose weight gradient goes back
    through autograd: the output layer of a one-stage model with tied embeddings uses the embedding's (its
    gradient also comes from the embedding, and the placeholder below would make megatron-core's DDP hook drop
    that part), and MegaScope's weight noise passes the parameter plus noise (a tensor without ``main_grad``,
    whose gradient must reach the parameter through the addition). ``overlap`` (bound by :func:`split_linears`):
    a column-parallel layer's communication is overlapped (:mod:`.tp_overlap`). ``float8``: the layer's GEMMs in
    float8 (:mod:`.float8`).
    """
    own = self._parameters.get("weight")
    if not weight.requires_grad or grad_output_buffer is not None or weight is not own:
        return type(self)._forward_impl(
            self,
            input,
            weight,
            bias=bias,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            grad_output_buffer=grad_output_buffer,
            wgrad_deferral_limit=wgrad_deferral_limit,
            tp_group=tp_group,
        )
    if float8 is not None:
        return Float8Linear.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, accumulate, float8)
    if overlap is not None and isinstance(self, ColumnParallelLinear):
        return column_linear(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, overlap, accumulate)
    return _SplitLinear.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, accumulate)


class SplitLinears:
    """The layers :func:`split_linears` changed; :meth:`restore` gives them megatron-core's backward back."""

    def __init__(
        self,
        modules: list[torch.nn.Module],
        float8_modules: Optional[list[str]] = None,
        kept_high_precision: Optional[dict[str, str]] = None,
    ) -> None:
        self.modules = modules
        self.float8_modules = float8_modules or []  # names of the layers whose GEMMs run in float8
        self.kept_high_precision = kept_high_precision or {}  # name: why it stays bf16 (with ``float8`` only)

    def restore(self) -> None:
        for module in self.modules:
            megatron_linear.restore(module)  # _forward_impl, and a row-parallel layer's overlapped forward
        self.modules = []


def split_linears(
    chunks: Sequence[torch.nn.Module],
    overlap: Any = None,
    accumulate: bool = True,
    float8: Optional[Float8Recipe] = None,
) -> SplitLinears:
    """Give every tensor-parallel linear layer of ``chunks`` (DDP-wrapped or not) the B/W-split backward.

    With ``overlap`` (a :class:`~lightning_megatron.layers.tp_overlap.TPCommOverlap`) their tensor-parallel
    communication is also overlapped with their GEMMs. ``accumulate=False``: outside a :func:`~.wgrad_accumulate.collecting` stash
    the weight gradient goes back through autograd as in megatron-core (no fused ``main_grad`` accumulation; for
    ``tp_comm_overlap`` without ``gradient_accumulation_fusion``). ``float8``: the layers' GEMMs in float8 (not
    with ``overlap``), except the output layer's (the logits stay bf16, as Transformer Engine keeps them), MoE experts'
    (tokens per expert change every step and can be zero, which a tensorwise scale has no value for) and, on GPUs,
    layers whose shard ``torch._scaled_mm`` cannot take. A layer already changed (by an earlier call) is
    left as it is.
    """
    modules, float8_modules, kept = [], [], {}
    for chunk in chunks:
        outputs = {
            id(m.output_layer)
            for m in chunk.modules()
            if isinstance(getattr(m, "output_layer", None), ColumnParallelLinear)
        }
        for name, module in chunk.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not megatron_linear.is_replaced(
                module
            ):
                if getattr(module.config, "gradient_accumulation_fusion", False):
                    continue  # apex's fused wgrad GEMM: keep megatron-core's path (not available without apex)
                row_overlap = overlap is not None and isinstance(module, RowParallelLinear)
                in_float8 = None
                if float8 is not None:
                    why = "the output layer" if id(module) in outputs else None
                    if why is None and getattr(module, "is_expert", False):
                        why = "an MoE expert (its token count changes every step, and can be zero)"
                    if why is None and not float8.emulate:
                        why = float8_shape_problem(module)
                    if why is None:
                        in_float8 = float8
                        float8_modules.append(name)
                    else:
                        kept[name] = why
                megatron_linear.replace(
                    module,
                    functools.partial(_split_forward_impl, overlap=overlap, accumulate=accumulate, float8=in_float8),
                    functools.partial(row_forward, overlap=overlap, accumulate=accumulate) if row_overlap else None,
                )
                modules.append(module)
    return SplitLinears(modules, float8_modules, kept)
