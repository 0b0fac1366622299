"""What a fit changes in megatron-core's tensor-parallel layers, and takes back at teardown.

The contract: :func:`symmetric_ar_option` checks the strategy's ``symmetric_ar_type`` when the strategy is built;
:class:`TensorParallelLayers` installs, for one fit, the weight-gradient split (``gradient_accumulation_fusion``,
``layers.wgrad``), the overlapped collectives (``tp_comm_overlap``, ``layers.tp_overlap``), the float8 GEMMs
(``fp8_recipe``, ``layers.float8``) and the symmetric-memory all-reduce (``compat.symmetric_all_reduce``), and
:meth:`~TensorParallelLayers.restore` undoes them all, so the model's layers are megatron-core's again after the fit (serving, generation, the next fit).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_megatron.compat import symmetric_all_reduce
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.float8 import Float8Recipe
from lightning_megatron.layers.tp_overlap import TPCommOverlap
from lightning_megatron.layers.wgrad import SplitLinears, split_linears

__all__ = ["TensorParallelLayers", "symmetric_ar_option"]


def symmetric_ar_option(kind: Any, tensor_parallel: int, sequence_parallel: bool) -> Optional[str]:
    """The strategy's ``symmetric_ar_type`` checked: the kind, or None (NCCL's all-reduce)."""
    if kind is None:
        return None
    if kind not in symmetric_all_reduce.KINDS:
        raise MegatronConfigError(
            f"`symmetric_ar_type` must be one of {list(symmetric_all_reduce.KINDS)} or unset (NCCL), got {kind!r}. "
            "'multimem_all_reduce' needs NVLink multicast, which this project does not use."
        )
    if tensor_parallel == 1 or sequence_parallel:
        why = "no tensor parallelism" if tensor_parallel == 1 else "sequence parallelism (reduce-scatters instead)"
        warnings.warn(
            f"`symmetric_ar_type={kind!r}` has no tensor-parallel all-reduce to replace with {why}; it is ignored.",
            stacklevel=3,
        )
        return None
    return kind


class TensorParallelLayers:
    """The changes of one fit to the tensor-parallel layers of its model chunks; empty until :meth:`install`."""

    def __init__(self) -> None:
        self._linears: Optional[SplitLinears] = None
        self._all_reduce: Optional[symmetric_all_reduce.SymmetricAllReduce] = None

    @property
    def split_linears(self) -> Optional[SplitLinears]:
        """The layers given the project's backward (weight-gradient split, overlap), or None."""
        return self._linears

    @property
    def symmetric_all_reduce(self) -> Optional[symmetric_all_reduce.SymmetricAllReduce]:
        """The installed symmetric-memory all-reduce (its ``calls`` and ``fallbacks``), or None."""
        return self._all_reduce

    def install(
        self,
        chunks: Sequence[torch.nn.Module],
        *,
        accumulate: bool,
        overlap: Optional[TPCommOverlap],
        symmetric_ar_type: Optional[str],
        tp_group: Any,
        on_cpu: bool,
        fp8_recipe: Optional[str] = None,
    ) -> None:
        """Install what this fit asks for (each once, however many times Lightning sets the strategy up).

        ``fp8_recipe``: torchao's recipe name, checked by ``layers.float8.float8_recipe_option`` (emulated on CPUs).
        """
        if (accumulate or overlap or fp8_recipe) and self._linears is None:
            float8 = Float8Recipe(fp8_recipe, emulate=on_cpu, compile=not on_cpu) if fp8_recipe else None
            # W inside B here
            self._linears = split_linears(chunks, overlap=overlap, accumulate=accumulate, float8=float8)
            if float8 is not None:
                _announce_float8(float8, self._linears)
            if overlap and not self._linears.modules:
                rank_zero_warn(
                    "`tp_comm_overlap=True` found no megatron-core ColumnParallelLinear/RowParallelLinear to overlap "
                    "(Transformer Engine layers, or apex's gradient_accumulation_fusion in the model config); it "
                    "does nothing here."
                )
        if symmetric_ar_type and self._all_reduce is None:
            if on_cpu:
                raise MegatronConfigError(
                    f"`symmetric_ar_type={symmetric_ar_type!r}` needs GPUs of one node (torch's symmetric memory); "
                    "the Trainer runs on CPU. Leave it unset there."
                )
            self._all_reduce = symmetric_all_reduce.install(tp_group, symmetric_ar_type)

    @property
    def float8_layers(self) -> list[str]:
        """The layers whose GEMMs run in float8 in this fit (names within their model chunk)."""
        return list(self._linears.float8_modules) if self._linears is not None else []

    def restore(self) -> None:
        if self._linears is not None:
            self._linears.restore()
            self._linears = None
        if self._all_reduce is not None:
            self._all_reduce.restore()
            self._all_reduce = None


def _announce_float8(float8: Float8Recipe, linears: Any) -> None:
    """Say once which layers stay in bf16 because of their shapes (the output layer and MoE experts by design)."""
    if not linears.float8_modules:
        raise MegatronConfigError(
            f"`fp8_recipe={float8.name!r}` found no megatron-core ColumnParallelLinear/RowParallelLinear to run in "
            "float8 (Transformer Engine layers, or the model config's `gradient_accumulation_fusion`, which keeps "
            "megatron-core's apex path). Use the local layer spec (`layer_spec='local'` or 'sdpa') or unset it."
        )
    by_design = ("the output layer", "an MoE expert")
    shapes = {name: why for name, why in linears.kept_high_precision.items() if not why.startswith(by_design)}
    if shapes:
        listed = "; ".join(f"{name}: {why}" for name, why in list(shapes.items())[:4])
        rank_zero_warn(
            f"`fp8_recipe={float8.name!r}`: {len(shapes)} linear layer(s) stay in bf16 ({listed}"
            f"{'; ...' if len(shapes) > 4 else ''}). Choose hidden sizes that, divided by the tensor-parallel size, "
            "are multiples of 16."
        )
