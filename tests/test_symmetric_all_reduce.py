"""``symmetric_ar_type``: megatron-core's tensor-parallel all-reduce on torch's symmetric memory
(``compat/symmetric_all_reduce.py``, ``layers/install.py``).

On CPUs (gloo, real forked ranks): the replacement sits where megatron-core's layers look ``_reduce`` up, so
``reduce_from_tensor_model_parallel_region`` over the installed group reaches it, and so does the input gradient of
a layer with the project's backward (``layers.wgrad``); a tensor it cannot take (not
CUDA) goes to the collective it replaced and comes back summed, counted as a fallback; another group passes
through uncounted; ``restore`` puts megatron-core's function back, also after a second install. Bad settings fail
when the strategy is built, naming the parameter; where there is nothing to replace it warns and is off; on CPUs
the fit says it needs GPUs.

The GPU kernels themselves, and a graphed TP2 fit with them against NCCL's eager one, bit for bit:
``test_graphs_gpu.py::test_two_gpu_symmetric_all_reduce_matches_nccl`` (2 GPUs).
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.compat import symmetric_all_reduce
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.install import TensorParallelLayers
from lightning_megatron.layers.wgrad import _SplitLinear

ORIGINAL = mappings._reduce


def _routes_and_restores() -> dict[str, Any]:
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    other = dist.new_group([0, 1])
    first = symmetric_all_reduce.install(group, "one_shot")
    handle = symmetric_all_reduce.install(group, "two_shot")  # replaces the first, keeps megatron-core's original
    try:
        summed = mappings.reduce_from_tensor_model_parallel_region(torch.full((4, 8), float(rank + 1)), group)
        passed = mappings.reduce_from_tensor_model_parallel_region(torch.ones(3), other)
        forward_counts = {"calls": handle.calls, "fallbacks": handle.fallbacks}
        # a column-parallel layer with the project's backward: its input gradient goes through the replacement too
        x = torch.ones(2, 3, requires_grad=True)
        weight = torch.nn.Parameter(torch.full((4, 3), float(rank + 1)))
        _SplitLinear.apply(x, weight, None, True, False, group, False).sum().backward()
        counts = {"calls": handle.calls, "fallbacks": handle.fallbacks}
        installed = mappings._reduce is handle and handle._original is ORIGINAL and first._original is ORIGINAL
        found = (
            symmetric_all_reduce.installed_for(group) is handle and symmetric_all_reduce.installed_for(other) is None
        )
    finally:
        handle.restore()
    return {
        "summed": summed.unique().tolist(),
        "passed": passed.unique().tolist(),
        "input_grad": x.grad.unique().tolist(),
        "forward_counts": forward_counts,
        "counts": counts,
        "installed": installed and found,
        "restored": mappings._reduce is ORIGINAL and symmetric_all_reduce.installed_for(group) is None,
    }


def test_megatron_reductions_over_the_group_reach_the_replacement(ranks: Any) -> None:
    for result in ranks.run(2, _routes_and_restores):
        assert result["installed"] and result["restored"], result
        assert result["summed"] == [3.0] and result["passed"] == [2.0], result  # gloo's sums, as before
        # CPU tensors: NCCL's path (gloo here), counted; the backward's input gradient too
        assert result["forward_counts"] == {"calls": 0, "fallbacks": 1}, result
        assert result["counts"] == {"calls": 0, "fallbacks": 2}, result
        assert result["input_grad"] == [4.0 * 1 + 4.0 * 2], result  # the column sums of both ranks' weights


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"symmetric_ar_type": "multimem_all_reduce"}, "`symmetric_ar_type` must be one of ['two_shot', 'one_shot']"),
        ({"symmetric_ar_type": True}, "`symmetric_ar_type` must be one of"),
    ],
)
def test_bad_settings_fail_when_the_strategy_is_built(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(MegatronConfigError, match=re.escape(message)):
        MegatronAppStrategy(tensor_model_parallel_size=2, **kwargs)


@pytest.mark.parametrize(
    ("layout", "why"),
    [({}, "no tensor parallelism"), ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "sequence")],
)
def test_with_nothing_to_replace_it_warns_and_is_off(layout: dict[str, Any], why: str) -> None:
    with pytest.warns(UserWarning, match=why):
        strategy = MegatronAppStrategy(symmetric_ar_type="two_shot", **layout)
    assert strategy.symmetric_ar_type is None


def test_tensor_parallel_without_sequence_parallelism_keeps_it() -> None:
    strategy = MegatronAppStrategy(tensor_model_parallel_size=2, symmetric_ar_type="two_shot")
    assert strategy.symmetric_ar_type == "two_shot"


def test_on_cpus_the_fit_says_it_needs_gpus() -> None:
    layers = TensorParallelLayers()
    with pytest.raises(MegatronConfigError, match="needs GPUs of one node"):
        layers.install([], accumulate=False, overlap=None, symmetric_ar_type="two_shot", tp_group=None, on_cpu=True)
    assert mappings._reduce is ORIGINAL
