"""Functions that run inside forked ranks (see ``distributed.py``): one Lightning run each."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from trainers import quiet_trainer

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.data import SyntheticTokenDataModule
from lightning_megatron.models import GPTModule

TINY_MODEL = dict(vocab_size=128, seq_length=16, num_layers=4, hidden_size=32, num_attention_heads=4)


class Recorder(pl.Callback):
    """Per-step train_loss and grad_norm as this rank logged them, and the validation losses."""

    def __init__(self) -> None:
        self.loss: list[float] = []
        self.grad_norm: list[float] = []
        self.lr: list[float] = []
        self.val_loss: list[float] = []
        self.moe_aux_loss: list[float] = []
        self.moe: dict[str, list[float]] = {}  # every logged moe/* metric, per step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        metrics = trainer.callback_metrics
        self.loss.append(float(metrics["train_loss"]))
        # No grad_norm on a step skipped for fp16 overflow (that step logs skipped_step instead).
        self.grad_norm.append(float(metrics["grad_norm"]) if "grad_norm" in metrics else float("nan"))
        self.lr.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        if "moe/load_balancing_loss" in metrics:
            self.moe_aux_loss.append(float(metrics["moe/load_balancing_loss"]))
        for name, value in metrics.items():
            if name.startswith("moe/"):
                self.moe.setdefault(name, []).append(float(value))

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        # (not on_validation_epoch_end: callbacks run before the module logs val_loss there)
        if not trainer.sanity_checking:
            self.val_loss.append(float(trainer.callback_metrics["val_loss"]))


def fit_gpt(
    world_size: int,
    *,
    steps: int = 4,
    precision: str = "32-true",
    model: Optional[dict[str, Any]] = None,
    data: Optional[dict[str, Any]] = None,
    trainer: Optional[dict[str, Any]] = None,
    ckpt_path: Optional[str] = None,
    callbacks: Optional[list] = None,
    module_cls: type = GPTModule,
    datamodule: Optional[pl.LightningDataModule] = None,
    probe: Optional[Any] = None,
    accelerator: str = "cpu",
    **strategy: Any,
) -> dict[str, Any]:
    strategy.setdefault("micro_batch_size", 2)
    strategy.setdefault("timeout", 60)
    recorder = Recorder()
    trainer_kwargs = dict(accelerator=accelerator, devices=world_size, precision=precision, max_steps=steps)
    trainer_kwargs.update(trainer or {})
    run = quiet_trainer(
        strategy=MegatronAppStrategy(**strategy), callbacks=[recorder, *(callbacks or [])], **trainer_kwargs
    )
    module = module_cls(**{**TINY_MODEL, "lr": 1e-2, **(model or {})})
    datamodule = datamodule or SyntheticTokenDataModule(
        **{
            "vocab_size": 128,
            "seq_length": 16,
            "global_batch_size": 8,
            "num_train_samples": 256,
            "num_val_samples": 32,
            **(data or {}),
        }
    )
    run.fit(module, datamodule, ckpt_path=ckpt_path)
    return {
        "loss": recorder.loss,
        "grad_norm": recorder.grad_norm,
        "lr": recorder.lr,
        "val_loss": recorder.val_loss,
        "moe_aux_loss": recorder.moe_aux_loss,
        "moe": recorder.moe,
        "global_step": run.global_step,
        "coordinates": run.strategy.parallel.coordinates,
        "params_dtype": str(next(module.parameters()).dtype),
        "probe": probe(module) if probe is not None else None,  # a look at the trained module, in the rank
    }
