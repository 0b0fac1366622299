"""Fused norms and bias gradients (``lightning_megatron.kernels``) on a GPU (skipped without CUDA): bf16 parity
and timing against the unfused ops at the 1.3B GPT's shapes (8192 tokens x hidden 2048, TP2 slices of the
linears) and a Llama-like hidden of 4096.

Parity: fresh random bf16 inputs per check (never zeros), outputs NaN-poisoned before each run (every element
must be written), the Triton path in use; the fused result's ‖out − ref‖ / ‖ref‖ against a float64 reference on
the same bf16 inputs must be under 1e-2 and within 2x (+1e-4) of the unfused ops' own error.

Timing: fused and unfused alternated (order flipped every repetition), CUDA events around each call, four input
sets rotated so repeated calls do not run from the cache, median of 200 repetitions after warm-up. Events around
one eager call also time the host's launch (Triton's launcher and the autograd function cost tens of µs), so the
norms and bias gradients are timed a second way too, ``gpu_only_us``: each variant captured once per input set in
a CUDA graph, 10 replays between two events, the median per call: what the kernels cost inside a graphed step
(``cuda_graphs=True``) or in a GPU-bound one.

The fused bias-dropout-add + norm (``residual_norm``) is checked the same way against megatron-core's compiled
bias-dropout-add followed by ATen's norm, with gradients into both outputs.

Fit: a small GPT-2-style GPTModule (LayerNorm, biases, the fused tanh bias-GeLU) trained in bf16 on one GPU with
``fused_norms``, ``fused_bias_grad`` and ``fused_residual_norm`` on gives the unfused losses within bf16 tolerance
(2e-2 relative per step), each step replayed as a CUDA graph (one GPU's default); with the three unset the fused
kernels are on there too.

``LM_RESULTS_DIR``: where the errors and times go (``kernels_gpu.json``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gpu_work import record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 8192
WARMUP, REPS, SETS = 20, 200, 4


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "an output element was never written (NaN poison left) or overflowed"
    return float((a.double() - ref).norm() / ref.norm())


def _record(tmp_path: Path, key: str, row: dict[str, Any]) -> None:
    record("kernels_gpu.json", tmp_path, key, row)


@pytest.fixture
def poisoned() -> Any:
    from lightning_megatron.kernels import _triton

    assert os.environ.get("LM_FUSED_KERNELS") != "torch", "unset LM_FUSED_KERNELS: it turns the kernels off"
    assert _triton.triton is not None, "Triton is not importable: the fused path would be the torch fallback"
    _triton.POISON["on"] = True
    yield _triton
    _triton.POISON["on"] = False


def _norm_case(rms: bool, tokens: int, hidden: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(tokens, hidden, device="cuda", generator=g) * 2 + 0.3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(torch.bfloat16)
    b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).to(torch.bfloat16)
    dy = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    return ([x, w] if rms else [x, w, b]), dy


def _run(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dy)
    return [out.detach(), *(t.grad for t in leaves)]


def _norm_fns(rms: bool, hidden: int) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    from lightning_megatron.kernels import layer_norm, rms_norm

    if rms:
        return (lambda x, w: rms_norm(x, w, 1e-5)), (lambda x, w: F.rms_norm(x, (hidden,), w, 1e-5))
    return (lambda x, w, b: layer_norm(x, w, b, 1e-5)), (lambda x, w, b: F.layer_norm(x, (hidden,), w, b, 1e-5))


@pytest.mark.parametrize(("rms", "hidden"), [(False, 2048), (False, 1000), (True, 4096), (True, 2048)])
def test_norms_bf16_parity(poisoned: Any, rms: bool, hidden: int, tmp_path: Path) -> None:
    fused, unfused = _norm_fns(rms, hidden)
    names = ["output", "grad_x", "grad_weight", "grad_bias"]
    for seed in range(2):  # fresh inputs each time
        inputs, dy = _norm_case(rms, TOKENS + 37 * seed, hidden, seed + hidden)
        assert poisoned.use_triton(inputs[0])
        reference = _run(unfused, [t.double() for t in inputs], dy.double())
        ours, aten = _run(fused, inputs, dy), _run(unfused, inputs, dy)
        torch.cuda.synchronize()
        errors = {}
        for name, a, u, r in zip(names, ours, aten, reference):
            assert a.dtype == u.dtype, name
            errors[name] = (_rel(a, r), _rel(u, r))
            assert errors[name][0] < 1e-2, (name, errors[name])
            assert errors[name][0] <= 2 * errors[name][1] + 1e-4, (name, errors[name])
    _record(tmp_path, f"parity/{'rmsnorm' if rms else 'layernorm'}/{hidden}", {"fused_vs_unfused_error": errors})


_FIT = r"""
import json, sys
sys.path.insert(0, "tests")
from cases import fit_gpt
from test_kernels import fused_modules
model = dict(vocab_size=512, seq_length=128, num_layers=2, hidden_size=256, num_attention_heads=4,
             activation="gelu_tanh", lr=1e-3)
