"""Pipeline schedules, selected by name. Importing this package registers megatron-core's schedules, MegaDPP and
MegaFBD.

This package holds schedules only: :mod:`.registry` (the contract a schedule implements and the registry),
:mod:`.tracing` (the p2p spans every schedule reports), :mod:`.gradsync` and :mod:`.transports` (what the schedules
over a tagged transport share), and the schedules themselves. What rewrites megatron-core's linear layers (the
weight-gradient split the zero-bubble schedules use included) is in :mod:`lightning_megatron.layers`."""

from lightning_megatron.pipeline import dpp as _dpp  # noqa: F401  (registers "dpp", "zb-h1")
from lightning_megatron.pipeline import fbd as _fbd  # noqa: F401  (registers "fbd")
from lightning_megatron.pipeline import megatron_schedules as _megatron_schedules  # noqa: F401  (registers)
from lightning_megatron.pipeline.registry import (
    ForwardBackwardFunc,
    Schedule,
    ScheduleContext,
    ScheduleGroups,
    ScheduleSession,
    StepEvents,
    available_schedules,
    get_schedule,
    register_schedule,
)

__all__ = [
    "ForwardBackwardFunc",
    "Schedule",
    "ScheduleContext",
    "ScheduleGroups",
    "ScheduleSession",
    "StepEvents",
    "available_schedules",
    "get_schedule",
    "register_schedule",
]
