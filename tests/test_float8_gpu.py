"""``fp8_recipe`` on GPUs (skipped without CUDA): ``torch._scaled_mm`` where the CPU tests have torchao's emulation.

* The three GEMMs of every recipe on Hopper's FP8 tensor cores against the emulation of the same casts (the CPU
  path): the same numbers up to the order of fp32 sums and the rounding of the result (bf16: within 5e-3 of the
  emulation's norm; the tensorwise weight gradient, which ``_scaled_mm`` returns in fp32, within 1e-3; cuBLAS's
  rowwise GEMM has no fp32 output, so torchao rounds that one to bf16 first). Compiled (the GPU default) and eager
  casts give the same bits.
* Real fits on one GPU (subprocesses: megatron-core's global state is per process), the step replayed as a CUDA
  graph (the default on one GPU): float8 is captured (scales computed on the GPU, no host synchronisation), the
  replays give the eager float8 fit's losses, and stay within a stated tolerance of bf16. With two GPUs also TP2 +
  SP and PP2 against the one-GPU float8 fit.

``LM_RESULTS_DIR``: where the numbers go (``float8_gpu.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_work import LLAMA_STYLE_LAYERS, record, run_scripts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_scaled_mm_matches_the_emulation(recipe: str, tmp_path: Path) -> None:
    from lightning_megatron.layers.float8 import Float8Recipe

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(4096, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(3072, 2048, device="cuda", generator=g) / 45).to(torch.bfloat16)
    dy = (torch.randn(4096, 3072, device="cuda", generator=g) / 1000).to(torch.bfloat16)
    real, emulated = Float8Recipe(recipe, emulate=False), Float8Recipe(recipe, emulate=True)
    compiled = Float8Recipe(recipe, emulate=False, compile=True)
    row = {}
    for name, run in (
        ("output", lambda r: r.output(x, w)),
        ("grad_input", lambda r: r.grad_input(dy, w)),
        ("grad_weight_fp32", lambda r: r.grad_weight(dy, x, torch.float32)),
    ):
        got, want = run(real), run(emulated)
        if recipe != "rowwise_with_gw_hp" or name != "grad_weight_fp32":  # (that one is a bf16 GEMM, not float8)
            assert torch.equal(run(compiled), got), f"{name}: compiled casts gave other bits than eager ones"
        exact = {"output": x.float() @ w.float().t(), "grad_input": dy.float() @ w.float()}.get(
            name, dy.float().t() @ x.float()
        )
        row[name] = {"vs_emulation": _rel(got, want), "vs_bf16_exact": _rel(got, exact), "dtype": str(got.dtype)}
    record("float8_gpu.json", tmp_path, f"gemms/{recipe}", {**row, "gpu": torch.cuda.get_device_name()})
    for name, errors in row.items():
        bound = 1e-3 if (name, recipe) == ("grad_weight_fp32", "tensorwise") else 5e-3
        assert errors["vs_emulation"] < bound, (name, row)
        assert 1e-4 < errors["vs_bf16_exact"] < 0.1, (name, row)  # really float8, and close


_FIT = r"""
import json, sys, time
sys.path.insert(0, "tests")
from cases import fit_gpt

recipe, model, extra = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

def probe(module):
    graph = module.trainer.strategy.step_graph
    return None if graph is None else {"captures": graph.captures, "replays": graph.replays,
                                       "gave_up_because": graph.gave_up_because}

start = time.perf_counter()
out = fit_gpt(extra.pop("devices", 1), steps=12, precision="bf16-mixed", accelerator="gpu", model=model, probe=probe,
              data={"vocab_size": model["vocab_size"], "seq_length": model["seq_length"], "global_batch_size": 8},
              fp8_recipe=None if recipe == "bf16" else recipe, **extra)
print("RESULT", json.dumps({"loss": out["loss"], "graph": out["probe"], "seconds": time.perf_counter() - start}))
"""

LLAMA_SHAPE = dict(
    vocab_size=1024,
    seq_length=256,
    num_layers=4,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=1408,
    **LLAMA_STYLE_LAYERS,
    lr=1e-3,
)
BF16_TOL = 0.03  # float8 against bf16, relative loss, over 12 steps of this model


def _fits(runs: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    shape = json.dumps(LLAMA_SHAPE)
    return run_scripts(_FIT, {name: [recipe, shape, json.dumps(extra)] for name, (recipe, extra) in runs.items()})


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_one_cast_per_operand_gives_torchaos_bits() -> None:
    """The tensorwise layers' single cast (``quantize``; its pointwise part compiled) against torchao's own."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from lightning_megatron.layers.float8 import Float8Recipe

    recipe = Float8Recipe("tensorwise", emulate=False, compile=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    for shape, dtype in (((8192, 2048), torch.float8_e4m3fn), ((4096, 5632), torch.float8_e5m2)):
        x = (torch.randn(*shape, device="cuda", generator=g) * 7).to(torch.bfloat16)
        data, data_t, scale = recipe.quantize(x, dtype)
        theirs = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig())
        assert torch.equal(scale, theirs._scale)
        assert torch.equal(data.view(torch.uint8), theirs._data.view(torch.uint8))
        assert torch.equal(data_t.view(torch.uint8), theirs._data.t().contiguous().view(torch.uint8))


def test_float8_fit_is_captured_and_replays_the_eager_losses(tmp_path: Path) -> None:
    fits = _fits(
        {
            "bf16": ("bf16", {}),
            # eager, with the graphed fit's default weight-gradient accumulation (fp32 GEMM output into main_grad)
            "tensorwise_eager": ("tensorwise", {"cuda_graphs": False, "gradient_accumulation_fusion": True}),
            "tensorwise": ("tensorwise", {}),
            "rowwise": ("rowwise", {}),
        }
    )
    for name in ("tensorwise", "rowwise"):
        fits[f"max_rel_loss_vs_bf16_{name}"] = _max_rel(fits[name]["loss"], fits["bf16"]["loss"])
    fits["max_rel_loss_graphed_vs_eager"] = _max_rel(fits["tensorwise"]["loss"], fits["tensorwise_eager"]["loss"])
    record("float8_gpu.json", tmp_path, "fit/llama-style-1gpu", fits)
    assert fits["tensorwise"]["graph"]["replays"] >= 8 and fits["tensorwise"]["graph"]["gave_up_because"] is None
    assert fits["rowwise"]["graph"]["replays"] >= 8
    assert fits["tensorwise_eager"]["graph"] is None
    assert fits["max_rel_loss_graphed_vs_eager"] < 1e-3, fits
    for name in ("tensorwise", "rowwise"):
        assert fits[name]["loss"] != fits["bf16"]["loss"]
        assert fits[f"max_rel_loss_vs_bf16_{name}"] < BF16_TOL, fits


@two_gpus
def test_float8_at_tp2_sp_and_pp2_matches_one_gpu(tmp_path: Path) -> None:
    fits = _fits(
        {
            "1gpu": ("tensorwise", {"cuda_graphs": False}),
            "tp2_sp": ("tensorwise", {"devices": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
            "pp2": ("tensorwise", {"devices": 2, "pipeline_model_parallel_size": 2}),
        }
    )
    for name in ("tp2_sp", "pp2"):
        fits[f"max_rel_loss_vs_1gpu_{name}"] = _max_rel(fits[name]["loss"], fits["1gpu"]["loss"])
    record("float8_gpu.json", tmp_path, "fit/llama-style-layouts", fits)
    assert fits["max_rel_loss_vs_1gpu_tp2_sp"] < 5e-3, fits
    assert fits["max_rel_loss_vs_1gpu_pp2"] < 5e-3, fits
