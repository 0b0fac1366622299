"""Functions that run inside forked ranks for ``test_release.py``."""

from __future__ import annotations

import os
import weakref
from typing import Any

import lightning.pytorch as pl
from cases import fit_gpt
from megatron.core.utils import get_model_config


class _Watch(pl.Callback):
    """Weak references to what the strategy built, taken at the end of training."""

    def __init__(self) -> None:
        self.refs: dict[str, list[Any]] = {}
        self.params: list[Any] = []
        self.configs: list[Any] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        strategy = trainer.strategy
        self.refs["ddp"] = [weakref.ref(c) for c in strategy.wrapped_chunks]
        self.refs["optimizer"] = [weakref.ref(o) for o in strategy.optimizers]
        self.params = [p for c in strategy.wrapped_chunks for p in c.parameters()]
        self.configs = [get_model_config(c) for c in strategy.wrapped_chunks]


def fit_and_look(world_size: int, **strategy: Any) -> dict[str, Any]:
    """After a fit, while the caller still holds the module: are the DDP wrappers and optimizer gone (without a
    garbage-collector pass), and what still points at them?"""
    watch = _Watch()
    fit_gpt(world_size, steps=2, callbacks=[watch], **strategy)
    hooks = ("no_sync_func", "grad_sync_func", "finalize_model_grads_func", "grad_scale_func", "timers")
    return {
        "alive": {name: sum(ref() is not None for ref in refs) for name, refs in watch.refs.items()},
        "main_grads": sum(hasattr(p, "main_grad") or hasattr(p, "main_param") for p in watch.params),
        "config_hooks": sorted({h for c in watch.configs for h in hooks if getattr(c, h, None) is not None}),
    }


def threads_after(world_size: int, **strategy: Any) -> int:
    """The process's threads (native ones included: gloo runs a loop thread per context) after a fit."""
    fit_gpt(world_size, steps=2, **strategy)
    return len(os.listdir("/proc/self/task"))
