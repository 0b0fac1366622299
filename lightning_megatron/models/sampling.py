"""``lightning-megatron sample``: text from a checkpoint, to see what a run has learned.

    lightning-megatron sample runs/gpt-tiny-cpu/checkpoints/last.ckpt --prompt "And God said" --max-new-tokens 48

The checkpoint's ``config.yaml`` (written by ``lightning-megatron fit``) says which model to build and which
tokenizer the data used. The model is loaded in one process (checkpoints load at any parallel layout, so a
model trained at TP2×PP2 samples here at TP1×PP1) and continues all prompts in one batch with
``GPTModule.generate`` (prompts may have different lengths).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional

__all__ = ["main", "run", "sample_from_checkpoint"]


def sample_from_checkpoint(
    checkpoint: str,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 48,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    seed: int = 0,
    tokenizer: Optional[str] = None,
) -> list[str]:
    """Continue the prompts (one batch) with the model of ``checkpoint``; returns prompt + continuation texts."""
    from lightning_megatron.models.loading import load_model

    loaded = load_model(checkpoint, tokenizer=tokenizer)  # shards load at any layout: one process here
    model, tok = loaded.module, loaded.tokenizer
    generation = model.generate(
        [tok.encode(prompt) for prompt in prompts],
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    return [tok.decode(row) for row in generation.tokens]


def run(args: argparse.Namespace) -> None:
    """Run ``lightning-megatron sample`` with the parsed arguments: print each continuation after ``--- ``."""
    texts = sample_from_checkpoint(
        args.checkpoint,
        args.prompt or ["And"],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    for text in texts:
        print(f"--- {text}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``lightning-megatron sample`` (its arguments: :mod:`lightning_megatron.cli_commands`)."""
    from lightning_megatron.cli_commands import parse

    run(parse("sample", argv))
