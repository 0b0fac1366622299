"""Fused kernels for the local/sdpa layer specs: norms, bias gradients, cross-entropy and RoPE (issue 17).

Every kernel here computes the same function as the unfused torch ops it replaces, within bf16 rounding on
GPUs and within float32 reordering on CPUs (each module states its exact contract):

* :mod:`.norms`: LayerNorm and RMSNorm whose backward computes the input gradient and the per-block partial
  weight/bias gradients in one pass over the saved input and the output gradient (Apex/TE style), instead of
  ATen's two passes (``layer_norm_grad_input`` + ``GammaBetaBackward``); and ``residual_norm``, the
  bias-dropout-add (dropout 0) and the norm after it as one op, whose backward also adds the residual
  gradient and sums the bias gradient in the norm's backward kernel.
* :mod:`.bias`: the bias-gradient column sum as a single-pass two-stage reduction, and the autograd pieces
  that route each linear layer's bias gradient through it (the qkv/fc1 linears, the bias-GeLU and the
  bias-dropout-add of megatron-core's transformer layer).
* :mod:`.layers`: the megatron-core modules (norm, linear, MLP, bias-dropout-add, transformer layer) the layer
  specs use when the ``GPTModule(fused_norms=..., fused_bias_grad=..., fused_residual_norm=...)`` settings are on.
* :mod:`.cross_entropy`: the vocabulary-parallel cross-entropy that reads the logits once forward and once
  backward (compiled on GPUs), the loss of ``GPTModule`` wherever ``fuse_kernels`` applies.
* :mod:`.rope`: rotary position embedding as one compiled kernel each way, megatron-core's ``apply_rope_fusion``
  kernel where Transformer Engine is absent.
* :mod:`._triton`: whether Triton kernels run for a given tensor (CUDA and Triton; on CPUs the torch fallbacks
  run, with the same arithmetic as the kernels).
"""

from lightning_megatron.kernels.bias import bias_dropout_add, bias_gelu, bias_grad
from lightning_megatron.kernels.norms import FusedLayerNorm, FusedRMSNorm, layer_norm, residual_norm, rms_norm

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "bias_dropout_add",
    "bias_gelu",
    "bias_grad",
    "layer_norm",
    "residual_norm",
    "rms_norm",
]
