"""CUDA graphs on a GPU: the replayed step computes what the eager step computes.

* ``StepGraph`` alone, on a small model with an optimizer outside the graph: bit-identical losses and
  parameters to the eager loop, fresh inputs each replay, one capture; a new batch shape captures again, too
  many shapes fall back to eager steps; a step that waits for the GPU is named with its file and line.
* Real fits (subprocesses: megatron-core's global state is per process) with ``cuda_graphs`` off and on, in one
  launch: a GPT-2-style model without dropout (losses equal to 1e-5; also with ``cuda_graphs`` unset, which
  on one GPU means on) and a Llama-style one (RMSNorm, SwiGLU, RoPE, GQA) with dropout 0.1 (the dropout
  streams are registered with the graph), each with validation between graphed steps. With two GPUs also
  TP2 + SP, DP2, and DP2 with the distributed optimizer and megatron-core's overlapped gradient reduction.
* Automatic graphs with steps that cannot be captured (a host sync; the legacy stream waiting on the capture):
  one warning, the fit goes on eagerly and matches the eager fit.
* By default a graphed step on one GPU accumulates its weight gradients in the GEMM (``gradient_accumulation_fusion``
  unset); the comparisons above pin it off, one test compares it with the graphed fit without it.

``LM_RESULTS_DIR``: where the losses go (``graphs_gpu.json``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_work import LLAMA_STYLE_LAYERS, record, run_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _record(tmp_path: Path, key: str, row: dict[str, Any]) -> None:
    record("graphs_gpu.json", tmp_path, key, row)


def _stepper(model: torch.nn.Module) -> Any:
    from lightning_megatron.strategy.step import StepOutput

    def run(microbatches: Any) -> StepOutput:
        total = torch.zeros((), device="cuda")
        for mb in microbatches:
            loss = ((model(mb["x"]) - mb["y"]) ** 2).mean()
            loss.backward()
            total = total + loss.detach()
        count = torch.full((), float(len(microbatches)), device="cuda")
        return StepOutput(loss=total / count, loss_sum=total, num_tokens=count)

    return run


def _batches(rows: list[int], seed: int = 1) -> list[list[dict[str, torch.Tensor]]]:
    """One step per entry of ``rows``: two microbatches of that many rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    steps = []
    for n in rows:
        x, y = torch.randn(n, 64, device="cuda", generator=g), torch.randn(n, 64, device="cuda", generator=g)
        steps.append([{"x": x, "y": y}, {"x": x.flip(0), "y": y}])
    return steps


