"""Who does what in MegaFBD's rank split: forward replicas, backward replicas, and who feeds whom.

The job keeps megatron-core's layout (TP × PP × DP, every rank one process and one GPU); the split is over the
data-parallel replicas. The last ``forward_replicas`` replicas run forwards only; the first ``B = DP − F`` run the
backwards, read the data (the sampler shards it ``B`` ways) and own the loss. A step's microbatches are dealt to the
forward replicas round-robin, microbatch by microbatch: microbatch ``m`` of backward replica ``b`` is slot
``m·B + b``, run by forward replica ``(m·B + b) mod F``. With ``F`` dividing ``B`` that is forward replica
``b mod F`` for all of ``b``'s microbatches (1:2, 1:3); with more forward replicas than backward ones (3:1, for
forward-heavy work) a backward replica's microbatches come from several forward replicas in turn, so none idles.

Forward replicas stay data-parallel replicas: they take part in the gradient reduction with zero gradients and
zero tokens (exact, because the strategy scales gradients by the global token count, not by the replica count)
and run the same optimizer step, so they hold the updated weights after every step without a broadcast.

:class:`Roles` also knows every rank's ``(replica, stage, tensor rank)`` (one all-gather when the session opens),
so a rank can name the partner that serves a message whichever replica, stage and TP rank it sits at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError

__all__ = ["Roles", "check_replicas", "data_shard", "dealt_to"]


def dealt_to(backward_replica: int, microbatch: int, backward_replicas: int, forward_replicas: int) -> int:
    """Which forward replica (0 to ``F − 1``, counted among the forward replicas) runs ``microbatch`` of
    ``backward_replica``: slot ``m·B + b``, dealt round-robin (module docstring)."""
    return (microbatch * backward_replicas + backward_replica) % forward_replicas


def check_replicas(forward_replicas: int, data_parallel: int) -> None:
    if forward_replicas >= data_parallel:
        raise MegatronConfigError(
            f"schedule='fbd' with forward_replicas={forward_replicas} needs a data-parallel size above it (one "
            f"replica at least runs the backwards), but the data-parallel size is {data_parallel}. Add GPUs "
            "(devices x nodes = TP x PP x DP) or lower schedule_options.forward_replicas."
        )


def data_shard(options: Any, rank: int, size: int) -> tuple[int, int]:
    """The sampler's ``(rank, replicas)``: backward replicas split the data; a forward replica reads its first
    partner's shard (it never uses it: partners send the microbatches they run)."""
    forward = int(options.forward_replicas)
    backward = max(size - forward, 1)
    return (rank if rank < backward else (rank - backward) % backward), backward


@dataclass(frozen=True)
class Roles:
    forward_replicas: int
    backward_replicas: int
    replica: int
    """This rank's data-parallel index."""
    stage: int
    stages: int
    tensor_rank: int
    _grid: dict[tuple[int, int, int], int]

    @classmethod
    def discover(cls, forward_replicas: int, device: torch.device, groups: Any) -> Roles:
        """This rank's role and the map of every rank (one all-gather over the world, at session open), from the
        session's process ``groups`` (:class:`~lightning_megatron.pipeline.registry.ScheduleGroups`)."""
        dp = groups.data_size
        check_replicas(forward_replicas, dp)
        if groups.context_parallel_size != 1:
            raise MegatronConfigError("schedule='fbd' does not run with context parallelism; set its size to 1.")
        mine = torch.tensor(
            [groups.data_rank, groups.pipeline_rank, groups.tensor_rank],
            dtype=torch.int64,
            device=device,
        )
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        grid = {tuple(int(v) for v in t.tolist()): rank for rank, t in enumerate(every)}
        return cls(
            forward_replicas=forward_replicas,
            backward_replicas=dp - forward_replicas,
            replica=int(mine[0]),
            stage=int(mine[1]),
            stages=groups.pipeline_size,
            tensor_rank=int(mine[2]),
            _grid=grid,
        )

    @property
    def is_forward(self) -> bool:
        return self.replica >= self.backward_replicas

    def feeder(self, backward_replica: int, microbatch: int) -> int:
        """The forward replica (data-parallel index) that runs ``microbatch`` of ``backward_replica``."""
        return self.backward_replicas + dealt_to(
            backward_replica, microbatch, self.backward_replicas, self.forward_replicas
        )

    def feeders(self, backward_replica: int) -> list[int]:
        """Every forward replica that runs some microbatch of ``backward_replica`` (the slots repeat every
        ``F`` microbatches)."""
        return sorted({self.feeder(backward_replica, m) for m in range(self.forward_replicas)})

    def partners(self) -> list[int]:
        """A forward replica's backward replicas: those with a microbatch it runs."""
        return [b for b in range(self.backward_replicas) if self.replica in self.feeders(b)]

    def assigned(self, microbatches: int) -> list[tuple[int, int]]:
        """A forward replica's ``(microbatch, backward replica)`` pairs of a step, in the order it runs them."""
        return [
            (m, b)
            for m in range(microbatches)
            for b in range(self.backward_replicas)
            if self.feeder(b, m) == self.replica
        ]

    def rank(self, replica: int, stage: int) -> int:
        """The global rank at ``(replica, stage)`` with this rank's tensor-parallel index."""
        return self._grid[(replica, stage, self.tensor_rank)]
