"""MegaScan on steps replayed as CUDA graphs (one GPU, the default strategy; skipped without CUDA).

The graph's own events time a replayed step (``scan.tracing.recorder``), so tracing no longer costs the graph:

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
* Shapes and settings the recorder's design did not start from: a Llama-style model with dropout (tracing must not
  shift the Philox streams), ``granularity="op"`` (hundreds of events per step in the graph), ``profile_steps`` on a
  replayed step, and Lightning's own ``PyTorchProfiler`` recording while the step is captured.

``LM_RESULTS_DIR``: where the numbers go (``megascan_graphs_gpu.json``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from gpu_work import LLAMA_STYLE_LAYERS, record, run_script
from trainers import quiet_trainer

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
    trace_dir: Optional[Path],
    callbacks: list[Any] = (),
    cuda_graphs: Optional[bool] = None,
    shape: Optional[dict[str, Any]] = None,
    scan: Optional[dict[str, Any]] = None,
    trainer_options: Optional[dict[str, Any]] = None,
    **module: Any,
) -> dict[str, Any]:
    """One fit of ``shape`` (default ``SHAPE``) with MegaScan (``scan`` overrides its test settings) when
    ``trace_dir`` is set; ``trainer_options``: further Trainer arguments."""
    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule
    from lightning_megatron.scan import MegaScan

    shape = shape or SHAPE
    losses = _Losses()
    tracers = []
    if trace_dir is not None:
        settings = {**dict(interval=2, window=2, granularity="layer", detect=False, gpu_busy_every=1), **(scan or {})}
        tracers = [MegaScan(trace_dir, **settings)]
    strategy = MegatronAppStrategy(micro_batch_size=2, cuda_graphs=cuda_graphs)
    trainer = quiet_trainer(
        accelerator="gpu",
        precision="bf16-mixed",
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[*tracers, *callbacks, losses],
        **(trainer_options or {}),
    )
    data = SyntheticTokenDataModule(
        vocab_size=shape["vocab_size"],
        seq_length=shape["seq_length"],
        global_batch_size=2 * MICROBATCHES,
        num_train_samples=2 * MICROBATCHES * STEPS,
    )
    torch.manual_seed(0)
    trainer.fit(GPTModule(**shape, layer_spec="sdpa", **module), data)
    graph = strategy.step_graph
    counts = None if graph is None else (graph.captures, graph.replays, graph.eager_steps_by_caller)
    return {"losses": losses.losses, "graph": counts}


def _steps(trace_dir: Path) -> dict[int, list[dict[str, Any]]]:
    from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

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
    return [e for e in step if e["cat"] in ("compute", "compute.layer", "compute.op", "grad_sync")]


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
    _assert_replays_hold(steps, eager_step)

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


def _assert_replays_hold(steps: dict[int, list[dict[str, Any]]], eager_step: list[dict[str, Any]]) -> None:
    """Every step from the capture's (2) on holds ``eager_step``'s spans, marked as replayed (no enqueue fields),
    inside its step span, not empty, the forwards in microbatch order."""
    for number in range(2, STEPS):
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


def test_steps_traced_eagerly_in_place_of_replays_are_marked(tmp_path: Path) -> None:
    """``trace_replays=False`` in a graphed fit: the traced steps (1, 3, 5, 7) run eagerly, the others warm up
    (0, 2), capture (4) and replay (4, 6); the traced steps after the capture ran in place of a replay and say so
    (``args.in_place_of_replay``, read by ``scan.analysis.attribution``), the ones before it do not."""
    out = _fit(tmp_path / "trace", scan=dict(interval=2, window=1, trace_replays=False))
    assert out["graph"] == (1, 2, 4), out["graph"]
    steps = _steps(tmp_path / "trace")
    marks = {
        number: bool(frame["args"].get("in_place_of_replay"))
        for number, spans in steps.items()
        for frame in spans
        if frame["cat"] == "step"
    }
    assert marks == {1: False, 3: False, 5: True, 7: True}, marks


# Llama-style (RMSNorm, SwiGLU, rotary embeddings, grouped queries, no biases), with dropout: other kernels in the
# graph (the rotary and SwiGLU ones, the dropout's Philox draws), same GPU-bound size as SHAPE.
LLAMA_SHAPE = dict(
    SHAPE, **LLAMA_STYLE_LAYERS, num_query_groups=4, ffn_hidden_size=5632, hidden_dropout=0.1, attention_dropout=0.1
)


def test_llama_style_with_dropout_traced_on_replays(tmp_path: Path) -> None:
    """Tracing takes nothing from the dropout streams: the traced and untraced graphed fits draw the same masks
    (losses equal within cuDNN's noise, where a shifted Philox offset would give other masks and other losses)."""
    traced = _fit(tmp_path / "trace", shape=LLAMA_SHAPE)
    untraced = _fit(None, shape=LLAMA_SHAPE)
    worst = max(abs(a - b) / abs(b) for a, b in zip(traced["losses"], untraced["losses"]))
    record(
        "megascan_graphs_gpu.json",
        tmp_path,
        "llama_style_dropout",
        {"model": LLAMA_SHAPE, "graph": traced["graph"], "max_rel_loss_diff_traced_vs_untraced": worst},
    )
    assert traced["graph"] == untraced["graph"] == (1, STEPS - 2, 0), (traced["graph"], untraced["graph"])
    assert len(traced["losses"]) == STEPS and worst <= 1e-3, (traced["losses"], untraced["losses"])
    steps = _steps(tmp_path / "trace")
    _assert_replays_hold(steps, steps[1])


def test_op_granularity_on_replays(tmp_path: Path) -> None:
    """Every module with parameters gets a span pair per call: hundreds of events per step, all in the graph."""
    out = _fit(tmp_path / "trace", scan={"granularity": "op"})
    assert out["graph"] == (1, STEPS - 2, 0), out["graph"]
    steps = _steps(tmp_path / "trace")
    ops = [e for e in steps[1] if e["cat"] == "compute.op"]
    per_layer = {e["args"]["part"] for e in ops}
    # attention's QKV and output projections and the MLP's two linears at least, forward and backward, per layer
    assert len(ops) >= SHAPE["num_layers"] * MICROBATCHES * 4 * 2 and len(per_layer) >= 4, (len(ops), per_layer)
    _assert_replays_hold(steps, steps[1])
    record(
        "megascan_graphs_gpu.json",
        tmp_path,
        "op_granularity",
        {"graph": out["graph"], "op_spans_per_step": len(ops), "parts": sorted(per_layer)},
    )


def test_profile_steps_on_a_replayed_step(tmp_path: Path) -> None:
    """``MegaScan(profile_steps=[4])`` on a step that is a replay: its Kineto trace holds the graph's kernels, and
    MegaScan's own spans of that step are there as on every other replay."""
    out = _fit(tmp_path / "trace", scan={"profile_steps": [4]})
    assert out["graph"] == (1, STEPS - 2, 0), out["graph"]
    steps = _steps(tmp_path / "trace")
    _assert_replays_hold(steps, steps[1])
    (kineto,) = sorted((tmp_path / "trace" / "profile").glob("*.pt.trace.json*"))
    events = json.loads(kineto.read_text())["traceEvents"]
    marks = [e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    record(
        "megascan_graphs_gpu.json",
        tmp_path,
        "profile_steps_on_replay",
        {"graph": out["graph"], "marks": marks, "kernels": len(kernels)},
    )
    assert set(marks) == {"ProfilerStep#4"}, marks  # (the CPU annotation and its GPU copy)
    assert len(kernels) > 100, len(kernels)  # a replay of six layers x four microbatches, forward and backward


def test_lightning_pytorch_profiler_during_the_capture(tmp_path: Path) -> None:
    """``Trainer(profiler="pytorch")``: Lightning's default schedule records steps 2-4, so its Kineto session (CUPTI
    attached) spans the capture. The graph is still captured and replayed, MegaScan traces the replays (busy time
    is skipped while another profiler session runs), and the fit trains as the untraced, unprofiled one."""
    from lightning.pytorch.profilers import PyTorchProfiler

    profiler = PyTorchProfiler(dirpath=tmp_path / "lightning", filename="prof", export_to_chrome=True)
    out = _fit(tmp_path / "trace", trainer_options={"profiler": profiler})
    plain = _fit(None)
    worst = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], plain["losses"]))
    exported = sorted((tmp_path / "lightning").rglob("*.json"))
    record(
        "megascan_graphs_gpu.json",
        tmp_path,
        "lightning_profiler_during_capture",
        {"graph": out["graph"], "max_rel_loss_diff": worst, "exported": [p.name for p in exported]},
    )
    assert out["graph"] == (1, STEPS - 2, 0), out["graph"]
    assert worst <= 1e-4, (out["losses"], plain["losses"])
    assert exported, "Lightning's profiler wrote no trace"
    steps = _steps(tmp_path / "trace")
    _assert_replays_hold(steps, steps[1])


