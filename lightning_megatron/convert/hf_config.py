"""Hugging Face ``config.json`` ↔ ``GPTModule`` arguments, per model family (GPT-2, Llama, Mixtral, Qwen2, Qwen2-MoE,
Qwen3, Qwen3-MoE).

Kept apart from the tensor conversion (``convert.hf``), which needs only the family (``hf_model_type``) and a few
shapes: the mapping of fields is where families differ most and grow, and reading it needs no tensors.

What each family adds to Llama (RoPE, RMSNorm, SwiGLU, no biases):

* Mixtral: an MoE layer in every layer (``num_local_experts``, ``num_experts_per_tok``); its router (softmax over all
  experts, top k, renormalized over the k) gives the weights of megatron-core's default top-k router (top k of the
  logits, softmax over the k).
* Qwen2: biases on the q, k and v projections (implied by the model type: there is no ``attention_bias`` field),
  ``GPTModule(add_qkv_bias=True)``.
* Qwen2-MoE: Qwen2 (``qkv_bias``, default true) with MoE layers where ``mlp_only_layers`` and
  ``decoder_sparse_step`` put them (layer ``i`` when ``i`` is not listed and ``(i + 1) % step == 0``; megatron-core's
  ``moe_layer_freq`` as a list of 0/1; dense layers have width ``intermediate_size``), a shared expert of width
  ``shared_expert_intermediate_size`` scaled by a sigmoid gate (``moe_shared_expert_gate``), and experts of width
  ``moe_intermediate_size``. ``norm_topk_prob=False`` (the default of the released models) takes the top k of a
  softmax over all experts without renormalizing: megatron-core's ``moe_router_pre_softmax=True``; ``True`` is
  Mixtral's routing.
* Qwen3: Llama with an RMSNorm over each head's query and key before RoPE (``q_norm``/``k_norm``:
  ``GPTModule(qk_layernorm=True)``), no biases (``attention_bias=true`` is refused) and an explicit ``head_dim``
  (``kv_channels``; always written on export, since transformers' default is 128, not ``hidden / heads``).
* Qwen3-MoE: Qwen3 with Qwen2-MoE's expert layers (the same ``mlp_only_layers`` / ``decoder_sparse_step`` placement
  and ``norm_topk_prob`` routing; the released models set ``norm_topk_prob=true``, megatron-core's default router)
  and no shared expert.

Sliding-window attention (Mixtral's ``sliding_window`` shorter than the context, Qwen's ``use_sliding_window`` or a
``"sliding_attention"`` entry in ``layer_types``) and scaled RoPE are refused: ``GPTModule`` attends over the whole
causal context with unscaled RoPE.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_megatron.models.moe import moe_layer_pattern

__all__ = ["gpt_kwargs_to_hf_config", "hf_config_to_gpt_kwargs", "hf_model_type", "qwen2_moe_layer_pattern"]

_SUPPORTED = "'gpt2', 'llama', 'mixtral', 'qwen2', 'qwen2_moe', 'qwen3' or 'qwen3_moe'"


def _rope_theta(config: dict[str, Any]) -> float:
    """``rope_theta`` from either config style (top level, or ``rope_parameters`` since transformers 5)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"RoPE scaling {rope_type!r} is not supported (only unscaled RoPE).")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _refuse_qwen_sliding_window(config: dict[str, Any]) -> None:
    sliding = [i for i, kind in enumerate(config.get("layer_types") or []) if kind != "full_attention"]
    if config.get("use_sliding_window") or sliding:
        raise NotImplementedError(
            f"{config['model_type']} with use_sliding_window={config.get('use_sliding_window')} (sliding-attention "
            f"layers {sliding}) is not supported: GPTModule attends over the whole causal context. Convert a "
            "checkpoint with use_sliding_window=false."
        )


def qwen2_moe_layer_pattern(config: dict[str, Any]) -> list[int]:
    """Which layers of a Qwen2-MoE or Qwen3-MoE config are MoE layers (1) or dense (0), as transformers builds them."""
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    return [0 if i in dense or (i + 1) % step else 1 for i in range(config["num_hidden_layers"])]


