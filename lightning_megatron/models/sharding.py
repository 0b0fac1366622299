"""Walking megatron-core's sharded state dicts: each ``ShardedTensor`` names a *global* tensor (``key``,
``global_shape``, leading ``prepend_axis_num`` layer axes) and where this rank's piece of it lies
(``global_offset``; ``data`` is the local parameter or a view of it). Initialization and checkpoint
conversion both use this to work on global tensors whatever the parallel layout."""

from __future__ import annotations

from collections.abc import Iterator

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

__all__ = ["sharded_tensors"]


def sharded_tensors(tree: object) -> Iterator[ShardedTensor]:
    """Every ``ShardedTensor`` in a (nested) sharded state dict; factories (e.g. SwiGLU's fused
    ``linear_fc1``) are built into their parts, whose ``data`` are views of the parameter."""
    if isinstance(tree, ShardedTensor):
        yield tree
    elif isinstance(tree, ShardedTensorFactory):
        yield from sharded_tensors(tree.build())
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from sharded_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from sharded_tensors(value)
