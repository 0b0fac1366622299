"""MegaScope's own process group: how captured data and commands travel between ranks.

Contract: ``scope_group()`` returns a private gloo group over every rank (created on first use, collectively:
every rank must be in the call), so MegaScope never sends a byte over the training groups (NCCL on GPUs)
and never reorders their collectives. Over it, ``gather_to(dst, payload)`` brings each rank's captured shards
(CPU tensors) to the serving rank, and ``broadcast_from(src, obj)`` sends commands (generation requests,
perturbation changes, pause/resume) from the serving rank to all. In one process without
``torch.distributed`` both are local. The group is made again when the world group changes (a new
``init_process_group``) and released at interpreter exit with the rest.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["broadcast_from", "gather_to", "is_distributed", "rank", "scope_group"]

_GROUP: dict[int, Any] = {}
DEFAULT_TIMEOUT = timedelta(minutes=30)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def scope_group(timeout: Optional[timedelta] = None) -> Optional[Any]:
    """The private gloo group (``None`` in one process). Collective the first time: all ranks call it."""
    if not is_distributed():
        return None
    key = id(dist.group.WORLD)
    group = _GROUP.get(key)
    if group is None:
        _GROUP.clear()  # an earlier world's group is gone with that world
        group = _GROUP[key] = dist.new_group(backend="gloo", timeout=timeout or DEFAULT_TIMEOUT)
    return group


def gather_to(dst: int, payload: Any) -> Optional[list[Any]]:
    """Every rank's ``payload`` (picklable, CPU tensors) on rank ``dst``, in rank order; ``None`` elsewhere."""
    if not is_distributed():
        return [payload]
    group = scope_group()
    out: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(payload, out, dst=dst, group=group)
    return out


def broadcast_from(src: int, obj: Any = None) -> Any:
    """``obj`` of rank ``src`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=scope_group())
    return box[0]
