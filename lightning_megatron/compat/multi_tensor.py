"""megatron-core's multi-tensor fallbacks, replaced by torch's foreach kernels.

Why: without Transformer Engine or Apex, megatron-core's gradient clipping and its mixed-precision optimizer fall
back to ``megatron.core.utils.local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``.

* The norm takes one ``torch.norm`` per gradient and then builds a host list of them (``torch.tensor`` of CUDA
  scalars): one device synchronisation per parameter, about 300 a step on GPT-2-medium, each of which drains the
  GPU's queue while the host still has the optimizer and the next step to launch.
* The scale (also the copy of fp32 master weights into the bf16 model weights) launches one kernel per tensor from
  a Python loop.

torch's ``_foreach_norm``, ``_foreach_mul_`` and ``_foreach_copy_`` (what ``torch.nn.utils.clip_grad_norm_`` and
torch's optimizers use) do the same arithmetic in a few multi-tensor kernels without a synchronisation. ``install``
puts them on the two module globals megatron-core reads (``optimizer.clip_grads`` and ``optimizer.optimizer``), and
only where those still hold the local fallbacks: Transformer Engine's or Apex's kernels are kept when present.
The norm is the same quantity (the 2-norm of the per-tensor 2-norms), summed in another order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

__all__ = ["foreach_l2_norm", "foreach_scale", "install"]


def foreach_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor: bool, *args
) -> tuple[torch.Tensor, None]:
    """Drop-in for ``amp_C.multi_tensor_l2norm``: the 2-norm over every tensor of ``tensor_lists[0]``, as a
    one-element fp32 tensor on the tensors' device."""
    tensors = list(tensor_lists[0])
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        by_dtype[tensor.dtype].append(tensor)
    norms = [norm for group in by_dtype.values() for norm in torch._foreach_norm(group, 2, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], scale: float
) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair (also across dtypes)."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    pairs: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(
        lambda: ([], [])
    )
    for src, dst in zip(sources, targets):
        group = pairs[(src.dtype, dst.dtype)]
        group[0].append(src)
        group[1].append(dst)
    for src, dst in pairs.values():
        in_place = all(s is d for s, d in zip(src, dst))
        if in_place:
            if scale != 1.0:
                torch._foreach_mul_(dst, scale)
        else:
            torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def install() -> bool:
    """Point megatron-core's clipping and optimizer at the foreach kernels where they use the local fallbacks.
    Idempotent; returns whether anything uses them now."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    replaced = False
    if getattr(clip_grads, "l2_norm_impl", None) in (utils.local_multi_tensor_l2_norm, foreach_l2_norm):
        clip_grads.l2_norm_impl = foreach_l2_norm
        replaced = True
    for module in (clip_grads, megatron_optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) in (utils.local_multi_tensor_scale, foreach_scale):
            module.multi_tensor_scale_impl = foreach_scale
            replaced = True
    return replaced
