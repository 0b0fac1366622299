"""Whether this package's Triton kernels run for a tensor.

Contract: :func:`use_triton` is true for a CUDA tensor when Triton imports, and, under ``TRITON_INTERPRET=1``
(Triton's CPU interpreter, which the CPU tests use to run the kernels' own code), for a CPU tensor too.
``LM_FUSED_KERNELS=torch`` forces the torch fallbacks everywhere (to compare the two on one GPU). Nothing
here launches anything; importing this module never fails without Triton. :func:`empty` allocates every
buffer a kernel writes; with ``POISON["on"]`` (tests) it fills them with NaN first, so an element a kernel
never writes shows up.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

try:  # Triton ships with CUDA builds of torch; CPU wheels have none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["POISON", "cdiv", "empty", "num_programs", "tl", "triton", "use_triton"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    if triton is None or os.environ.get("LM_FUSED_KERNELS") == "torch":
        return False
    return tensor.is_cuda or (_INTERPRET and tensor.device.type == "cpu")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_programs(device: torch.device, per_sm: int = 2) -> int:
    """How many persistent programs fill ``device`` (``per_sm`` per multiprocessor; 8 on the interpreter)."""
    if device.type != "cuda":
        return 8
    return per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


POISON: dict[str, bool] = {"on": False}


def empty(shape: Any, *, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An output buffer on ``like``'s device (NaN-filled while ``POISON["on"]``)."""
    out = torch.empty(shape, device=like.device, dtype=dtype or like.dtype)
    return out.fill_(float("nan")) if POISON["on"] else out
