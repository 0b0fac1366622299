"""Bias gradients: a single-pass column sum, and the autograd pieces that use it.

Contract:

* :func:`bias_grad` ``(grad_output) -> grad_bias``: the sum of ``grad_output`` over every dimension but the last
  (what autograd computes for a broadcast bias, and ``grad_output.sum(dim=0)`` in a linear's backward), in
  ``grad_output``'s dtype, accumulated in float32. On CUDA one Triton kernel reads ``grad_output`` once: each
  program sums a block of rows of a column strip into float32 registers, then a second stage sums the few
  partial rows. Elsewhere it is ``grad_output.reshape(-1, n).sum(0)``: bit-for-bit autograd's reduction.
  Call it from any backward that holds a 2-D or N-D output gradient (for example a linear layer's
  ``grad_bias = bias_grad(grad_output) if use_bias else None``).
* :func:`add_bias` ``(x, bias)``: ``x + bias`` whose backward passes ``dy`` through to ``x`` and takes the bias
  gradient with :func:`bias_grad`.
* :func:`bias_gelu` ``(x, bias)``: megatron-core's fused bias-GeLU (tanh approximation, its own compiled
  forward); on CUDA its backward is one Triton kernel that writes the GeLU input gradient and sums it into the
  bias gradient in the same pass (megatron-core runs the GeLU backward, then autograd reads its output again
  for the bias). Elsewhere megatron-core's ``bias_gelu_back`` then :func:`bias_grad`: megatron-core's
  arithmetic exactly.
* :func:`bias_dropout_add` ``(x, bias, residual)``: megatron-core's bias-dropout-add at dropout 0 in training,
  ``residual + (x + bias)``, whose backward is ``dy`` for ``x`` and ``residual`` and :func:`bias_grad` for the
  bias (no elementwise kernel at all in the backward).
"""

from __future__ import annotations

import torch

from lightning_megatron.kernels._triton import cdiv, empty, num_programs, tl, triton, use_triton

__all__ = ["add_bias", "bias_dropout_add", "bias_gelu", "bias_grad"]

BLOCK_ROWS, BLOCK_COLS = 32, 256  # one tile of the column sums: 256 consecutive columns x 32 rows


def bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """``grad_output`` summed over all dimensions but the last, in its dtype (float32 accumulation)."""
    n = grad_output.shape[-1]
    g = grad_output.reshape(-1, n)
    if not use_triton(g) or g.shape[0] == 0:
        return g.sum(0)
    if not g.is_contiguous():
        g = g.contiguous()
    partial = _column_sums(g, None, None)
    return partial.sum(0).to(g.dtype)


def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x + bias`` (bias over the last dimension) with the bias gradient through :func:`bias_grad`."""
    return _AddBias.apply(x, bias)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``bias_gelu_impl(x, bias)`` with the bias gradient fused into the GeLU backward."""
    return _BiasGelu.apply(x, bias)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + (x + bias)``: megatron-core's training bias-dropout-add at dropout probability 0."""
    if residual.dtype != x.dtype:  # what megatron-core does (an fp32 residual under bf16)
        residual = residual.to(x.dtype)
    return _BiasAddResidual.apply(x, bias, residual)


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):  # noqa: ANN001, ANN205
        return x + bias

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        return dy, bias_grad(dy)


class _BiasAddResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual):  # noqa: ANN001, ANN205
        return residual + (x + bias)  # megatron-core's order: x + bias first, then the residual

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        return dy, bias_grad(dy), dy


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):  # noqa: ANN001, ANN205
        from megatron.core.fusions.fused_bias_gelu import bias_gelu as forward

        ctx.save_for_backward(x, bias)
        return forward(bias, x)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, bias = ctx.saved_tensors
        n = x.shape[-1]
        if use_triton(x) and x.numel() > 0:
            g = dy.reshape(-1, n)
            y = x.reshape(-1, n)
            g, y = (t if t.is_contiguous() else t.contiguous() for t in (g, y))
            dx = empty(y.shape, like=y)
            partial = _column_sums(g, y, bias, dx)
            return dx.view(x.shape), partial.sum(0).to(bias.dtype)
        from megatron.core.fusions.fused_bias_gelu import bias_gelu_back

        dx = bias_gelu_back(dy, bias, x)
        return dx, bias_grad(dx).to(bias.dtype)


def _column_sums(g, y, bias, dx=None):  # noqa: ANN001, ANN202
    """Float32 partial column sums ``[programs, n]`` of ``g`` (or, with ``y``/``bias``/``dx``, of the bias-GeLU
    input gradient it writes into ``dx``)."""
    rows, n = g.shape
    strips = cdiv(n, BLOCK_COLS)
    row_blocks = max(1, min(cdiv(num_programs(g.device, per_sm=4), strips), cdiv(rows, BLOCK_ROWS)))
    rows_per_program = cdiv(cdiv(rows, row_blocks), BLOCK_ROWS) * BLOCK_ROWS
    row_blocks = cdiv(rows, rows_per_program)
    partial = empty((row_blocks, n), like=g, dtype=torch.float32)
    gelu = y is not None
    _column_sum_kernel[(row_blocks, strips)](
        g,
        y if gelu else g,
        bias if gelu else g,
        dx if gelu else g,
        partial,
        rows,
        n,
        ROWS_PER_PROGRAM=rows_per_program,
        BLOCK_M=BLOCK_ROWS,
        BLOCK_N=BLOCK_COLS,
        GELU=gelu,
        num_warps=4,
    )
    return partial


if triton is not None:

    @triton.jit
    def _column_sum_kernel(
        G,
        Y,
        B,
        DX,
        PARTIAL,
        M,
        N,
        ROWS_PER_PROGRAM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GELU: tl.constexpr,
    ):
        row_block = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # reduced across rows once, at the end
        first = row_block * ROWS_PER_PROGRAM
        if GELU:
            bias = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        for i in range(0, ROWS_PER_PROGRAM, BLOCK_M):
            rows = first + i + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & col_mask[None, :]
            offsets = rows[:, None] * N + cols[None, :]
            g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
            if GELU:
                # megatron-core's bias_gelu_back: the derivative of the tanh GeLU at x = y + bias, times g
                x = tl.load(Y + offsets, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
                inner = 0.79788456 * x * (1 + 0.044715 * x * x)
                tanh_out = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
                ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
                dx = (ff * g).to(DX.dtype.element_ty)
                tl.store(DX + offsets, dx, mask=mask)
                g = tl.where(mask, dx.to(tl.float32), 0.0)  # the bias gradient sums the rounded input gradient
            acc += g
        tl.store(PARTIAL + row_block * N + cols, tl.sum(acc, axis=0), mask=col_mask)
