"""Real data: the King James Bible corpus shipped in the repo, preprocessed into megatron-core's indexed
format, batched by ``GPTDataModule`` with the strategy's data-parallel rank and resumed at the right sample."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path
from typing import Any

import pytest
from cases import fit_gpt
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatron import MegatronConfigError
from lightning_megatron.data.gpt import GPTDataModule
from lightning_megatron.data.preprocess import preprocess_jsonl
from lightning_megatron.data.tokenizers import load_tokenizer

CORPUS = Path(__file__).resolve().parents[1] / "recipes" / "data" / "kjv.jsonl.gz"
SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The first 120 chapters, tokenized with a 600-token BPE trained on them."""
    root = tmp_path_factory.mktemp("kjv")
    subset = root / "kjv-subset.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as source:
        subset.write_text("".join(itertools.islice(source, 120)), encoding="utf-8")
    prefix = str(root / "kjv")
    preprocess_jsonl(str(subset), prefix, "train:600", append_eod=True, quiet=True)
    tokenizer = f"{prefix}-tokenizer.json"
    vocab = load_tokenizer(tokenizer).vocab_size
    return {"prefix": prefix, "tokenizer": tokenizer, "vocab": vocab, "cache": str(root / "cache")}


def fit_on_corpus(world_size: int, corpus: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    data = GPTDataModule(
        data_path=corpus["prefix"],
        tokenizer=corpus["tokenizer"],
        seq_length=SEQ,
        global_batch_size=8,
        split="90,10,0",
        num_workers=0,
        cache_dir=corpus["cache"],
    )
    model = {"vocab_size": corpus["vocab"], "seq_length": SEQ, "lr": 3e-3}
    return fit_gpt(world_size, model=model, datamodule=data, **kwargs)


def test_same_global_batches_at_any_data_parallel_size(ranks: Any, corpus: dict) -> None:
    single = ranks.run(1, fit_on_corpus, 1, corpus, steps=4)[0]
    for result in ranks.run(2, fit_on_corpus, 2, corpus, steps=4):  # DP2
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-5)
    for result in ranks.run(2, fit_on_corpus, 2, corpus, steps=4, tensor_model_parallel_size=2):
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-5)


def test_resume_reads_the_next_samples(ranks: Any, corpus: dict, tmp_path: Path) -> None:
    def run(resume: str | None = None) -> dict[str, Any]:
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
        return ranks.run(
            2,
            fit_on_corpus,
            2,
            corpus,
            steps=4,
            trainer={"enable_checkpointing": True},
            callbacks=[saver],
            ckpt_path=resume,
            pipeline_model_parallel_size=2,
        )[0]

    full = run()
    resumed = run(str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resumed["loss"] == pytest.approx(full["loss"][2:], rel=1e-5)


def test_validation_split_is_used(ranks: Any, corpus: dict) -> None:
    result = ranks.run(1, fit_on_corpus, 1, corpus, steps=2, trainer={"limit_val_batches": 2, "val_check_interval": 2})[
        0
    ]
    assert len(result["val_loss"]) == 1 and result["val_loss"][0] < 10


def test_missing_corpus_names_the_fix(tmp_path: Path) -> None:
    data = GPTDataModule(data_path=str(tmp_path / "nothing"), tokenizer="unused")
    with pytest.raises(MegatronConfigError, match="lightning-megatron preprocess"):
        data.setup("fit")
