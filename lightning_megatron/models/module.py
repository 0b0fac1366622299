"""The LightningModule contract of ``MegatronAppStrategy``.

A module builds the model chunks of its own pipeline stage and says how one microbatch goes through a
chunk; the strategy does the rest (microbatches, schedule, gradient sync, optimizer, checkpoints)::

    class MyModel(MegatronLightningModule):
        def build_chunk(self, stage):            # stage.pre_process / post_process / vp_stage
            return GPTModel(config, spec, ..., pre_process=stage.pre_process, ...)

        def forward_step(self, batch, chunk):    # one microbatch through one chunk
            output = chunk(batch["tokens"], ...)
            return output, lambda out: ((out * batch["loss_mask"]).sum(), batch["loss_mask"].sum())

``forward_step`` returns the chunk's output and a loss function. On the last stage the loss function
receives that output and returns ``(loss_sum, num_tokens)``; elsewhere the output is the activation the
next stage receives. ``training_step``/``validation_step``/``test_step`` are provided and log the exact,
global ``train_loss``/``val_loss``/``test_loss`` on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_megatron.strategy.parallel import ParallelContext, StageSpec
from lightning_megatron.strategy.step import LossFn, StepOutput

if TYPE_CHECKING:
    from lightning_megatron.strategy.strategy import MegatronAppStrategy

__all__ = ["MegatronLightningModule"]


class MegatronLightningModule(pl.LightningModule):
    model_chunks: torch.nn.ModuleList
    """One entry per virtual pipeline stage of this rank (a single entry without virtual stages), set by
    ``configure_model``. (Annotation only: a class-level default would shadow the registered submodule.)"""

    graph_safe_forward_step: bool = False
    """Set ``True`` in the class that defines ``forward_step`` when the step only queues GPU work (no ``.item()``,
    no host copies, no per-call Python side effects): on one GPU the strategy then replays the training step as
    a CUDA graph by default (``MegatronAppStrategy(cuda_graphs=None)``). A subclass overriding ``forward_step``
    makes its own promise; ``cuda_graphs=True`` captures without one."""

    # -- what subclasses implement --------------------------------------------------------------
    def build_chunk(self, stage: StageSpec) -> torch.nn.Module:
        """Build the model chunk of ``stage`` (a megatron-core module with ``set_input_tensor``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_chunk(stage) or configure_model().")

    def forward_step(self, batch: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, LossFn]:
        """Run one microbatch through ``chunk``; return ``(output, loss_fn)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_step(batch, chunk).")

    # -- provided -------------------------------------------------------------------------------
    @property
    def megatron(self) -> MegatronAppStrategy:
        from lightning_megatron.strategy.strategy import MegatronAppStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, MegatronAppStrategy):
            raise TypeError(
                f"{type(self).__name__} trains with MegatronAppStrategy: pass Trainer(strategy=MegatronAppStrategy(...)) "
                f"or `strategy: megatron` in YAML (got {type(strategy).__name__})."
            )
        return strategy

    @property
    def parallel(self) -> ParallelContext:
        """This rank's parallel layout, ranks and stages (available from ``configure_model`` on)."""
        return self.megatron.parallel

    @override
    def configure_model(self) -> None:
        if getattr(self, "model_chunks", None) is not None:
            return  # Lightning calls this hook once per fit/validate/test; build once.
        self.model_chunks = torch.nn.ModuleList(self.build_chunk(stage) for stage in self.parallel.stages())

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.megatron.forward_backward(batch)
        self.log("train_loss", out.loss, prog_bar=True, batch_size=1)
        return out.loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._accumulate_eval(self.megatron.forward_backward(batch, forward_only=True))

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._accumulate_eval(self.megatron.forward_backward(batch, forward_only=True))

    @override
    def on_validation_epoch_start(self) -> None:
        self._eval_totals = torch.zeros(2, device=self.device)

    on_test_epoch_start = on_validation_epoch_start

    @override
    def on_validation_epoch_end(self) -> None:
        # Already global on every rank; sync_dist averages identical values (Lightning expects it at epoch level).
        self.log("val_loss", self._eval_loss(), prog_bar=True, sync_dist=True)

    @override
    def on_test_epoch_end(self) -> None:
        self.log("test_loss", self._eval_loss(), sync_dist=True)

    def _accumulate_eval(self, out: StepOutput) -> None:
        self._eval_totals += torch.stack([out.loss_sum, out.num_tokens]).to(self._eval_totals.device)

    def _eval_loss(self) -> torch.Tensor:
        """Token-weighted loss over the whole evaluation epoch (not a mean of per-batch means)."""
        loss_sum, tokens = self._eval_totals
        return loss_sum / tokens.clamp(min=1.0)
