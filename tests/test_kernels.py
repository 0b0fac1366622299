"""Fused norms and bias gradients (``lightning_megatron.kernels``) on CPUs.

* The torch path of the norms (the kernels' formulas) equals ATen's LayerNorm/RMSNorm in fp32 within 1e-6
  relative (‖ours − ATen‖ / ‖ATen‖; only the summation order differs) for the output and the input, weight and
  bias gradients; the bias-gradient pieces are bit-for-bit megatron-core's arithmetic on CPUs.
* The Triton kernels themselves, run by Triton's CPU interpreter (the dev extra installs Triton, so CI runs
  them; skipped without it), against the torch path on odd shapes, with NaN-poisoned outputs.
* The fused bias-dropout-add + norm (``residual_norm``) equals megatron-core's bias-dropout-add followed by ATen's
  norm in fp32: the residual sum bit-for-bit, the rest within 1e-6, with gradients flowing into both outputs.
* A tiny GPTModule fit with ``fused_norms``/``fused_bias_grad``/``fused_residual_norm`` on gives the unfused
  losses and gradient norms (GPT-2 style at TP2 with sequence parallelism, Llama style on one rank), and every
  layer's pre-MLP norm took the fused op's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cases import fit_gpt

from lightning_megatron import MegatronConfigError
from lightning_megatron.kernels import FusedLayerNorm, FusedRMSNorm, bias_dropout_add, bias_grad, layer_norm, rms_norm
from lightning_megatron.kernels.bias import add_bias
from lightning_megatron.kernels.norms import residual_norm
from lightning_megatron.models.specs import gpt_block_spec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _outputs_and_grads(fn: Any, inputs: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(dy)
    return [out.detach(), *(t.grad for t in inputs)]


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(7, 3, 96), (33, 130)])
def test_norms_match_aten_in_fp32(rms: bool, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) + rms)
    hidden = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).requires_grad_()
    w = (torch.randn(hidden, generator=g) + 1).requires_grad_()
    b = torch.randn(hidden, generator=g).requires_grad_()
    dy = torch.randn(shape, generator=g)
    if rms:
        ours = _outputs_and_grads(lambda: rms_norm(x, w, 1e-5), [x, w], dy)
        aten = _outputs_and_grads(lambda: F.rms_norm(x, (hidden,), w, 1e-5), [x, w], dy)
    else:
        ours = _outputs_and_grads(lambda: layer_norm(x, w, b, 1e-5), [x, w, b], dy)
        aten = _outputs_and_grads(lambda: F.layer_norm(x, (hidden,), w, b, 1e-5), [x, w, b], dy)
    for name, a, r in zip(["output", "grad x", "grad weight", "grad bias"], ours, aten):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert _rel(a, r) < 1e-6, (name, _rel(a, r))


def test_norms_on_a_non_contiguous_input_and_as_modules() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 10, 8, generator=g)
    x = base.transpose(0, 1).requires_grad_()  # [10, 64, 8]: not contiguous
    ours, reference = FusedLayerNorm(8, eps=1e-6), torch.nn.LayerNorm(8, eps=1e-6)
    with torch.no_grad():
        for p in (*ours.parameters(), *reference.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    dy = torch.randn(10, 64, 8, generator=g)
    a = _outputs_and_grads(lambda: ours(x), [x, ours.weight, ours.bias], dy)
    r = _outputs_and_grads(lambda: reference(x), [x, reference.weight, reference.bias], dy)
    for name, p, q in zip(["output", "grad x", "grad weight", "grad bias"], a, r):
        assert _rel(p, q) < 1e-6, (name, _rel(p, q))
    assert isinstance(ours, torch.nn.LayerNorm) and ours.state_dict().keys() == reference.state_dict().keys()
    assert isinstance(FusedRMSNorm(8, eps=1e-5), torch.nn.RMSNorm)
    with pytest.raises(MegatronConfigError, match="weight has shape"):
        layer_norm(x, torch.ones(4), None, 1e-5)


def test_bias_gradients_are_megatron_cores_arithmetic_exactly() -> None:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4, 40, generator=g).requires_grad_()
    bias = torch.randn(40, generator=g).requires_grad_()
    residual = torch.randn(6, 4, 40, generator=g).requires_grad_()
    dy = torch.randn(6, 4, 40, generator=g)
    assert torch.equal(bias_grad(dy), dy.sum(dim=(0, 1)))
    megatron_bda = get_bias_dropout_add(training=True, fused=False)
    ours = _outputs_and_grads(lambda: bias_dropout_add(x, bias, residual), [x, bias, residual], dy)
    theirs = _outputs_and_grads(lambda: megatron_bda((x, bias), residual, 0.0), [x, bias, residual], dy)
    for name, a, r in zip(["output", "grad x", "grad bias", "grad residual"], ours, theirs):
        assert torch.equal(a, r), name
    ours = _outputs_and_grads(lambda: F.gelu(add_bias(x, bias)), [x, bias], dy)
    theirs = _outputs_and_grads(lambda: F.gelu(x + bias), [x, bias], dy)
    for name, a, r in zip(["output", "grad x", "grad bias"], ours, theirs):
        assert torch.equal(a, r), name


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_residual_norm_matches_bias_dropout_add_then_norm(rms: bool) -> None:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    g = torch.Generator().manual_seed(11 + rms)
    shape, hidden = (9, 2, 80), 80
    x, residual = torch.randn(shape, generator=g).requires_grad_(), torch.randn(shape, generator=g).requires_grad_()
    x_bias = torch.randn(hidden, generator=g).requires_grad_()
    w = (torch.randn(hidden, generator=g) + 1).requires_grad_()
    b = torch.randn(hidden, generator=g).requires_grad_()
    dh, dy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    bda = get_bias_dropout_add(training=True, fused=False)
    leaves = [x, x_bias, residual, w] + ([] if rms else [b])

    def run(fn: Any) -> list[torch.Tensor]:
        for t in leaves:
            t.grad = None
        h, y = fn()
        torch.autograd.backward([h, y], [dh, dy])
        return [h.detach(), y.detach(), *(t.grad for t in leaves)]

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        h = bda((x, x_bias), residual, 0.0)
        return h, (F.rms_norm(h, (hidden,), w, 1e-5) if rms else F.layer_norm(h, (hidden,), w, b, 1e-5))

    ours = run(lambda: residual_norm(x, x_bias, residual, w, None if rms else b, 1e-5, rms))
    theirs = run(unfused)
    assert torch.equal(ours[0], theirs[0])  # h: the same two fp32 adds
    names = ["y", "grad x", "grad x_bias", "grad residual", "grad weight", "grad bias"]
    for name, a, r in zip(names, ours[1:], theirs[1:]):
        assert _rel(a, r) < 1e-6, (name, _rel(a, r))


def test_fused_settings_are_checked() -> None:
    with pytest.raises(MegatronConfigError, match="fused_norms/fused_bias_grad"):
        gpt_block_spec("te", config=None, fused_norms=True)  # type: ignore[arg-type]
    with pytest.raises(MegatronConfigError, match="needs fused_norms=True"):
        gpt_block_spec("sdpa", config=None, fused_residual_norm=True)  # type: ignore[arg-type]
    with pytest.raises(MegatronConfigError, match="'sdpa\\+fused'"):
        gpt_block_spec("sdpa+fast", config=None)  # type: ignore[arg-type]


_INTERPRETER_CHECK = r"""
import torch
from lightning_megatron.kernels import _triton, bias, norms
assert _triton.use_triton(torch.empty(1)), "the interpreter path is not taken"
_triton.POISON["on"] = True
worst = 0.0
def rel(a, b):
    global worst
    assert torch.isfinite(a).all(), "an output element was never written"
    err = float((a.double() - b.double()).norm() / b.double().norm())
    worst = max(worst, err)
    assert err < 1e-6, err