def _train(batches: list[Any], graphed: bool, max_captures: int = 4) -> tuple[list[float], list[torch.Tensor], Any]:
    """As in the strategy: gradients accumulate through hooks on accumulator nodes made (and kept) after
    ``open()``, into buffers that keep their address; the optimizer steps outside the graph."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from lightning_megatron.strategy.graphs import StepGraph

    # A fit earlier in this process (another test file's, eager) leaves megatron-core's RNG tracker seeded without
    # graph-safe generators, which a capture refuses; this model draws nothing from it: start from the empty
    # tracker of a fresh process, as when this file runs alone.
    get_cuda_rng_tracker().reset()
    graph = StepGraph(warmup_steps=2, max_captures=max_captures)
    graph.open()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        main_grads = {p: torch.zeros_like(p) for p in model.parameters()}
        accumulators = []
        for p in model.parameters():  # megatron-core DDP's pattern: keep the node, hook it, move .grad away
            node = p.expand_as(p).grad_fn.next_functions[0][0]

            def hook(*_: Any, p: torch.nn.Parameter = p, buffer: torch.Tensor = main_grads[p]) -> None:
                buffer.add_(p.grad)
                p.grad = None

            node.register_hook(hook)
            accumulators.append(node)
        run, losses = _stepper(model), []
        for batch in batches:
            for buffer in main_grads.values():
                buffer.zero_()
            out = graph(run, batch) if graphed else run(batch)
            for p in model.parameters():
                p.grad = main_grads[p]
            optimizer.step()
            for p in model.parameters():
                p.grad = None
            losses.append(out.loss.item())
        return losses, [p.detach().clone() for p in model.parameters()], graph
    finally:
        graph.close()


def test_step_graph_replays_the_eager_step_bit_for_bit() -> None:
    batches = _batches([8] * 8)
    eager, eager_params, _ = _train(batches, graphed=False)
    replayed, replayed_params, graph = _train(batches, graphed=True)
    assert (graph.captures, graph.replays) == (1, 6)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # close() gave the stream back
    assert all(torch.isfinite(torch.tensor(eager)))
    assert replayed == eager
    assert len(set(replayed)) == len(replayed)  # every replay read its own batch
    assert all(torch.equal(a, b) for a, b in zip(replayed_params, eager_params))


def test_a_new_shape_captures_a_new_graph_and_too_many_shapes_run_eagerly() -> None:
    rows = [8] * 4 + [16] * 4 + [8] * 4  # A, B, A again: three captures, each after two eager steps
    batches = _batches(rows, seed=2)
    eager, eager_params, _ = _train(batches, graphed=False)
    replayed, replayed_params, graph = _train(batches, graphed=True)
    assert (graph.captures, graph.replays) == (3, 6)
    assert replayed == eager and all(torch.equal(a, b) for a, b in zip(replayed_params, eager_params))
    # With one graph allowed, the second shape gives up: the rest of the fit is eager, and still the same.
    with pytest.warns(UserWarning, match="shapes changed again"):
        capped, capped_params, graph = _train(batches, graphed=True, max_captures=1)
    assert (graph.captures, graph.replays) == (1, 2)
    assert capped == eager and all(torch.equal(a, b) for a, b in zip(capped_params, eager_params))


def test_a_step_that_waits_for_the_gpu_is_named_before_the_capture() -> None:
    """Strict (graphs asked for): an error naming the place. Not strict (automatic): one warning naming it, the
    checked step's result (it ran), and eager steps from then on."""
    from lightning_megatron.errors import MegatronConfigError
    from lightning_megatron.strategy.graphs import StepGraph
    from lightning_megatron.strategy.step import StepOutput

    x = torch.randn(16, device="cuda")

    def run(microbatches: Any) -> StepOutput:
        loss = microbatches[0].sum()
        if loss > 0:  # a Python `if` on a GPU tensor: the host waits
            loss = loss * 2
        return StepOutput(loss=loss, loss_sum=loss, num_tokens=loss)

    graph = StepGraph(warmup_steps=2)
    graph.open()
    try:
        graph(run, [x])
        with pytest.raises(MegatronConfigError, match=r"waits for the GPU.*test_graphs_gpu.py:\d+"):
            graph(run, [x])
    finally:
        graph.close()
    graph = StepGraph(warmup_steps=1, strict=False)
    graph.open()
    try:
        with pytest.warns(UserWarning, match=r"cuda_graphs \(automatic\).*test_graphs_gpu.py:\d+"):
            out = graph(run, [x])
        assert torch.equal(out.loss, run([x]).loss)
        assert graph(run, [x]).loss.item() == out.loss.item() and (graph.captures, graph.replays) == (0, 0)
        assert "waits for the GPU" in graph.gave_up_because
    finally:
        graph.close()


