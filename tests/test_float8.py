"""``fp8_recipe``: megatron-core's parallel linear layers with float8 GEMMs through torchao (``layers/float8.py``).

On CPUs the GEMMs are torchao's emulation: the same casts and scales as on GPUs, the product of the dequantised
operands in fp32. What is checked here:

* the emulation is the arithmetic of ``torch._scaled_mm``: written out independently (scale ``max/amax``, cast,
  fp32 product, divide by the scales), it gives the same numbers; the float8 result is not the bf16 one (the path
  is really taken);
* layouts: the same fit in float8 at TP2, PP2 and TP2 × PP2 gives the single process's losses (PP splits no
  tensor: within bf16 noise; TP gives each shard its own scale: within ``LAYOUT_TOL``), and within ``BF16_TOL``
  of bf16;
* the output layer stays bf16, the four GEMM layers of every transformer layer run in float8; a zero-bubble
  schedule's deferred weight gradients are float8 too (same losses as 1F1B);
* checkpoints are bf16: a float8 fit resumes exactly in float8 and resumes in bf16, and back;
* bad settings fail before any process group: an unknown recipe, fp32 weights, ``tp_comm_overlap``.

The GPU path (``torch._scaled_mm``, CUDA graphs) is ``test_float8_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dpp_cases as dc
import lightning.pytorch as pl
import pytest
import torch
from cases import fit_gpt
from test_checkpoint import SAVE_EVERY, STEPS, assert_continues, fit
from test_dpp import assert_close

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.float8 import Float8Recipe

LAYOUT_TOL = 2e-3  # relative loss difference, float8 at a layout against float8 in one process
BF16_TOL = 2e-2  # relative loss difference, float8 against bf16 over the first steps of a tiny model
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _by_hand(x: torch.Tensor, top: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensorwise cast as cuBLAS's FP8 GEMM takes it: ``(x * scale)`` in float8 and the scale (fp32; divided in
    fp64 as torchao does, so that eager and compiled casts agree)."""
    scale = (top / x.double().abs().max().clamp(min=1e-12)).float()
    return (x.float() * scale).clamp(-top, top).to(dtype), scale


