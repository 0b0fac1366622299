"""The megatron-core modules the local/sdpa layer specs use with the fused kernels on.

Contract (each is a drop-in for the megatron-core module named, same parameters and checkpoints, same
function; only where the bias gradient or the norm's backward is computed changes):

* :func:`fused_norm` ``(config, hidden_size, eps)``: :class:`~.norms.FusedLayerNorm` or
  :class:`~.norms.FusedRMSNorm` for ``config.normalization`` (what ``specs.SequenceParallelNorm`` builds with
  ``fused=True``).
* :class:`BiasGradColumnParallelLinear`: ``ColumnParallelLinear`` (the qkv projection) that adds its own bias
  after the GEMM through :func:`~.bias.add_bias`, so its bias gradient is the single-pass column sum
  instead of ``grad_output.sum(dim=0)`` inside the linear's backward. Layers that gather their output or skip
  the bias add are left as they are.
* :class:`BiasGradMLP`: megatron-core's ``MLP`` whose fc1 bias goes through :func:`~.bias.bias_gelu`
  (with ``bias_activation_fusion`` and the tanh GeLU) or :func:`~.bias.add_bias` (unfused, non-gated
  activations); every other case (gated units, per-token scales, TE activations, no bias) is megatron-core's.
* :func:`get_bias_dropout_add` ``(training, fused)``: megatron-core's ``get_bias_dropout_add``, except that a
  training call with a bias and dropout probability 0 goes through :func:`~.bias.bias_dropout_add`.
* :class:`ResidualNormBDA`, :class:`ResidualNormTransformerLayer` and :func:`link_residual_norms`: a
  bias-dropout-add and the norm after it as one op (:func:`~.norms.residual_norm`) in training at dropout 0.
  The layer links its attention bias-dropout-add to its pre-MLP norm when it is built;
  :func:`link_residual_norms` ``(model)`` links each layer's MLP bias-dropout-add to the next layer's input norm
  (the last one to the block's final norm), once the model is built (``GPTModule.build_chunk`` calls it). The
  norm takes the output handed over only for the very tensor it was computed from, so a missing or wrong link
  costs speed, never correctness. Everything else (evaluation, dropout > 0, a norm that is not fused,
  cross-attention layers) runs unfused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add as _megatron_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.kernels.bias import add_bias, bias_dropout_add, bias_gelu
from lightning_megatron.kernels.norms import FusedLayerNorm, FusedRMSNorm, residual_norm

__all__ = [
    "BiasGradColumnParallelLinear",
    "BiasGradMLP",
    "ResidualNormBDA",
    "ResidualNormTransformerLayer",
    "fused_norm",
    "get_bias_dropout_add",
    "link_residual_norms",
]


def fused_norm(config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
    if config.normalization == "LayerNorm":
        return FusedLayerNorm(hidden_size, eps=eps)
    if config.normalization == "RMSNorm":
        return FusedRMSNorm(hidden_size, eps=eps)
    raise MegatronConfigError(
        f"normalization={config.normalization!r} has no fused kernel; use 'LayerNorm' or 'RMSNorm', "
        "or turn fused_norms off."
    )


class BiasGradColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose bias is added after the GEMM by :func:`~.bias.add_bias`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Only where the bias would be added to this rank's output slice anyway: not skipped, not gathered.
        self.adds_own_bias = self.bias is not None and not self.skip_bias_add and not self.gather_output
        if self.adds_own_bias:
            self.skip_bias_add = True  # megatron-core then returns the bias instead of adding it in the GEMM

    def forward(
        self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.adds_own_bias:
            return super().forward(input_, weight, runtime_gather_output)
        if runtime_gather_output:
            raise MegatronConfigError(
                "BiasGradColumnParallelLinear cannot gather its output at run time (its bias is added to this "
                "rank's slice); build the layer with gather_output=True or turn fused_bias_grad off."
            )
        output, bias = super().forward(input_, weight, runtime_gather_output)
        return add_bias(output, bias), None


class BiasGradMLP(MLP):
    """megatron-core's ``MLP`` with the fc1 bias gradient from the fused kernels (see the module docstring).

    Its submodules default to the local spec's (``ColumnParallelLinear`` fc1, ``RowParallelLinear`` fc2), so a
    layer spec names the class itself: megatron-core's ``TransformerLayer`` builds a plain class with default
    arguments (the default tensor-parallel group, which is the one it would pass), where a ``ModuleSpec`` of an
    ``MLP`` subclass would log "Unknown MLP type" for every layer.
    """

    def __init__(self, config: TransformerConfig, submodules: Optional[MLPSubmodules] = None, **kwargs: Any) -> None:
        if submodules is None:
            submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        super().__init__(config, submodules, **kwargs)

    def forward(
        self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None, **kwargs: Any
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        config = self.config
        fc1 = self.linear_fc1
        plain = (
            per_token_scale is None
            and not config.use_te_activation_func
            and not config.gated_linear_unit
            and getattr(fc1, "bias", None) is not None
            and getattr(fc1, "skip_bias_add", False)
            and (not config.bias_activation_fusion or self.activation_func == F.gelu)
        )
        if not plain:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = fc1(hidden_states)
        if config.bias_activation_fusion:
            intermediate = bias_gelu(intermediate, bias)
        else:
            intermediate = self.activation_func(add_bias(intermediate, bias))
        return self.linear_fc2(intermediate)


def get_bias_dropout_add(training: bool, fused: bool) -> Callable[..., torch.Tensor]:
    """megatron-core's ``get_bias_dropout_add`` with the bias gradient through the fused column sum."""
    megatron = _megatron_bias_dropout_add(training, fused)
    if not training:
        return megatron

    def _bias_dropout_add(
        x_with_bias: tuple[torch.Tensor, Optional[torch.Tensor]], residual: torch.Tensor, prob: float
    ) -> torch.Tensor:
        x, bias = x_with_bias
        if bias is None or prob > 0.0:
            return megatron(x_with_bias, residual, prob)
        return bias_dropout_add(x, bias, residual)

    return _bias_dropout_add


