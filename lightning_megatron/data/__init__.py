"""DataModules and samplers that batch by global batch size (one batch = one optimizer step)."""

from lightning_megatron.data.sampler import GlobalBatchSampler
from lightning_megatron.data.synthetic import SyntheticTokenDataModule

__all__ = ["GlobalBatchSampler", "SyntheticTokenDataModule"]
