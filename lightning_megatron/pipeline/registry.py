"""Pipeline schedules by name, and the contract a schedule implements.

A schedule is a :class:`Schedule`: a subclass names itself, says which layouts and microbatch counts it runs, parses
its ``schedule_options`` and, once per fit, opens a :class:`ScheduleSession` from a :class:`ScheduleContext`. The
session is called like megatron-core's ``forward_backward_func`` each step::

    session(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
            micro_batch_size, decoder_seq_length=None, forward_only=False,
            collect_non_loss_data=False, first_val_step=None, adjust_tensor_shapes_fn=None,
            **kwargs) -> list  # per-microbatch loss_fn outputs on the last stage, [] elsewhere

and closed at the fit's teardown. Every hook but :meth:`Schedule.open` has a documented default, so the smallest
schedule is a name and an ``open``; a stateless one is a plain function given to :func:`register_schedule`.

When the strategy calls what (the order a schedule can rely on):

1. strategy construction: :meth:`Schedule.parse_options` (the ``schedule_options`` dict, so a typo fails before any
   process starts) and :meth:`Schedule.check_layout` (pipeline and virtual sizes), on every rank;
2. data loading: :meth:`Schedule.data_shard` (which shard the data-parallel replica's sampler reads);
3. every step: :meth:`Schedule.check_microbatches`, then, on the first step, :meth:`Schedule.open` with the
   context (the process groups exist and the device is known), then the session;
4. teardown: ``session.close()``.

The context hands a session everything it needs from outside explicitly: its process groups
(:class:`ScheduleGroups`), a way to open and connect a transport (:meth:`ScheduleContext.open_transport`), and the
step's observers (:class:`StepEvents`: spans MegaScan draws, the messages a p2p span moves; report p2p operations
with :func:`lightning_megatron.pipeline.tracing.traced_p2p`). A schedule needs no ``parallel_state`` global.

The strategy looks schedules up here and never imports one directly, so new schedules plug in with
:func:`register_schedule` and no change to the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError

__all__ = [
    "NO_EVENTS",
    "ForwardBackwardFunc",
    "MicrobatchCheck",
    "Schedule",
    "ScheduleContext",
    "ScheduleGroups",
    "ScheduleSession",
    "StepEvents",
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


# -- what the context hands a session ---------------------------------------------------------------------------


class StepEvents(Protocol):
    """The step's observers (MegaScan's tracer, fault injectors), as a schedule reports to them.

    Spans carry megatron-core's timer names (``forward-send``, ``backward-recv``, ``weight-grad-compute``, ...), so a
    tracer draws a schedule's spans as it draws megatron-core's. Nothing is observed while :attr:`active` is False:
    a schedule may skip building what it would report."""

    @property
    def active(self) -> bool:
        """Whether anyone observes the step now (listeners come and go between steps)."""
        ...

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A span named ``name`` around the block."""
        ...

    def microbatch(self, phase: str, chunk: int, microbatch: int) -> None:
        """The open span's work belongs to this chunk's microbatch (``phase``: ``"forward"``, ``"weight-grad"``...)."""
        ...

    def messages(self, name: str, sends: list[dict[str, Any]], recvs: list[dict[str, Any]]) -> None:
        """The open p2p span ``name`` moves these messages (``{"peer", "bytes", "seq", "direction", ...}``)."""
        ...


