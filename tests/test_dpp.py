"""MegaDPP (``schedule="dpp"``) on real gloo ranks, against megatron-core's own schedules.

* ``static`` replays megatron-core's order: losses and every ``main_grad`` are bit-identical (``torch.equal``) to
  ``"interleaved"`` (and ``"1f1b"`` without virtual stages), GPT-2- and Llama-shaped, at PP2 × VPP2, PP4 × VPP2
  and TP2 × PP2 × VPP2.
* Every policy under random link delays (inside the transport, 20 seeds): the loss within 1e-6 relative and every
  gradient within 1e-6 of the largest, and the delays really reorder the work.
* DP2 with the distributed optimizer and overlapped gradient reduction; resuming from a checkpoint; a killed
  peer raises ``PeerLost`` naming it; bad settings fail before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dpp_cases as dc
import pytest
import torch
from distributed import WorkerGroup

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.dpp.plan import StagePlan
from lightning_megatron.scan.evaluation.inject import SlowdownInjector

TRANSPORT = "shm"  # the default on one node; test_dpp_transports covers the others


def assert_close(got: dict[str, Any], want: dict[str, Any], tol: float, what: str) -> None:
    """Losses within ``tol`` relative, every gradient within ``tol`` of the step's largest gradient."""
    for step, (a, b) in enumerate(zip(got["loss"], want["loss"])):
        assert abs(a - b) <= tol * abs(b), f"{what}: step {step} loss {a} vs {b}"
    assert len(got["grads"]) == len(want["grads"])
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        largest = max(float(t.abs().max()) for t in w.values())
        for name in w:
            err = float((g[name] - w[name]).abs().max())
            assert err <= tol * largest, f"{what}: step {step} {name} off by {err:.3g} (largest {largest:.3g})"