for seed, (rows, n) in enumerate([(37, 96), (5, 100), (70, 33)]):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 3 + 1
    w, b, dy = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    for rms in (False, True):
        got = norms._forward_triton(x, w, None if rms else b, 1e-5, rms)
        want = norms._forward_torch(x, w, None if rms else b, 1e-5, rms)
        rel(got[0], want[0])
        rel(got[2], want[2].view(-1))
        if not rms:
            rel(got[1], want[1].view(-1))
        got = norms._backward_triton(x, dy, w, got[1], got[2], not rms, rms)
        want = norms._backward_torch(x, dy, w, want[1], want[2], not rms, rms)
        for a, r in zip(got, want):
            if r is not None:
                rel(a, r)
        r, xb, dh = torch.randn(rows, n, generator=g), torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
        fused_h = _triton.empty((rows, n), like=x)
        got = norms._forward_triton(x, w, None if rms else b, 1e-5, rms, residual=r, x_bias=xb, h=fused_h)
        h = norms._bias_residual_torch(x, xb, r)
        want = norms._forward_torch(h, w, None if rms else b, 1e-5, rms)
        rel(fused_h, h)
        rel(got[0], want[0])
        got = norms._backward_triton(fused_h, dy, w, got[1], got[2], not rms, rms, dh=dh, x_bias_grad=True)
        want = norms._backward_torch(h, dy, w, want[1], want[2], not rms, rms, dh=dh, x_bias_grad=True)
        for a, r in zip(got, want):
            if r is not None:
                rel(a, r)
    rel(bias.bias_grad(dy), dy.sum(0))
    for tile in (bias.Tile(block_m=8, block_n=32, warps=2, per_sm=1), bias.Tile(block_m=64, block_n=512, warps=8)):
        rel(bias._column_sums(dy, None, None, out_dtype=dy.dtype, tile=tile), dy.sum(0))
    y, bias_vector, dx = torch.randn(rows, n, generator=g), torch.randn(n, generator=g), _triton.empty((rows, n), like=x)
    summed = bias._column_sums(dy, y, bias_vector, dx, out_dtype=torch.float32)
    v = (y + bias_vector).double()
    t = torch.tanh(0.79788456 * v * (1 + 0.044715 * v * v))
    want_dx = (0.5 * v * ((1 - t * t) * (0.79788456 + 0.1070322243 * v * v)) + 0.5 * (1 + t)) * dy.double()
    rel(dx, want_dx)
    rel(summed, want_dx.sum(0))