if sys.argv[1] != "default":  # unset: on, since one GPU replays the step as a CUDA graph by default
    fused = sys.argv[1] == "on"
    model.update(fused_norms=fused, fused_bias_grad=fused, fused_residual_norm=fused)

def probe(module):
    return {"fused": fused_modules(module), "graphed": module.trainer.strategy.step_graph.replays > 0}

out = fit_gpt(1, steps=6, precision="bf16-mixed", accelerator="gpu", model=model, probe=probe,
              data={"vocab_size": 512, "seq_length": 128})
print("RESULT", json.dumps({"loss": out["loss"], "grad_norm": out["grad_norm"], "probe": out["probe"]}))
"""


def test_fit_bf16_with_fused_kernels_matches_unfused(tmp_path: Path) -> None:
    """Every fit's step is replayed as a CUDA graph (one GPU's default), the kernels captured in it; with the
    flags unset the fused kernels are on there, and that fit is the fused one, bit for bit."""
    results = {}
    for setting in ("off", "on", "default"):
        done = subprocess.run(
            [sys.executable, "-c", _FIT, setting], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stderr[-4000:]
        results[setting] = json.loads(lines[-1][len("RESULT ") :])
    fused = {"norms": 5, "qkv": 2, "mlp": 2, "bda": 2, "residual_norm": 4, "missed": 0}
    assert results["on"]["probe"] == results["default"]["probe"] == {"fused": fused, "graphed": True}
    assert results["off"]["probe"] == {"fused": dict.fromkeys(fused, 0), "graphed": True}
    _record(tmp_path, "fit/gpt2-style-bf16", results)
    assert results["default"]["loss"] == results["on"]["loss"]
    for off, on in zip(results["off"]["loss"], results["on"]["loss"]):
        assert on == pytest.approx(off, rel=2e-2), results


_VALIDATE = r"""
import json, sys
sys.path.insert(0, "tests")
import lightning.pytorch as pl
import torch
from test_kernels import fused_modules
from lightning_megatron import MegatronAppStrategy
from lightning_megatron.data import SyntheticTokenDataModule
from lightning_megatron.models import GPTModule

model = GPTModule(vocab_size=512, seq_length=128, num_layers=2, hidden_size=256, num_attention_heads=4)
data = SyntheticTokenDataModule(vocab_size=512, seq_length=128, global_batch_size=4, num_train_samples=8,
                                num_val_samples=8)
