"""Mixture of experts (``GPTModule(num_moe_experts=...)``, ``MegatronAppStrategy(expert_model_parallel_size=N)``):
a Llama-shaped tiny MoE model (4 experts, top-2, every other layer dense in one case) trained with its experts split
over ranks must follow one process's losses within 1e-3 (fp32, CPU, gloo's all-to-all), alone and with tensor
(and sequence) parallelism, pipeline stages and the distributed optimizer; the router's load-balancing loss is
logged and agrees across layouts; a checkpoint saved at one expert-parallel size resumes at another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import dpp_cases as dc
import lightning.pytorch as pl
import pytest
from cases import TINY_MODEL, fit_gpt

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.convert.hf import gpt_kwargs_to_hf_config
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.models import GPTModule
from lightning_megatron.strategy.graphs import declares_graph_safe_step
from lightning_megatron.strategy.parallel import ParallelLayout

MODEL = {"layer_spec": "sdpa", "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}
MODEL.update(dc.llama_model())
TRAINER = {"val_check_interval": 3, "limit_val_batches": 2}
LAYOUTS = {
    "fused-kernels": (1, {"layer_spec": "sdpa+fused"}, {}),
    "ep2": (2, {}, dict(expert_model_parallel_size=2)),
    "ep2-allgather": (2, {"moe_token_dispatcher_type": "allgather"}, dict(expert_model_parallel_size=2)),
    "ep2-tp2-sp": (4, {}, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2-pp2": (4, {}, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "ep2-distopt": (2, {}, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
    # DP4 with EP2: every expert on two ranks (expert data parallelism), its gradients reduced between them
    "ep2-dp4": (4, {}, dict(expert_model_parallel_size=2)),
    "ep2-dp4-distopt": (4, {}, dict(expert_model_parallel_size=2, use_distributed_optimizer=True)),
    "ep2-cp2": (4, {}, dict(expert_model_parallel_size=2, context_parallel_size=2)),
    "ep2-pp2-zb": (4, {}, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, schedule="zb-h1")),
    "ep2-pp2-dpp": (4, {}, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, schedule="dpp")),
    "ep2-pp2-vpp2": (
        4,
        {},
        dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ),
}


@pytest.fixture(scope="module")
def one_process(ranks: Any) -> dict[str, Any]:
    return ranks.run(1, fit_gpt, 1, steps=3, model=MODEL, trainer=TRAINER)[0]


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_losses_equal_one_process(ranks: Any, one_process: dict[str, Any], layout: str) -> None:
    world, model, strategy = LAYOUTS[layout]
    want = one_process
    # (another dispatcher, or the fused kernels: the same model, so the same losses as one process without them)
    results = ranks.run(world, fit_gpt, world, steps=3, model={**MODEL, **model}, trainer=TRAINER, **strategy)
    assert len(want["loss"]) == 3 and len(want["moe_aux_loss"]) == 3, want
    for rank, got in enumerate(results):
        for step, (a, b) in enumerate(zip(got["loss"], want["loss"], strict=True)):
            assert _close(a, b, 1e-3), f"{layout} rank {rank}: step {step} loss {a} vs {b}"
        assert _close(got["val_loss"][-1], want["val_loss"][-1], 1e-3), (layout, rank, got["val_loss"])
        for step, (a, b) in enumerate(zip(got["moe_aux_loss"], want["moe_aux_loss"], strict=True)):
            assert _close(a, b, 1e-2), f"{layout} rank {rank}: step {step} load-balancing loss {a} vs {b}"


def test_load_balancing_loss_is_logged_and_near_its_floor(one_process: dict[str, Any]) -> None:
    # megatron-core's switch loss is E * sum_e(f_e * p_e) / topk: 1 when tokens and probabilities spread evenly.
    aux = one_process["moe_aux_loss"]
    assert len(aux) == 3 and all(0.9 < value < 2.0 for value in aux), aux


STEPS, SAVE_EVERY = 6, 3


def fit_saving(
    world_size: int, ckpt_dir: str, resume: Optional[str] = None, model: Optional[dict] = None, **strategy: Any
) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = {"enable_checkpointing": True, "limit_val_batches": 0}
    return fit_gpt(
        world_size, steps=STEPS, model=model or MODEL, trainer=trainer, callbacks=[saver], ckpt_path=resume, **strategy
    )


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ((2, {"expert_model_parallel_size": 2}), (1, {})),
        ((1, {}), (4, {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True})),
    ],
    ids=["ep2-to-ep1", "ep1-to-ep2-tp2"],
)
def test_checkpoint_resumes_at_another_expert_parallel_size(
    ranks: Any, tmp_path: Path, saved: tuple[int, dict], resumed: tuple[int, dict]
) -> None:
    """Experts, router and optimizer state do not depend on how experts are split: a checkpoint saved at one
    expert-parallel size continues at another as the uninterrupted run."""
    full = ranks.run(saved[0], fit_saving, saved[0], str(tmp_path / "saved"), **saved[1])[0]
    resume = str(tmp_path / "saved" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    results = ranks.run(resumed[0], fit_saving, resumed[0], str(tmp_path / "resumed"), resume, **resumed[1])
    tail = full["loss"][SAVE_EVERY:]
    for rank, got in enumerate(results):
        assert got["global_step"] == STEPS and len(got["loss"]) == len(tail)
        for step, (a, b) in enumerate(zip(got["loss"], tail), start=SAVE_EVERY + 1):
            assert _close(a, b, 1e-3), f"rank {rank}: step {step} loss {a} != uninterrupted {b}"


# Qwen-MoE style: a shared expert every token goes through, scaled by a sigmoid gate, and the routed experts' weights
# the softmax over all experts, not renormalized over the top k (moe_router_pre_softmax)
SHARED = {**MODEL, "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True}
SHARED["moe_router_pre_softmax"] = True


def test_shared_experts_follow_one_process_and_reshard(ranks: Any, one_process: dict[str, Any], tmp_path: Path) -> None:
    """The shared experts are a dense MLP beside the routed ones (split over TP, whole on every EP rank): losses
    at EP2 and EP2 × TP2 + SP equal one process's, and a checkpoint saved at EP2 resumes at EP1."""
    want = ranks.run(1, fit_gpt, 1, steps=3, model=SHARED, trainer=TRAINER)[0]
    assert not _close(want["loss"][-1], one_process["loss"][-1], 1e-4), "the shared experts must change the model"
    layouts = [(2, dict(expert_model_parallel_size=2))]
    layouts += [(4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True))]
    for world, strategy in layouts:
        results = ranks.run(world, fit_gpt, world, steps=3, model=SHARED, trainer=TRAINER, **strategy)
        for rank, got in enumerate(results):
            for step, (a, b) in enumerate(zip(got["loss"], want["loss"], strict=True)):
                assert _close(a, b, 1e-3), f"{strategy} rank {rank}: step {step} loss {a} vs {b}"
    full = ranks.run(2, fit_saving, 2, str(tmp_path / "saved"), model=SHARED, expert_model_parallel_size=2)[0]
    resume = str(tmp_path / "saved" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    got = ranks.run(1, fit_saving, 1, str(tmp_path / "resumed"), resume, model=SHARED)[0]
    for step, (a, b) in enumerate(zip(got["loss"], full["loss"][SAVE_EVERY:], strict=True), start=SAVE_EVERY + 1):
        assert _close(a, b, 1e-3), f"step {step} loss {a} != uninterrupted {b}"


def test_moe_settings_are_checked() -> None:
    with pytest.raises(MegatronConfigError, match="moe_router_topk=5"):
        GPTModule(num_moe_experts=4, moe_router_topk=5)
    with pytest.raises(MegatronConfigError, match="num_moe_experts=1"):
        GPTModule(num_moe_experts=1)
    with pytest.raises(MegatronConfigError, match="moe_layer_freq"):
        GPTModule(num_layers=4, num_moe_experts=4, moe_layer_freq=[1, 0])
    with pytest.raises(MegatronConfigError, match="Set add_bias_linear=False"):
        GPTModule(num_moe_experts=4, add_bias_linear=True)
    with pytest.raises(MegatronConfigError, match="moe_token_dispatcher_type"):
        GPTModule(num_moe_experts=4, moe_token_dispatcher_type="flex")
    with pytest.raises(MegatronConfigError, match="moe_shared_expert_intermediate_size=0"):
        GPTModule(num_moe_experts=4, moe_shared_expert_intermediate_size=0, add_bias_linear=False)
    with pytest.raises(MegatronConfigError, match="moe_shared_expert_gate=True gates"):
        GPTModule(num_moe_experts=4, moe_shared_expert_gate=True, add_bias_linear=False)
    with pytest.raises(MegatronConfigError, match="need an MoE model: set num_moe_experts"):
        GPTModule(moe_shared_expert_intermediate_size=64)
    # Mixtral has no shared experts: a gated shared expert is exported as Qwen2-MoE, an ungated one not at all
    assert gpt_kwargs_to_hf_config(dict(GPTModule(**SHARED).hparams))["model_type"] == "qwen2_moe"
    with pytest.raises(NotImplementedError, match="no shared experts"):
        gpt_kwargs_to_hf_config(dict(GPTModule(**{**SHARED, "moe_shared_expert_gate": False}).hparams))
    with pytest.raises(MegatronConfigError, match="moe_router_pre_softmax need an MoE model"):
        GPTModule(moe_router_pre_softmax=True)
    with pytest.raises(MegatronConfigError, match="GPTModule\\(num_moe_experts=...\\)"):
        GPTModule(transformer_config_overrides={"num_moe_experts": 4})
    with pytest.raises(MegatronConfigError, match="expert_model_parallel_size"):
        MegatronAppStrategy(expert_model_parallel_size=0)
    with pytest.raises(MegatronConfigError, match="expert_model_parallel_size=4 must divide"):
        ParallelLayout(tensor=2, expert=4).data_parallel_size(4)
    assert ParallelLayout(tensor=2, expert=2).data_parallel_size(4) == 2
    # the dropless dispatcher reads token counts on the host: no automatic CUDA graph
    assert declares_graph_safe_step(GPTModule()) and not declares_graph_safe_step(
        GPTModule(num_moe_experts=4, add_bias_linear=False)
    )


def test_expert_parallel_needs_experts_that_split(ranks: Any) -> None:
    with pytest.raises(Exception, match="num_moe_experts=3 does not split over expert_model_parallel_size=2"):
        ranks.run(2, fit_gpt, 2, steps=1, model={**MODEL, "num_moe_experts": 3}, expert_model_parallel_size=2)
    with pytest.raises(Exception, match="the model has none"):
        ranks.run(2, fit_gpt, 2, steps=1, expert_model_parallel_size=2)
    with pytest.raises(Exception, match="Set sequence_parallel=True"):
        ranks.run(2, fit_gpt, 2, steps=1, model=MODEL, tensor_model_parallel_size=2)
    with pytest.raises(Exception, match="schedule='fbd' with num_moe_experts"):
        ranks.run(2, fit_gpt, 2, steps=1, model=MODEL, pipeline_model_parallel_size=2, schedule="fbd")


@pytest.mark.parametrize("freq", [[1, 1, 0, 0], [0, 0, 1, 1]], ids=["second-stage-dense", "first-stage-dense"])
def test_a_stage_without_moe_layers_logs_the_same_router_losses(ranks: Any, freq: list[int]) -> None:
    """At PP2 one stage has no MoE layer (the second, or the first, which holds global rank 0); the losses and the
    logged load-balancing and z-losses (reduced over stages, averaged over the two MoE layers) equal one process's
    on every rank."""
    model = {**MODEL, "moe_layer_freq": freq, "transformer_config_overrides": {"moe_z_loss_coeff": 1e-3}}
    want = ranks.run(1, fit_gpt, 1, steps=2, model=model)[0]
    assert sorted(want["moe"]) == ["moe/load_balancing_loss", "moe/z_loss"] and len(want["moe_aux_loss"]) == 2, want
    results = ranks.run(
        4, fit_gpt, 4, steps=2, model=model, pipeline_model_parallel_size=2, expert_model_parallel_size=2
    )
    for rank, got in enumerate(results):
        for a, b in zip(got["loss"], want["loss"], strict=True):
            assert _close(a, b, 1e-3), (rank, got, want)
        for name, values in want["moe"].items():
            for a, b in zip(got["moe"][name], values, strict=True):
                assert _close(a, b, 1e-3), (rank, name, got["moe"], want["moe"])


def test_grouped_gemm_experts_follow_the_sequential_ones(ranks: Any) -> None:
    """``moe_grouped_gemm=True`` (``torch._grouped_mm``, bf16 on CPUs too): the same model and parameters, so the
    bf16 fits follow the sequential experts' within bf16 rounding, at one process and at EP2 (two local experts
    each), and both give the same checkpointable parameter names."""
    bf16 = dict(precision="bf16-mixed", steps=3, timeout=300)  # bf16 GEMMs are slow on CPUs without AVX-512
    want = ranks.run(1, fit_gpt, 1, model=MODEL, **bf16)[0]
    for world, strategy in ((1, {}), (2, {"expert_model_parallel_size": 2})):
        for rank, got in enumerate(
            ranks.run(world, fit_gpt, world, model={**MODEL, "moe_grouped_gemm": True}, **bf16, **strategy)
        ):
            for a, b in zip(got["loss"], want["loss"], strict=True):
                assert _close(a, b, 2e-2), (world, rank, got["loss"], want["loss"])
    with pytest.raises(MegatronConfigError, match="add_bias_linear=False"):
        GPTModule(num_moe_experts=4, moe_grouped_gemm=True, add_bias_linear=True)


def test_throughput_dry_run_at_ep2_with_grouped_experts(tmp_path: Path) -> None:
    """``benchmarks/throughput.py``'s MoE model on CPUs (its GPU runs: docs/guides/moe.md): an EP2 variant with
    grouped experts measures steps and model FLOPs counting the active experts."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "throughput.json"
    variants = {
        "-ep2": {"strategy_options": {"expert_model_parallel_size": 2}, "module_options": {"moe_grouped_gemm": True}}
    }
    command = [sys.executable, str(root / "benchmarks/throughput.py"), "--cpu-dry-run", "--only", "dry-run-moe/dp2"]
    command += ["--runners", "strategy-sdpa", "hf", "--variants", json.dumps(variants), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["dry-run-moe/dp2/strategy-sdpa-ep2"], runs  # no transformers peer for MoE models
    run = runs["dry-run-moe/dp2/strategy-sdpa-ep2"]
    assert run["tokens_per_second"] > 0 and run["model_tflops_per_gpu"] > 0, run


def test_float8_keeps_the_experts_in_bf16(ranks: Any) -> None:
    """``fp8_recipe`` with MoE layers: attention and dense layers in float8 (emulated on CPUs), the experts in bf16
    (their token counts change every step and can be zero); at EP2 the losses stay within float8's 2e-2 of bf16."""
    model = {**MODEL, "hidden_size": 64, "moe_ffn_hidden_size": 64, "ffn_hidden_size": 128, "moe_layer_freq": 2}

    slow = 300  # bf16 GEMMs are slow on CPUs without AVX-512
    want = ranks.run(
        2, fit_gpt, 2, steps=3, precision="bf16-mixed", model=model, expert_model_parallel_size=2, timeout=slow
    )[0]
    got = ranks.run(
        2,
        fit_gpt,
        2,
        steps=3,
        precision="bf16-mixed",
        model=model,
        probe=kept_in_bf16,
        callbacks=[KeptInBf16()],
        expert_model_parallel_size=2,
        fp8_recipe="tensorwise",
        timeout=slow,
    )[0]
    experts = [name for name, why in got["probe"].items() if why.startswith("an MoE expert")]
    assert experts and all(".experts." in name for name in experts), got["probe"]
    for a, b in zip(got["loss"], want["loss"], strict=True):
        assert _close(a, b, 2e-2), (got["loss"], want["loss"])


class KeptInBf16(pl.Callback):
    """Notes, while the fit runs, which linear layers ``fp8_recipe`` left in bf16 (and why) on the module."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.kept_in_bf16 = dict(trainer.strategy.tp_layers.split_linears.kept_high_precision)


def kept_in_bf16(module: Any) -> dict[str, str]:
    """(A probe, run in the rank after the fit:) what :class:`KeptInBf16` noted."""
    return module.kept_in_bf16


AUX_HEAVY = {**MODEL, "moe_aux_loss_coeff": 10.0, "transformer_config_overrides": {"moe_z_loss_coeff": 1.0}}
AUX_LAYOUTS = {
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "cp2": (2, dict(context_parallel_size=2)),
}


@pytest.mark.parametrize("layout", list(AUX_LAYOUTS))
def test_router_losses_weigh_the_same_when_tokens_are_split(ranks: Any, layout: str) -> None:
    """With the load-balancing and z-losses weighted heavily, the gradient's norm at TP2 + SP and at CP2 (each rank
    routes part of the tokens) equals one process's: the router losses' gradients keep their weight whichever
    ranks hold the tokens."""
    world, strategy = AUX_LAYOUTS[layout]
    want = ranks.run(1, fit_gpt, 1, steps=2, model=AUX_HEAVY)[0]
    got = ranks.run(world, fit_gpt, world, steps=2, model=AUX_HEAVY, **strategy)[0]
    for step, (a, b) in enumerate(zip(got["grad_norm"], want["grad_norm"], strict=True)):
        assert _close(a, b, 1e-3), f"{layout}: step {step} grad norm {a} vs one process's {b}"


def grouped_against_sequential(counts: list[int]) -> dict[str, float]:
    """One MoE layer's experts (bf16, 4 local experts) on tokens sorted by expert, ``counts`` of them each: the
    grouped GEMMs against ``SequentialMLP``'s forward on the same module, output and gradients (largest relative
    error); and whether the grouped path ran."""
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP

    from lightning_megatron.layers import grouped_experts
    from lightning_megatron.models.loading import prepare

    module = GPTModule(**{**TINY_MODEL, **MODEL, "moe_grouped_gemm": True})
    prepare(module, devices=1, accelerator="cpu", precision="bf16-mixed", strategy_options={"timeout": 120})
    experts = next(m for m in module.modules() if isinstance(m, grouped_experts.GroupedGemmExperts))
    hidden_size = experts.local_experts[0].linear_fc1.weight.shape[1]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(sum(counts), hidden_size, generator=g).to(torch.bfloat16)
    probs = torch.rand(sum(counts), generator=g)
    grad = torch.randn(sum(counts), hidden_size, generator=g).to(torch.bfloat16)
    ran = []
    original = torch._grouped_mm

    def counting(*args: Any, **kwargs: Any) -> Any:
        ran.append(1)
        return original(*args, **kwargs)

    results = {}
    for name, forward in (("grouped", experts.forward), ("sequential", lambda *a: SequentialMLP.forward(experts, *a))):
        experts.zero_grad(set_to_none=True)
        x = tokens.clone().requires_grad_()
        torch._grouped_mm = counting
        try:
            out, _ = forward(x, torch.tensor(counts), probs)
        finally:
            torch._grouped_mm = original
        out.backward(grad)
        weights = [p.grad.float().clone() for p in experts.parameters()]
        results[name] = (out.float().detach(), x.grad.float(), weights)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp(min=1e-12))

    (go, gx, gw), (so, sx, sw) = results["grouped"], results["sequential"]
    return {
        "grouped_mm_calls": float(len(ran)),
        "out": rel(go, so),
        "dx": rel(gx, sx),
        "dw": max(rel(a, b) for a, b in zip(gw, sw) if b.norm() > 0),
        "zero_token_expert_grads": float(sum(float(a.abs().sum()) for a, b in zip(gw, sw) if b.norm() == 0)),
    }


def test_grouped_gemm_experts_equal_sequential_ones_on_the_same_weights(ranks: Any) -> None:
    """The grouped GEMMs compute ``SequentialMLP``'s function: output, input gradient and every expert's weight
    gradients within bf16 rounding of the sequential experts' on the same module and tokens, an expert that got no
    tokens included (its gradients zero)."""
    got = ranks.run(1, grouped_against_sequential, [5, 0, 3, 8])[0]
    assert got["grouped_mm_calls"] >= 2, got  # fc1 and fc2 ran grouped
    assert got["out"] < 1e-2 and got["dx"] < 1e-2 and got["dw"] < 2e-2, got
    assert got["zero_token_expert_grads"] == 0.0, got


class AdagradGPT(GPTModule):
    """An optimizer megatron-core does not implement (the strategy steps it as a plain torch optimizer)."""

    def configure_optimizers(self) -> Any:
        import torch

        return torch.optim.Adagrad([p for c in self.model_chunks for p in c.parameters()], lr=1e-2)


def test_an_optimizer_megatron_core_lacks_is_refused_at_ep2(ranks: Any) -> None:
    """A plain torch optimizer knows nothing of expert ranks (its gradient norm and checkpoint are per tensor and
    pipeline rank): at EP2 it is refused by name before the first step; at EP1 it trains."""
    with pytest.raises(Exception, match="expert_model_parallel_size > 1 needs an optimizer megatron-core"):
        ranks.run(2, fit_gpt, 2, steps=1, model=MODEL, module_cls=AdagradGPT, expert_model_parallel_size=2)
    assert len(ranks.run(1, fit_gpt, 1, steps=1, model=MODEL, module_cls=AdagradGPT)[0]["loss"]) == 1
