"""Where a tensor-parallel linear layer's backward hands its weight gradient: computed now, or deferred as W.

The contract: :func:`weight_grad` is the one place a backward of ours (the B/W split's, :mod:`.wgrad`, and the
overlapped layers', :mod:`.tp_overlap`) hands over its weight gradient. Outside :func:`collecting` the gradient is
computed at once; inside, a :class:`WeightGrad` (the layer's input and output gradient) is appended to the stash
for a zero-bubble schedule to run later (``WeightGrad.run``). Either way :func:`accumulate_weight_grad` does the
arithmetic: on GPUs with bf16/fp16 activations and an fp32 ``main_grad`` one GEMM accumulates straight into
``main_grad`` (no half-precision temporary, no separate add: what megatron-core can only do with apex);
elsewhere megatron-core's own arithmetic, so in fp32 the result equals the unsplit backward's.

Under megatron-core DDP the backward hands autograd a placeholder marked ``grad_added_to_main_grad`` for the
weight (the flag megatron-core's fused-accumulation path sets), so DDP's hook adds nothing and drops it.

Why a module of its own: the split layers and the overlapped layers both build on it, and the split installs the
overlapped ones; with the handover here neither imports the other in a circle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

__all__ = ["WeightGrad", "accumulate_weight_grad", "collecting", "fused_accumulation_status", "weight_grad"]

# ``gemm(grad_output_2d, total_input_2d, out_dtype)``: ``grad_output_2d.t() @ total_input_2d`` in ``out_dtype``
Gemm = Callable[[torch.Tensor, torch.Tensor, Optional[torch.dtype]], torch.Tensor]

_STASH: Optional[list[WeightGrad]] = None  # where backwards put their weight gradients (None: compute them)
# A module global, not thread-local: autograd runs CUDA backwards on its own device threads.


@dataclass
class WeightGrad:
    """One linear layer's weight gradient of one microbatch, not computed yet."""

    weight: torch.nn.Parameter
    grad_output: torch.Tensor
    total_input: torch.Tensor
    gemm: Optional[Gemm] = None  # the layer's own weight-gradient GEMM (float8), or None: a plain matmul

    def run(self) -> None:
        with torch.no_grad():  # outside autograd's backward now: build no graph
            grad_output, total_input = prepare_input_tensors_for_wgrad_compute(self.grad_output, self.total_input)
            accumulate_weight_grad(self.weight, grad_output, total_input, self.gemm)
        self.grad_output = self.total_input = None  # type: ignore[assignment]  # free them now


def accumulate_weight_grad(
    weight: torch.nn.Parameter, grad_output: torch.Tensor, total_input: torch.Tensor, gemm: Optional[Gemm] = None
) -> None:
    """Add ``grad_output.t() @ total_input`` (2-D views) to the weight's gradient.

    ``gemm``: the layer's own GEMM (:mod:`.float8`'s), asked for an fp32 result where it is added to an fp32
    ``main_grad`` (the float8 GEMM's fp32 accumulator, not rounded to bf16 first).

    Under megatron-core DDP with bf16/fp16 activations and an fp32 ``main_grad`` on a GPU, one GEMM accumulates
    straight into ``main_grad`` (``addmm`` with ``out_dtype``: fp32 accumulation and output, what apex's
    ``gradient_accumulation_fusion`` kernel does), with no half-precision temporary and no separate add. Everywhere
    else (CPU, fp32 training, a torch without the fused GEMM) it is megatron-core's own arithmetic: the GEMM in the
    activations' dtype, then ``main_grad.add_``; in fp32 that is bit-for-bit the unsplit backward.
    """
    main_grad = getattr(weight, "main_grad", None)
    if gemm is not None:
        if main_grad is not None:
            main_grad.add_(gemm(grad_output, total_input, main_grad.dtype))
        elif weight.grad is None:
            weight.grad = gemm(grad_output, total_input, weight.dtype)
        else:
            weight.grad += gemm(grad_output, total_input, weight.dtype)
        return
    if main_grad is not None and _fused_gemm_applies(grad_output, main_grad):
        try:
            torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
            return
        except (RuntimeError, TypeError, NotImplementedError) as error:  # this torch or device lacks it
            _FUSED_GEMM["available"] = False
            _FUSED_GEMM["why"] = f"{type(error).__name__}: {error}".splitlines()[0]
    grad_weight = grad_output.t().matmul(total_input)
    if main_grad is not None:  # megatron-core DDP: what its backward hook does with param.grad
        main_grad.add_(grad_weight)
    elif weight.grad is None:
        weight.grad = grad_weight
    else:
        weight.grad += grad_weight


_FUSED_GEMM: dict[str, Any] = {"available": True, "why": None}  # cleared after the first failure, with the reason


def fused_accumulation_status() -> dict[str, Any]:
    """Whether weight-gradient GEMMs accumulate into ``main_grad`` in one fused GEMM (``why``: if not, the error)."""
    return dict(_FUSED_GEMM)


def _fused_gemm_applies(grad_output: torch.Tensor, main_grad: torch.Tensor) -> bool:
    return (
        _FUSED_GEMM["available"]
        and grad_output.is_cuda
        and grad_output.dtype in (torch.bfloat16, torch.float16)
        and main_grad.dtype == torch.float32
        and main_grad.is_contiguous()
    )


def weight_grad(
    weight: torch.nn.Parameter,
    grad_output: torch.Tensor,
    total_input: torch.Tensor,
    accumulate: bool = True,
    gemm: Optional[Gemm] = None,
) -> Any:
    """A backward's weight gradient: computed now, or deferred into the :func:`collecting` stash.

    Returns what the backward hands autograd for the weight: ``None``, or under megatron-core DDP the placeholder
    its hook drops (see the module docstring). With ``accumulate=False`` and no stash, the gradient itself, as
    megatron-core's backward returns it (its DDP hook adds it to ``main_grad``: no fused accumulation), unless this
    step already added one straight to ``main_grad`` (``grad_added_to_main_grad``: the hook would drop this one).
    ``gemm``: the layer's weight-gradient GEMM when it is not a plain matmul (float8).
    """
    if not accumulate and _STASH is None and not getattr(weight, "grad_added_to_main_grad", False):
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        return gemm(grad_output, total_input, weight.dtype) if gemm else grad_output.t().matmul(total_input)
    deferred = WeightGrad(weight, grad_output.detach(), total_input.detach(), gemm)
    if _STASH is None:
        deferred.run()
    else:
        _STASH.append(deferred)
    if not hasattr(weight, "main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


@contextlib.contextmanager
def collecting(stash: list[WeightGrad]) -> Iterator[list[WeightGrad]]:
    """Backwards run inside defer their weight gradients into ``stash`` (in the order the layers ran)."""
    global _STASH
    previous, _STASH = _STASH, stash
    try:
        yield stash
    finally:
        _STASH = previous
