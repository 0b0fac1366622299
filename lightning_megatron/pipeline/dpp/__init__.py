"""MegaDPP: a dynamic pipeline schedule that runs whichever forward or backward is ready (``schedule="dpp"``),
and ``schedule="zb-h1"``: megatron-core's 1F1B order with weight gradients split off and run in the bubbles.

``plan`` (a rank's tasks and megatron-core's order), ``policy`` (what to run next, the memory rule),
``schedule`` (the executor over a transport), ``wgrad`` (the B/W split of the linear layers), ``simulate`` and
``scenario`` (the same policies in a discrete-event model: will DPP help my job?), ``options`` (the
``schedule_options`` the strategy takes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from typing_extensions import override

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.dpp.options import DppOptions, parse_options
from lightning_megatron.pipeline.dpp.policy import POLICIES
from lightning_megatron.pipeline.registry import Schedule, ScheduleContext, ScheduleSession, register_schedule

__all__ = ["POLICIES", "DppOptions", "DppSchedule", "ZeroBubbleSchedule"]


class DppSchedule(Schedule):
    """``schedule="dpp"``: the dynamic executor, with or without virtual stages."""

    name = "dpp"
    description = "MegaDPP: runs whichever forward/backward is ready, over a tagged transport (policy=...)"
    virtual_stages = None

    @override
    def parse_options(self, raw: Mapping[str, Any]) -> DppOptions:
        return parse_options(raw)

    @override
    def check_layout(self, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        if pipeline < 2:
            return "a dynamic pipeline schedule needs pipeline_model_parallel_size >= 2 (use '1f1b' without a pipeline)"
        return super().check_layout(pipeline, virtual)

    @override
    def check_microbatches(self, num_microbatches: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        # With virtual stages, megatron-core's order (the static policy, and the fallback of every policy) walks
        # microbatches in groups of `pipeline`, as the interleaved schedule does.
        if virtual is not None and (num_microbatches < pipeline or num_microbatches % pipeline):
            return f"with virtual stages it needs a multiple of pipeline_model_parallel_size={pipeline} microbatches"
        return None

    @override
    def open(self, context: ScheduleContext) -> ScheduleSession:
        from lightning_megatron.pipeline.dpp.schedule import DppSession  # megatron-core and transports load here

        return DppSession(context)


class ZeroBubbleSchedule(DppSchedule):
    """``schedule="zb-h1"``: the executor with megatron-core's 1F1B order and the weight gradients split off."""

    name = "zb-h1"
    description = "zero-bubble (ZB-H1 style): 1F1B with weight gradients deferred into the bubbles"
    virtual_stages = False

    @override
    def parse_options(self, raw: Mapping[str, Any]) -> DppOptions:
        fixed = {"policy", "split_weight_grads", "extra_activations"} & set(raw)
        if fixed:
            raise MegatronConfigError(
                f"schedule='zb-h1' is megatron-core's 1F1B order with split weight gradients; it does not take "
                f"{sorted(fixed)}. For other orders use schedule='dpp' with schedule_options split_weight_grads=True."
            )
        return dataclasses.replace(parse_options(raw), policy="static", split_weight_grads=True)

    @override
    def check_microbatches(self, num_microbatches: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        return None


register_schedule(DppSchedule())
register_schedule(ZeroBubbleSchedule())
