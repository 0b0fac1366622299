"""Ring attention (``lightning_megatron.context``) against causal SDPA on the assembled sequence.

Real gloo ranks hold Megatron's load-balanced chunks of one sequence; the output and the gradients of q, k and v,
gathered back into sequence order, must equal one process's causal SDPA within 1e-5 in fp32, with as many key/value
heads as query heads and with fewer (GQA).
"""

from __future__ import annotations

from typing import Any

import context_cases as cc
import pytest
import torch

from lightning_megatron.context import cp_chunk_indices


def test_chunk_indices_are_megatrons_split() -> None:
    assert cp_chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([cp_chunk_indices(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_ring_attention_equals_full_causal_sdpa(ranks: Any, world_size: int, kv_heads: int) -> None:
    errors = ranks.run(world_size, cc.ring_vs_full, 2, 4, kv_heads, 8 * world_size, 16)
    for rank, rank_errors in enumerate(errors):
        for name, error in rank_errors.items():
            assert error < 1e-5, f"CP{world_size} rank {rank}: {name} differs by {error:.3g}"


def test_ring_attention_plain_torch_blocks(ranks: Any) -> None:
    """The blocks GPUs compute in fp32 without a kernel that returns the log-sum-exp, checked here on CPUs."""
    for rank, rank_errors in enumerate(ranks.run(2, cc.ring_vs_full, 2, 4, 2, 16, 16, kernel="math")):
        for name, error in rank_errors.items():
            assert error < 1e-5, f"rank {rank}: {name} differs by {error:.3g}"
