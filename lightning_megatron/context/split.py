"""Which tokens a context-parallel rank holds, and how to put a sequence back together.

Megatron's load-balanced split (``get_batch_on_this_cp_rank`` in Megatron-LM): the sequence is cut into ``2N``
equal chunks and rank ``r`` of ``N`` keeps chunks ``r`` and ``2N-1-r``, in that order. Under causal attention the
early chunk attends to few keys and the late one to many, so every rank does the same work; megatron-core's rotary
embedding selects the same chunks of the position table (``get_pos_emb_on_this_cp_rank``), so RoPE positions stay
global without anything passed to the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["cp_chunk_indices", "gather_sequence", "merge_sequence", "split_sequence"]


def cp_chunk_indices(seq_len: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions (into the full sequence) that rank ``rank`` of ``size`` holds, in local order."""
    if seq_len % (2 * size):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 × {size} equal chunks")
    chunk = seq_len // (2 * size)
    early = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    late = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([early, late])


def split_sequence(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """This rank's tokens of ``tensor`` along ``dim`` (a copy: the chunks are not adjacent)."""
    return tensor.index_select(dim, cp_chunk_indices(tensor.shape[dim], size, rank, tensor.device))


def merge_sequence(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every rank's :func:`split_sequence` share, given in rank order (the inverse of
    splitting over all ranks; no communication: whoever holds the shares puts them back in order)."""
    size = len(parts)
    if size == 1:
        return parts[0]
    gathered = torch.cat(list(parts), dim=dim)
    seq_len = gathered.shape[dim]
    order = torch.cat([cp_chunk_indices(seq_len, size, r, gathered.device) for r in range(size)])
    result = torch.empty_like(gathered)
    result.index_copy_(dim, order, gathered)
    return result


def gather_sequence(local: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The full sequence from every rank's :func:`split_sequence` share (all-gather, then back into order)."""
    size = dist.get_world_size(group)
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return merge_sequence(parts, dim)
