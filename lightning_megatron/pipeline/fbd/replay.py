"""Ship mode's two halves: record what a stage's backward needs, and rebuild its graph elsewhere without the GEMMs.

A backward needs the autograd graph of its forward and the tensors the graph saved. The graph cannot travel
between processes, but it is cheap to rebuild: replaying the stage's forward code rebuilds the same nodes, and
only their saved tensors are expensive. So:

* on the forward rank, :class:`Capture` (``saved_tensors_hooks``) lists every tensor autograd saves during the
  stage's forward, in order; :meth:`Capture.bundle` packs the ones that are not parameters into one byte buffer
  and a header (dtype, shape, offset; parameters by reference; the same tensor saved twice is shipped once);
* on the backward rank, :func:`replaying` runs the same forward with the GEMMs and attention kernels skipped
  (their outputs are left uninitialised: the values computed downstream of them are garbage, and nothing reads
  them), and its pack hook hands autograd the shipped tensor in the position of each saved one. The backward
  then computes exactly what the forward rank's graph would have.

Requirements this puts on the model: the forward's saves must not depend on activation values (true of dense
transformers; a router choosing experts from activations would break it), and custom autograd functions must
save tensors with ``save_for_backward`` (megatron-core's do), not stash them on ``ctx``. The replay checks every
saved tensor's shape against the header and fails naming the position if the two forwards diverged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["Bundle", "Capture", "ReplayMismatch", "replaying"]

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_LOCAL, _ALIAS = -1, -2  # header codes: a parameter of the receiving rank; the same tensor as an earlier entry
_ALIGN = 16

_aten = torch.ops.aten
_SKIPPED = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
"""The kernels a replay skips: the GEMMs and fused attention (the forward's cost); everything else runs."""


class ReplayMismatch(RuntimeError):
    """The backward rank's replay saved different tensors than the forward rank's forward did."""


@dataclass
class Bundle:
    """One stage's saved tensors for one microbatch: ``header`` (int64) and ``data`` (uint8), two messages."""

    header: torch.Tensor
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.header.numel() * 8


class Capture:
    """``with capture:`` around a stage's forward records what autograd saves; then :meth:`bundle` packs it."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._saved: list[Any] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _no_backward_here)

    def __enter__(self) -> Capture:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> int:
        # The graph keeps a position, not the tensor: once bundled, the activations are freed at once, even where
        # a custom autograd function's graph holds a reference cycle that only the garbage collector would break
        # (a graph that never runs its backward never releases its saved tensors otherwise).
        self._saved.append(None if _is_parameter(tensor, self._param_storages) else tensor)
        return len(self._saved) - 1

    def bundle(self, device: torch.device) -> Bundle:
        """The saved tensors as one byte buffer on ``device`` (one copy) and its header; forgets them."""
        header: list[int] = [len(self._saved)]
        seen: dict[tuple, int] = {}
        plan: list[tuple[torch.Tensor, int]] = []
        offset = 0
        for index, tensor in enumerate(self._saved):
            if tensor is None:
                header.append(_LOCAL)
                continue
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            if key in seen and tensor.data_ptr() != 0:
                header += [_ALIAS, seen[key]]
                continue
            seen[key] = index
            header += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape, offset]
            plan.append((tensor, offset))
            offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        data = torch.empty(offset, dtype=torch.uint8, device=device)
        for tensor, start in plan:
            size = tensor.numel() * tensor.element_size()
            if size:
                data[start : start + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self._saved = []
        return Bundle(torch.tensor(header, dtype=torch.int64), data)


def _no_backward_here(position: int) -> torch.Tensor:
    raise RuntimeError(
        "a backward ran through a forward captured for ship mode: the forward rank ships its saved tensors and "
        "runs no backward (this is a bug in the schedule)."
    )


def _is_parameter(tensor: torch.Tensor, storages: set[int]) -> bool:
    try:
        return tensor.untyped_storage().data_ptr() in storages
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return False


def _unbundle(bundle: Bundle) -> list[Any]:
    """Per saved position: ``None`` (a local parameter) or the shipped tensor (a view into ``bundle.data``)."""
    values = bundle.header.tolist()
    count, at = values[0], 1
    entries: list[Any] = []
    for _ in range(count):
        code = values[at]
        if code == _LOCAL:
            entries.append(None)
            at += 1
        elif code == _ALIAS:
            entries.append(entries[values[at + 1]])
            at += 2
        else:
            dtype, ndim = _DTYPES[code], values[at + 1]
            shape = values[at + 2 : at + 2 + ndim]
            start = values[at + 2 + ndim]
            size = dtype.itemsize * _numel(shape)
            entries.append(bundle.data[start : start + size].view(dtype).view(shape))
            at += 3 + ndim
    return entries


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _SkipHeavyKernels(TorchDispatchMode):
    """Runs every kernel except :data:`_SKIPPED`, whose outputs it allocates uninitialised (shapes from meta)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SKIPPED:
            return func(*args, **kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        return tree_map(lambda t: _empty_like_meta(t, device), meta)


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _empty_like_meta(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
    return value


@contextlib.contextmanager
def replaying(bundle: Bundle) -> Iterator[None]:
    """Within: a forward that saves tensors as the captured one did, rebuilt on the shipped tensors, no GEMMs."""
    entries = _unbundle(bundle)
    position = 0

    def pack(tensor: torch.Tensor) -> Any:
        nonlocal position
        if position >= len(entries):
            raise ReplayMismatch(
                f"the replay saved more tensors than the forward rank's forward ({len(entries)}): the two ran "
                "different code (a value-dependent branch, or different model settings on the two ranks)."
            )
        shipped = entries[position]
        position += 1
        if shipped is None:
            return tensor  # a parameter: this rank's own
        if tuple(shipped.shape) != tuple(tensor.shape) or shipped.dtype != tensor.dtype:
            raise ReplayMismatch(
                f"saved tensor {position - 1}: the forward rank saved {tuple(shipped.shape)} {shipped.dtype}, the "
                f"replay {tuple(tensor.shape)} {tensor.dtype}: the two forwards diverged."
            )
        return shipped

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _SkipHeavyKernels():
        yield
    if position != len(entries):
        raise ReplayMismatch(
            f"the replay saved {position} tensors, the forward rank's forward {len(entries)}: the two diverged."
        )
