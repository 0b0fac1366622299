"""Hugging Face checkpoints (GPT-2, Llama, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE) to and from ``GPTModule``, at
any tensor/pipeline/expert layout.

Shards are located through megatron-core's sharded state dict, as ``models.init`` does: every
``ShardedTensor`` of a chunk names a *global* tensor (``key``, ``global_shape``, with ``prepend_axis_num``
leading layer axes whose offsets are the global layer number) and where this rank's piece of it lies
(``global_offset``; ``data`` is the local parameter or a view of it). Import builds the full global tensor
of each key from the Hugging Face weights and copies out this rank's piece, so every layout reads the same
checkpoint with no resharding step. Export runs the other way: ranks send their pieces to global rank 0,
which assembles and converts them.

Layouts that differ between the two worlds:

* megatron-core fuses Q, K and V into one ``linear_qkv`` whose rows are grouped per query group
  ``[q heads of the group, k, v]`` (GQA aware); Hugging Face keeps ``[all q; all k; all v]``.
* SwiGLU ``linear_fc1`` is ``[gate; up]``.
* GPT-2 stores its linear layers as ``Conv1D`` (``[in, out]``, transposed).
* ``GPTModule`` pads the vocabulary to ``make_vocab_size_divisible_by``: padding rows are zeros on import
  and stripped on export.
* Mixtral's experts (``block_sparse_moe.experts.{e}.w1/w3/w2``, the layout ``save_pretrained`` writes) are one
  global tensor per layer in megatron-core, with a leading expert axis (``experts.experts.linear_fc1`` is
  ``[gate; up]`` per expert). Its router (softmax over all experts, top-k, weights renormalized over the k) is
  megatron-core's default top-k router (top-k over the logits, softmax over the k): the same weights.
* Qwen2's q/k/v biases are one ``linear_qkv.bias`` (``GPTModule(add_qkv_bias=True)``), grouped like the weight's
  rows. Qwen2-MoE's MoE layers (``mlp.experts.{e}.gate_proj/up_proj/down_proj``, router ``mlp.gate``) add a shared
  expert (``mlp.shared_expert.*``: megatron-core's ``shared_experts.linear_fc1/fc2``) whose ``[1, hidden]`` sigmoid
  gate ``mlp.shared_expert_gate.weight`` is megatron-core's ``shared_experts.gate_weight`` unchanged; its layers
  listed in ``mlp_only_layers`` are dense Llama MLPs. The routing and the other config fields: ``convert.hf_config``.
* Qwen3's per-head query and key norms (``self_attn.q_norm`` / ``k_norm``, ``[head_dim]``) are megatron-core's
  ``self_attention.q_layernorm`` / ``k_layernorm`` (``GPTModule(qk_layernorm=True)``) unchanged, whole on every
  tensor-parallel rank. Qwen3-MoE's MoE layers are Qwen2-MoE's without the shared expert.
* Models whose layers differ (``moe_layer_freq`` other than 1) have the layer number in their keys
  (``decoder.layers.3.mlp...``) instead of a leading layer axis; both are read.

Dependencies run one way: this module uses ``convert.hf_config`` (the ``config.json`` side, per family) and
``models.sharding`` and never imports ``models.gpt``, whose ``GPTModule(hf_checkpoint=...)`` calls
``load_hf_weights_``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.utils import unwrap_model

from lightning_megatron.convert.hf_config import gpt_kwargs_to_hf_config, hf_config_to_gpt_kwargs, hf_model_type
from lightning_megatron.models.sharding import sharded_tensors

__all__ = ["export_hf", "gpt_kwargs_to_hf_config", "hf_config_to_gpt_kwargs", "load_hf_weights_"]

_LAYERS = "decoder.layers."


# -- tensor layouts -------------------------------------------------------------------------------
def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[all q; all k; all v]`` rows to megatron-core's per-query-group ``[q of group, k, v]`` rows."""
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _qkv_from_megatron(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, ...]:
    rest = qkv.shape[1:]
    head_dim = qkv.shape[0] // (heads + 2 * groups)
    grouped = qkv.reshape(groups, -1, *rest)
    q, k, v = grouped.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


