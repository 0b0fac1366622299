"""Functions that run inside forked ranks for the MegaScope router tests (see ``distributed.py``)."""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
from scope_cases import BATCH, LLAMA_STYLE, SEQ, batch_of, build, tokens

from lightning_megatron.scope import capture, perturb
from lightning_megatron.scope.perturb import Perturbation, noise_draws

# 4 experts, top-2; layer 1 stays dense, so one model has both kinds of layer.
MOE_STYLE = dict(LLAMA_STYLE, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[1, 0, 1, 1])
ROUTER = ["blocks.*.moe.*", "blocks.*.hook_mlp_out", "blocks.*.hook_resid_post", "hook_logits"]


def router_captures(world: int, model: dict[str, Any], evaluate: bool = False, **layout: Any) -> Optional[dict]:
    """Every probe point of one forward of a fixed batch (2 microbatches through the pipeline schedule), captured
    at a layout; ``evaluate``: in eval mode (megatron-core refuses MoE training at TP > 1 without SP)."""
    trainer, module = build(world, model, **layout)
    if evaluate:
        for chunk in module.model_chunks:
            chunk.eval()
    with capture(module) as cache:
        trainer.strategy.forward_backward(batch_of(tokens()), forward_only=True)
    return {name: cache[name] for name in cache} if cache.is_server else None


def _router_of(chunk: torch.nn.Module, layer_index: int) -> torch.nn.Module:
    layer = next(m for m in chunk.decoder.layers if int(m.layer_number) - 1 == layer_index)
    return layer.mlp.router


def router_perturbed_gradients(world: int, model: dict[str, Any], pert: dict[str, Any], **layout: Any) -> dict:
    """Loss and gradients of one batch (plain autograd through the chunk) under ``perturb`` on router logits, and
    under a reference written by hand: the router instance's ``gating`` replaced by one that adds the same draws
    (gaussian) or sets the disabled experts' logits to -inf, without MegaScope. Also the experts chosen under the
    perturbation (captured), and the clean run's."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter

    trainer, module = build(world, model, **layout)
    chunk = module.model_chunks[0]
    ids = tokens(1)
    positions = torch.arange(SEQ).expand_as(ids)
    layer_index = int(pert["site"].split(".")[1])
    choice = f"blocks.{layer_index}.moe.hook_expert_choice"

    def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor], Optional[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        with capture(module, [choice]) as cache:
            logits = chunk(input_ids=ids, position_ids=positions, attention_mask=None)
            loss = logits.float().pow(2).mean()
            loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        return loss.detach(), grads, (cache[choice] if cache.is_server else None)

    clean_loss, clean, clean_choice = loss_and_grads()
    with perturb(module, **pert):
        loss, perturbed, choice_inside = loss_and_grads()

    spec = Perturbation(**pert)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    experts = int(model["num_moe_experts"])
    sequence_parallel = bool(layout.get("sequence_parallel"))

    def by_hand(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        logits = TopKRouter.gating(self, hidden)  # [s(/TP under SP), b, E]
        mask = torch.zeros(experts, dtype=torch.bool)
        mask[list(spec.experts) if spec.experts is not None else slice(None)] = True
        if spec.kind == "disable":
            return logits.masked_fill(mask, float("-inf"))
        full = noise_draws(spec, spec.site, [module.hparams.seq_length, BATCH, experts], microbatch=(dp_rank, 0))["n"]
        noise = full[:SEQ]
        if sequence_parallel:
            noise = noise.chunk(tp)[tp_rank]
        return logits + spec.strength * noise * mask

    router = _router_of(chunk, layer_index)
    installed = router.__dict__.get("gating")
    object.__setattr__(router, "gating", types.MethodType(by_hand, router))
    try:
        reference_loss, reference, _ = loss_and_grads()
    finally:
        if installed is None:
            del router.__dict__["gating"]
        else:
            object.__setattr__(router, "gating", installed)
    return {
        "clean_loss": clean_loss,
        "loss": loss,
        "reference_loss": reference_loss,
        "clean": clean,
        "perturbed": perturbed,
        "reference": reference,
        "clean_choice": clean_choice,
        "choice": choice_inside,
        "params": sorted(n for n, p in module.named_parameters() if p.requires_grad),
    }


def router_request_errors(world: int) -> list[str]:
    """What ``set_perturbations`` answers to router perturbations that name nothing real."""
    from lightning_megatron.scope.perturb import requested
    from lightning_megatron.scope.protocol import ProtocolError

    _, module = build(world, MOE_STYLE)
    out = []
    for spec in (
        {"site": "blocks.0.moe.hook_router_logits", "kind": "disable", "experts": [7]},
        {"site": "blocks.0.moe.hook_router_logits", "kind": "disable", "experts": [0, 1, 2]},
        {"site": "blocks.1.hook_resid_post", "kind": "disable", "experts": [0]},
        {"site": "blocks.1.moe.hook_router_logits", "kind": "gaussian", "strength": 1.0},
    ):
        try:
            requested([spec], module)
        except ProtocolError as err:
            out.append(f"{err.field}: {err.message}")
    return out


def _validation_batches() -> Any:
    """Two fixed batches of the tiny model's tokens, the same at every layout (the sweep's validation data)."""
    from torch.utils.data import DataLoader

    return DataLoader([batch_of(tokens(seed)) for seed in (5, 6)], batch_size=None)


def expert_sweep(world: int, model: dict[str, Any], grid: dict[str, Any], by_hand: list[dict], **layout: Any) -> dict:
    """``run_sweep`` over a per-expert grid at a layout, and the validation loss under each of ``by_hand``'s
    perturbations entered with ``perturb`` directly (the cell a sweep row must equal)."""
    from lightning_megatron.scope.sweep import SweepGrid, run_sweep

    trainer, module = build(world, model, **layout)
    data = _validation_batches()
    clean, rows = run_sweep(trainer, module, data, SweepGrid(**grid), progress=False)
    hand = []
    for spec in by_hand:
        with perturb(module, perturbations=[Perturbation(**spec)]):
            hand.append(float(trainer.validate(module, data, verbose=False)[0]["val_loss"]))
    return {"clean": clean, "rows": rows, "by_hand": hand}


class _NeverIterated:
    """Validation data that fails the case if anything reads it: a refusal must come before any validation."""

    def __iter__(self) -> Any:
        raise AssertionError("the sweep validated before refusing its grid")


def expert_sweep_refusals(world: int, dense: bool, **layout: Any) -> list[str]:
    """What ``run_sweep`` answers (on this rank) to per-expert grids the model cannot run (``dense``: also on a
    dense model)."""
    from lightning_megatron.errors import MegatronConfigError
    from lightning_megatron.scope.sweep import SweepGrid, run_sweep

    router = ["moe.hook_router_logits"]
    cases = [
        (MOE_STYLE, dict(layers=[0], sites=router, kinds=["disable"], experts=[1, 4])),
        (MOE_STYLE, dict(layers=[0, 1], sites=router, kinds=["disable"], experts="all")),
        *([(LLAMA_STYLE, dict(layers=[0], sites=router, kinds=["gaussian"], experts=[0]))] if dense else []),
    ]
    out = []
    built: dict[int, Any] = {}
    for model, grid in cases:
        if id(model) not in built:
            built[id(model)] = build(world, model, **layout)
        trainer, module = built[id(model)]
        try:
            run_sweep(trainer, module, _NeverIterated(), SweepGrid(**grid), progress=False)
        except MegatronConfigError as error:
            out.append(str(error))
        else:
            out.append("no error")
    return out
