"""Lightning's ``Strategy.reduce``/``all_gather``/``barrier``/``broadcast``/``reduce_boolean_decision`` semantics
over torch.distributed, gloo included; each is a no-op without a process group (a single process).

Lightning callers pass ``reduce_op`` as a string (``"mean"``, ``"sum"``, ...) or a ``ReduceOp``; gloo has no
``AVG``, so a mean is a sum divided by the group size, in floating point even for integer tensors.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["barrier", "broadcast_object", "combine_decision", "gather_tensor", "reduce_tensor"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_tensor(tensor: Tensor, group: Optional[Any], reduce_op: Optional[Any] = "mean") -> Tensor:
    """A reduced copy of ``tensor`` over ``group`` (``None``: the default group)."""
    op = reduce_op if reduce_op is not None else "mean"
    if isinstance(op, str):
        name = op.lower()
        if name not in ("mean", "avg", *_REDUCE_OPS):
            raise ValueError(f"reduce_op={op!r} is not one of 'mean', 'sum', 'max', 'min'.")
        mean = name in ("mean", "avg")
        op = dist.ReduceOp.SUM if mean else _REDUCE_OPS[name]
    else:
        mean = op == dist.ReduceOp.AVG  # gloo has no AVG: sum, then divide
        op = dist.ReduceOp.SUM if mean else op
    result = tensor.clone()
    if mean and not result.is_floating_point():
        result = result.float()
    dist.all_reduce(result, op=op, group=group)
    return result / dist.get_world_size(group) if mean else result


def gather_tensor(tensor: Tensor, group: Optional[Any], sync_grads: bool = False) -> Tensor:
    """``tensor`` from every rank of ``group``, stacked along a new first dimension (differentiable on request)."""
    tensor = tensor.contiguous()
    if sync_grads:
        from torch.distributed.nn.functional import all_gather as differentiable_all_gather

        gathered = differentiable_all_gather(tensor, group=group or dist.group.WORLD)
    else:
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
    return torch.stack(list(gathered))


def barrier(device: torch.device) -> None:
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def combine_decision(decision: bool, all: bool, device: torch.device) -> bool:
    """``all``: every rank decided so; else: any rank did."""
    if not dist.is_initialized():
        return decision
    flag = torch.tensor(int(decision), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return bool(flag == dist.get_world_size()) if all else bool(flag)