_TWO_GPU_FIT = r"""
import json, sys, tempfile
sys.path.insert(0, "tests")
from cases import fit_gpt
from lightning_megatron.scan import MegaScan

traced = sys.argv[1] == "traced"
scan = [MegaScan(tempfile.mkdtemp(), interval=2, window=1, detect=False)] if traced else []

def probe(module):
    graph = module.trainer.strategy.step_graph
    return None if graph is None else [graph.captures, graph.replays, graph.eager_steps_by_caller]

model = dict(vocab_size=1024, seq_length=128, num_layers=4, hidden_size=256, num_attention_heads=4)
out = fit_gpt(2, steps=10, precision="bf16-mixed", accelerator="gpu", model=model, probe=probe, callbacks=scan,
              data={"vocab_size": 1024, "seq_length": 128, "global_batch_size": 8})
print("RESULT", json.dumps({"loss": out["loss"], "graph": out["probe"]}))
"""


def _two_gpu_fit(scratch: Path, source: str, *args: str) -> dict[str, Any]:
    """Run ``source`` (a fit of 2 processes that prints ``RESULT {json}``) with ``args``; return that JSON."""
    script = scratch / "two_gpu_fit.py"  # a file: Lightning starts rank 1 by running sys.argv again
    script.write_text(source)
    return run_script(script, *args)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_traced_steps_run_eagerly_between_replays(tmp_path: Path) -> None:
    """DP2, graphs by default: MegaScan traces replays only in one-process fits, so here its traced steps (1, 3, 5,
    7, 9) run eagerly and the untraced ones are warm-up steps, the capture and replays (0, 2, 4, 6, 8); the fit
    trains as the untraced one (same kernels: the fused ones chosen with the graph, eager or replayed)."""
    with tempfile.TemporaryDirectory() as scratch:
        results = {name: _two_gpu_fit(Path(scratch), _TWO_GPU_FIT, name) for name in ("traced", "untraced")}
    traced, untraced = results["traced"], results["untraced"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(traced["loss"], untraced["loss"]))
    record("megascan_graphs_gpu.json", tmp_path, "two_gpu_dp2", {**results, "max_rel_loss_diff": worst})
    assert untraced["graph"] == [1, 8, 0], untraced["graph"]
    assert traced["graph"] == [1, 3, 5], traced["graph"]  # captured at step 4, replayed at 4, 6, 8
    assert worst <= 1e-4, results


