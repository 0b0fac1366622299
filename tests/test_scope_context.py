"""MegaScope at context parallelism (real gloo ranks): each rank holds two load-balanced chunks of every sequence,
yet captures assemble into the whole sequence and equal one process's, a perturbation defined on the whole sequence
gives one process's loss, the attention pattern (which ring attention never holds) is dropped with a warning from a
broader request and refused by name when asked for alone, and generation (whole sequences on every rank) captures as
at CP1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scope_cases import CP_PERTURBATIONS, LLAMA_STYLE, context_parallel_probes

MODEL = {**LLAMA_STYLE, "layer_spec": "sdpa"}
LAYOUTS = {
    "cp2": (2, dict(context_parallel_size=2)),
    "cp2-tp2-sp": (4, dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def one_process(ranks: Any) -> dict[str, Any]:
    return ranks.run(1, context_parallel_probes, 1, MODEL)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scope_at_context_parallelism_equals_one_process(ranks: Any, one_process: dict[str, Any], layout: str) -> None:
    world, kwargs = LAYOUTS[layout]
    results = ranks.run(world, context_parallel_probes, world, MODEL, **kwargs, timeout=300)
    want, got = one_process["captures"], results[0]["captures"]
    assert sorted(got) == sorted(want) and len(want) == 1 + 4 * 12 + 2, sorted(set(want) ^ set(got))
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, f"{name}: {tuple(got[name].shape)} vs {tuple(tensor.shape)}"
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for rank, result in enumerate(results):
        assert result["captures"] is None or rank == 0, "only the serving rank holds captures"
        clean = result["clean_loss"]
        assert abs(clean - one_process["clean_loss"]) <= 1e-5 * abs(clean), f"rank {rank}: clean loss"
        for label in CP_PERTURBATIONS:
            loss, reference = result["losses"][label], one_process["losses"][label]
            assert abs(reference - one_process["clean_loss"]) > 1e-3, f"{label} must change the loss"
            assert abs(loss - reference) <= 1e-5 * abs(reference), f"rank {rank} {label}: {loss} vs {reference}"
        assert "'blocks.0.attn.hook_pattern'" in result["refusal"], result["refusal"]
        assert "context_parallel_size=2" in result["refusal"], result["refusal"]
        # a broader request drops the pattern with a warning (serving rank) and captures the rest
        assert len(result["dropped"]) == (rank == 0), result["dropped"]
    assert "blocks.0.attn.hook_pattern" in results[0]["dropped"][0]
    assert results[0]["attn"] == [n for n in one_process["attn"] if not n.endswith("hook_pattern")]
    assert "blocks.0.attn.hook_pattern" in one_process["attn"] and not one_process["dropped"]
    assert one_process["refusal"] == "captured"
    generated, reference = results[0]["generated"], one_process["generated"]
    assert (
        sorted(generated)
        == sorted(reference)
        == sorted(["blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern", "hook_logits"])
    )
    for name, tensor in reference.items():
        # Under sequence parallelism generation pads each forward to a multiple of TP: compare the real positions.
        real = generated[name][tuple(slice(0, n) for n in tensor.shape)]
        torch.testing.assert_close(real, tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
