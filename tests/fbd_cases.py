"""Functions that run inside forked ranks for ``test_fbd.py``: MegaFBD's rank split against megatron-core's 1F1B."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from dpp_cases import fit_recording


def fit_with_model(world_size: int, callbacks: Any = (), **strategy: Any) -> dict[str, Any]:
    """``fit_recording`` plus the fbd session's performance model (made after the third step) and roles."""
    seen: dict[str, Any] = {}

    class Model(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            session = trainer.strategy.schedule_session
            seen["prediction"] = session.prediction
            seen["parts"] = session.parts
            seen["forward"] = session.roles.is_forward

    result = fit_recording(world_size, callbacks=[Model(), *callbacks], **strategy)
    result.update(seen)
    return result


def traced(trace_dir: str, world_size: int, **strategy: Any) -> dict[str, Any]:
    """An fbd fit under MegaScan (every step traced)."""
    from lightning_megatron.scan import MegaScan

    scan = MegaScan(trace_dir, interval=1, window=1, detect=False)
    return fit_with_model(world_size, steps=3, callbacks=[scan], **strategy)
