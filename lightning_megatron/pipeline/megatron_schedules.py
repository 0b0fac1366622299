"""megatron-core's own schedules as registry entries: ``"1f1b"`` and ``"interleaved"``.

Both delegate to megatron-core unchanged (on CPU too, through ``compat.cpu``). ``"1f1b"`` without
pipeline parallelism is megatron-core's no-pipelining loop, so one schedule name covers PP=1 and PP>1.
"""

from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules

from lightning_megatron.pipeline.registry import register_schedule

__all__ = ["one_f_one_b", "interleaved"]


def one_f_one_b(**kwargs) -> list:
    """Non-interleaved one-forward-one-backward (PipeDream-flush); plain microbatch loop at PP=1."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return schedules.forward_backward_no_pipelining(**kwargs)
    return schedules.forward_backward_pipelining_without_interleaving(**kwargs)


def interleaved(**kwargs) -> list:
    """Interleaved 1F1B over virtual pipeline stages (Narayanan et al., 2021)."""
    return schedules.forward_backward_pipelining_with_interleaving(**kwargs)


def _check_interleaved(num_microbatches: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
    # megatron-core groups microbatches in runs of `microbatch_group_size_per_vp_stage`, which the
    # strategy leaves at its default, the pipeline size.
    if num_microbatches < pipeline:
        return f"the interleaved schedule needs at least pipeline_model_parallel_size={pipeline} microbatches"
    if num_microbatches % pipeline:
        return f"the interleaved schedule needs a multiple of pipeline_model_parallel_size={pipeline} microbatches"
    return None


register_schedule(
    "1f1b",
    one_f_one_b,
    virtual_stages=False,
    description="megatron-core 1F1B (no pipelining when pipeline_model_parallel_size=1)",
)
register_schedule(
    "interleaved",
    interleaved,
    virtual_stages=True,
    check_microbatches=_check_interleaved,
    description="megatron-core interleaved 1F1B over virtual pipeline stages",
)
