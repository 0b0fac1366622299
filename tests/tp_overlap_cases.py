"""Functions that run inside forked ranks for ``test_tp_overlap.py``: the chunked collective matmul against its
unchunked definition, and fits with ``tp_comm_overlap`` that count which overlapped paths ran."""

from __future__ import annotations

import datetime
from collections import Counter
from typing import Any

import dpp_cases as dc
import torch
import torch.distributed as dist

PRIMITIVES = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def primitives(chunk_counts: list[int]) -> dict[str, float]:
    """Largest error of each primitive (float64) against the collective and GEMM done whole, per chunk count."""
    from lightning_megatron.layers.collective_matmul import (
        all_gather_matmul,
        matmul_all_reduce,
        matmul_reduce_scatter,
    )

    if not dist.is_initialized():  # (later fits in these ranks reuse it, as after a fit: the strategy's timeout)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group, size, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)  # the same tensors on every rank: each takes its own part
    rows = 5  # per rank: uneven pieces for 2 and 3 chunks, fewer rows than chunks for 7
    full = torch.randn(size * rows, 3, 6, generator=g, dtype=torch.float64)
    rhs = torch.randn(6, 4, generator=g, dtype=torch.float64)
    xs = [torch.randn(size * rows, 3, 6, generator=g, dtype=torch.float64) for _ in range(size)]  # one per rank
    rhss = [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(size)]
    summed = sum(x @ r for x, r in zip(xs, rhss))
    errors: dict[str, float] = {}
    with torch.no_grad():
        for chunks in chunk_counts:
            out, gathered = all_gather_matmul(full[rank * rows : (rank + 1) * rows], rhs, group, chunks, True)
            errors[f"all_gather_matmul/{chunks}"] = float((out - full @ rhs).abs().max())
            errors[f"all_gather_matmul.gathered/{chunks}"] = float((gathered - full).abs().max())
            out, pending = matmul_reduce_scatter(xs[rank], rhss[rank], group, chunks)
            pending.wait()
            errors[f"matmul_reduce_scatter/{chunks}"] = float(
                (out - summed[rank * rows : (rank + 1) * rows]).abs().max()
            )
            out, pending = matmul_all_reduce(xs[rank], rhss[rank], group, chunks)
            pending.wait()
            errors[f"matmul_all_reduce/{chunks}"] = float((out - summed).abs().max())
    return errors


def fit_counting(world_size: int, **strategy: Any) -> dict[str, Any]:
    """``dpp_cases.fit_fused_layers`` plus how often each chunked primitive ran (through the overlapped layers)."""
    from lightning_megatron.layers import tp_overlap

    calls: Counter = Counter()
    originals = {name: getattr(tp_overlap, name) for name in PRIMITIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in PRIMITIVES:
        setattr(tp_overlap, name, counting(name))
    try:
        result = dc.fit_fused_layers(world_size, **strategy)
    finally:
        for name, fn in originals.items():
            setattr(tp_overlap, name, fn)
    result["calls"] = {name: calls[name] for name in PRIMITIVES}
    return result
