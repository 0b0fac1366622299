"""Mixture-of-experts settings of ``GPTModule``: megatron-core's ``moe_*`` fields, checked, and the auxiliary losses.

megatron-core's MoE layer (``MoELayer``: a ``TopKRouter``, a token dispatcher, the experts) runs without Transformer
Engine on its local spec; ``models.specs`` builds it in place of the dense MLP in the layers ``moe_layer_freq``
names. Its own checks run inside every rank, after the processes started, as assertions (``topk`` larger than the
expert count, a layer-frequency list of the wrong length, experts that do not split over the expert-parallel
ranks); here they are errors naming the parameter, checked when the module is built (``check_moe``) or, for the
layout, when the config is made (``check_expert_layout``).

The router's load-balancing losses are added to the gradient inside the layer (``MoEAuxLossAutoScaler``) and kept,
per layer and summed over microbatches, in megatron-core's tracker. ``AuxLosses.take`` reduces them as
Megatron-LM's training loop does (over pipeline stages, the tensor × context group, averaged over data-parallel
ranks), averages over MoE layers and microbatches and clears the tracker, so each training step logs its own.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch

from lightning_megatron.errors import MegatronConfigError

__all__ = [
    "AuxLosses",
    "MoETokenDispatcher",
    "check_expert_layout",
    "check_moe",
    "forget_aux_losses",
    "moe_layer_pattern",
    "separate_expert_parameters",
]

MoETokenDispatcher = Literal["alltoall", "allgather"]
# The tracker names megatron-core's router logs under, by the load-balancing type that produces them.
_AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def moe_layer_pattern(num_layers: int, freq: Union[int, list[int]]) -> list[int]:
    """megatron-core's ``moe_layer_freq``: ``N`` makes every N-th layer (0, N, 2N, ...) an MoE layer; a list of
    0/1 names each layer of the whole model."""
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        raise MegatronConfigError(f"moe_layer_freq={freq!r}: give an integer N (every N-th layer) or a list of 0/1.")
    if isinstance(freq, int):
        if freq < 1:
            raise MegatronConfigError(f"moe_layer_freq={freq}: must be at least 1 (1: every layer is an MoE layer).")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise MegatronConfigError(
            f"moe_layer_freq={freq}: a list needs one 0 (dense) or 1 (MoE) per layer, {num_layers} in all."
        )
    return list(freq)


def check_moe(
    num_moe_experts: Optional[int],
    *,
    moe_router_topk: int,
    moe_ffn_hidden_size: Optional[int],
    moe_aux_loss_coeff: float,
    moe_token_dispatcher_type: str,
    moe_layer_freq: Union[int, list[int]],
    moe_grouped_gemm: bool,
    add_bias_linear: bool,
    moe_shared_expert_intermediate_size: Optional[int] = None,
    moe_shared_expert_gate: bool = False,
    moe_router_pre_softmax: bool = False,
    num_layers: int,
    ffn_hidden_size: int,
    overrides: Optional[dict[str, Any]],
) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of these settings (none without experts; ``moe_grouped_gemm`` is this
    package's, chosen in the layer spec: megatron-core's field of that name selects its deprecated ``GroupedMLP``),
    or a ``MegatronConfigError``
    naming the parameter. Needs only the module's arguments: ``GPTModule.__init__`` runs it before any process."""
    named = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff")
    named += ("moe_token_dispatcher_type", "moe_layer_freq", "moe_grouped_gemm")
    named += ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax")
    clash = sorted(set(overrides or {}) & set(named))
    if clash:
        raise MegatronConfigError(
            f"transformer_config_overrides sets {clash}, which are GPTModule arguments: pass them as "
            f"GPTModule({', '.join(f'{name}=...' for name in clash)}) instead."
        )
    if num_moe_experts is None:
        if moe_shared_expert_intermediate_size is not None or moe_shared_expert_gate or moe_router_pre_softmax:
            raise MegatronConfigError(
                "moe_shared_expert_intermediate_size / moe_shared_expert_gate / moe_router_pre_softmax need an MoE "
                "model: set num_moe_experts."
            )
        return {}
    if isinstance(num_moe_experts, bool) or not isinstance(num_moe_experts, int) or num_moe_experts < 2:
        raise MegatronConfigError(
            f"num_moe_experts={num_moe_experts!r}: an MoE layer needs at least 2 experts (None: dense MLPs)."
        )
    if not isinstance(moe_router_topk, int) or not 1 <= moe_router_topk <= num_moe_experts:
        raise MegatronConfigError(
            f"moe_router_topk={moe_router_topk!r}: each token goes to 1 to num_moe_experts={num_moe_experts} experts."
        )
    if moe_ffn_hidden_size is not None and (not isinstance(moe_ffn_hidden_size, int) or moe_ffn_hidden_size < 1):
        raise MegatronConfigError(f"moe_ffn_hidden_size={moe_ffn_hidden_size!r}: a positive width, or None.")
    if moe_aux_loss_coeff < 0:
        raise MegatronConfigError(f"moe_aux_loss_coeff={moe_aux_loss_coeff}: must be >= 0 (0 turns the loss off).")
    if moe_token_dispatcher_type not in ("alltoall", "allgather"):
        raise MegatronConfigError(
            f"moe_token_dispatcher_type={moe_token_dispatcher_type!r}: choose 'alltoall' or 'allgather' ('flex' "
            "needs DeepEP)."
        )
    if not any(moe_layer_pattern(num_layers, moe_layer_freq)):
        raise MegatronConfigError(
            f"moe_layer_freq={moe_layer_freq!r} makes none of the {num_layers} layers an MoE layer: mark at least one "
            "with 1, or leave num_moe_experts unset for a dense model."
        )
    if moe_grouped_gemm not in (True, False):
        raise MegatronConfigError(f"moe_grouped_gemm={moe_grouped_gemm!r}: true or false.")
    shared = moe_shared_expert_intermediate_size
    if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int) or shared < 1):
        raise MegatronConfigError(
            f"moe_shared_expert_intermediate_size={shared!r}: the hidden width of the shared experts (all of them "
            "together, e.g. 2 shared experts of width 1408 -> 2816), or None for none."
        )
    if moe_shared_expert_gate not in (True, False):
        raise MegatronConfigError(f"moe_shared_expert_gate={moe_shared_expert_gate!r}: true or false.")
    if moe_router_pre_softmax not in (True, False):
        raise MegatronConfigError(f"moe_router_pre_softmax={moe_router_pre_softmax!r}: true or false.")
    if moe_shared_expert_gate and shared is None:
        raise MegatronConfigError(
            "moe_shared_expert_gate=True gates the shared experts' output; it needs "
            "moe_shared_expert_intermediate_size (their width)."
        )
    if add_bias_linear:
        raise MegatronConfigError(
            "num_moe_experts with add_bias_linear=True: megatron-core 0.16.1's experts add their output bias in "
            "place on a view, which autograd refuses in the first forward. Set add_bias_linear=False (Mixtral-, "
            "Qwen- and DeepSeek-style MoE models have no biases)."
        )
    return {
        "num_moe_experts": num_moe_experts,
        "moe_router_topk": moe_router_topk,
        "moe_ffn_hidden_size": moe_ffn_hidden_size or ffn_hidden_size,
        "moe_aux_loss_coeff": moe_aux_loss_coeff,
        "moe_token_dispatcher_type": moe_token_dispatcher_type,
        "moe_layer_freq": moe_layer_freq,
        "moe_shared_expert_intermediate_size": shared,
        "moe_shared_expert_gate": moe_shared_expert_gate,
        "moe_router_pre_softmax": moe_router_pre_softmax,
    }


