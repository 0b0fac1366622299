"""Chunked collective matmul: a GEMM and the tensor-parallel collective next to it, decomposed along the token
dimension (dim 0, megatron-core's ``[sequence, batch, hidden]``) so the collective of one chunk runs while another
chunk's GEMM computes.

Contract: each function computes exactly what the unchunked pair computes (collective then GEMM, or GEMM then
collective) with the same collectives of the same process group (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, each on a chunk, ``async_op=True``), so every rank of the group must call
it with the same shapes and ``chunks``. Every output row is one GEMM row of the same operands and every reduced
element the same sum over the group's ranks, so only the GEMM's blocking may change the rounding (in fp32 on CPUs
the results agree to the last few bits). ``rhs`` is the right-hand matrix as ``torch.mm`` takes it (``weight.t()``
in a forward, ``weight`` in an input-gradient GEMM). Run inside ``torch.no_grad`` (autograd functions' bodies are).

On GPUs the collectives run on the process group's communication stream (NCCL's), the GEMMs on the current
stream; ``Work.wait`` only makes the current stream wait, so the host never blocks. Buffers handed to an unfinished
collective are kept referenced by :class:`Pending` until it is waited on.

* :func:`all_gather_matmul` — ``all_gather(x) @ rhs``: every chunk's all-gather starts at once; this rank's own rows
  (needing no communication) are multiplied first, then each gathered chunk as it arrives.
* :func:`matmul_reduce_scatter` — ``reduce_scatter(x @ rhs)``: chunk ``i`` of every rank's output shard is
  computed, then its reduce-scatter starts while chunk ``i + 1`` is computed.
* :func:`matmul_all_reduce` — ``all_reduce(x @ rhs)``: the same with an all-reduce of each chunk of rows.

:func:`all_gather_rows` is the unchunked all-gather that the layers without overlap use (sequence parallelism).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["Pending", "all_gather_matmul", "all_gather_rows", "matmul_all_reduce", "matmul_reduce_scatter", "spans"]


class Pending:
    """Collectives still running, with the buffers they read or write; :meth:`wait` finishes them."""

    def __init__(self) -> None:
        self._works: list[tuple[Any, tuple[torch.Tensor, ...]]] = []

    def add(self, work: Any, *buffers: torch.Tensor) -> None:
        self._works.append((work, buffers))

    def wait(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works = []


def all_gather_rows(input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """The sequence-parallel all-gather along the first dimension (with ``async_op``: ``(work, output)``)."""
    shape = list(input.shape)
    shape[0] *= dist.get_world_size(group)
    out = torch.empty(shape, dtype=input.dtype, device=input.device)
    work = dist.all_gather_into_tensor(out, input.contiguous(), group=group, async_op=async_op)
    return (work, out) if async_op else out


def spans(length: int, chunks: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``min(chunks, length)`` consecutive pieces of ``length`` rows (sizes differ by ≤ 1)."""
    count = max(1, min(chunks, length))
    base, extra = divmod(length, count)
    out, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _mm_into(x: torch.Tensor, rhs: torch.Tensor, out: torch.Tensor) -> None:
    """``out[...] = x @ rhs`` over the 2-D views (``x`` and ``out`` contiguous, equal leading dimensions)."""
    torch.mm(x.reshape(-1, x.shape[-1]), rhs, out=out.view(-1, out.shape[-1]))


def all_gather_matmul(
    x: torch.Tensor, rhs: torch.Tensor, group: Any, chunks: int, keep_gathered: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(all_gather(x) @ rhs, all_gather(x) if keep_gathered else None)``, gathered along dim 0."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty((size * rows, *x.shape[1:-1], rhs.shape[-1]), dtype=x.dtype, device=x.device)
    pieces_of = spans(rows, chunks)
    copy = keep_gathered and len(pieces_of) > 1  # one piece: its buffer is the gathered tensor, in order
    gathered = torch.empty((size * rows, *x.shape[1:]), dtype=x.dtype, device=x.device) if copy else None
    started = []
    for a, b in pieces_of:  # all of them now: they run back to back on the communication stream
        buffer = torch.empty((size * (b - a), *x.shape[1:]), dtype=x.dtype, device=x.device)
        started.append((a, b, buffer, dist.all_gather_into_tensor(buffer, x[a:b], group=group, async_op=True)))
    _mm_into(x, rhs, out[rank * rows : (rank + 1) * rows])  # this rank's rows: no communication needed
    for a, b, buffer, work in started:
        work.wait()
        pieces = buffer.view(size, b - a, *x.shape[1:])
        for peer in range(size):
            if peer != rank:
                _mm_into(pieces[peer], rhs, out[peer * rows + a : peer * rows + b])
        if gathered is not None:
            gathered.view(size, rows, *x.shape[1:])[:, a:b].copy_(pieces)
        elif keep_gathered:
            gathered = buffer
    return out, gathered


def matmul_reduce_scatter(x: torch.Tensor, rhs: torch.Tensor, group: Any, chunks: int) -> tuple[torch.Tensor, Pending]:
    """``reduce_scatter(x @ rhs)`` along dim 0 (this rank's shard of the summed rows) and the collectives to wait on.

    The result may be read only after ``Pending.wait()``.
    """
    size = dist.get_world_size(group)
    x = x.contiguous()
    if x.shape[0] % size:
        raise ValueError(f"reduce-scatter of {x.shape[0]} rows over {size} ranks: not divisible")
    rows = x.shape[0] // size
    out = torch.empty((rows, *x.shape[1:-1], rhs.shape[-1]), dtype=x.dtype, device=x.device)
    pending = Pending()
    for a, b in spans(rows, chunks):
        partial = torch.empty((size * (b - a), *out.shape[1:]), dtype=x.dtype, device=x.device)
        pieces = partial.view(size, b - a, *out.shape[1:])
        for peer in range(size):  # the rows of chunk [a, b) of every rank's shard, rank-major as the collective wants
            _mm_into(x[peer * rows + a : peer * rows + b], rhs, pieces[peer])
        pending.add(dist.reduce_scatter_tensor(out[a:b], partial, group=group, async_op=True), partial)
    return out, pending


def matmul_all_reduce(x: torch.Tensor, rhs: torch.Tensor, group: Any, chunks: int) -> tuple[torch.Tensor, Pending]:
    """``all_reduce(x @ rhs)`` and the collectives to wait on; the result may be read only after ``Pending.wait()``."""
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], rhs.shape[-1]), dtype=x.dtype, device=x.device)
    pending = Pending()
    for a, b in spans(x.shape[0], chunks):
        _mm_into(x[a:b], rhs, out[a:b])
        pending.add(dist.all_reduce(out[a:b], group=group, async_op=True), out)
    return out, pending
