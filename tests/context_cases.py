"""Functions that run inside forked ranks for ``test_ring_attention.py`` and ``test_context_parallel.py``."""

from __future__ import annotations

import datetime
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _group() -> dist.ProcessGroup:
    if not dist.is_initialized():  # later cases in these ranks reuse it
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    return dist.group.WORLD


def ring_vs_full(
    batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, kernel: str = "auto"
) -> dict[str, float]:
    """Largest error of ring attention's output and q/k/v gradients against causal SDPA on the whole sequence.
    ``kernel="math"``: the blocks run on the plain-torch path GPUs take in fp32, instead of the CPU kernel."""
    from lightning_megatron.context import gather_sequence, ring_attention, split_sequence

    module = sys.modules["lightning_megatron.context.ring_attention"]  # the package re-exports the function's name

    chosen = module._kernel
    if kernel != "auto":
        module._kernel = lambda q: kernel
    try:
        return _compare(batch, heads, kv_heads, seq, head_dim, gather_sequence, ring_attention, split_sequence)
    finally:
        module._kernel = chosen


def _compare(batch, heads, kv_heads, seq, head_dim, gather_sequence, ring_attention, split_sequence):  # noqa: ANN001, ANN202
    dtype = torch.float32

    group = _group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(11)  # the same full tensors on every rank: each takes its own part
    q = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=dtype, requires_grad=True)
    dout = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=dtype)
    scale = head_dim**-0.5
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
    want.backward(dout)

    local = [split_sequence(t.detach(), 2, size, rank).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group=group, scale=scale)
    out.backward(split_sequence(dout, 2, size, rank))
    got = {"out": gather_sequence(out.detach(), 2, group)}
    for name, t in zip("qkv", local):
        got[f"d{name}"] = gather_sequence(t.grad, 2, group)
    want_all = {"out": want.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: float((got[name] - want_all[name]).abs().max()) for name in want_all}


def greedy_continuation(module: Any) -> dict[str, Any]:
    """Greedy tokens and their fp32 logits (last stage) for two prompts, with and without the KV cache."""
    import torch

    out: dict[str, Any] = {}
    for kv_cache in (True, False):
        logits: list = []

        def keep(step: Any, logits: list = logits) -> None:
            if step.logits is not None:
                logits.append(step.logits.detach().clone())

        result = module.generate(
            [[3, 5, 7, 9, 11, 13, 15, 17, 19, 21], [2, 4, 6]], 6, temperature=0, kv_cache=kv_cache, on_token=keep
        )
        out[f"tokens/{kv_cache}"] = result.tokens
        out[f"logits/{kv_cache}"] = torch.stack(logits) if logits else None
    return out
