"""Per-instance replacement of megatron-core's tensor-parallel linear layers' methods (``layers.wgrad``).

Why: megatron-core 0.16.1 computes a ``ColumnParallelLinear``'s or ``RowParallelLinear``'s weight gradient inside
its backward, in ``LinearWithGradAccumulationAndAsyncCommunication``, and offers no hook to defer it or to overlap
its tensor-parallel collectives without Transformer Engine. The layer calls its ``_forward_impl`` (a private
method, bound per call) with the autograd function's arguments; :func:`replace` sets that method, and for a
row-parallel layer with overlap its ``forward``, on the *instance*, so the class and every other layer stay
megatron-core's. :func:`restore` deletes the instance attributes: the class's methods show through again.

What the replacements compute is :mod:`lightning_megatron.layers`' business; this module only installs and
restores them, so every patch of a third-party function stays in ``compat/`` (see :mod:`.inventory`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ["is_replaced", "replace", "restore"]

_REPLACED = ("_forward_impl", "forward")


def is_replaced(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs a replacement (an earlier :func:`replace` not yet restored)."""
    return "_forward_impl" in module.__dict__


def replace(
    module: torch.nn.Module, forward_impl: Callable[..., Any], forward: Optional[Callable[..., Any]] = None
) -> None:
    """Bind ``forward_impl`` (and ``forward``) to ``module`` in place of its class's methods."""
    module._forward_impl = types.MethodType(forward_impl, module)
    if forward is not None:
        module.forward = types.MethodType(forward, module)


def restore(module: torch.nn.Module) -> None:
    """The class's methods again (a no-op on a module never replaced)."""
    for name in _REPLACED:
        module.__dict__.pop(name, None)
