"""Pipeline schedules, selected by name. Importing this package registers megatron-core's schedules and MegaDPP."""

from lightning_megatron.pipeline import dpp as _dpp  # noqa: F401  (registers "dpp")
from lightning_megatron.pipeline import megatron_schedules as _megatron_schedules  # noqa: F401  (registers)
from lightning_megatron.pipeline.registry import (
    ForwardBackwardFunc,
    Schedule,
    available_schedules,
    get_schedule,
    register_schedule,
)

__all__ = ["ForwardBackwardFunc", "Schedule", "available_schedules", "get_schedule", "register_schedule"]
