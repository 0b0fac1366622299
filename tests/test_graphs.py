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
from lightning_megatron.models import GPTModule
from lightning_megatron.models.module import MegatronLightningModule
from lightning_megatron.strategy.graphs import (
    StepGraph,
    check_graphable_precision,
    declares_graph_safe_step,
    resolve_accumulation_fusion,
    resolve_cuda_graphs,
    settings_not_run_graphed,
)
from lightning_megatron.strategy.step import StepOutput


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(cuda_graphs=True, pipeline_model_parallel_size=2), ["pipeline_model_parallel_size=1", "cuda_graphs"]),
        (dict(cuda_graphs="yes"), ["`cuda_graphs` must be true, false or null"]),
        (dict(gradient_accumulation_fusion="yes"), ["`gradient_accumulation_fusion` must be true, false or unset"]),
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


def _one_step_fit() -> dict[str, Any]:
    """Inside a rank (a fit holds a process group, which the pytest process must not: it forks the ranks)."""
    strategy = lambda module: module.trainer.strategy  # noqa: E731
    out = cases.fit_gpt(
        1, steps=1, probe=lambda m: (strategy(m).step_graph is None, strategy(m).fuses_gradient_accumulation)
    )
    return {"no_graph": out["probe"][0], "fused_accumulation": out["probe"][1], "steps": len(out["loss"])}


def test_cuda_graphs_unset_stay_off_on_cpu_and_pipeline_layouts_are_accepted(ranks: Any) -> None:
    """The default is automatic: a CPU fit (every CPU test) and a pipeline layout build and run without graphs."""
    assert MegatronAppStrategy().cuda_graphs is None
    assert MegatronAppStrategy(pipeline_model_parallel_size=2).cuda_graphs is None
    (out,) = ranks.run(1, _one_step_fit)
    assert out == {"no_graph": True, "fused_accumulation": False, "steps": 1}


