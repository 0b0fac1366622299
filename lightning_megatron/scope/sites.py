"""The probe points of a megatron-core GPT: one registry shared by capture and perturbation.

Contract: ``probe_points(chunks)`` lists every point of this rank's model chunks as a ``ProbePoint``: its
TransformerLens-style name, the module and hook (``"pre"`` or ``"post"`` forward hook) that sees it, how to
read the tensor from that hook's arguments or output and how to write a replacement back, and its
``ShardLayout`` (how the tensor is split under tensor and sequence parallelism). Capture reads points,
perturbation writes them; neither knows megatron-core's module structure — this module does.

Names (layer ``L`` is 0-based, the model's global layer index, whatever pipeline stage owns it):

=================================  ==========================================  ================  ===========
name                               what                                        logical shape     perturb
=================================  ==========================================  ================  ===========
``hook_embed``                     token + position embedding                  [b, s, h]         system
``blocks.L.hook_resid_pre``        residual stream into layer L                [b, s, h]         system
``blocks.L.attn.hook_q/k/v``       queries, keys, values (after RoPE)          [b, s, n, d]      calculation
``blocks.L.attn.hook_pattern``     attention probabilities                     [b, n, q, k]      —
``blocks.L.attn.hook_z``           attention context, before the projection    [b, s, n, d]      calculation
``blocks.L.hook_attn_out``         attention output (with its bias)            [b, s, h]         calculation
``blocks.L.hook_resid_mid``        residual stream between attention and MLP   [b, s, h]         —
``blocks.L.mlp.hook_pre``          MLP pre-activation (SwiGLU: the gate)       [b, s, f]         calculation
``blocks.L.mlp.hook_pre_linear``   SwiGLU's linear half                        [b, s, f]         —
``blocks.L.mlp.hook_post``         MLP activation, into the second linear      [b, s, f]         calculation
``blocks.L.hook_mlp_out``          MLP output (with its bias)                  [b, s, h]         calculation
``blocks.L.moe.hook_router_logits``  router logits, before the score function   [b, s, E]         calculation
``blocks.L.moe.hook_expert_choice``  the top-k experts per token (by weight)     [b, s, k]         —
``blocks.L.moe.hook_expert_weights`` their weights (probabilities into combine)  [b, s, k]         —
``blocks.L.hook_resid_post``       residual stream out of layer L              [b, s, h]         system
``ln_final.hook_normalized``       final norm output                           [b, s, h]         —
``hook_logits``                    logits over the real vocabulary             [b, s, vocab]     —
``blocks.L.attn.W_QKV/W_O``        attention weights                           (weight)          storage
``blocks.L.mlp.W_in/W_out``        MLP weights                                 (weight)          storage
=================================  ==========================================  ================  ===========

Unlike TransformerLens, ``hook_q``/``hook_k`` are taken after rotary embeddings (what attention uses; so after the
per-head query/key norms of ``GPTModule(qk_layernorm=True)`` too, which come before RoPE), and
``hook_k``/``hook_v`` have the model's key/value heads (query groups under GQA). Perturbing ``mlp.hook_pre``
of a SwiGLU MLP perturbs both halves. ``hook_pattern`` under ``layer_spec="sdpa"`` is recomputed from
``hook_q``/``hook_k`` for the captured layers (SDPA never materializes it); under ``"local"`` it is
megatron-core's own softmax output.

In a mixture-of-experts layer (``GPTModule(num_moe_experts=...)``: its MLP is megatron-core's ``MoELayer``) the
dense MLP's internals (``mlp.hook_pre``/``hook_pre_linear``/``hook_post``, ``mlp.W_in``/``W_out``) do not exist;
``hook_mlp_out`` is the layer's output after the experts' outputs are combined, and the ``moe.*`` points describe
its router. Each rank routes its own tokens (the router is replicated, not split over expert-parallel ranks), so
the router's tensors are laid out as the residual stream: whole on every tensor-parallel rank, split on the
sequence under sequence parallelism. ``hook_router_logits`` is reached through ``compat.router`` (no module
boundary carries it); perturbing it changes which experts are chosen, and ``kind="disable"`` with ``experts=[e]``
sets expert e's logit to ``-inf`` so it is never chosen. ``hook_expert_choice`` holds expert indices (int64; -1
where a token lost a slot to a capacity limit), highest weight first.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope.layout import ShardLayout

__all__ = [
    "ProbePoint",
    "SITE_GROUPS",
    "all_point_names",
    "chunks_of",
    "match_points",
    "moe_facts",
    "moe_layers_of",
    "point_names_of",
    "probe_points",
    "vocab_size_of",
]

Category = Literal["system", "calculation", "storage"]
When = Literal["pre", "post"]
Reader = Callable[[tuple, dict, Any], Optional[torch.Tensor]]
Writer = Callable[[tuple, dict, Any, torch.Tensor], Any]

SITE_GROUPS: dict[str, tuple[str, ...]] = {
    # MegatronApp's three perturbation places, as shorthands for sweeps and the UI.
    "storage": ("attn.W_QKV", "attn.W_O", "mlp.W_in", "mlp.W_out"),
    "calculation": ("hook_attn_out", "hook_mlp_out"),
    "system": ("hook_resid_post",),
}

_RESIDUAL = ShardLayout(sequence_parallel_split=True)  # [s, b, h], replicated over TP; split on s under SP


@dataclass(frozen=True, eq=False)
class ProbePoint:
    name: str
    layer: Optional[int]
    module: torch.nn.Module
    when: When
    layout: ShardLayout
    read: Reader
    write: Optional[Writer] = None
    category: Optional[Category] = None
    is_weight: bool = False
    half: Optional[int] = None
    """SwiGLU's fc1: which half of the assembled full tensor this point is (0: gate, 1: linear)."""
    head_dim: Optional[int] = None
    """Dimension of the heads in this rank's tensor (for head-targeted perturbation and pattern heads)."""
    num_heads: Optional[int] = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def capturable(self) -> bool:
        return not self.is_weight

    @property
    def perturbable(self) -> bool:
        return self.write is not None


