"""``GPTModule(qk_layernorm=True)`` (Qwen3's layout: an RMSNorm over each head's query and key before RoPE): losses
of a Llama-shaped tiny model with those norms, and heads wider than ``hidden / heads`` (``kv_channels``), equal one
process's within 1e-3 on every layer spec (the fused norms included), at TP2 + SP (the ``[head_dim]`` weights whole
on both ranks, their gradients summed: they stay equal), at PP2 and at CP2 (ring attention); the norms train, and a
checkpoint saved at TP2 resumes at TP1 as the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import dpp_cases as dc
import pytest
from cases import fit_gpt

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.models import GPTModule

HEAD_DIM = 16  # cases.TINY_MODEL: hidden 32, 4 heads -> 8 by default
MODEL = {"layer_spec": "sdpa", "qk_layernorm": True, "kv_channels": HEAD_DIM, "layernorm_epsilon": 1e-6}
MODEL.update(dc.llama_model())
STEPS, SAVE_EVERY = 4, 2
LAYOUTS = {
    "local": (1, {"layer_spec": "local"}, {}),
    "sdpa+fused": (1, {"layer_spec": "sdpa+fused"}, {}),
    "tp2-sp": (2, {}, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2": (2, {}, {"pipeline_model_parallel_size": 2}),
    "cp2": (2, {}, {"context_parallel_size": 2}),
}


def qk_norms(module: GPTModule) -> dict[str, Any]:
    """This rank's first-layer query/key norms: type, shape, epsilon, how far training moved them from ones, and
    the values (compared across tensor-parallel ranks)."""
    attention = module.model_chunks[0].decoder.layers[0].self_attention
    q, k = attention.q_layernorm, attention.k_layernorm
    return {
        "type": type(q).__name__,
        "shape": tuple(q.weight.shape),
        "eps": q.eps,
        "moved": float((q.weight.detach() - 1).abs().sum() + (k.weight.detach() - 1).abs().sum()),
        "values": (q.weight.detach().clone(), k.weight.detach().clone()),
    }


def fit(world_size: int, ckpt_dir: Optional[str] = None, resume: Optional[str] = None, **kwargs: Any) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = {**MODEL, **kwargs.pop("model", {})}
    trainer: dict[str, Any] = {"limit_val_batches": 0}
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_EVERY, save_top_k=-1))
        trainer["enable_checkpointing"] = True
    return fit_gpt(
        world_size,
        steps=STEPS,
        model=model,
        trainer=trainer,
        callbacks=callbacks,
        ckpt_path=resume,
        probe=qk_norms,
        **kwargs,
    )


@pytest.fixture(scope="module")
def one_process(ranks: Any) -> dict[str, Any]:
    return ranks.run(1, fit, 1)[0]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_the_norms_are_per_head_rmsnorms_and_train(one_process: dict[str, Any]) -> None:
    probe = one_process["probe"]
    assert probe["type"] == "RMSNorm" and probe["shape"] == (HEAD_DIM,) and probe["eps"] == 1e-6
    assert probe["moved"] > 0, "the norms start at ones and must train"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qk_layernorm_losses_equal_one_process(ranks: Any, one_process: dict[str, Any], layout: str) -> None:
    world, model, strategy = LAYOUTS[layout]
    results = ranks.run(world, fit, world, model=model, **strategy)
    for rank, got in enumerate(results):
        for step, (a, b) in enumerate(zip(got["loss"], one_process["loss"], strict=True)):
            assert _close(a, b, 1e-3), f"{layout} rank {rank}: step {step} loss {a} vs {b}"
    if strategy.get("tensor_model_parallel_size") == 2:
        (q0, k0), (q1, k1) = (got["probe"]["values"] for got in results)
        assert q0.shape == (HEAD_DIM,), "per-head norm weights are whole on every tensor-parallel rank"
        assert q0.equal(q1) and k0.equal(k1), "their summed gradients keep the ranks' copies equal"


def test_qk_layernorm_checkpoint_resumes_at_another_tensor_parallel_size(ranks: Any, tmp_path: Path) -> None:
    tp2 = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    full = ranks.run(2, fit, 2, str(tmp_path / "saved"), **tp2)[0]
    resume = str(tmp_path / "saved" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    (got,) = ranks.run(1, fit, 1, str(tmp_path / "resumed"), resume)
    tail = full["loss"][SAVE_EVERY:]
    assert got["global_step"] == STEPS and len(got["loss"]) == len(tail)
    for step, (a, b) in enumerate(zip(got["loss"], tail), start=SAVE_EVERY + 1):
        assert _close(a, b, 1e-3), f"step {step} loss {a} != uninterrupted {b}"


def test_qk_layernorm_is_an_argument_not_an_override() -> None:
    with pytest.raises(MegatronConfigError, match=r"GPTModule\(qk_layernorm=...\)"):
        GPTModule(transformer_config_overrides={"qk_layernorm": True})


def test_megascope_sees_the_normed_queries_and_keys_at_tp2_sp(ranks: Any) -> None:
    """MegaScope's attention points (``hook_q``/``hook_k`` after the norms, ``hook_pattern``, ...) of a model with
    query/key norms are the same at TP2 + SP as in one process, and differ from the model without them."""
    import torch
    from scope_cases import LLAMA_STYLE, captures_at_layout

    model = {**LLAMA_STYLE, "qk_layernorm": True}
    want = ranks.run(1, captures_at_layout, 1, model)[0]
    plain = ranks.run(1, captures_at_layout, 1, LLAMA_STYLE)[0]
    assert sorted(want) == sorted(plain), "the same probe points"
    assert not torch.allclose(want["blocks.0.attn.hook_q"], plain["blocks.0.attn.hook_q"])
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    got = ranks.run(2, captures_at_layout, 2, model, **layout)[0]
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
