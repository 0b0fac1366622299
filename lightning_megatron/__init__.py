"""lightning-megatron: megatron-core parallelism under PyTorch Lightning.

Importing the package registers ``MegatronAppStrategy`` in Lightning's strategy registry as
``"megatron"`` (so ``Trainer(strategy="megatron")`` and ``strategy: megatron`` in YAML work) and
megatron-core's pipeline schedules in ``lightning_megatron.pipeline``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.strategy import MegatronAppStrategy, MegatronPrecision

__version__ = "0.1.0"

MegatronAppStrategy.register_strategies(StrategyRegistry)

__all__ = ["MegatronAppStrategy", "MegatronConfigError", "MegatronPrecision", "__version__"]
