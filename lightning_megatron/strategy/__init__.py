"""The Lightning strategy: megatron-core parallelism, precision, optimizer and checkpoints.

Importing this package registers ``MegatronAppStrategy`` in Lightning's ``StrategyRegistry`` as ``"megatron"``
(``Trainer(strategy="megatron")``, ``strategy: megatron`` in YAML). The registration lives here, not in
``lightning_megatron/__init__.py``, so that the top-level package stays importable without torch and Lightning
while every way of reaching the strategy (the CLI, ``from lightning_megatron import MegatronAppStrategy``)
still registers it.
"""

from lightning_megatron.compat import quiet

quiet.filter_warnings()  # before megatron-core is imported below: its import warns (see compat.quiet)

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_megatron.strategy.checkpoint import DistCheckpointIO  # noqa: E402
from lightning_megatron.strategy.listeners import StepListener  # noqa: E402
from lightning_megatron.strategy.parallel import ParallelContext, ParallelLayout, StageSpec  # noqa: E402
from lightning_megatron.strategy.precision import MegatronPrecision  # noqa: E402
from lightning_megatron.strategy.step import StepOutput  # noqa: E402
from lightning_megatron.strategy.strategy import MegatronAppStrategy  # noqa: E402

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

MegatronAppStrategy.register_strategies(StrategyRegistry)  # override=True: re-imports are harmless
