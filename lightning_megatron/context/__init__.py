"""Context parallelism: each rank holds a slice of the sequence, and attention passes key/value blocks around."""

from lightning_megatron.context.ring_attention import ring_attention
from lightning_megatron.context.split import cp_chunk_indices, gather_sequence, merge_sequence, split_sequence

__all__ = ["cp_chunk_indices", "gather_sequence", "merge_sequence", "ring_attention", "split_sequence"]