class _Rule:
    """One megatron-core tensor ↔ the Hugging Face tensors it is made of (``{i}``: the layer number)."""

    def __init__(
        self,
        hf: Sequence[str],
        to_megatron: Callable[..., torch.Tensor] = lambda t: t,
        from_megatron: Callable[[torch.Tensor], Sequence[torch.Tensor]] = lambda t: (t,),
    ) -> None:
        self.hf, self.to_megatron, self.from_megatron = tuple(hf), to_megatron, from_megatron

    def names(self, layer: Optional[int], expert: Optional[int] = None) -> list[str]:
        return [name.format(i=layer, e=expert) for name in self.hf]


def _t(t: torch.Tensor) -> torch.Tensor:
    return t.t()


def _swiglu_rule(gate: str, up: str) -> _Rule:
    """A SwiGLU ``linear_fc1`` (``[gate; up]``) from its two Hugging Face projections."""
    return _Rule([gate, up], lambda g, u: torch.cat([g, u], dim=0), lambda t: t.chunk(2, dim=0))


def _qwen_moe_rules(mlp: str, shared: bool) -> dict[str, _Rule]:
    """An MoE layer of Qwen2-MoE or Qwen3-MoE (``mlp``: its ``model.layers.{i}.mlp.`` prefix): router, experts and,
    for Qwen2-MoE (``shared``), the gated shared expert. The shared expert's gate (``nn.Linear(hidden, 1)``,
    ``[1, hidden]``) is megatron-core's ``gate_weight`` as it is; both apply a sigmoid to it."""
    rules = {
        "mlp.router.weight": _Rule([mlp + "gate.weight"]),
        "mlp.experts.experts.linear_fc1.weight": _swiglu_rule(
            mlp + "experts.{e}.gate_proj.weight", mlp + "experts.{e}.up_proj.weight"
        ),
        "mlp.experts.experts.linear_fc2.weight": _Rule([mlp + "experts.{e}.down_proj.weight"]),
    }
    if shared:
        rules.update(
            {
                "mlp.shared_experts.linear_fc1.weight": _swiglu_rule(
                    mlp + "shared_expert.gate_proj.weight", mlp + "shared_expert.up_proj.weight"
                ),
                "mlp.shared_experts.linear_fc2.weight": _Rule([mlp + "shared_expert.down_proj.weight"]),
                "mlp.shared_experts.gate_weight": _Rule([mlp + "shared_expert_gate.weight"]),
            }
        )
    return rules


