"""Lightning's ``Strategy.reduce``/``all_gather``/``barrier``/``broadcast``/``reduce_boolean_decision`` semantics
over torch.distributed, gloo included; each is a no-op without a process group (a single process).
:class:`DataParallelCollectives` gives the strategy those methods, over the data-parallel group by default.

Lightning callers pass ``reduce_op`` as a string (``"mean"``, ``"sum"``, ...) or a ``ReduceOp``; gloo has no
``AVG``, so a mean is a sum divided by the group size, in floating point even for integer tensors.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor
from typing_extensions import override

__all__ = [
    "DataParallelCollectives",
    "barrier",
    "broadcast_object",
    "combine_decision",
    "gather_tensor",
    "reduce_tensor",
]

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


class DataParallelCollectives:
    """Lightning's collective methods of a strategy (a mixin before ``ParallelStrategy``): metrics are reduced over
    the data- (and context-) parallel group by default, since model-parallel peers hold the same values. Needs
    ``self._parallel`` (None before the groups exist) and ``self.root_device``."""

    _parallel: Any
    root_device: torch.device

    def _default_group(self) -> Optional[Any]:
        """Data-parallel ranks see different data; model-parallel peers hold the same metric values."""
        if self._parallel is None:
            return None
        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Reduce over ``group``; by default the data-parallel group (see ``_default_group``)."""
        if not isinstance(tensor, Tensor) or not dist.is_initialized():
            return tensor
        return reduce_tensor(tensor, group if group is not None else self._default_group(), reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` (same shape everywhere) from ``group``, by default the data-parallel group."""
        if not dist.is_initialized():
            return tensor.unsqueeze(0)
        return gather_tensor(tensor, group if group is not None else self._default_group(), sync_grads)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a picklable object from global rank ``src`` to every rank."""
        return broadcast_object(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Combine a decision across **all** ranks (e.g. early stopping must stop every stage)."""
        return combine_decision(decision, all, self.root_device)