class ResidualNormBDA:
    """A bias-dropout-add (megatron-core's call: ``bda(training, fused)(x_with_bias, residual, prob)``) that, once
    :attr:`norm` is linked, also computes that norm of its output and hands it over (see the module docstring).
    ``bias_grad``: when it runs unfused, use :func:`get_bias_dropout_add` rather than megatron-core's."""

    def __init__(self, bias_grad: bool = False) -> None:
        self.bias_grad = bias_grad
        self.norm: Optional[torch.nn.Module] = None  # set by ResidualNormTransformerLayer

    def __call__(self, training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        unfused = (get_bias_dropout_add if self.bias_grad else _megatron_bias_dropout_add)(training, fused)
        norm = self.norm
        if not training or norm is None:
            return unfused

        def _bias_dropout_add_norm(
            x_with_bias: tuple[torch.Tensor, Optional[torch.Tensor]], residual: torch.Tensor, prob: float
        ) -> torch.Tensor:
            x, bias = x_with_bias
            if prob > 0.0:
                return unfused(x_with_bias, residual, prob)
            rms = isinstance(norm, FusedRMSNorm)
            h, y = residual_norm(x, bias, residual, norm.weight, None if rms else norm.bias, norm.eps, rms)
            norm.hand_over(h, y)
            return h

        return _bias_dropout_add_norm


class ResidualNormTransformerLayer(TransformerLayer):
    """megatron-core's ``TransformerLayer`` whose attention bias-dropout-add computes the pre-MLP norm too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        bda = self.self_attn_bda
        if (
            isinstance(bda, ResidualNormBDA)
            and isinstance(self.pre_mlp_layernorm, (FusedLayerNorm, FusedRMSNorm))
            and isinstance(self.pre_cross_attn_layernorm, IdentityOp)  # nothing between the two
            and isinstance(self.cross_attention, IdentityOp)
        ):
            bda.norm = self.pre_mlp_layernorm


def link_residual_norms(model: torch.nn.Module) -> int:
    """Link every MLP bias-dropout-add of ``model``'s transformer blocks to the norm after it (the next layer's
    input norm, or the block's final norm after the last layer); returns how many links were made."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    linked = 0
    for block in model.modules():
        if not isinstance(block, TransformerBlock):
            continue
        layers = list(block.layers)
        for layer, following in zip(layers, [*layers[1:], None]):
            norm = following.input_layernorm if following is not None else block.final_layernorm
            bda = getattr(layer, "mlp_bda", None)
            if isinstance(bda, ResidualNormBDA) and isinstance(norm, (FusedLayerNorm, FusedRMSNorm)):
                bda.norm = norm
                linked += 1
    return linked
