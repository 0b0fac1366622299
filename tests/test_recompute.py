"""Activation recomputation (``GPTModule(recompute_granularity=..., recompute_method=..., recompute_num_layers=...)``).

Recomputation changes what is kept between forward and backward, never the arithmetic: the checkpointed forward
runs again under the RNG states it first ran with. So on CPUs in fp32 the losses and every step's gradients must
equal those of the same fit without it, at tensor (with sequence) parallelism on a Llama-shaped model and at
pipeline parallelism (with the fused norms hand-over and the zero-bubble schedule's split backward). Equal results
would also come from a setting that is silently ignored, so every fit counts how often each transformer layer and
each core attention ran forward in the first step: twice as often where recomputation is asked for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import dpp_cases as dc
import lightning.pytorch as pl
import pytest
import yaml
from test_dpp import assert_close

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.models import GPTModule
from lightning_megatron.models.recompute import check_recompute_layout


class _ForwardCounts(pl.Callback):
    """Forward calls of every transformer layer and core attention of this rank during the first training step,
    keyed ``chunk{i}.layer{j}`` and ``chunk{i}.layer{j}.core_attention``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.first: dict[str, int] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from megatron.core.transformer.transformer_layer import TransformerLayer

        for i, chunk in enumerate(trainer.strategy.wrapped_chunks):
            layers = [m for m in chunk.modules() if isinstance(m, TransformerLayer)]
            for j, layer in enumerate(layers):
                for key, module in ((f"chunk{i}.layer{j}", layer), (f"chunk{i}.layer{j}.core_attention", None)):
                    module = module or layer.self_attention.core_attention
                    module.register_forward_hook(lambda *_, key=key: self.counts.update([key]))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.first:
            self.first = dict(self.counts)


def fit_counting(world_size: int, **strategy: Any) -> dict[str, Any]:
    counter = _ForwardCounts()
    result = dc.fit_recording(world_size, steps=2, callbacks=[counter], **strategy)
    result["forwards"] = counter.first
    return result


FULL_UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FULL_UNIFORM_2 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
FULL_BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective")

# (strategy and model of the fit, the recompute settings tried against it without recomputation)
CASES = {
    "tp2-sp-llama": (
        dict(tensor_model_parallel_size=2, sequence_parallel=True, model={"num_layers": 2, **dc.llama_model()}),
        [FULL_UNIFORM, SELECTIVE],
    ),
    "pp2": (dict(pipeline_model_parallel_size=2), [FULL_BLOCK, FULL_UNIFORM_2, SELECTIVE]),
    "pp2-zb-fused-norms": (
        dict(pipeline_model_parallel_size=2, schedule="zb-h1", model={"layer_spec": "local+fused"}),
        [FULL_UNIFORM],
    ),
}


def _recomputed(settings: dict[str, Any], key: str) -> bool:
    """Whether ``key`` (a layer, or its core attention) runs forward twice under ``settings`` (2 layers a chunk)."""
    if settings["recompute_granularity"] == "selective":
        return key.endswith("core_attention")
    return settings["recompute_method"] == "uniform" or ".layer0" in key  # block: the first layer of each chunk


@pytest.mark.parametrize("case", list(CASES))
def test_recomputation_runs_and_changes_no_result(ranks: Any, case: str) -> None:
    strategy, variants = CASES[case]
    model = strategy.get("model", {})
    want = ranks.run(2, fit_counting, 2, **strategy)
    for settings in variants:
        got = ranks.run(2, fit_counting, 2, **{**strategy, "model": {**model, **settings}})
        for rank in range(2):
            what = f"{case} {settings} rank {rank}"
            assert_close(got[rank], want[rank], 1e-6, what)
            base, seen = want[rank]["forwards"], got[rank]["forwards"]
            assert base and base.keys() == seen.keys(), what
            for key, count in base.items():
                expected = 2 * count if _recomputed(settings, key) else count
                assert seen[key] == expected, f"{what}: {key} ran forward {seen[key]} times, expected {expected}"


