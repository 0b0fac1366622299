"""megatron-core 0.16.1's MoE layer without Transformer Engine, and on CPUs.

Two things stop it there:

* The router's gating linear (``moe_utils.RouterGatingLinearFunction``) tests ``te_general_gemm is not None`` in its
  forward and backward to choose between Transformer Engine's GEMM and ``torch.mm``, but ``moe_utils`` defines that
  name only inside its ``try: import transformer_engine`` block: without Transformer Engine every MoE forward
  raises ``NameError: name 'te_general_gemm' is not defined``. ``install`` defines the global as ``None`` where it
  is missing, so the function takes its ``torch.mm`` path; with Transformer Engine nothing changes.
* The all-to-all dispatcher hands its split sizes to ``torch.distributed.all_to_all_single`` after
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors: on CPUs the sizes stay
  tensors, which c10d rejects (``all_to_all_single(): incompatible function arguments``). The dispatcher's copy of
  that function is replaced by one that also converts CPU tensors when asked for numpy; CUDA tensors go to the
  original.

And one that is megatron-core's arithmetic, not its environment: with ``calculate_per_token_loss`` (this
project's loss contract) a router scales its load-balancing and z-losses by the tokens *it* routed before their
gradients join the main loss's, which are divided by the global token count. Where the tokens of a microbatch are
split over ranks (sequence parallelism over the tensor-parallel ranks, context parallelism), each rank's loss is
its part of the whole microbatch's, but it is scaled by its share of the tokens: the router losses' gradients came
out ``1 / (TP x CP)`` of one process's (at TP2 + SP their weight was half of what ``moe_aux_loss_coeff`` says).
``scale_router_loss_gradients(split)`` makes ``MoEAuxLossAutoScaler.set_loss_scale``, which the schedules call
before every microbatch's backward with the main loss's scale, multiply that scale by the number of ranks the
tokens are split over, for the fit's duration.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install", "scale_router_loss_gradients"]


def install() -> None:
    """Idempotent; only defines what megatron-core left undefined, and converts only what it left unconverted."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if token_dispatcher.maybe_move_tensor_to_cpu is not _maybe_move_tensor_to_cpu:
        global _original
        _original = token_dispatcher.maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu


_original: Any = None


def _maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
        return tensor.numpy()
    return _original(tensor, as_numpy=as_numpy, record_stream=record_stream)


_router_split = 1
_set_loss_scale_original: Any = None


def scale_router_loss_gradients(split: int) -> None:
    """The router losses' gradients times ``split`` (the ranks a microbatch's tokens are split over) from now on;
    ``split=1`` puts megatron-core's ``set_loss_scale`` back."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    global _router_split, _set_loss_scale_original
    _router_split = int(split)
    installed = _set_loss_scale_original is not None
    if _router_split != 1 and not installed:
        _set_loss_scale_original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(_set_loss_scale)
    elif _router_split == 1 and installed:
        MoEAuxLossAutoScaler.set_loss_scale = _set_loss_scale_original
        _set_loss_scale_original = None


def _set_loss_scale(scale: torch.Tensor) -> None:
    _set_loss_scale_original.__func__(scale * _router_split)
