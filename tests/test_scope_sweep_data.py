"""The data a perturbation sweep validates on: each data-parallel rank's own share of the validation batches,
whole. ``scope sweep`` reads the run's validation loader (already split over the data-parallel ranks) and replays
those batches for every cell; Lightning would give a plain loader of them a ``DistributedSampler`` and split them a
second time (real gloo ranks)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from scope_cases import LLAMA_STYLE, batch_of, build

from lightning_megatron.scope.sweep import rank_batches

BATCHES = 4


def validated_batches(world: int) -> list[int]:
    """The indices of the batches this rank validated, of ``BATCHES`` given to it."""
    trainer, module = build(world, LLAMA_STYLE)
    rank = trainer.global_rank
    given = [batch_of(torch.full((4, 12), 10 * rank + i)) for i in range(BATCHES)]
    seen: list[int] = []

    class Seen(pl.Callback):
        def on_validation_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int, *_: Any) -> None:
            seen.append(int(batch["tokens"][0, 0]) - 10 * rank)

    trainer.callbacks.append(Seen())
    trainer.validate(module, rank_batches(given), verbose=False)
    return seen


def test_every_rank_validates_all_of_its_own_batches(ranks: Any) -> None:
    assert ranks.run(2, validated_batches, 2) == [list(range(BATCHES))] * 2
