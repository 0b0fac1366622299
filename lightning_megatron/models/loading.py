"""A trained model at any parallel layout, ready to generate or evaluate: from a run's checkpoint or a
Hugging Face directory.

Contract: ``prepare(module, devices=..., **layout)`` builds a module's chunks at a layout without training
(its own initialization, or a checkpoint's weights with ``ckpt_path``) and returns the Trainer that holds them;
``load_model(checkpoint=..., hf=..., devices=..., **layout)`` returns ``Loaded(trainer, module, tokenizer,
config)`` on every rank the Trainer runs (Lightning launches the other ranks itself when
``devices > 1``, as for ``fit``). A checkpoint written by ``lightning-megatron fit`` carries its
``config.yaml``: which model class to build (``model.class_path`` / ``init_args``), the tokenizer of its
data and the precision; its shards load at any layout through the strategy (a one-batch validation).
``hf`` is a local Hugging Face GPT-2, Llama or Mixtral directory (``config.json``, safetensors, tokenizer files).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import yaml
from torch.utils.data import DataLoader

from lightning_megatron.errors import MegatronConfigError

__all__ = ["Loaded", "class_from_config", "load_model", "model_from_config", "prepare"]


@dataclass
class Loaded:
    trainer: pl.Trainer
    module: Any
    tokenizer: Any
    config: dict[str, Any]
    """The run's resolved configuration (``config.yaml``); empty for Hugging Face directories."""


def class_from_config(section: dict[str, Any], package: Any) -> type:
    """The class of a LightningCLI section (``class_path``: dotted, or a short name in ``package``)."""
    class_path = section["class_path"]
    if "." in class_path:
        module_name, name = class_path.rsplit(".", 1)
        return getattr(importlib.import_module(module_name), name)
    return getattr(package, class_path)


def model_from_config(section: dict[str, Any]) -> pl.LightningModule:
    """The LightningModule a ``model: {class_path, init_args}`` section describes (must be able to generate)."""
    from lightning_megatron import models

    class_path = section["class_path"]
    cls = class_from_config(section, models)
    if not (isinstance(cls, type) and issubclass(cls, models.MegatronLightningModule) and hasattr(cls, "generate")):
        raise MegatronConfigError(f"{class_path} is not a MegatronLightningModule that can generate text.")
    return cls(**section.get("init_args", {}))


def prepare(
    module: Any,
    *,
    devices: int = 1,
    accelerator: str = "auto",
    precision: str = "32-true",
    micro_batch_size: int = 1,
    ckpt_path: Optional[str] = None,
    strategy_options: Optional[dict[str, Any]] = None,
    **layout: Any,
) -> pl.Trainer:
    """Build ``module``'s chunks at ``layout`` (and load ``ckpt_path`` through the strategy, at any saved
    layout) with a one-batch validation; returns the Trainer. Every rank calls it."""
    from lightning_megatron import MegatronAppStrategy

    seq = module.hparams.seq_length
    # enough microbatches for the interleaved schedule (at least the pipeline size)
    batch = micro_batch_size * max(2, int(layout.get("pipeline_model_parallel_size", 1)))
    probe = {"tokens": torch.zeros(batch, seq, dtype=torch.long), "labels": torch.zeros(batch, seq, dtype=torch.long)}
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=MegatronAppStrategy(micro_batch_size=micro_batch_size, **layout, **(strategy_options or {})),
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.validate(module, DataLoader([probe], batch_size=None), ckpt_path=ckpt_path, verbose=False)
    return trainer


def load_model(
    checkpoint: Optional[str] = None,
    *,
    hf: Optional[str] = None,
    tokenizer: Optional[str] = None,
    devices: int = 1,
    accelerator: str = "auto",
    precision: Optional[str] = None,
    micro_batch_size: int = 1,
    model_overrides: Optional[dict[str, Any]] = None,
    **layout: Any,
) -> Loaded:
    """Build and load the model at ``layout`` (``MegatronAppStrategy`` arguments); see the module docstring."""
    from lightning_megatron.data.tokenizers import load_tokenizer

    if (checkpoint is None) == (hf is None):
        raise MegatronConfigError(
            "Give a checkpoint directory or --hf DIR (a Hugging Face model), not both or neither."
        )
    config: dict[str, Any] = {}
    if checkpoint is not None:
        config_file = Path(checkpoint) / "config.yaml"
        if not Path(checkpoint).exists():
            raise FileNotFoundError(
                f"checkpoint {checkpoint} does not exist; give a checkpoint directory written by "
                "`lightning-megatron fit` (e.g. runs/gpt-tiny-cpu/checkpoints/last.ckpt)."
            )
        if not config_file.is_file():
            raise MegatronConfigError(
                f"{checkpoint} has no config.yaml; use checkpoints written by `lightning-megatron fit`."
            )
        config = yaml.safe_load(config_file.read_text())
        tokenizer = tokenizer or config.get("data", {}).get("init_args", {}).get("tokenizer")
        if not tokenizer:
            raise MegatronConfigError("The run's data had no tokenizer; pass --tokenizer.")
        section = dict(config["model"])
        section["init_args"] = {**section.get("init_args", {}), **(model_overrides or {})}
        module = model_from_config(section)
        precision = precision or config.get("trainer", {}).get("precision", "32-true")
    else:
        from lightning_megatron.convert import hf_config_to_gpt_kwargs
        from lightning_megatron.models.gpt import GPTModule

        directory = Path(str(hf))
        if not (directory / "config.json").is_file():
            raise MegatronConfigError(f"--hf {hf}: not a Hugging Face model directory (no config.json).")
        kwargs = hf_config_to_gpt_kwargs(json.loads((directory / "config.json").read_text()))
        module = GPTModule(**kwargs, hf_checkpoint=str(directory), **(model_overrides or {}))
        tokenizer = tokenizer or str(directory)
        precision = precision or "32-true"
    tok = load_tokenizer(tokenizer)
    trainer = prepare(
        module,
        devices=devices,
        accelerator=accelerator,
        precision=precision,
        micro_batch_size=micro_batch_size,
        ckpt_path=checkpoint,
        **layout,
    )
    return Loaded(trainer, module, tok, config)
