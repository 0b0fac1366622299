"""Precision the way megatron-core does it: half-precision weights, fp32 master weights, no autocast.

Lightning's ``"bf16-mixed"`` means ``torch.autocast`` around fp32 weights. megatron-core instead keeps
the model in bf16 or fp16 (``Float16Module``), sends activations between stages in that dtype, and keeps
fp32 master weights and (for fp16) a loss scale in its optimizer. ``MegatronPrecision`` maps Lightning's
precision strings onto that; the strategy converts Lightning's own plugins into it, so
``Trainer(precision="bf16-mixed", strategy=MegatronAppStrategy())`` does the right thing.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from typing_extensions import override

from lightning_megatron.errors import MegatronConfigError

__all__ = ["MegatronPrecision", "PrecisionName"]

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed"]
_DTYPES: dict[str, torch.dtype] = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


class MegatronPrecision(Precision):
    def __init__(self, precision: PrecisionName = "32-true") -> None:
        precision = _ALIASES.get(precision, precision)  # type: ignore[call-overload]
        if precision not in _DTYPES:
            raise MegatronConfigError(
                f"precision={precision!r} is not supported by MegatronAppStrategy; use one of "
                f"{', '.join(_DTYPES)} (bf16/fp16 weights with fp32 master weights, as megatron-core trains)."
            )
        self.precision = precision

    @property
    def params_dtype(self) -> torch.dtype:
        return _DTYPES[self.precision]

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Wrap a model chunk in megatron-core's ``Float16Module`` for half precision."""
        if self.params_dtype == torch.float32:
            return module
        from megatron.core.transformer.module import Float16Module
        from megatron.core.utils import get_model_config

        return Float16Module(get_model_config(module), module)

    @override
    def forward_context(self):  # noqa: ANN201
        return nullcontext()  # weights are already in the compute dtype: no autocast

    @override
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """No-op: the pipeline schedule ran every microbatch's backward inside ``training_step``."""

    @override
    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: Any = None,
    ) -> None:
        """Hand Lightning's ``gradient_clip_val`` to the strategy's optimizer, which clips by global norm.

        The norm must span tensor- and pipeline-parallel shards, so it is computed inside the optimizer
        step (megatron-core's model-parallel norm), not here over one rank's parameters.
        """
        algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
        if clip_val and algorithm not in (None, "norm"):
            raise MegatronConfigError(
                f"gradient_clip_algorithm={algorithm!r} is not supported by MegatronAppStrategy; use 'norm' "
                "(clipping by the global gradient norm across all model-parallel ranks)."
            )
        target = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        if hasattr(target, "clip_grad"):
            target.clip_grad = float(clip_val or 0.0)


def from_lightning_plugin(plugin: Optional[Precision]) -> Optional[MegatronPrecision]:
    """Translate the plugin Lightning built from ``Trainer(precision=...)`` into ``MegatronPrecision``."""
    if plugin is None or isinstance(plugin, MegatronPrecision):
        return plugin
    if isinstance(plugin, MixedPrecision):
        return MegatronPrecision(plugin.precision)  # "bf16-mixed" | "16-mixed"
    if isinstance(plugin, HalfPrecision):
        raise MegatronConfigError(
            f"precision={plugin.precision!r} (half-precision master weights) is not supported by "
            "MegatronAppStrategy; use 'bf16-mixed' (bf16 weights, fp32 master weights in the optimizer)."
        )
    if type(plugin) is Precision:
        return MegatronPrecision("32-true")
    raise MegatronConfigError(
        f"{type(plugin).__name__} is not supported by MegatronAppStrategy; use Trainer(precision=...) with one "
        f"of {', '.join(_DTYPES)}, or plugins=[MegatronPrecision(...)]."
    )
