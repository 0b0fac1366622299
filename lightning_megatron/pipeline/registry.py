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

A schedule with state that outlives a step (a transport, its threads) registers ``open_session``
instead of a plain callable: the strategy calls it once per fit (first step) with the parsed
``schedule_options`` and closes the session at teardown. ``parse_options`` turns the strategy's
``schedule_options`` dict into the schedule's typed settings when the strategy is *constructed*, so
a typo fails before any process starts. ``data_shard`` tells the strategy's sampler which shard a data-parallel
replica reads, for schedules whose replicas do different work (MegaFBD).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from lightning_megatron.errors import MegatronConfigError

__all__ = [
    "ForwardBackwardFunc",
    "MicrobatchCheck",
    "Schedule",
    "ScheduleContext",
    "ScheduleSession",
    "available_schedules",
    "get_schedule",
    "register_schedule",
]


class ForwardBackwardFunc(Protocol):
    def __call__(self, **kwargs) -> list: ...  # megatron-core's forward_backward_func contract


MicrobatchCheck = Callable[[int, int, Optional[int]], Optional[str]]
"""``(num_microbatches, pipeline_size, virtual_size) -> None`` if runnable, else the reason it is not."""


class ScheduleSession(Protocol):
    """A schedule's state for one fit: called like a ``ForwardBackwardFunc`` each step, closed at teardown."""

    def __call__(self, **kwargs) -> list: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ScheduleContext:
    """What the strategy tells a schedule session when it opens (after the process groups exist)."""

    options: Any
    """The schedule's parsed options (``parse_options``'s result), or the raw dict if it parses none."""
    device: Any
    """The rank's ``torch.device``."""
    timeout: float
    """Seconds a rank may wait for a peer before failing (the strategy's ``timeout``)."""


class _Stateless:
    """A plain ``ForwardBackwardFunc`` as a session with nothing to close."""

    def __init__(self, forward_backward: ForwardBackwardFunc) -> None:
        self._forward_backward = forward_backward

    def __call__(self, **kwargs) -> list:
        return self._forward_backward(**kwargs)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Schedule:
    name: str
    forward_backward: Optional[ForwardBackwardFunc]
    virtual_stages: Optional[bool]
    """True: needs several model chunks per rank (virtual stages); False: one chunk; None: either."""
    check_microbatches: Optional[MicrobatchCheck] = None
    description: str = ""
    open_session: Optional[Callable[[ScheduleContext], ScheduleSession]] = None
    parse_options: Optional[Callable[[Mapping[str, Any]], Any]] = None
    check_layout: Optional[Callable[[int, Optional[int]], Optional[str]]] = None
    """``(pipeline_size, virtual_size) -> None`` if the schedule runs that layout, else the reason it does not."""
    data_shard: Optional[Callable[[Any, int, int], tuple[int, int]]] = None
    """``(options, data_parallel_rank, data_parallel_size) -> (sampler rank, sampler replicas)``, for schedules
    in which not every data-parallel replica reads its own data (MegaFBD's forward replicas); default: the
    data-parallel rank and size."""

    def options(self, raw: Optional[Mapping[str, Any]]) -> Any:
        """The schedule's typed settings from the strategy's ``schedule_options`` (a clear error if wrong)."""
        if self.parse_options is not None:
            return self.parse_options(dict(raw or {}))
        if raw:
            raise MegatronConfigError(
                f"schedule={self.name!r} takes no schedule_options; got {sorted(raw)}. Remove `schedule_options`."
            )
        return None

    def open(self, context: ScheduleContext) -> ScheduleSession:
        if self.open_session is not None:
            return self.open_session(context)
        assert self.forward_backward is not None
        return _Stateless(self.forward_backward)

    def data_parallel_shard(self, options: Any, rank: int, size: int) -> tuple[int, int]:
        """Which shard of the data this data-parallel replica reads: ``(sampler rank, sampler replicas)``."""
        return (rank, size) if self.data_shard is None else self.data_shard(options, rank, size)

    def validate(self, *, pipeline: int, virtual: Optional[int]) -> None:
        if self.check_layout is not None:
            reason = self.check_layout(pipeline, virtual)
            if reason:
                raise MegatronConfigError(f"schedule={self.name!r}: {reason}.")
        if self.virtual_stages is None:
            return
        if self.virtual_stages and virtual is None:
            raise MegatronConfigError(
                f"schedule={self.name!r} interleaves virtual pipeline stages: set "
                "`virtual_pipeline_model_parallel_size` (e.g. 2), or pick a schedule without virtual stages "
                f"({', '.join(s for s in available_schedules() if _REGISTRY[s].virtual_stages is not True)})."
            )
        if not self.virtual_stages and virtual is not None:
            raise MegatronConfigError(
                f"schedule={self.name!r} runs one model chunk per rank, but "
                f"virtual_pipeline_model_parallel_size={virtual}. Use a schedule with virtual stages "
                f"({', '.join(s for s in available_schedules() if _REGISTRY[s].virtual_stages is not False)}) or unset "
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
    forward_backward: Optional[ForwardBackwardFunc] = None,
    *,
    virtual_stages: Optional[bool] = False,
    check_microbatches: Optional[MicrobatchCheck] = None,
    description: str = "",
    open_session: Optional[Callable[[ScheduleContext], ScheduleSession]] = None,
    parse_options: Optional[Callable[[Mapping[str, Any]], Any]] = None,
    check_layout: Optional[Callable[[int, Optional[int]], Optional[str]]] = None,
    data_shard: Optional[Callable[[Any, int, int], tuple[int, int]]] = None,
    override: bool = False,
) -> Schedule:
    """Add a schedule under ``name``; the strategy's ``schedule=`` argument selects it.

    Give either ``forward_backward`` (stateless) or ``open_session`` (state per fit). ``virtual_stages=None``
    runs with or without virtual pipeline stages."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"Schedule names are short identifiers like '1f1b'; got {name!r}.")
    if name in _REGISTRY and not override:
        raise ValueError(f"A schedule named {name!r} is already registered; pass override=True to replace it.")
    if (forward_backward is None) == (open_session is None):
        raise ValueError(f"schedule {name!r}: give exactly one of `forward_backward` and `open_session`.")
    entry = Schedule(
        name,
        forward_backward,
        virtual_stages,
        check_microbatches,
        description,
        open_session,
        parse_options,
        check_layout,
        data_shard,
    )
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