def _cross_stream_blocks_are_reused() -> bool:
    """Whether the caching allocator recycles blocks used on a second stream: it does not while it counts a capture
    as underway (it may not query their events then), which a failed capture used to leave behind for good."""
    side, block = torch.cuda.Stream(), 64 * 2**20
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for _ in range(8):
        t = torch.empty(block, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            t.add_(1)
        t.record_stream(side)
        del t
        torch.cuda.synchronize()  # the block's use on the side stream is over: the next allocation may take it
    return torch.cuda.memory_reserved() - before < 4 * block


def test_a_capture_that_fails_is_an_error_or_a_step_to_run_again() -> None:
    """The legacy default stream waiting on the step's stream passes the sync check but breaks the capture (the
    legacy stream may not depend on a capturing one: what autograd did before the step got a stream of its own,
    ``StepGraph.open``). Strict: an error naming the place. Not strict: ``StepNotRun`` after one warning (the
    caller runs that step eagerly), then eager steps. After the abandoned capture the CUDA context, the random
    generators registered with it and the caching allocator work (``compat/graph_capture.py``)."""
    from lightning_megatron.errors import MegatronConfigError
    from lightning_megatron.strategy.graphs import StepGraph, StepNotRun
    from lightning_megatron.strategy.step import StepOutput

    x = torch.randn(16, device="cuda")

    def run(microbatches: Any) -> StepOutput:
        # Not a host sync (the sync check passes it), but the legacy stream may not depend on a capturing stream.
        torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
        loss = microbatches[0].sum()
        return StepOutput(loss=loss, loss_sum=loss, num_tokens=loss)

    for strict in (True, False):
        graph = StepGraph(warmup_steps=1, strict=strict)
        graph.open()
        try:
            graph(run, [x])  # the warm-up step: the sync check finds nothing
            if strict:
                with pytest.raises(MegatronConfigError, match=r"capturing the training step.*test_graphs_gpu.py:\d+"):
                    graph(run, [x])
            else:
                with pytest.warns(UserWarning, match=r"cuda_graphs \(automatic\): capturing"):
                    with pytest.raises(StepNotRun):
                        graph(run, [x])
                assert graph(run, [x]).loss.item() == pytest.approx(x.sum().item(), rel=1e-6)
                assert graph.captures == 0 and "capturing the training step" in graph.gave_up_because
            # The default generator was registered with the abandoned capture: eager dropout still draws.
            assert 0 < torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5).count_nonzero() < 4096
            assert _cross_stream_blocks_are_reused(), "the allocator still thinks a capture is underway"
        finally:
            graph.close()


_FIT = r"""""
import json, sys, time, warnings
import lightning.pytorch as pl
import torch
sys.path.insert(0, "tests")
from cases import fit_gpt
from lightning_megatron.models import GPTModule
setting, module_name = sys.argv[1], sys.argv[4]
model = json.loads(sys.argv[2])
extra = json.loads(sys.argv[3])


class WaitsForGPU(GPTModule):
    graph_safe_forward_step = True  # a wrong promise: the loss is read on the host

    def forward_step(self, batch, chunk):
        output, loss_fn = super().forward_step(batch, chunk)

        def loss(out):
            loss_sum, tokens = loss_fn(out)
            if tokens < 0:  # a Python `if` on a GPU tensor: the host waits for the GPU
                raise ValueError("negative token count")
            return loss_sum, tokens

        return output, loss


class UsesLegacyStream(GPTModule):
    graph_safe_forward_step = True  # a wrong promise: the legacy default stream may not wait on a capture

    def forward_step(self, batch, chunk):
        torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
        return super().forward_step(batch, chunk)


MODULES = {"gpt": GPTModule, "waits": WaitsForGPU, "legacy_stream": UsesLegacyStream}
if setting != "auto":
    extra["cuda_graphs"] = setting == "on"

class SymmetricCounts(pl.Callback):
    # the symmetric all-reduce's counts at the end of training: teardown takes it back before the probe runs
    counts = None

    def on_train_end(self, trainer, module):
        symmetric = trainer.strategy.tp_layers.symmetric_all_reduce
        if symmetric is not None:
            self.counts = {"calls": symmetric.calls, "fallbacks": symmetric.fallbacks}


symmetric_counts = SymmetricCounts()

def probe(module):
    from lightning_megatron.layers.wgrad_accumulate import fused_accumulation_status

    strategy = module.trainer.strategy
    graph = strategy.step_graph
    accumulation = {"resolved": strategy.fuses_gradient_accumulation, **fused_accumulation_status()}
    symmetric = symmetric_counts.counts
    if graph is None:
        return {"graph": None, "accumulation": accumulation, "symmetric_all_reduce": symmetric}
    graph = {"captures": graph.captures, "replays": graph.replays, "gave_up_because": graph.gave_up_because}
    return {"graph": graph, "accumulation": accumulation, "symmetric_all_reduce": symmetric}

start = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fit_gpt(extra.pop("devices", 1), steps=10, precision="bf16-mixed", accelerator="gpu", model=model,
                  probe=probe, module_cls=MODULES[module_name], callbacks=[symmetric_counts],
                  data={"vocab_size": model["vocab_size"], "seq_length": model["seq_length"], "global_batch_size": 8},
                  trainer={"limit_val_batches": 2, "val_check_interval": 5}, **extra)
notes = [str(w.message) for w in caught if "cuda_graphs" in str(w.message)]
print("RESULT", json.dumps({"loss": out["loss"], "val_loss": out["val_loss"], **out["probe"],
                            "warnings": notes, "seconds": time.perf_counter() - start}))
"""

