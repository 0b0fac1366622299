"""``cuda_graphs=True`` on a GPU: the replayed step computes what the eager step computes.

* ``StepGraph`` alone, on a small model with an optimizer outside the graph: bit-identical losses and
  parameters to the eager loop, fresh inputs each replay, one capture; a new batch shape captures again, too
  many shapes fall back to eager steps; a step that waits for the GPU is named with its file and line.
* Real fits (subprocesses: megatron-core's global state is per process) with ``cuda_graphs`` off and on, in one
  launch: a GPT-2-style model without dropout (losses equal to 1e-5) and a Llama-style one (RMSNorm,
  SwiGLU, RoPE, GQA) with dropout 0.1 (the dropout streams are registered with the graph), each with
  validation between graphed steps. With two GPUs also TP2 + SP, DP2, and DP2 with the distributed optimizer
  and megatron-core's overlapped gradient reduction.

``LM_RESULTS_DIR``: where the losses go (``graphs_gpu.json``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_work import record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
ROOT = Path(__file__).resolve().parents[1]


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
    from lightning_megatron.strategy.graphs import StepGraph

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


_FIT = r"""""
import json, sys, time
sys.path.insert(0, "tests")
from cases import fit_gpt
graphs = sys.argv[1] == "on"
model = json.loads(sys.argv[2])
extra = json.loads(sys.argv[3])

def probe(module):
    graph = module.trainer.strategy.step_graph
    return None if graph is None else {"captures": graph.captures, "replays": graph.replays}

start = time.perf_counter()
out = fit_gpt(extra.pop("devices", 1), steps=10, precision="bf16-mixed", accelerator="gpu", model=model, probe=probe,
              data={"vocab_size": model["vocab_size"], "seq_length": model["seq_length"], "global_batch_size": 8},
              trainer={"limit_val_batches": 2, "val_check_interval": 5}, cuda_graphs=graphs, **extra)
print("RESULT", json.dumps({"loss": out["loss"], "val_loss": out["val_loss"], "graph": out["probe"],
                            "seconds": time.perf_counter() - start}))
"""

GPT2_STYLE = dict(vocab_size=1024, seq_length=128, num_layers=4, hidden_size=256, num_attention_heads=4, lr=1e-3)
LLAMA_STYLE = dict(
    vocab_size=1024,
    seq_length=128,
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=704,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    lr=1e-3,
)


def _fits(model: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    results = {}
    for setting in ("off", "on"):
        done = subprocess.run(
            [sys.executable, "-c", _FIT, setting, json.dumps(model), json.dumps(extra)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-4000:]
        results[setting] = json.loads(lines[-1][len("RESULT ") :])
    return results


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_gpt2_style_fit_without_dropout_matches_eager(tmp_path: Path) -> None:
    results = _fits(GPT2_STYLE, {})
    off, on = results["off"], results["on"]
    results["max_rel_loss_diff"] = _max_rel(on["loss"], off["loss"])
    results["max_rel_val_loss_diff"] = _max_rel(on["val_loss"], off["val_loss"])
    _record(tmp_path, "fit/gpt2-style-bf16", results)
    assert off["graph"] is None and on["graph"] == {"captures": 1, "replays": 8}
    assert len(on["loss"]) == 10 and len(on["val_loss"]) == 2
    assert results["max_rel_loss_diff"] < 1e-5 and results["max_rel_val_loss_diff"] < 1e-5, results


def test_llama_style_fit_with_dropout_draws_fresh_masks(tmp_path: Path) -> None:
    results = _fits(LLAMA_STYLE, {})
    off, on = results["off"], results["on"]
    results["max_rel_loss_diff"] = _max_rel(on["loss"], off["loss"])
    _record(tmp_path, "fit/llama-style-dropout-bf16", results)
    assert on["graph"] == {"captures": 1, "replays": 8}
    # The same seeds: a graph replaying one frozen dropout mask, or stale inputs, would drift from the eager fit.
    assert results["max_rel_loss_diff"] < 1e-2, results
    assert on["loss"][-1] < on["loss"][0]


TWO_GPU_LAYOUTS = {
    "tp2-sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "dp2": {},
    "dp2-distopt-overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", list(TWO_GPU_LAYOUTS))
def test_two_gpu_fit_matches_eager(layout: str, tmp_path: Path) -> None:
    """Collectives inside the graph: tensor-parallel all-gathers and reduce-scatters, the data-parallel gradient
    all-reduce, and megatron-core's overlapped reduce-scatter on its own stream."""
    results = _fits(GPT2_STYLE, {"devices": 2, **TWO_GPU_LAYOUTS[layout]})
    results["max_rel_loss_diff"] = _max_rel(results["on"]["loss"], results["off"]["loss"])
    _record(tmp_path, f"fit/gpt2-style-{layout}-bf16", results)
    assert results["on"]["graph"] == {"captures": 1, "replays": 8}
    assert results["max_rel_loss_diff"] < 1e-5, results
