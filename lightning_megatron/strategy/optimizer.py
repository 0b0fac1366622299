"""From the torch optimizer a user returns in ``configure_optimizers`` to one that can step a Megatron model.

Users write ordinary Lightning code: ``AdamW(self.parameters(), lr=..., weight_decay=...)`` with any
torch LR scheduler attached. The strategy then picks one of two engines:

* ``MegatronOptimizer`` (Adam, AdamW, SGD): megatron-core's optimizer built with the same
  hyperparameters and the same parameter groups. It keeps fp32 master weights for bf16/fp16, shards
  state across data-parallel ranks with the distributed optimizer, computes a model-parallel grad norm
  and clips, and saves reshardable checkpoints. The user's optimizer stays the holder of the
  hyperparameters: its LR schedulers keep working, and each step copies its learning rates and weight
  decays into megatron-core's groups.
* ``TorchOptimizer`` (any other torch optimizer, fp32 only): the user's optimizer steps the weights
  itself, on gradients the strategy has synchronised; the strategy adds the model-parallel grad norm
  and clipping. Its checkpoints load only at the layout they were saved with.

Both present Lightning a ``torch.optim.Optimizer`` whose ``step(closure)`` runs the closure (the whole
pipeline schedule, forward and backward of every microbatch) and then updates the weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.transformer.module import param_is_not_shared

from lightning_megatron.compat.megatron import finish_distributed_optimizer_load, prepare_distributed_optimizer_load
from lightning_megatron.compat.multi_tensor import install as install_foreach_kernels
from lightning_megatron.compat.torch import mark_optimizer_stepped
from lightning_megatron.errors import MegatronConfigError

__all__ = ["StrategyOptimizer", "MegatronOptimizer", "TorchOptimizer", "build_optimizer"]

# Param-group key that ties each megatron-core group to the user's group it came from.
_USER_GROUP = "lightning_megatron_group"
# Hyperparameters schedulers may change; copied from the user's groups before every step.
_SYNCED_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum")
# Reshardable across TP/PP/DP layouts; the default megatron-core format only reshards along DP.
_DISTRIBUTED_OPTIMIZER_CHECKPOINT = {"distrib_optim_sharding_type": "fully_reshardable"}


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer Lightning holds. Gradients are owned by the strategy, not by ``zero_grad``.

    ``zero_grad`` is a no-op on purpose: Lightning calls it after ``training_step`` returns, and by then
    the pipeline schedule has already produced this step's gradients. The strategy clears gradient
    buffers itself before each schedule run (``clear_grads``).

    ``listeners``: the strategy's step listeners (``strategy.listeners``), told ``optimizer-step`` around the
    update itself, so a tracer's span holds the update and nothing that Lightning's hooks do around it.
    """

    def __init__(self, user_optimizer: torch.optim.Optimizer) -> None:
        # Optimizer.__init__ is not called: this object owns no parameters of its own. It exposes the
        # user's optimizer's groups, the ones their LR schedulers adjust.
        self.user_optimizer = user_optimizer
        self.defaults = user_optimizer.defaults
        self.state: dict = {}
        self.clip_grad: float = 0.0
        self.last_grad_norm: Optional[float] = None
        self.last_step_skipped: bool = False
        self.listeners: Sequence[Any] = ()  # StepListener (not imported: strategy.listeners is the contract)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.user_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def clear_grads(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        listeners = sorted(self.listeners, key=lambda listener: listener.nesting)  # as megatron's timers
        for listener in listeners:
            listener.span_start("optimizer-step")
        try:
            self._update()
        finally:
            for listener in reversed(listeners):
                listener.span_stop("optimizer-step")
        return loss

    def _update(self) -> None:
        raise NotImplementedError

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool) -> dict[str, Any]:
        raise NotImplementedError

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _user_group_state(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.user_optimizer.param_groups]

    def _load_user_group_state(self, saved: Sequence[dict[str, Any]]) -> None:
        if len(saved) != len(self.user_optimizer.param_groups):
            raise MegatronConfigError(
                f"The checkpoint's optimizer has {len(saved)} parameter groups, configure_optimizers returned "
                f"{len(self.user_optimizer.param_groups)}. Resume with the same parameter grouping."
            )
        for group, values in zip(self.user_optimizer.param_groups, saved):
            group.update({k: v for k, v in values.items() if k != "params"})

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise RuntimeError(
            "MegatronAppStrategy checkpoints optimizers as sharded state; use trainer.save_checkpoint()."
        )