_TWO_GPU_REPLAYED = r"""
import json, sys
sys.path.insert(0, "tests")
from cases import fit_gpt
from lightning_megatron.scan import MegaScan

mode, layout, trace_dir = sys.argv[1], sys.argv[2], sys.argv[3]
scan = [] if mode == "untraced" else [
    MegaScan(trace_dir, interval=1, window=1, detect=True, gpu_busy_every=1, trace_replays=mode == "replayed")
]
parallel = {"dp2": {}, "tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True}}[layout]

def probe(module):
    graph = module.trainer.strategy.step_graph
    return None if graph is None else [graph.captures, graph.replays, graph.eager_steps_by_caller]

model = dict(vocab_size=1024, seq_length=128, num_layers=4, hidden_size=256, num_attention_heads=4)
out = fit_gpt(2, steps=10, precision="bf16-mixed", accelerator="gpu", model=model, probe=probe, callbacks=scan,
              data={"vocab_size": 1024, "seq_length": 128, "global_batch_size": 8}, **parallel)
report = scan[0].report if scan else None
suspects = [] if report is None else [[s.rank, s.kind] for s in report.suspects]
print("RESULT", json.dumps({"loss": out["loss"], "graph": out["probe"], "suspects": suspects}))
"""

_IN_THE_GRAPH = ("compute", "compute.layer", "grad_sync", "collective")


