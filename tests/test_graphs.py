"""``cuda_graphs``: the settings a CUDA graph cannot replay fail when the strategy is built (or, for the device and
the precision, when the fit starts), with the parameter to change; the step graph's bookkeeping runs eagerly.

The captures and replays themselves need a GPU: ``tests/test_graphs_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import cases
import pytest
import torch

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.strategy.graphs import StepGraph, check_graphable_precision
from lightning_megatron.strategy.step import StepOutput


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(cuda_graphs=True, pipeline_model_parallel_size=2), ["pipeline_model_parallel_size=1", "cuda_graphs"]),
        (dict(cuda_graphs="yes"), ["`cuda_graphs` must be true or false"]),
    ],
)
def test_bad_settings_fail_when_the_strategy_is_built(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(MegatronConfigError) as error:
        MegatronAppStrategy(**kwargs)
    for word in words:
        assert word in str(error.value)


def test_cuda_graphs_on_cpu_fail_before_any_process_group() -> None:
    with pytest.raises(MegatronConfigError, match="needs GPUs.*accelerator='gpu'"):
        cases.fit_gpt(1, steps=1, cuda_graphs=True)
    assert not torch.distributed.is_initialized()


def test_fp16_is_refused_with_the_fix() -> None:
    with pytest.raises(MegatronConfigError, match="bf16-mixed"):
        check_graphable_precision(torch.float16)
    check_graphable_precision(torch.bfloat16)
    check_graphable_precision(torch.float32)


def test_warmup_steps_run_eagerly_and_a_new_signature_starts_over() -> None:
    """Before a capture the step graph only counts: each call runs ``run`` itself, and a change of shape or of a
    non-tensor leaf restarts the warm-up (so a graph is never replayed with inputs of another shape)."""
    calls: list[int] = []

    def run(microbatches: Any) -> StepOutput:
        calls.append(microbatches[0]["tokens"].shape[1])
        loss = microbatches[0]["tokens"].float().mean()
        return StepOutput(loss=loss, loss_sum=loss, num_tokens=torch.tensor(1.0))

    graph = StepGraph(warmup_steps=3)
    a = [{"tokens": torch.ones(2, 8), "flag": 1}]
    out = graph(run, a)
    assert out.loss.item() == 1.0 and graph._eager_steps == 1
    graph(run, [{"tokens": torch.zeros(2, 8), "flag": 1}])  # same signature: the warm-up goes on
    assert graph._eager_steps == 2
    graph(run, [{"tokens": torch.ones(2, 16), "flag": 1}])  # new shape: starts over
    assert graph._eager_steps == 1
    graph(run, [{"tokens": torch.ones(2, 16), "flag": 2}])  # new non-tensor value: starts over
    assert graph._eager_steps == 1
    assert calls == [8, 8, 16, 16] and graph.captures == 0 and graph.replays == 0
    with pytest.raises(MegatronConfigError, match="warmup_steps=0"):
        StepGraph(warmup_steps=0)
