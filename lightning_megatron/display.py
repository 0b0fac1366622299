"""What a run shows while it trains: a progress bar that counts steps, and a one-line summary of the layout.

Lightning's defaults assume one model on one device and epoch-based training. Under ``MegatronAppStrategy``
they mislead: the model summary tables rank 0's pipeline stage only (a fraction of the model) with
``Total FLOPs: 0``, and step-based training (``max_steps``, ``max_epochs`` unset, which Lightning stores
as -1) shows ``Epoch 0/-2`` next to the logger's version as a float (``v_num: 1.000``).

* :func:`step_progress_bar` is Lightning's progress bar (rich when installed, else tqdm) that shows the
  optimizer step and the logged ``train_loss`` / ``val_loss`` (global values, identical on every rank: see
  ``strategy.step``), without ``v_num`` and without the nonsensical epoch count.
* :class:`LayoutSummary` prints ``GPTModule: 819 K parameters, TP 2 × PP 2 × DP 1 on 4 processes; per rank:
  stage 0 216 K, stage 1 230 K`` once, from rank 0, at the start of a fit.

``lightning-megatron fit`` installs both unless the configuration names its own progress bar or model summary;
Python users pass them in ``Trainer(callbacks=[...])``. One private Lightning method is overridden here:
``RichProgressBar._get_train_description`` (the only place the rich bar composes ``Epoch N/M``); if a
Lightning release renames it, the bar shows Lightning's own description again and nothing else changes.
"""

from __future__ import annotations

from typing import Any, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

__all__ = ["LayoutSummary", "step_progress_bar"]

_RICH = RequirementCache("rich>=10.2.2")  # what Lightning's RichProgressBar requires

_Metrics = dict[str, Union[int, str, float, dict[str, float]]]


def _step_metrics(trainer: pl.Trainer, metrics: _Metrics) -> _Metrics:
    """The optimizer step first, then the logged progress-bar metrics; no ``v_num`` (the logger's version)."""
    metrics = {k: v for k, v in metrics.items() if k != "v_num"}
    return {"step": str(trainer.global_step), **metrics}  # a string: the rich bar prints numbers as 1.000


class _RichStepProgressBar(RichProgressBar):
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> _Metrics:
        return _step_metrics(trainer, super().get_metrics(trainer, pl_module))

    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning appends "/{max_epochs - 1}" even when max_epochs is -1 (step-based training): "Epoch 0/-2".
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        width = len(self.validation_description)  # as Lightning: pad so that the bars do not shift
        return f"{description:{width}}" if width > len(description) else description


class _TQDMStepProgressBar(TQDMProgressBar):
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> _Metrics:
        return _step_metrics(trainer, super().get_metrics(trainer, pl_module))


def step_progress_bar() -> ProgressBar:
    """Lightning's default progress bar (rich when installed, else tqdm), showing the step and the losses."""
    return _RichStepProgressBar() if _RICH else _TQDMStepProgressBar()


def _human(count: int) -> str:
    return get_human_readable_count(count).strip()  # "216 K", "1.2 M", as Lightning's summary


def _count(pl_module: pl.LightningModule, parallel: Any) -> tuple[int, int]:
    """Parameters this rank holds, and its share of the model's distinct parameters.

    Distinct: parameters split across tensor-parallel ranks (megatron-core marks them ``tensor_model_parallel``)
    count on every tensor-parallel rank, replicated ones (norms, some biases) on tensor-parallel rank 0 only;
    the last stage's copy of tied embeddings (``shared_embedding`` on a chunk without the embedding) not at
    all; data-parallel replicas only once.
    """
    held = distinct = 0
    for chunk, stage in zip(pl_module.model_chunks, parallel.stages()):
        for param in chunk.parameters():
            held += param.numel()
            embedding_copy = getattr(param, "shared_embedding", False) and not stage.pre_process
            replicated = not getattr(param, "tensor_model_parallel", False)
            if embedding_copy or (replicated and parallel.tensor_rank != 0) or parallel.data_parallel_rank != 0:
                continue
            distinct += param.numel()
    return held, distinct


class LayoutSummary(Callback):
    """One line at the start of a fit: parameters in total and per pipeline stage, and the parallel layout.

    Replaces Lightning's ``ModelSummary`` (a table of rank 0's modules: under pipeline parallelism part of the
    model, with ``Total FLOPs: 0`` since no example input runs). Every rank counts its own parameters and one
    all-reduce brings the counts to rank 0.
    """

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_megatron.strategy.strategy import MegatronAppStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, MegatronAppStrategy) or not hasattr(pl_module, "model_chunks"):
            return
        parallel = strategy.parallel
        held, distinct = _count(pl_module, parallel)
        world, rank = trainer.world_size, trainer.global_rank
        table = torch.zeros(world, 3, dtype=torch.int64, device=strategy.root_device)
        table[rank] = torch.tensor([parallel.pipeline_rank, held, distinct])
        if dist.is_available() and dist.is_initialized() and world > 1:
            dist.all_reduce(table)
        if trainer.is_global_zero:
            rank_zero_info(self.describe(type(pl_module).__name__, strategy.layout, world, table.tolist()))

    @staticmethod
    def describe(name: str, layout: Any, world: int, table: list[list[int]]) -> str:
        """``table``: one ``[pipeline_rank, held, distinct]`` row per global rank."""
        total = sum(row[2] for row in table)
        parts = [f"TP {layout.tensor}", f"PP {layout.pipeline}"]
        if layout.virtual_pipeline:
            parts.append(f"VPP {layout.virtual_pipeline}")
        parts.append(f"DP {world // (layout.tensor * layout.pipeline)}")
        shape = " × ".join(parts) + (" (sequence parallel)" if layout.sequence_parallel else "")
        stages = []
        for stage in range(layout.pipeline):
            counts = sorted({row[1] for row in table if row[0] == stage})
            span = _human(counts[0]) if len(counts) == 1 else f"{_human(counts[0])}–{_human(counts[-1])}"
            stages.append(f"stage {stage} {span}" if layout.pipeline > 1 else span)
        processes = "process" if world == 1 else "processes"
        return f"{name}: {_human(total)} parameters, {shape} on {world} {processes}; per rank: {', '.join(stages)}"
