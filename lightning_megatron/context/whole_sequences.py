"""Run a context-parallel model on whole sequences: what generation does at ``context_parallel_size > 1``.

Context-parallel ranks hold the same weights and differ only in which tokens they see. Decoding feeds positions
one at a time (with a KV cache) or the whole context (without), neither of which splits into ``2 × CP`` chunks; so
inside :func:`whole_sequences` every rank of a context-parallel group runs the whole sequence itself, as at CP1:
the model config says ``context_parallel_size=1`` (the project's attention then runs plain SDPA, and megatron-core's
RoPE covers the whole length) and the rotary embeddings forget their context-parallel group (which they would slice
their position table by). The ranks compute the same tokens redundantly; nothing is exchanged.

megatron-core's ``RotaryEmbedding.forward`` is an ``lru_cache`` keyed by its arguments, not by the group it slices
by, so its cache is cleared on the way in and out: a table cut for this rank's chunks must not serve a whole
sequence of the same length, nor the other way round.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core.utils import get_model_config

__all__ = ["whole_sequences"]


@contextmanager
def whole_sequences(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Inside the block, ``chunks`` (a rank's model chunks) compute whole sequences as at CP1; restored after."""
    configs = {id(get_model_config(c)): get_model_config(c) for c in chunks}.values()
    sizes = [(config, config.context_parallel_size) for config in configs]
    rotary = [(m, m.cp_group) for c in chunks for m in c.modules() if hasattr(m, "cp_group") and hasattr(m, "inv_freq")]
    try:
        for config, _ in sizes:
            config.context_parallel_size = 1
        for module, _ in rotary:
            module.cp_group = None
        _clear_rotary_caches(rotary)
        yield
    finally:
        for config, size in sizes:
            config.context_parallel_size = size
        for module, group in rotary:
            module.cp_group = group
        _clear_rotary_caches(rotary)


def _clear_rotary_caches(rotary: list) -> None:
    for kind in {type(module) for module, _ in rotary}:
        clear = getattr(kind.forward, "cache_clear", None)
        if clear is not None:
            clear()
