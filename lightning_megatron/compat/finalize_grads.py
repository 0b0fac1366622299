"""megatron-core's ``finalize_model_grads`` without its host synchronisation.

Why: with ``calculate_per_token_loss`` megatron-core 0.16 scales the gradients by ``1 / num_tokens`` only
``if num_tokens > 0``: a Python ``if`` on a GPU tensor, so the host waits for the whole backward pass on every
step, and a CUDA graph cannot capture the step at all (``cuda_graphs=True``). This version lets megatron-core do
everything else (data-parallel reduction, sequence-parallel and embedding gradients) and then scales by
``1 / max(num_tokens, 1)`` on the GPU. The result is the same: with no counted token every gradient is zero, and
a zero scaled by 1 stays zero.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads as _megatron_finalize_model_grads
from megatron.core.pipeline_parallel.utils import get_pp_last_rank

__all__ = ["finalize_model_grads"]


def finalize_model_grads(
    model: list[torch.nn.Module],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection: Optional[Any] = None,
    force_all_reduce: Optional[bool] = False,
) -> None:
    """``megatron.core.distributed.finalize_model_grads``'s signature and result, with no host synchronisation."""
    _megatron_finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    if pg_collection is not None:
        pp_group, dp_cp_group = pg_collection.pp, pg_collection.dp_cp
    else:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    # The count lives on the last pipeline stage: broadcast it down the pipeline, then sum the replicas.
    torch.distributed.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)
    torch.distributed.all_reduce(num_tokens, group=dp_cp_group)
    scaling = 1.0 / num_tokens.clamp(min=1)
    for chunk in model:
        chunk.scale_gradients(scaling)