def _rules(hp: dict[str, Any]) -> dict[str, _Rule]:
    """megatron-core key (``decoder.layers.`` keys without the layer number) → conversion rule."""
    heads = hp["num_attention_heads"]
    groups = hp.get("num_query_groups") or heads
    model_type = hf_model_type(hp)
    if model_type == "gpt2":
        p = "transformer."
        attn_t = lambda t: _qkv_to_megatron(*t.t().chunk(3, dim=0), groups=heads)  # noqa: E731
        attn_f = lambda t: (torch.cat(_qkv_from_megatron(t, heads, heads), dim=0).t(),)  # noqa: E731
        attn_bt = lambda t: _qkv_to_megatron(*t.chunk(3, dim=0), groups=heads)  # noqa: E731
        attn_bf = lambda t: (torch.cat(_qkv_from_megatron(t, heads, heads), dim=0),)  # noqa: E731
        transposed = dict(to_megatron=_t, from_megatron=lambda t: (t.t(),))
        rules = {
            "embedding.word_embeddings.weight": _Rule([p + "wte.weight"]),
            "embedding.position_embeddings.weight": _Rule([p + "wpe.weight"]),
            "decoder.final_layernorm.weight": _Rule([p + "ln_f.weight"]),
            "decoder.final_layernorm.bias": _Rule([p + "ln_f.bias"]),
            "output_layer.weight": _Rule(["lm_head.weight"]),
        }
        layer = {
            "input_layernorm.weight": _Rule([p + "h.{i}.ln_1.weight"]),
            "input_layernorm.bias": _Rule([p + "h.{i}.ln_1.bias"]),
            "self_attention.linear_qkv.weight": _Rule([p + "h.{i}.attn.c_attn.weight"], attn_t, attn_f),
            "self_attention.linear_qkv.bias": _Rule([p + "h.{i}.attn.c_attn.bias"], attn_bt, attn_bf),
            "self_attention.linear_proj.weight": _Rule([p + "h.{i}.attn.c_proj.weight"], **transposed),
            "self_attention.linear_proj.bias": _Rule([p + "h.{i}.attn.c_proj.bias"]),
            "pre_mlp_layernorm.weight": _Rule([p + "h.{i}.ln_2.weight"]),
            "pre_mlp_layernorm.bias": _Rule([p + "h.{i}.ln_2.bias"]),
            "mlp.linear_fc1.weight": _Rule([p + "h.{i}.mlp.c_fc.weight"], **transposed),
            "mlp.linear_fc1.bias": _Rule([p + "h.{i}.mlp.c_fc.bias"]),
            "mlp.linear_fc2.weight": _Rule([p + "h.{i}.mlp.c_proj.weight"], **transposed),
            "mlp.linear_fc2.bias": _Rule([p + "h.{i}.mlp.c_proj.bias"]),
        }
    else:
        p = "model.layers.{i}."
        rules = {
            "embedding.word_embeddings.weight": _Rule(["model.embed_tokens.weight"]),
            "decoder.final_layernorm.weight": _Rule(["model.norm.weight"]),
            "output_layer.weight": _Rule(["lm_head.weight"]),
        }
        layer = {
            "input_layernorm.weight": _Rule([p + "input_layernorm.weight"]),
            "self_attention.linear_qkv.weight": _Rule(
                [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                lambda q, k, v: _qkv_to_megatron(q, k, v, groups),
                lambda t: _qkv_from_megatron(t, heads, groups),
            ),
            "self_attention.linear_proj.weight": _Rule([p + "self_attn.o_proj.weight"]),
            "pre_mlp_layernorm.weight": _Rule([p + "post_attention_layernorm.weight"]),
            "mlp.linear_fc1.weight": _swiglu_rule(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            "mlp.linear_fc2.weight": _Rule([p + "mlp.down_proj.weight"]),
        }
        if model_type in ("qwen2", "qwen2_moe") and hp.get("add_qkv_bias"):
            layer["self_attention.linear_qkv.bias"] = _Rule(
                [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"],
                lambda q, k, v: _qkv_to_megatron(q, k, v, groups),
                lambda t: _qkv_from_megatron(t, heads, groups),
            )
        if model_type in ("qwen3", "qwen3_moe"):
            layer["self_attention.q_layernorm.weight"] = _Rule([p + "self_attn.q_norm.weight"])
            layer["self_attention.k_layernorm.weight"] = _Rule([p + "self_attn.k_norm.weight"])
        if model_type in ("qwen2_moe", "qwen3_moe"):  # dense layers (mlp_only_layers) keep the Llama MLP rules above
            layer.update(_qwen_moe_rules(p + "mlp.", shared=model_type == "qwen2_moe"))
        if model_type == "mixtral":
            moe = p + "block_sparse_moe."
            for key in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
                del layer[key]
            layer.update(
                {
                    "mlp.router.weight": _Rule([moe + "gate.weight"]),
                    "mlp.experts.experts.linear_fc1.weight": _swiglu_rule(
                        moe + "experts.{e}.w1.weight", moe + "experts.{e}.w3.weight"
                    ),
                    "mlp.experts.experts.linear_fc2.weight": _Rule([moe + "experts.{e}.w2.weight"]),
                }
            )
    # The local layer spec maps its norms to Transformer Engine's fused names in the sharded state dict.
    for norm, fused in (
        ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
        ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ):
        for key in [k for k in layer if k.startswith(norm)]:
            layer[fused + key[len(norm) :]] = layer[key]
    rules.update({_LAYERS + key: rule for key, rule in layer.items()})
    return rules


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


# -- reading Hugging Face checkpoints ---------------------------------------------------------------
class _HFReader:
    """Lazy access to the tensors of a local safetensors checkpoint (one file or an index of shards)."""

    def __init__(self, hf_dir: Union[str, Path]) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = {name: self.dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        elif (self.dir / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(self.dir / "model.safetensors", framework="pt") as f:
                self.files = {name: self.dir / "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir} has no model.safetensors or model.safetensors.index.json.")
        self._open: dict[Path, Any] = {}

    def resolve(self, name: str) -> Optional[str]:
        """The stored name of ``name``: GPT-2 checkpoints exist with and without the ``transformer.`` prefix."""
        if name in self.files:
            return name
        if name.startswith("transformer.") and name[len("transformer.") :] in self.files:
            return name[len("transformer.") :]
        return None

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        stored = self.resolve(name)
        if stored is None:
            raise KeyError(f"{name} is not in the checkpoint at {self.dir}.")
        path = self.files[stored]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(stored)


def read_hf_config(hf_dir: Union[str, Path]) -> dict[str, Any]:
    return json.loads((Path(hf_dir) / "config.json").read_text())


# -- import ---------------------------------------------------------------------------------------
def _chunk_list(module_or_chunks: Any) -> list[torch.nn.Module]:
    chunks = getattr(module_or_chunks, "model_chunks", module_or_chunks)
    if isinstance(chunks, torch.nn.Module) and not isinstance(chunks, torch.nn.ModuleList):
        chunks = [chunks]
    return [unwrap_model(chunk) for chunk in chunks]


_NUMBERED_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class _Piece:
    """Where one sharded tensor of this rank lies: the rule's key (``decoder.layers.`` keys without a layer number),
    its global layer and expert (None where the tensor has none), the global tensor's shape past those axes, and
    the slice of it this rank holds."""

    sharded: ShardedTensor
    key: str
    layer: Optional[int]
    expert: Optional[int]
    shape: tuple[int, ...]
    index: tuple[slice, ...]


def _local_pieces(chunks: Sequence[torch.nn.Module]) -> Iterator[_Piece]:
    """Each sharded tensor of ``chunks`` with its global layer (and expert) number and the slice it holds.

    The leading (``prepend_axis_num``) axes are the layer (stacked layers) and then the expert (an MoE layer's
    experts); a key with the layer number in it (``decoder.layers.3.``, non-homogeneous layers) has no layer
    axis."""
    for chunk in chunks:
        for sharded in sharded_tensors(chunk.sharded_state_dict()):
            if sharded.flattened_range is not None:
                raise NotImplementedError(f"{sharded.key}: flattened (distributed-optimizer) shards are not supported.")
            key, offsets = sharded.key, list(sharded.global_offset[: sharded.prepend_axis_num])
            numbered = _NUMBERED_LAYER.match(key)
            if numbered:
                layer: Optional[int] = int(numbered.group(1))
                key = _LAYERS + numbered.group(2)
            else:
                layer = offsets.pop(0) if offsets else None
            expert = offsets.pop(0) if ".experts.experts." in key and offsets else None
            if offsets:
                raise NotImplementedError(f"{sharded.key}: {sharded.prepend_axis_num} leading axes are not supported.")
            prepend = sharded.prepend_axis_num
            index = tuple(
                slice(offset, offset + size)
                for offset, size in zip(sharded.global_offset[prepend:], sharded.data.shape)
            )
            yield _Piece(sharded, key, layer, expert, tuple(sharded.global_shape[prepend:]), index)


def _pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit the model's padded {rows}.")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


@torch.no_grad()
def load_hf_weights_(chunks: Sequence[torch.nn.Module], hf_dir: Union[str, Path]) -> None:
    """Copy a Hugging Face checkpoint into ``chunks`` (this rank's model chunks), each rank its own shards.

    Every rank reads only the tensors its chunks hold (safetensors is memory-mapped), builds each global
    megatron-core tensor and copies out its piece, so no communication is needed and any layout works.
    Raises if a model tensor has no counterpart in the checkpoint or the shapes disagree.
    """
    chunks = _chunk_list(chunks)
    config = read_hf_config(hf_dir)
    rules = _rules(hf_config_to_gpt_kwargs(config))
    reader = _HFReader(hf_dir)
    tied = config.get("tie_word_embeddings", config.get("model_type") == "gpt2")
    cache: dict[tuple[str, Optional[int], Optional[int]], torch.Tensor] = {}
    for piece in _local_pieces(chunks):
        key, layer, where = piece.key, piece.layer, (piece.key, piece.layer, piece.expert)
        if where not in cache:
            if key not in rules:
                raise KeyError(f"No Hugging Face counterpart for megatron-core tensor {key!r}.")
            rule = rules[key]
            if key == "output_layer.weight" and (tied or reader.resolve("lm_head.weight") is None):
                rule = rules["embedding.word_embeddings.weight"]
            full = rule.to_megatron(*(reader.get(name) for name in rule.names(layer, piece.expert)))
            if key in _VOCAB_KEYS:
                full = _pad_vocab(full, piece.shape[0])
            if tuple(full.shape) != piece.shape:
                raise ValueError(
                    f"{key} (layer {layer}): checkpoint gives {tuple(full.shape)}, model has {piece.shape}."
                )
            cache.clear()  # pieces of one global tensor come in a row; keep just that one
            cache[where] = full
        piece.sharded.data.copy_(cache[where][piece.index])


# -- export ---------------------------------------------------------------------------------------
_Where = tuple[str, Optional[int], Optional[int]]  # (rule key, layer, expert)


def _comm_device() -> torch.device:
    """Where pieces travel: NCCL moves CUDA tensors only, gloo CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_tensors(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[_Where, Optional[torch.Tensor]]]:
    """Each global tensor in turn, whole on global rank 0 (``None`` on the other ranks, which send their pieces).

    One tensor is assembled at a time, so rank 0 holds its own chunks plus one global tensor, not the model: the
    ranks first share where every main-replica piece lies (metadata only), then all walk the same list of
    global tensors, each rank sending rank 0 the pieces it holds as rank 0 asks for them. Every rank must
    consume the whole iterator."""
    local = [p for p in _local_pieces(chunks) if is_main_replica(p.sharded.replica_id)]
    meta = [((p.key, p.layer, p.expert), p.index, p.shape, p.sharded.data.dtype) for p in local]
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if dist:
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, meta)
        rank, device = torch.distributed.get_rank(), _comm_device()
    else:
        everyone, rank, device = [meta], 0, torch.device("cpu")
    order: dict[_Where, list[tuple[int, int]]] = {}  # where -> [(rank, its n-th piece)]
    for source, pieces in enumerate(everyone):
        for n, (where, *_) in enumerate(pieces):
            order.setdefault(where, []).append((source, n))
    for where, holders in order.items():
        full = None
        if rank == 0:
            _, _, shape, dtype = everyone[holders[0][0]][holders[0][1]]
            full = torch.zeros(shape, dtype=dtype)
        for source, n in holders:
            _, index, _, dtype = everyone[source][n]
            if source == rank == 0:
                full[index] = local[n].sharded.data.detach().cpu()
            elif rank == 0:
                buffer = torch.empty(full[index].shape, dtype=dtype, device=device)
                torch.distributed.recv(buffer, src=source)
                full[index] = buffer.cpu()
            elif source == rank:
                torch.distributed.send(local[n].sharded.data.detach().to(device).contiguous(), dst=0)
        yield where, full


def _check_out_dir(out_dir: Union[str, Path]) -> Path:
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"export_hf: out_dir {str(path)!r} exists and is not a directory; pass a directory to write.")
    return path


@torch.no_grad()
def export_hf(
    module_or_chunks: Any,
    out_dir: Union[str, Path],
    gpt_kwargs: Optional[dict[str, Any]] = None,
    base_config: Optional[dict[str, Any]] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: Union[int, str] = "5GB",
) -> None:
    """Write a ``GPTModule`` (or its model chunks) as a Hugging Face checkpoint; call on every rank.

    Global rank 0 assembles one global tensor at a time from the ranks' pieces and writes ``config.json`` and
    the weights as ``save_pretrained`` lays them out: ``model.safetensors`` where they fit in one shard of
    ``max_shard_size`` (bytes, or a size such as ``"5GB"``), else numbered shards and
    ``model.safetensors.index.json``; earlier shards in ``out_dir`` are replaced. Rank 0's memory is its own
    chunks plus one shard, whatever the model's size. Every rank returns once the files are written, and raises
    if rank 0 could not write them. ``gpt_kwargs`` defaults to the module's hparams (when passing chunks, pass the
    module's full hyperparameters, ``dict(module.hparams)``: a missing one is an error on every rank); the config
    starts from ``base_config``, else from the ``config.json`` of the module's ``hf_checkpoint``, so fields the
    conversion does not own (token ids, ...) survive a round trip. ``dtype`` casts the weights (default: as
    stored in the model).
    """
    from lightning_megatron.convert.shards import ShardWriter, parse_size

    hp = dict(gpt_kwargs if gpt_kwargs is not None else getattr(module_or_chunks, "hparams", {}))
    if not hp:
        raise ValueError("export_hf needs a GPTModule, or its chunks and gpt_kwargs.")
    if base_config is None and hp.get("hf_checkpoint"):
        base_config = read_hf_config(hp["hf_checkpoint"])
    try:  # before any communication, so a bad argument fails on every rank
        rules = _rules(hp)
        config = gpt_kwargs_to_hf_config(hp, base_config)
    except KeyError as missing:
        raise ValueError(
            f"export_hf: gpt_kwargs has no {missing}; pass the module's full hyperparameters (dict(module.hparams))."
        ) from None
    parse_size(max_shard_size)
    out_path = _check_out_dir(out_dir)
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    writer = None
    failure: Optional[str] = None
    if not dist or torch.distributed.get_rank() == 0:
        try:
            writer = ShardWriter(out_path, max_shard_size)
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
    tied = hp["share_embeddings_and_output_weights"]
    for (key, layer, expert), full in _global_tensors(_chunk_list(module_or_chunks)):
        if full is None or failure is not None or (key == "output_layer.weight" and tied):
            continue  # rank 0 keeps receiving after a failure, so no rank is left waiting on a send
        try:
            if key not in rules:
                raise KeyError(f"No Hugging Face counterpart for megatron-core tensor {key!r}.")
            if key in _VOCAB_KEYS:
                full = full[: hp["vocab_size"]]
            for name, tensor in zip(rules[key].names(layer, expert), rules[key].from_megatron(full)):
                writer.add(name, tensor.to(dtype or tensor.dtype))
        except Exception as error:  # noqa: BLE001 - told to every rank below, which would otherwise wait
            failure = f"{type(error).__name__}: {error}"
    if writer is not None and failure is None:
        try:
            writer.close()
            (out_path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
    if writer is not None and failure is not None:
        writer.discard()
    if dist:
        status = [failure]
        torch.distributed.broadcast_object_list(status, src=0)
        failure = status[0]
    if failure is not None:
        raise RuntimeError(f"export_hf could not write {str(out_path)!r} on global rank 0: {failure}")
