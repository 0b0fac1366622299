"""Rotary position embedding as one fused kernel forward and one backward.

Contract: ``apply_rotary_pos_emb(t, freqs, interleaved=False)`` is megatron-core's non-interleaved RoPE of
``t`` (``[seq, batch, heads, dim]``) by ``freqs`` (``[seq, 1, 1, rot_dim]``, fp32): the first ``rot_dim`` channels
rotated (``t * cos + rotate_half(t) * sin``), the rest passed through. It has the signature megatron-core expects of
Transformer Engine's ``fused_apply_rotary_pos_emb`` (``compat.rope`` installs it there when TE is absent).

Why: without Transformer Engine, megatron-core applies RoPE to the queries and keys of every layer with eager ops:
cos and sin of the frequencies, a chunk, a negation and a concatenation for the rotated half, two products, a
sum and a concatenation with the pass-through channels; each a pass over the query or key tensor, forward and
backward (the ``mul``/``cat``/``neg`` rows of a Llama-style profile). Compiled, the same expression is one kernel
each way. It computes in fp32 and rounds once (as Transformer Engine's kernel does), where the eager path rounds
cos and sin and every intermediate to the activations' dtype: equal in fp32, within bf16 rounding in bf16.
On CPUs it runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

__all__ = ["apply_rotary_pos_emb"]


def _rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    rot_dim = freqs.shape[-1]
    x = t[..., :rot_dim].float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (x * torch.cos(freqs) + rotated * torch.sin(freqs)).to(t.dtype)
    if rot_dim == t.shape[-1]:
        return out
    return torch.cat((out, t[..., rot_dim:]), dim=-1)


_compiled: Optional[Callable[..., Any]] = None


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE of ``t`` by ``freqs`` (see the module docstring); compiled on GPUs."""
    global _compiled
    if interleaved:
        raise NotImplementedError(
            "apply_rotary_pos_emb: interleaved rotary embeddings are not fused here; set "
            "transformer_config_overrides={'apply_rope_fusion': False} for rotary_interleaved=True."
        )
    if not t.is_cuda:
        return _rope(t, freqs)
    if _compiled is None:
        _compiled = torch.compile(_rope, dynamic=False)
    return _compiled(t, freqs)
