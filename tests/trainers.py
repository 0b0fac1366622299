"""One Trainer for the tests: ``quiet_trainer(...)``.

The tests' fits want Lightning's loop and nothing it writes or prints of its own: no logger, no checkpoints, no
progress bar or model summary, and no validation unless a test asks for it (``limit_val_batches``). Keyword
arguments override any of these and pass anything else to ``pl.Trainer``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["quiet_trainer"]

QUIET: dict[str, Any] = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    num_sanity_val_steps=0,
)


def quiet_trainer(*, accelerator: str = "cpu", devices: int = 1, **kwargs: Any) -> pl.Trainer:
    """``pl.Trainer(accelerator=..., devices=..., **QUIET, **kwargs)``; ``kwargs`` win over :data:`QUIET`."""
    return pl.Trainer(accelerator=accelerator, devices=devices, **{**QUIET, **kwargs})