strategy = MegatronAppStrategy()
trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", strategy=strategy, logger=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.validate(model, data, verbose=False)
print("RESULT", json.dumps({"replays_cuda_graphs": strategy.replays_cuda_graphs, "fused": fused_modules(model)}))
"""


def test_a_validate_only_run_keeps_the_eager_kernels() -> None:
    """One GPU, flags unset, ``trainer.validate`` alone: no training step to replay, so the fused kernels (chosen
    with the graph; slower in eager steps) stay off, and nothing is compiled for them."""
    done = subprocess.run([sys.executable, "-c", _VALIDATE], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["replays_cuda_graphs"] is False, result
    assert not any(result["fused"].values()), result


@pytest.mark.parametrize("width", [2048, 3072, 4096, 1000])
def test_bias_grad_bf16_parity(poisoned: Any, width: int, tmp_path: Path) -> None:
    from lightning_megatron.kernels import bias_grad

    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(width + seed)
        dy = torch.randn(TOKENS // 2, 2, width, device="cuda", generator=g).to(torch.bfloat16)
        ours, aten = bias_grad(dy), dy.sum(dim=(0, 1))
        reference = dy.double().sum(dim=(0, 1))
        errors = (_rel(ours, reference), _rel(aten, reference))
        assert ours.dtype == aten.dtype and errors[0] < 1e-2 and errors[0] <= 2 * errors[1] + 1e-4, errors
    _record(tmp_path, f"parity/bias_grad/{width}", {"fused_vs_unfused_error": errors})


def test_bias_gelu_and_bias_dropout_add_bf16_parity(poisoned: Any, tmp_path: Path) -> None:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    from lightning_megatron.kernels import bias_dropout_add, bias_gelu

    def gelu64(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        v = x + b
        return v * 0.5 * (1.0 + torch.tanh(0.79788456 * v * (1 + 0.044715 * v * v)))

    megatron_bda = get_bias_dropout_add(training=True, fused=True)
    results = {}
    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        x = torch.randn(TOKENS // 2, 2, 4096, device="cuda", generator=g).to(torch.bfloat16)
        b = (0.5 * torch.randn(4096, device="cuda", generator=g)).to(torch.bfloat16)
        dy = torch.randn(TOKENS // 2, 2, 4096, device="cuda", generator=g).to(torch.bfloat16)
        reference = _run(gelu64, [x.double(), b.double()], dy.double())
        ours, theirs = _run(bias_gelu, [x, b], dy), _run(bias_gelu_impl, [x, b], dy)
        for name, a, u, r in zip(["output", "grad_x", "grad_bias"], ours, theirs, reference):
            results[f"bias_gelu/{name}"] = (_rel(a, r), _rel(u, r))
        h = x[..., :2048].contiguous()
        residual = torch.randn(h.shape, device="cuda", generator=g).to(torch.bfloat16)
        dh = dy[..., :2048].contiguous()
        b2 = b[:2048].contiguous()
        reference = _run(lambda x, b, r: r + (x + b), [h.double(), b2.double(), residual.double()], dh.double())
        ours = _run(bias_dropout_add, [h, b2, residual], dh)
        theirs = _run(lambda x, b, r: megatron_bda((x, b), r, 0.0), [h, b2, residual], dh)
        for name, a, u, r in zip(["output", "grad_x", "grad_bias", "grad_residual"], ours, theirs, reference):
            results[f"bias_dropout_add/{name}"] = (_rel(a, r), _rel(u, r))
        for name, (fused_error, unfused_error) in results.items():
            assert fused_error < 1e-2 and fused_error <= 2 * unfused_error + 1e-4, (name, fused_error, unfused_error)
    _record(tmp_path, "parity/bias_gelu_and_bda", {"fused_vs_unfused_error": results})


def _residual_case(rms: bool, hidden: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def bf16(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * scale + shift).to(torch.bfloat16)

    shape = (TOKENS // 2, 2, hidden)
    inputs = [bf16(*shape), bf16(hidden, scale=0.5), bf16(*shape, scale=2.0), bf16(hidden, scale=0.1, shift=1.0)]
    if not rms:
        inputs.append(bf16(hidden, scale=0.1))
    return inputs, [bf16(*shape), bf16(*shape)]  # the gradients of h and of the norm's output


def _residual_fns(rms: bool, hidden: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from lightning_megatron.kernels.norms import residual_norm

    megatron_bda = get_bias_dropout_add(training=True, fused=True)

    def fused(x: torch.Tensor, xb: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: Any = None) -> Any:
        return residual_norm(x, xb, r, w, b, 1e-5, rms)

    def unfused(x: torch.Tensor, xb: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: Any = None) -> Any:
        h = megatron_bda((x, xb), r, 0.0) if x.dtype != torch.float64 else r + (x + xb)
        return h, (F.rms_norm(h, (hidden,), w, 1e-5) if rms else F.layer_norm(h, (hidden,), w, b, 1e-5))

    return fused, unfused


def _run_two(fn: Callable[..., Any], inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    h, y = fn(*leaves)
    torch.autograd.backward([h, y], grads)
    return [h.detach(), y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize(("rms", "hidden"), [(False, 2048), (True, 4096)])
def test_residual_norm_bf16_parity(poisoned: Any, rms: bool, hidden: int, tmp_path: Path) -> None:
    fused, unfused = _residual_fns(rms, hidden)
    names = ["h", "output", "grad_x", "grad_x_bias", "grad_residual", "grad_weight", "grad_bias"]
    for seed in range(2):
        inputs, grads = _residual_case(rms, hidden, 200 + seed)
        assert poisoned.use_triton(inputs[0])
        reference = _run_two(unfused, [t.double() for t in inputs], [t.double() for t in grads])
        ours, theirs = _run_two(fused, inputs, grads), _run_two(unfused, inputs, grads)
        torch.cuda.synchronize()
        errors = {}
        for name, a, u, r in zip(names, ours, theirs, reference):
            errors[name] = (_rel(a, r), _rel(u, r))
            assert a.dtype == u.dtype and errors[name][0] < 1e-2, (name, errors[name])
            assert errors[name][0] <= 2 * errors[name][1] + 1e-4, (name, errors[name])
    _record(tmp_path, f"parity/residual_norm/{'rmsnorm' if rms else 'layernorm'}/{hidden}", {"errors": errors})


# -- timing ----------------------------------------------------------------------------------------------------------


def _time_alternated(variants: dict[str, Callable[[int], Any]]) -> dict[str, float]:
    """Median microseconds of each variant (called with the input-set index), alternated, with CUDA events."""
    names = list(variants)
    for i in range(WARMUP):
        for name in names:
            variants[name](i % SETS)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(REPS):
        for name in names if rep % 2 == 0 else names[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            variants[name](rep % SETS)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000.0)
    return {name: statistics.median(values) for name, values in times.items()}


def _time_graphed(variants: dict[str, Callable[[int], Any]], replays: int = 10, reps: int = 30) -> dict[str, float]:
    """Median GPU microseconds per call of each variant: one CUDA graph per variant and input set, ``replays``
    replays between two events (no host launch cost in the time), alternated as in ``_time_alternated``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs: dict[str, list[torch.cuda.CUDAGraph]] = {}
    with torch.cuda.stream(stream):
        for name, call in variants.items():
            for i in range(SETS):
                for _ in range(3):  # warm-up off the capture (Triton compiles, autograd allocates)
                    call(i)
            graphs[name] = []
            for i in range(SETS):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    call(i)
                graphs[name].append(graph)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            graph = graphs[name][rep % SETS]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000.0 / replays)
    return {name: statistics.median(values) for name, values in times.items()}


