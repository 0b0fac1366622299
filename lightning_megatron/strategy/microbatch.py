"""One Lightning batch is one optimizer step: split a data-parallel rank's batch into microbatches."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_megatron.context.split import split_sequence
from lightning_megatron.errors import MegatronConfigError

__all__ = ["split_microbatches", "batch_size_of", "infer_seq_length", "context_parallel_share"]


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [t for v in batch for t in _tensors(v)]
    return []


def batch_size_of(batch: Any) -> int:
    """The leading dimension shared by every tensor of the batch."""
    tensors = _tensors(batch)
    if not tensors:
        raise MegatronConfigError(
            "The batch holds no tensors. MegatronAppStrategy splits batches along dim 0 of their tensors; "
            "return a tensor, a dict or a tuple of tensors from the DataLoader."
        )
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if len(sizes) != 1 or None in sizes:
        raise MegatronConfigError(
            f"Every tensor in the batch must share its first (sample) dimension; found sizes {sorted(map(str, sizes))}."
        )
    return sizes.pop()


def _slice(batch: Any, start: int, stop: int, size: int) -> Any:
    """Slice every tensor (and every per-sample list of non-tensors) of ``batch`` along the samples."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        sliced = copy.copy(batch)  # keeps the mapping's type (OrderedDict, defaultdict, ...)
        for key, value in batch.items():
            sliced[key] = _slice(value, start, stop, size)
        return sliced
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        if not _tensors(batch) and len(batch) == size:
            return batch[start:stop]  # one entry per sample, e.g. document ids
        items = [_slice(v, start, stop, size) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def split_microbatches(batch: Any, micro_batch_size: int) -> list[Any]:
    """Views of ``batch`` in consecutive slices of ``micro_batch_size`` samples (no copies)."""
    size = batch_size_of(batch)
    if size % micro_batch_size:
        raise MegatronConfigError(
            f"The batch on this data-parallel rank has {size} samples, which is not a multiple of "
            f"micro_batch_size={micro_batch_size}. One batch is one optimizer step: make the DataLoader's "
            "batch size (global batch size / data-parallel size) a multiple of `micro_batch_size`, and use "
            "drop_last=True so the last batch is not smaller."
        )
    return [_slice(batch, i, i + micro_batch_size, size) for i in range(0, size, micro_batch_size)]


def infer_seq_length(microbatch: Any) -> int:
    """Sequence length for the schedule's activation shape: dim 1 of ``tokens``, else of the first 2-D tensor."""
    if isinstance(microbatch, Mapping) and isinstance(microbatch.get("tokens"), torch.Tensor):
        return int(microbatch["tokens"].shape[1])
    for t in _tensors(microbatch):
        if t.dim() >= 2:
            return int(t.shape[1])
    raise MegatronConfigError(
        "Could not infer the sequence length of a microbatch (it has no 2-D tensor). Define "
        "`microbatch_seq_length(microbatch)` on the LightningModule."
    )


def context_parallel_share(microbatch: Any, seq_length: int, size: int, rank: int) -> Any:
    """This context-parallel rank's tokens of ``microbatch``: every tensor whose dim 1 is the sequence (``tokens``,
    ``labels``, ``loss_mask``, ``position_ids``, ...) keeps the rank's two chunks (``context.split``); others stay.

    ``position_ids`` are added (``0 .. seq-1``) where the microbatch has ``tokens`` and none, so a learned position
    embedding sees global positions; RoPE needs nothing: megatron-core's rotary embedding picks the same chunks of
    its table for this rank.
    """
    if not isinstance(microbatch, Mapping):
        raise MegatronConfigError(
            "context_parallel_size > 1 splits each microbatch along the sequence and needs dict batches "
            f"(``tokens``, ``labels``, ``loss_mask``, ``position_ids``); got {type(microbatch).__name__}."
        )
    tokens = microbatch.get("tokens")
    if isinstance(tokens, torch.Tensor) and "position_ids" not in microbatch:
        microbatch = {**microbatch, "position_ids": torch.arange(seq_length, device=tokens.device).expand_as(tokens)}
    share = copy.copy(microbatch)
    for key, value in microbatch.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_length:
            share[key] = split_sequence(value, 1, size, rank)
    return share
