"""Layer specs: ``"sdpa"`` (fused PyTorch attention) computes what ``"local"`` computes, under tensor and
pipeline parallelism and with grouped-query attention. fp32: 1e-5 relative on the per-step loss and 1e-4 on
the gradient norm (the kernels differ only in summation order)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn.functional as F
from cases import fit_gpt
from megatron.core.transformer.transformer_config import TransformerConfig

from lightning_megatron import MegatronConfigError
from lightning_megatron.models.gpt import fused_kernel_fields, gelu_tanh
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


@pytest.mark.parametrize(
    ("activation", "bias", "fused_activation"),
    [("gelu_tanh", True, True), ("gelu", True, False), ("gelu_tanh", False, False), ("swiglu", False, True)],
)
def test_fused_kernels_only_where_the_math_is_unchanged(activation: str, bias: bool, fused_activation: bool) -> None:
    fields = fused_kernel_fields(activation, bias)
    assert fields["cross_entropy_loss_fusion"] is True
    assert fields.get("bias_activation_fusion", False) is fused_activation
    if activation == "gelu_tanh" and bias:
        # megatron-core's fused bias-GeLU is the tanh approximation, chosen by activation_func=F.gelu.
        assert fields["activation_func"] is F.gelu
    # megatron-core accepts every combination it is given (its own validation, in __post_init__).
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        add_bias_linear=bias,
        gated_linear_unit=activation == "swiglu",
        activation_func=F.silu if activation == "swiglu" else gelu_tanh,
    )
    TransformerConfig(**{**base, **fields})


def test_transformer_config_overrides_reach_the_model(ranks: Any) -> None:
    plain = ranks.run(1, fit_gpt, 1)[0]
    dropout = ranks.run(1, fit_gpt, 1, model={"transformer_config_overrides": {"hidden_dropout": 0.5}})[0]
    assert dropout["loss"][0] != pytest.approx(plain["loss"][0], rel=1e-4)
