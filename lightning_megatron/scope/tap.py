"""Where a forward pass is: which positions, which step and microbatch — the context every hook needs.

Contract: ``Tap.of(chunks)`` is the one object per model that captures and perturbations share. While at
least one of them is active (``acquire``/``release``, reference-counted) it keeps a forward pre-hook on each
model chunk that records the absolute positions the forward computes (``offset``: the KV cache's
``sequence_len_offset``, 0 without one; ``length``: the width of ``position_ids``, times the context-parallel size
when the forward is split over context-parallel ranks) and ``cp_size``: how many context-parallel ranks share the
sequence of *this* forward (the model config's ``context_parallel_size``, read per forward: generation runs whole
sequences at CP1 semantics on every rank, ``context.whole_sequences``). ``step``, ``microbatch``
and ``phase`` are set by whoever drives the model (the training callback from the strategy's step
listener; generation leaves them at 0). When nothing is active no hook is registered: zero cost when off.

The parallel facts a hook needs (tensor- and context-parallel rank and size, sequence parallelism,
data-parallel rank) are read once from megatron-core's parallel state, or are those of one process when it is not initialized.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state

from lightning_megatron.strategy.listeners import StepListener

__all__ = ["ForwardState", "ParallelFacts", "Tap", "strategy_of"]


def strategy_of(model: Any) -> Any:
    """The ``MegatronAppStrategy`` training ``model`` (a LightningModule attached to a Trainer), else None."""
    from lightning_megatron.strategy import MegatronAppStrategy

    trainer = getattr(model, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    return strategy if isinstance(strategy, MegatronAppStrategy) else None


@dataclass(frozen=True)
class ParallelFacts:
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    sequence_parallel: bool = False
    cp_rank: int = 0
    cp_size: int = 1

    @classmethod
    def read(cls, chunks: Sequence[torch.nn.Module]) -> ParallelFacts:
        if not parallel_state.model_parallel_is_initialized():
            return cls()
        return cls(
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            dp_rank=parallel_state.get_data_parallel_rank(),
            sequence_parallel=bool(getattr(chunks[0].config, "sequence_parallel", False)),
            cp_rank=parallel_state.get_context_parallel_rank(),
            cp_size=parallel_state.get_context_parallel_world_size(),
        )


@dataclass
class ForwardState:
    step: int = 0
    microbatch: int = 0
    """Global microbatch index of the step (data-parallel rank × microbatches per rank + local index)."""
    phase: str = "forward"
    """``"backward"`` while the backward runs: forwards then are activation recomputation (not captured)."""
    offset: int = 0
    length: int = 0
    cp_size: int = 1
    """Context-parallel ranks the current forward's sequence is split over (1: every rank runs it whole)."""
    step_pinned: bool = False
    """Set by a driver that assigns ``step`` itself; otherwise the strategy's ``global_step`` is used."""

    @property
    def end(self) -> int:
        """One past the last absolute position of the current forward."""
        return self.offset + self.length


class _MicrobatchListener(StepListener):
    """Keeps ``ForwardState`` in step with the strategy's schedule: step, microbatch, forward or backward."""

    def __init__(self, state: ForwardState, strategy: Any) -> None:
        self.state = state
        self.strategy = strategy

    def microbatch(self, phase: str, chunk: int, microbatch: int) -> None:
        self.state.phase = phase
        self.state.microbatch = microbatch
        trainer = getattr(self.strategy.lightning_module, "_trainer", None)
        if trainer is not None and not self.state.step_pinned:
            self.state.step = int(trainer.global_step)


class Tap:
    """Shared per model (keyed by its first chunk); see the module docstring."""

    _taps: weakref.WeakKeyDictionary[torch.nn.Module, Tap] = weakref.WeakKeyDictionary()

    def __init__(self, chunks: Sequence[torch.nn.Module], strategy: Any = None) -> None:
        self.chunks = list(chunks)
        self.strategy = strategy
        self._listener: Any = None
        self.state = ForwardState()
        self.facts = ParallelFacts.read(self.chunks)
        self.max_positions = max(int(getattr(c, "max_sequence_length", 0) or 0) for c in self.chunks)
        self._users = 0
        self._handles: list[Any] = []

    @classmethod
    def of(cls, chunks: Sequence[torch.nn.Module], strategy: Any = None) -> Tap:
        tap = cls._taps.get(chunks[0])
        if tap is None or [id(c) for c in tap.chunks] != [id(c) for c in chunks]:
            tap = cls._taps[chunks[0]] = cls(chunks, strategy)
        elif strategy is not None and tap._users == 0:
            tap.strategy = strategy
        return tap

    def acquire(self) -> None:
        if self._users == 0:
            self.facts = ParallelFacts.read(self.chunks)  # the layout may differ from the last use
            self._handles = [c.register_forward_pre_hook(self._on_chunk_forward, with_kwargs=True) for c in self.chunks]
            if self.strategy is not None:
                self._listener = _MicrobatchListener(self.state, self.strategy)
                self.strategy.add_step_listener(self._listener)
        self._users += 1

    def release(self) -> None:
        self._users -= 1
        if self._users == 0:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if self._listener is not None:
                self.strategy.remove_step_listener(self._listener)
                self._listener = None
            self.state.__init__()  # type: ignore[misc]  (reset in place: hooks hold this object)

    def _on_chunk_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        tokens = kwargs.get("input_ids", args[0] if args else None)
        context = kwargs.get("inference_context") or kwargs.get("inference_params")
        offset = getattr(context, "sequence_len_offset", 0) if context is not None else 0
        reference = positions if positions is not None else tokens
        # Read per forward: inside ``context.whole_sequences`` the config says 1 and every rank runs it all.
        cp_size = int(getattr(getattr(module, "config", None), "context_parallel_size", 1) or 1)
        self.state.cp_size = cp_size if self.facts.cp_size > 1 else 1
        self.state.offset = int(offset or 0)
        self.state.length = int(reference.shape[1]) * self.state.cp_size if reference is not None else 0

    def positions_of(self, extent: int) -> tuple[int, int]:
        """Absolute positions of a tensor with ``extent`` positions computed by the current forward: the last
        ``extent`` ones (a KV-cache decode step, or logits of the last token only)."""
        end = self.state.end if self.state.length else extent
        return end - extent, end

    def positions_for_seq(self, local_extent: int, layout_split: bool) -> tuple[int, int]:
        """Absolute positions of a tensor with ``local_extent`` positions on this rank: its sequence may be split
        over tensor-parallel ranks (sequence parallelism, ``layout_split``) and over context-parallel ranks."""
        extent = local_extent * (self.facts.tp_size if layout_split and self.facts.sequence_parallel else 1)
        return self.positions_of(extent * self.state.cp_size)

    @property
    def redundant(self) -> bool:
        """This rank runs the current forward whole, as another context-parallel rank (rank 0) does too."""
        return self.state.cp_size == 1 and self.facts.cp_rank != 0
