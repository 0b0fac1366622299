"""megatron-core's gradient-sync protocol for schedules that run backwards in their own order.

megatron-core's schedules reduce gradients in a fixed pattern: every backward but the ones that finish a model
chunk runs inside the chunk's ``no_sync``, and with ``overlap_grad_reduce`` the chunk's ``grad_sync_func`` starts
its reduction once its last backward is done. A schedule of ours that orders backwards differently (MegaDPP), or
in which some data-parallel ranks run no backward at all (MegaFBD's forward ranks), keeps that protocol with
:class:`GradSync`, so every data-parallel rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

__all__ = ["GradSync"]


class GradSync:
    """megatron-core's gradient-sync protocol, per chunk as soon as its backwards are done.

    The step runs inside every chunk's ``no_sync`` (nothing is reduced per microbatch). When chunk ``c``'s last
    backward is done, and every chunk after it has started, its ``grad_sync_func`` (the DDP's
    ``start_grad_sync``, set with ``overlap_grad_reduce``) is called outside ``no_sync``, as megatron-core's
    interleaved schedule does; the order C-1, ..., 0 is the same on every data-parallel rank, whatever order the
    policy ran the backwards in. Without ``overlap_grad_reduce``, ``finalize_model_grads`` reduces everything.
    """

    def __init__(self, config: Any, model: list[torch.nn.Module], microbatches: int, forward_only: bool) -> None:
        funcs = None if forward_only else config.no_sync_func
        self._no_sync = funcs if isinstance(funcs, list) else [funcs] if funcs is not None else []
        sync = None if forward_only else config.grad_sync_func
        self._sync = None if sync is None else sync if isinstance(sync, list) else [sync] * len(model)
        self._model = model
        self._left = [microbatches] * len(model)
        self._next = len(model) - 1
        self._context: Optional[contextlib.ExitStack] = None

    def disable(self) -> None:
        if self._context is None:
            stack = contextlib.ExitStack()
            for func in self._no_sync:
                stack.enter_context(func())
            self._context = stack

    def enable(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.close()

    def backward_done(self, chunk: int) -> None:
        self._left[chunk] -= 1
        self._start(final=False)

    def finish(self) -> None:
        self.enable()
        self._start(final=True)

    def _start(self, final: bool) -> None:
        while self._next >= 0 and (final or self._left[self._next] == 0):
            chunk, self._next = self._next, self._next - 1
            if self._sync is not None:
                self.enable()
                self._sync[chunk](self._model[chunk].parameters())
                if not final:
                    self.disable()
