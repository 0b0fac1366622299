"""Single-process unit tests (no Trainer, no process group) of lightning_megatron's registration with Lightning and
MegatronAppStrategy(...)'s arguments: defaults, errors naming the fix."""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_megatron
from lightning_megatron import MegatronAppStrategy, MegatronConfigError


def test_import_registers_megatron_strategy() -> None:
    """``Trainer(strategy="megatron")`` and ``strategy: megatron`` in YAML rely on this import side effect: with
    ``lightning.pytorch`` already loaded (as here), ``import lightning_megatron`` imports the strategy and
    registers its name at once."""
    saved = StrategyRegistry.pop("megatron", None)
    try:
        assert "megatron" not in StrategyRegistry
        importlib.reload(lightning_megatron)
        assert StrategyRegistry["megatron"]["strategy"] is MegatronAppStrategy
        assert isinstance(StrategyRegistry.get("megatron"), MegatronAppStrategy)
    finally:
        if saved is not None:
            StrategyRegistry["megatron"] = saved


def test_lazy_import_registers_megatron_strategy_on_first_access() -> None:
    """The other import order: ``import lightning_megatron`` first loads neither torch, Lightning nor
    megatron-core (trace readers such as the TensorBoard plugin rely on it); the strategy's first access
    imports ``lightning_megatron.strategy``, which registers ``"megatron"``."""
    code = (
        "import sys\n"
        "import lightning_megatron\n"
        "heavy = sorted({'torch', 'lightning', 'megatron'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "assert lightning_megatron.MegatronConfigError.__name__ == 'MegatronConfigError'\n"
        "from lightning_megatron import MegatronAppStrategy\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert StrategyRegistry['megatron']['strategy'] is MegatronAppStrategy\n"
        "assert lightning_megatron.MegatronPrecision.__name__ == 'MegatronPrecision'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_strategy_defaults() -> None:
    strategy = MegatronAppStrategy()
    assert strategy.schedule.name == "1f1b" and strategy.micro_batch_size == 1
    virtual = MegatronAppStrategy(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert virtual.schedule.name == "interleaved"


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(schedule="zero-bubble"), ["Unknown pipeline schedule 'zero-bubble'", "1f1b", "interleaved"]),
        (dict(pipeline_model_parallel_size=2, schedule="interleaved"), ["virtual_pipeline_model_parallel_size"]),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, schedule="1f1b"),
            ["schedule='1f1b'", "virtual_pipeline_model_parallel_size=2"],
        ),
        (dict(overlap_param_gather=True), ["overlap_param_gather", "use_distributed_optimizer"]),
        (dict(process_group_backend="mpi"), ["process_group_backend", "'mpi'"]),
        (dict(micro_batch_size=0), ["micro_batch_size", "0"]),
        (dict(micro_batch_size=2.0), ["micro_batch_size", "2.0"]),
        (dict(ddp_config={"overlap_grad_reduce": True}), ["ddp_config['overlap_grad_reduce']"]),
        (dict(ddp_config={"bucket_size": 10}), ["ddp_config['bucket_size']"]),
        (dict(tensor_model_parallel_size=0), ["tensor_model_parallel_size"]),
        (dict(sequence_parallel=True), ["sequence_parallel"]),
    ],
)
def test_strategy_constructor_errors(kwargs: dict[str, Any], fragments: list[str]) -> None:
    """Bad arguments fail at construction, on every rank alike, before any process group exists."""
    with pytest.raises(MegatronConfigError) as info:
        MegatronAppStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_strategy_accepts_consistent_arguments() -> None:
    """The counterparts of the refused combinations construct fine (the checks are not over-eager)."""
    MegatronAppStrategy(overlap_param_gather=True, use_distributed_optimizer=True)
    MegatronAppStrategy(process_group_backend="gloo", micro_batch_size=4)
    strategy = MegatronAppStrategy(ddp_config={"check_for_nan_in_grad": True})
    assert strategy._ddp_kwargs["check_for_nan_in_grad"] is True
