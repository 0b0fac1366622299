"""Vocabulary-parallel cross-entropy that reads the logits once forward and once backward.

Contract: ``vocab_parallel_cross_entropy(logits, target, tp_group)`` takes this rank's slice of the logits
(``[..., vocab / TP]``, any float dtype) and the target ids (``[...]``) and returns the per-token loss in fp32, equal
to megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy`` within fp32 rounding, with the gradient
``(softmax - one_hot) * grad_output`` in the logits' dtype.

Why: without Transformer Engine, megatron-core's fused cross-entropy (``cross_entropy_fusion_impl="native"``)
compiles steps that materialise fp32 copies of the ``[tokens, vocab]`` logits: an fp32 cast for the max, the exp
of every logit kept in fp32 for the backward (twice the logits' bytes, written in the forward and read back), and
an fp32 gradient converted to bf16. With a GPT-2-sized vocabulary that is a noticeable share of a step's GPU time
(docs/guides/performance.md). Here the only tensors kept are the logits themselves (alive anyway: the
output layer produced them) and one fp32 log-sum-exp per token:

* forward: one compiled reduction over the logits (log-sum-exp in fp32) and a gather of the target's logit;
* backward: one compiled elementwise pass that reads the logits and writes the gradient in their dtype.

Under tensor parallelism every rank reduces its own vocabulary slice; the per-token log-sum-exps are combined by an
all-gather (one float per token and rank) and the target's logit, found on one rank, by a sum all-reduce: the same
two collectives as megatron-core's, on the same tensor-parallel group. On CPUs the same functions run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_cross_entropy"]


def _local_lse_and_target_logit(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    local = target - vocab_start
    here = (local >= 0) & (local < x.shape[-1])
    picked = torch.gather(x, -1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return lse, torch.where(here, picked, torch.zeros_like(picked))


def _logits_grad(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, vocab_start: int, grad_output: torch.Tensor
) -> torch.Tensor:
    softmax = torch.exp(logits.float() - lse.unsqueeze(-1))
    ids = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
    one_hot = (ids == target.unsqueeze(-1)).to(softmax.dtype)
    return ((softmax - one_hot) * grad_output.float().unsqueeze(-1)).to(logits.dtype)


_COMPILED: dict[str, Callable[..., Any]] = {}


def _kernel(name: str, fn: Callable[..., Any], on_gpu: bool) -> Callable[..., Any]:
    """The function compiled (one fused kernel per shape) on GPUs, as is on CPUs."""
    if not on_gpu:
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


def _group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Optional[dist.ProcessGroup]):  # noqa: ANN205
        rank, size = _group_rank_and_size(group)
        vocab_start = rank * logits.shape[-1]
        forward = _kernel("forward", _local_lse_and_target_logit, logits.is_cuda)
        lse, target_logit = forward(logits, target, vocab_start)
        if size > 1:
            every = torch.empty(size * lse.numel(), dtype=lse.dtype, device=lse.device)
            dist.all_gather_into_tensor(every, lse.reshape(-1), group=group)
            lse = torch.logsumexp(every.view(size, *lse.shape), dim=0)
            dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(logits, lse, target)
        ctx.vocab_start = vocab_start
        return lse - target_logit

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # noqa: ANN205
        logits, lse, target = ctx.saved_tensors
        backward = _kernel("backward", _logits_grad, logits.is_cuda)
        return backward(logits, lse, target, ctx.vocab_start, grad_output.contiguous()), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Per-token cross-entropy of this rank's vocabulary slice of ``logits`` (see the module docstring)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} need targets of shape "
            f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}."
        )
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
