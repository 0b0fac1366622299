"""Transformer layer specs (which modules a layer is made of), by name.

* ``"local"``: megatron-core's pure-PyTorch layer (no Transformer Engine, no Apex), with one change: its
  norms are ``SequenceParallelNorm``. megatron-core's torch norm refuses ``sequence_parallel=True``
  because it does not mark its weights for the tensor-parallel gradient all-reduce that sequence
  parallelism needs; ours does, so the local spec runs sequence parallel (on GPUs and CPUs) without
  Transformer Engine or Apex.
* ``"sdpa"``: ``"local"`` with core attention through PyTorch's fused ``scaled_dot_product_attention``
  (``models.attention.SDPAttention``): same numerics, flash/memory-efficient kernels on GPUs.
* ``"te"``: megatron-core's Transformer Engine spec, when transformer-engine is installed.

With ``qk_layernorm`` (Qwen3's per-head query/key norms) the local and sdpa specs build those norms as the layer's
others (``SequenceParallelNorm``, fused with ``fused_norms``); see ``_with_qk_norms``.

The local and sdpa specs take three kernel settings (``GPTModule(fused_norms=..., fused_bias_grad=...,
fused_residual_norm=...)``; see ``lightning_megatron.kernels``): ``fused_norms`` builds the norms with a one-pass
backward, ``fused_bias_grad`` routes the linear layers' bias gradients (qkv, fc1 with its GeLU, and the two
bias-dropout-adds) through a single-pass column sum, ``fused_residual_norm`` (needs ``fused_norms``) runs each
bias-dropout-add and the norm after it as one op (within a layer from the spec alone; from a layer's MLP to the
next layer's norm once ``kernels.layers.link_residual_norms(model)`` has run, which ``GPTModule`` does). A
``"+fused"`` suffix on the name (``"sdpa+fused"``) turns all three on, so benchmark runners named after a spec
(``strategy-sdpa+fused``) can select them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

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

LayerSpecName = Literal["local", "sdpa", "te", "local+fused", "sdpa+fused"]


class SequenceParallelNorm:
    """LayerNorm or RMSNorm (``config.normalization``) whose weights join the sequence-parallel grad sync.

    With sequence parallelism each tensor-parallel rank normalizes a different slice of the sequence,
    so its norm weights see only part of the gradient; megatron-core sums those parts across the
    tensor-parallel group for parameters flagged ``sequence_parallel``.
    """

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, fused: bool = False, **_: object
    ) -> torch.nn.Module:
        if fused:  # the same parameters, with the fused kernels (lightning_megatron.kernels.norms)
            from lightning_megatron.kernels.layers import fused_norm

            norm: torch.nn.Module = fused_norm(config, hidden_size, eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise MegatronConfigError(
                f"normalization={config.normalization!r} is not supported by the local spec; use 'LayerNorm' or 'RMSNorm'."
            )
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def gpt_block_spec(
    name: LayerSpecName,
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    *,
    fused_norms: bool = False,
    fused_bias_grad: bool = False,
    fused_residual_norm: bool = False,
    grouped_experts: bool = False,
) -> ModuleSpec:
    """The decoder block spec for this rank's pipeline stage (and virtual stage). ``grouped_experts``: MoE layers'
    experts as grouped GEMMs (``layers.grouped_experts``) instead of megatron-core's ``SequentialMLP``."""
    if name.endswith("+fused"):
        name = name[: -len("+fused")]  # type: ignore[assignment]
        fused_norms = fused_bias_grad = fused_residual_norm = True
        if name == "te":
            raise MegatronConfigError("layer_spec='te+fused' is not available: Transformer Engine fuses its own norms.")
    if name == "te":
        if fused_norms or fused_bias_grad or fused_residual_norm:
            raise MegatronConfigError(
                "fused_norms/fused_bias_grad/fused_residual_norm apply to layer_spec='local' or 'sdpa'; with "
                "layer_spec='te' Transformer Engine's own fused kernels run: turn them off."
            )
        return _transformer_engine_block_spec(config, vp_stage)
    if name not in ("local", "sdpa"):
        raise MegatronConfigError(
            f"layer_spec={name!r} is not available; choose from: 'local', 'sdpa', 'te', 'local+fused', 'sdpa+fused'."
        )
    if name == "local" and config.context_parallel_size > 1:
        raise MegatronConfigError(
            f"context_parallel_size={config.context_parallel_size} needs layer_spec='sdpa' (ring attention over "
            "SDPA); megatron-core's local attention has no context parallelism."
        )
    if fused_residual_norm and not fused_norms:
        raise MegatronConfigError(
            "fused_residual_norm=True needs fused_norms=True (the pre-MLP norm takes the fused op's output)."
        )

    def layer_spec(num_experts: Optional[int]) -> ModuleSpec:
        return _local_layer_spec(
            name,
            config,
            num_experts,
            fused_norms=fused_norms,
            fused_bias_grad=fused_bias_grad,
            fused_residual_norm=fused_residual_norm,
            grouped_experts=grouped_experts,
        )

    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if config.num_moe_experts is None:
        layer_specs = [layer_spec(None)] * num_layers
    else:  # megatron-core's moe_layer_freq: which layers of the whole model are MoE layers
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from lightning_megatron.models.moe import moe_layer_pattern

        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        dense, moe = layer_spec(None), layer_spec(config.num_moe_experts)
        pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
        layer_specs = [moe if pattern[offset + i] else dense for i in range(num_layers)]
    norm = ModuleSpec(module=SequenceParallelNorm, params={"fused": True}) if fused_norms else SequenceParallelNorm
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=norm),
    )


