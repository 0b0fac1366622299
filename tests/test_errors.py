"""Configuration errors that only show once ranks run: each must reach every rank as the same clear error.

A setting that fails on one rank while its peers wait in a collective hangs the whole job until the
collective timeout. So every case here runs a real ``Trainer.fit`` on forked gloo ranks, catches the error
inside each rank and returns it; the test then checks that all ranks failed alike, with a message naming
the parameter to change, well within the case timeout, and that the ranks are still usable afterwards.
"""

from __future__ import annotations

import math
import os
from typing import Any

import cases
import pytest
import torch

from lightning_megatron.models import GPTModule

TIMEOUT = 60.0
WORLD_SIZE = 2


class TwoOptimizersGPT(GPTModule):
    """Returns two optimizers: Lightning's automatic optimization refuses that before the strategy sees it."""

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        params = list(self.parameters())
        return [torch.optim.AdamW(params, lr=1e-3), torch.optim.SGD(params, lr=1e-3)]


class ManualTwoOptimizersGPT(TwoOptimizersGPT):
    """The same with manual optimization, which Lightning allows: the strategy's own check must refuse it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False


def provoke(world_size: int, fit_kwargs: dict[str, Any]) -> tuple[str, str]:
    """Run inside a rank: ``fit_gpt`` with a bad setting; return ``(exception type name, message)``."""
    try:
        cases.fit_gpt(world_size, **fit_kwargs)
    except Exception as err:  # noqa: BLE001  (the test asserts on the type)
        return type(err).__name__, str(err)
    return "no error", ""


def healthy_fit() -> dict[str, Any]:
    """Run inside a rank: a normal TP2 run, as a later test in the same worker group would do."""
    result = cases.fit_gpt(WORLD_SIZE, tensor_model_parallel_size=2, steps=2)
    return {"pid": os.getpid(), "loss": result["loss"], "global_step": result["global_step"]}


def worker_pid() -> int:
    return os.getpid()


# (id, fit_gpt arguments, expected exception type, fragments the message must contain)
ERRORS: list[tuple[str, dict[str, Any], str, list[str]]] = [
    (
        # Checked against the world size before any process group: the first error, not a TP-vs-layer one.
        "world-not-divisible-by-tp-pp",
        dict(tensor_model_parallel_size=4),
        "MegatronConfigError",
        ["world size 2", "tensor_model_parallel_size × pipeline_model_parallel_size = 4 × 1 = 4"],
    ),
    (
        "layers-not-divisible-by-stages",
        dict(model={"num_layers": 3}, pipeline_model_parallel_size=2),
        "MegatronConfigError",
        ["3 layers", "pipeline_model_parallel_size = 2"],
    ),
    (
        # PP2 × DP1: the rank's batch of 6 in microbatches of 2 gives 3, not a multiple of 2.
        "interleaved-microbatches-not-multiple-of-pp",
        dict(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            data={"global_batch_size": 6},
            micro_batch_size=2,
        ),
        "MegatronConfigError",
        ["schedule='interleaved'", "3 microbatches", "multiple of pipeline_model_parallel_size=2", "micro_batch_size"],
    ),
    (
        # DP2: each rank gets 3 samples, which micro_batch_size=2 cannot split.
        "batch-not-divisible-by-micro-batch",
        dict(data={"global_batch_size": 6}, micro_batch_size=2),
        "MegatronConfigError",
        ["3 samples", "micro_batch_size=2"],
    ),
    (
        "accumulate-grad-batches",
        dict(trainer={"accumulate_grad_batches": 2}),
        "MegatronConfigError",
        ["accumulate_grad_batches=2", "global batch size"],
    ),
    (
        "nccl-on-cpu",
        dict(process_group_backend="nccl"),
        "MegatronConfigError",
        ["process_group_backend='nccl'", "CPU", "gloo"],
    ),
    (
        "two-optimizers-automatic",
        dict(module_cls=TwoOptimizersGPT),
        "RuntimeError",
        ["multiple optimizers", "automatic_optimization"],
    ),
    (
        "unknown-transformer-config-field",
        dict(model={"transformer_config_overrides": {"hiden_size": 64}}),
        "MegatronConfigError",
        ["transformer_config_overrides", "hiden_size"],
    ),
    (
        "manual-optimization",
        dict(module_cls=ManualTwoOptimizersGPT),
        "MegatronConfigError",
        ["automatic_optimization"],
    ),
]


@pytest.mark.parametrize(
    ("fit_kwargs", "expected_type", "fragments"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_every_rank_raises_the_same_clear_error(
    ranks: Any, fit_kwargs: dict[str, Any], expected_type: str, fragments: list[str]
) -> None:
    """All ranks fail alike and promptly (``ranks.run`` raises if one hangs past the timeout)."""
    results = ranks.run(WORLD_SIZE, provoke, WORLD_SIZE, fit_kwargs, timeout=TIMEOUT)
    assert len(results) == WORLD_SIZE
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    error_type, message = results[0]
    assert error_type == expected_type, message
    for fragment in fragments:
        assert fragment in message


def test_worker_group_still_trains_after_each_error(ranks: Any) -> None:
    """A caught configuration error must leave the ranks reusable: the same processes (no replaced group)
    run a normal TP2 fit after every error case, however far the failed run got (process group, megatron
    parallel state of another layout, half-built Trainer)."""
    group = ranks.group(WORLD_SIZE)
    pids = ranks.run(WORLD_SIZE, worker_pid, timeout=TIMEOUT)
    for name, fit_kwargs, expected_type, _ in ERRORS:
        errors = ranks.run(WORLD_SIZE, provoke, WORLD_SIZE, fit_kwargs, timeout=TIMEOUT)
        assert {e[0] for e in errors} == {expected_type}, (name, errors)
        results = ranks.run(WORLD_SIZE, healthy_fit, timeout=TIMEOUT)
        assert ranks.group(WORLD_SIZE) is group and not group.broken, name
        assert [r["pid"] for r in results] == pids, name
        for result in results:
            assert result["global_step"] == 2, name
            assert len(result["loss"]) == 2 and all(math.isfinite(x) for x in result["loss"]), name
        assert results[0]["loss"] == results[1]["loss"], name  # TP peers log the same global loss


def test_virtual_pipeline_size_one_trains(ranks: Any) -> None:
    """ParallelLayout accepts a virtual size of 1 (and picks the interleaved schedule), so it must train."""
    fit_kwargs = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1, steps=2)
    results = ranks.run(WORLD_SIZE, provoke, WORLD_SIZE, fit_kwargs, timeout=TIMEOUT)
    assert results == [("no error", "")] * WORLD_SIZE