def _rank_steps(trace_dir: Path) -> dict[int, dict[int, list[dict[str, Any]]]]:
    from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

    out: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for rank, path in list_rank_files(trace_dir).items():
        for event in read_rank_file(path):
            step = (event.get("args") or {}).get("step")
            if event.get("ph") == "X" and step is not None:
                out.setdefault(rank, {}).setdefault(step, []).append(event)
    return out


def _span_kinds(step: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted((e["name"], e["cat"], e["args"].get("microbatch", -1)) for e in step if e["cat"] in _IN_THE_GRAPH)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", ["dp2", "tp2-sp"])
def test_two_gpu_replayed_traces_hold_the_eager_steps_spans(tmp_path: Path, layout: str) -> None:
    """``MegaScan(trace_replays=True)`` at DP2 and TP2 + SP: the traced steps stay replays (one capture, no step
    made eager for MegaScan), the fit trains as the untraced one, and every replayed step of every rank holds the
    spans an eagerly traced step holds (forward, backward, gradient sync, the collectives: those inside the graph
    are its own events), each inside its step span, marked ``graph``; detection on the clean replayed fit names
    nothing. What a multi-GPU default (``trace_replays=None``) waits for before tracing replays there."""
    modes = ("replayed", "eager", "untraced")
    results = {mode: _two_gpu_fit(tmp_path, _TWO_GPU_REPLAYED, mode, layout, str(tmp_path / mode)) for mode in modes}
    replayed, untraced = results["replayed"], results["untraced"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(replayed["loss"], untraced["loss"]))
    replayed_steps, eager_steps = _rank_steps(tmp_path / "replayed"), _rank_steps(tmp_path / "eager")
    spans = {rank: len(_span_kinds(steps[5])) for rank, steps in replayed_steps.items()}
    record(
        "megascan_graphs_gpu.json",
        tmp_path,
        f"two_gpu_replayed_{layout}",
        {**results, "max_rel_loss_diff": worst, "spans_in_a_replayed_step": spans},
    )
    assert replayed["graph"] == untraced["graph"], results  # one capture, the same replays, nothing made eager
    assert worst <= 1e-4, results
    assert sorted(replayed_steps) == [0, 1]
    for rank, steps in replayed_steps.items():
        eager = _span_kinds(eager_steps[rank][5])
        assert any(cat == "collective" for _, cat, _ in eager) or layout == "dp2", eager
        for number in range(3, 10):  # captured at step 2 (after two eager warm-up steps), replayed from 3 on
            step = steps[number]
            assert _span_kinds(step) == eager, (rank, number)
            inside = [e for e in step if e["cat"] in _IN_THE_GRAPH and e["args"].get("graph")]
            assert inside, (rank, number)
            (frame,) = [e for e in step if e["cat"] == "step"]
            assert all(
                frame["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= frame["ts"] + frame["dur"] + 1 for e in inside
            )
            assert all(e["dur"] > 0 for e in inside)
    assert replayed["suspects"] == [], replayed["suspects"]
