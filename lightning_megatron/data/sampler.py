"""Sampling by global batch, so the data of a step does not depend on the data-parallel size.

Step ``k`` of an epoch consumes samples ``[k·G, (k+1)·G)`` of the epoch's order (``G`` = global batch
size); data-parallel rank ``r`` of ``D`` takes the contiguous slice ``[r·G/D, (r+1)·G/D)`` of it. The
same run at DP1 and DP4 therefore sees the same samples in every step, and a restarted run can skip
exactly the steps already taken (``start_step``), which makes resumed training continue on the same
data as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler

from lightning_megatron.errors import MegatronConfigError

__all__ = ["GlobalBatchSampler", "data_parallel_coordinates", "eval_sampler", "train_sampler"]


class GlobalBatchSampler(DistributedSampler):
    """Index sampler for one data-parallel rank; use with ``DataLoader(batch_size=G // D, drop_last=True)``.

    It subclasses ``DistributedSampler`` so Lightning recognises it and does not inject its own.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        start_step: int = 0,
        steps_per_epoch: int | None = None,
    ) -> None:
        if global_batch_size % num_replicas:
            raise MegatronConfigError(
                f"global_batch_size={global_batch_size} must be divisible by the data-parallel size {num_replicas}."
            )
        if num_samples < global_batch_size:
            raise MegatronConfigError(
                f"The dataset has {num_samples} samples, fewer than one global batch ({global_batch_size})."
            )
        super().__init__(range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // num_replicas
        self.full_epoch_steps = num_samples // global_batch_size
        self.steps_per_epoch = min(steps_per_epoch or self.full_epoch_steps, self.full_epoch_steps)
        self.start_step = start_step

    def _skip(self) -> int:
        """Steps of the current epoch already taken before a restart."""
        done = self.start_step - self.epoch * self.steps_per_epoch
        return min(max(done, 0), self.steps_per_epoch)

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        first = self.rank * self.local_batch_size
        for step in range(self._skip(), self.steps_per_epoch):
            start = step * self.global_batch_size + first
            yield from order[start : start + self.local_batch_size]

    def __len__(self) -> int:
        # The full, unlimited epoch, also when resuming inside it: Lightning applies limit_train_batches
        # to this length itself, and ends a shortened (resumed) epoch when the iterator runs out.
        return self.full_epoch_steps * self.local_batch_size


def data_parallel_coordinates(trainer: object) -> tuple[int, int]:
    """``(data-parallel size, rank)`` of this process under the trainer's strategy."""
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))


def train_sampler(
    trainer: object, num_samples: int, *, global_batch_size: int, seed: int, shuffle: bool = True
) -> GlobalBatchSampler:
    """The training sampler for this rank, positioned after the steps the (restored) trainer has taken.

    One batch is one optimizer step, so ``trainer.global_step`` is the number of global batches
    consumed; ``limit_train_batches`` shortens epochs the way Lightning counts them.
    """
    replicas, rank = data_parallel_coordinates(trainer)
    full = num_samples // global_batch_size
    limit = getattr(trainer, "limit_train_batches", None)
    if isinstance(limit, int):
        steps = min(full, limit)
    elif isinstance(limit, float):
        steps = int(full * limit)
    else:
        steps = full
    return GlobalBatchSampler(
        num_samples,
        global_batch_size=global_batch_size,
        num_replicas=replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        start_step=int(getattr(trainer, "global_step", 0)),
        steps_per_epoch=max(steps, 1),
    )


def eval_sampler(trainer: object, num_samples: int, *, global_batch_size: int) -> GlobalBatchSampler:
    """Validation/test sampler: the same global batches at every data-parallel size, in order."""
    replicas, rank = data_parallel_coordinates(trainer)
    return GlobalBatchSampler(
        num_samples, global_batch_size=global_batch_size, num_replicas=replicas, rank=rank, shuffle=False
    )
