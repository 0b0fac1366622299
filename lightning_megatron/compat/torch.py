"""The private PyTorch protocol this project touches, in one place.

``torch.optim.lr_scheduler.LRScheduler`` warns ("Detected call of `lr_scheduler.step()` before
`optimizer.step()`") unless the optimizer it is attached to has set ``_opt_called``. Our users attach
schedulers to the torch optimizer they return from ``configure_optimizers``; the strategy keeps that
optimizer as the holder of learning rates and steps the weights with megatron-core's optimizer, so the
attached optimizer never steps itself. We record the step on it, exactly as the scheduler's own step
wrapper would.
"""

from __future__ import annotations

import torch

__all__ = ["default_store", "mark_optimizer_stepped"]


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    optimizer._opt_called = True  # type: ignore[attr-defined]


def default_store() -> torch.distributed.Store:
    """The rendezvous store of torch.distributed's default group.

    Transports exchange connection data (segment names, addresses) through the job's own store, so they need
    no ports or names of their own. torch exposes the store only through a private accessor."""
    from torch.distributed import distributed_c10d

    if not torch.distributed.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: there is no rendezvous store to use.")
    return distributed_c10d._get_default_store()