class MegatronOptimizer(StrategyOptimizer):
    """megatron-core's optimizer, driven by the hyperparameters of the user's torch optimizer."""

    def __init__(
        self, user_optimizer: torch.optim.Optimizer, megatron_optimizer: Any, merged_groups: dict[int, list[int]]
    ) -> None:
        super().__init__(user_optimizer)
        self.megatron = megatron_optimizer
        self._merged_groups = {k: v for k, v in merged_groups.items() if len(v) > 1}

    def clear_grads(self) -> None:
        self.megatron.zero_grad()

    def _sync_hyperparams(self) -> None:
        user_groups = self.user_optimizer.param_groups
        for first, indices in self._merged_groups.items():
            for other in indices[1:]:
                if any(user_groups[other].get(k) != user_groups[first].get(k) for k in _SYNCED_KEYS):
                    raise MegatronConfigError(
                        f"Parameter groups {first} and {other} started with equal hyperparameters and share one "
                        "megatron-core group, but a scheduler has since changed them differently. Give them different "
                        "initial learning rates or weight decays."
                    )
        for group in self.megatron.param_groups:
            source = user_groups[group[_USER_GROUP]]
            for key in _SYNCED_KEYS:
                if key in source and key in group:
                    group[key] = source[key]

    def _update(self) -> None:
        self._sync_hyperparams()
        # megatron-core computes the grad norm only while clipping; an infinite threshold measures it
        # (for logging) without ever scaling the gradients.
        self.megatron.config.clip_grad = self.clip_grad if self.clip_grad > 0 else math.inf
        success, grad_norm, _ = self.megatron.step()
        self.last_step_skipped = not success
        self.last_grad_norm = None if grad_norm is None else float(grad_norm)
        mark_optimizer_stepped(self.user_optimizer)

    @property
    def loss_scaler(self):  # noqa: ANN201
        """The callable megatron-core's schedules apply to the last stage's loss (fp16 loss scaling)."""
        return self.megatron.scale_loss

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool) -> dict[str, Any]:
        if is_loading:
            prepare_distributed_optimizer_load(self.megatron)
        return {
            "megatron": self.megatron.sharded_state_dict(
                model_sharded_state_dict, is_loading=is_loading, metadata=dict(_DISTRIBUTED_OPTIMIZER_CHECKPOINT)
            ),
            "user_param_groups": self._user_group_state(),
        }

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        self.megatron.load_state_dict(state["megatron"])
        finish_distributed_optimizer_load(self.megatron)
        self._load_user_group_state(state["user_param_groups"])


class TorchOptimizer(StrategyOptimizer):
    """A torch optimizer megatron-core cannot express, stepping on gradients the strategy synchronised."""

    def __init__(self, user_optimizer: torch.optim.Optimizer) -> None:
        super().__init__(user_optimizer)
        self._params = [p for g in user_optimizer.param_groups for p in g["params"] if p.requires_grad]

    def clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _update(self) -> None:
        for p in self._params:
            if getattr(p, "main_grad", None) is not None:  # megatron-core DDP accumulates into main_grad
                p.grad = p.main_grad
        grads = [
            p.grad
            for p in self._params
            if p.grad is not None
            and param_is_not_shared(p)
            and tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
        ]
        norm = get_grad_norm_fp32(grads, grad_stats_parallel_group=parallel_state.get_model_parallel_group())
        if self.clip_grad > 0:
            clip_grad_by_total_norm_fp32([p for p in self._params if p.grad is not None], self.clip_grad, norm)
        self.last_grad_norm = float(norm)
        self.last_step_skipped = False
        self.user_optimizer.step()

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool) -> dict[str, Any]:
        pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
        shape = (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )
        # The state is keyed by parameter position on this rank, so it is one object per (pp, tp) rank,
        # replicated across data-parallel ranks.
        data = None if is_loading else self.user_optimizer.state_dict()
        return {
            "torch": ShardedObject(
                "optimizer.torch_state", data, shape, (pp, tp), replica_id=parallel_state.get_data_parallel_rank()
            ),
        }

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        self.user_optimizer.load_state_dict(state["torch"])