print("worst relative error", worst)
"""


def test_triton_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("LM_FUSED_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "worst relative error" in done.stdout


GPT2 = {"normalization": "LayerNorm", "add_bias_linear": True, "activation": "gelu_tanh"}
LLAMA = {
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "activation": "swiglu",
    "position_embedding_type": "rope",
}


def fused_modules(module: Any) -> dict[str, int]:
    """How many of each fused module the trained model holds (so the fit below cannot pass unfused)."""
    from lightning_megatron.kernels.layers import BiasGradColumnParallelLinear, BiasGradMLP

    counts = {"norms": 0, "qkv": 0, "mlp": 0, "bda": 0, "residual_norm": 0, "missed": 0}
    for sub in module.modules():
        counts["norms"] += isinstance(sub, (FusedLayerNorm, FusedRMSNorm))
        counts["qkv"] += isinstance(sub, BiasGradColumnParallelLinear) and sub.adds_own_bias
        counts["mlp"] += isinstance(sub, BiasGradMLP)
        counts["bda"] += getattr(sub, "mlp_bda", None) is not None and sub.mlp_bda.__module__.endswith("kernels.layers")
        # linked bias-dropout-adds whose output the norm after them took
        for name in ("self_attn_bda", "mlp_bda"):
            norm = getattr(getattr(sub, name, None), "norm", None)
            counts["residual_norm"] += norm is not None and norm.hand_overs_taken > 0
        counts["missed"] += getattr(sub, "hand_overs_missed", 0)
    return counts


def fused_modules_and_checkpoint_keys(module: Any) -> dict[str, Any]:
    """``fused_modules`` and the keys a checkpoint of the model holds (plain and megatron-core sharded)."""
    sharded = [sorted(chunk.sharded_state_dict().keys()) for chunk in module.model_chunks]
    return {"fused": fused_modules(module), "state_dict": sorted(module.state_dict().keys()), "sharded": sharded}


FLAGS = {"fused_norms": True, "fused_bias_grad": True, "fused_residual_norm": True}


@pytest.mark.parametrize(
    ("model", "fused_settings", "layout"),
    [
        (GPT2, FLAGS, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
        ({**LLAMA, "layer_spec": "sdpa"}, {"layer_spec": "sdpa+fused"}, {"pipeline_model_parallel_size": 2}),
    ],
    ids=["gpt2-style-tp2-sp", "llama-style-pp2-sdpa+fused"],
)
def test_fit_with_fused_kernels_matches_unfused(ranks: Any, model: dict, fused_settings: dict, layout: dict) -> None:
    probe = fused_modules_and_checkpoint_keys
    unfused = ranks.run(2, fit_gpt, 2, steps=3, model=model, probe=probe, **layout)
    fused = ranks.run(2, fit_gpt, 2, steps=3, model={**model, **fused_settings}, probe=probe, **layout)
    stages = layout.get("pipeline_model_parallel_size", 1)
    layers = 4 // stages  # cases.TINY_MODEL's 4 layers, split over the pipeline stages
    for off, on in zip(unfused, fused):
        last_stage = on["coordinates"]["pp"] == stages - 1
        expected = {
            "norms": 2 * layers + last_stage,  # the final norm on the last stage
            "qkv": layers if model["add_bias_linear"] else 0,
            "mlp": layers,
            "bda": layers,
            # every layer's attention bda + pre-MLP norm, every MLP bda + next norm (none after a stage's end)
            "residual_norm": 2 * layers - (not last_stage),
            "missed": 0,
        }
        assert on["probe"]["fused"] == expected
        assert not any(off["probe"]["fused"].values())
        # the same checkpoints: fused layers keep megatron-core's parameter names and sharding
        assert off["probe"]["state_dict"] and all(off["probe"]["sharded"])
        assert on["probe"]["state_dict"] == off["probe"]["state_dict"]
        assert on["probe"]["sharded"] == off["probe"]["sharded"]
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5)
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5)


def test_single_pass_cross_entropy_matches_torch_in_fp32() -> None:
    from lightning_megatron.kernels.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 3, 50, generator=g) * 4).requires_grad_()
    target = torch.randint(50, (6, 3), generator=g)
    dy = torch.rand(6, 3, generator=g)
    ours = _outputs_and_grads(lambda: vocab_parallel_cross_entropy(logits, target), [logits], dy)
    ref = _outputs_and_grads(
        lambda: F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(6, 3), [logits], dy
    )
    for a, b in zip(ours, ref):
        assert _rel(a, b) < 1e-6
    with pytest.raises(ValueError, match="targets of shape"):
        vocab_parallel_cross_entropy(logits, target[:, :2])


def test_fused_rope_matches_megatron_core_in_fp32() -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from lightning_megatron.kernels.rope import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(4)
    for rot_dim in (16, 8):  # every channel rotated, and half of them passed through
        t = torch.randn(5, 2, 3, 16, generator=g).requires_grad_()
        freqs = torch.randn(5, 1, 1, rot_dim, generator=g)
        dy = torch.randn(5, 2, 3, 16, generator=g)
        ours = _outputs_and_grads(lambda t=t, freqs=freqs: apply_rotary_pos_emb(t, freqs), [t], dy)
        ref = _outputs_and_grads(lambda t=t, freqs=freqs: _apply_rotary_pos_emb_bshd(t, freqs), [t], dy)
        for a, b in zip(ours, ref):
            assert _rel(a, b) < 1e-6
    with pytest.raises(NotImplementedError, match="apply_rope_fusion"):
        apply_rotary_pos_emb(t, freqs, interleaved=True)


def loss_and_rope_paths(module: Any) -> dict[str, Any]:
    """Which loss each chunk computes and which RoPE megatron-core calls (``fit_gpt``'s probe)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.utils import unwrap_model

    from lightning_megatron.kernels.rope import apply_rotary_pos_emb

    chunks = [unwrap_model(chunk) for chunk in module.model_chunks]
    return {
        "single_pass_cross_entropy": [c.single_pass_cross_entropy for c in chunks if c.post_process],
        "fused_rope": module.transformer_config().apply_rope_fusion
        and rope_utils.fused_apply_rotary_pos_emb is apply_rotary_pos_emb,
    }


def test_fit_with_single_pass_cross_entropy_and_fused_rope_matches_megatron_cores(ranks: Any) -> None:
    """Llama style at TP2 (vocabulary split over two gloo ranks): the loss through ``kernels.cross_entropy`` and RoPE
    through ``kernels.rope`` (installed as megatron-core's fused RoPE) give megatron-core's losses and grad norms."""
    model = {**LLAMA, "layer_spec": "sdpa"}
    fused = {**model, "fused_cross_entropy": True, "transformer_config_overrides": {"apply_rope_fusion": True}}
    layout = {"tensor_model_parallel_size": 2}
    plain = ranks.run(2, fit_gpt, 2, steps=3, model=model, probe=loss_and_rope_paths, **layout)
    ours = ranks.run(2, fit_gpt, 2, steps=3, model=fused, probe=loss_and_rope_paths, **layout)
    for off, on in zip(plain, ours):
        assert off["probe"] == {"single_pass_cross_entropy": [False], "fused_rope": False}
        assert on["probe"] == {"single_pass_cross_entropy": [True], "fused_rope": True}
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-6)
        assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5)
