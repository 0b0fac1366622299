"""Functions that run inside forked ranks for ``test_dpp.py``: MegaDPP against megatron-core's schedules."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from cases import fit_gpt

from lightning_megatron import MegatronAppStrategy


def _main_grads(strategy: MegatronAppStrategy) -> dict[str, torch.Tensor]:
    grads = {}
    for i, chunk in enumerate(strategy.wrapped_chunks):
        for name, param in chunk.named_parameters():
            grads[f"chunk{i}.{name}"] = param.main_grad.detach().clone()
    return grads


class GradRecorder(pl.Callback):
    """Each step's ``main_grad`` of every parameter, just before the optimizer uses them."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.grads.append(_main_grads(trainer.strategy))


def fit_recording(world_size: int, steps: int = 3, callbacks: Optional[list] = None, **strategy: Any) -> dict[str, Any]:
    """``fit_gpt`` plus every step's gradients and, for dpp, the order of the last step's tasks."""
    recorder = GradRecorder()
    order: list = []
    sequence: list = []
    held: list = [None]

    class Order(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            session = trainer.strategy.schedule_session
            order[:] = [str(t) for t in getattr(session, "last_order", [])]
            sequence[:] = list(getattr(session, "last_sequence", []))
            held[:] = [getattr(session, "last_peak_held", None)]

    result = fit_gpt(world_size, steps=steps, callbacks=[recorder, Order(), *(callbacks or [])], **strategy)
    result["grads"] = recorder.grads
    result["order"] = list(order)
    result["sequence"] = list(sequence)  # dpp/zb-h1: tasks and weight gradients as run in the last step
    result["peak_held"] = held[0]  # dpp/zb-h1: activations held + weight gradients pending, at most
    return result


def fit_recording_with_allowance(
    world_size: int, fraction: float, callbacks: Optional[list] = None, **strategy: Any
) -> dict[str, Any]:
    """``fit_recording`` under a byte budget (``weight_grad_memory`` a number) whose allowance, which CPUs cannot
    measure, is set from step 1 on to ``fraction`` of the largest weight-gradient stash step 0 saw."""

    class Allowance(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            session = trainer.strategy.schedule_session
            if session is not None:
                session.weight_grad_bytes = int(fraction * session.last_weight_grad_bytes)

    return fit_recording(world_size, callbacks=[Allowance(), *(callbacks or [])], **strategy)


class _Experiments(pl.Callback):
    """At the start of training, run one step's forward and backward under each (policy, delay seed) with a fresh
    dpp session each, and record its loss and gradients; the reference is the static policy without delays."""

    def __init__(self, runs: list[dict[str, Any]]) -> None:
        self.runs = runs
        self.results: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        strategy = trainer.strategy
        batch = next(iter(trainer.datamodule.train_dataloader()))
        batch = strategy.batch_to_device(batch)
        for run in self.runs:
            with strategy.using_schedule("dpp", run) as session:
                out = strategy.forward_backward(batch)
                self.results.append(
                    {
                        "run": run,
                        "loss": float(out.loss),
                        "grads": _main_grads(strategy),
                        "order": [str(t) for t in session.last_order],
                        "peak": session.last_peak,
                    }
                )
        trainer.should_stop = True


def policies_under_delays(world_size: int, runs: list[dict[str, Any]], **strategy: Any) -> list[dict[str, Any]]:
    experiments = _Experiments(runs)
    fit_gpt(world_size, steps=1, callbacks=[experiments], schedule="dpp", **strategy)
    return experiments.results


def killed_peer(world_size: int, **strategy: Any) -> Optional[dict[str, Any]]:
    """Rank 1 dies in the middle of the second step; the others must raise PeerLost naming it."""
    import torch.distributed as dist

    class Die(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1 and dist.get_rank() == 1:
                os._exit(3)

    try:
        fit_gpt(world_size, steps=3, callbacks=[Die()], schedule="dpp", **strategy)
    except Exception as err:  # noqa: BLE001
        chain, e = [], err
        while e is not None:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        return {"error": " <- ".join(chain)}
    return {"error": None}


def llama_model() -> dict[str, Any]:
    """A Llama-shaped tiny model (GQA, SwiGLU, RoPE, RMSNorm, no biases): a layout the schedule was not written for."""
    return dict(
        num_query_groups=2,
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
    )


def traced(trace_dir: str, **strategy: Any) -> dict[str, Any]:
    """A dpp fit under MegaScan (every step traced); the order of the last step shows whether it reordered."""
    from lightning_megatron.scan import MegaScan

    scan = MegaScan(trace_dir, interval=1, window=1, detect=False)
    return fit_recording(2, steps=3, callbacks=[scan], **strategy)


class _FusedLayers(pl.Callback):
    """How many linear layers ``gradient_accumulation_fusion`` gave the project's backward, seen during the fit."""

    def __init__(self) -> None:
        self.count: Optional[int] = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        fused = trainer.strategy.tp_layers.split_linears
        self.count = None if fused is None else len(fused.modules)


def fit_fused_layers(world_size: int, **strategy: Any) -> dict[str, Any]:
    """``fit_recording`` plus the number of linear layers that ran the project's weight-gradient path."""
    counter = _FusedLayers()
    result = fit_recording(world_size, callbacks=[counter], **strategy)
    result["fused_layers"] = counter.count
    return result
