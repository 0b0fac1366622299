"""The Lightning strategy: megatron-core parallelism, precision, optimizer and checkpoints."""

from lightning_megatron.strategy.checkpoint import DistCheckpointIO
from lightning_megatron.strategy.listeners import StepListener
from lightning_megatron.strategy.parallel import ParallelContext, ParallelLayout, StageSpec
from lightning_megatron.strategy.precision import MegatronPrecision
from lightning_megatron.strategy.step import StepOutput
from lightning_megatron.strategy.strategy import MegatronAppStrategy

__all__ = [
    "DistCheckpointIO",
    "MegatronAppStrategy",
    "MegatronPrecision",
    "ParallelContext",
    "ParallelLayout",
    "StageSpec",
    "StepListener",
    "StepOutput",
]