def check_expert_layout(
    num_moe_experts: Optional[int],
    expert_parallel: int,
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    training: bool = True,
) -> None:
    """Raise unless the experts split evenly over ``expert_model_parallel_size`` ranks (each rank holds
    ``num_moe_experts / expert_model_parallel_size`` whole experts), and unless a training run at tensor
    parallelism has sequence parallelism (megatron-core's MoE layer raises in its first training forward
    otherwise)."""
    if num_moe_experts is not None and training and tensor_parallel > 1 and not sequence_parallel:
        raise MegatronConfigError(
            f"num_moe_experts with tensor_model_parallel_size={tensor_parallel}: megatron-core's MoE layer trains "
            "only with sequence parallelism at TP > 1. Set sequence_parallel=True on the strategy."
        )
    if num_moe_experts is None:
        if expert_parallel > 1:
            raise MegatronConfigError(
                f"expert_model_parallel_size={expert_parallel} splits experts over ranks, but the model has none: "
                "set GPTModule(num_moe_experts=...) or expert_model_parallel_size=1."
            )
        return
    if num_moe_experts % expert_parallel:
        raise MegatronConfigError(
            f"num_moe_experts={num_moe_experts} does not split over expert_model_parallel_size={expert_parallel} "
            "ranks: choose an expert count that is a multiple of it."
        )


