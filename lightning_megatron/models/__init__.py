"""LightningModules for MegatronAppStrategy: the module contract and a GPT model."""

from lightning_megatron.models.generation import Generation, GenerationStep
from lightning_megatron.models.gpt import GPTModule
from lightning_megatron.models.module import MegatronLightningModule

__all__ = ["GPTModule", "Generation", "GenerationStep", "MegatronLightningModule"]
