"""Synthetic token sequences with learnable structure, for tests and smoke runs without data files.

Each sequence is a walk on a fixed random graph over the vocabulary: every token has ``branching``
possible successors, chosen uniformly. The best achievable loss is therefore ``ln(branching)`` nats
per token (versus ``ln(vocab_size)`` for a model that learned nothing), so a falling loss shows
learning, and every sample is a pure function of ``(seed, index)``.
"""

from __future__ import annotations

import math
from typing import Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_megatron.data.sampler import eval_sampler, train_sampler

__all__ = ["SyntheticTokens", "SyntheticTokenDataModule"]


class SyntheticTokens(Dataset):
    """``num_samples`` walks of ``seq_length + 1`` tokens on the graph drawn from ``graph_seed``."""

    def __init__(
        self, num_samples: int, *, vocab_size: int, seq_length: int, branching: int, graph_seed: int, walk_seed: int
    ) -> None:
        successors = torch.randint(
            vocab_size, (vocab_size, branching), generator=torch.Generator().manual_seed(graph_seed)
        )
        generator = torch.Generator().manual_seed(walk_seed)
        walk = torch.empty(num_samples, seq_length + 1, dtype=torch.long)
        walk[:, 0] = torch.randint(vocab_size, (num_samples,), generator=generator)
        choices = torch.randint(branching, (num_samples, seq_length), generator=generator)
        for t in range(seq_length):
            walk[:, t + 1] = successors[walk[:, t], choices[:, t]]
        self.walk = walk
        self.entropy = math.log(branching)

    def __len__(self) -> int:
        return self.walk.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        seq = self.walk[index]
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(seq.numel() - 1)}


class SyntheticTokenDataModule(pl.LightningDataModule):
    """Random-walk token data (see the module docstring), batched by *global* batch size.

    Args:
        global_batch_size: Samples per optimizer step across all data-parallel ranks; each rank's
            DataLoader yields ``global_batch_size / data-parallel size`` of them per batch.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_length: int = 64,
        global_batch_size: int = 8,
        num_train_samples: int = 4096,
        num_val_samples: int = 256,
        branching: int = 4,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[SyntheticTokens] = None
        self.val_set: Optional[SyntheticTokens] = None

    @override
    def setup(self, stage: str) -> None:
        hp = self.hparams
        common = dict(vocab_size=hp.vocab_size, seq_length=hp.seq_length, branching=hp.branching, graph_seed=hp.seed)
        if self.train_set is None:
            self.train_set = SyntheticTokens(hp.num_train_samples, walk_seed=hp.seed + 1, **common)
            # Same graph, other walks: held-out sequences of the same language.
            self.val_set = SyntheticTokens(hp.num_val_samples, walk_seed=hp.seed + 2, **common)

    def _loader(self, dataset: SyntheticTokens, sampler: torch.utils.data.Sampler) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=sampler.local_batch_size,  # type: ignore[attr-defined]
            sampler=sampler,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        sampler = train_sampler(
            self.trainer, len(self.train_set), global_batch_size=self.hparams.global_batch_size, seed=self.hparams.seed
        )
        return self._loader(self.train_set, sampler)

    @override
    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(
            self.val_set,
            eval_sampler(self.trainer, len(self.val_set), global_batch_size=self.hparams.global_batch_size),
        )

    test_dataloader = val_dataloader
