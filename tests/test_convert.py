"""Hugging Face conversion: small random ``transformers`` models into ``GPTModule`` at several layouts and back.

Forward: the logits of the converted model (all of them, gathered over tensor-parallel ranks, on the last
pipeline stage) and its validation loss match the ``transformers`` model on the same tokens. Everything is
fp32 on CPU, so the only differences are the order of floating-point operations: we require 1e-4 absolute
on logits of magnitude up to ~8 (weights drawn with std 0.2) and 1e-5 relative on the loss (measured at
every layout: at most 1e-5 absolute on logits, 1.5e-7 relative on the loss).

Round trip: HF → GPTModule (at each layout) → ``export_hf`` gives bit-identical tensors (``torch.equal``)
under the same names, and a config with every original field unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import dpp_cases as dc
import pytest
import torch
from trainers import quiet_trainer

from lightning_megatron.convert import gpt_kwargs_to_hf_config, hf_config_to_gpt_kwargs
from lightning_megatron.models import GPTModule

SEQ = 16
BATCH = 4
LAYOUTS = {
    "single": (1, {}),
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "tp2-pp2": (4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
}
LOGITS_ATOL = 1e-4
LOSS_REL = 1e-5


class RecordingGPT(GPTModule):
    """Keeps the last stage's logits (what the padded-vocabulary loss function receives)."""

    def forward_step(self, batch: dict[str, torch.Tensor], chunk: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        output, loss_fn = super().forward_step(batch, chunk)

        def recording(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.recorded.append(out.detach().clone())
            return loss_fn(out)

        return output, recording


def convert_and_export(
    world_size: int, hf_dir: str, out_dir: str, sequence: torch.Tensor, max_shard_size: Any = "5GB", **strategy: Any
) -> dict:
    """Runs on every rank: load ``hf_dir`` at this layout, validate on ``sequence``, export to ``out_dir``."""
    from megatron.core import parallel_state

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.convert import export_hf

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    kwargs = hf_config_to_gpt_kwargs(config)
    module = RecordingGPT(**kwargs, hf_checkpoint=hf_dir)
    module.recorded = []
    trainer = quiet_trainer(
        devices=world_size,
        strategy=MegatronAppStrategy(micro_batch_size=2, timeout=60, **strategy),
        limit_val_batches=1.0,
        use_distributed_sampler=False,
    )
    batch = {"tokens": sequence[:, :-1].contiguous(), "labels": sequence[:, 1:].contiguous()}
    (metrics,) = trainer.validate(
        module, dataloaders=torch.utils.data.DataLoader([batch], batch_size=None), verbose=False
    )
    logits = None
    if module.recorded:
        local = torch.cat(module.recorded)
        parts = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)[..., : kwargs["vocab_size"]]
    export_hf(module, out_dir, dtype=None, max_shard_size=max_shard_size)
    return {"val_loss": float(metrics["val_loss"]), "logits": logits}


def _models() -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=250,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    llama = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=250,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    mixtral = transformers.MixtralConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=250,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    qwen = dict(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=250,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    qwen2 = transformers.Qwen2Config(**qwen, tie_word_embeddings=True)
    # 4 experts, top-2, a gated shared expert, layer 1 dense (mlp_only_layers); the released models' routing
    # (norm_topk_prob=False: softmax over all experts, top 2, no renormalization) and Mixtral's (True)
    moe = dict(qwen, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    moe.update(shared_expert_intermediate_size=80, tie_word_embeddings=False)
    # Qwen3: per-head q/k norms, heads of 24 (not 64 / 4 = 16), GQA; tied and untied. Qwen3-MoE: 4 experts, top-2,
    # no shared expert, layer 2 dense, the released models' routing (norm_topk_prob=True)
    qwen3 = dict(qwen, head_dim=24)
    qwen3_moe = dict(qwen3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[2])
    return {
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**qwen3, tie_word_embeddings=True)),
        "qwen3_untied": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**qwen3, tie_word_embeddings=False)),
        "qwen3_moe": (
            transformers.Qwen3MoeForCausalLM,
            transformers.Qwen3MoeConfig(**qwen3_moe, norm_topk_prob=True, tie_word_embeddings=False),
        ),
        "qwen2": (transformers.Qwen2ForCausalLM, qwen2),
        "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(**moe, norm_topk_prob=False)),
        "qwen2_moe_norm": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(**moe, norm_topk_prob=True)),
        "gpt2": (transformers.GPT2LMHeadModel, gpt2),
        "llama": (transformers.LlamaForCausalLM, llama),
        "mixtral": (transformers.MixtralForCausalLM, mixtral),
    }


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved_model(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def mixtral_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved_model("mixtral", tmp_path_factory)


def _saved_model(name: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A random ``transformers`` model saved as safetensors, tokens, and its reference logits and loss."""
    model_cls, config = _models()[name]
    torch.manual_seed(0)
    config.initializer_range = 0.2  # logits of order 1-10, so the tolerances mean something
    model = model_cls(config).eval()
    with torch.no_grad():  # random, not the near-zero default init of some biases/norms: every tensor matters
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    hf_dir = tmp_path_factory.mktemp(name)
    model.save_pretrained(hf_dir, safe_serialization=True)
    sequence = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=sequence[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), sequence[:, 1:].reshape(-1))
    return {"dir": hf_dir, "sequence": sequence, "logits": logits, "loss": float(loss), "name": name}


def _read(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: ``model.safetensors``, or the shards its index names."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if not index.exists():
        return load_file(str(path / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(str(path / shard)))
    return tensors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_forward_and_round_trip(ranks: Any, hf_model: dict[str, Any], layout: str, tmp_path: Path) -> None:
    _check_forward_and_round_trip(ranks, hf_model, layout, *LAYOUTS[layout], tmp_path)


MOE_LAYOUTS = {
    "single": (1, {}),
    "ep2": (2, {"expert_model_parallel_size": 2}),
    "tp2-sp-ep2": (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2}),
    "pp2-ep2": (4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_mixtral_forward_and_round_trip(ranks: Any, mixtral_model: dict[str, Any], layout: str, tmp_path: Path) -> None:
    """A Mixtral-style checkpoint (4 experts, top-2, GQA) with its experts split over ranks: the router picks the
    same experts with the same weights, so logits match as for dense models, and export gives the same tensors."""
    _check_forward_and_round_trip(ranks, mixtral_model, layout, *MOE_LAYOUTS[layout], tmp_path)


def _check_forward_and_round_trip(
    ranks: Any, hf_model: dict[str, Any], layout: str, world_size: int, strategy: dict[str, Any], tmp_path: Path
) -> None:
    out_dir = tmp_path / "export"
    results = ranks.run(
        world_size, convert_and_export, world_size, str(hf_model["dir"]), str(out_dir), hf_model["sequence"], **strategy
    )

    for rank, result in enumerate(results):
        assert result["val_loss"] == pytest.approx(hf_model["loss"], rel=LOSS_REL), f"rank {rank}"
    last_stage = [r["logits"] for r in results if r["logits"] is not None]
    assert last_stage
    for logits in last_stage:
        diff = (logits - hf_model["logits"]).abs().max().item()
        assert diff <= LOGITS_ATOL, f"{hf_model['name']} {layout}: max |logits diff| = {diff:.2e}"

    original, exported = _read(hf_model["dir"]), _read(out_dir)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    original_config = json.loads((hf_model["dir"] / "config.json").read_text())
    exported_config = json.loads((out_dir / "config.json").read_text())
    changed = {k: (v, exported_config.get(k)) for k, v in original_config.items() if exported_config.get(k) != v}
    assert not changed
    assert hf_config_to_gpt_kwargs(exported_config) == hf_config_to_gpt_kwargs(original_config)


QWEN_LAYOUTS = {
    "qwen2-single": ("qwen2", 1, {}),
    "qwen2-tp2-sp": ("qwen2", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "qwen2-pp2": ("qwen2", 2, {"pipeline_model_parallel_size": 2}),
    "qwen2_moe-single": ("qwen2_moe", 1, {}),
    "qwen2_moe-tp2-sp-ep2": ("qwen2_moe", 4, MOE_LAYOUTS["tp2-sp-ep2"][1]),
    "qwen2_moe-pp2-ep2": ("qwen2_moe", 4, MOE_LAYOUTS["pp2-ep2"][1]),
    "qwen2_moe_norm-single": ("qwen2_moe_norm", 1, {}),
    "qwen2_moe_norm-ep2": ("qwen2_moe_norm", 2, MOE_LAYOUTS["ep2"][1]),
}


@pytest.fixture(scope="module")
def qwen_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return {name: _saved_model(name, tmp_path_factory) for name in ("qwen2", "qwen2_moe", "qwen2_moe_norm")}


@pytest.mark.parametrize("layout", list(QWEN_LAYOUTS))
def test_qwen_forward_and_round_trip(ranks: Any, qwen_models: dict[str, Any], layout: str, tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases, tied embeddings) and Qwen2-MoE (a gated shared expert, a dense layer, both routings):
    logits as transformers' at one process and with the model split over tensor (+ sequence), pipeline and expert
    ranks, and export gives back the same tensors and config."""
    name, world_size, strategy = QWEN_LAYOUTS[layout]
    _check_forward_and_round_trip(ranks, qwen_models[name], layout, world_size, strategy, tmp_path)


def test_qwen_configs_map_both_ways() -> None:
    """What a Qwen config becomes (the fields the tensors cannot show), and what is refused."""
    models = _models()
    dense = hf_config_to_gpt_kwargs(models["qwen2"][1].to_dict())
    assert dense["add_qkv_bias"] and dense["share_embeddings_and_output_weights"] and not dense["add_bias_linear"]
    moe_config = models["qwen2_moe"][1].to_dict()
    moe = hf_config_to_gpt_kwargs(moe_config)
    assert moe["moe_layer_freq"] == [1, 0, 1, 1] and moe["moe_router_pre_softmax"] and moe["moe_shared_expert_gate"]
    assert (moe["ffn_hidden_size"], moe["moe_ffn_hidden_size"], moe["moe_shared_expert_intermediate_size"]) == (
        96,
        32,
        80,
    )
    assert not hf_config_to_gpt_kwargs(models["qwen2_moe_norm"][1].to_dict())["moe_router_pre_softmax"]
    # decoder_sparse_step=2: layers 1 and 3 (transformers' (i + 1) % step), not megatron-core's integer 2 (0 and 2)
    stepped = hf_config_to_gpt_kwargs({**moe_config, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert stepped["moe_layer_freq"] == [0, 1, 0, 1]
    exported = gpt_kwargs_to_hf_config({**stepped, "moe_layer_freq": 2})  # megatron-core's every 2nd: 0 and 2
    assert (exported["decoder_sparse_step"], exported["mlp_only_layers"]) == (1, [1, 3])
    assert hf_config_to_gpt_kwargs(exported)["moe_layer_freq"] == [1, 0, 1, 0]
    for refused, match in (
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, r"sliding-attention layers \[3\]"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "'yarn'"),
    ):
        for config in (models["qwen2"][1].to_dict(), moe_config):
            with pytest.raises(NotImplementedError, match=match):
                hf_config_to_gpt_kwargs({**config, **refused})
    with pytest.raises(NotImplementedError, match="shared_expert_intermediate_size=0"):
        hf_config_to_gpt_kwargs({**moe_config, "shared_expert_intermediate_size": 0})
    # A shared expert without Qwen's gate is neither Mixtral nor Qwen2-MoE
    with pytest.raises(NotImplementedError, match="moe_shared_expert_gate=True"):
        gpt_kwargs_to_hf_config({**moe, "moe_shared_expert_gate": False})


QWEN3_LAYOUTS = {
    "qwen3-single": ("qwen3", 1, {}),
    "qwen3-tp2-sp": ("qwen3", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "qwen3_untied-pp2": ("qwen3_untied", 2, {"pipeline_model_parallel_size": 2}),
    "qwen3_moe-single": ("qwen3_moe", 1, {}),
    "qwen3_moe-ep2": ("qwen3_moe", 2, MOE_LAYOUTS["ep2"][1]),
    "qwen3_moe-tp2-sp": ("qwen3_moe", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "qwen3_moe-pp2": ("qwen3_moe", 2, {"pipeline_model_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return {name: _saved_model(name, tmp_path_factory) for name in ("qwen3", "qwen3_untied", "qwen3_moe")}


@pytest.mark.parametrize("layout", list(QWEN3_LAYOUTS))
def test_qwen3_forward_and_round_trip(ranks: Any, qwen3_models: dict[str, Any], layout: str, tmp_path: Path) -> None:
    """Qwen3 (per-head q/k norms, head_dim 24 != hidden / heads, GQA, tied and untied embeddings) and Qwen3-MoE (no
    shared expert, a dense layer): logits as transformers' at one process and split over tensor (+ sequence),
    pipeline and expert ranks, and export gives back the same tensors and config."""
    name, world_size, strategy = QWEN3_LAYOUTS[layout]
    _check_forward_and_round_trip(ranks, qwen3_models[name], layout, world_size, strategy, tmp_path)


def test_qwen3_configs_map_both_ways() -> None:
    """What a Qwen3 config becomes, what an equivalent GPTModule exports, and what is refused."""
    models = _models()
    dense_config = models["qwen3"][1].to_dict()
    dense = hf_config_to_gpt_kwargs(dense_config)
    assert dense["qk_layernorm"] and dense["kv_channels"] == 24 and not dense.get("add_qkv_bias")
    assert dense["share_embeddings_and_output_weights"] and dense["num_query_groups"] == 2
    moe_config = models["qwen3_moe"][1].to_dict()
    moe = hf_config_to_gpt_kwargs(moe_config)
    assert moe["qk_layernorm"] and moe["moe_layer_freq"] == [1, 1, 0, 1] and not moe["moe_router_pre_softmax"]
    assert (moe["ffn_hidden_size"], moe["moe_ffn_hidden_size"], moe["moe_router_topk"]) == (96, 32, 2)
    assert moe.get("moe_shared_expert_intermediate_size") is None
    assert hf_config_to_gpt_kwargs({**moe_config, "norm_topk_prob": False})["moe_router_pre_softmax"]
    # From the GPTModule arguments alone (no base config): head_dim is written even where it is hidden / heads,
    # since transformers' Qwen3 default is 128
    for kwargs, model_type in ((dense, "qwen3"), (moe, "qwen3_moe")):
        plain = {**kwargs, "kv_channels": None}
        exported = gpt_kwargs_to_hf_config(plain)
        assert exported["model_type"] == model_type and exported["head_dim"] == 16
        assert not exported["attention_bias"] and not exported["use_sliding_window"]
        assert hf_config_to_gpt_kwargs(exported) == plain
    for refused, match in (
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "'yarn'"),
        ({"attention_bias": True}, "attention_bias"),
    ):
        for config in (dense_config, moe_config):
            with pytest.raises(NotImplementedError, match=match):
                hf_config_to_gpt_kwargs({**config, **refused})
    with pytest.raises(NotImplementedError, match="convert it as a 'qwen3'"):
        hf_config_to_gpt_kwargs({**moe_config, "mlp_only_layers": [0, 1, 2, 3]})
    # q/k norms with a qkv bias, a shared expert or GPT-2's layout have no Hugging Face family here
    for unexportable in (
        {**dense, "add_qkv_bias": True},
        {**moe, "moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True},
        {**hf_config_to_gpt_kwargs(models["gpt2"][1].to_dict()), "qk_layernorm": True},
    ):
        with pytest.raises(NotImplementedError, match="qk_layernorm=True"):
            gpt_kwargs_to_hf_config(unexportable)
    # Without the norms, the same arguments are Llama and Mixtral-like again
    assert gpt_kwargs_to_hf_config({**dense, "qk_layernorm": False})["model_type"] == "llama"


# -- sharded export -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _saved_model("llama", tmp_path_factory)


def test_sharded_export_is_what_save_pretrained_writes(ranks: Any, llama_model: dict[str, Any], tmp_path: Path) -> None:
    """At TP2 x PP2, shards of at most 40 kB (the model is ~230 kB): rank 0 assembles one tensor at a time and
    writes numbered shards and an index as ``save_pretrained`` does; ``transformers`` loads them to the same
    logits, and the tensors are the original ones, bit for bit. An export into the same folder replaces them."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "export"
    strategy = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    ranks.run(4, convert_and_export, 4, str(llama_model["dir"]), str(out), llama_model["sequence"], 40_000, **strategy)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 5 and set(index["weight_map"].values()) == set(shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors" and not (out / "model.safetensors").exists()
    original = _read(llama_model["dir"])
    exported = _read(out)
    assert sorted(exported) == sorted(original) == sorted(index["weight_map"])
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    from safetensors import safe_open

    for shard in shards:  # within the limit, or one tensor larger than it (the 64 kB embedding)
        with safe_open(str(out / shard), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1, (shard, sizes)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=llama_model["sequence"][:, :-1]).logits
    assert torch.equal(logits, llama_model["logits"])

    ranks.run(1, convert_and_export, 1, str(out), str(out), llama_model["sequence"])  # import the shards, export
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert all(torch.equal(t, original[name]) for name, t in _read(out).items())


def export_into(out_dir: str) -> Optional[str]:
    """Export a tiny model at TP2 into ``out_dir``; what ``export_hf`` raised on this rank."""
    from lightning_megatron.convert import export_hf
    from lightning_megatron.models.loading import prepare

    module = GPTModule(**TINY_LLAMA)
    prepare(module, devices=2, accelerator="cpu", tensor_model_parallel_size=2, strategy_options={"timeout": 60})
    try:
        export_hf(module, out_dir)
    except RuntimeError as error:
        return str(error)
    return None


TINY_LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, **dc.llama_model())


def test_an_export_rank_0_cannot_write_fails_on_every_rank(ranks: Any, tmp_path: Path) -> None:
    """Only rank 0 writes; where it cannot (here: the folder would be inside a file), every rank raises with
    rank 0's reason instead of returning as if the export had worked, and none waits for the others."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    errors = ranks.run(2, export_into, str(blocker / "export"))
    assert all(e is not None and "on global rank 0" in e and "a-file" in e for e in errors), errors


def test_shard_sizes_are_checked_and_stale_shards_go(tmp_path: Path) -> None:
    from lightning_megatron.convert.shards import ShardWriter, parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(123) == 123
    for bad in ("5 parsecs", "-1GB", 0, "0"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)
    writer = ShardWriter(tmp_path, max_shard_size=100)
    for i in range(3):
        writer.add(f"t{i}", torch.zeros(20))  # 80 bytes: one a shard
    assert [p.name for p in writer.close()] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    with pytest.raises(ValueError, match="added twice"):
        again = ShardWriter(tmp_path)
        again.add("t0", torch.zeros(1))
        again.add("t0", torch.zeros(1))
    again.discard()
    single = ShardWriter(tmp_path)
    single.add("t0", torch.ones(2))
    single.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
