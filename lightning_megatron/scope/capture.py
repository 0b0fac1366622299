"""``capture``: record probe points of a (parallel) megatron-core model as layout-invariant tensors.

Contract::

    with capture(module, ["blocks.*.hook_resid_post", "hook_logits"], reducers={"hook_logits": [topk]}) as cache:
        ...  # any forwards: generation, training steps, a validation pass
    cache["blocks.3.hook_resid_post"]  # [batch, pos, hidden], the same at every TP/PP/VPP/SP layout

* Collective: every rank enters and leaves the context (and calls ``flush``) together; the results are on
  the serving rank (global rank 0 by default), where ``cache.records`` holds them. Other ranks get an empty
  cache.
* At hook time a rank only copies its shard (pipeline outputs are deallocated after they are sent, so
  later is too late). ``flush()`` (called on exit; generation calls it after every token, the training
  callback after every sampled step) moves the shards to the serving rank over MegaScope's private gloo
  group, assembles each tensor from its TP shards (``scope.layout``), reorders it as TransformerLens does and
  applies the reducers there, so a reduction means the same at every layout.
* Only data-parallel rank 0 records (replicas hold the same activations for other data). Forwards that run
  during the backward (activation recomputation) are not recorded twice.
* ``heads`` limits ``hook_pattern`` to those heads (under ``layer_spec="sdpa"`` only they are recomputed).
* Context parallelism (CP > 1): each context-parallel rank records its share of the sequence (two load-balanced
  chunks); the serving rank assembles each share over TP and then the shares into the whole sequence, so a capture
  equals CP1's. ``hook_pattern`` cannot be recorded there: under ring attention no rank ever holds more than one
  block of the ``[q, k]`` matrix, and rebuilding it would gather every rank's keys. A request that matched other
  points too drops the patterns with a warning; one for patterns alone is refused (``MegatronConfigError`` on
  ``attach``).
  Forwards that run whole sequences on every context-parallel rank (generation, ``context.whole_sequences``; pass
  ``whole_sequences=True``, which also allows ``hook_pattern``) are recorded by context-parallel rank 0 alone.
* Zero cost when off: hooks exist only inside the context.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope import collect
from lightning_megatron.scope.layout import ShardLayout
from lightning_megatron.scope.reducers import Reduced, Reducer, apply_reducers, parse_reducers
from lightning_megatron.scope.sites import (
    SITE_GROUPS,
    ProbePoint,
    chunks_of,
    match_points,
    point_names_of,
    probe_points,
    vocab_size_of,
)
from lightning_megatron.scope.tap import Tap, strategy_of

__all__ = ["Capture", "Record", "ScopeCache", "capture"]

NamesFilter = Union[str, Sequence[str], Callable[[str], bool], None]


@dataclass(frozen=True, kw_only=True)
class Record:
    """One captured tensor: a probe point in one forward of one microbatch (or one weight)."""

    name: str
    layer: Optional[int]
    step: int
    microbatch: int
    start: int
    """First absolute position covered (the query positions of ``hook_pattern``)."""
    end: int
    tensor: torch.Tensor
    extra: Optional[torch.Tensor] = None
    """``topk`` indices or ``histogram`` edges."""
    pos_axis: Optional[int] = 1


@dataclass(kw_only=True)
class _Shard:
    name: str
    layer: Optional[int]
    step: int
    microbatch: int
    call: int
    tp_rank: int
    cp_rank: int
    start: int
    end: int
    tensor: Optional[torch.Tensor]
    layout: ShardLayout
    half: Optional[int]
    reduced: bool = False
    """The reducers already ran on this shard, on its device (``_reducible_on_shard``)."""
    extra: Optional[torch.Tensor] = None


class ScopeCache(Mapping[str, torch.Tensor]):
    """Captured records on the serving rank; ``cache[name]`` joins a name's records into one tensor.

    Records of one microbatch are joined along the position axis (a later record of the same positions
    replaces the earlier one), microbatches along the batch axis. That is exactly the tensor a single
    forward over the whole sequence would give, when reducers kept the position axis; otherwise use
    ``records_of(name)``.
    """

    def __init__(self, is_server: bool) -> None:
        self.is_server = is_server
        self.records: list[Record] = []

    def records_of(self, name: str) -> list[Record]:
        return [r for r in self.records if r.name == name]

    def names(self) -> list[str]:
        return list(dict.fromkeys(r.name for r in self.records))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __getitem__(self, name: str) -> torch.Tensor:
        records = self.records_of(name)
        if not records:
            raise KeyError(f"{name!r} was not captured (captured: {self.names()[:8]}{'...' if len(self) > 8 else ''})")
        if len(records) == 1:
            return records[0].tensor
        by_microbatch: dict[tuple[int, int], list[Record]] = defaultdict(list)
        for record in records:
            by_microbatch[(record.step, record.microbatch)].append(record)
        return torch.cat([_join_positions(name, group) for _, group in sorted(by_microbatch.items())], dim=0)

    def clear(self) -> None:
        self.records.clear()

    def save(self, path: Union[str, Path]) -> Path:
        """Write the cache: ``.safetensors`` (joined tensors by name) or ``.pt`` (every record with metadata)."""
        path = Path(path)
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            tensors = {}
            for name in self.names():
                try:
                    tensors[name] = self[name].contiguous()
                except MegatronConfigError:
                    for i, record in enumerate(self.records_of(name)):
                        tensors[f"{name}/{i}"] = record.tensor.contiguous()
            save_file(tensors, str(path), metadata={"format": "lightning-megatron.megascope", "version": "1"})
        elif path.suffix == ".pt":
            torch.save([dataclasses.asdict(r) for r in self.records], path)
        else:
            raise MegatronConfigError(f"ScopeCache.save({str(path)!r}): use a .safetensors or .pt file name.")
        return path


def _join_positions(name: str, records: list[Record]) -> torch.Tensor:
    axis = records[0].pos_axis
    if axis is None or any(r.tensor.shape[axis] != r.end - r.start for r in records):
        raise MegatronConfigError(
            f"{name!r}: its records cannot be joined by position (a reducer changed the position axis); "
            "read cache.records_of(name) instead."
        )
    end = max(r.end for r in records)
    first = records[0].tensor
    shape = list(first.shape)
    shape[axis] = end - min(r.start for r in records)
    if name.endswith("hook_pattern"):
        shape[-1] = end  # key axis grows with the positions
    out = torch.zeros(shape, dtype=first.dtype)
    base = min(r.start for r in records)
    for record in records:
        target = out.narrow(axis, record.start - base, record.end - record.start)
        if name.endswith("hook_pattern"):
            target = target.narrow(-1, 0, record.tensor.shape[-1])
        target.copy_(record.tensor)
    return out


class Capture:
    """The object behind ``capture(...)``; ``flush()`` may be called (collectively) inside the context."""

    def __init__(
        self,
        model: Any,
        names_filter: NamesFilter = None,
        reducers: Optional[Mapping[str, Sequence[Any]]] = None,
        *,
        heads: Optional[Sequence[int]] = None,
        serving_rank: int = 0,
        to_cpu: bool = True,
        whole_sequences: bool = False,
    ) -> None:
        self.chunks = chunks_of(model)
        self.tap = Tap.of(self.chunks, strategy_of(model))
        points = [p for p in probe_points(self.chunks, vocab_size_of(model)) if p.capturable]
        _check_names(names_filter, self.chunks[0].config)
        self.points = _filtered(points, names_filter)
        self.reducers = {pattern: parse_reducers(chain) for pattern, chain in (reducers or {}).items()}
        self.heads = _checked_heads(heads, self.chunks[0].config.num_attention_heads)
        self.serving_rank = serving_rank
        self.to_cpu = to_cpu
        self.whole_sequences = whole_sequences
        """The forwards run whole sequences on every context-parallel rank (generation): ``hook_pattern`` is allowed."""
        self.cache = ScopeCache(is_server=collect.rank() == serving_rank)
        self._shards: list[_Shard] = []
        self._calls: dict[tuple[str, int, int], int] = defaultdict(int)
        self._handles: list[Any] = []

    # -- hooks ---------------------------------------------------------------------------------------------
    def attach(self) -> None:
        collect.scope_group()  # collective on first use: create it while every rank is here
        self.tap.acquire()
        try:
            self._check_context_parallel()
        except MegatronConfigError:
            self.tap.release()
            raise
        if self.tap.facts.dp_rank != 0:
            return  # data-parallel replicas: same model, other data; rank 0 of each stage speaks for them
        for point in self.points:
            hook = self._hook(point)
            if point.when == "pre":
                self._handles.append(point.module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                self._handles.append(point.module.register_forward_hook(hook, with_kwargs=True))

    def _check_context_parallel(self) -> None:
        """At CP > 1, drop the ``hook_pattern`` points a broader request matched (``"*"``, ``"blocks.0.attn.*"``)
        with a warning, so a capture of "everything" works at any layout; refuse, on every rank at the same call
        and before any hook, a request for nothing but patterns: it would record nothing."""
        if self.tap.facts.cp_size == 1 or self.whole_sequences:
            return
        refused = [p.name for p in self.points if p.name.endswith("hook_pattern")]
        if not refused:
            return
        why = f"under ring attention at context_parallel_size={self.tap.facts.cp_size} no rank holds the [q, k] matrix"
        if len(refused) == len(self.points):
            raise MegatronConfigError(
                f"capture: {refused[0]!r} (attention probabilities) cannot be captured: {why}. Leave the "
                "'attn.hook_pattern' points out of the names (e.g. capture 'attn.hook_q' and 'attn.hook_k' and "
                "compute it), or probe the checkpoint at context_parallel_size=1."
            )
        self.points = [p for p in self.points if not p.name.endswith("hook_pattern")]
        if collect.rank() == self.serving_rank:
            shown = ", ".join(refused[:3]) + (f" and {len(refused) - 3} more" if len(refused) > 3 else "")
            warnings.warn(f"capture: not capturing {shown} (attention probabilities): {why}.", stacklevel=3)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.tap.release()

    def _local_heads(self, local_count: int) -> Optional[list[int]]:
        if self.heads is None:
            return None
        first = self.tap.facts.tp_rank * local_count
        return [h - first for h in self.heads if first <= h < first + local_count]

    def _hook(self, point: ProbePoint) -> Callable[..., None]:
        state = self.tap.state
        pattern = point.name.endswith("hook_pattern")
        per_rank_heads = (point.num_heads or 0) // max(self.tap.facts.tp_size, 1)

        def read(args: tuple, kwargs: dict, output: Any) -> None:
            if state.phase == "backward":
                return  # activation recomputation: already recorded in the forward
            if self.tap.redundant:
                return  # a whole sequence that context-parallel rank 0 records too
            if pattern and state.cp_size > 1:
                raise MegatronConfigError(
                    f"capture: {point.name!r} cannot be captured in a forward split over {state.cp_size} "
                    "context-parallel ranks (ring attention); capture it in generation or at context_parallel_size=1."
                )
            if not pattern:
                self._keep(point, point.read(args, kwargs, output))
                return
            heads = self._local_heads(per_rank_heads)
            if heads == []:
                self._keep(point, None)
            elif point.extras.get("selects_heads"):
                self._keep(point, point.read(args, kwargs, output, heads=heads))
            else:
                tensor = point.read(args, kwargs, output)
                self._keep(point, tensor if heads is None else tensor[:, heads])

        if point.when == "pre":
            return lambda module, args, kwargs: read(args, kwargs, None)
        return lambda module, args, kwargs, output: read(args, kwargs, output)

    def _keep(self, point: ProbePoint, tensor: Optional[torch.Tensor]) -> None:
        state, facts = self.tap.state, self.tap.facts
        layout = point.layout
        chain = self._reducers_for(point.name)
        reduced, extra = False, None
        if tensor is not None:
            extent = tensor.shape[layout.seq_dim] if layout.seq_dim is not None else 0
            start, end = self.tap.positions_for_seq(extent, layout.sequence_parallel_split)
            if chain and _reducible_on_shard(point, chain, tensor.dim(), facts.tp_size):
                # reduce where the data is: a training step's activations shrink before they leave the GPU
                result = apply_reducers(tensor.detach(), chain)
                copy, extra, reduced = result.tensor, result.extra, True
            else:
                # a copy on the tensor's device (no host sync here); ``flush`` moves them to the host in one copy
                copy = tensor.detach().clone()
        else:  # this rank holds none of the requested heads
            start = end = -1
            copy = None
        key = (point.name, state.step, state.microbatch)
        call = self._calls[key]
        self._calls[key] += 1
        self._shards.append(
            _Shard(
                name=point.name,
                layer=point.layer,
                step=state.step,
                microbatch=state.microbatch,
                call=call,
                tp_rank=facts.tp_rank,
                cp_rank=facts.cp_rank if state.cp_size > 1 else 0,
                start=start,
                end=end,
                tensor=copy,
                layout=point.layout,
                half=point.half,
                reduced=reduced,
                extra=extra,
            )
        )

    # -- to the serving rank ---------------------------------------------------------------------------------
    def flush(self) -> list[Record]:
        """Collective: bring every rank's shards to the serving rank; returns the new records there."""
        shards, self._shards = self._shards, []
        if self.to_cpu:
            _to_host([s for s in shards if s.tensor is not None])
        gathered = collect.gather_to(self.serving_rank, shards)
        if gathered is None:
            return []
        groups: dict[tuple[str, int, int, int], list[_Shard]] = defaultdict(list)
        for rank_shards in gathered:
            for shard in rank_shards:
                groups[(shard.name, shard.step, shard.microbatch, shard.call)].append(shard)
        records = [self._assemble(parts) for _, parts in sorted(groups.items(), key=_forward_order)]
        self.cache.records.extend(records)
        return records

    def _assemble(self, parts: list[_Shard]) -> Record:
        facts = self.tap.facts
        first = parts[0]  # the points of other pipeline stages exist only there: their shards say how to join
        layout = first.layout
        parts = sorted(parts, key=lambda s: (s.cp_rank, s.tp_rank))
        present = [p for p in parts if p.tensor is not None]
        start = min(p.start for p in present)
        end = max(p.end for p in present)
        shares = sorted({p.cp_rank for p in present})

        def whole(values: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
            """Over TP within each context-parallel share, then the shares along the sequence."""
            joined = [layout.assemble([v for r, v in values if r == cp], facts.sequence_parallel) for cp in shares]
            return layout.join_context(joined)

        full = whole([(p.cp_rank, p.tensor) for p in present])  # type: ignore[misc]
        if first.half is not None:
            full = full.chunk(2, dim=layout.tp_dim)[first.half]
        logical = layout.logical(full)
        if first.reduced:
            extra = None
            if present[0].extra is not None:
                extra = layout.logical(whole([(p.cp_rank, p.extra) for p in present]))  # type: ignore[misc]
            reduced = Reduced(logical, extra)
        else:
            reduced = apply_reducers(logical, self._reducers_for(first.name))
        return Record(
            name=first.name,
            layer=first.layer,
            step=first.step,
            microbatch=first.microbatch,
            start=start,
            end=end,
            tensor=reduced.tensor,
            extra=reduced.extra,
            pos_axis=layout.logical_pos_axis,
        )

    def _reducers_for(self, name: str) -> Sequence[Reducer]:
        for pattern, chain in self.reducers.items():
            if fnmatch.fnmatchcase(name, pattern):
                return chain
        return ()


def _reducible_on_shard(point: ProbePoint, chain: Sequence[Reducer], ndim: int, tp_size: int) -> bool:
    """Whether the reducers give the same result on each rank's shard as on the assembled tensor: they act along
    the last axis only (per position, per head), that axis is whole on every rank, and the logical view keeps
    it last and unchanged (no head split, vocabulary trim or SwiGLU half)."""
    layout = point.layout
    if layout.heads is not None or layout.trim_last is not None or point.half is not None:
        return False
    if tp_size > 1 and layout.tp_dim is not None and layout.tp_dim % ndim == ndim - 1:
        return False
    return all(r.kind != "histogram" and r.axis % ndim == ndim - 1 for r in chain)


def _to_host(shards: list[_Shard]) -> None:
    """Move the shards' tensors to the host with one device-to-host copy per dtype (one wait for the GPU per
    flush, instead of one per probe: each wait would stall the launch pipeline of a decoding model)."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[_Shard]] = defaultdict(list)
    for shard in shards:
        by_dtype[(shard.tensor.dtype, shard.tensor.device)].append(shard)  # type: ignore[union-attr]
    for (_, device), group in by_dtype.items():
        if device.type == "cpu":
            continue
        flat = torch.cat([shard.tensor.reshape(-1) for shard in group]).cpu()  # type: ignore[union-attr]
        for shard, part in zip(group, flat.split([shard.tensor.numel() for shard in group])):  # type: ignore[union-attr]
            shard.tensor = part.view(shard.tensor.shape)  # type: ignore[union-attr]
    for shard in shards:
        if shard.extra is not None and shard.extra.device.type != "cpu":
            shard.extra = shard.extra.cpu()


def _checked_heads(heads: Optional[Sequence[int]], num_heads: int) -> Optional[list[int]]:
    if heads is None:
        return None
    chosen = sorted({int(h) for h in heads})
    if not chosen or chosen[0] < 0 or chosen[-1] >= num_heads:
        raise MegatronConfigError(f"capture(heads={list(heads)!r}): heads are 0..{num_heads - 1} for this model.")
    return chosen


def _forward_order(item: tuple[tuple[str, int, int, int], list[_Shard]]) -> tuple:
    (name, step, microbatch, call), parts = item
    layer = parts[0].layer
    return (step, microbatch, call, -1 if name == "hook_embed" else (1 << 30 if layer is None else layer), name)


def _filtered(points: list[ProbePoint], names_filter: NamesFilter) -> list[ProbePoint]:
    if names_filter is None:
        return points
    if callable(names_filter):
        return [p for p in points if names_filter(p.name)]
    patterns = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    return match_points(points, patterns, what="capture")


def _check_names(names_filter: NamesFilter, config: Any) -> None:
    """A name or glob that matches no point of the whole model is a typo: say so, rather than capture nothing
    (this rank holds only its pipeline stage's points, so the check is against the model's full list)."""
    if names_filter is None or callable(names_filter):
        return
    names = point_names_of(config)
    patterns = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    for pattern in patterns:
        if isinstance(pattern, str) and pattern not in SITE_GROUPS:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                raise MegatronConfigError(
                    f"capture: {pattern!r} matches no probe point of this model; names look like "
                    "'blocks.3.hook_resid_post', 'blocks.*.attn.hook_pattern' or 'hook_logits' (see scope.sites)."
                )


@contextmanager
def capture(
    model: Any,
    names_filter: NamesFilter = None,
    reducers: Optional[Mapping[str, Sequence[Any]]] = None,
    *,
    heads: Optional[Sequence[int]] = None,
    serving_rank: int = 0,
    whole_sequences: bool = False,
) -> Iterator[ScopeCache]:
    """Record the probe points matching ``names_filter`` (names, globs, or a predicate) while inside.

    ``reducers`` maps name globs to reducer chains (``scope.reducers``: ``Reducer`` objects or mappings
    such as ``{"kind": "topk", "k": 20, "softmax": True}``). ``whole_sequences``: the forwards inside run whole
    sequences on every context-parallel rank (generation). See the module docstring for the rules.
    """
    session = Capture(
        model, names_filter, reducers, heads=heads, serving_rank=serving_rank, whole_sequences=whole_sequences
    )
    session.attach()
    try:
        yield session.cache
    finally:
        session.detach()
    session.flush()
