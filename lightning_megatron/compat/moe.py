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
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install"]


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