# -- the settings' checks, before any process starts --------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        (dict(recompute_granularity="full"), ["recompute_method and recompute_num_layers"]),
        (dict(recompute_granularity="full", recompute_method="block"), ["needs recompute_num_layers"]),
        (dict(recompute_granularity="selective", recompute_method="uniform"), ["recompute_method='uniform'"]),
        (dict(recompute_granularity="selective", recompute_num_layers=1), ["recompute_num_layers=1"]),
        (dict(recompute_method="block", recompute_num_layers=1), ["recompute_granularity='full'"]),
        (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=5),
            ["recompute_num_layers=5", "from 1 to num_layers=4"],
        ),
        (dict(recompute_granularity="all"), ["recompute_granularity='all'"]),
        (
            dict(recompute_granularity="selective", transformer_config_overrides={"recompute_granularity": "full"}),
            ["transformer_config_overrides", "GPTModule(recompute_granularity=...)"],
        ),
    ],
)
def test_bad_settings_name_the_parameter(settings: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(MegatronConfigError) as err:
        GPTModule(num_layers=4, **settings)
    for name in names:
        assert name in str(err.value)


def test_selective_under_sdpa_warns_that_it_saves_little() -> None:
    with pytest.warns(UserWarning, match="almost no memory"):
        GPTModule(layer_spec="sdpa", recompute_granularity="selective")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GPTModule(layer_spec="local", recompute_granularity="selective")
        GPTModule(layer_spec="sdpa", **FULL_UNIFORM)


def test_the_layout_check_counts_layers_per_chunk() -> None:
    check_recompute_layout(FULL_UNIFORM_2, 4, "pipeline stage")
    check_recompute_layout({"recompute_granularity": "selective"}, 3, "pipeline stage")
    with pytest.raises(MegatronConfigError, match="recompute_num_layers that divides 3"):
        check_recompute_layout(FULL_UNIFORM_2, 3, "virtual pipeline stage")
    with pytest.raises(MegatronConfigError, match="from 1 to 1"):
        check_recompute_layout({**FULL_BLOCK, "recompute_num_layers": 2}, 1, "virtual pipeline stage")


def test_settings_read_from_yaml(tmp_path: Path) -> None:
    """The command line (LightningCLI reading ``GPTModule``'s signature) takes the settings from a config file."""
    config = {"model": {"class_path": "GPTModule", "init_args": {"num_layers": 2, **FULL_BLOCK}}}
    path = tmp_path / "recompute.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", str(path), "--print_config"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)["model"]["init_args"]
    assert {name: printed[name] for name in FULL_BLOCK} == FULL_BLOCK


def test_a_norm_after_a_checkpoint_computes_its_own_output() -> None:
    """A fused norm takes the output handed over for its input only while that input's autograd node is the one
    the output was computed from. A checkpoint (here a minimal one) computes its output without a graph of its
    input and returns that very tensor with a new node; the norm after it must normalize it itself, or the
    gradient stops there."""
    import torch
    import torch.nn.functional as F

    from lightning_megatron.kernels.norms import FusedLayerNorm

    norm = FusedLayerNorm(8)

    class Checkpointed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            h = x.detach() * 2
            with torch.enable_grad():  # megatron-core runs its bias-dropout-adds so, even inside a checkpoint
                norm.hand_over(h, F.layer_norm(h, (8,), norm.weight, norm.bias))
            return h

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return 2 * grad

    x = torch.randn(4, 8, requires_grad=True)
    y = norm(Checkpointed.apply(x))
    (y * torch.arange(8.0)).sum().backward()
    ref = x.detach().clone().requires_grad_()
    (F.layer_norm(ref * 2, (8,), norm.weight, norm.bias) * torch.arange(8.0)).sum().backward()
    assert norm.hand_overs_missed == 1 and norm.hand_overs_taken == 0
    assert x.grad is not None and torch.allclose(x.grad, ref.grad, atol=1e-6)
