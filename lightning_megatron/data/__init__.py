"""Data: global-batch samplers, real corpora (indexed datasets, tokenizers, preprocessing) and synthetic tokens.

One batch is one optimizer step: every DataModule here batches by *global* batch size, so the samples of a
step do not depend on the data-parallel size, and training resumes at the right sample after a restore.
"""

from lightning_megatron.data.gpt import GPTDataModule
from lightning_megatron.data.sampler import GlobalBatchSampler
from lightning_megatron.data.synthetic import SyntheticTokenDataModule
from lightning_megatron.data.tokenizers import load_tokenizer, train_bpe_tokenizer

__all__ = ["GPTDataModule", "GlobalBatchSampler", "SyntheticTokenDataModule", "load_tokenizer", "train_bpe_tokenizer"]