def separate_expert_parameters(model: torch.nn.Module) -> None:
    """Mark every expert weight as megatron-core marks it at ``expert_model_parallel_size > 1`` (``allreduce=False``),
    at every expert-parallel size.

    megatron-core gives expert weights their own gradient buffers (reduced over the expert-data-parallel group) and
    their own optimizer in a chain only when experts are split over ranks. The optimizer's checkpoint then has two
    structures (one optimizer at EP1, a chain of two beyond), and a checkpoint saved at EP2 would not load at EP1.
    Marked always, experts have their own buffers and optimizer at every size: at EP1 the expert-data-parallel
    group is the data-parallel group, so the reduction and the update are the same arithmetic, and a checkpoint
    loads at any expert-parallel size."""
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False


def forget_aux_losses() -> None:
    """Empty megatron-core's auxiliary-loss tracker, a process global whose entries keep the layer count and process
    groups of the model that made them: a later model with more layers (a second fit, validation of another
    model, a test suite's reused ranks) indexed past them (``IndexError`` in ``save_to_aux_losses_tracker``), and a
    stage without MoE layers would reduce over an earlier fit's groups."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


class AuxLosses:
    """The router's auxiliary losses of one step, as logged values (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        types = config.moe_router_load_balancing_type
        types = types if isinstance(types, list) else [types]
        coeffs = config.moe_aux_loss_coeff
        coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(types)
        self.names = [_AUX_LOSS_NAMES[t] for t, c in zip(types, coeffs) if t in _AUX_LOSS_NAMES and c > 0]
        if config.moe_z_loss_coeff:
            self.names.append("z_loss")
        self.num_layers = config.num_layers + (config.mtp_num_layers or 0)  # as the routers size the tracker
        self.num_moe_layers = sum(moe_layer_pattern(config.num_layers, config.moe_layer_freq))
        forget_aux_losses()  # entries of an earlier fit in this process (see forget_aux_losses)

    def clear(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()

    def take(self, microbatches: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Each loss, reduced over ranks and averaged over MoE layers and microbatches; clears the tracker. A
        collective: every rank calls it after every training step (a stage without MoE layers contributes zeros)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import (
            get_moe_layer_wise_logging_tracker,
            reduce_aux_losses_tracker_across_ranks,
        )

        tracker = get_moe_layer_wise_logging_tracker()
        every_split = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        for name in self.names:  # the entry a stage without MoE layers lacks, with the groups the routers give it
            entry = tracker.setdefault(name, {"values": torch.zeros(self.num_layers, device=device)})
            if name == "z_loss":
                # Each router logs the mean over the tokens it routed and megatron-core reduces it over the
                # pipeline only (rank 0's share of the batch): averaged over the ranks that split the tokens
                # (tensor + sequence, data, context parallel), it is the mean over the global batch.
                entry.update(reduce_group=None, avg_group=every_split, reduce_group_has_dp=False)
                continue
            if name == "global_load_balancing_loss":
                group, has_dp = every_split, True
            else:
                group, has_dp = parallel_state.get_tensor_and_context_parallel_group(), False
            entry.setdefault("reduce_group", group)
            entry.setdefault("avg_group", None)
            entry.setdefault("reduce_group_has_dp", has_dp)
        reduce_aux_losses_tracker_across_ranks(self.names)
        taken = {
            name: tracker[name]["values"].float().sum() / (self.num_moe_layers * max(1, microbatches))
            for name in self.names
        }
        self.clear()
        return taken
