"""How one probed tensor is laid out across tensor-parallel ranks, and back.

Contract: a ``ShardLayout`` maps between three views of a tensor that a hook sees in megatron-core layout
(``[seq, batch, ...]``):

* **local**: what this rank's hook holds (a tensor-parallel shard, and under sequence parallelism a slice of
  the sequence);
* **full**: the tensor as one rank holds it at TP1 (the same at every layout, so captures and perturbation
  noise defined on it are layout-invariant);
* **logical**: the full tensor in TransformerLens order (``[batch, pos, ...]``, heads split out), what users see.

``assemble`` builds *full* from the shards of all TP ranks (tp-rank order), ``local_part`` cuts this rank's
shard out of a *full* tensor (how perturbation noise reaches a shard), ``logical`` reorders *full* for users.

Under context parallelism (CP > 1) the sequence is split first, over context-parallel ranks, into Megatron's
load-balanced chunks (``context.split``: rank r of N holds chunks r and 2N-1-r), and only each rank's share is then
split over tensor-parallel ranks (sequence parallelism) as above. So *full* is assembled in two steps: every CP
rank's share from its TP shards (``assemble``), then the shares into the whole sequence (``join_context``);
``context_part`` and ``local_part`` cut the other way. Every tensor with positions along ``seq_dim`` is split so;
weights (``seq_dim=None``) are whole on every CP rank.
Two layouts need care: SwiGLU's ``linear_fc1`` holds ``[gate_r; up_r]`` on rank r (the full tensor is
``[gate; up]``, not the concatenation of shards), and vocab-parallel logits carry padded vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_megatron.context.split import merge_sequence, split_sequence

__all__ = ["ShardLayout"]


@dataclass(frozen=True)
class ShardLayout:
    tp_dim: Optional[int] = None
    """Dimension split across tensor-parallel ranks (``None``: every TP rank holds the same tensor)."""
    seq_dim: Optional[int] = 0
    """Dimension of the positions (``None`` for weights)."""
    sequence_parallel_split: bool = False
    """Under sequence parallelism, ``seq_dim`` is split across TP ranks (residual stream, layer outputs)."""
    gated: bool = False
    """SwiGLU ``linear_fc1``: each shard is ``[gate_r; up_r]`` along ``tp_dim``."""
    to_logical: tuple[int, ...] = (1, 0)
    """Permutation from megatron order to TransformerLens order (leading dims; the rest stay in place)."""
    heads: Optional[int] = None
    """Split the last dimension into ``[heads, head_dim]`` in the logical view (``hook_z``)."""
    trim_last: Optional[int] = None
    """Keep only the first N entries of the last dimension in the logical view (real vocabulary of logits)."""

    # -- shards <-> full ---------------------------------------------------------------------------------
    def split_seq(self, sequence_parallel: bool) -> bool:
        return self.sequence_parallel_split and sequence_parallel and self.seq_dim is not None

    def assemble(self, shards: Sequence[torch.Tensor], sequence_parallel: bool = False) -> torch.Tensor:
        """The full tensor from every TP rank's shard, in tensor-parallel rank order."""
        if self.split_seq(sequence_parallel):
            assert self.seq_dim is not None
            if self.tp_dim is None:
                return torch.cat(list(shards), dim=self.seq_dim)
            raise ValueError("a tensor split on both the sequence and a tensor-parallel dim is not a probe layout")
        if self.tp_dim is None or len(shards) == 1 and not self.gated:
            return shards[0]
        if self.gated:
            halves = [shard.chunk(2, dim=self.tp_dim) for shard in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=self.tp_dim)
        return torch.cat(list(shards), dim=self.tp_dim)

    def local_part(
        self, full: torch.Tensor, tp_rank: int, tp_size: int, sequence_parallel: bool = False
    ) -> torch.Tensor:
        """This rank's shard of ``full`` (the inverse of ``assemble``)."""
        if self.split_seq(sequence_parallel):
            assert self.seq_dim is not None
            return full.chunk(tp_size, dim=self.seq_dim)[tp_rank]
        if self.tp_dim is None or tp_size == 1:
            return full
        if self.gated:
            gate, up = full.chunk(2, dim=self.tp_dim)
            return torch.cat(
                [gate.chunk(tp_size, dim=self.tp_dim)[tp_rank], up.chunk(tp_size, dim=self.tp_dim)[tp_rank]],
                dim=self.tp_dim,
            )
        return full.chunk(tp_size, dim=self.tp_dim)[tp_rank]

    def full_shape(self, local_shape: Sequence[int], tp_size: int, sequence_parallel: bool = False) -> list[int]:
        shape = list(local_shape)
        if self.split_seq(sequence_parallel):
            assert self.seq_dim is not None
            shape[self.seq_dim] *= tp_size
        elif self.tp_dim is not None:
            shape[self.tp_dim] *= tp_size
        return shape

    # -- context-parallel shares <-> full --------------------------------------------------------------------
    def join_context(self, shares: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole sequence from every context-parallel rank's share (each already assembled over TP), in
        context-parallel rank order."""
        if len(shares) == 1 or self.seq_dim is None:
            return shares[0]
        return merge_sequence(shares, self.seq_dim)

    def context_part(self, full: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
        """This context-parallel rank's share of ``full`` (its two load-balanced chunks along ``seq_dim``)."""
        if cp_size == 1 or self.seq_dim is None:
            return full
        return split_sequence(full, self.seq_dim, cp_size, cp_rank)

    # -- full -> what users see ----------------------------------------------------------------------------
    def logical(self, full: torch.Tensor) -> torch.Tensor:
        lead = len(self.to_logical)
        out = full.permute(*self.to_logical, *range(lead, full.dim()))
        if self.trim_last is not None:
            out = out[..., : self.trim_last]
        if self.heads is not None:
            out = out.reshape(*out.shape[:-1], self.heads, out.shape[-1] // self.heads)
        return out.contiguous()

    @property
    def logical_pos_axis(self) -> Optional[int]:
        """Where the positions are in the logical view."""
        if self.seq_dim is None:
            return None
        return self.to_logical.index(self.seq_dim) if self.seq_dim < len(self.to_logical) else self.seq_dim
