"""``gradient_accumulation_fusion``: every tensor-parallel linear layer's weight gradient through the project's
path (``layers/wgrad.py``, shared with the ``zb-h1`` schedule's B/W split), against megatron-core's own backward.

On CPUs in fp32 the arithmetic is megatron-core's (GEMM, then ``main_grad.add_``), so losses and every step's
gradients must match within 1e-6, under tensor and sequence parallelism (a Llama-shaped model), and under data
parallelism with the distributed optimizer and ``overlap_grad_reduce`` (megatron-core's DDP hook sees each
gradient once). The fused GEMM itself (bf16 into fp32 ``main_grad``) is a GPU path: ``test_wgrad_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import dpp_cases as dc
import pytest
from test_dpp import assert_close

LAYOUTS = {
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True, model={"num_layers": 2, **dc.llama_model()}),
    "dp2-distopt-overlap": dict(use_distributed_optimizer=True, overlap_grad_reduce=True),
    "pp2": dict(pipeline_model_parallel_size=2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_accumulation_matches_megatron_core(ranks: Any, layout: str) -> None:
    common = LAYOUTS[layout]
    want = ranks.run(2, dc.fit_fused_layers, 2, **common)
    got = ranks.run(2, dc.fit_fused_layers, 2, gradient_accumulation_fusion=True, **common)
    for rank in range(2):
        assert want[rank]["fused_layers"] is None
        assert got[rank]["fused_layers"], f"rank {rank}: no linear layer took the fused path"
        assert_close(got[rank], want[rank], 1e-6, f"gradient_accumulation_fusion {layout} rank {rank}")
