"""MegaScope on mixture-of-experts models: the router's probe points (logits, the experts each token chose and their
weights) are the same at every layout (expert, tensor and sequence, pipeline parallel) as in one process, the dense
MLP's internal points are absent from MoE layers, and perturbations of the router (noise on its logits, a disabled
expert) give the gradients of a reference written by hand (real gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scope_moe_cases import MOE_STYLE, router_captures, router_perturbed_gradients, router_request_errors

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope.perturb import Perturbation

LAYOUTS = {
    "ep2": (2, dict(expert_model_parallel_size=2), False),
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), False),
    "tp2-eval": (2, dict(tensor_model_parallel_size=2), True),
    "pp2": (2, dict(pipeline_model_parallel_size=2), False),
    "ep2-tp2-sp": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True), False),
}
MOE_LAYERS, DENSE_LAYER = (0, 2, 3), 1


@pytest.fixture(scope="module")
def reference(ranks: Any) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "train": ranks.run(1, router_captures, 1, MOE_STYLE)[0],
        "eval": ranks.run(1, router_captures, 1, MOE_STYLE, True)[0],
    }


def test_moe_layers_have_router_points_and_no_dense_mlp_internals(reference: Any) -> None:
    got = reference["train"]
    for layer in MOE_LAYERS:
        assert not [n for n in got if n.startswith(f"blocks.{layer}.mlp.")], "MoE layers have no dense-MLP points"
        logits = got[f"blocks.{layer}.moe.hook_router_logits"]
        choice = got[f"blocks.{layer}.moe.hook_expert_choice"]
        weights = got[f"blocks.{layer}.moe.hook_expert_weights"]
        assert logits.shape == (4, 12, 4) and choice.shape == weights.shape == (4, 12, 2)
        assert choice.dtype == torch.int64
        # the choice is the top-2 of the logits, highest first; the weights are the softmax over those two
        top_logits, top = logits.topk(2, dim=-1)
        assert torch.equal(choice, top), layer
        torch.testing.assert_close(weights, top_logits.softmax(-1))
        assert len(got[f"blocks.{layer}.hook_mlp_out"].shape) == 3
    assert f"blocks.{DENSE_LAYER}.mlp.hook_post" in got and not any(
        n.startswith(f"blocks.{DENSE_LAYER}.moe") for n in got
    )
    # 1 embed + dense layer (13 points) + 3 MoE layers (13 each) + final norm + logits
    assert len(got) == 1 + 13 + 3 * 13 + 2


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_router_captures_equal_one_process_at_every_layout(ranks: Any, reference: Any, layout: str) -> None:
    """Each rank routes its own tokens: at EP2 (every data-parallel rank feeds the same batch here), under TP2 with
    and without sequence parallelism and at PP2 the serving rank's captures equal one process's."""
    world, kwargs, evaluate = LAYOUTS[layout]
    got = ranks.run(world, router_captures, world, MOE_STYLE, evaluate, **kwargs)[0]
    want = reference["eval" if evaluate else "train"]
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        if name.endswith("hook_expert_choice"):
            assert torch.equal(got[name], tensor), name
        else:
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_shared_experts_keep_the_points_and_equal_one_process_at_ep2_tp2(ranks: Any, reference: Any) -> None:
    """With a gated shared expert beside the routed ones the MoE layers have the same points (``hook_mlp_out`` is
    routed plus shared), and captures at EP2 × TP2 + SP and at PP2 equal one process's."""
    model = dict(MOE_STYLE, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    want = ranks.run(1, router_captures, 1, model)[0]
    assert sorted(want) == sorted(reference["train"])
    assert not torch.allclose(want["blocks.0.hook_mlp_out"], reference["train"]["blocks.0.hook_mlp_out"])
    # (the gate is drawn split-invariantly: megatron-core draws it from a generator whose state depends on the layout)
    for world, layout in [
        (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
        (2, dict(pipeline_model_parallel_size=2)),
    ]:
        got = ranks.run(world, router_captures, world, model, **layout)[0]
        for name, tensor in want.items():
            torch.testing.assert_close(
                got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name, at=layout: f"{at} {n}: {m}"
            )


EXPERT = "model_chunks.0.decoder.layers.{layer}.mlp.experts.local_experts.{local}.linear_fc1.weight"


@pytest.mark.parametrize(
    "pert",
    [
        dict(site="blocks.2.moe.hook_router_logits", kind="gaussian", strength=0.5, seed=3),
        dict(site="blocks.0.moe.hook_router_logits", kind="gaussian", strength=2.0, seed=4, experts=[1]),
        dict(site="blocks.2.moe.hook_router_logits", kind="disable", experts=[3]),
    ],
    ids=["logit-noise", "one-expert-noise", "disabled-expert"],
)
@pytest.mark.parametrize(
    "world,layout",
    [(1, {}), (2, dict(expert_model_parallel_size=2)), (2, dict(tensor_model_parallel_size=2, sequence_parallel=True))],
    ids=["one-process", "ep2", "tp2-sp"],
)
def test_router_perturbations_match_a_reference_by_hand(ranks: Any, pert: dict, world: int, layout: dict) -> None:
    results = ranks.run(world, router_perturbed_gradients, world, MOE_STYLE, pert, **layout)
    for rank, r in enumerate(results):
        assert r["loss"] != r["clean_loss"], "the perturbation changed nothing"
        torch.testing.assert_close(r["loss"], r["reference_loss"], rtol=0, atol=1e-6)
        assert sorted(r["reference"]) == sorted(r["perturbed"]), rank
        for name, grad in r["reference"].items():
            torch.testing.assert_close(r["perturbed"][name], grad, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert any(not torch.equal(r["perturbed"][n], g) for n, g in r["clean"].items() if n in r["perturbed"])
    if pert["kind"] == "disable":
        served = results[0]
        assert (served["clean_choice"] == 3).any(), "expert 3 is chosen without the perturbation"
        assert not (served["choice"] == 3).any(), "a disabled expert is never chosen"
        # expert 3 gets no tokens, so no gradient; it is local expert 1 of the second expert-parallel rank at EP2
        ep = layout.get("expert_model_parallel_size", 1)
        owner, name = results[(3 // (4 // ep)) * (world // ep)], EXPERT.format(layer=2, local=3 % (4 // ep))
        assert owner["clean"][name].abs().sum() > 0
        assert owner["perturbed"].get(name, torch.zeros(1)).abs().sum() == 0


def test_router_perturbations_are_checked() -> None:
    with pytest.raises(MegatronConfigError, match="kind='disable'\\) needs experts"):
        Perturbation("blocks.0.moe.hook_router_logits", "disable")


def test_router_perturbation_errors_name_the_field(ranks: Any) -> None:
    got = ranks.run(1, router_request_errors, 1)[0]
    assert got[0] == "/perturbations/0/experts/0: 7 is not an expert of this model (experts 0..3)", got
    assert got[1].startswith("/perturbations/0/experts: disabling 3 of 4 experts leaves fewer than"), got
    assert got[2].startswith("/perturbations/0/experts: experts=[...] applies to router logits only"), got
    assert "matches no probe point" in got[3] or "no point" in got[3], got
