"""megatron-core's tensor-parallel all-reduce on torch's symmetric memory instead of NCCL's ring (GPUs in one node).

Why: at TP2 without sequence parallelism every layer's forward waits on two all-reduces of its full activation
(32 MiB for the 1.3B GPT at micro batch 4, sequence 2048): the row-parallel attention projection's and MLP's
outputs. Within one node, torch's two-shot all-reduce over symmetric memory moves such a tensor faster than
NCCL's ring (more NCCL channels do not close the gap), while the one-shot kind falls behind NCCL at these sizes
(the measurements: docs/guides/performance.md). megatron-core's own switch for these kernels
(``TransformerConfig.symmetric_ar_type``) exists only in its Transformer Engine layers, which this project does
not use.

Private APIs, kept to this module: ``torch.distributed._symmetric_memory`` (``empty``, ``rendezvous``) with the
``torch.ops.symm_mem`` all-reduce kernels, and ``megatron.core.tensor_parallel.mappings._reduce``, the function
through which megatron-core's layers all-reduce over the tensor-parallel group (``RowParallelLinear``'s and
``VocabParallelEmbedding``'s outputs, and the input gradient of a ``ColumnParallelLinear`` left to megatron-core).
:func:`install` replaces that function for a fit and :meth:`SymmetricAllReduce.restore` puts megatron-core's back
(listed in :mod:`.inventory`).
The layers ``layers.wgrad`` gives their own backward reduce their input gradients themselves, on NCCL
asynchronously under the weight-gradient GEMM; where :func:`installed_for` finds this replacement for their group
they call it after that GEMM instead, on the compute stream. The overlap they give up was not there to lose: a
profile of the graphed TP2 step shows the GPU's kernel time filling the whole step, with those input-gradient
all-reduces among them, so almost nothing ran beside them (docs/guides/performance.md).

The contract: :func:`install` replaces ``_reduce`` for one tensor-parallel group and returns a
:class:`SymmetricAllReduce`; its :meth:`~SymmetricAllReduce.restore` puts megatron-core's back. While installed, a
``_reduce`` over that group of a contiguous CUDA tensor whose bytes split evenly across the group's ranks is copied
into the group's symmetric buffer and reduced from there into the tensor itself, in place as NCCL's. Everything
else (another group, a tensor the buffer cannot hold during a CUDA graph capture) goes to NCCL, counted in
``fallbacks``. The buffer is allocated on first use and grown outside captures; ``rendezvous`` is a collective, and
every rank of the group reaches it in the same call, since tensor-parallel ranks reduce tensors of equal shape.
For two ranks the sum is the same in every bit as NCCL's (each element is one addition, in fp32, rounded once).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.tensor_parallel import mappings

__all__ = ["KINDS", "SymmetricAllReduce", "installed_for", "install"]

KINDS = ("two_shot", "one_shot")  # megatron-core's names for them (``symmetric_ar_type``)
_ALIGN = 16  # bytes each rank's share of the buffer starts on (the kernels' vector loads)
_GROW = 1 << 20  # the buffer grows in whole MiB, so a few sizes of activation share one allocation


class SymmetricAllReduce:
    """The installed replacement of ``mappings._reduce`` for ``group``: counts of symmetric and NCCL calls."""

    def __init__(self, group: Any, kind: str, original: Any) -> None:
        self.group, self.kind, self._original = group, kind, original
        self.calls = 0  # all-reduces made on symmetric memory
        self.fallbacks = 0  # all-reduces of the group left to NCCL
        self._buffer: Optional[torch.Tensor] = None

    def __call__(self, input_: torch.Tensor, group: Any) -> torch.Tensor:
        if group is not self.group or group.size() == 1:
            return self._original(input_, group)
        view = self._symmetric_view(input_)
        if view is None:
            self.fallbacks += 1
            return self._original(input_, group)
        flat = input_.view(-1)
        view.copy_(flat)
        name = self.group.group_name
        if self.kind == "two_shot":
            torch.ops.symm_mem.two_shot_all_reduce_out(view, "sum", name, flat)
        else:
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", name, flat)
        self.calls += 1
        return input_

    def _symmetric_view(self, input_: torch.Tensor) -> Optional[torch.Tensor]:
        """The first ``input_.nbytes`` of the group's buffer as a flat tensor of ``input_``'s dtype; None where the
        tensor cannot be reduced there (not CUDA, not contiguous, uneven shares, no room during a capture)."""
        nbytes = input_.numel() * input_.element_size()
        if not input_.is_cuda or not input_.is_contiguous() or nbytes % (_ALIGN * self.group.size()):
            return None
        if self._buffer is None or self._buffer.numel() < nbytes:
            if torch.cuda.is_current_stream_capturing():
                return None  # allocating and exchanging handles cannot be captured
            self._buffer = _allocate(-(-nbytes // _GROW) * _GROW, input_.device, self.group)
        return self._buffer[:nbytes].view(input_.dtype)

    def restore(self) -> None:
        """megatron-core's ``_reduce`` back; the buffer is freed."""
        if mappings._reduce is self:
            mappings._reduce = self._original
        self._buffer = None


def installed_for(group: Any) -> Optional[SymmetricAllReduce]:
    """The installed replacement if it serves ``group``, else None."""
    current = mappings._reduce
    return current if isinstance(current, SymmetricAllReduce) and current.group is group else None


def _allocate(nbytes: int, device: torch.device, group: Any) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group)
    return buffer


def install(group: Any, kind: str) -> SymmetricAllReduce:
    """Route megatron-core's all-reduces over ``group`` (a tensor-parallel group of CUDA ranks) through symmetric
    memory with ``kind`` (``"two_shot"`` or ``"one_shot"``) until :meth:`SymmetricAllReduce.restore`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(mappings._reduce, SymmetricAllReduce):
        mappings._reduce.restore()  # one replacement at a time: megatron-core's function is back
    replacement = SymmetricAllReduce(group, kind, mappings._reduce)
    mappings._reduce = replacement
    return replacement
