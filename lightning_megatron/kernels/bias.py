"""Bias gradients: a single-pass column sum, and the autograd pieces that use it.

Contract:

* :func:`bias_grad` ``(grad_output) -> grad_bias``: the sum of ``grad_output`` over every dimension but the last
  (what autograd computes for a broadcast bias, and ``grad_output.sum(dim=0)`` in a linear's backward), in
  ``grad_output``'s dtype, accumulated in float32. On CUDA one Triton kernel reads ``grad_output`` once: each
  program sums a block of rows of a column strip into float32 registers; a second, small Triton kernel sums
  those few partial rows in a fixed order and rounds once into the output dtype (two launches in all, where
  ``partial.sum(0).to(dtype)`` took three). The tile shape depends on the width (:data:`TILES`, chosen by
  ``benchmarks/bias_grad_tiles.py``). Elsewhere it is ``grad_output.reshape(-1, n).sum(0)``: bit-for-bit
  autograd's reduction.
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

from dataclasses import dataclass
from typing import Optional

import torch

from lightning_megatron.kernels._triton import cdiv, empty, num_programs, tl, triton, use_triton

__all__ = ["GELU_TILES", "TILES", "Tile", "add_bias", "bias_dropout_add", "bias_gelu", "bias_grad", "tile_for"]


@dataclass(frozen=True)
class Tile:
    """One program's share of the column sums: ``block_n`` consecutive columns, ``block_m`` rows at a time,
    ``warps`` warps, and ``per_sm`` programs per multiprocessor (more keeps more loads in flight)."""

    block_m: int = 32
    block_n: int = 256
    warps: int = 4
    per_sm: int = 4


# (widest row in columns, tile), narrowest first; the last one also beyond. See ``tile_for``. Chosen by
# ``benchmarks/bias_grad_tiles.py`` ([8192, width] bf16, CUDA-graph replays) as the tiles that beat ATen's column sum,
# and megatron-core's GeLU backward plus ATen's sum, over the widths models use (the bias-GeLU wants narrower tiles:
# more registers per element); the timings: docs/guides/performance.md.
TILES: list[tuple[int, Tile]] = [(2048, Tile(128, 64, 4, 8)), (1 << 62, Tile(128, 128, 8, 4))]
GELU_TILES: list[tuple[int, Tile]] = [(8192, Tile(32, 128, 4, 8)), (1 << 62, Tile(32, 128, 4, 16))]


def tile_for(n: int, gelu: bool = False) -> Tile:
    """The tile for rows ``n`` wide: of the plain column sum, or (``gelu``) of the bias-GeLU backward."""
    table = GELU_TILES if gelu else TILES
    return next((tile for widest, tile in table if n <= widest), table[-1][1])


def bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """``grad_output`` summed over all dimensions but the last, in its dtype (float32 accumulation)."""
    n = grad_output.shape[-1]
    g = grad_output.reshape(-1, n)
    if not use_triton(g) or g.shape[0] == 0:
        return g.sum(0)
    if not g.is_contiguous():
        g = g.contiguous()
    return _column_sums(g, None, None, out_dtype=g.dtype)


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
            return dx.view(x.shape), _column_sums(g, y, bias, dx, out_dtype=bias.dtype)
        from megatron.core.fusions.fused_bias_gelu import bias_gelu_back

        dx = bias_gelu_back(dy, bias, x)
        return dx, bias_grad(dx).to(bias.dtype)


def _column_sums(g, y, bias, dx=None, *, out_dtype: torch.dtype, tile: Optional[Tile] = None):  # noqa: ANN001, ANN202
    """The column sums ``[n]`` of ``g`` in ``out_dtype`` (or, with ``y``/``bias``/``dx``, of the bias-GeLU input
    gradient it writes into ``dx``): float32 partial sums per block of rows, then one pass over them."""
    rows, n = g.shape
    gelu = y is not None
    tile = tile or tile_for(n, gelu)
    strips = cdiv(n, tile.block_n)
    row_blocks = max(1, min(cdiv(num_programs(g.device, per_sm=tile.per_sm), strips), cdiv(rows, tile.block_m)))
    rows_per_program = cdiv(cdiv(rows, row_blocks), tile.block_m) * tile.block_m
    row_blocks = cdiv(rows, rows_per_program)
    partial = empty((row_blocks, n), like=g, dtype=torch.float32)
    _column_sum_kernel[(row_blocks, strips)](
        g,
        y if gelu else g,
        bias if gelu else g,
        dx if gelu else g,
        partial,
        rows,
        n,
        ROWS_PER_PROGRAM=rows_per_program,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        GELU=gelu,
        num_warps=tile.warps,
    )
    out = empty((n,), like=g, dtype=out_dtype)
    _finish_kernel[(cdiv(n, FINISH_COLS),)](partial, out, row_blocks, n, BLOCK_R=FINISH_ROWS, BLOCK_N=FINISH_COLS)
    return out


FINISH_ROWS, FINISH_COLS = 16, 128  # the second stage's tile: a few partial rows of 128 columns at a time


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

    @triton.jit
    def _finish_kernel(PARTIAL, OUT, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """OUT[c] = sum over r of PARTIAL[r, c], in float32 and in a fixed order, rounded once to OUT's dtype."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        for first in range(0, R, BLOCK_R):
            rows = first + tl.arange(0, BLOCK_R)
            mask = (rows < R)[:, None] & col_mask[None, :]
            acc += tl.load(PARTIAL + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
        tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)
