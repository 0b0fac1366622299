"""MegaFBD's rank split (``schedule="fbd"``): forward replicas run forwards, backward replicas run backwards.

``roles`` (which data-parallel replicas do what, who feeds whom), ``wiring`` (message tags, who talks to whom, the
link's calibration), ``schedule`` (the session: both roles' loops), ``replay`` (ship mode: capture saved tensors, rebuild the graph without GEMMs), ``perfmodel`` (the
step time predicted from measured parts), ``options`` (the ``schedule_options`` the strategy takes).

When to use it, and when the weight-gradient split on the same GPUs (``schedule="zb-h1"``) is the better
decoupling, is in the README's MegaFBD section: on the same number of GPUs the rank split cannot beat coupled
training (its backward replicas recompute, or wait for shipped activations); it pays when the forwards run on
devices that would not train anyway, or for forward-heavy work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from lightning_megatron.pipeline.fbd.options import MODES, FbdOptions, parse_options
from lightning_megatron.pipeline.fbd.roles import data_shard
from lightning_megatron.pipeline.registry import Schedule, ScheduleContext, ScheduleSession, register_schedule

__all__ = ["MODES", "FbdOptions", "FbdSchedule"]


class FbdSchedule(Schedule):
    """``schedule="fbd"``: the rank split; forward replicas read no data of their own (:meth:`data_shard`)."""

    name = "fbd"
    description = "MegaFBD rank split: forward replicas run forwards, backward replicas the backwards (mode=...)"
    virtual_stages = False

    @override
    def parse_options(self, raw: Mapping[str, Any]) -> FbdOptions:
        return parse_options(raw)

    @override
    def data_shard(self, options: Any, rank: int, size: int) -> tuple[int, int]:
        return data_shard(options, rank, size)

    @override
    def open(self, context: ScheduleContext) -> ScheduleSession:
        from lightning_megatron.pipeline.fbd.schedule import FbdSession  # megatron-core and transports load here

        return FbdSession(context)


register_schedule(FbdSchedule())