def _gpt2_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    act = config.get("activation_function", "gelu_new")
    activations = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in activations:
        raise NotImplementedError(f"GPT-2 activation_function={act!r} is not supported ({sorted(activations)}).")
    if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
        raise NotImplementedError("GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported.")
    hidden = config["n_embd"]
    return dict(
        vocab_size=config["vocab_size"],
        seq_length=config["n_positions"],
        num_layers=config["n_layer"],
        hidden_size=hidden,
        num_attention_heads=config["n_head"],
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        activation=activations[act],
        add_bias_linear=True,
        share_embeddings_and_output_weights=config.get("tie_word_embeddings", True),
        hidden_dropout=config.get("resid_pdrop", 0.1),
        attention_dropout=config.get("attn_pdrop", 0.1),
        layernorm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        init_method_std=config.get("initializer_range", 0.02),
        mask_padded_vocab=True,
    )


def _llama_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(
            f"{config['model_type']} hidden_act={config['hidden_act']!r} is not supported (only silu)."
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise NotImplementedError(
            f"{config['model_type']} checkpoints with attention_bias or mlp_bias are not supported (GPTModule has "
            "no bias on the output projection or the MLP of a Llama-style model)."
        )
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return dict(
        vocab_size=config["vocab_size"],
        seq_length=config.get("max_position_embeddings", 2048),
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        ffn_hidden_size=config["intermediate_size"],
        kv_channels=None if head_dim == hidden // heads else head_dim,
        position_embedding_type="rope",
        rotary_base=_rope_theta(config),
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        share_embeddings_and_output_weights=config.get("tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=config.get("attention_dropout", 0.0),
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        init_method_std=config.get("initializer_range", 0.02),
        mask_padded_vocab=True,
    )


def _mixtral_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("sliding_window") not in (None, 0) and config["sliding_window"] < config.get(
        "max_position_embeddings", 2048
    ):
        raise NotImplementedError("Mixtral checkpoints with a sliding attention window are not supported.")
    experts = dict(
        num_moe_experts=config["num_local_experts"],
        moe_router_topk=config.get("num_experts_per_tok", 2),
        moe_ffn_hidden_size=config["intermediate_size"],
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
    )
    return {**_llama_kwargs(config), **experts}


def _qwen2_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    _refuse_qwen_sliding_window(config)
    return {**_llama_kwargs(config), "add_qkv_bias": True}


def _qwen2_moe_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    _refuse_qwen_sliding_window(config)
    if not config.get("num_experts"):
        raise NotImplementedError(
            f"qwen2_moe with num_experts={config.get('num_experts')!r} has no MoE layers: convert it as a 'qwen2' "
            "checkpoint."
        )
    if not config.get("shared_expert_intermediate_size"):
        raise NotImplementedError(
            "qwen2_moe without a shared expert (shared_expert_intermediate_size="
            f"{config.get('shared_expert_intermediate_size')!r}) is not supported: transformers builds one always."
        )
    pattern = qwen2_moe_layer_pattern(config)
    if not any(pattern):
        raise NotImplementedError(
            "qwen2_moe whose mlp_only_layers / decoder_sparse_step leave no MoE layer: convert it as 'qwen2'."
        )
    experts = dict(
        add_qkv_bias=bool(config.get("qkv_bias", True)),
        num_moe_experts=config["num_experts"],
        moe_router_topk=config.get("num_experts_per_tok", 4),
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=config["shared_expert_intermediate_size"],
        moe_shared_expert_gate=True,
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
    )
    return {**_llama_kwargs(config), **experts}


def _qwen3_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    _refuse_qwen_sliding_window(config)
    return {**_llama_kwargs(config), "qk_layernorm": True}


def _qwen3_num_experts_key(config: dict[str, Any]) -> str:
    """Released Qwen3-MoE configs say ``num_experts``; transformers 5 writes it as ``num_local_experts`` (its
    ``attribute_map``) and reads either."""
    return "num_local_experts" if "num_local_experts" in config and "num_experts" not in config else "num_experts"


def _qwen3_moe_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    _refuse_qwen_sliding_window(config)
    num_experts = config.get(_qwen3_num_experts_key(config))
    pattern = qwen2_moe_layer_pattern(config)
    if not num_experts or not any(pattern):
        raise NotImplementedError(
            f"qwen3_moe with num_experts={num_experts!r}, mlp_only_layers="
            f"{config.get('mlp_only_layers')!r} and decoder_sparse_step={config.get('decoder_sparse_step')!r} has no "
            "MoE layer: convert it as a 'qwen3' checkpoint."
        )
    experts = dict(
        num_moe_experts=num_experts,
        moe_router_topk=config.get("num_experts_per_tok", 8),
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
    )
    return {**_qwen3_kwargs(config), **experts}


_FROM_HF = {
    "gpt2": _gpt2_kwargs,
    "llama": _llama_kwargs,
    "mixtral": _mixtral_kwargs,
    "qwen2": _qwen2_kwargs,
    "qwen2_moe": _qwen2_moe_kwargs,
    "qwen3": _qwen3_kwargs,
    "qwen3_moe": _qwen3_moe_kwargs,
}


def hf_config_to_gpt_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``GPTModule`` arguments that build the architecture of a Hugging Face ``config.json``.

    Only the architecture is set (shape, norms, activation, positions, dropout, experts); training arguments keep
    ``GPTModule``'s defaults. ``mask_padded_vocab`` is on so the loss ignores the vocabulary padding and
    equals the original model's.
    """
    model_type = config.get("model_type")
    if model_type not in _FROM_HF:
        raise NotImplementedError(f"model_type={model_type!r} is not supported; choose a {_SUPPORTED} checkpoint.")
    return _FROM_HF[model_type](config)


def hf_model_type(hp: dict[str, Any]) -> str:
    """The Hugging Face family a ``GPTModule`` (its hparams) is exported as, or ``NotImplementedError``."""
    qk_norms = bool(hp.get("qk_layernorm"))
    if hp["position_embedding_type"] == "learned_absolute" and hp["normalization"] == "LayerNorm" and not qk_norms:
        if hp["activation"] in ("gelu", "gelu_tanh") and hp["add_bias_linear"]:  # its biases include the qkv one
            return "gpt2"
    llama_like = hp["position_embedding_type"] == "rope" and hp["normalization"] == "RMSNorm"
    if llama_like and hp["activation"] == "swiglu" and not hp["add_bias_linear"]:
        qkv_bias, shared = bool(hp.get("add_qkv_bias")), hp.get("moe_shared_expert_intermediate_size")
        if qk_norms:
            if not qkv_bias and shared is None:
                return "qwen3" if hp.get("num_moe_experts") is None else "qwen3_moe"
        elif hp.get("num_moe_experts") is None:
            return "qwen2" if qkv_bias else "llama"
        elif (
            shared is None
            and not qkv_bias
            and hp.get("moe_layer_freq", 1) == 1
            and not hp.get("moe_router_pre_softmax")
        ):
            return "mixtral"
        elif shared is not None and hp.get("moe_shared_expert_gate"):
            return "qwen2_moe"
    raise NotImplementedError(
        "Only GPT-2 style (learned positions, LayerNorm, gelu, biases), Llama style (RoPE, RMSNorm, swiglu, no "
        "biases), Qwen2 style (Llama with add_qkv_bias), Mixtral style (Llama with an MoE layer in every layer, no "
        "shared experts, no qkv bias, moe_router_pre_softmax=False) and Qwen2-MoE style (Llama with MoE layers and "
        "a gated shared expert: moe_shared_expert_gate=True), Qwen3 style (Llama with qk_layernorm=True) and "
        "Qwen3-MoE style (Qwen3 with MoE layers, no shared expert) GPTModules can be exported to Hugging Face."
    )


def _gpt2_config(config: dict[str, Any], hp: dict[str, Any]) -> None:
    hidden, ffn = hp["hidden_size"], hp.get("ffn_hidden_size")
    config["architectures"] = ["GPT2LMHeadModel"]
    config.update(
        n_positions=hp["seq_length"],
        n_layer=hp["num_layers"],
        n_embd=hidden,
        n_head=hp["num_attention_heads"],
        n_inner=None if ffn in (None, 4 * hidden) else ffn,
        activation_function="gelu_new" if hp["activation"] == "gelu_tanh" else "gelu",
        layer_norm_epsilon=hp["layernorm_epsilon"],
        resid_pdrop=hp["hidden_dropout"],
        embd_pdrop=hp["hidden_dropout"],  # megatron-core's hidden_dropout covers the embeddings too
        attn_pdrop=hp["attention_dropout"],
    )


def _llama_config(config: dict[str, Any], hp: dict[str, Any], model_type: str) -> None:
    hidden, heads = hp["hidden_size"], hp["num_attention_heads"]
    head_dim = hp.get("kv_channels") or hidden // heads
    if model_type in ("llama", "mixtral"):
        # A base config that leaves head_dim unset (None: hidden / heads, as Mixtral's does) keeps it unset.
        default_head_dim = "head_dim" in config and config["head_dim"] is None and not hp.get("kv_channels")
        config["head_dim"] = None if default_head_dim else head_dim
    elif model_type in ("qwen3", "qwen3_moe"):  # always: Qwen3Config's default is 128, not hidden / heads
        config["head_dim"] = head_dim
    elif hp.get("kv_channels") or config.get("head_dim") is not None:  # Qwen2's configs have no head_dim field
        config["head_dim"] = head_dim
    config.update(
        max_position_embeddings=hp["seq_length"],
        num_hidden_layers=hp["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=hp.get("num_query_groups") or heads,
        intermediate_size=hp.get("ffn_hidden_size") or 4 * hidden,
        hidden_act="silu",
        rms_norm_eps=hp["layernorm_epsilon"],
        attention_dropout=hp["attention_dropout"],
    )
    if "rope_parameters" in config or "rope_theta" not in config:
        config["rope_parameters"] = {**(config.get("rope_parameters") or {}), "rope_theta": hp["rotary_base"]}
        config["rope_parameters"].setdefault("rope_type", "default")
    else:
        config["rope_theta"] = hp["rotary_base"]


def _qwen_attention_config(config: dict[str, Any], hp: dict[str, Any]) -> None:
    """Whole-context attention in every layer: no sliding window, and layer types for the exported layer count."""
    config["use_sliding_window"] = False
    config["layer_types"] = ["full_attention"] * hp["num_layers"]
    config.setdefault("max_window_layers", hp["num_layers"])


def _qwen_moe_config(config: dict[str, Any], hp: dict[str, Any]) -> None:
    """The expert fields Qwen2-MoE and Qwen3-MoE share: where the MoE layers are, the experts, the routing."""
    pattern = moe_layer_pattern(hp["num_layers"], hp.get("moe_layer_freq", 1))
    if qwen2_moe_layer_pattern(config) != pattern:
        # Any pattern is every layer (step 1) less the dense ones; a base config whose fields give it is kept.
        config.update(decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    config.setdefault("decoder_sparse_step", 1)
    config.setdefault("mlp_only_layers", [])
    qwen3 = hf_model_type(hp) == "qwen3_moe"
    config[_qwen3_num_experts_key(config) if qwen3 else "num_experts"] = hp["num_moe_experts"]
    config.update(
        num_experts_per_tok=hp.get("moe_router_topk", 2),
        moe_intermediate_size=hp.get("moe_ffn_hidden_size") or config["intermediate_size"],
        norm_topk_prob=not hp.get("moe_router_pre_softmax", False),
        router_aux_loss_coef=hp.get("moe_aux_loss_coeff", 0.0),
    )
    if not qwen3:
        config.update(
            qkv_bias=bool(hp.get("add_qkv_bias")),
            shared_expert_intermediate_size=hp["moe_shared_expert_intermediate_size"],
        )


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def gpt_kwargs_to_hf_config(hp: dict[str, Any], base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a ``GPTModule`` (its hparams), over ``base`` (kept fields: token ids, ...)."""
    config = dict(base or {})
    model_type = hf_model_type(hp)
    config["model_type"] = model_type
    config["vocab_size"] = hp["vocab_size"]
    config["tie_word_embeddings"] = hp["share_embeddings_and_output_weights"]
    config["initializer_range"] = hp["init_method_std"]
    if model_type == "gpt2":
        _gpt2_config(config, hp)
        return config
    config["architectures"] = [_ARCHITECTURES[model_type]]
    _llama_config(config, hp, model_type)
    if model_type == "mixtral":
        config.update(
            intermediate_size=hp.get("moe_ffn_hidden_size") or config["intermediate_size"],
            num_local_experts=hp["num_moe_experts"],
            num_experts_per_tok=hp.get("moe_router_topk", 2),
            router_aux_loss_coef=hp.get("moe_aux_loss_coeff", 0.0),
        )
        config.setdefault("sliding_window", None)
    elif model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        _qwen_attention_config(config, hp)
        if model_type in ("qwen3", "qwen3_moe"):
            config["attention_bias"] = False
        if model_type in ("qwen2_moe", "qwen3_moe"):
            _qwen_moe_config(config, hp)
    return config
