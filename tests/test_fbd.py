"""MegaFBD's rank split (``schedule="fbd"``) on real gloo ranks, against megatron-core's 1F1B without the split.

The reference is the same global batch on the backward replicas' GPUs alone (``B`` data-parallel replicas, the
same TP × PP): the rank split must not change what is trained. Checked on every rank, forward replicas included
(they must end each step with the same gradients, hence the same weights):

* ``recompute`` mode is bit-identical to 1F1B (the recompute is the forward the backward would have run) where
  at most two backward replicas' gradients are summed (with three, the all-reduce adds them in another order);
* ``ship`` mode within the strategy's fp32 parity tolerance, 1e-5 (measured up to 1.3e-6: the backward reads
  shipped, contiguous copies of the saved tensors, so a GEMM may accumulate in another order), at PP1, PP2, a 1:2 forward:backward ratio (DP3), 1:3 and 3:1 (DP4), and TP2 × PP2 with sequence
  parallelism on a Llama-shaped model (RoPE, GQA, SwiGLU, RMSNorm);
* with the distributed optimizer and overlapped gradient reduction (forward replicas hold optimizer shards and
  reduce zeros) the losses and gradient norms match within 1e-5 (gradients are sharded differently over 3
  replicas than over 2, so they are not compared one by one);
* resuming from a checkpoint continues the uninterrupted run; the performance model is made after the third
  step on every rank; bad settings fail with the parameter named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dpp_cases as dc
import fbd_cases as fc
import pytest
from test_dpp import assert_close, assert_identical

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.fbd.perfmodel import Parts, predict
from lightning_megatron.pipeline.fbd.roles import Roles, check_replicas, data_shard

# name: (tensor, pipeline, forward replicas, backward replicas, model, other strategy settings)
LAYOUTS = {
    "pp1": (1, 1, 1, 1, {}, {}),
    "pp2": (1, 2, 1, 1, {}, {}),
    "dp3-ratio-1to2": (1, 1, 1, 2, {}, {}),
    "dp3-distopt-overlap": (1, 1, 1, 2, {}, {"use_distributed_optimizer": True, "overlap_grad_reduce": True}),
    "dp4-ratio-1to3": (1, 1, 1, 3, {}, {"data": {"global_batch_size": 12}}),  # shards over the 3 backward replicas
    "dp4-ratio-3to1": (1, 1, 3, 1, {}, {}),  # one backward replica's microbatches from three forward replicas
    "tp2-pp2-sp-llama": (2, 2, 1, 1, {"num_layers": 4, **dc.llama_model()}, {}),
}


def _rank_of(tensor: int, pipeline: int, replicas: int, tp: int, dp: int, pp: int) -> int:
    """megatron-core's default rank order (tp fastest, then dp, then pp)."""
    return tp + tensor * (dp + replicas * pp)


