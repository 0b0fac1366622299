"""Single-process unit tests (no Trainer, no process group) of strategy/parallel.py: which TP x PP x VPP layouts are
accepted, with errors naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_megatron import MegatronConfigError
from lightning_megatron.strategy.parallel import ParallelLayout


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(tensor=0), ["tensor_model_parallel_size", "0"]),
        (dict(tensor=1.5), ["tensor_model_parallel_size", "1.5"]),
        (dict(pipeline=-1), ["pipeline_model_parallel_size", "-1"]),
        (dict(pipeline=2, virtual_pipeline=0), ["virtual_pipeline_model_parallel_size", "0"]),
        (dict(virtual_pipeline=2), ["virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"]),
        (dict(sequence_parallel=True), ["sequence_parallel", "tensor_model_parallel_size"]),
    ],
)
def test_layout_rejects_bad_sizes(kwargs: dict[str, Any], names: list[str]) -> None:
    """Each bad size is refused at construction with a message naming the user-facing parameter."""
    with pytest.raises(MegatronConfigError) as info:
        ParallelLayout(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_layout_valid_sizes() -> None:
    layout = ParallelLayout(tensor=2, pipeline=2, virtual_pipeline=3, sequence_parallel=True)
    assert layout.model_parallel_size == 4
    assert layout.num_chunks == 3
    assert ParallelLayout(pipeline=2).num_chunks == 1
    assert layout.data_parallel_size(8) == 2
    assert layout.data_parallel_size(4) == 1


def test_layout_world_size_not_divisible() -> None:
    """Checked before any process group exists, so every rank fails the same way."""
    with pytest.raises(MegatronConfigError) as info:
        ParallelLayout(tensor=2, pipeline=2).data_parallel_size(6)
    message = str(info.value)
    assert "world size 6" in message
    assert "tensor_model_parallel_size" in message and "pipeline_model_parallel_size" in message
    assert "= 4" in message


def test_layout_layers_must_split_over_stages() -> None:
    """Virtual stages count: 6 layers fit 2 pipeline stages but not 2 × 2 virtual ones."""
    ParallelLayout(pipeline=2).check_num_layers(6)
    ParallelLayout(pipeline=2, virtual_pipeline=2).check_num_layers(8)
    with pytest.raises(MegatronConfigError, match="pipeline_model_parallel_size = 4") as info:
        ParallelLayout(pipeline=4).check_num_layers(6)
    assert "6 layers" in str(info.value)
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size") as info:
        ParallelLayout(pipeline=2, virtual_pipeline=2).check_num_layers(6)
    assert "= 4 stages" in str(info.value)