# The fused kernels are pinned off: with graphs they would be on by default, and the comparison with the eager fit
# (which keeps them off) is about the graph. test_kernels_gpu.py compares fused and unfused fits, both graphed. So is
# the weight-gradient GEMM that accumulates into main_grad (on by default with graphs on one GPU; compared below).
UNFUSED = dict(fused_norms=False, fused_bias_grad=False, fused_residual_norm=False)
PLAIN_ACCUMULATION = {"gradient_accumulation_fusion": False}
GPT2_STYLE = dict(
    vocab_size=1024, seq_length=128, num_layers=4, hidden_size=256, num_attention_heads=4, lr=1e-3, **UNFUSED
)
LLAMA_STYLE = dict(
    vocab_size=1024,
    seq_length=128,
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=704,
    **LLAMA_STYLE_LAYERS,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    lr=1e-3,
    **UNFUSED,
)
REPLAYED = {"captures": 1, "replays": 8, "gave_up_because": None}
"""Ten steps: two eager warm-up steps, the capture at the third (replayed at once: that is how the captured step
computes), replays for the other seven. Validation after the fifth runs eagerly and keeps the graph."""


def _fits(model: dict[str, Any], extra: dict[str, Any], runs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """One subprocess fit per entry of ``runs``: name -> (cuda_graphs setting "off"/"on"/"auto", module).

    The fit runs from a script file, not ``python -c``: with two devices Lightning starts the second rank by
    running ``sys.argv`` again, and ``-c`` is no file it can run."""
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "graphs_fit.py"
        script.write_text(_FIT)
        for name, (setting, module) in runs.items():
            results[name] = _fit(script, setting, model, extra, module)
    return results


def _fit(script: Path, setting: str, model: dict[str, Any], extra: dict[str, Any], module: str) -> dict[str, Any]:
    return run_script(script, setting, json.dumps(model), json.dumps(extra), module)


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_gpt2_style_fit_without_dropout_matches_eager(tmp_path: Path) -> None:
    """Graphs asked for, and by default (one GPU, ``GPTModule``): the same graph, the eager losses."""
    results = _fits(
        GPT2_STYLE, PLAIN_ACCUMULATION, {"off": ("off", "gpt"), "on": ("on", "gpt"), "default": ("auto", "gpt")}
    )
    off, on, default = results["off"], results["on"], results["default"]
    for name in ("on", "default"):
        results[f"max_rel_loss_diff_{name}"] = _max_rel(results[name]["loss"], off["loss"])
        results[f"max_rel_val_loss_diff_{name}"] = _max_rel(results[name]["val_loss"], off["val_loss"])
    _record(tmp_path, "fit/gpt2-style-bf16", results)
    assert off["graph"] is None and on["graph"] == REPLAYED and default["graph"] == REPLAYED
    assert len(on["loss"]) == 10 and len(on["val_loss"]) == 2
    assert default["loss"] == on["loss"] and not default["warnings"]
    assert results["max_rel_loss_diff_on"] < 1e-5 and results["max_rel_val_loss_diff_on"] < 1e-5, results


def test_llama_style_fit_with_dropout_draws_fresh_masks(tmp_path: Path) -> None:
    results = _fits(LLAMA_STYLE, PLAIN_ACCUMULATION, {"off": ("off", "gpt"), "on": ("on", "gpt")})
    off, on = results["off"], results["on"]
    results["max_rel_loss_diff"] = _max_rel(on["loss"], off["loss"])
    _record(tmp_path, "fit/llama-style-dropout-bf16", results)
    assert on["graph"] == REPLAYED
    # The same seeds: a graph replaying one frozen dropout mask, or stale inputs, would drift from the eager fit.
    assert results["max_rel_loss_diff"] < 1e-2, results
    assert on["loss"][-1] < on["loss"][0]


def test_by_default_graphed_steps_accumulate_weight_gradients_in_the_gemm(tmp_path: Path) -> None:
    """On one GPU with graphs (the default) the weight-gradient GEMM accumulates into the fp32 ``main_grad``
    inside the graph; without graphs it stays off. The losses follow the graphed fit without it within bf16
    tolerance (the fused GEMM rounds less: 9e-6 against 1.7e-3 relative error per gradient, wgrad_fused_gemm_*.json)."""
    results = _fits(LLAMA_STYLE, {}, {"default": ("auto", "gpt"), "eager": ("off", "gpt")})
    results.update(_fits(LLAMA_STYLE, PLAIN_ACCUMULATION, {"plain": ("on", "gpt")}))
    default, plain, eager = results["default"], results["plain"], results["eager"]
    results["max_rel_loss_diff"] = _max_rel(default["loss"], plain["loss"])
    _record(tmp_path, "fit/llama-style-accumulation-fusion-bf16", results)
    assert default["graph"] == REPLAYED and plain["graph"] == REPLAYED
    assert default["accumulation"] == {"resolved": True, "available": True, "why": None}, default["accumulation"]
    assert plain["accumulation"]["resolved"] is False and eager["accumulation"]["resolved"] is False
    assert results["max_rel_loss_diff"] < 1e-2, results
    assert default["loss"][-1] < default["loss"][0]


def test_by_default_a_step_that_cannot_be_captured_warns_and_trains_eagerly(tmp_path: Path) -> None:
    """Automatic graphs with a module whose promise is wrong. A step that waits for the GPU is found by the
    sync check (the step it checks has run: nothing to redo); the legacy stream waiting on the step fails the capture
    itself (nothing of that step ran: the strategy clears the gradients and runs it eagerly). Either way one
    warning names the place, and the fit matches the eager one; after the failed capture the dropout streams
    (registered with the abandoned graph) go on drawing."""
    waits = _fits(GPT2_STYLE, PLAIN_ACCUMULATION, {"off": ("off", "waits"), "default": ("auto", "waits")})
    runs = {"off": ("off", "legacy_stream"), "default": ("auto", "legacy_stream")}
    legacy = _fits(LLAMA_STYLE, PLAIN_ACCUMULATION, runs)
    results = {"waits": waits, "legacy_stream": legacy}
    results["waits"]["max_rel_loss_diff"] = _max_rel(waits["default"]["loss"], waits["off"]["loss"])
    results["legacy_stream"]["max_rel_loss_diff"] = _max_rel(legacy["default"]["loss"], legacy["off"]["loss"])
    _record(tmp_path, "fit/automatic-fallback-bf16", results)
    for run, place in ((waits["default"], "waits for the GPU"), (legacy["default"], "capturing the training step")):
        graph = run["graph"]
        assert graph is not None and graph["captures"] == 0 and graph["replays"] == 0, run
        assert place in graph["gave_up_because"], graph
        assert len(run["warnings"]) == 1 and "cuda_graphs (automatic)" in run["warnings"][0], run["warnings"]
        assert len(run["loss"]) == 10 and len(run["val_loss"]) == 2
    assert "graphs_fit.py:" in waits["default"]["graph"]["gave_up_because"]  # the fit's script: file and line named
    assert results["waits"]["max_rel_loss_diff"] < 1e-5, results
    assert results["legacy_stream"]["max_rel_loss_diff"] < 1e-2, results
    assert legacy["default"]["loss"][-1] < legacy["default"]["loss"][0]


TWO_GPU_LAYOUTS = {  # the graph alone (the fused weight-gradient GEMM, automatic with graphs, pinned off) ...
    "tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True, **PLAIN_ACCUMULATION},
    "tp2": {"tensor_model_parallel_size": 2, **PLAIN_ACCUMULATION},
    "dp2": PLAIN_ACCUMULATION,
    "dp2-distopt-overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, **PLAIN_ACCUMULATION},
    # the weight-gradient GEMM accumulating into main_grad, graphed and eager: tp2-gaf (2 x H200, 2026-11-27) and
    # dp2-gaf (2026-11-28) passed bit for bit, so graphs.settings_not_run_graphed no longer names it
    "tp2-gaf": {"tensor_model_parallel_size": 2, "gradient_accumulation_fusion": True},
    "dp2-gaf": {"gradient_accumulation_fusion": True},
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", list(TWO_GPU_LAYOUTS))
def test_two_gpu_fit_matches_eager(layout: str, tmp_path: Path) -> None:
    """Collectives inside the graph: tensor-parallel all-gathers and reduce-scatters, the data-parallel gradient
    all-reduce, and megatron-core's overlapped reduce-scatter on its own stream."""
    results = _fits(GPT2_STYLE, {"devices": 2, **TWO_GPU_LAYOUTS[layout]}, {"off": ("off", "gpt"), "on": ("on", "gpt")})
    results["max_rel_loss_diff"] = _max_rel(results["on"]["loss"], results["off"]["loss"])
    _record(tmp_path, f"fit/gpt2-style-{layout}-bf16", results)
    assert results["on"]["graph"] == REPLAYED
    assert results["max_rel_loss_diff"] < 1e-5, results
    if "gaf" in layout:  # both fits took the fused weight-gradient GEMM
        assert results["on"]["accumulation"]["resolved"] and results["off"]["accumulation"]["resolved"], results


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_symmetric_all_reduce_matches_nccl(tmp_path: Path) -> None:
    """``symmetric_ar_type="two_shot"`` at TP2, graphed and eager, against NCCL's eager fit: the same losses in every
    bit (two ranks: each element is one addition, rounded once, on both paths), the kernels captured into the graph
    and replayed, and every all-reduce taken by them, the row-parallel outputs' and the input gradients' (the buffer
    grows in the eager warm-up steps, so none falls back to NCCL inside the capture)."""
    # the project's backward on every linear (the default with the graph at TP), so the input gradients' all-reduces
    # take the symmetric path too
    tp2 = {"devices": 2, "tensor_model_parallel_size": 2, "gradient_accumulation_fusion": True}
    nccl = _fits(GPT2_STYLE, tp2, {"off": ("off", "gpt")})["off"]
    results = _fits(GPT2_STYLE, {**tp2, "symmetric_ar_type": "two_shot"}, {"off": ("off", "gpt"), "on": ("on", "gpt")})
    results["nccl"] = nccl
    for name in ("off", "on"):
        results[f"max_rel_loss_diff_{name}_vs_nccl"] = _max_rel(results[name]["loss"], nccl["loss"])
    _record(tmp_path, "fit/gpt2-style-tp2-symmetric-two-shot-bf16", results)
    assert results["on"]["graph"] == REPLAYED, results
    assert nccl["symmetric_all_reduce"] is None
    for name in ("off", "on"):
        counts = results[name]["symmetric_all_reduce"]
        assert counts["calls"] > 0 and counts["fallbacks"] == 0, (name, counts)
        assert results[f"max_rel_loss_diff_{name}_vs_nccl"] == 0.0, results
