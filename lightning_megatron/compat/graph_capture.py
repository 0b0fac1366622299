"""Clean up after a CUDA graph capture that failed (torch 2.11 leaves two things behind).

Why: ``torch.cuda.graph`` ends a capture in ``CUDAGraph.capture_end``, which calls ``cudaStreamEndCapture`` first
and raises if the capture was invalidated, before it does the rest of its bookkeeping:

* the caching allocator still counts a capture as underway. While one is, it never processes the events of blocks
  used on more than one stream (``cudaEventQuery`` is illegal during a capture), so those blocks are never
  reused: twelve fits in one process after a failed capture ran out of memory with most of the GPU's memory
  reserved and unused. Nor is the capture's private memory pool ever released;
* every random generator registered with the graph stays in capture mode, and the next eager dropout raises
  "Offset increment outside graph capture".

:func:`capturing` runs a capture with a memory pool of its own (so the pool's id is known even when the capture
fails) and, when it fails, ends the allocator's capture, releases the pool, and puts the generators' states back
to where they were before the capture. After a successful capture it does nothing: torch did all of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["capturing"]


@contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, generators: Sequence[torch.Generator]
) -> Iterator[None]:
    """``torch.cuda.graph(graph, stream=stream)`` that leaves nothing behind if the capture fails. ``generators``:
    the tracker generators already registered with ``graph`` (the default one is added here)."""
    device = torch.cuda.current_device()
    generators = [torch.cuda.default_generators[device], *generators]
    saved = [generator.clone_state() for generator in generators]
    pool = torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    except BaseException:
        try:
            torch._C._cuda_endAllocateToPool(device, pool)
        except RuntimeError:
            pass  # the capture got as far as ending it: torch releases the pool with the graph
        else:
            torch._C._cuda_releasePool(device, pool)  # the reference the capture took
        for generator, state in zip(generators, saved):
            generator.graphsafe_set_state(state)
        raise
