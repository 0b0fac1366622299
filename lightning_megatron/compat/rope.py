"""megatron-core's fused-RoPE hook, filled with ``kernels.rope`` when Transformer Engine is absent.

Why: ``TransformerConfig(apply_rope_fusion=True)`` calls ``rope_utils.fused_apply_rotary_pos_emb``, a module global
that megatron-core imports from Transformer Engine and leaves ``None`` without it (the config then refuses the
setting). There is no public way to hand megatron-core another fused RoPE, so ``install`` sets that global, and
only while it is ``None``: Transformer Engine's kernel is kept when present.
"""

from __future__ import annotations

__all__ = ["install"]


def install() -> None:
    """Idempotent: after it, ``apply_rope_fusion=True`` works with or without Transformer Engine."""
    from megatron.core.models.common.embeddings import rope_utils

    from lightning_megatron.kernels.rope import apply_rotary_pos_emb

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = apply_rotary_pos_emb