class _NoEvents:
    """Nobody observes: every report is dropped."""

    active = False

    def span(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def microbatch(self, phase: str, chunk: int, microbatch: int) -> None:
        pass

    def messages(self, name: str, sends: list[dict[str, Any]], recvs: list[dict[str, Any]]) -> None:
        pass


NO_EVENTS: StepEvents = _NoEvents()


@dataclass(frozen=True)
class ScheduleGroups:
    """The rank's process groups, as megatron-core made them for the fit."""

    pipeline: Any
    """The pipeline-parallel group (``torch.distributed.ProcessGroup``): this rank's stages, in stage order."""
    tensor: Any
    """The tensor-parallel group."""
    data: Any
    """The data-parallel group (without context parallelism)."""
    context_parallel_size: int = 1

    @property
    def pipeline_ranks(self) -> list[int]:
        """Global ranks of the pipeline stages, stage 0 first."""
        return dist.get_process_group_ranks(self.pipeline)

    @property
    def pipeline_rank(self) -> int:
        return dist.get_rank(self.pipeline)

    @property
    def pipeline_size(self) -> int:
        return dist.get_world_size(self.pipeline)

    @property
    def tensor_ranks(self) -> list[int]:
        """Global ranks of the tensor-parallel peers, tensor rank 0 first."""
        return dist.get_process_group_ranks(self.tensor)

    @property
    def tensor_rank(self) -> int:
        return dist.get_rank(self.tensor)

    @property
    def tensor_size(self) -> int:
        return dist.get_world_size(self.tensor)

    @property
    def data_rank(self) -> int:
        return dist.get_rank(self.data)

    @property
    def data_size(self) -> int:
        return dist.get_world_size(self.data)


@dataclass(frozen=True)
class ScheduleContext:
    """What the strategy hands a schedule when it opens a session (after the process groups exist)."""

    options: Any
    """The schedule's parsed options (:meth:`Schedule.parse_options`'s result)."""
    device: Any
    """The rank's ``torch.device``."""
    timeout: float
    """Seconds a rank may wait for a peer before failing (the strategy's ``timeout``)."""
    groups: ScheduleGroups
    """The rank's pipeline, tensor- and data-parallel groups."""
    events: StepEvents = field(default=NO_EVENTS)
    """The step's observers (see :func:`lightning_megatron.pipeline.tracing.traced_p2p`)."""

    def open_transport(self, name: str, transport_options: Mapping[str, Any], peers: Iterable[int]) -> Any:
        """A tagged transport (``lightning_megatron.transport``) named ``name`` (``"auto"``: ``shm`` on one node,
        ``torch`` otherwise), connected to ``peers`` (global ranks, each of which opens its own with this rank
        among its peers), on this rank's device where the transport can move its tensors, with the strategy's
        timeout. The session closes it."""
        from lightning_megatron.pipeline.transports import open_transport

        return open_transport(name, transport_options, torch.device(self.device), self.timeout, peers)


# -- the contract -----------------------------------------------------------------------------------------------


class Schedule:
    """What a pipeline schedule provides; subclass it, set :attr:`name`, implement :meth:`open`.

    The hooks (override what differs from the default): :meth:`parse_options`, :meth:`check_layout`,
    :meth:`check_microbatches`, :meth:`data_shard`, :meth:`open`. The strategy calls the non-hook methods
    (:meth:`options`, :meth:`validate`, :meth:`validate_microbatches`, :meth:`data_parallel_shard`), which turn a
    hook's reason into the project's error; a subclass leaves those alone."""

    name: str = ""
    """The name the strategy's ``schedule=`` argument selects (a short identifier like ``"1f1b"``)."""
    description: str = ""
    """One line for listings (``available_schedules``, the CLI)."""
    virtual_stages: Optional[bool] = False
    """True: needs several model chunks per rank (virtual pipeline stages); False: one chunk; None: either.
    :meth:`check_layout`'s default checks it."""

    # -- hooks --------------------------------------------------------------------------------------------------

    def parse_options(self, raw: Mapping[str, Any]) -> Any:
        """The schedule's typed settings from the strategy's ``schedule_options`` (raise
        :class:`~lightning_megatron.errors.MegatronConfigError` naming the key when wrong). Default: the schedule
        takes none, and any given is an error."""
        if raw:
            raise MegatronConfigError(
                f"schedule={self.name!r} takes no schedule_options; got {sorted(raw)}. Remove `schedule_options`."
            )
        return None

    def check_layout(self, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        """None if the schedule runs ``pipeline`` stages with ``virtual`` model chunks per rank (None: one), else
        the reason it does not (with the fix). Default: the check of :attr:`virtual_stages`; an override adds its
        own conditions and returns ``super().check_layout(...)`` for the rest."""
        if self.virtual_stages and virtual is None:
            return (
                "it interleaves virtual pipeline stages: set `virtual_pipeline_model_parallel_size` (e.g. 2), or pick "
                f"a schedule without virtual stages ({', '.join(_names(lambda s: s.virtual_stages is not True))})"
            )
        if self.virtual_stages is False and virtual is not None:
            return (
                f"it runs one model chunk per rank, but virtual_pipeline_model_parallel_size={virtual}. Use a "
                f"schedule with virtual stages ({', '.join(_names(lambda s: s.virtual_stages is not False))}) or "
                "unset the virtual size"
            )
        return None

    def check_microbatches(self, num_microbatches: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        """None if a step of ``num_microbatches`` runs, else the reason it cannot. Default: any count runs."""
        return None

    def data_shard(self, options: Any, rank: int, size: int) -> tuple[int, int]:
        """``(sampler rank, sampler replicas)`` for data-parallel replica ``rank`` of ``size``, for schedules in which
        not every replica reads its own data (MegaFBD's forward replicas). Default: ``(rank, size)``."""
        return rank, size

    def open(self, context: ScheduleContext) -> ScheduleSession:
        """The session for one fit (first step; closed at teardown). Required."""
        raise NotImplementedError(f"schedule {self.name!r} ({type(self).__name__}) does not implement open().")

    # -- what the strategy calls --------------------------------------------------------------------------------

    def options(self, raw: Optional[Mapping[str, Any]]) -> Any:
        """The schedule's typed settings from the strategy's ``schedule_options`` (a clear error if wrong)."""
        return self.parse_options(dict(raw or {}))

    def validate(self, *, pipeline: int, virtual: Optional[int]) -> None:
        reason = self.check_layout(pipeline, virtual)
        if reason:
            raise MegatronConfigError(f"schedule={self.name!r}: {reason}.")

    def validate_microbatches(self, num_microbatches: int, *, pipeline: int, virtual: Optional[int]) -> None:
        if num_microbatches < 1:
            raise MegatronConfigError("A step needs at least one microbatch; the batch on this rank is empty.")
        reason = self.check_microbatches(num_microbatches, pipeline, virtual)
        if reason:
            raise MegatronConfigError(
                f"schedule={self.name!r} cannot run {num_microbatches} microbatches per step: {reason}. "
                "The number of microbatches is the batch size per data-parallel rank divided by "
                "`micro_batch_size`; change one of them."
            )

    def data_parallel_shard(self, options: Any, rank: int, size: int) -> tuple[int, int]:
        """Which shard of the data this data-parallel replica reads: ``(sampler rank, sampler replicas)``."""
        return self.data_shard(options, rank, size)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class FunctionSchedule(Schedule):
    """A stateless schedule: one ``forward_backward`` function, the same for every fit (what
    ``register_schedule(name, function)`` registers)."""

    def __init__(
        self,
        *,
        name: str,
        forward_backward: ForwardBackwardFunc,
        virtual_stages: Optional[bool] = False,
        check_microbatches: Optional[MicrobatchCheck] = None,
        description: str = "",
    ) -> None:
        self.name, self.forward_backward = name, forward_backward
        self.virtual_stages, self.description = virtual_stages, description
        self._check_microbatches = check_microbatches

    def check_microbatches(self, num_microbatches: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        check = self._check_microbatches
        return None if check is None else check(num_microbatches, pipeline, virtual)

    def open(self, context: ScheduleContext) -> ScheduleSession:
        return StatelessSession(self.forward_backward)


class StatelessSession:
    """A plain ``ForwardBackwardFunc`` as a session with nothing to close."""

    def __init__(self, forward_backward: ForwardBackwardFunc) -> None:
        self.forward_backward = forward_backward

    def __call__(self, **kwargs) -> list:
        return self.forward_backward(**kwargs)

    def close(self) -> None:
        pass


# -- the registry -----------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Schedule] = {}


def _names(keep: Callable[[Schedule], bool]) -> Iterator[str]:
    return (name for name in available_schedules() if keep(_REGISTRY[name]))


def register_schedule(
    schedule: Schedule | str,
    forward_backward: Optional[ForwardBackwardFunc] = None,
    *,
    virtual_stages: Optional[bool] = False,
    check_microbatches: Optional[MicrobatchCheck] = None,
    description: str = "",
    override: bool = False,
) -> Schedule:
    """Add a schedule; the strategy's ``schedule=`` argument selects it by its name.

    ``register_schedule(MySchedule())`` registers a :class:`Schedule`; ``register_schedule(name, function, ...)`` is
    the shorthand for a stateless one (a :class:`FunctionSchedule`). ``override=True`` replaces a schedule of the
    same name."""
    if isinstance(schedule, Schedule):
        if forward_backward is not None:
            raise ValueError(f"schedule {schedule.name!r}: a Schedule object takes no `forward_backward` function.")
        entry = schedule
    elif isinstance(schedule, str):
        if forward_backward is None:
            raise ValueError(
                f"schedule {schedule!r}: give its `forward_backward` function, or register a Schedule subclass's "
                "instance (lightning_megatron.pipeline.Schedule) for a schedule with state or options."
            )
        entry = FunctionSchedule(
            name=schedule,
            forward_backward=forward_backward,
            virtual_stages=virtual_stages,
            check_microbatches=check_microbatches,
            description=description,
        )
    else:
        raise TypeError(f"register_schedule takes a Schedule or a name, got {type(schedule).__name__}.")
    name = entry.name
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"Schedule names are short identifiers like '1f1b'; got {name!r}.")
    if name in _REGISTRY and not override:
        raise ValueError(f"A schedule named {name!r} is already registered; pass override=True to replace it.")
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
