"""megatron-core's uneven gathers and reduce-scatters along the first dimension, on gloo.

Why: with tensor parallelism the MoE dispatcher gathers each rank's tokens over the tensor-parallel group and
reduce-scatters them back (``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with split
sizes), each rank holding a different number of tokens. megatron-core does that with ``torch.distributed.all_gather``
over a list of tensors of different sizes and ``torch.distributed.reduce_scatter``; NCCL runs both, gloo runs
neither (``ProcessGroupGloo::allgather: invalid tensor size``; no reduce_scatter). On CPUs (``install``, called for
gloo processes only) those two functions take another route when split sizes are given: the gather pads every
rank's part to the largest and gathers equal parts, the reduce-scatter all-reduces the whole input and keeps the
rank's slice: the same values, more bytes, on CPUs only. Without split sizes megatron-core's own run.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["install"]

_ORIGINAL: dict[str, Any] = {}


def install() -> None:
    """Idempotent. For processes whose collectives run on gloo (CPU training)."""
    from megatron.core.tensor_parallel import mappings

    if _ORIGINAL:
        return
    _ORIGINAL["gather"] = mappings._gather_along_first_dim
    _ORIGINAL["reduce_scatter"] = mappings._reduce_scatter_along_first_dim
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


def _gather_along_first_dim(
    input_: torch.Tensor, group: Any, output_split_sizes: Optional[list[int]] = None, use_global_buffer: bool = False
) -> torch.Tensor:
    if output_split_sizes is None or group.size() == 1:
        return _ORIGINAL["gather"](input_, group, output_split_sizes, use_global_buffer)
    sizes = [int(s) for s in output_split_sizes]
    longest = max(sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)], dim=0)


def _reduce_scatter_along_first_dim(
    input_: torch.Tensor, group: Any, input_split_sizes: Optional[list[int]] = None, use_global_buffer: bool = False
) -> torch.Tensor:
    if input_split_sizes is None or group.size() == 1:
        return _ORIGINAL["reduce_scatter"](input_, group, input_split_sizes, use_global_buffer)
    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    sizes = [int(s) for s in input_split_sizes]
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]].clone()