def _swapped_session_fit() -> dict[str, Any]:
    """A benchmark's cases, as ``benchmarks/fbd_split.py`` runs them: other schedule sessions
    (``strategy.using_schedule``) before the fit's steps. The step graph is a real one that stays in its warm-up (no capture on CPU), so it counts
    the steps it was given."""
    import lightning.pytorch as pl

    graph = StepGraph(warmup_steps=100, strict=False)
    counted: dict[str, int] = {}

    class SwapSessions(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            strategy = trainer.strategy
            strategy._steps.graph = graph
            batch = strategy.batch_to_device(next(iter(trainer.datamodule.train_dataloader())))
            for name in ("first", "second"):
                with strategy.using_schedule("1f1b"):
                    for _ in range(2):
                        strategy.forward_backward(batch)
                counted[name] = graph._eager_steps

        def on_train_batch_end(self, *args: Any) -> None:
            counted["after_the_fit_step"] = graph._eager_steps  # before the fit's end closes the graph

    out = cases.fit_gpt(1, steps=1, callbacks=[SwapSessions()])
    return {**counted, "steps": len(out["loss"])}


def test_a_step_graph_serves_only_the_session_it_started_with(ranks: Any) -> None:
    """A graph holds one schedule session's work: with another session swapped in (a benchmark's next case), or
    the fit's own session opened after a benchmark's, steps run eagerly, never as a replay of the first session's
    step (which had every case of the 4-GPU rank-split benchmark replay its data-parallel baseline)."""
    (out,) = ranks.run(1, _swapped_session_fit)
    assert out == {"first": 2, "second": 2, "after_the_fit_step": 2, "steps": 1}, out


class _OwnStep(GPTModule):
    def forward_step(self, batch: Any, chunk: torch.nn.Module) -> Any:  # no promise made here
        return super().forward_step(batch, chunk)


class _OwnCapturableStep(_OwnStep):
    graph_safe_forward_step = True

    def forward_step(self, batch: Any, chunk: torch.nn.Module) -> Any:
        return super().forward_step(batch, chunk)


class _PromiseWithoutStep(MegatronLightningModule):
    graph_safe_forward_step = True  # but forward_step is the base class's, which makes no promise


@pytest.mark.parametrize(
    ("module_cls", "declared"),
    [(GPTModule, True), (_OwnStep, False), (_OwnCapturableStep, True), (_PromiseWithoutStep, False)],
)
def test_only_the_class_that_defines_forward_step_can_promise_it_is_capturable(
    module_cls: type, declared: bool
) -> None:
    module = module_cls.__new__(module_cls)  # the promise is a class attribute: no need to build the model
    assert declares_graph_safe_step(module) is declared


@pytest.mark.parametrize(
    ("requested", "where", "expected"),
    [
        (None, {}, True),  # one node, PP 1 (one GPU, TP, DP), bf16, GPTModule: on
        (None, {"on_cpu": True}, False),
        (None, {"pipeline": 2}, False),  # pipeline schedules wait on other stages from the host
        (None, {"num_nodes": 2}, False),  # never run across nodes: opt-in there
        (True, {"num_nodes": 2}, True),
        (None, {"unchecked": ("overlap_param_gather",)}, False),  # never run graphed with several processes
        (True, {"unchecked": ("tp_comm_overlap",)}, True),
        (None, {"params_dtype": torch.float16}, False),
        (None, {"module": "own step"}, False),
        (True, {"module": "own step"}, True),
        (False, {}, False),
        (None, {"fitting": False}, False),  # validate/test/predict: no training step to replay
        (True, {"fitting": False}, False),
    ],
)
def test_automatic_graphs_apply_where_they_were_measured(requested: Any, where: dict[str, Any], expected: bool) -> None:
    kwargs: dict[str, Any] = {
        "module": GPTModule.__new__(GPTModule),
        "on_cpu": False,
        "params_dtype": torch.bfloat16,
        **where,
    }
    if kwargs["module"] == "own step":
        kwargs["module"] = _OwnStep.__new__(_OwnStep)
    assert resolve_cuda_graphs(requested, **kwargs) is expected


@pytest.mark.parametrize(
    ("requested", "where", "expected"),
    [
        (None, {}, True),  # graphed, bf16: 1.02-1.03x on one GPU, 1.018x at TP2, 1.029x at DP2
        (None, {"graphs": False}, False),  # eager: the host-bound GPT-2-medium ran 0.92x
        (None, {"pipeline": 2}, False),  # graphed pipelines: no parity test with it yet
        (None, {"params_dtype": torch.float32}, False),  # fp32: the same arithmetic, only more host work
        (None, {"on_cpu": True, "graphs": False}, False),
        (True, {"graphs": False, "pipeline": 2}, True),
        (False, {}, False),
    ],
)
def test_automatic_accumulation_fusion_comes_with_the_graph(
    requested: Any, where: dict[str, Any], expected: bool
) -> None:
    kwargs: dict[str, Any] = {"graphs": True, "on_cpu": False, "params_dtype": torch.bfloat16, **where}
    assert resolve_accumulation_fusion(requested, **kwargs) is expected


def test_settings_no_graph_parity_test_ran_with_are_named() -> None:
    """The fused weight-gradient GEMM ran graphed at TP2 and DP2, bit for bit, so it is not named; the overlapped
    parameter all-gather and the overlapped tensor-parallel linears are."""
    assert settings_not_run_graphed(overlap_param_gather=False, tp_comm_overlap=False) == ()
    both = settings_not_run_graphed(overlap_param_gather=True, tp_comm_overlap=True)
    assert both == ("overlap_param_gather", "tp_comm_overlap")


def test_graphs_asked_for_where_they_cannot_work_are_errors() -> None:
    module = GPTModule.__new__(GPTModule)
    with pytest.raises(MegatronConfigError, match="needs GPUs"):
        resolve_cuda_graphs(True, module=module, on_cpu=True, params_dtype=torch.float32)
    with pytest.raises(MegatronConfigError, match="bf16-mixed"):
        resolve_cuda_graphs(True, module=module, on_cpu=False, params_dtype=torch.float16)


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
