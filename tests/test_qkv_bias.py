"""``GPTModule(add_qkv_bias=True)`` (Qwen2's layout: a bias on the fused query/key/value projection, none elsewhere):
losses of a Llama-shaped tiny model with that bias equal one process's within 1e-3 on every layer spec (the fused
kernels' bias paths included) and at TP2 + SP, where the bias is split with the projection's rows; the bias
trains, and a checkpoint saved at TP2 resumes at TP1 as the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import dpp_cases as dc
import pytest
from cases import fit_gpt

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.models import GPTModule

MODEL = {"layer_spec": "sdpa", "add_qkv_bias": True, **dc.llama_model()}
STEPS, SAVE_EVERY = 4, 2
LAYOUTS = {
    "local": (1, {"layer_spec": "local"}, {}),
    "sdpa+fused": (1, {"layer_spec": "sdpa+fused"}, {}),
    "tp2-sp": (2, {}, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
}


def qkv_biases(module: GPTModule) -> dict[str, Any]:
    """This rank's first-layer biases: the qkv one's shape and size, and whether the others exist."""
    attention = module.model_chunks[0].decoder.layers[0].self_attention
    mlp = module.model_chunks[0].decoder.layers[0].mlp
    bias = attention.linear_qkv.bias
    return {
        "qkv_shape": None if bias is None else tuple(bias.shape),
        "qkv_abs": None if bias is None else float(bias.detach().abs().sum()),
        "proj_bias": attention.linear_proj.bias is not None,
        "fc1_bias": mlp.linear_fc1.bias is not None,
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
        probe=qkv_biases,
        **kwargs,
    )


@pytest.fixture(scope="module")
def one_process(ranks: Any) -> dict[str, Any]:
    return ranks.run(1, fit, 1)[0]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_the_bias_is_on_qkv_only_and_trains(one_process: dict[str, Any]) -> None:
    probe = one_process["probe"]
    hidden = 32  # cases.TINY_MODEL: 4 heads of 8, 2 query groups -> q 32 + k 16 + v 16 rows
    assert probe["qkv_shape"] == (hidden + 2 * 16,)
    assert probe["qkv_abs"] > 0, "the bias starts at zero and must train"
    assert not probe["proj_bias"] and not probe["fc1_bias"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qkv_bias_losses_equal_one_process(ranks: Any, one_process: dict[str, Any], layout: str) -> None:
    world, model, strategy = LAYOUTS[layout]
    results = ranks.run(world, fit, world, model=model, **strategy)
    for rank, got in enumerate(results):
        for step, (a, b) in enumerate(zip(got["loss"], one_process["loss"], strict=True)):
            assert _close(a, b, 1e-3), f"{layout} rank {rank}: step {step} loss {a} vs {b}"
        if strategy.get("tensor_model_parallel_size") == 2:
            assert got["probe"]["qkv_shape"] == (32,), "the bias is split with the projection's rows"


def test_qkv_bias_checkpoint_resumes_at_another_tensor_parallel_size(ranks: Any, tmp_path: Path) -> None:
    tp2 = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    full = ranks.run(2, fit, 2, str(tmp_path / "saved"), **tp2)[0]
    resume = str(tmp_path / "saved" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    (got,) = ranks.run(1, fit, 1, str(tmp_path / "resumed"), resume)
    tail = full["loss"][SAVE_EVERY:]
    assert got["global_step"] == STEPS and len(got["loss"]) == len(tail)
    for step, (a, b) in enumerate(zip(got["loss"], tail), start=SAVE_EVERY + 1):
        assert _close(a, b, 1e-3), f"step {step} loss {a} != uninterrupted {b}"


def test_qkv_bias_is_an_argument_not_an_override() -> None:
    with pytest.raises(MegatronConfigError, match=r"GPTModule\(add_qkv_bias=...\)"):
        GPTModule(transformer_config_overrides={"add_qkv_bias": True})
