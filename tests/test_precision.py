"""Single-process unit tests (no Trainer, no process group) of strategy/precision.py: Lightning's precision settings
translated to megatron-core's, and the plugin's hooks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_megatron import MegatronAppStrategy, MegatronConfigError, MegatronPrecision
from lightning_megatron.strategy.optimizer import (
    StrategyOptimizer,
)
from lightning_megatron.strategy.precision import from_lightning_plugin


@pytest.mark.parametrize(
    ("plugin", "name", "dtype"),
    [
        (Precision(), "32-true", torch.float32),
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed", torch.bfloat16),
        (MixedPrecision("16-mixed", "cpu"), "16-mixed", torch.float16),
    ],
)
def test_from_lightning_plugin_maps(plugin: Precision, name: str, dtype: torch.dtype) -> None:
    """Trainer(precision=...) builds Lightning's plugin; the strategy must turn it into megatron precision."""
    converted = from_lightning_plugin(plugin)
    assert isinstance(converted, MegatronPrecision)
    assert converted.precision == name and converted.params_dtype == dtype


def test_from_lightning_plugin_passthrough_and_rejections() -> None:
    own = MegatronPrecision("bf16-mixed")
    assert from_lightning_plugin(own) is own
    assert from_lightning_plugin(None) is None
    with pytest.raises(MegatronConfigError, match="precision='bf16-true'") as info:
        from_lightning_plugin(HalfPrecision("bf16-true"))
    assert "bf16-mixed" in str(info.value)
    with pytest.raises(MegatronConfigError, match="DoublePrecision is not supported"):
        from_lightning_plugin(DoublePrecision())


def test_strategy_converts_lightning_precision_plugin() -> None:
    """The setter Lightning's accelerator connector uses yields megatron precision, not autocast."""
    strategy = MegatronAppStrategy()
    assert strategy.precision_plugin.precision == "32-true"
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert isinstance(strategy.precision_plugin, MegatronPrecision)
    assert strategy.precision_plugin.params_dtype == torch.bfloat16


def test_megatron_precision_names() -> None:
    assert MegatronPrecision("bf16").precision == "bf16-mixed"
    assert MegatronPrecision(16).precision == "16-mixed"  # type: ignore[arg-type]
    assert MegatronPrecision("32").precision == "32-true"
    for bad in ("64-true", "bf16-true", "transformer-engine"):
        with pytest.raises(MegatronConfigError, match=f"precision='{bad}' is not supported"):
            MegatronPrecision(bad)  # type: ignore[arg-type]


def test_precision_backward_is_a_noop_and_no_autocast() -> None:
    """The schedule already ran backward; a second one would double the gradients."""
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).sum()
    precision = MegatronPrecision("bf16-mixed")
    precision.backward(loss, None, None)
    assert weight.grad is None
    with precision.forward_context():
        assert not torch.is_autocast_enabled("cpu")
    module = torch.nn.Linear(2, 2)
    assert MegatronPrecision().convert_module(module) is module


def test_clip_gradients_sets_clip_grad() -> None:
    """Lightning's gradient_clip_val reaches the optimizer that clips by model-parallel norm."""
    precision = MegatronPrecision()
    target = SimpleNamespace(clip_grad=0.0)
    precision.clip_gradients(target, 1.5)  # type: ignore[arg-type]
    assert target.clip_grad == 1.5
    wrapped = SimpleNamespace(_optimizer=SimpleNamespace(clip_grad=0.0))
    precision.clip_gradients(wrapped, 2, GradClipAlgorithmType.NORM)  # type: ignore[arg-type]
    assert wrapped._optimizer.clip_grad == 2.0 and not hasattr(wrapped, "clip_grad")
    precision.clip_gradients(wrapped, None, "norm")  # type: ignore[arg-type]
    assert wrapped._optimizer.clip_grad == 0.0

    plain = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    precision.clip_gradients(plain, 1.0)
    assert not hasattr(plain, "clip_grad")


def test_clip_gradients_through_a_real_lightning_optimizer() -> None:
    """LightningOptimizer copies the wrapped optimizer's attributes; the inner one must get the value."""
    inner = StrategyOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    MegatronPrecision().clip_gradients(LightningOptimizer(inner), 0.75)  # type: ignore[arg-type]
    assert inner.clip_grad == 0.75


@pytest.mark.parametrize("algorithm", ["value", GradClipAlgorithmType.VALUE])
def test_clip_gradients_rejects_value_clipping(algorithm: Any) -> None:
    target = SimpleNamespace(clip_grad=0.0)
    with pytest.raises(MegatronConfigError, match="gradient_clip_algorithm='value'"):
        MegatronPrecision().clip_gradients(target, 1.0, algorithm)  # type: ignore[arg-type]
    assert target.clip_grad == 0.0
    MegatronPrecision().clip_gradients(target, 0.0, algorithm)  # type: ignore[arg-type]  # clipping off: fine