@pytest.mark.parametrize("mode", ["recompute", "ship"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_split_matches_1f1b(ranks: Any, layout: str, mode: str) -> None:
    tensor, pipeline, forward, backward, model, other = LAYOUTS[layout]
    strategy = dict(
        **other,
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        sequence_parallel=tensor > 1,
        model=model,
        steps=3,
    )
    reference_world = tensor * pipeline * backward
    world = tensor * pipeline * (forward + backward)
    want = ranks.run(reference_world, dc.fit_recording, reference_world, schedule="1f1b", **strategy)
    got = ranks.run(
        world,
        fc.fit_with_model,
        world,
        schedule="fbd",
        schedule_options={"mode": mode, "forward_replicas": forward, "transport": "shm"},
        **strategy,
    )
    for rank in range(world):
        tp, dp, pp = rank % tensor, (rank // tensor) % (forward + backward), rank // (tensor * (forward + backward))
        reference = want[_rank_of(tensor, pipeline, backward, tp, min(dp, backward - 1), pp)]
        what = f"fbd {mode} {layout} rank {rank} ({'forward' if got[rank]['forward'] else 'backward'} replica {dp})"
        assert got[rank]["forward"] == (dp >= backward), what
        if other.get("use_distributed_optimizer"):
            # After the reduce-scatter a rank's main_grad is valid on its own shard only, and shards differ
            # between 2 and 3 replicas: compare what the shards produce, the loss and the gradient norm.
            for key in ("loss", "grad_norm"):
                for step, (a, b) in enumerate(zip(got[rank][key], reference[key])):
                    assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {step} {key} {a} vs {b}"
        elif mode == "recompute" and backward <= 2:
            # Two replicas' gradients plus zeros sum exactly in any order; three do not (1:3 differs from
            # 1F1B on DP3 by the order gloo adds them in: 1e-7 on a loss).
            assert_identical(got[rank], reference, what)
        else:
            # Three replicas' gradients sum in gloo's order, not 1F1B's on DP3: after three steps of lr 1e-2 a
            # gradient element of the 1:3 ship layout differed by 2e-5 of the largest (torch 2.13, numpy 2.4.6).
            assert_close(got[rank], reference, 5e-5 if backward > 2 else 1e-5, what)
        assert got[rank]["prediction"] and got[rank]["prediction"] > 0, what


def test_validation_runs_on_the_backward_replicas(ranks: Any) -> None:
    """Validation steps run megatron-core's own schedule on the backward replicas (forward replicas report
    nothing): the validation losses are 1F1B's."""
    common = dict(pipeline_model_parallel_size=2, steps=4, trainer={"limit_val_batches": 2, "val_check_interval": 2})
    want = ranks.run(2, dc.fit_recording, 2, schedule="1f1b", **common)
    got = ranks.run(4, dc.fit_recording, 4, schedule="fbd", schedule_options={"mode": "ship"}, **common)
    for rank in range(4):
        assert got[rank]["val_loss"] == want[0]["val_loss"] and len(got[rank]["val_loss"]) == 2, got[rank]


def test_resume_from_checkpoint(ranks: Any, tmp_path: Path) -> None:
    from test_checkpoint import SAVE_EVERY, assert_continues, fit

    strategy = dict(schedule="fbd", schedule_options={"mode": "ship", "transport": "shm"})
    full = ranks.run(2, fit, 2, tmp_path, **strategy)[0]
    checkpoint = str(tmp_path / f"epoch=0-step={SAVE_EVERY}.ckpt")
    resumed = ranks.run(2, fit, 2, tmp_path / "resumed", resume=checkpoint, **strategy)
    assert_continues(resumed[0], full, "fbd ship resumed at step 3")


# -- settings and the performance model (no processes) ------------------------------------------------------------


@pytest.mark.parametrize(
    "options, words",
    [
        ({"mode": "activations"}, ["schedule_options.mode", "recompute", "ship"]),
        ({"forward_replicas": 0}, ["forward_replicas", ">= 1"]),
        ({"ratio": 2}, ["unknown keys", "forward_replicas"]),
        ({"prefetch": 0}, ["prefetch"]),
    ],
)
def test_bad_options_fail_when_the_strategy_is_built(options: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(MegatronConfigError) as error:
        MegatronAppStrategy(schedule="fbd", schedule_options=options)
    for word in words:
        assert word in str(error.value)


def test_too_few_replicas_names_the_fix() -> None:
    with pytest.raises(MegatronConfigError, match="forward_replicas=2 needs a data-parallel size above it"):
        check_replicas(2, 2)
    with pytest.raises(MegatronConfigError, match="virtual"):
        MegatronAppStrategy(schedule="fbd", pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)


def test_backward_replicas_split_the_data() -> None:
    from lightning_megatron.pipeline.fbd.options import FbdOptions

    options = FbdOptions(forward_replicas=1)
    assert [data_shard(options, r, 3) for r in range(3)] == [(0, 2), (1, 2), (0, 2)]


def _roles(forward: int, backward: int, replica: int) -> Roles:
    return Roles(forward, backward, replica, stage=0, stages=1, tensor_rank=0, _grid={})


def test_microbatches_are_dealt_to_the_forward_replicas() -> None:
    """Slot ``m·B + b`` goes to forward replica ``slot mod F``: one feeder per backward replica where ``F``
    divides ``B`` (as before the dealing), every forward replica busy where there are more of them than of
    backward replicas (3:1: none idles), and every microbatch run exactly once."""
    one_to_three = _roles(1, 3, 3)
    assert one_to_three.partners() == [0, 1, 2] and len(one_to_three.assigned(4)) == 12
    assert [_roles(2, 2, 2).feeders(b) for b in range(2)] == [[2], [3]]
    three_to_one = [_roles(3, 1, f) for f in (1, 2, 3)]
    assert [r.assigned(6) for r in three_to_one] == [[(0, 0), (3, 0)], [(1, 0), (4, 0)], [(2, 0), (5, 0)]]
    assert three_to_one[0].feeders(0) == [1, 2, 3] and all(r.partners() == [0] for r in three_to_one)
    for forward, backward in [(1, 1), (1, 2), (2, 3), (3, 2), (3, 1), (2, 4)]:
        runs = [pair for f in range(forward) for pair in _roles(forward, backward, backward + f).assigned(5)]
        assert sorted(runs) == [(m, b) for m in range(5) for b in range(backward)], (forward, backward)


def _parts(mode: str, **kw: Any) -> Parts:
    base: dict[str, Any] = dict(
        mode=mode,
        microbatches=4,
        backward_replicas=1,
        forward_replicas=1,
        prefetch=2,
        forward_s=[1.0],
        recompute_s=[1.0],
        backward_s=[2.0],
        input_bytes=[0.0],
        bundle_bytes=[0.0],
        grad_bytes=[0.0],
        latency_s=0.0,
        bandwidth=float("inf"),
        sync_s=0.5,
    )
    base.update(kw)
    return Parts(**base)


def test_performance_model_by_hand() -> None:
    # PP1 recompute: the backward replica does everything (4 x (1 + 2)), the forward replica nothing.
    assert predict(_parts("recompute")) == pytest.approx(4 * 3 + 0.5)
    # PP1 ship: the first bundle after forward 1; the backward GPU copies each bundle in (1 MB at 2 MB/s: 0.5),
    # replays (0.3) and runs the backward (2): it is the bottleneck.
    ship = _parts("ship", recompute_s=[0.3], bundle_bytes=[1e6], bandwidth=2e6)
    assert predict(ship) == pytest.approx(1 + 4 * 2.8 + 0.5)
    # A slow forward (3 per microbatch) becomes the bottleneck: bundles at 3, 6, 9, 12, then the last copy,
    # replay and backward.
    slow = _parts("ship", forward_s=[3.0], recompute_s=[0.3], bundle_bytes=[1e6], bandwidth=2e6)
    assert predict(slow) == pytest.approx(12 + 2.8 + 0.5)
    # PP2 recompute: backward stage 1 starts once forward stage 0 has sent microbatch 0's input.
    pp2 = _parts(
        "recompute",
        forward_s=[1.0, 1.0],
        recompute_s=[1.0, 1.0],
        backward_s=[2.0, 2.0],
        input_bytes=[0.0, 0.0],
        bundle_bytes=[0.0, 0.0],
        grad_bytes=[0.0, 0.0],
    )
    # stage 1: starts at 1, 4 x 3 -> ends 13; stage 0: last backward needs stage 1's gradient of mb 3 (13) -> 15.
    assert predict(pp2) == pytest.approx(15 + 0.5)
    # 3:1, ship, the slow forward: microbatches 0-2 run side by side on three forward replicas (bundles at 3), the
    # fourth on the first again (at 6); the backward GPU takes 2.8 for each from 3 on: 3 + 4 x 2.8.
    three = _parts("ship", forward_s=[3.0], recompute_s=[0.3], bundle_bytes=[1e6], bandwidth=2e6, forward_replicas=3)
    assert predict(three) == pytest.approx(3 + 4 * 2.8 + 0.5)
    # 1:2, ship: one forward replica runs both partners' microbatches in turn (8 forwards, 3 each): the last at 24.
    two = _parts("ship", forward_s=[3.0], recompute_s=[0.3], bundle_bytes=[1e6], bandwidth=2e6, backward_replicas=2)
    assert predict(two) == pytest.approx(24 + 2.8 + 0.5)


def test_recompute_draws_the_forward_dropout_masks(ranks: Any) -> None:
    """With dropout, a recompute must draw the masks the forward replica drew (its RNG state travels with each
    stage input): then recompute and ship mode, which ships the masks themselves, give the same gradients. One
    forward replica serves two backward replicas, so its random stream is not the one either backward replica
    would draw on its own."""
    strategy = dict(pipeline_model_parallel_size=2, model={"hidden_dropout": 0.2, "attention_dropout": 0.2}, steps=2)
    runs = {
        mode: ranks.run(
            6,
            dc.fit_recording,
            6,
            schedule="fbd",
            schedule_options={"mode": mode, "forward_replicas": 1, "transport": "shm"},
            **strategy,
        )
        for mode in ("recompute", "ship")
    }
    for rank in range(6):
        assert_close(runs["recompute"][rank], runs["ship"][rank], 1e-5, f"dropout, rank {rank}")


@pytest.mark.parametrize("mode", ["recompute", "ship"])
def test_megascan_traces_both_roles(ranks: Any, tmp_path: Path, mode: str) -> None:
    """Forward replicas trace forwards only; backward replicas a recompute and a backward per microbatch; every
    stage input, bundle and gradient is one flow from its sender to its receiver."""
    import gzip
    import json

    from lightning_megatron.scan.analysis.aggregate import aggregate
    from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

    options = {"mode": mode, "transport": "shm"}
    runs = ranks.run(
        4,
        fc.traced,
        str(tmp_path / "trace"),
        4,
        schedule="fbd",
        schedule_options=options,
        pipeline_model_parallel_size=2,
    )
    microbatches = 4  # global batch 8, micro-batch 2, one backward replica
    expected = [(s, m) for s in (1, 2) for m in range(microbatches)]  # MegaScan skips step 0
    sends = 0
    for rank, path in list_rank_files(tmp_path / "trace").items():
        events = list(read_rank_file(path))
        spans = [e for e in events if e.get("cat") == "compute" and e["ph"] == "X"]
        names = {e["name"] for e in spans}
        stage = rank // 2
        if runs[rank]["forward"]:
            want = {"forward"} if mode == "ship" or stage == 0 else set()
        else:
            want = {"recompute", "backward"}
        assert names == want, (rank, names)
        for name in want:
            got = sorted((e["args"]["step"], e["args"]["microbatch"]) for e in spans if e["name"] == name)
            assert got == expected, (rank, name, got)
        for event in events:
            if event.get("cat") == "p2p" and event["ph"] == "X":
                sends += len(event["args"].get("sends", []))
    merged = tmp_path / "merged.json.gz"
    summary = aggregate(tmp_path / "trace", merged, progress=False)
    with gzip.open(merged, "rt") as stream:
        flows = sum(1 for e in json.load(stream)["traceEvents"] if e["ph"] == "s" and e.get("cat") == "p2p")
    # per traced step and microbatch: one gradient (stage 1 -> 0) and, ship: two bundles (one per stage) and the
    # activation between forward stages; recompute: the stage input for backward stage 1
    per_microbatch = 1 + (3 if mode == "ship" else 1)
    assert sends == 2 * microbatches * per_microbatch, sends
    counts = summary["flows"]
    assert counts["unmatched_sends"] == counts["unmatched_recvs"] == 0, counts
    # Every send found its receive; ranks of one machine share their clock, so none is drawn backwards or dropped.
    assert flows == counts["p2p"] == sends, counts


@pytest.mark.parametrize("transport", ["torch", "tcp"])
def test_other_transports(ranks: Any, transport: str) -> None:
    """The transports MegaFBD picks across nodes (``auto``: ``torch``) carry it as ``shm`` does."""
    common = dict(pipeline_model_parallel_size=2, steps=2)
    want = ranks.run(2, dc.fit_recording, 2, schedule="1f1b", **common)
    options = {"mode": "ship", "transport": transport}
    got = ranks.run(4, dc.fit_recording, 4, schedule="fbd", schedule_options=options, **common)
    for rank in range(4):
        assert_close(got[rank], want[(rank // 2)], 1e-5, f"fbd over {transport}, rank {rank}")