# -- readers and writers of hook arguments ---------------------------------------------------------------
def _arg(index: int, name: str) -> tuple[Reader, Writer]:
    def read(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
        return kwargs[name] if name in kwargs else args[index]

    def write(args: tuple, kwargs: dict, output: Any, value: torch.Tensor) -> tuple[tuple, dict]:
        if name in kwargs:
            return args, {**kwargs, name: value}
        return (*args[:index], value, *args[index + 1 :]), kwargs

    return read, write


def _first_output() -> tuple[Reader, Writer]:
    def read(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
        return output[0]

    def write(args: tuple, kwargs: dict, output: Any, value: torch.Tensor) -> Any:
        return (value, *output[1:])

    return read, write


def _output_with_bias(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    out, bias = output[0], output[1]
    return out if bias is None else out + bias


def _tensor_output() -> tuple[Reader, Writer]:
    return (lambda args, kwargs, output: output), (lambda args, kwargs, output, value: value)


def _last_positions(index: int, name: str) -> tuple[Reader, Writer]:
    """Keys/values: with a KV cache, core attention gets every cached position; capture only the new ones."""
    read_all, write = _arg(index, name)
    read_query, _ = _arg(0, "query")

    def read(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
        return read_all(args, kwargs, output)[-read_query(args, kwargs, output).shape[0] :]

    return read, write


# -- the registry ------------------------------------------------------------------------------------------
def chunks_of(model: Any) -> list[torch.nn.Module]:
    """The megatron-core model chunks of a ``MegatronLightningModule``, a list of chunks, or one chunk."""
    chunks = getattr(model, "model_chunks", None)
    if chunks is None:
        chunks = model if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [model]
    unwrapped = [unwrap_model(chunk) for chunk in chunks]
    if not unwrapped or not all(hasattr(chunk, "decoder") for chunk in unwrapped):
        raise MegatronConfigError(
            "MegaScope probes megatron-core GPT models: pass a GPTModule (after configure_model), its "
            "model_chunks, or a megatron.core GPTModel."
        )
    return unwrapped


def vocab_size_of(model: Any) -> Optional[int]:
    """The real (unpadded) vocabulary of a ``GPTModule``; None for bare chunks (logits keep the padding)."""
    hparams = getattr(model, "hparams", None)
    return getattr(hparams, "vocab_size", None) if hparams is not None else None


def probe_points(chunks: Iterable[torch.nn.Module], vocab_size: Optional[int] = None) -> list[ProbePoint]:
    """Every probe point of these (unwrapped) chunks, in forward order per chunk."""
    points: list[ProbePoint] = []
    for chunk in chunks:
        config = chunk.config
        if getattr(chunk, "pre_process", False):
            read, write = _tensor_output()
            points.append(ProbePoint("hook_embed", None, chunk.embedding, "post", _RESIDUAL, read, write, "system"))
        for layer in chunk.decoder.layers:
            if isinstance(layer, TransformerLayer):
                points += _layer_points(layer, config)
        if getattr(chunk, "post_process", False):
            norm = getattr(chunk.decoder, "final_layernorm", None)
            if norm is not None:
                read, _ = _tensor_output()
                points.append(ProbePoint("ln_final.hook_normalized", None, norm, "post", _RESIDUAL, read))
            logits_layout = ShardLayout(tp_dim=2, trim_last=vocab_size)
            read, _ = _first_output()
            points.append(ProbePoint("hook_logits", None, chunk.output_layer, "post", logits_layout, read))
    return points


def _layer_points(layer: TransformerLayer, config: Any) -> list[ProbePoint]:
    L = int(layer.layer_number) - 1
    p = f"blocks.{L}."
    attention, mlp = layer.self_attention, layer.mlp
    core = attention.core_attention
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    gated = bool(config.gated_linear_unit)
    qkv_layout = ShardLayout(tp_dim=2)  # [s, b, heads/TP, d]
    points = []

    read, write = _arg(0, "hidden_states")
    points.append(ProbePoint(p + "hook_resid_pre", L, layer, "pre", _RESIDUAL, read, write, "system"))
    for index, (name, n) in enumerate((("q", heads), ("k", groups), ("v", groups))):
        arg_name = ("query", "key", "value")[index]
        read, write = _arg(0, "query") if index == 0 else _last_positions(index, arg_name)
        points.append(
            ProbePoint(
                p + f"attn.hook_{name}", L, core, "pre", qkv_layout, read, write, "calculation", head_dim=2, num_heads=n
            )
        )
    pattern_layout = ShardLayout(tp_dim=1, seq_dim=2, to_logical=(0, 1))  # [b, heads/TP, q, k]
    softmax = getattr(core, "scale_mask_softmax", None)
    if type(core).forward is DotProductAttention.forward and isinstance(softmax, torch.nn.Module):
        read, _ = _tensor_output()
        points.append(
            ProbePoint(p + "attn.hook_pattern", L, softmax, "post", pattern_layout, read, head_dim=1, num_heads=heads)
        )
    else:
        points.append(
            ProbePoint(
                p + "attn.hook_pattern",
                L,
                core,
                "pre",
                pattern_layout,
                _recomputed_pattern(core),
                head_dim=1,
                num_heads=heads,
                extras={"selects_heads": True},
            )
        )
    read, write = _tensor_output()
    z_layout = ShardLayout(tp_dim=2, heads=heads)
    points.append(
        ProbePoint(
            p + "attn.hook_z", L, core, "post", z_layout, read, write, "calculation", head_dim=2, num_heads=heads
        )
    )
    _, write = _first_output()
    points.append(
        ProbePoint(p + "hook_attn_out", L, attention, "post", _RESIDUAL, _output_with_bias, write, "calculation")
    )
    read, _ = _arg(0, "hidden_states")
    points.append(ProbePoint(p + "hook_resid_mid", L, layer.pre_mlp_layernorm, "pre", _RESIDUAL, read))
    if isinstance(mlp, MoELayer):
        return points + _moe_points(layer, mlp, p, L)
    fc1_layout = ShardLayout(tp_dim=2, gated=gated)
    _, write = _first_output()
    points.append(
        ProbePoint(
            p + "mlp.hook_pre",
            L,
            mlp.linear_fc1,
            "post",
            fc1_layout,
            _output_with_bias,
            write,
            "calculation",
            half=0 if gated else None,
        )
    )
    if gated:
        points.append(
            ProbePoint(
                p + "mlp.hook_pre_linear", L, mlp.linear_fc1, "post", fc1_layout, _output_with_bias,
                half=1,
            )
        )  # fmt: skip
    read, write = _arg(0, "input_")
    points.append(
        ProbePoint(p + "mlp.hook_post", L, mlp.linear_fc2, "pre", ShardLayout(tp_dim=2), read, write, "calculation")
    )
    _, write = _first_output()
    points.append(ProbePoint(p + "hook_mlp_out", L, mlp, "post", _RESIDUAL, _output_with_bias, write, "calculation"))
    read, write = _first_output()
    points.append(ProbePoint(p + "hook_resid_post", L, layer, "post", _RESIDUAL, read, write, "system"))
    weights = (
        ("attn.W_QKV", attention.linear_qkv, ShardLayout(tp_dim=0, seq_dim=None, to_logical=())),
        ("attn.W_O", attention.linear_proj, ShardLayout(tp_dim=1, seq_dim=None, to_logical=())),
        ("mlp.W_in", mlp.linear_fc1, ShardLayout(tp_dim=0, seq_dim=None, to_logical=(), gated=gated)),
        ("mlp.W_out", mlp.linear_fc2, ShardLayout(tp_dim=1, seq_dim=None, to_logical=())),
    )
    for name, module, layout in weights:
        points.append(
            ProbePoint(p + name, L, module, "pre", layout, _weight_reader, _weight_marker, "storage", is_weight=True)
        )
    return points


def _moe_points(layer: TransformerLayer, moe: MoELayer, p: str, L: int) -> list[ProbePoint]:
    """The points after ``hook_resid_mid`` of an MoE layer: its router's, then the combined output."""
    from lightning_megatron.compat.router import logits_site

    router = moe.router
    experts, topk = int(router.config.num_moe_experts), int(router.config.moe_router_topk)
    facts = {"experts": experts, "topk": topk}
    read, write = _tensor_output()
    points = [
        ProbePoint(
            p + "moe.hook_router_logits", L, logits_site(router), "post", _RESIDUAL, read, write, "calculation",
            extras=facts,
        ),
        ProbePoint(p + "moe.hook_expert_choice", L, router, "post", _RESIDUAL, _expert_choice(topk, 0), extras=facts),
        ProbePoint(p + "moe.hook_expert_weights", L, router, "post", _RESIDUAL, _expert_choice(topk, 1), extras=facts),
    ]  # fmt: skip
    _, write = _first_output()
    points.append(ProbePoint(p + "hook_mlp_out", L, moe, "post", _RESIDUAL, _output_with_bias, write, "calculation"))
    read, write = _first_output()
    points.append(ProbePoint(p + "hook_resid_post", L, layer, "post", _RESIDUAL, read, write, "system"))
    attention = layer.self_attention
    weights = (
        ("attn.W_QKV", attention.linear_qkv, ShardLayout(tp_dim=0, seq_dim=None, to_logical=())),
        ("attn.W_O", attention.linear_proj, ShardLayout(tp_dim=1, seq_dim=None, to_logical=())),
    )
    for name, module, layout in weights:
        points.append(
            ProbePoint(p + name, L, module, "pre", layout, _weight_reader, _weight_marker, "storage", is_weight=True)
        )
    return points


def _expert_choice(topk: int, part: int) -> Reader:
    """From the router's output (``probs`` and ``routing_map``, ``[tokens, experts]``) and its input's shape
    ``[s, b, h]``: the chosen experts highest weight first (``part`` 0, int64; -1 for a slot a capacity limit
    dropped) or their weights (``part`` 1; 0 there), ``[s, b, k]``."""

    def read(args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
        hidden = kwargs["input"] if "input" in kwargs else args[0]
        probs, routing_map = output[0], output[1]
        chosen = torch.where(routing_map, probs.detach().float(), float("-inf"))
        weights, experts = chosen.topk(topk, dim=-1)
        dropped = torch.isneginf(weights)
        shape = (*hidden.shape[:2], topk)
        if part == 0:
            return experts.masked_fill(dropped, -1).view(shape)
        return weights.masked_fill(dropped, 0.0).view(shape)

    return read


def _weight_reader(args: tuple, kwargs: dict, output: Any) -> None:
    return None  # weights are perturbed through the module (``scope.perturb``), never read from a hook


def _weight_marker(args: tuple, kwargs: dict, output: Any, value: torch.Tensor) -> Any:
    raise AssertionError("weights are replaced on the module, not in hook arguments")


def _recomputed_pattern(core: torch.nn.Module) -> Reader:
    """softmax(q·kᵀ·scale + causal mask) in fp32 from core attention's inputs (SDPA never materializes it)."""
    scale = float(core.softmax_scale) * (core.layer_number if core.config.apply_query_key_layer_scaling else 1)

    def read(args: tuple, kwargs: dict, output: Any, heads: Optional[list[int]] = None) -> torch.Tensor:
        """``heads``: this rank's head indices to compute (None: all)."""
        query = kwargs.get("query", args[0] if args else None)
        key = kwargs.get("key", args[1] if len(args) > 1 else None)
        q = query.float()
        k = key.float()
        if q.shape[2] != k.shape[2]:  # GQA: each key/value head serves a group of query heads
            k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        if heads is not None:
            q, k = q[:, :, heads], k[:, :, heads]
        scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
        sq, sk = q.shape[0], k.shape[0]
        # Query i sits at absolute position sk - sq + i (a KV cache holds the earlier keys).
        rows = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
        future = torch.arange(sk, device=q.device).unsqueeze(0) > rows
        return scores.masked_fill(future, float("-inf")).softmax(dim=-1)

    return read


def match_points(points: Sequence[ProbePoint], patterns: Sequence[str], *, what: str) -> list[ProbePoint]:
    """Points whose names match any glob in ``patterns`` (``blocks.*.hook_resid_post``); a group name
    (``storage``, ``calculation``, ``system``) stands for its sites in every layer."""
    chosen: list[ProbePoint] = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise MegatronConfigError(f"{what}: a probe name must be a non-empty string, got {pattern!r:.60}.")
        globs = [f"blocks.*.{site}" for site in SITE_GROUPS[pattern]] if pattern in SITE_GROUPS else [pattern]
        for point in points:
            if point not in chosen and any(fnmatch.fnmatchcase(point.name, glob) for glob in globs):
                chosen.append(point)
    return chosen


def all_point_names(num_layers: int, gated: bool, moe_layers: Sequence[int] = ()) -> list[str]:
    """Every name a model of ``num_layers`` layers has (on some rank), for ``info`` and validation; the layers
    in ``moe_layers`` are mixture-of-experts layers (router points, no dense-MLP internals)."""
    attention = [
        "hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern", "attn.hook_z",
        "hook_attn_out", "hook_resid_mid",
    ]  # fmt: skip
    dense = [
        *attention, "mlp.hook_pre", *(["mlp.hook_pre_linear"] if gated else []),
        "mlp.hook_post", "hook_mlp_out", "hook_resid_post", "attn.W_QKV", "attn.W_O", "mlp.W_in", "mlp.W_out",
    ]  # fmt: skip
    moe = [
        *attention, "moe.hook_router_logits", "moe.hook_expert_choice", "moe.hook_expert_weights",
        "hook_mlp_out", "hook_resid_post", "attn.W_QKV", "attn.W_O",
    ]  # fmt: skip
    chosen = set(moe_layers)
    names = ["hook_embed"]
    names += [f"blocks.{layer}.{site}" for layer in range(num_layers) for site in (moe if layer in chosen else dense)]
    return names + ["ln_final.hook_normalized", "hook_logits"]


def moe_layers_of(config: Any) -> list[int]:
    """The (global, 0-based) indices of the mixture-of-experts layers of a model with this config."""
    if not getattr(config, "num_moe_experts", None):
        return []
    from lightning_megatron.models.moe import moe_layer_pattern

    pattern = moe_layer_pattern(int(config.num_layers), config.moe_layer_freq)
    return [index for index, is_moe in enumerate(pattern) if is_moe]


def moe_facts(config: Any) -> dict[str, Any]:
    """What a UI needs to show the router (``info.engine.model.moe``): expert count, top-k, the MoE layers;
    empty for a dense model."""
    layers = moe_layers_of(config)
    if not layers:
        return {}
    return {"moe": {"experts": int(config.num_moe_experts), "topk": int(config.moe_router_topk), "layers": layers}}


def point_names_of(config: Any) -> list[str]:
    """``all_point_names`` of the model a megatron-core ``TransformerConfig`` describes."""
    return all_point_names(int(config.num_layers), bool(config.gated_linear_unit), moe_layers_of(config))
