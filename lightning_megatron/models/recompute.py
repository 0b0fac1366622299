"""Activation recomputation settings of ``GPTModule``: megatron-core's three ``TransformerConfig`` fields, checked.

megatron-core reads ``recompute_granularity``, ``recompute_method`` and ``recompute_num_layers`` in two places:
``TransformerBlock._checkpointed_forward`` (``"full"``: whole layers run under ``tensor_parallel.checkpoint``, which
keeps only each checkpointed group's input and runs its forward again in the backward) and
``Attention.forward`` (``"selective"``: only ``core_attention``, the softmax(QKᵀ)V part, under the checkpoint).
Its own checks (``TransformerConfig.__post_init__``) run inside every rank and say nothing of pipeline stages, and
two mistakes pass them silently or fail late: ``"uniform"`` with a group size that does not divide a chunk's layers
reaches past the chunk's last layer (an ``IndexError`` in the first training step), and ``"selective"`` with a
``recompute_method`` is accepted and ignored. So the rules are checked here, by parameter name: the ones that need
only the arguments when the module is built (before any process starts), the ones that need the pipeline layout
when the config is made (every rank, before the model is built).

What selective recomputation saves depends on the core attention: megatron-core's local ``DotProductAttention``
(``layer_spec="local"``) keeps the ``[batch, heads, seq, seq]`` softmax output (and dropout mask) for its
backward, which the checkpoint drops; PyTorch's fused ``scaled_dot_product_attention`` (``layer_spec="sdpa"``)
keeps no such matrix (flash and memory-efficient kernels keep q, k, v, the output and one log-sum-exp per row),
so there the checkpoint recomputes the kernel (the recomputation does run) for almost no memory; a warning says
so. (megatron-core itself warns the same of Transformer Engine's fused attention.)
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

from lightning_megatron.errors import MegatronConfigError

__all__ = ["RECOMPUTE_FIELDS", "RecomputeGranularity", "RecomputeMethod", "check_recompute", "check_recompute_layout"]

RecomputeGranularity = Literal["selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def check_recompute(
    granularity: Optional[str],
    method: Optional[str],
    num_layers: Optional[int],
    *,
    total_layers: int,
    layer_spec: str,
    overrides: Optional[dict[str, Any]],
) -> dict[str, Any]:
    """The ``TransformerConfig`` fields for these settings, or a ``MegatronConfigError`` naming the parameter.

    Needs only the module's arguments, so ``GPTModule.__init__`` runs it before any process starts."""
    clash = sorted(set(overrides or {}) & set(RECOMPUTE_FIELDS))
    if clash:
        raise MegatronConfigError(
            f"transformer_config_overrides sets {clash}, which are GPTModule arguments: pass them as "
            f"GPTModule({', '.join(f'{name}=...' for name in clash)}) and remove them from "
            "transformer_config_overrides."
        )
    if granularity not in (None, "selective", "full"):
        raise MegatronConfigError(f"recompute_granularity={granularity!r}: choose None, 'selective' or 'full'.")
    if method not in (None, "uniform", "block"):
        raise MegatronConfigError(f"recompute_method={method!r}: choose None, 'uniform' or 'block'.")
    if granularity != "full":
        given = [
            f"{name}={value!r}"
            for name, value in (("recompute_method", method), ("recompute_num_layers", num_layers))
            if value is not None
        ]
        if given:
            raise MegatronConfigError(
                f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for recompute_granularity='full' only "
                f"(recompute_granularity="
                f"{granularity!r}): set recompute_granularity='full', or leave them out"
                + (" (selective recomputation covers core attention in every layer)." if granularity else ".")
            )
    if granularity is None:
        return {}
    if granularity == "selective":
        if layer_spec.split("+")[0] == "sdpa" and "recompute_modules" not in (overrides or {}):
            warnings.warn(
                f"recompute_granularity='selective' with layer_spec={layer_spec!r}: selective recomputation "
                "checkpoints core attention, and this spec's fused attention kernel keeps no [seq, seq] matrix "
                "for its backward, so it is recomputed for almost no memory saved. Use "
                "recompute_granularity='full' to save activation memory, or layer_spec='local' (whose unfused "
                "attention selective recomputation was made for).",
                stacklevel=3,
            )
        return {"recompute_granularity": "selective"}
    if method is None or num_layers is None:
        missing = " and ".join(
            name
            for name, value in (("recompute_method", method), ("recompute_num_layers", num_layers))
            if value is None
        )
        raise MegatronConfigError(
            f"recompute_granularity='full' needs {missing}: recompute_method='uniform' with recompute_num_layers=N "
            "checkpoints every group of N layers (N=1: every layer, the least memory), recompute_method='block' "
            "with recompute_num_layers=N checkpoints the first N layers of each pipeline stage and keeps the rest."
        )
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total_layers:
        raise MegatronConfigError(
            f"recompute_num_layers={num_layers!r} must be an integer from 1 to num_layers={total_layers}."
        )
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": num_layers}


def check_recompute_layout(fields: dict[str, Any], layers_per_chunk: int, where: str) -> None:
    """Raise unless full recomputation's ``recompute_num_layers`` fits the layers of one model chunk (a pipeline
    stage, or a virtual stage with interleaving): megatron-core counts its groups and blocks per chunk."""
    if fields.get("recompute_granularity") != "full":
        return
    method, count = fields["recompute_method"], fields["recompute_num_layers"]
    if method == "uniform" and layers_per_chunk % count:
        raise MegatronConfigError(
            f"recompute_method='uniform' with recompute_num_layers={count}: each {where} holds {layers_per_chunk} "
            f"layers, which do not split into groups of {count}. Choose a recompute_num_layers that divides "
            f"{layers_per_chunk} (1 checkpoints every layer)."
        )
    if method == "block" and count > layers_per_chunk:
        raise MegatronConfigError(
            f"recompute_method='block' with recompute_num_layers={count}: each {where} holds only "
            f"{layers_per_chunk} layers. Choose recompute_num_layers from 1 to {layers_per_chunk} (the number of "
            "layers of each stage to recompute)."
        )