def test_emulation_is_the_scaled_mm_arithmetic() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 3
    w = torch.randn(48, 96, dtype=torch.bfloat16) / 10
    g = torch.randn(64, 48, dtype=torch.bfloat16) / 100
    recipe = Float8Recipe("tensorwise", emulate=True)

    xq, xs = _by_hand(x, E4M3_MAX, torch.float8_e4m3fn)
    wq, ws = _by_hand(w, E4M3_MAX, torch.float8_e4m3fn)
    gq, gs = _by_hand(g, E5M2_MAX, torch.float8_e5m2)
    want_out = (xq.float() @ wq.float().t()) / (xs * ws)
    want_grad_input = (gq.float() @ wq.float()) / (gs * ws)
    want_grad_weight = (gq.float().t() @ xq.float()) / (gs * xs)

    out = recipe.output(x, w)
    assert out.dtype == torch.bfloat16
    # the same up to the order of the fp32 sums: a bf16 result at most one unit in its last place apart
    bf16_ulp = dict(rtol=2**-7, atol=1e-30)
    torch.testing.assert_close(out.float(), want_out.to(torch.bfloat16).float(), **bf16_ulp)
    torch.testing.assert_close(recipe.grad_input(g, w).float(), want_grad_input.to(torch.bfloat16).float(), **bf16_ulp)
    grad_weight = recipe.grad_weight(g, x, torch.float32)  # what is added to an fp32 main_grad
    assert grad_weight.dtype == torch.float32
    # fp32 sums in another order: within 1e-5 of the largest element (small elements come from cancellation)
    torch.testing.assert_close(grad_weight, want_grad_weight, rtol=0, atol=1e-5 * float(want_grad_weight.abs().max()))

    # the tensorwise layers cast each operand once, into both layouts: the same bits and scales
    for tensor, (want_q, want_scale), dtype in ((x, (xq, xs), torch.float8_e4m3fn), (g, (gq, gs), torch.float8_e5m2)):
        data, data_t, scale = recipe.quantize(tensor, dtype)
        assert torch.equal(data.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
        assert torch.equal(data_t.view(torch.uint8), want_q.t().view(torch.uint8)) and data_t.is_contiguous()

    exact = (x.float() @ w.float().t()).to(torch.bfloat16)
    assert not torch.equal(out, exact), "the float8 GEMM gave the bf16 result: nothing was quantised"
    assert (out.float() - exact.float()).abs().max() < 0.1 * exact.float().abs().max()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_scaled_mm_path_runs_every_recipe(recipe: str) -> None:
    """The path GPUs take (``torch._scaled_mm``, which torch also has for CPUs): every GEMM of every recipe is a
    valid ``_scaled_mm`` call (``rowwise_with_gw_hp`` mixes a rowwise and a tensorwise operand in its input
    gradient) and gives the emulation's numbers up to the rounding of the result."""
    torch.manual_seed(3)
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    w = torch.randn(48, 96, dtype=torch.bfloat16) / 10
    g = torch.randn(64, 48, dtype=torch.bfloat16)
    real, emulated = Float8Recipe(recipe, emulate=False), Float8Recipe(recipe, emulate=True)
    for run in (
        lambda r: r.output(x, w),
        lambda r: r.grad_input(g, w),
        lambda r: r.grad_weight(g, x, torch.float32),
    ):
        got, want = run(real).double(), run(emulated).double()
        assert float((got - want).norm() / want.norm()) < 5e-3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_weight_gradients_over_any_token_count(recipe: str) -> None:
    """``_scaled_mm`` needs the contracted width in multiples of 16, and the weight gradient contracts over the
    microbatch's tokens (24 here): that GEMM takes the emulation's arithmetic on the float8 operands, with a
    warning that names the fix, instead of failing inside torch; the cast-once path too."""
    torch.manual_seed(4)
    x = torch.randn(24, 96, dtype=torch.bfloat16)
    g = torch.randn(24, 48, dtype=torch.bfloat16)
    real, emulated = Float8Recipe(recipe, emulate=False), Float8Recipe(recipe, emulate=True)
    with pytest.warns(UserWarning, match="micro_batch_size x seq_length"):
        got = real.grad_weight(g, x, torch.float32)
    assert torch.equal(got, emulated.grad_weight(g, x, torch.float32))
    if real.casts_once:
        c = real.config
        _, g_t, g_scale = real.quantize(g, c.cast_config_grad_output.target_dtype)
        _, x_t, x_scale = real.quantize(x, c.cast_config_input.target_dtype)
        with pytest.warns(UserWarning, match="not a multiple of 16"):
            cast = real.grad_weight_cast(g_t, x_t, torch.float32, grad_output_scale=g_scale, input_scale=x_scale)
        assert float((cast - got).norm() / got.norm()) < 1e-6


def test_compiled_casts_and_gemms_give_the_eager_bits() -> None:
    """What GPUs run (``torch.compile``: fused casts), compiled here for the CPU: the same numbers as eager."""
    torch.manual_seed(2)
    x = torch.randn(32, 64, dtype=torch.bfloat16) * 2
    w = torch.randn(48, 64, dtype=torch.bfloat16) / 10
    g = torch.randn(32, 48, dtype=torch.bfloat16) / 100
    eager, compiled = Float8Recipe("tensorwise", emulate=True), Float8Recipe("tensorwise", emulate=True, compile=True)
    assert torch.equal(compiled.output(x, w), eager.output(x, w))
    assert torch.equal(compiled.grad_input(g, w), eager.grad_input(g, w))
    assert torch.equal(compiled.grad_weight(g, x, torch.float32), eager.grad_weight(g, x, torch.float32))


def test_past_the_recompile_limit_the_gemms_still_run() -> None:
    """A model with more linear shapes than dynamo recompiles a function for: the further shapes run eagerly
    instead of failing the fit (a full-graph compile raises there). The limit is lowered with dynamo's own
    ``config.patch``: pytest's ``monkeypatch`` deletes the setting on undo (torch's config module), and every rank
    forked afterwards (the test suite's worker pool) then fails in its first compile."""
    import torch._dynamo

    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = Float8Recipe("tensorwise", emulate=True, compile=True)
        eager = Float8Recipe("tensorwise", emulate=True)
        for rows, cols in ((16, 32), (24, 48), (8, 64)):
            x = torch.randn(rows, cols, dtype=torch.bfloat16)
            w = torch.randn(16, cols, dtype=torch.bfloat16)
            assert torch.equal(compiled.output(x, w), eager.output(x, w))
    torch._dynamo.reset()
    assert torch._dynamo.config.recompile_limit == limit  # restored, not deleted


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_recipes_stay_close_to_bf16(recipe: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    w = torch.randn(16, 64, dtype=torch.bfloat16) / 8
    g = torch.randn(32, 16, dtype=torch.bfloat16)
    r = Float8Recipe(recipe, emulate=True)
    for name, got, want, bf16 in (
        ("output", r.output(x, w), x.float() @ w.float().t(), x @ w.t()),
        ("grad_input", r.grad_input(g, w), g.float() @ w.float(), g @ w),
        ("grad_weight", r.grad_weight(g, x, torch.float32), g.float().t() @ x.float(), g.t() @ x),
    ):
        if recipe == "rowwise_with_gw_hp" and name == "grad_weight":  # this recipe's bf16 GEMM, as it is
            assert torch.equal(got, bf16.float()), name
            continue
        assert not torch.equal(got.float(), bf16.float()), f"{name}: bf16's GEMM, not float8's"
        assert (got.float() - want).abs().max() <= 0.08 * want.abs().max(), name


class _Float8Layers(pl.Callback):
    """The layers that ran in float8 during the fit (the strategy restores them at teardown)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.names = trainer.strategy.tp_layers.float8_layers


def fit_float8(world_size: int, **strategy: Any) -> dict[str, Any]:
    seen = _Float8Layers()
    result = dc.fit_recording(world_size, steps=4, precision="bf16-mixed", callbacks=[seen], **strategy)
    result["float8_layers"] = seen.names
    return result


@pytest.fixture(scope="module")
def one_process(ranks: Any) -> dict[str, dict[str, Any]]:
    return {
        "bf16": ranks.run(1, fit_float8, 1)[0],
        "tensorwise": ranks.run(1, fit_float8, 1, fp8_recipe="tensorwise")[0],
        "rowwise": ranks.run(1, fit_float8, 1, fp8_recipe="rowwise")[0],
    }


def _relative(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def test_float8_runs_every_transformer_gemm_and_keeps_the_output_layer(one_process: dict[str, Any]) -> None:
    names = one_process["tensorwise"]["float8_layers"]
    assert not one_process["bf16"]["float8_layers"]
    assert not any("output_layer" in n for n in names), names
    for part in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
        assert sum(n.endswith(part) for n in names) == 4, (part, names)  # TINY_MODEL: 4 layers
    loss = one_process["tensorwise"]["loss"]
    assert loss != one_process["bf16"]["loss"], "float8 gave bf16's losses bit for bit"
    assert _relative(loss, one_process["bf16"]["loss"]) <= BF16_TOL


TP2_SP_PP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2)
LAYOUTS = {
    "pp2": (2, dict(pipeline_model_parallel_size=2), "tensorwise"),
    "tp2": (2, dict(tensor_model_parallel_size=2), "tensorwise"),
    "tp2-sp-pp2": (4, TP2_SP_PP2, "tensorwise"),
    # the per-GEMM path (rowwise scales along other axes per GEMM; the bf16 input saved, gathered again under SP)
    "tp2-sp-pp2-rowwise": (4, TP2_SP_PP2, "rowwise"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float8_losses_agree_across_layouts(ranks: Any, one_process: dict[str, Any], layout: str) -> None:
    world, settings, recipe = LAYOUTS[layout]
    results = ranks.run(world, fit_float8, world, fp8_recipe=recipe, **settings)
    want = one_process[recipe]["loss"]
    last_stage = [r for r in results if r["loss"]]
    assert last_stage, f"{layout}: no rank recorded losses"
    for result in last_stage:
        assert result["float8_layers"], f"{layout}: no layer ran in float8"
        tol = 1e-3 * LAYOUT_TOL if "tp" not in layout else LAYOUT_TOL
        assert _relative(result["loss"], want) <= tol, f"{layout}: {result['loss']} vs one process {want}"
        assert _relative(result["loss"], one_process["bf16"]["loss"]) <= BF16_TOL


def test_deferred_weight_gradients_are_float8(ranks: Any) -> None:
    # both add each microbatch's fp32 weight gradient to main_grad (no bf16 gradient in between): same sums
    common = dict(pipeline_model_parallel_size=2, fp8_recipe="tensorwise", gradient_accumulation_fusion=True)
    want = ranks.run(2, fit_float8, 2, schedule="1f1b", **common)
    got = ranks.run(2, fit_float8, 2, schedule="zb-h1", **common)
    bf16 = ranks.run(2, fit_float8, 2, schedule="zb-h1", **{**common, "fp8_recipe": None})
    for rank in range(2):
        assert_close(got[rank], want[rank], 1e-5, f"zb-h1 vs 1f1b in float8, rank {rank}")
    assert got[1]["loss"] != bf16[1]["loss"], "zb-h1 with fp8_recipe gave bf16's losses"


def test_float8_checkpoints_resume_in_float8_and_in_bf16(ranks: Any, tmp_path: Path) -> None:
    settings = dict(precision="bf16-mixed", pipeline_model_parallel_size=2)
    full = ranks.run(2, fit, 2, tmp_path / "fp8", fp8_recipe="tensorwise", **settings)[0]
    bf16 = ranks.run(2, fit, 2, tmp_path / "bf16", **settings)[0]
    from_fp8 = str(tmp_path / "fp8" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    from_bf16 = str(tmp_path / "bf16" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    resumed = ranks.run(2, fit, 2, tmp_path / "a", from_fp8, fp8_recipe="tensorwise", **settings)[0]
    assert_continues(resumed, full, "float8 checkpoint resumed in float8")
    for ckpt, recipe, reference in ((from_fp8, None, full), (from_bf16, "tensorwise", bf16)):
        other = ranks.run(2, fit, 2, tmp_path / f"b{recipe}", ckpt, fp8_recipe=recipe, **settings)[0]
        assert other["global_step"] == STEPS
        assert _relative(other["loss"], reference["loss"][SAVE_EVERY:]) <= BF16_TOL, (recipe, other["loss"])


def test_bad_float8_settings_fail_with_the_fix() -> None:
    with pytest.raises(MegatronConfigError, match="`fp8_recipe` must be one of"):
        MegatronAppStrategy(fp8_recipe="delayed")
    with pytest.raises(MegatronConfigError, match="tp_comm_overlap"):
        MegatronAppStrategy(tensor_model_parallel_size=2, tp_comm_overlap=True, fp8_recipe="tensorwise")
    with pytest.raises(MegatronConfigError, match="precision='bf16-mixed'"):
        fit_gpt(1, steps=1, precision="32-true", fp8_recipe="tensorwise")


def test_a_gpu_without_float8_units_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_megatron.layers.float8 import check_float8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(MegatronConfigError, match=r"A100-SXM4-80GB is 8\.0.*Unset `fp8_recipe`"):
        check_float8_device("tensorwise", torch.device("cuda", 0))
    check_float8_device(None, torch.device("cuda", 0))  # no FP8: nothing to check
    check_float8_device("tensorwise", torch.device("cpu"))  # emulated
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device("rowwise", torch.device("cuda", 0))
