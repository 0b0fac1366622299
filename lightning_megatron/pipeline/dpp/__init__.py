"""MegaDPP: a dynamic pipeline schedule that runs whichever forward or backward is ready (``schedule="dpp"``).

``plan`` (a rank's tasks and megatron-core's order), ``policy`` (what to run next, the memory rule),
``schedule`` (the executor over a transport), ``simulate`` (the same policies in a discrete-event model: will
DPP help my job?), ``options`` (the ``schedule_options`` the strategy takes).
"""

from __future__ import annotations

from typing import Optional

from lightning_megatron.pipeline.dpp.options import DppOptions, parse_options
from lightning_megatron.pipeline.dpp.policy import POLICIES
from lightning_megatron.pipeline.registry import ScheduleContext, register_schedule

__all__ = ["DppOptions", "POLICIES"]


def _open(context: ScheduleContext):  # noqa: ANN202
    from lightning_megatron.pipeline.dpp.schedule import DppSession  # megatron-core and transports load here

    return DppSession(context)


def _check_layout(pipeline: int, virtual: Optional[int]) -> Optional[str]:
    if pipeline < 2:
        return "a dynamic pipeline schedule needs pipeline_model_parallel_size >= 2 (use '1f1b' without a pipeline)"
    return None


def _check_microbatches(num_microbatches: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
    # With virtual stages, megatron-core's order (the static policy, and the fallback of every policy) walks
    # microbatches in groups of `pipeline`, as the interleaved schedule does.
    if virtual is not None and (num_microbatches < pipeline or num_microbatches % pipeline):
        return f"with virtual stages it needs a multiple of pipeline_model_parallel_size={pipeline} microbatches"
    return None


register_schedule(
    "dpp",
    open_session=_open,
    virtual_stages=None,
    check_microbatches=_check_microbatches,
    check_layout=_check_layout,
    parse_options=parse_options,
    description="MegaDPP: runs whichever forward/backward is ready, over a tagged transport (policy=...)",
)
