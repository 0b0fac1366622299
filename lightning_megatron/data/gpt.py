"""Real training data: megatron-core's GPT datasets over indexed (``.bin``/``.idx``) corpora.

Corpora are prepared once with ``lightning-megatron preprocess`` (jsonl → tokens). megatron-core then
does what it does well (blending several corpora by weight, the train/valid/test split, packing documents
into fixed-length samples, shuffling, caching the index), and this module batches the samples by global
batch size with the strategy's data-parallel rank, resuming at the right sample after a restore.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import lightning.pytorch as pl
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_megatron.data.sampler import eval_sampler, train_sampler
from lightning_megatron.errors import MegatronConfigError

__all__ = ["GPTDataModule"]


class _TokenizerView:
    """What megatron-core's GPT dataset reads from a tokenizer: the vocabulary size, the end-of-document id,
    and identifiers for its index cache."""

    def __init__(self, path: str) -> None:
        from lightning_megatron.data.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(path)
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod_id
        self.unique_identifiers = {"path": str(Path(path).resolve()), "vocab_size": self.vocab_size, "eod": self.eod}


class GPTDataModule(pl.LightningDataModule):
    """Blended, split, packed GPT samples from indexed corpora.

    Args:
        data_path: An indexed-dataset prefix (``data/corpus`` for ``data/corpus.bin``/``.idx``), a list of
            prefixes (equal weights), or Megatron's blend list ``["0.7", "data/a", "0.3", "data/b"]``.
        tokenizer: The tokenizer the corpus was preprocessed with (a file or directory, see
            ``lightning_megatron.data.tokenizers``); its vocabulary size must fit the model's.
        seq_length: Tokens per sample (the model's sequence length).
        global_batch_size: Samples per optimizer step across all data-parallel ranks.
        split: Train/valid/test proportions of the documents, Megatron style (``"969,30,1"``).
        cache_dir: Where megatron-core keeps its sample index (default: next to the data).
        eod_mask_loss, reset_position_ids, reset_attention_mask: Megatron's document-boundary options.
    """

    def __init__(
        self,
        data_path: Union[str, list[str]],
        tokenizer: str,
        seq_length: int = 1024,
        global_batch_size: int = 8,
        split: str = "969,30,1",
        seed: int = 1234,
        num_workers: int = 2,
        cache_dir: Optional[str] = None,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.datasets: dict[str, Optional[Dataset]] = {}

    def _config(self) -> GPTDatasetConfig:
        hp = self.hparams
        paths = [hp.data_path] if isinstance(hp.data_path, str) else list(hp.data_path)
        for prefix in paths[1::2] if len(paths) > 1 and _is_number(paths[0]) else paths:
            if not Path(f"{prefix}.bin").is_file() or not Path(f"{prefix}.idx").is_file():
                raise MegatronConfigError(
                    f"data_path entry {prefix!r} has no {prefix}.bin/{prefix}.idx. Make them with "
                    f"`lightning-megatron preprocess --input corpus.jsonl --output-prefix {prefix} --tokenizer ...`."
                )
        return GPTDatasetConfig(
            random_seed=hp.seed,
            sequence_length=hp.seq_length,
            blend=get_blend_from_list(paths),
            split=hp.split,
            tokenizer=_TokenizerView(hp.tokenizer),
            reset_position_ids=hp.reset_position_ids,
            reset_attention_mask=hp.reset_attention_mask,
            eod_mask_loss=hp.eod_mask_loss,
            create_attention_mask=False,  # causal attention needs no mask tensor
            path_to_cache=hp.cache_dir,
        )

    @override
    def setup(self, stage: str) -> None:
        if self.datasets:
            return
        max_steps = getattr(self.trainer, "max_steps", -1) if self.trainer is not None else -1
        # Megatron sizes the training set by the run (steps × global batch); evaluation sets are one epoch.
        train_samples = max_steps * self.hparams.global_batch_size if max_steps and max_steps > 0 else None
        builder = BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, None, None], lambda: True, self._config())
        train, valid, test = builder.build()
        self.datasets = {"train": train, "valid": valid, "test": test}

    def _loader(self, split: str, training: bool) -> DataLoader:
        dataset = self.datasets.get(split)
        if dataset is None or len(dataset) == 0:
            raise MegatronConfigError(
                f"The {split} split is empty; give it a share of the documents with `split` (now {self.hparams.split!r})."
            )
        gbs = self.hparams.global_batch_size
        if training:
            # megatron-core has shuffled the samples already; the sampler only positions and shards them.
            sampler = train_sampler(
                self.trainer, len(dataset), global_batch_size=gbs, seed=self.hparams.seed, shuffle=False
            )
        else:
            sampler = eval_sampler(self.trainer, len(dataset), global_batch_size=gbs)
        return DataLoader(
            dataset,
            batch_size=sampler.local_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", training=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("valid", training=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test", training=False)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
