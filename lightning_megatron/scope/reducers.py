"""The fixed set of reductions a capture may apply, from Python or from a client's JSON.

Contract: a reducer turns one captured *logical* tensor (the layout-invariant, TransformerLens-ordered view,
``scope.layout``) into a smaller one, on the serving rank, after the shards were assembled, so a reduction
means the same thing at every parallel layout. Reducers are data, never code: ``Reducer.from_dict`` accepts
only the kinds below with typed, range-checked fields (MegatronApp evaluated a Python expression sent by the
browser). Every reducer keeps the number of dimensions (``keepdim``), so the position axis stays where it was
(``histogram`` is the exception: it returns ``[bins]`` counts and the bin edges).

==============  =============================================  ==========================================
kind            fields                                         result
==============  =============================================  ==========================================
``slice``       ``axis``, ``start``, ``stop``                  ``x[..., start:stop, ...]`` along ``axis``
``mean``        ``axis``                                       mean over ``axis`` (size 1)
``norm``        ``axis``                                       L2 norm over ``axis`` (size 1)
``absmax``      ``axis``                                       largest magnitude over ``axis`` (size 1)
``downsample``  ``axis``, ``bins``                             mean-pool ``axis`` into ``bins`` (near-)equal bins
``histogram``   ``bins``                                       counts of all finite values; edges in extra
``topk``        ``k``, ``axis``, ``softmax`` (bool)            the k largest (probabilities if softmax);
                                                               their indices in extra
==============  =============================================  ==========================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F

from lightning_megatron.errors import MegatronConfigError

__all__ = ["Reduced", "Reducer", "apply_reducers", "parse_reducers"]

ReducerKind = Literal["slice", "mean", "norm", "absmax", "downsample", "histogram", "topk"]
_FIELDS: dict[str, tuple[str, ...]] = {
    "slice": ("axis", "start", "stop"),
    "mean": ("axis",),
    "norm": ("axis",),
    "absmax": ("axis",),
    "downsample": ("axis", "bins"),
    "histogram": ("bins",),
    "topk": ("k", "axis", "softmax"),
}
_MAX_BINS = 4096
_MAX_K = 1000


@dataclass(frozen=True)
class Reduced:
    tensor: torch.Tensor
    extra: Optional[torch.Tensor] = None
    """``topk``: the indices; ``histogram``: the ``bins + 1`` edges."""


@dataclass(frozen=True)
class Reducer:
    kind: ReducerKind
    axis: int = -1
    start: int = 0
    stop: Optional[int] = None
    bins: int = 64
    k: int = 10
    softmax: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _FIELDS:
            raise MegatronConfigError(f"reducer kind={self.kind!r} is not one of {sorted(_FIELDS)}.")
        if not 1 <= self.bins <= _MAX_BINS:
            raise MegatronConfigError(f"reducer bins={self.bins} must be in [1, {_MAX_BINS}].")
        if not 1 <= self.k <= _MAX_K:
            raise MegatronConfigError(f"reducer k={self.k} must be in [1, {_MAX_K}].")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Reducer:
        """A reducer from plain data (YAML, JSON); unknown kinds and fields are errors."""
        if not isinstance(spec, Mapping) or "kind" not in spec:
            raise MegatronConfigError(
                f"a reducer is a mapping with a 'kind' (one of {sorted(_FIELDS)}), got {spec!r:.80}."
            )
        kind = spec["kind"]
        if kind not in _FIELDS:
            raise MegatronConfigError(f"reducer kind={kind!r} is not one of {sorted(_FIELDS)}.")
        extra = sorted(set(spec) - {"kind", *_FIELDS[kind]})
        if extra:
            raise MegatronConfigError(f"reducer {kind!r} takes {list(_FIELDS[kind])}; unknown fields: {extra}.")
        values: dict[str, Any] = {}
        for name in _FIELDS[kind]:
            if name not in spec:
                continue
            value = spec[name]
            want = bool if name == "softmax" else int
            if name == "stop" and value is None:
                values[name] = None
                continue
            if type(value) is not want:  # noqa: E721  (bool is an int subclass: be exact)
                raise MegatronConfigError(
                    f"reducer {kind!r} field {name!r} must be {want.__name__}, got {value!r:.40}."
                )
            values[name] = value
        return cls(kind=kind, **values)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"kind": self.kind, **{name: data[name] for name in _FIELDS[self.kind]}}

    # -- the reductions ---------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor) -> Reduced:
        if self.kind == "histogram":
            return _histogram(x, self.bins)
        axis = _checked_axis(self.axis, x.dim(), self.kind)
        if self.kind == "slice":
            size = x.shape[axis]
            start, stop = slice(self.start, self.stop).indices(size)[:2]
            return Reduced(x.narrow(axis, start, max(0, stop - start)))
        values = x.float()
        if self.kind == "mean":
            return Reduced(values.mean(dim=axis, keepdim=True))
        if self.kind == "norm":
            return Reduced(values.norm(dim=axis, keepdim=True))
        if self.kind == "absmax":
            return Reduced(values.abs().amax(dim=axis, keepdim=True))
        if self.kind == "downsample":
            return Reduced(_downsample(values, axis, self.bins))
        # topk
        if self.softmax:
            values = values.softmax(dim=axis)
        top = values.topk(min(self.k, values.shape[axis]), dim=axis)
        return Reduced(top.values, top.indices)


def _checked_axis(axis: int, ndim: int, kind: str) -> int:
    if not -ndim <= axis < ndim:
        raise MegatronConfigError(f"reducer {kind!r}: axis={axis} is out of range for a {ndim}-d tensor.")
    return axis % ndim


def _downsample(x: torch.Tensor, axis: int, bins: int) -> torch.Tensor:
    """Mean-pool ``axis`` into ``bins`` bins of (nearly) equal width: bin i averages the entries
    ``floor(i·n/bins) .. ceil((i+1)·n/bins) - 1``, so no bin is empty whatever ``n`` is (96 into 64 bins too)."""
    axis = axis % x.dim()
    size = x.shape[axis]
    if size <= bins:
        return x
    if size % bins == 0:  # the common case (hidden sizes are multiples of the bins): one reshape and mean
        return x.unflatten(axis, (bins, size // bins)).mean(dim=axis + 1)
    moved = x.movedim(axis, -1)
    pooled = F.adaptive_avg_pool1d(moved.reshape(-1, 1, size), bins).reshape(*moved.shape[:-1], bins)
    return pooled.movedim(-1, axis)


def _histogram(x: torch.Tensor, bins: int) -> Reduced:
    values = x.detach().float().flatten()
    values = values[torch.isfinite(values)].cpu()
    if values.numel() == 0:
        return Reduced(torch.zeros(bins), torch.zeros(bins + 1))
    low, high = float(values.min()), float(values.max())
    if low == high:
        low, high = low - 0.5, high + 0.5
    counts, edges = torch.histogram(values, bins=bins, range=(low, high))
    return Reduced(counts, edges)


def parse_reducers(specs: Optional[Sequence[Any]]) -> tuple[Reducer, ...]:
    """``Reducer`` objects or plain mappings -> a tuple of reducers (at most 4 in a chain)."""
    if not specs:
        return ()
    if len(specs) > 4:
        raise MegatronConfigError(f"at most 4 reducers may be chained, got {len(specs)}.")
    return tuple(spec if isinstance(spec, Reducer) else Reducer.from_dict(spec) for spec in specs)


def apply_reducers(x: torch.Tensor, reducers: Sequence[Reducer]) -> Reduced:
    """Apply a chain; an ``extra`` (indices, edges) comes from the last reducer that produced one."""
    result = Reduced(x)
    for reducer in reducers:
        step = reducer(result.tensor)
        if result.extra is not None and step.extra is None and reducer.kind == "slice":
            # slicing topk values slices their indices too
            extra = reducer(result.extra).tensor
            result = Reduced(step.tensor, extra)
        else:
            result = Reduced(step.tensor, step.extra if step.extra is not None else None)
    return result
