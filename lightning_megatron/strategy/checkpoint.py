"""Sharded checkpoints: a directory every rank writes its part of, loadable at another parallel layout.

Layout of ``epoch=0-step=10.ckpt/``:

* megatron-core ``dist_checkpointing`` files (``*.distcp``, ``.metadata``, ``common.pt``,
  ``metadata.json``) holding the model and optimizer as global, layout-independent tensors;
* ``trainer_state.pt``: everything else Lightning saves (loops, callbacks, LR schedulers,
  hyperparameters), written once by global rank 0 after all shards are on disk, so its presence
  marks a complete checkpoint;
* ``config.yaml``: the resolved LightningCLI configuration, when the run was started from the CLI.

:func:`drop_unused_callback_states` trims a training checkpoint's callback states for loads that do not resume
a fit.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from megatron.core import dist_checkpointing
from typing_extensions import override

from lightning_megatron.compat.megatron import use_in_process_checkpoint_results

__all__ = [
    "DistCheckpointIO",
    "CONFIG_KEY",
    "SHARDED_KEYS",
    "drop_unused_callback_states",
    "load_sharded",
    "model_sharded_state_dict",
]

TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
CONFIG_KEY = "lightning_megatron_config"
"""Checkpoint entry (set by the CLI) whose text is written next to the shards as ``config.yaml``."""
SHARDED_KEYS = ("state_dict", "optimizer_states")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class DistCheckpointIO(CheckpointIO):
    """Saves and loads on **every** rank; the strategy supplies the sharded template for loading."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("DistCheckpointIO does not take storage_options.")
        path = Path(path)
        if _rank() == 0:
            self.remove_checkpoint(path)
            path.mkdir(parents=True)
        _barrier()
        sharded = {key: checkpoint[key] for key in SHARDED_KEYS if key in checkpoint}
        use_in_process_checkpoint_results()
        dist_checkpointing.save(sharded, str(path))
        if _rank() == 0:
            rest = {k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS and k != CONFIG_KEY}
            if CONFIG_KEY in checkpoint:
                (path / CONFIG_FILE).write_text(checkpoint[CONFIG_KEY])
            tmp = path / (TRAINER_STATE + ".tmp")
            torch.save(rest, tmp)
            tmp.rename(path / TRAINER_STATE)

    @override
    def load_checkpoint(
        self,
        path: Any,
        map_location: Optional[Any] = None,
        weights_only: Optional[bool] = None,
        *,
        sharded_state_dict: Optional[dict[str, Any]] = None,
    ) -> dict[str, Any]:
        path = Path(path)
        state_file = path / TRAINER_STATE
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist.")
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} is not a MegatronAppStrategy checkpoint (a directory written by every rank)."
            )
        if not state_file.is_file():
            raise FileNotFoundError(
                f"{path} is incomplete: {TRAINER_STATE} is missing, so the save did not finish. Resume from an "
                "earlier checkpoint."
            )
        checkpoint = torch.load(state_file, map_location="cpu", weights_only=bool(weights_only))
        if sharded_state_dict:
            checkpoint.update(dist_checkpointing.load(sharded_state_dict, str(path)))
        return checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        path = Path(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def model_sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """The model's part of a checkpoint: every chunk's megatron-core sharded state dict, ``chunk{i}``."""
    return {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def load_sharded(
    io: CheckpointIO,
    path: Any,
    chunks: Sequence[torch.nn.Module],
    optimizer: Optional[Any],
    *,
    fitting: bool,
    callbacks: Sequence[Any],
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Lightning's ``load_checkpoint`` for the strategy: megatron-core's loader fills a template of this layout's
    sharded state dicts (the model's, and the optimizer's when ``fitting`` with one: a strategy optimizer's
    ``sharded_state_dict``), so a checkpoint saved at another layout loads here; a load that does not resume a
    fit drops the callback states nobody reads (:func:`drop_unused_callback_states`)."""
    template: dict[str, Any] = {"state_dict": model_sharded_state_dict(chunks)}
    if optimizer is not None and fitting:
        template["optimizer_states"] = [optimizer.sharded_state_dict(template["state_dict"], is_loading=True)]
    if isinstance(io, DistCheckpointIO):
        checkpoint = io.load_checkpoint(path, weights_only=weights_only, sharded_state_dict=template)
    else:
        checkpoint = io.load_checkpoint(path, weights_only=weights_only)
    if not fitting:
        drop_unused_callback_states(checkpoint, callbacks)
    return checkpoint


def drop_unused_callback_states(checkpoint: dict[str, Any], callbacks: Sequence[Any]) -> None:
    """Evaluating or generating from a training checkpoint needs none of the run's callbacks.

    Lightning hands each callback of this Trainer its saved state and warns about saved states without a
    callback ("callbacks used to create the checkpoint need to be provided"), advice that is right for
    resuming a fit and wrong for a validation or for loading weights to generate (``lightning-megatron
    sample``). States no callback here would read are dropped; the others are restored as before.
    """
    states = checkpoint.get("callbacks")
    if isinstance(states, dict):
        present = {callback.state_key for callback in callbacks}
        checkpoint["callbacks"] = {key: state for key, state in states.items() if key in present}
