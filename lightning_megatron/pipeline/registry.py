"""Pipeline schedules by name.

A schedule is any callable with megatron-core's ``forward_backward_func`` keyword signature::

    schedule(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
             micro_batch_size, decoder_seq_length=None, forward_only=False,
             collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
             **kwargs) -> list  # per-microbatch loss_fn outputs on the last stage, [] elsewhere

The strategy looks schedules up here and never imports one directly, so new schedules (MegaDPP,
MegaFBD, other transports) plug in with ``register_schedule`` and no change to the strategy.
Each entry also says whether it runs virtual pipeline stages and which microbatch counts it takes,
so a bad combination fails with a clear message on every rank before any send or receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

from lightning_megatron.errors import MegatronConfigError

__all__ = [
    "ForwardBackwardFunc",
    "MicrobatchCheck",
    "Schedule",
    "available_schedules",
    "get_schedule",
    "register_schedule",
]


class ForwardBackwardFunc(Protocol):
    def __call__(self, **kwargs) -> list: ...  # megatron-core's forward_backward_func contract


MicrobatchCheck = Callable[[int, int, Optional[int]], Optional[str]]
"""``(num_microbatches, pipeline_size, virtual_size) -> None`` if runnable, else the reason it is not."""


@dataclass(frozen=True)
class Schedule:
    name: str
    forward_backward: ForwardBackwardFunc
    virtual_stages: bool
    """True if the schedule runs several model chunks per rank (virtual pipeline stages)."""
    check_microbatches: Optional[MicrobatchCheck] = None
    description: str = ""

    def validate(self, *, pipeline: int, virtual: Optional[int]) -> None:
        if self.virtual_stages and virtual is None:
            raise MegatronConfigError(
                f"schedule={self.name!r} interleaves virtual pipeline stages: set "
                "`virtual_pipeline_model_parallel_size` (e.g. 2), or pick a schedule without virtual stages "
                f"({', '.join(s for s in available_schedules() if not _REGISTRY[s].virtual_stages)})."
            )
        if not self.virtual_stages and virtual is not None:
            raise MegatronConfigError(
                f"schedule={self.name!r} runs one model chunk per rank, but "
                f"virtual_pipeline_model_parallel_size={virtual}. Use a schedule with virtual stages "
                f"({', '.join(s for s in available_schedules() if _REGISTRY[s].virtual_stages)}) or unset "
                "the virtual size."
            )

    def validate_microbatches(self, num_microbatches: int, *, pipeline: int, virtual: Optional[int]) -> None:
        if num_microbatches < 1:
            raise MegatronConfigError("A step needs at least one microbatch; the batch on this rank is empty.")
        if self.check_microbatches is None:
            return
        reason = self.check_microbatches(num_microbatches, pipeline, virtual)
        if reason:
            raise MegatronConfigError(
                f"schedule={self.name!r} cannot run {num_microbatches} microbatches per step: {reason}. "
                "The number of microbatches is the batch size per data-parallel rank divided by "
                "`micro_batch_size`; change one of them."
            )


_REGISTRY: dict[str, Schedule] = {}


def register_schedule(
    name: str,
    forward_backward: ForwardBackwardFunc,
    *,
    virtual_stages: bool = False,
    check_microbatches: Optional[MicrobatchCheck] = None,
    description: str = "",
    override: bool = False,
) -> Schedule:
    """Add a schedule under ``name``; the strategy's ``schedule=`` argument selects it."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"Schedule names are short identifiers like '1f1b'; got {name!r}.")
    if name in _REGISTRY and not override:
        raise ValueError(f"A schedule named {name!r} is already registered; pass override=True to replace it.")
    entry = Schedule(name, forward_backward, virtual_stages, check_microbatches, description)
    _REGISTRY[name] = entry
    return entry


def get_schedule(name: str) -> Schedule:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise MegatronConfigError(
            f"Unknown pipeline schedule {name!r}. Registered schedules: {', '.join(available_schedules())}."
        ) from None


def available_schedules() -> list[str]:
    return sorted(_REGISTRY)