def _fwd_bwd(
    fn: Callable[..., torch.Tensor], sets: list[tuple[list[torch.Tensor], torch.Tensor]]
) -> Callable[[int], Any]:
    def call(i: int) -> None:
        inputs, dy = sets[i]
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(dy)

    return call


@pytest.mark.parametrize(("rms", "hidden"), [(False, 2048), (True, 4096), (True, 2048)])
def test_time_norms(rms: bool, hidden: int, tmp_path: Path) -> None:
    from lightning_megatron.kernels._triton import use_triton

    fused, unfused = _norm_fns(rms, hidden)
    sets = []
    for s in range(SETS):
        inputs, dy = _norm_case(rms, TOKENS, hidden, 1000 + s)
        sets.append(([t.requires_grad_() for t in inputs], dy))
    assert use_triton(sets[0][0][0])
    x_sets = [inputs[0].detach() for inputs, _ in sets]
    with torch.no_grad():
        forward = _time_alternated(
            {
                "unfused": lambda i: unfused(x_sets[i], *sets[i][0][1:]),
                "fused": lambda i: fused(x_sets[i], *sets[i][0][1:]),
            }
        )
    from lightning_megatron.kernels import norms

    def programs_per_sm(count: int) -> Callable[[int], Any]:  # the backward's persistent programs, a tuning knob
        call = _fwd_bwd(fused, sets)

        def timed(i: int) -> None:
            default, norms.BACKWARD_PROGRAMS_PER_SM = norms.BACKWARD_PROGRAMS_PER_SM, count
            try:
                call(i)
            finally:
                norms.BACKWARD_PROGRAMS_PER_SM = default

        return timed

    both = _time_alternated(
        {
            "unfused": _fwd_bwd(unfused, sets),
            "fused": _fwd_bwd(fused, sets),
            "fused_2_per_sm": programs_per_sm(2),
            "fused_8_per_sm": programs_per_sm(8),
        }
    )
    gpu_only = _time_graphed({"unfused": _fwd_bwd(unfused, sets), "fused": _fwd_bwd(fused, sets)})
    row = {
        "shape": [TOKENS, hidden],
        "forward_us": forward,
        "forward_backward_us": both,
        "speedup_forward": forward["unfused"] / forward["fused"],
        "speedup_forward_backward": both["unfused"] / both["fused"],
        "forward_backward_gpu_only_us": gpu_only,
        "speedup_forward_backward_gpu_only": gpu_only["unfused"] / gpu_only["fused"],
    }
    _record(tmp_path, f"time/{'rmsnorm' if rms else 'layernorm'}/{hidden}", row)
    print(row)
    assert all(v > 0 for v in (*forward.values(), *both.values()))


