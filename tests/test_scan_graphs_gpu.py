"""MegaScan on steps replayed as CUDA graphs (one GPU, the default strategy; skipped without CUDA).

The graph's own events time a replayed step (``scan.recorder``), so tracing no longer costs the graph:

* A traced fit keeps its graph (one capture, every later step replayed, no eager step asked for) and trains
  as the untraced one: losses equal within cuDNN attention's run-to-run noise.
* Every replayed traced step holds the spans an eager traced step of the same fit holds (forward, backward and
  layer spans per microbatch), each inside its step span, the forwards in microbatch order, marked
  ``args.graph``, with GPU busy time that covers them (the profiler sees the graph's kernels).
* Against what it did not build: the same model traced eagerly (``cuda_graphs=False`` with the same fused
  kernels; the recorder's validated path). The GPU ran each forward's and backward's kernels for as long in both
  (busy time within 15%), and a replayed span, free of the eager step's launch gaps, lasts about as long as the
  eager step's kernels ran in it.
* A listener that is not graph-safe (``SlowdownInjector``) still makes every step eager.

``LM_RESULTS_DIR``: where the numbers go (``megascan_graphs_gpu.json``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from gpu_work import record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# GPU-bound on one H100 even eagerly (the eager comparison needs the GPU, not the host, to pace the spans).
SHAPE = dict(num_layers=6, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000)
MICROBATCHES = 4
FUSED = dict(fused_norms=True, fused_bias_grad=True, fused_residual_norm=True)
STEPS = 8


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def _fit(
    trace_dir: Optional[Path], callbacks: list[Any] = (), cuda_graphs: Optional[bool] = None, **module: Any
) -> dict[str, Any]:
    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule
    from lightning_megatron.scan import MegaScan

    losses = _Losses()
    scan = []
    if trace_dir is not None:
        scan = [MegaScan(trace_dir, interval=2, window=2, granularity="layer", detect=False, gpu_busy_every=1)]
    strategy = MegatronAppStrategy(micro_batch_size=2, cuda_graphs=cuda_graphs)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[*scan, *callbacks, losses],
    )
    data = SyntheticTokenDataModule(
        vocab_size=SHAPE["vocab_size"],
        seq_length=SHAPE["seq_length"],
        global_batch_size=2 * MICROBATCHES,
        num_train_samples=2 * MICROBATCHES * STEPS,
    )
    torch.manual_seed(0)
    trainer.fit(GPTModule(**SHAPE, layer_spec="sdpa", **module), data)
    graph = strategy.step_graph
    counts = None if graph is None else (graph.captures, graph.replays, graph.eager_steps_by_caller)
    return {"losses": losses.losses, "graph": counts}


def _steps(trace_dir: Path) -> dict[int, list[dict[str, Any]]]:
    from lightning_megatron.scan.format import list_rank_files, read_rank_file

    (path,) = list_rank_files(trace_dir).values()
    out: dict[int, list[dict[str, Any]]] = {}
    for event in read_rank_file(path):
        step = (event.get("args") or {}).get("step")
        if event.get("ph") == "X" and step is not None:
            out.setdefault(step, []).append(event)
    return out


def _inside(step: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans of the step function (the captured part): compute, layers, gradient sync; not the optimizer's
    collectives, which run eagerly after the replay."""
    return [e for e in step if e["cat"] in ("compute", "compute.layer", "grad_sync")]


def _shape(step: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a step's spans are, without their times: name, category, microbatch (sorted)."""
    return sorted((e["name"], e["cat"], e["args"].get("microbatch", -1)) for e in _inside(step))


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("scan-graphs")
    return {
        "traced": {**_fit(root / "graphs"), "dir": root / "graphs"},
        "untraced": _fit(None),
        # the kernels the graphed default runs (eager steps default to the unfused ones)
        "eager": {**_fit(root / "eager", cuda_graphs=False, **FUSED), "dir": root / "eager"},
    }


def test_a_traced_fit_keeps_its_graph_and_trains_the_same(fits: dict[str, Any]) -> None:
    traced, untraced = fits["traced"], fits["untraced"]
    assert traced["graph"] == (1, STEPS - 2, 0), traced["graph"]  # two warm-up steps, then capture and replays
    assert untraced["graph"] == traced["graph"]
    # Equal within cuDNN attention's run-to-run noise (its backward is not bitwise deterministic; the first eager
    # steps already differ by ~5e-6): tracing changes no arithmetic.
    assert len(traced["losses"]) == STEPS
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(traced["losses"], untraced["losses"])), (
        traced["losses"],
        untraced["losses"],
    )


