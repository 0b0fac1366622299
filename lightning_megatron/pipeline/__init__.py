"""Pipeline schedules, selected by name. Importing this package registers megatron-core's schedules, MegaDPP and
MegaFBD."""

from lightning_megatron.pipeline import dpp as _dpp  # noqa: F401  (registers "dpp", "zb-h1")
from lightning_megatron.pipeline import fbd as _fbd  # noqa: F401  (registers "fbd")
from lightning_megatron.pipeline import megatron_schedules as _megatron_schedules  # noqa: F401  (registers)
from lightning_megatron.pipeline.registry import (
    ForwardBackwardFunc,
    Schedule,
    available_schedules,
    get_schedule,
    register_schedule,
)

__all__ = ["ForwardBackwardFunc", "Schedule", "available_schedules", "get_schedule", "register_schedule"]