def _megatron_config_kwargs(optimizer: torch.optim.Optimizer) -> tuple[Optional[dict[str, Any]], str]:
    """Map a torch optimizer to megatron-core ``OptimizerConfig`` fields, or say why it cannot be."""
    d = optimizer.defaults
    name = type(optimizer).__name__
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        if d.get("amsgrad") or d.get("maximize"):
            return None, f"{name}(amsgrad/maximize) has no megatron-core equivalent"
        decoupled = type(optimizer) is torch.optim.AdamW or bool(d.get("decoupled_weight_decay", False))
        return (
            {
                "optimizer": "adam",
                "lr": float(d["lr"]),
                "weight_decay": float(d["weight_decay"]),
                "adam_beta1": float(d["betas"][0]),
                "adam_beta2": float(d["betas"][1]),
                "adam_eps": float(d["eps"]),
                "decoupled_weight_decay": decoupled,
            },
            "",
        )
    if type(optimizer) is torch.optim.SGD:
        if d.get("nesterov") or d.get("dampening") or d.get("maximize"):
            return None, "SGD(nesterov/dampening/maximize) has no megatron-core equivalent"
        return (
            {
                "optimizer": "sgd",
                "lr": float(d["lr"]),
                "weight_decay": float(d["weight_decay"]),
                "sgd_momentum": float(d["momentum"]),
            },
            "",
        )
    return None, f"megatron-core has no {name}"


def _check_coverage(optimizer: torch.optim.Optimizer, chunks: Sequence[torch.nn.Module]) -> None:
    trainable = {id(p): n for chunk in chunks for n, p in chunk.named_parameters() if p.requires_grad}
    grouped = [p for g in optimizer.param_groups for p in g["params"]]
    grouped_ids = {id(p) for p in grouped}
    missing = [n for i, n in trainable.items() if i not in grouped_ids]
    if missing:
        raise MegatronConfigError(
            f"configure_optimizers() must optimize every trainable parameter of the model chunks; {len(missing)} "
            f"are in no parameter group (e.g. {missing[0]!r}). Pass self.parameters(), or set requires_grad=False "
            "on parameters you want frozen."
        )
    foreign = [p for p in grouped if id(p) not in trainable]
    if foreign:
        raise MegatronConfigError(
            f"configure_optimizers() returned {len(foreign)} parameters that are not trainable parameters of "
            "the model chunks built in configure_model(). Keep all parameters inside `self.model_chunks`."
        )


def build_optimizer(
    optimizer: torch.optim.Optimizer,
    chunks: Sequence[torch.nn.Module],
    *,
    params_dtype: torch.dtype,
    use_distributed_optimizer: bool,
    extra_config: Optional[dict[str, Any]] = None,
) -> StrategyOptimizer:
    """Turn the user's optimizer into the one the strategy steps (see the module docstring)."""
    _check_coverage(optimizer, chunks)
    kwargs, reason = _megatron_config_kwargs(optimizer)
    if kwargs is None:
        if use_distributed_optimizer:
            raise MegatronConfigError(
                f"use_distributed_optimizer=True needs an optimizer megatron-core implements (Adam, AdamW, SGD); "
                f"{reason}. Switch optimizers or set use_distributed_optimizer=False."
            )
        if params_dtype != torch.float32:
            raise MegatronConfigError(
                f"Mixed precision keeps fp32 master weights in megatron-core's optimizer, which supports Adam, "
                f"AdamW and SGD; {reason}. Use one of those, or precision='32-true'."
            )
        from megatron.core import parallel_state

        if parallel_state.get_expert_model_parallel_world_size() > 1:
            # Its gradient norm and its checkpoint know the tensor and pipeline ranks only, not which experts a
            # rank holds: clipping would differ between expert ranks and expert state would be saved from one.
            raise MegatronConfigError(
                f"expert_model_parallel_size > 1 needs an optimizer megatron-core implements (Adam, AdamW, SGD), "
                f"which reduces the gradient norm and saves optimizer state per expert rank; {reason}. Switch "
                "optimizers or set expert_model_parallel_size=1."
            )
        return TorchOptimizer(optimizer)

    kwargs.update(
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
        clip_grad=0.0,
    )
    for key, value in (extra_config or {}).items():
        if key in kwargs:
            raise MegatronConfigError(
                f"optimizer_config sets {key!r}, which the strategy derives from configure_optimizers() and the "
                "precision setting. Set it there instead."
            )
        kwargs[key] = value
    try:
        config = OptimizerConfig(**kwargs)
    except TypeError as err:
        raise MegatronConfigError(
            f"optimizer_config has a field megatron-core's OptimizerConfig lacks: {err}"
        ) from None

    overrides, representatives = _group_overrides(optimizer.param_groups)
    install_foreach_kernels()
    megatron_optimizer = get_megatron_optimizer(config, list(chunks), config_overrides=overrides)
    if optimizer.defaults.get("fused") is not False:
        _fuse_adam_steps(megatron_optimizer)
    return MegatronOptimizer(optimizer, megatron_optimizer, representatives)