def test_replayed_steps_hold_the_eager_steps_spans(fits: dict[str, Any], tmp_path: Path) -> None:
    steps = _steps(fits["traced"]["dir"])
    assert sorted(steps) == list(range(1, STEPS)), sorted(steps)  # start_step=1, every step traced
    eager_step = steps[1]  # the second warm-up step: traced eagerly
    assert not any(e["args"].get("graph") for e in eager_step)
    assert all("enqueue_us" in e["args"] for e in _inside(eager_step))
    for number in range(2, STEPS):  # the capture's step (2) and the replays
        step = steps[number]
        inside = _inside(step)
        assert _shape(step) == _shape(eager_step), number
        stray = [e for e in inside if e["args"].get("graph") is not True or "enqueue_us" in e["args"]]
        assert not stray, stray[:3]
        (frame,) = [e for e in step if e["cat"] == "step"]
        assert all(frame["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= frame["ts"] + frame["dur"] + 1 for e in inside)
        assert all(e["dur"] > 0 for e in inside)
        forwards = sorted(
            (e for e in inside if e["cat"] == "compute" and e["name"] == "forward"), key=lambda e: e["ts"]
        )
        assert [e["args"]["microbatch"] for e in forwards] == list(range(MICROBATCHES))

    # GPU busy time (every window tries; busy.py rejects a window whose anchors and events disagree): the profiler
    # sees the replayed kernels, and a GPU-bound replay runs kernels through (nearly) all of every compute span.
    compute = [e for s in range(2, STEPS) for e in steps[s] if e["cat"] == "compute"]
    busy = [e for e in compute if "busy_us" in e["args"]]
    assert busy, "no replayed step got GPU busy time"
    assert statistics.median(e["args"]["busy_us"] / e["dur"] for e in busy) > 0.8, busy[:4]
    eager = _steps(fits["eager"]["dir"])
    row: dict[str, Any] = {
        "model": SHAPE,
        "microbatches": MICROBATCHES,
        "device": torch.cuda.get_device_name(),
        "graph": fits["traced"]["graph"],
        "replayed_compute_spans_with_busy_time": f"{len(busy)} of {len(compute)}",
    }
    for part in ("forward", "backward"):
        row[part] = {
            "replayed_dur_ms": _median(steps, part, "dur"),
            "replayed_busy_ms": _median(steps, part, "busy_us"),
            "eager_dur_ms": _median(eager, part, "dur"),
            "eager_busy_ms": _median(eager, part, "busy_us"),
        }
    record("megascan_graphs_gpu.json", tmp_path, "replayed_vs_eager", row)
    # Against the eager tracer (the validated path; the same kernels): the GPU ran the same kernels for as long,
    # and a replayed span, free of launch gaps, lasts about as long as those kernels ran in the eager step.
    for part in ("forward", "backward"):
        numbers = row[part]
        assert 0.85 < numbers["replayed_busy_ms"] / numbers["eager_busy_ms"] < 1.15, row
        assert 0.9 < numbers["replayed_dur_ms"] / numbers["eager_busy_ms"] < 1.3, row


def _median(steps: dict[int, list[dict[str, Any]]], name: str, field: str) -> float:
    """Median over steps 2 and later of the compute spans ``name``: ``dur`` or ``busy_us`` (where measured), ms."""
    values = [
        e["dur"] if field == "dur" else e["args"].get(field)
        for s, events in steps.items()
        if s >= 2
        for e in events
        if e["cat"] == "compute" and e["name"] == name
    ]
    values = [v for v in values if v is not None]
    return statistics.median(values) / 1000 if values else float("nan")


def test_a_listener_that_is_not_graph_safe_keeps_steps_eager(tmp_path: Path) -> None:
    from lightning_megatron.scan import SlowdownInjector

    out = _fit(tmp_path / "trace", [SlowdownInjector(ranks=[0], factor=1.2)])
    captures, replays, eager_steps = out["graph"]
    assert (captures, replays) == (0, 0) and eager_steps == STEPS, out["graph"]
