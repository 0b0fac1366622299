"""Transformer layer specs (which modules a layer is made of), by name.

* ``"local"``: megatron-core's pure-PyTorch layer (no Transformer Engine, no Apex), with one change: its
  norms are ``SequenceParallelNorm``. megatron-core's torch norm refuses ``sequence_parallel=True``
  because it does not mark its weights for the tensor-parallel gradient all-reduce that sequence
  parallelism needs; ours does, so the local spec runs sequence parallel (on GPUs and CPUs) without
  Transformer Engine or Apex.
* ``"sdpa"``: ``"local"`` with core attention through PyTorch's fused ``scaled_dot_product_attention``
  (``models.attention.SDPAttention``): same numerics, flash/memory-efficient kernels on GPUs.
* ``"te"``: megatron-core's Transformer Engine spec, when transformer-engine is installed.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.models.attention import SDPAttention

__all__ = ["LayerSpecName", "SequenceParallelNorm", "gpt_block_spec"]

LayerSpecName = Literal["local", "sdpa", "te"]


class SequenceParallelNorm:
    """LayerNorm or RMSNorm (``config.normalization``) whose weights join the sequence-parallel grad sync.

    With sequence parallelism each tensor-parallel rank normalizes a different slice of the sequence,
    so its norm weights see only part of the gradient; megatron-core sums those parts across the
    tensor-parallel group for parameters flagged ``sequence_parallel``.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise MegatronConfigError(
                f"normalization={config.normalization!r} is not supported by the local spec; use 'LayerNorm' or 'RMSNorm'."
            )
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def gpt_block_spec(name: LayerSpecName, config: TransformerConfig, vp_stage: Optional[int] = None) -> ModuleSpec:
    """The decoder block spec for this rank's pipeline stage (and virtual stage)."""
    if name == "te":
        return _transformer_engine_block_spec(config, vp_stage)
    if name not in ("local", "sdpa"):
        raise MegatronConfigError(f"layer_spec={name!r} is not available; choose from: 'local', 'sdpa', 'te'.")
    layer = get_gpt_layer_local_spec(normalization=config.normalization)
    submodules = dataclasses.replace(
        layer.submodules, input_layernorm=SequenceParallelNorm, pre_mlp_layernorm=SequenceParallelNorm
    )
    if name == "sdpa":
        attention = submodules.self_attention
        submodules = dataclasses.replace(
            submodules,
            self_attention=dataclasses.replace(
                attention, submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention)
            ),
        )
    layer = dataclasses.replace(layer, submodules=submodules)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelNorm),
    )


def _transformer_engine_block_spec(config: TransformerConfig, vp_stage: Optional[int]) -> ModuleSpec:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        raise MegatronConfigError(
            "layer_spec='te' needs NVIDIA Transformer Engine (pip install transformer-engine[pytorch]); "
            "without it use layer_spec='sdpa'."
        ) from None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