@pytest.mark.parametrize("width", [2048, 3072, 4096, 8192])
def test_time_bias_grad(width: int, tmp_path: Path) -> None:
    from lightning_megatron.kernels import bias_grad

    sets = [torch.randn(TOKENS // 2, 2, width, device="cuda").to(torch.bfloat16) for _ in range(SETS)]
    variants = {"unfused": lambda i: sets[i].sum(dim=(0, 1)), "fused": lambda i: bias_grad(sets[i])}
    times, gpu_only = _time_alternated(variants), _time_graphed(variants)
    row = {
        "shape": [TOKENS, width],
        "us": times,
        "speedup": times["unfused"] / times["fused"],
        "gpu_only_us": gpu_only,
        "speedup_gpu_only": gpu_only["unfused"] / gpu_only["fused"],
    }
    _record(tmp_path, f"time/bias_grad/{width}", row)
    print(row)
    assert torch.allclose(bias_grad(sets[0]).float(), sets[0].sum(dim=(0, 1)).float(), rtol=2e-2, atol=0.5)


@pytest.mark.parametrize(("rms", "hidden"), [(False, 2048), (True, 4096)])
def test_time_residual_norm(rms: bool, hidden: int, tmp_path: Path) -> None:
    fused, unfused = _residual_fns(rms, hidden)
    sets = []
    for s in range(SETS):
        inputs, grads = _residual_case(rms, hidden, 300 + s)
        sets.append(([t.requires_grad_() for t in inputs], grads))

    def fwd_bwd(fn: Callable[..., Any]) -> Callable[[int], None]:
        def call(i: int) -> None:
            inputs, grads = sets[i]
            for t in inputs:
                t.grad = None
            torch.autograd.backward(list(fn(*inputs)), grads)

        return call

    variants = {"unfused": fwd_bwd(unfused), "fused": fwd_bwd(fused)}
    times, gpu_only = _time_alternated(variants), _time_graphed(variants)
    row = {
        "shape": [TOKENS, hidden],
        "forward_backward_us": times,
        "speedup": times["unfused"] / times["fused"],
        "forward_backward_gpu_only_us": gpu_only,
        "speedup_gpu_only": gpu_only["unfused"] / gpu_only["fused"],
    }
    _record(tmp_path, f"time/residual_norm/{'rmsnorm' if rms else 'layernorm'}/{hidden}", row)
    print(row)
    assert all(v > 0 for v in times.values())


def test_time_bias_gelu_and_bias_dropout_add(tmp_path: Path) -> None:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

    from lightning_megatron.kernels import bias_dropout_add, bias_gelu

    def case(width: int, extra: bool) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        sets = []
        for _ in range(SETS):
            x = torch.randn(TOKENS // 2, 2, width, device="cuda").to(torch.bfloat16).requires_grad_()
            b = (0.5 * torch.randn(width, device="cuda")).to(torch.bfloat16).requires_grad_()
            inputs = [x, b]
            if extra:
                inputs.append(torch.randn(TOKENS // 2, 2, width, device="cuda").to(torch.bfloat16).requires_grad_())
            sets.append((inputs, torch.randn(TOKENS // 2, 2, width, device="cuda").to(torch.bfloat16)))
        return sets

    gelu_sets, bda_sets = case(4096, False), case(2048, True)
    megatron_bda = get_bias_dropout_add(training=True, fused=True)
    rows = {
        "bias_gelu_4096": _time_alternated(
            {"unfused": _fwd_bwd(bias_gelu_impl, gelu_sets), "fused": _fwd_bwd(bias_gelu, gelu_sets)}
        ),
        "bias_dropout_add_2048": _time_alternated(
            {
                "unfused": _fwd_bwd(lambda x, b, r: megatron_bda((x, b), r, 0.0), bda_sets),
                "fused": _fwd_bwd(bias_dropout_add, bda_sets),
            }
        ),
    }
    for name, times in rows.items():
        row = {"tokens": TOKENS, "forward_backward_us": times, "speedup": times["unfused"] / times["fused"]}
        _record(tmp_path, f"time/{name}", row)
        print(name, row)
        assert all(v > 0 for v in times.values())


@pytest.fixture(scope="module")
def one_rank_group() -> Any:
    """A one-rank NCCL group: megatron-core's fused cross-entropy all-reduces over its tensor-parallel group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD


@pytest.mark.parametrize("vocab", [50304, 32000])
def test_single_pass_cross_entropy_bf16_parity_and_time(one_rank_group: Any, vocab: int, tmp_path: Path) -> None:
    """``kernels.cross_entropy`` (compiled) against float64 and against megatron-core's fused cross-entropy (the
    one ``cross_entropy_fusion_impl="native"`` selects) at the benchmark models' logits: 2048 tokens x 4."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    from lightning_megatron.kernels.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(vocab)
    sets = []
    for _ in range(SETS):
        logits = (torch.randn(2048, 4, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
        target = torch.randint(vocab, (2048, 4), device="cuda", generator=g)
        sets.append(([logits], target))
    fns = {
        "megatron": lambda x, t: fused_vocab_parallel_cross_entropy(x, t, one_rank_group),
        "single_pass": lambda x, t: vocab_parallel_cross_entropy(x, t, one_rank_group),
    }
    (logits,), target = sets[0]
    dy = torch.rand(2048, 4, device="cuda", generator=g)
    leaf = logits.double().requires_grad_()
    ref_loss = F.cross_entropy(leaf.flatten(0, 1), target.flatten(), reduction="none").view(2048, 4)
    ref_loss.backward(dy.double())
    errors = {}
    for name, fn in fns.items():
        loss, grad = _run(lambda x, fn=fn: fn(x, target), [logits], dy)
        errors[name] = {"loss": _rel(loss, ref_loss.detach()), "grad": _rel(grad, leaf.grad)}
    assert errors["single_pass"]["loss"] < 1e-5 and errors["single_pass"]["grad"] < 1e-2
    assert errors["single_pass"]["grad"] <= 2 * errors["megatron"]["grad"] + 1e-4

    def step(fn: Callable[..., torch.Tensor]) -> Callable[[int], Any]:
        def call(i: int) -> None:
            (x,), t = sets[i]
            fn(x.detach().requires_grad_(), t).backward(dy)

        return call

    times = _time_alternated({name: step(fn) for name, fn in fns.items()})
    row = {"shape": [2048, 4, vocab], "errors_vs_float64": errors, "forward_backward_us": times}
    row["speedup"] = times["megatron"] / times["single_pass"]
    _record(tmp_path, f"time/cross_entropy/{vocab}", row)
    print(row)


def test_fused_rope_bf16_parity_and_time(tmp_path: Path) -> None:
    """``kernels.rope`` (compiled) against float64 and megatron-core's unfused RoPE, at the Llama-style 0.85B
    model's queries (2048 tokens x 4, 16 heads of 128) and keys (4 groups)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from lightning_megatron.kernels.rope import apply_rotary_pos_emb

    g = torch.Generator(device="cuda").manual_seed(5)
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    angles = torch.outer(torch.arange(2048, device="cuda").float(), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    row: dict[str, Any] = {}
    for heads in (16, 4):
        sets = [
            ([torch.randn(2048, 4, heads, 128, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()], None)
            for _ in range(SETS)
        ]
        dy = torch.randn(2048, 4, heads, 128, device="cuda", generator=g).to(torch.bfloat16)
        t = sets[0][0][0].detach()
        leaf = t.double().requires_grad_()
        ref = _apply_rotary_pos_emb_bshd(leaf, freqs.double())
        ref.backward(dy.double())
        errors = {}
        fns = {
            "unfused": lambda x: _apply_rotary_pos_emb_bshd(x, freqs),
            "fused": lambda x: apply_rotary_pos_emb(x, freqs),
        }
        for name, fn in fns.items():
            out, grad = _run(fn, [t], dy)
            errors[name] = {"out": _rel(out, ref.detach()), "grad": _rel(grad, leaf.grad)}
        assert errors["fused"]["out"] <= 2 * errors["unfused"]["out"] + 1e-4
        assert errors["fused"]["grad"] <= 2 * errors["unfused"]["grad"] + 1e-4
        times = _time_alternated({name: _fwd_bwd(fn, [(s, dy) for s, _ in sets]) for name, fn in fns.items()})
        row[f"heads_{heads}"] = {"errors_vs_float64": errors, "forward_backward_us": times}
        row[f"heads_{heads}"]["speedup"] = times["unfused"] / times["fused"]
    _record(tmp_path, "time/rope/2048x4x128", row)
    print(row)