def _local_layer_spec(
    name: str,
    config: TransformerConfig,
    num_experts: Optional[int],
    *,
    fused_norms: bool,
    fused_bias_grad: bool,
    fused_residual_norm: bool,
    grouped_experts: bool = False,
) -> ModuleSpec:
    """megatron-core's local layer (an MoE layer with ``num_experts``) with this package's norms, kernels and
    attention. An MoE layer's experts keep megatron-core's linears: ``fused_bias_grad`` reaches its attention and
    bias-dropout-adds only."""
    layer = get_gpt_layer_local_spec(num_experts=num_experts, normalization=config.normalization)
    if num_experts and grouped_experts:
        from lightning_megatron.layers.grouped_experts import GroupedGemmExperts

        moe = layer.submodules.mlp
        experts = dataclasses.replace(moe.submodules.experts, module=GroupedGemmExperts)
        mlp = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, experts=experts))
        layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))
    norm: Any = ModuleSpec(module=SequenceParallelNorm, params={"fused": True}) if fused_norms else SequenceParallelNorm
    submodules = dataclasses.replace(layer.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
    if config.qk_layernorm:
        submodules = _with_qk_norms(submodules, norm)
    if fused_bias_grad:
        submodules = _with_fused_bias_grad(submodules, moe=num_experts is not None)
    if fused_residual_norm:
        from lightning_megatron.kernels.layers import ResidualNormBDA

        bda = ModuleSpec(module=ResidualNormBDA, params={"bias_grad": fused_bias_grad})
        # the MLP's is linked to the next norm by kernels.layers.link_residual_norms once the model is built
        submodules = dataclasses.replace(submodules, self_attn_bda=bda, mlp_bda=bda)
    if name == "sdpa":
        attention = submodules.self_attention
        submodules = dataclasses.replace(
            submodules,
            self_attention=dataclasses.replace(
                attention, submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention)
            ),
        )
    layer = dataclasses.replace(layer, submodules=submodules)
    if fused_residual_norm:
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from lightning_megatron.kernels.layers import ResidualNormTransformerLayer

        if layer.module is not TransformerLayer:
            raise MegatronConfigError(
                f"fused_residual_norm expects megatron-core's TransformerLayer, this spec builds {layer.module.__name__}: "
                "turn fused_residual_norm off."
            )
        layer = dataclasses.replace(layer, module=ResidualNormTransformerLayer)
    return layer


def _with_qk_norms(submodules: Any, norm: Any) -> Any:
    """The attention with a norm over each head's query and key (``config.qk_layernorm``; Qwen3's ``q_norm`` and
    ``k_norm``), built as the layer's other norms: the model's normalization and epsilon, fused with
    ``fused_norms``.

    megatron-core applies them in ``SelfAttention.get_query_key_value_tensors``, to ``[seq, batch, heads, head_dim]``
    queries and keys before RoPE, as Hugging Face does. Their ``[head_dim]`` weights are whole on every
    tensor-parallel rank (each rank normalizes its own heads with them) and megatron-core's
    ``finalize_model_grads`` sums their gradients over the tensor-parallel group by name (``q_layernorm`` /
    ``k_layernorm``), with or without sequence parallelism; with it they are also flagged ``sequence_parallel``
    (``SequenceParallelNorm``), which selects the same single sum. megatron-core's own local spec would build its
    torch norm, which refuses sequence parallelism.
    """
    attention = submodules.self_attention
    if not hasattr(attention.submodules, "k_layernorm"):
        raise MegatronConfigError(
            f"qk_layernorm=True expects megatron-core's SelfAttention; this spec builds {attention.module.__name__}: "
            "set qk_layernorm=False."
        )
    heads = dataclasses.replace(attention.submodules, q_layernorm=norm, k_layernorm=norm)
    return dataclasses.replace(submodules, self_attention=dataclasses.replace(attention, submodules=heads))


def _with_fused_bias_grad(submodules: Any, moe: bool = False) -> Any:
    """The layer's qkv linear, MLP (not an MoE layer's experts) and bias-dropout-adds with their bias gradients
    through the fused column sum."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    from lightning_megatron.kernels.layers import BiasGradColumnParallelLinear, BiasGradMLP, get_bias_dropout_add

    attention, mlp = submodules.self_attention, submodules.mlp
    local_mlp = (
        mlp.module is MLP
        and mlp.submodules.linear_fc1 is ColumnParallelLinear
        and mlp.submodules.linear_fc2 is RowParallelLinear
    )
    if attention.submodules.linear_qkv is not ColumnParallelLinear or not (local_mlp or moe):
        raise MegatronConfigError(
            "fused_bias_grad expects megatron-core's local layer (ColumnParallelLinear qkv, MLP); this megatron-core "
            "builds another one: turn fused_bias_grad off."
        )
    return dataclasses.replace(
        submodules,
        self_attention=dataclasses.replace(
            attention,
            submodules=dataclasses.replace(attention.submodules, linear_qkv=BiasGradColumnParallelLinear),
        ),
        mlp=mlp if moe else BiasGradMLP,  # a class, not a ModuleSpec: see BiasGradMLP
        self_attn_bda=get_bias_dropout_add,
        mlp_bda=get_bias_dropout_add,
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
