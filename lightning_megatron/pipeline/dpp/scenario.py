"""What the MegaDPP simulator simulates: a :class:`Scenario` (layout, compute times, link delays, memory, seed).

Every field has a YAML/CLI-friendly type and is validated when the scenario is made, naming the field and the
fix, so ``lightning-megatron dpp simulate --config scenario.yaml`` fails before it simulates anything.
``_plan``/``_link_counts`` are the layout's plans and per-link message counts, shared (cached) by every run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional, Union

import numpy as np

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.dpp.plan import FORWARD, StagePlan

__all__ = ["DELAY_KINDS", "DelayModel", "Scenario"]

DELAY_KINDS = ("none", "constant", "exponential", "uniform", "spike")

DelayModel = Callable[[int, int, int], float]
"""``delay(src, dst, n) -> seconds``: the extra delay of the ``n``-th message (from 0) sent on link ``src → dst``."""


# -- the scenario ------------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Scenario:
    """One pipeline step to simulate. Every field has a YAML/CLI-friendly type; all are validated on creation.

    Times are in seconds of one *chunk task* (one model chunk on one microbatch); only their ratios matter, so
    ``forward_s=1`` (and every other time in forward-times) is a fine unit.
    """

    pipeline: int = 2
    """Pipeline ranks P."""
    chunks: int = 1
    """Model chunks (virtual stages) per rank; 1 is plain 1F1B, more is megatron-core's interleaved schedule."""
    microbatches: int = 8
    """Microbatches per step; with ``chunks > 1`` a multiple of ``pipeline`` (megatron-core's rule)."""
    forward_s: Union[float, tuple[float, ...]] = 1.0
    """Compute time of one forward chunk task: one number, or one per pipeline rank."""
    backward_s: Union[float, tuple[float, ...]] = 2.0
    """Compute time of one backward chunk task: one number, or one per pipeline rank."""
    slow_ranks: Optional[dict[int, float]] = None
    """``{rank: factor}``: a persistently slower (factor > 1) rank, forward and backward."""
    compute_jitter: float = 0.0
    """Coefficient of variation of every compute time (log-normal, mean preserved), drawn per (rank, task)."""
    transfer_s: float = 0.0
    """Base time of one activation or gradient transfer (every link)."""
    delay_kind: str = "none"
    """Extra link delay per message: ``none``; ``constant`` (``delay_mean_s``); ``exponential`` (mean
    ``delay_mean_s``); ``uniform`` (on [0, 2·``delay_mean_s``]); ``spike`` (``delay_mean_s`` for a fraction
    ``delay_probability`` of the messages, 0 for the others)."""
    delay_mean_s: float = 0.0
    """The delay model's mean (for ``spike``: the size of one spike)."""
    delay_probability: float = 0.1
    """``spike`` only: the fraction of messages delayed."""
    delay_links: Optional[tuple[tuple[int, int], ...]] = None
    """``(src, dst)`` pipeline-rank links the delays apply to; None: every link."""
    delay: Optional[DelayModel] = field(default=None, compare=False)
    """Your own delay model instead of ``delay_kind``: ``delay(src, dst, n) -> seconds`` (see :data:`DelayModel`);
    ``delay_links`` still selects the links it applies to. Its randomness is its own (``seed`` then drives only
    the compute jitter). The transport's spec plugs in as
    ``functools.partial(lightning_megatron.transport.delay.delay_for, LinkDelay(...))``."""
    extra_activations: int = 0
    """Activations a rank may hold beyond megatron-core's own peak (the memory rule's slack)."""
    grace_fraction: float = 0.1
    """The adaptive policy's grace time, as a fraction of the measured forward time."""
    seed: int = 0
    """Seed of the compute-jitter and link-delay draws (the same draws for every policy)."""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> MegatronConfigError:
            return MegatronConfigError(f"Scenario({name}={getattr(self, name)!r}): {why}")

        for name in ("pipeline", "chunks", "microbatches"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "must be an integer >= 1.")
        P, M = int(self.pipeline), int(self.microbatches)
        if self.chunks > 1 and (M < P or M % P):
            lower, upper = max(P, M - M % P), max(P, M - M % P + (P if M % P else 0))
            raise bad(
                "microbatches",
                f"megatron-core's interleaved order (chunks={self.chunks} > 1) needs a multiple of "
                f"pipeline={P} microbatches, at least {P}: use {lower}" + (f" or {upper}." if upper != lower else "."),
            )
        for name in ("forward_s", "backward_s"):
            value = getattr(self, name)
            if _is_number(value):
                values: tuple[float, ...] = (float(value),)
            elif isinstance(value, (list, tuple)) and len(value) == P and all(_is_number(v) for v in value):
                values = tuple(float(v) for v in value)
            else:
                raise bad(name, f"give one time in seconds, or a list of {P} (one per pipeline rank).")
            if not all(math.isfinite(v) and v > 0 for v in values):
                raise bad(name, "compute times must be finite and > 0 seconds.")
            object.__setattr__(self, name, values[0] if len(values) == 1 and _is_number(value) else values)
        if self.slow_ranks is not None:
            if not isinstance(self.slow_ranks, Mapping):
                raise bad("slow_ranks", "give a mapping {rank: factor}, e.g. {1: 1.2} for a rank 20% slower.")
            slow: dict[int, float] = {}
            for rank, factor in self.slow_ranks.items():
                try:
                    rank_i = int(rank)  # YAML and JSON keys may be strings
                except (TypeError, ValueError):
                    raise bad("slow_ranks", f"key {rank!r} is not a pipeline rank.") from None
                if not 0 <= rank_i < P:
                    raise bad("slow_ranks", f"rank {rank_i} is outside the pipeline's ranks 0..{P - 1}.")
                if not _is_number(factor) or not (math.isfinite(factor) and factor > 0):
                    raise bad("slow_ranks", f"the factor of rank {rank_i} must be a number > 0 (1.2: 20% slower).")
                slow[rank_i] = float(factor)
            object.__setattr__(self, "slow_ranks", slow)
        for name in ("compute_jitter", "transfer_s", "delay_mean_s", "grace_fraction"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise bad(name, "must be a finite number >= 0.")
            object.__setattr__(self, name, float(value))
        if self.delay_kind not in DELAY_KINDS:
            raise bad("delay_kind", f"choose one of {', '.join(DELAY_KINDS)}.")
        if self.delay_kind == "none" and self.delay_mean_s > 0:
            raise bad("delay_mean_s", "has no effect with delay_kind='none': set delay_kind (e.g. 'exponential').")
        if self.delay_kind != "none" and self.delay_mean_s == 0:
            raise bad("delay_mean_s", f"delay_kind={self.delay_kind!r} needs a delay_mean_s > 0 (seconds).")
        p = self.delay_probability
        if not _is_number(p) or not 0 <= p <= 1:
            raise bad("delay_probability", "must be a fraction in [0, 1] (spike delays only).")
        object.__setattr__(self, "delay_probability", float(p))
        if self.delay is not None:
            if not callable(self.delay):
                raise bad("delay", "must be a callable delay(src, dst, n) -> seconds, or None.")
            if self.delay_kind != "none":
                raise bad("delay", f"give either delay= or delay_kind={self.delay_kind!r}, not both.")
        if self.delay_links is not None:
            links: list[tuple[int, int]] = []
            carried = _links(P, int(self.chunks), M)
            for link in self.delay_links:
                if not (isinstance(link, (list, tuple)) and len(link) == 2 and all(_is_int(r) for r in link)):
                    raise bad("delay_links", f"{link!r} is not a (src, dst) pair of pipeline ranks.")
                pair = (int(link[0]), int(link[1]))
                if pair not in carried:
                    raise bad(
                        "delay_links",
                        f"link {pair[0]}->{pair[1]} carries no pipeline messages in this layout; "
                        f"the links are {', '.join(f'{a}->{b}' for a, b in sorted(carried))}.",
                    )
                links.append(pair)
            object.__setattr__(self, "delay_links", tuple(links))
        if not _is_int(self.extra_activations) or self.extra_activations < 0:
            raise bad("extra_activations", "must be an integer >= 0 (activations beyond megatron-core's peak).")
        if not _is_int(self.seed) or self.seed < 0:
            raise bad("seed", "must be an integer >= 0.")

    # -- derived -------------------------------------------------------------------------------------------------

    def compute_s(self, rank: int, phase: str) -> float:
        """The mean compute time of one ``phase`` chunk task on ``rank`` (base time × slow-rank factor)."""
        base = self.forward_s if phase == FORWARD else self.backward_s
        base_s = base[rank] if isinstance(base, tuple) else base
        return base_s * (self.slow_ranks or {}).get(rank, 1.0)

    def replace(self, **changes: Any) -> Scenario:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> Scenario:
        """A scenario from a YAML/JSON mapping (field names as keys); unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(mapping) - names)
        if unknown:
            raise MegatronConfigError(
                f"Scenario: unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(names))}."
            )
        values = dict(mapping)
        for key in ("forward_s", "backward_s"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        if values.get("delay_links") is not None:
            values["delay_links"] = tuple(tuple(link) for link in values["delay_links"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON types (a custom ``delay`` callable is named, not serialised)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("forward_s", "backward_s"):
            if isinstance(out[key], tuple):
                out[key] = list(out[key])
        if out["delay_links"] is not None:
            out["delay_links"] = [list(link) for link in out["delay_links"]]
        if out["delay"] is not None:
            out["delay"] = getattr(out["delay"], "__qualname__", repr(out["delay"]))
        return out


@lru_cache(maxsize=256)
def _plan(pipeline: int, rank: int, chunks: int, microbatches: int) -> StagePlan:
    """StagePlans are immutable: one per layout, shared by every simulation (their cached orders too)."""
    return StagePlan(pipeline, rank, chunks, microbatches)


@lru_cache(maxsize=256)
def _link_counts(pipeline: int, chunks: int, microbatches: int) -> dict[tuple[int, int], int]:
    """How many messages each ``(src, dst)`` link carries in one step."""
    counts: dict[tuple[int, int], int] = {}
    for rank in range(pipeline):
        plan = _plan(pipeline, rank, chunks, microbatches)
        for task in plan.order:
            message = plan.output_of(task)
            if message is not None:
                link = (rank, plan.destination_rank(message))
                counts[link] = counts.get(link, 0) + 1
    return counts


def _links(pipeline: int, chunks: int, microbatches: int) -> set[tuple[int, int]]:
    return set(_link_counts(pipeline, chunks, microbatches))