def assert_identical(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["loss"] == want["loss"], f"{what}: losses {got['loss']} != {want['loss']}"
    assert len(got["grads"]) == len(want["grads"])
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        assert g.keys() == w.keys()
        for name in g:
            assert torch.equal(g[name], w[name]), f"{what}: step {step} main_grad of {name} differs"


LAYOUTS = {
    "pp2-vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "pp4-vpp2": (4, dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)),
    "tp2-pp2-vpp2": (
        4,
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
}


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_static_is_bit_identical_to_megatron(ranks: Any, layout: str, shape: str) -> None:
    world, strategy = LAYOUTS[layout]
    model = {"model": {"num_layers": 8, **(dc.llama_model() if shape == "llama" else {})}}
    baseline = "interleaved" if "virtual_pipeline_model_parallel_size" in strategy else "1f1b"
    validate = {"trainer": {"limit_val_batches": 2, "val_check_interval": 2}}  # forward-only steps too
    want = ranks.run(world, dc.fit_recording, world, schedule=baseline, **validate, **model, **strategy)
    got = ranks.run(
        world,
        dc.fit_recording,
        world,
        schedule="dpp",
        schedule_options={"policy": "static", "transport": TRANSPORT},
        **validate,
        **model,
        **strategy,
    )
    for rank in range(world):
        assert_identical(got[rank], want[rank], f"{layout} {shape} rank {rank}")
        assert got[rank]["val_loss"] == want[rank]["val_loss"] and len(got[rank]["val_loss"]) == 1, got[rank]


def policy_runs(seeds: int) -> list[dict[str, Any]]:
    delay = {"kind": "exponential", "mean_s": 0.002}
    return [
        {"policy": policy, "extra_activations": extra, "transport": TRANSPORT, "link_delay": {**delay, "seed": seed}}
        for policy in ("static", "adaptive", "depth-first", "breadth-first")
        for extra in (0, 2)
        for seed in range(seeds if extra == 0 else 2)
    ]


@pytest.mark.parametrize("layout, seeds", [("pp2-vpp2", 20), ("pp4-vpp2", 4), ("tp2-pp2-vpp2", 2)])
def test_every_policy_is_exact_under_random_delays(ranks: Any, layout: str, seeds: int) -> None:
    world, strategy = LAYOUTS[layout]
    runs = [{"policy": "static", "transport": TRANSPORT}, *policy_runs(seeds)]
    per_rank = ranks.run(
        world, dc.policies_under_delays, world, runs, model={"num_layers": 8}, micro_batch_size=2, **strategy
    )
    reordered = 0
    for rank, results in enumerate(per_rank):
        reference = results[0]
        largest = max(float(g.abs().max()) for g in reference["grads"].values())
        for result in results[1:]:
            what = (
                f"{layout} rank {rank} {result['run']['policy']} extra {result['run']['extra_activations']} "
                f"seed {result['run']['link_delay']['seed']}"
            )
            assert abs(result["loss"] - reference["loss"]) <= 1e-6 * abs(reference["loss"]), what
            for name, grad in result["grads"].items():
                err = float((grad - reference["grads"][name]).abs().max())
                assert err <= 1e-6 * largest, f"{what}: {name} off by {err:.3g} (largest gradient {largest:.3g})"
            assert sorted(result["order"]) == sorted(reference["order"]), f"{what}: tasks ran != each once"
            if result["run"]["policy"] == "static":
                assert result["order"] == reference["order"], f"{what}: static must keep megatron-core's order"
            reordered += result["order"] != reference["order"]
    # The delays must really have changed the order somewhere, or this test proves nothing.
    assert reordered >= 10, f"only {reordered} runs ran out of megatron-core's order"


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_half_precision_static_is_bit_identical(ranks: Any, precision: str) -> None:
    world, strategy = LAYOUTS["pp2-vpp2"]
    common = dict(precision=precision, model={"num_layers": 8}, **strategy)
    want = ranks.run(world, dc.fit_recording, world, schedule="interleaved", **common)
    got = ranks.run(world, dc.fit_recording, world, schedule="dpp", schedule_options={"policy": "static"}, **common)
    for rank in range(world):
        assert_identical(got[rank], want[rank], f"{precision} rank {rank}")


def test_dp2_distributed_optimizer_matches_1f1b(ranks: Any) -> None:
    common = dict(pipeline_model_parallel_size=2, use_distributed_optimizer=True, overlap_grad_reduce=True, steps=3)
    want = ranks.run(4, dc.fit_recording, 4, schedule="1f1b", **common)
    got = ranks.run(
        4,
        dc.fit_recording,
        4,
        schedule="dpp",
        schedule_options={"policy": "adaptive", "transport": TRANSPORT},
        **common,
    )
    for rank in range(4):
        for step, (a, b) in enumerate(zip(got[rank]["loss"], want[rank]["loss"])):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {step}: dpp {a} vs 1f1b {b}"


@pytest.mark.parametrize(
    "schedule, options, virtual",
    [("dpp", {"policy": "adaptive", "extra_activations": 1, "transport": TRANSPORT}, 2), ("zb-h1", {}, None)],
    ids=["dpp", "zb-h1"],
)
def test_resume_from_checkpoint(
    ranks: Any, tmp_path: Path, schedule: str, options: dict[str, Any], virtual: Any
) -> None:
    from test_checkpoint import SAVE_EVERY, assert_continues, fit

    strategy = dict(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=virtual,
        schedule=schedule,
        schedule_options=options,
    )
    full = ranks.run(2, fit, 2, tmp_path, **strategy)[0]
    checkpoint = str(tmp_path / f"epoch=0-step={SAVE_EVERY}.ckpt")
    resumed = ranks.run(2, fit, 2, tmp_path / "resumed", resume=checkpoint, **strategy)
    assert_continues(resumed[0], full, f"{schedule} resumed at step 3")


@pytest.mark.parametrize("transport", ["torch", "tcp"])
def test_dpp_transports(ranks: Any, transport: str) -> None:
    world, strategy = LAYOUTS["pp2-vpp2"]
    want = ranks.run(world, dc.fit_recording, world, schedule="interleaved", model={"num_layers": 8}, **strategy)
    got = ranks.run(
        world,
        dc.fit_recording,
        world,
        schedule="dpp",
        schedule_options={"policy": "static", "transport": transport},
        model={"num_layers": 8},
        **strategy,
    )
    for rank in range(world):
        assert_identical(got[rank], want[rank], f"{transport} rank {rank}")


def test_killed_peer_raises_peer_lost(tmp_path: Path) -> None:
    group = WorkerGroup(2, tmp_path)  # a pair of its own: rank 1 dies
    try:
        survivor, victim = group.run(
            dc.killed_peer,
            2,
            pipeline_model_parallel_size=2,
            schedule_options={"transport": TRANSPORT},
            may_die={1},
            timeout=120,
        )
    finally:
        group.shutdown(kill=True)
    assert victim is None, "rank 1 was meant to die"
    assert survivor["error"] and "PeerLost" in survivor["error"] and "rank 1" in survivor["error"], survivor


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(schedule_options={"polcy": "adaptive"}), ["unknown keys", "polcy", "policy"]),
        (dict(schedule_options={"policy": "fastest"}), ["policy='fastest'", "adaptive"]),
        (dict(schedule_options={"extra_activations": -1}), ["extra_activations=-1", ">= 0"]),
        (dict(schedule_options={"transport": "carrier-pigeon"}), ["transport='carrier-pigeon'", "shm"]),
        (dict(pipeline_model_parallel_size=1), ["pipeline_model_parallel_size >= 2"]),
        (dict(schedule="interleaved", schedule_options={"policy": "static"}), ["takes no schedule_options"]),
        (dict(schedule="zb-h1", schedule_options={"policy": "adaptive"}), ["zb-h1", "split_weight_grads=True"]),
        (dict(schedule_options={"max_deferred_weight_grads": -2}), ["max_deferred_weight_grads=-2"]),
        (
            dict(schedule="zb-h1", schedule_options={"weight_grad_memory": "last"}),
            ["weight_grad_memory='last'", "own-rank"],
        ),
        (
            dict(schedule="zb-h1", schedule_options={"weight_grad_memory": 0.9}),
            ["weight_grad_memory=0.9", "from 1.0 to 4.0"],
        ),
    ],
)
def test_bad_settings_fail_when_the_strategy_is_built(kwargs: dict[str, Any], words: list[str]) -> None:
    kwargs = {"schedule": "dpp", "pipeline_model_parallel_size": 2, **kwargs}
    if kwargs["schedule"] == "interleaved":
        kwargs["virtual_pipeline_model_parallel_size"] = 2
    with pytest.raises(MegatronConfigError) as err:
        MegatronAppStrategy(**kwargs)
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_bad_microbatch_count_is_named() -> None:
    strategy = MegatronAppStrategy(
        schedule="dpp", pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    with pytest.raises(MegatronConfigError, match="multiple of pipeline_model_parallel_size=2"):
        strategy.schedule.validate_microbatches(3, pipeline=2, virtual=2)


def test_megascan_pairs_every_message_whatever_the_order(ranks: Any, tmp_path: Path) -> None:
    import gzip
    import json

    from lightning_megatron.scan.analysis.aggregate import aggregate
    from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

    world, strategy = LAYOUTS["pp2-vpp2"]
    options = {
        "policy": "breadth-first",
        "extra_activations": 2,
        "transport": TRANSPORT,
        "link_delay": {"kind": "exponential", "mean_s": 0.003, "seed": 1},
    }
    runs = ranks.run(
        world,
        dc.traced,
        str(tmp_path / "trace"),
        schedule="dpp",
        schedule_options=options,
        model={"num_layers": 8},
        **strategy,
    )
    sends = 0
    for path in list_rank_files(tmp_path / "trace").values():
        for event in read_rank_file(path):
            if event.get("cat") == "p2p" and event["ph"] == "X":
                sends += len(event["args"].get("sends", []))
                for record in event["args"].get("sends", []) + event["args"].get("recvs", []):
                    assert {"peer", "seq", "microbatch", "stage"} <= record.keys(), record
    merged = tmp_path / "merged.json.gz"
    summary = aggregate(tmp_path / "trace", merged, progress=False)
    with gzip.open(merged, "rt") as stream:
        events = json.load(stream)["traceEvents"]
    flows = sum(1 for e in events if e["ph"] == "s" and e.get("cat") == "p2p")
    # steps 1 and 2 are traced (MegaScan skips the first); 4 stages: 3 boundaries x 4 microbatches x 2 directions
    assert sends == 2 * 3 * 4 * 2, sends
    counts = summary["flows"]
    assert counts["unmatched_sends"] == counts["unmatched_recvs"] == 0, counts
    # Ranks of one machine share their clock (one clock domain), so no flow is drawn backwards or left out.
    assert flows == counts["p2p"] == sends, counts
    static = [[str(t) for t in StagePlan(2, rank, 2, 4).order] for rank in range(2)]
    assert any(run["order"] != static[rank] for rank, run in enumerate(runs)), "the trace must be of a reordered run"


# -- the weight-gradient split (B/W) ------------------------------------------------------------------------------

ZB_LAYOUTS = {
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "pp4": (4, dict(pipeline_model_parallel_size=4)),
    "tp2-pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "tp2-pp2-sp": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True)),
    "dp2-pp2-overlap": (
        4,
        dict(pipeline_model_parallel_size=2, use_distributed_optimizer=True, overlap_grad_reduce=True),
    ),
}


@pytest.mark.parametrize("layout", list(ZB_LAYOUTS))
def test_zero_bubble_matches_1f1b(ranks: Any, layout: str) -> None:
    world, strategy = ZB_LAYOUTS[layout]
    common = dict(model={"num_layers": 4, **dc.llama_model()} if "sp" in layout else {}, **strategy)
    want = ranks.run(world, dc.fit_recording, world, schedule="1f1b", **common)
    got = ranks.run(world, dc.fit_recording, world, schedule="zb-h1", **common)
    for rank in range(world):
        assert_close(got[rank], want[rank], 1e-6, f"zb-h1 {layout} rank {rank}")
    # the memory rule: activations held + weight gradients pending never exceed the first rank's 1F1B peak
    pipeline = strategy["pipeline_model_parallel_size"]
    for rank in range(world):
        sequence = got[rank]["sequence"]
        assert got[rank]["peak_held"] <= pipeline, f"rank {rank} held {got[rank]['peak_held']}: {sequence}"
        weights = [s for s in sequence if s[0] == "W"]
        assert sorted(weights) == sorted("W" + s[1:] for s in sequence if s[0] == "B"), sequence
        assert all(sequence.index("B" + w[1:]) < sequence.index(w) for w in weights), sequence


def test_zero_bubble_within_each_ranks_own_1f1b_memory(ranks: Any) -> None:
    """``weight_grad_memory="own-rank"``: rank r of a 4-stage pipeline holds at most 4 - r activations and pending
    weight gradients (its own 1F1B peak), where ``"first-rank"`` lets every rank fill up to the first rank's 4.

    A W waits while the rank has work and runs when the rank would idle, so how many pile up depends on whether
    inputs are there when wanted. In one CI run they were not: the last rank idled after every backward and ran its
    W there under either rule ("assert 1 > 1"; making rank 2 compute 3x slower fails the same way). Here the last
    rank computes 3x slower, so its inputs are always waiting and its Ws pile up to the rule's bound, whatever the
    machine's load."""
    world, strategy = ZB_LAYOUTS["pp4"]
    want = ranks.run(world, dc.fit_recording, world, schedule="1f1b", **strategy)
    slow_last = [SlowdownInjector([world - 1], 3.0)]
    options = {"weight_grad_memory": "own-rank"}
    got = ranks.run(
        world, dc.fit_recording, world, callbacks=slow_last, schedule="zb-h1", schedule_options=options, **strategy
    )
    first = {"weight_grad_memory": "first-rank"}
    by_first = ranks.run(
        world, dc.fit_recording, world, callbacks=slow_last, schedule="zb-h1", schedule_options=first, **strategy
    )
    for rank in range(world):
        assert_close(got[rank], want[rank], 1e-6, f"zb-h1 own-rank memory, rank {rank}")
        assert_close(by_first[rank], want[rank], 1e-6, f"zb-h1 first-rank memory, rank {rank}")
        assert got[rank]["peak_held"] <= world - rank, (rank, got[rank]["peak_held"], got[rank]["sequence"])
    assert by_first[world - 1]["peak_held"] > got[world - 1]["peak_held"], "the option must change the last rank"


def test_zero_bubble_byte_budget_keeps_part_of_a_weight_gradient(ranks: Any) -> None:
    """``weight_grad_memory`` a number: past ``"own-rank"``'s count, pending Ws are kept while their bytes fit the
    allowance, and the oldest runs layer by layer (``w`` parts) until they do; the sums are 1f1b's. On CPUs the
    allowance is not measured (it stays 0: ``"own-rank"``), so the test sets it to half a W from step 1 on.

    The sequences of separate fits are compared, and a W also runs where its rank would idle, so the last rank
    computes 3x slower (as in the test above): its inputs always wait for it and the first rank always waits for
    its gradients, whatever the machine's load."""
    world, strategy = ZB_LAYOUTS["pp2"]
    want = ranks.run(world, dc.fit_recording, world, schedule="1f1b", **strategy)
    zb = dict(strategy, schedule="zb-h1", callbacks=[SlowdownInjector([world - 1], 3.0)])
    options = {"weight_grad_memory": 1.1}
    as_own_rank = ranks.run(world, dc.fit_recording, world, schedule_options=options, **zb)
    reference = ranks.run(world, dc.fit_recording, world, schedule_options={"weight_grad_memory": "own-rank"}, **zb)
    got = ranks.run(world, dc.fit_recording_with_allowance, world, 0.5, schedule_options=options, **zb)
    for rank in range(world):
        assert as_own_rank[rank]["sequence"] == reference[rank]["sequence"], f"CPU budget is own-rank, rank {rank}"
        assert_close(got[rank], want[rank], 1e-6, f"zb-h1 byte budget, rank {rank}")
    parts = [s for s in got[world - 1]["sequence"] if s.startswith("w")]
    assert parts, got[world - 1]["sequence"]
    assert got[world - 1]["sequence"] != reference[world - 1]["sequence"]


def test_split_weight_grads_with_virtual_stages_and_reordering(ranks: Any) -> None:
    world, strategy = LAYOUTS["pp2-vpp2"]
    common = dict(model={"num_layers": 8}, **strategy)
    want = ranks.run(world, dc.fit_recording, world, schedule="interleaved", **common)
    for policy in ("static", "adaptive"):
        options = {"policy": policy, "split_weight_grads": True, "extra_activations": 2}
        if policy == "adaptive":
            options["link_delay"] = {"kind": "exponential", "mean_s": 0.002, "seed": 3}
        got = ranks.run(world, dc.fit_recording, world, schedule="dpp", schedule_options=options, **common)
        for rank in range(world):
            assert_close(got[rank], want[rank], 1e-6, f"dpp {policy} + split rank {rank}")


def test_megascan_traces_weight_gradients(ranks: Any, tmp_path: Path) -> None:
    from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

    ranks.run(2, dc.traced, str(tmp_path / "trace"), schedule="zb-h1", pipeline_model_parallel_size=2)
    for rank, path in list_rank_files(tmp_path / "trace").items():
        spans = [e for e in read_rank_file(path) if e.get("cat") == "compute" and e["ph"] == "X"]
        by_name = {name: [e for e in spans if e["name"] == name] for name in ("forward", "backward", "weight-grad")}
        # steps 1 and 2 are traced, 4 microbatches each: one forward, B and W per microbatch
        for name, events in by_name.items():
            assert sorted((e["args"]["step"], e["args"]["microbatch"]) for e in events) == [
                (s, m) for s in (1, 2) for m in range(4)
            ], (rank, name)
