"""An MoE layer's experts as two grouped GEMMs (``torch._grouped_mm``), without Transformer Engine or ``grouped_gemm``.

megatron-core runs an MoE layer's local experts one after the other (``SequentialMLP``: two GEMMs and an activation
per expert, each a kernel launch and a pass over that expert's few tokens) or, as grouped GEMMs, through Transformer
Engine (``TEGroupedMLP``) or the ``grouped_gemm`` package (``GroupedMLP``, deprecated, bf16 only, its optimizer state
incompatible with ``SequentialMLP``'s checkpoints). torch has its own grouped GEMM (``torch._grouped_mm``: one kernel
for all experts, the token counts as offsets, with autograd), for bf16.

:class:`GroupedGemmExperts` *is* a ``SequentialMLP``: the same parameters (one ``MLP`` per local expert), the same
sharded state dict, so weights and optimizer state are checkpointed alike and either class loads the other's
checkpoints. Only the forward differs: the local experts' ``linear_fc1`` weights are stacked into ``[experts, in,
out]`` and run as one grouped GEMM over the tokens sorted by expert (what the dispatcher hands the experts), then the
activation scaled by the router's weights, then ``linear_fc2`` the same way. The stacking copies the local expert
weights once per forward (their gradients flow back through it to each expert's parameter); for the sizes MoE layers
have, that is one more read of weights the GEMMs read anyway.

Where ``torch._grouped_mm`` does not run (other dtypes than bf16, a single local expert, biases, widths that are
not multiples of 8, a clamped or offset activation, GPUs older than sm80) the forward is ``SequentialMLP``'s. The
experts' linears do no communication of their own (megatron-core marks them ``explicit_expert_comm``; the
dispatcher gathers and scatters tokens over the expert tensor-parallel group), so the grouped GEMMs are the whole
computation at any layout.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

__all__ = ["GroupedGemmExperts", "grouped_gemm_available"]


def grouped_gemm_available(dtype: torch.dtype) -> bool:
    """Whether this torch has a grouped GEMM for ``dtype`` (bf16: ``torch._grouped_mm``)."""
    return dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _grouped_gemm_runs(hidden: torch.Tensor, experts: torch.nn.ModuleList, config: object) -> bool:
    """Whether this layer's expert GEMMs can be grouped: bf16, more than one local expert, no biases, the experts'
    plain activation (no clamp or GLU offset, which ``SequentialMLP``'s MLPs apply), every width a multiple of 8
    elements (``torch._grouped_mm`` reads rows whose strides are multiples of 16 bytes), and on GPUs one whose
    grouped GEMM kernel exists (compute capability 8.0 or newer)."""
    if len(experts) == 1 or not grouped_gemm_available(hidden.dtype):
        return False
    if config.add_bias_linear or config.moe_apply_probs_on_input or config.fp8 or config.fp4:
        return False
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0):
        return False
    widths = (*experts[0].linear_fc1.weight.shape, *experts[0].linear_fc2.weight.shape)
    if any(width % 8 for width in widths):
        return False
    return hidden.device.type != "cuda" or torch.cuda.get_device_capability(hidden.device) >= (8, 0)


class GroupedGemmExperts(SequentialMLP):
    """``SequentialMLP`` with its local experts' GEMMs grouped (see the module docstring)."""

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        hidden = permuted_local_hidden_states
        config = self.config
        if not _grouped_gemm_runs(hidden, self.local_experts, config):
            return super().forward(hidden, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert, device="cpu").to(torch.int64)
        offsets = torch.cumsum(counts, 0).to(device=hidden.device, dtype=torch.int32)
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts]).transpose(1, 2)
        intermediate = torch._grouped_mm(hidden, fc1, offs=offsets)
        if config.gated_linear_unit:
            gate, linear = torch.chunk(intermediate, 2, dim=-1)
            intermediate = config.activation_func(gate) * linear
        else:
            intermediate = config.activation_func(intermediate)
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(hidden.dtype)
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts]).transpose(1, 2)
        return torch._grouped_mm(intermediate, fc2, offs=offsets), None
