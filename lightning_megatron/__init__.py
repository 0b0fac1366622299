"""lightning-megatron: megatron-core parallelism under PyTorch Lightning.

Importing the package is cheap: it loads neither torch, Lightning nor megatron-core, so tools that only read
MegaScan traces (``lightning_megatron.scan.analysis.detect``, the TensorBoard plugin) start in milliseconds. The public
names ``MegatronAppStrategy`` and ``MegatronPrecision`` are loaded on first access (PEP 562 ``__getattr__``).

``MegatronAppStrategy`` is registered in Lightning's strategy registry as ``"megatron"`` (so
``Trainer(strategy="megatron")`` and ``strategy: megatron`` in YAML work) by ``lightning_megatron.strategy``,
i.e. whenever the strategy is imported: by the CLI, by ``from lightning_megatron import MegatronAppStrategy``,
and by this import itself when ``lightning.pytorch`` is already loaded (``import lightning.pytorch as pl;
import lightning_megatron; pl.Trainer(strategy="megatron")`` keeps working).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from lightning_megatron.compat import quiet
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_megatron.strategy import MegatronAppStrategy, MegatronPrecision

# Other projects' warnings that are not the user's to act on (compat/quiet.py says which and why), filtered before
# any module of this package imports megatron-core: the models, data and MegaScan import it without the strategy.
quiet.filter_warnings()

__version__ = "0.1.0"

__all__ = ["MegatronAppStrategy", "MegatronConfigError", "MegatronPrecision", "__version__"]

# public name → the module that defines it, imported on first access
_LAZY = {"MegatronAppStrategy": "lightning_megatron.strategy", "MegatronPrecision": "lightning_megatron.strategy"}


__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)


if "lightning.pytorch" in sys.modules:
    # Lightning is loaded, so the strategy costs little more; register its name now (override=True: a reload
    # or a second registration is harmless) for code that names "megatron" without importing the strategy.
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_megatron.strategy import MegatronAppStrategy, MegatronPrecision

    MegatronAppStrategy.register_strategies(StrategyRegistry)
