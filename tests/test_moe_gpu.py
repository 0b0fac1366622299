"""MoE on GPUs (skipped without CUDA): megatron-core's MoE layer at bf16 with NCCL's all-to-all.

* One GPU: the grouped-GEMM experts (``moe_grouped_gemm=True``, ``torch._grouped_mm`` on the GPU's tensor cores)
  follow the sequential experts' losses within bf16 rounding over 12 steps, and MoE fits run eagerly (no automatic
  CUDA graph: the dispatcher reads token counts on the host).
* Two GPUs: EP2 (sequential and grouped) against the one-GPU fit of the same model.

Each fit runs in its own subprocess (megatron-core's global state is per process). ``LM_RESULTS_DIR``: where the
numbers go (``moe_gpu.json``).
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

_FIT = r"""
import json, sys, time
sys.path.insert(0, "tests")
from cases import fit_gpt

model, extra = json.loads(sys.argv[1]), json.loads(sys.argv[2])

def probe(module):
    return {"graphed": module.trainer.strategy.replays_cuda_graphs}

start = time.perf_counter()
out = fit_gpt(extra.pop("devices", 1), steps=12, precision="bf16-mixed", accelerator="gpu", model=model, probe=probe,
              data={"vocab_size": model["vocab_size"], "seq_length": model["seq_length"], "global_batch_size": 8},
              **extra)
print("RESULT", json.dumps({"loss": out["loss"], "aux": out["moe_aux_loss"], "probe": out["probe"],
                            "seconds": time.perf_counter() - start}))
"""

MIXTRAL_SHAPE = dict(
    vocab_size=1024,
    seq_length=256,
    num_layers=4,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=1408,
    num_moe_experts=8,
    moe_router_topk=2,
    **LLAMA_STYLE_LAYERS,
    lr=1e-3,
)
BF16_TOL = 0.02  # relative loss over 12 steps: grouped against sequential, EP2 against one GPU


def _fits(runs: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    args = {name: [json.dumps({**MIXTRAL_SHAPE, **model}), json.dumps(extra)] for name, (model, extra) in runs.items()}
    return run_scripts(_FIT, args)


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_grouped_experts_follow_the_sequential_ones(tmp_path: Path) -> None:
    fits = _fits({"sequential": ({}, {}), "grouped": ({"moe_grouped_gemm": True}, {})})
    rel = _max_rel(fits["grouped"]["loss"], fits["sequential"]["loss"])
    row = {name: {"loss": fit["loss"], "seconds": fit["seconds"]} for name, fit in fits.items()}
    record("moe_gpu.json", tmp_path, "one_gpu", {**row, "grouped_vs_sequential_max_rel": rel})
    assert not fits["sequential"]["probe"]["graphed"] and not fits["grouped"]["probe"]["graphed"]
    assert rel < BF16_TOL, row
    assert fits["sequential"]["loss"][-1] < fits["sequential"]["loss"][0] - 0.5, row  # it learns


@two_gpus
def test_expert_parallel_follows_one_gpu(tmp_path: Path) -> None:
    fits = _fits(
        {
            "one_gpu": ({}, {}),
            "ep2": ({}, {"devices": 2, "expert_model_parallel_size": 2}),
            "ep2_grouped": ({"moe_grouped_gemm": True}, {"devices": 2, "expert_model_parallel_size": 2}),
        }
    )
    rows = {name: {"loss": fit["loss"], "aux": fit["aux"], "seconds": fit["seconds"]} for name, fit in fits.items()}
    record("moe_gpu.json", tmp_path, "ep2", rows)
    for name in ("ep2", "ep2_grouped"):
        assert _max_rel(fits[name]["loss"], fits["one_gpu"]["loss"]) < BF16_TOL, rows
