"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materializes the full ``[batch, heads, seq, seq]`` score
matrix with ``baddbmm``, a separate softmax and ``bmm`` — without Transformer Engine that unfused path is
what made megatron-core's GPT much slower than a plain PyTorch model (docs/evaluation/throughput.md).
PyTorch's SDPA picks a fused kernel (FlashAttention or memory-efficient attention on GPUs) for the same math:
causal masking, GQA, dropout, the same softmax scale. This class keeps ``DotProductAttention``'s constructor
(head partitioning under tensor parallelism, scale, dropout) and replaces only the computation.

Under context parallelism (``context_parallel_size > 1``) each rank holds two chunks of every sequence, and the
computation is ring attention over SDPA blocks (:mod:`lightning_megatron.context.ring_attention`): the same
causal attention over the whole sequence, which megatron-core's own attention offers only through Transformer
Engine.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from lightning_megatron.context.ring_attention import ring_attention
from lightning_megatron.errors import MegatronConfigError

__all__ = ["SDPAttention"]


class SDPAttention(DotProductAttention):
    """Drop-in core attention for megatron-core layer specs (``core_attention=SDPAttention``)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, *args, **kwargs) -> None:  # noqa: ANN001
        context, given = config.context_parallel_size, config
        if context > 1:
            # DotProductAttention refuses context parallelism (its unfused path cannot do it); this class can, and
            # the constructor's head and scale bookkeeping does not depend on it.
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        if context > 1:
            self.config = given  # the model's config (megatron-core's modules read it, e.g. for RoPE)
            if self.attention_dropout.p > 0:
                raise MegatronConfigError(
                    f"attention_dropout={self.attention_dropout.p} is not supported with context_parallel_size="
                    f"{context} (ring attention has no dropout): set attention_dropout=0."
                )
        if self.config.window_size is not None or self.config.softmax_type != "vanilla":
            raise MegatronConfigError(
                "layer_spec='sdpa' supports full causal attention with the vanilla softmax; use layer_spec='local' "
                "for sliding-window attention or other softmax types."
            )
        # megatron-core divides the scale by the layer number and multiplies it back inside its softmax.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        self.gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[object] = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise MegatronConfigError("layer_spec='sdpa' does not take packed sequences or attention biases.")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # megatron-core: [seq, batch, heads, head_dim]; SDPA: [batch, heads, seq, head_dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        seq, batch = query.shape[0], query.shape[1]
        # Read per call: generation runs whole sequences with the config at CP1 (context.whole_sequences).
        if self.config.context_parallel_size > 1:
            if mask_type != AttnMaskType.causal or attention_mask is not None:
                raise MegatronConfigError(
                    "context_parallel_size > 1 runs causal attention without an explicit mask (ring attention); "
                    "this call passed an attention mask or a non-causal mask type."
                )
            group = getattr(self.pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
            context = ring_attention(q, k, v, group=group, scale=self.sdpa_scale)
            return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        # megatron-core's masks are True where attention is *not* allowed; SDPA's boolean masks the opposite.
        mask = None if attention_mask is None else ~attention_mask
        dropout = self.attention_dropout.p if self.training else 0.0

        def attend() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.sdpa_scale, enable_gqa=self.gqa
            )

        if dropout > 0 and not self.config.sequence_parallel:
            # As DotProductAttention: dropout inside the tensor-parallel region draws from the TP RNG stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)
