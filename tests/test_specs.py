"""Layer specs: ``"sdpa"`` (fused PyTorch attention) computes what ``"local"`` computes, under tensor and
pipeline parallelism and with grouped-query attention. fp32: 1e-5 relative on the per-step loss and 1e-4 on
the gradient norm (the kernels differ only in summation order)."""

from __future__ import annotations

from typing import Any

import pytest
from cases import fit_gpt

from lightning_megatron import MegatronConfigError
from lightning_megatron.models.specs import gpt_block_spec

GQA = {"num_query_groups": 2, "position_embedding_type": "rope", "normalization": "RMSNorm", "activation": "swiglu"}


@pytest.mark.parametrize("model", [{}, GQA], ids=["gpt2-style", "llama-style-gqa"])
def test_sdpa_matches_local(ranks: Any, model: dict) -> None:
    local = ranks.run(1, fit_gpt, 1, model={**model, "layer_spec": "local"})[0]
    for world_size, layout in [
        (1, {}),
        (2, {"tensor_model_parallel_size": 2}),
        (2, {"pipeline_model_parallel_size": 2}),
    ]:
        for result in ranks.run(world_size, fit_gpt, world_size, model={**model, "layer_spec": "sdpa"}, **layout):
            assert result["loss"] == pytest.approx(local["loss"], rel=1e-5), layout
            assert result["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-4), layout


def test_te_spec_without_transformer_engine_says_what_to_do() -> None:
    with pytest.raises(MegatronConfigError, match="layer_spec='sdpa'"):
        gpt_block_spec("te", config=None)  # type: ignore[arg-type]
