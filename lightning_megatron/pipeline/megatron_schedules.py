"""megatron-core's own schedules as registry entries: ``"1f1b"`` and ``"interleaved"``.

Both delegate to megatron-core unchanged (on CPU too, through ``compat.cpu``). ``"1f1b"`` without
pipeline parallelism is megatron-core's no-pipelining loop, so one schedule name covers PP=1 and PP>1: the
session picks the loop from the pipeline group it is handed.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.pipeline_parallel import schedules
from typing_extensions import override

from lightning_megatron.pipeline.registry import Schedule, ScheduleContext, StatelessSession, register_schedule

__all__ = ["Interleaved", "OneFOneB"]


class OneFOneB(Schedule):
    """Non-interleaved one-forward-one-backward (PipeDream-flush); plain microbatch loop at PP=1."""

    name = "1f1b"
    description = "megatron-core 1F1B (no pipelining when pipeline_model_parallel_size=1)"
    virtual_stages = False

    @override
    def open(self, context: ScheduleContext) -> StatelessSession:
        if context.groups.pipeline_size == 1:
            return StatelessSession(schedules.forward_backward_no_pipelining)
        return StatelessSession(schedules.forward_backward_pipelining_without_interleaving)


class Interleaved(Schedule):
    """Interleaved 1F1B over virtual pipeline stages (Narayanan et al., 2021)."""

    name = "interleaved"
    description = "megatron-core interleaved 1F1B over virtual pipeline stages"
    virtual_stages = True

    @override
    def check_microbatches(self, num_microbatches: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        # megatron-core groups microbatches in runs of `microbatch_group_size_per_vp_stage`, which the
        # strategy leaves at its default, the pipeline size.
        if num_microbatches < pipeline:
            return f"the interleaved schedule needs at least pipeline_model_parallel_size={pipeline} microbatches"
        if num_microbatches % pipeline:
            return f"the interleaved schedule needs a multiple of pipeline_model_parallel_size={pipeline} microbatches"
        return None

    @override
    def open(self, context: ScheduleContext) -> StatelessSession:
        return StatelessSession(schedules.forward_backward_pipelining_with_interleaving)


register_schedule(OneFOneB())
register_schedule(Interleaved())
