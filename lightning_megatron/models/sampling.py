"""``lightning-megatron sample``: text from a checkpoint, to see what a run has learned.

    lightning-megatron sample runs/gpt-tiny-cpu/checkpoints/last.ckpt --prompt "And God said" --max-new-tokens 48

The checkpoint's ``config.yaml`` (written by ``lightning-megatron fit``) says which model to build and which
tokenizer the data used. The model is loaded in one process (checkpoints load at any parallel layout, so a
model trained at TP2×PP2 samples here at TP1×PP1) and continues each prompt with ``GPTModule.generate``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import yaml
from torch.utils.data import DataLoader

from lightning_megatron.errors import MegatronConfigError

__all__ = ["main", "sample_from_checkpoint"]


def _model_from_config(section: dict[str, Any]) -> pl.LightningModule:
    from lightning_megatron import models

    class_path = section["class_path"]
    if "." in class_path:
        module_name, name = class_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), name)
    else:
        cls = getattr(models, class_path)
    if not (isinstance(cls, type) and issubclass(cls, models.MegatronLightningModule) and hasattr(cls, "generate")):
        raise MegatronConfigError(f"{class_path} is not a MegatronLightningModule that can generate text.")
    return cls(**section.get("init_args", {}))


def sample_from_checkpoint(
    checkpoint: str,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 48,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    seed: int = 0,
    tokenizer: Optional[str] = None,
) -> list[str]:
    """Continue each prompt with the model of ``checkpoint``; returns prompt + continuation texts."""
    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data.tokenizers import load_tokenizer

    config_file = Path(checkpoint) / "config.yaml"
    if not config_file.is_file():
        raise MegatronConfigError(
            f"{checkpoint} has no config.yaml; sample from checkpoints written by `lightning-megatron fit`."
        )
    config = yaml.safe_load(config_file.read_text())
    tokenizer = tokenizer or config.get("data", {}).get("init_args", {}).get("tokenizer")
    if not tokenizer:
        raise MegatronConfigError("The run's data had no tokenizer; pass --tokenizer.")
    tok = load_tokenizer(tokenizer)
    model = _model_from_config(config["model"])
    seq = model.hparams.seq_length
    # Weights are restored through the strategy (any saved layout -> this one) by a one-batch validation.
    probe = {"tokens": torch.zeros(1, seq, dtype=torch.long), "labels": torch.zeros(1, seq, dtype=torch.long)}
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        strategy=MegatronAppStrategy(micro_batch_size=1),
        precision=config.get("trainer", {}).get("precision", "32-true"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(model, DataLoader([probe], batch_size=None), ckpt_path=checkpoint, verbose=False)
    texts = []
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([tok.encode(prompt)], dtype=torch.long, device=trainer.strategy.root_device)
        out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed + index)
        texts.append(tok.decode(out[0].tolist()))
    return texts


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-megatron sample", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory written by `lightning-megatron fit`")
    parser.add_argument("--prompt", action="append", help="text to continue (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="override the tokenizer recorded in the run's config")
    args = parser.parse_args(argv)
    texts = sample_from_checkpoint(
        args.checkpoint,
        args.prompt or ["And"],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    for text in texts:
        print(f"--- {text}")
