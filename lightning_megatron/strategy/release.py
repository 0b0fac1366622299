"""Let go, at the end of a fit, of what the strategy built around the user's model, so it is freed at once.

Lightning's trainer and module reference each other, so everything reachable from them is freed only by the
garbage collector's next full pass, which Python times by object counts, not by GPU memory: forty fits in one
process (a sweep, a notebook, a test suite) ran out of GPU memory holding dead fits' gradient buffers and
optimizer states, and every fit's process groups (gloo: a loop thread each) lived on with them. Two links tie the
strategy's objects to the user's module, which outlives the fit:

* megatron-core's model config (shared by the module's chunks) holds the DDP wrappers' bound methods
  (``no_sync_func``, ``grad_sync_func``, ...) and the optimizer's loss scaler;
* every parameter holds its ``main_grad`` view of the DDP gradient buffer and its ``main_param`` (the optimizer's
  fp32 master copy), and its accumulate-grad node holds the DDP's backward hook (the DDP keeps those nodes alive in
  ``grad_accs``).

:func:`release_training_state` cuts both. The weights stay with the module (with the distributed optimizer they
live in the DDP's parameter buffer, which the parameters keep); whatever is left in cycles is for the collector,
which the strategy runs once when the next fit sets up (:func:`collect_previous_fits`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel

from lightning_megatron.compat import moe as moe_compat

__all__ = ["collect_previous_fits", "release_training_state"]

_CONFIG_HOOKS = ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func", "grad_scale_func")
_PARAM_ATTRIBUTES = ("main_grad", "grad_added_to_main_grad", "main_param", "main_param_sharded")
"""What megatron-core's DDP and optimizers hang on each parameter: the gradient-buffer view and the optimizer's
fp32 master copy (a 350M model's training state, gigabytes of GPU memory, outlived its fit through these)."""


def release_training_state(chunks: Iterable[torch.nn.Module], configs: Iterable[Any]) -> None:
    """Cut the DDP wrappers and the optimizer loose from the model chunks and their configs."""
    moe_compat.scale_router_loss_gradients(1)
    for config in configs:
        for name in _CONFIG_HOOKS:
            if getattr(config, name, None) is not None:
                setattr(config, name, None)
        config.timers = None
    for chunk in chunks:
        if not isinstance(chunk, DistributedDataParallel):
            continue
        if getattr(chunk, "remove_forward_pre_hook_handles", None):
            chunk.disable_forward_pre_hook(param_sync=False)
        chunk.grad_accs = []  # the accumulate-grad nodes, and with them the backward hooks that hold the DDP
        for param in chunk.module.parameters():
            param.grad = None
            for name in _PARAM_ATTRIBUTES:
                if hasattr(param, name):
                    delattr(param, name)


def collect_previous_fits() -> None:
    """A full garbage-collector pass: what earlier fits left in reference cycles (their process groups and, if
    their modules were dropped, their weights) goes before this fit allocates."""
    gc.collect()
