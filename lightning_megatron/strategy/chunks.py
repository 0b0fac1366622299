"""The model chunks as megatron-core's schedules see them.

The contract: a LightningModule's ``model_chunks`` in, the chunks the strategy trains out. :func:`validated_chunks`
checks them against the strategy (one chunk per virtual stage, ``forward_step``, no parameter outside the chunks,
a TransformerConfig built with the strategy's parallel settings) before any collective can hang on a mismatch;
:func:`wrap_ddp` wraps them in megatron-core's DDP as Megatron-LM does; :func:`install_config_hooks` sets the
run-time hooks megatron-core's schedules read from the model config (no-sync, gradient sync and finalisation,
pipeline-communication settings).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from lightning_megatron.compat import moe as moe_compat
from lightning_megatron.compat.finalize_grads import finalize_model_grads
from lightning_megatron.compat.megatron import batched_p2p_is_safe
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.strategy.parallel import ParallelLayout

__all__ = ["ddp_options", "install_config_hooks", "unwrap", "validated_chunks", "wrap_ddp"]

_NOT_CHECKED = ("use_cpu_initialization", "calculate_per_token_loss", "attention_softmax_in_fp32")
"""Config fields the strategy sets itself or that may differ from ``config_kwargs()`` without harm."""


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The user's chunk inside megatron-core's DDP and mixed-precision wrappers."""
    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def validated_chunks(module: Any, num_chunks: int, config_kwargs: Mapping[str, Any]) -> list[torch.nn.Module]:
    """``module.model_chunks``, checked; :class:`MegatronConfigError` names what is wrong and the fix."""
    chunks = getattr(module, "model_chunks", None)
    if not isinstance(chunks, torch.nn.ModuleList) or len(chunks) != num_chunks:
        raise MegatronConfigError(
            f"{type(module).__name__}.configure_model() must set `self.model_chunks` to a torch.nn.ModuleList "
            f"with one model chunk per virtual pipeline stage ({num_chunks} here); got {chunks!r:.80}. "
            "Subclass MegatronLightningModule and implement build_chunk(), or build them yourself."
        )
    if not callable(getattr(module, "forward_step", None)):
        raise MegatronConfigError(f"{type(module).__name__} must define forward_step(batch, chunk).")
    chunk_params = {id(p) for c in chunks for p in c.parameters()}
    stray = [n for n, p in module.named_parameters() if id(p) not in chunk_params]
    if stray:
        raise MegatronConfigError(
            f"Parameters outside `model_chunks` are not trained or checkpointed by MegatronAppStrategy: {stray[:3]}. "
            "Move them into the model chunks."
        )
    for chunk in chunks:
        _check_config(get_model_config(chunk), config_kwargs)
    return list(chunks)


def _check_config(config: Any, expected: Mapping[str, Any]) -> None:
    wrong = {
        k: (getattr(config, k, None), v)
        for k, v in expected.items()
        if k not in _NOT_CHECKED and getattr(config, k, None) != v
    }
    if wrong:
        details = ", ".join(f"{k}={got!r} (strategy: {want!r})" for k, (got, want) in wrong.items())
        raise MegatronConfigError(
            f"The model chunks were built with a config that disagrees with the strategy: {details}. Build the "
            "TransformerConfig with **self.parallel.config_kwargs()."
        )


def ddp_options(named: Mapping[str, Any], ddp_config: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The DDP fields: the strategy's named arguments, then ``ddp_config``'s further ones (checked when the
    strategy is built; megatron-core checks the names at :func:`wrap_ddp`)."""
    if named.get("overlap_param_gather") and not named.get("use_distributed_optimizer"):
        raise MegatronConfigError(
            "`overlap_param_gather=True` overlaps the distributed optimizer's parameter all-gather; set "
            "`use_distributed_optimizer=True` too, or leave it off."
        )
    for key in ddp_config or {}:
        if key in named:
            raise MegatronConfigError(
                f"ddp_config[{key!r}] duplicates the strategy argument of that name; use the argument."
            )
    return {**named, **(ddp_config or {})}


def wrap_ddp(chunks: Sequence[torch.nn.Module], ddp_kwargs: Mapping[str, Any]) -> list[torch.nn.Module]:
    """megatron-core DDP around each chunk; the replicas start from rank 0's parameters."""
    for chunk in chunks:
        get_model_config(chunk).calculate_per_token_loss = True  # DDP reads it for its gradient scaling
    try:
        ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    except TypeError as err:
        raise MegatronConfigError(
            f"ddp_config has a field megatron-core's DistributedDataParallelConfig lacks: {err}"
        ) from None
    wrapped = [
        # As Megatron-LM: only the first chunk gets bucketed overlap (its gradients are ready last).
        DistributedDataParallel(get_model_config(c), ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()  # replicas start identical even if a module's init is rank-dependent
    return wrapped


def install_config_hooks(
    chunks: Sequence[torch.nn.Module],
    layout: ParallelLayout,
    *,
    on_cpu: bool,
    deallocate_pipeline_outputs: bool,
    overlap_grad_reduce: bool,
) -> None:
    """Set the run-time hooks megatron-core's schedules read from the model config."""
    ddp = [c for c in chunks if isinstance(c, DistributedDataParallel)]

    def per_chunk(name: str) -> Any:
        funcs = [getattr(c, name) for c in ddp]
        return funcs[0] if len(funcs) == 1 else funcs

    configs = {id(get_model_config(c)): get_model_config(c) for c in chunks}.values()
    if ddp and any(getattr(config, "num_moe_experts", None) for config in configs):
        # megatron-core weighs the router losses by each rank's share of the tokens (compat.moe)
        moe_compat.scale_router_loss_gradients(layout.context * (layout.tensor if layout.sequence_parallel else 1))
    for config in configs:
        config.calculate_per_token_loss = True
        config.batch_p2p_comm = batched_p2p_is_safe(
            on_cpu=on_cpu, pipeline=layout.pipeline, virtual_pipeline=layout.virtual_pipeline
        )
        config.deallocate_pipeline_outputs = deallocate_pipeline_outputs
        if ddp:
            config.no_sync_func = per_chunk("no_sync")
            config.finalize_model_grads_func = finalize_model_grads
            if overlap_grad_reduce:
                config.grad_sync_func = per_chunk("start_grad_sync")
