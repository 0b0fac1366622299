"""MegaScan at context parallelism (real gloo ranks): ring attention's key/value exchanges are traced as spans, every
send pairs with the receive on the next rank of the ring (flows in the merged trace), the time blocked in an
exchange's ``wait()`` counts as waiting, training is unchanged and nothing is left observing after the fit."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import dpp_cases as dc
from cases import TINY_MODEL, fit_gpt

from lightning_megatron.scan import MegaScan
from lightning_megatron.scan.analysis.aggregate import aggregate
from lightning_megatron.scan.analysis.detect import detect
from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

MODEL = {"layer_spec": "sdpa", **dc.llama_model()}
STEPS = 3
TRACED = STEPS - 1  # MegaScan(interval=1, window=1) traces every step after the first


def traced_context_fit(trace_dir: str, world: int, trace: bool, **layout: Any) -> dict[str, Any]:
    from lightning_megatron.context.ring_attention import set_ring_observer

    callbacks = [MegaScan(trace_dir, interval=1, window=1, detect=False)] if trace else []
    result = fit_gpt(world, steps=STEPS, model=MODEL, callbacks=callbacks, **layout)
    return {"loss": result["loss"], "observer_left": set_ring_observer(None) is not None}


def test_ring_exchanges_are_traced_and_paired(ranks: Any, tmp_path: Path) -> None:
    layout = dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    traced = ranks.run(4, traced_context_fit, str(tmp_path / "trace"), 4, True, **layout)
    plain = ranks.run(4, traced_context_fit, str(tmp_path / "plain"), 4, False, **layout)
    assert [r["loss"] for r in traced] == [r["loss"] for r in plain], "tracing changed training"
    assert not any(r["observer_left"] for r in traced)
    layers = TINY_MODEL["num_layers"]
    for rank, path in list_rank_files(tmp_path / "trace").items():
        events = [e for e in read_rank_file(path) if e.get("ph") == "X"]
        names = Counter(e["name"] for e in events if e.get("cat") == "ring")
        # CP2, per layer and microbatch of a traced step: the keys/values make N - 1 = 1 hop in the forward and
        # again in the backward, where their gradients make N = 2 hops back to their owner
        microbatches = 8 // 2  # fit_gpt's global batch 8, micro-batch 2, DP = 4 / (CP2 × TP2) = 1
        per_step = layers * microbatches
        assert names == {
            "ring kv forward": TRACED * per_step,
            "ring kv backward": TRACED * per_step,
            "ring dkv backward": 2 * TRACED * per_step,
        }, (rank, names)
        waits = [e for e in events if e.get("cat") == "ring.wait"]
        assert len(waits) == 4 * TRACED * per_step
        for event in events:
            if event.get("cat") == "ring":
                (send,), (recv,) = event["args"]["sends"], event["args"]["recvs"]
                assert send["direction"] == recv["direction"] == event["name"] and send["bytes"] > 0
    merged = tmp_path / "merged.json.gz"
    counts = aggregate(tmp_path / "trace", merged, progress=False)["flows"]
    # every exchange of every rank drawn once, none left out as drawn backwards (those are counted apart, in
    # "dropped": collectives of a few µs can be, within the clocks' uncertainty on a loaded machine)
    assert counts["ring"] == 4 * 4 * TRACED * per_step, counts
    assert counts["unmatched_sends"] == counts["unmatched_recvs"] == 0, counts
    with gzip.open(merged, "rt") as stream:
        flows = [e for e in json.load(stream)["traceEvents"] if e.get("cat") == "ring" and e["ph"] in "sf"]
    assert len(flows) == 2 * counts["ring"]
    report = detect(tmp_path / "trace")  # detection reads the new categories
    assert report.params is not None