def _fuse_adam_steps(megatron_optimizer: Any) -> None:
    """Step torch's Adam/AdamW inside megatron-core's optimizer with its fused CUDA kernel.

    Without Transformer Engine or Apex, megatron-core builds a plain ``torch.optim.AdamW``, whose CUDA default is
    the foreach implementation: about ten passes over the fp32 master weights and both moments, several times the
    fused kernel's time (docs/guides/performance.md). ``fused=True`` is torch's single-kernel Adam, the same update
    (what Apex's ``FusedAdam`` does). Set before the first step, so every ``step`` state tensor is created where the
    fused kernel wants it (on the parameter's device); torch's ``load_state_dict`` moves loaded ones there too. A
    user optimizer built with ``fused=False`` keeps the default.
    """
    parts = getattr(megatron_optimizer, "chained_optimizers", None) or [megatron_optimizer]
    for part in parts:
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.state:
            continue
        for group in inner.param_groups:
            if group["params"] and all(p.is_cuda and p.dtype == torch.float32 for p in group["params"]):
                group["fused"], group["foreach"] = True, False


def _group_overrides(groups: Sequence[dict[str, Any]]) -> tuple[dict, dict[int, list[int]]]:
    """megatron-core parameter groups for the user's groups, and which user groups each one stands for.

    megatron-core tells its groups apart (also when loading checkpoints) by their learning-rate and
    weight-decay *multipliers*, so each user group becomes a group with ``lr_mult = lr / max lr`` and
    ``wd_mult = weight_decay / max weight decay``. User groups with equal multipliers become one
    megatron-core group; they must then agree on every other hyperparameter too.
    """
    base_lr = max(float(g["lr"]) for g in groups) or 1.0
    base_wd = max(float(g.get("weight_decay", 0.0)) for g in groups) or 1.0
    members: dict[tuple[float, float], list[int]] = {}
    for index, group in enumerate(groups):
        key = (float(group["lr"]) / base_lr, float(group.get("weight_decay", 0.0)) / base_wd)
        members.setdefault(key, []).append(index)
    overrides, representatives = {}, {}
    for (lr_mult, wd_mult), indices in members.items():
        first = groups[indices[0]]
        for other in indices[1:]:
            differing = [k for k in _SYNCED_KEYS if groups[other].get(k) != first.get(k)]
            if differing:
                raise MegatronConfigError(
                    f"Parameter groups {indices[0]} and {other} have the same learning rate and weight decay but "
                    f"different {differing}; megatron-core cannot keep them apart. Merge them or make their "
                    "learning rates or weight decays differ."
                )
        ids = frozenset(id(p) for i in indices for p in groups[i]["params"])
        predicate = ParamPredicate(name=f"{_USER_GROUP}_{indices[0]}", fn=lambda p, ids=ids: id(p) in ids)
        overrides[ParamKey(predicate=predicate)] = {"lr_mult": lr_mult, "wd_mult": wd_mult, _USER_GROUP: indices[0]}
        representatives[indices[0]] = indices
    return overrides, representatives
