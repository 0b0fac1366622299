"""LayerNorm and RMSNorm with a one-pass backward (input gradient and weight/bias gradients together).

Contract:

* :func:`layer_norm` ``(x, weight, bias, eps)`` and :func:`rms_norm` ``(x, weight, eps)`` compute
  ``torch.nn.functional.layer_norm`` / ``rms_norm`` over the last dimension, with their gradients for ``x``,
  ``weight`` and ``bias``. The output has ``x``'s dtype, the weight gradients the weights' dtypes. Statistics
  and all arithmetic are in float32 (float64 for float64 inputs), rounded once at the end, as ATen's CUDA
  kernels do.
* On CUDA (Triton available) the forward is one Triton kernel per row (output, mean, rstd); the backward is one
  persistent Triton kernel in which each program walks a block of rows, writes the rows' input gradient and
  keeps the block's partial ``sum(dy * xhat)`` and ``sum(dy)`` in registers; a small second stage sums the
  ``programs x hidden`` float32 partials. So ``x`` and ``dy`` are read once, where ATen reads both twice
  (``layer_norm_grad_input`` then ``GammaBetaBackward``).
* Elsewhere (CPUs) the same formulas run as torch ops: equal to ATen within float32 reordering (the tests
  hold them to 1e-6), no speed-up.
* :func:`residual_norm` ``(x, x_bias, residual, weight, bias, eps, rms) -> (h, y)``: megatron-core's
  bias-dropout-add at dropout 0 (``h = residual + (x + x_bias)``) and the norm of ``h``, forward and backward
  in the same kernels (the norm backward also adds ``h``'s other gradient and sums the ``x_bias`` gradient).
* :class:`FusedLayerNorm` / :class:`FusedRMSNorm` are ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` with this
  forward (same parameters, state-dict keys and ``isinstance``), for the layer specs; they take an output
  :func:`residual_norm` computed for their input (:meth:`hand_over`) instead of computing it again.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.kernels._triton import cdiv, empty, num_programs, tl, triton, use_triton

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "layer_norm", "residual_norm", "rms_norm"]

MAX_HIDDEN = 16384  # one row must fit one program's registers; wider rows take the torch path
BACKWARD_PROGRAMS_PER_SM = 4  # persistent backward programs per multiprocessor (tests/test_kernels_gpu.py times 2-8)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``F.layer_norm(x, x.shape[-1:], weight, bias, eps)`` with the fused backward."""
    _check(x, weight, bias, "layer_norm")
    return _NormFunction.apply(x, weight, bias, float(eps), False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, x.shape[-1:], weight, eps)`` with the fused backward."""
    _check(x, weight, None, "rms_norm")
    return _NormFunction.apply(x, weight, None, float(eps), True)


def _check(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], name: str) -> None:
    if weight is None:
        raise MegatronConfigError(f"{name}: weight is None; the fused norms need elementwise_affine=True.")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise MegatronConfigError(
            f"{name}: weight has shape {tuple(weight.shape)} but x's last dimension is {x.shape[-1]}; "
            "the fused norms normalize over the last dimension only (normalized_shape=(hidden,))."
        )
    if bias is not None and bias.shape != weight.shape:
        raise MegatronConfigError(f"{name}: bias has shape {tuple(bias.shape)}, expected {tuple(weight.shape)}.")


class _HandOver:
    """The output for one input may have been computed already: :func:`residual_norm` in the op before the
    norm (``kernels.layers.ResidualNormBDA``) computes it with the residual add and hands it over. The norm
    takes it only for that very input tensor; any other input is normalized as usual (and the hand-over
    dropped), so a layer that changes the tensor in between stays correct, only unfused.

    And only while that input's autograd node is still the one the output was computed from: activation
    recomputation (``GPTModule(recompute_granularity="full")``) runs a checkpointed layer's forward without a
    graph of its input, then returns that very output tensor with a new node (the checkpoint's). The norm after
    the checkpoint (the next layer's outside it, or the final norm) then sees the very input, but an output whose
    graph does not reach the checkpoint: taking it would cut the gradient of every layer before it."""

    _handed_over: Optional[tuple[torch.Tensor, torch.Tensor, Any]] = None
    hand_overs_taken = 0  # counters, to check that the fusion happens (tests, debugging)
    hand_overs_missed = 0

    def hand_over(self, input: torch.Tensor, output: torch.Tensor) -> None:
        self._handed_over = (input, output, input.grad_fn)

    def _take(self, input: torch.Tensor) -> Optional[torch.Tensor]:
        handed, self._handed_over = self._handed_over, None
        if handed is None:
            return None
        if handed[0] is input and input.grad_fn is handed[2]:
            self.hand_overs_taken += 1
            return handed[1]
        self.hand_overs_missed += 1
        return None


def _check_affine(norm: torch.nn.Module, plain: str) -> None:
    if not norm.elementwise_affine or len(norm.normalized_shape) != 1:
        raise MegatronConfigError(
            f"{type(norm).__name__} needs elementwise_affine=True and one normalized dimension; use {plain} for "
            "other shapes."
        )


class FusedLayerNorm(_HandOver, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dimension with the fused kernels of :mod:`lightning_megatron.kernels`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, **kwargs: object) -> None:
        super().__init__(hidden_size, eps=eps, **kwargs)
        _check_affine(self, "torch.nn.LayerNorm")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        handed = self._take(input)
        return handed if handed is not None else layer_norm(input, self.weight, self.bias, self.eps)


class FusedRMSNorm(_HandOver, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last dimension with the fused kernels of :mod:`lightning_megatron.kernels`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, **kwargs: object) -> None:
        if eps is None:
            raise MegatronConfigError(
                "FusedRMSNorm needs an explicit eps (torch.nn.RMSNorm's None is dtype-dependent)."
            )
        super().__init__(hidden_size, eps=eps, **kwargs)
        _check_affine(self, "torch.nn.RMSNorm")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        handed = self._take(input)
        return handed if handed is not None else rms_norm(input, self.weight, self.eps)


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):  # noqa: ANN001, ANN205
        shape = x.shape
        x2 = _rows(x)
        triton_path = _triton_path(x2)
        forward = _forward_triton if triton_path else _forward_torch
        y, mean, rstd = forward(x2, weight, bias, eps, rms)
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.rms, ctx.triton_path, ctx.shape = rms, triton_path, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        backward = _backward_triton if ctx.triton_path else _backward_torch
        dx, dw, db, _ = backward(x2, _rows(dy), weight, mean, rstd, bias is not None, ctx.rms)
        return dx.view(ctx.shape), dw, db, None, None


def residual_norm(
    x: torch.Tensor,
    x_bias: Optional[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + (x + x_bias)`` and ``norm(h)`` (LayerNorm with ``bias``, or RMSNorm) in one pass each way.

    The forward writes ``h`` (rounded to ``x``'s dtype, then normalized, as the unfused norm reads it) and the
    norm's output; the backward takes the gradients of both outputs together and writes one gradient for ``x``
    and ``residual`` (``dh`` plus the norm's input gradient), with the weight, bias and ``x_bias`` gradients
    from partial sums in the same pass: the norm backward, the add of the two gradients of ``h`` and the bias
    gradient column sum, which run as four ATen kernels unfused.
    """
    _check(x, weight, bias, "residual_norm")
    if x_bias is not None and x_bias.shape != weight.shape:
        raise MegatronConfigError(
            f"residual_norm: x_bias has shape {tuple(x_bias.shape)}, expected {tuple(weight.shape)}."
        )
    if residual.shape != x.shape:
        raise MegatronConfigError(f"residual_norm: residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}.")
    if residual.dtype != x.dtype:  # megatron-core's bias-dropout-add casts the residual the same way
        residual = residual.to(x.dtype)
    return _ResidualNormFunction.apply(x, x_bias, residual, weight, bias, float(eps), rms)


class _ResidualNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_bias, residual, weight, bias, eps, rms):  # noqa: ANN001, ANN205
        shape = x.shape
        x2, r2 = _rows(x), _rows(residual)
        triton_path = _triton_path(x2)
        # h is allocated in x's shape, not returned as a view: megatron-core's make_viewless_tensor (at the end of
        # each layer) passes a tensor that is not a view through as itself, so the next norm recognizes it.
        if triton_path:
            h = empty(shape, like=x)
            y, mean, rstd = _forward_triton(x2, weight, bias, eps, rms, residual=r2, x_bias=x_bias, h=h.view(x2.shape))
        else:
            h = _bias_residual_torch(x, x_bias, residual)
            y, mean, rstd = _forward_torch(h.view(x2.shape), weight, bias, eps, rms)
        ctx.save_for_backward(h, weight, bias, mean, rstd)
        ctx.rms, ctx.triton_path, ctx.shape, ctx.has_x_bias = rms, triton_path, shape, x_bias is not None
        return h, y.view(shape)

    @staticmethod
    def backward(ctx, dh, dy):  # noqa: ANN001, ANN205
        h, weight, bias, mean, rstd = ctx.saved_tensors
        backward = _backward_triton if ctx.triton_path else _backward_torch
        dx, dw, db, dxb = backward(
            _rows(h), _rows(dy), weight, mean, rstd, bias is not None, ctx.rms, dh=_rows(dh), x_bias_grad=ctx.has_x_bias
        )
        dx = dx.view(ctx.shape)
        return dx, dxb, dx, dw, db, None, None


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.is_contiguous() else t2.contiguous()


def _triton_path(x2: torch.Tensor) -> bool:
    return use_triton(x2) and 0 < x2.numel() and x2.shape[-1] <= MAX_HIDDEN and x2.dtype != torch.float64


# -- torch (CPU) path: the kernels' formulas as torch ops ------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _bias_residual_torch(x, x_bias, residual):  # noqa: ANN001, ANN202
    dtype = _compute_dtype(x)
    xf = x.to(dtype) if x_bias is None else x.to(dtype) + x_bias.to(dtype)
    return (residual.to(dtype) + xf).to(x.dtype)


def _forward_torch(x, weight, bias, eps, rms):  # noqa: ANN001, ANN202
    xf = x.to(_compute_dtype(x))
    if rms:
        mean = None
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        xhat = xf * rstd
    else:
        mean = xf.mean(-1, keepdim=True)
        centered = xf - mean
        rstd = torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
        xhat = centered * rstd
    y = xhat * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype), mean, rstd


def _backward_torch(x, dy, weight, mean, rstd, has_bias, rms, dh=None, x_bias_grad=False):  # noqa: ANN001, ANN202
    dtype = rstd.dtype
    xf, dyf = x.to(dtype), dy.to(dtype)
    xhat = (xf if rms else xf - mean) * rstd
    wdy = dyf * weight.to(dtype)
    c1 = (xhat * wdy).mean(-1, keepdim=True)
    if rms:
        dx = (wdy - xhat * c1) * rstd
    else:
        dx = (wdy - (xhat * c1 + wdy.mean(-1, keepdim=True))) * rstd
    if dh is not None:
        dx = dx + dh.to(dtype)
    dw = (dyf * xhat).sum(0).to(weight.dtype)
    db = dyf.sum(0).to(weight.dtype) if has_bias else None
    dx = dx.to(x.dtype)
    dxb = dx.sum(0) if x_bias_grad else None
    return dx, dw, db, dxb


# -- Triton path -----------------------------------------------------------------------------------------------------


def _launch_shape(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    return block, min(max(block // 256, 1), 16)


def _forward_triton(x, weight, bias, eps, rms, residual=None, x_bias=None, h=None):  # noqa: ANN001, ANN202
    """The norm of ``x``; with ``residual``, of ``h = residual + (x + x_bias)``, which it writes into ``h``."""
    rows, n = x.shape
    y = empty(x.shape, like=x)
    rstd = empty(rows, like=x, dtype=torch.float32)
    mean = None if rms else empty(rows, like=x, dtype=torch.float32)
    block, warps = _launch_shape(n)
    _norm_forward_kernel[(rows,)](
        x,
        y,
        weight,
        bias if bias is not None else weight,  # placeholders are never read or written
        mean if mean is not None else rstd,
        rstd,
        residual if residual is not None else x,
        x_bias if x_bias is not None else weight,
        h if h is not None else y,
        n,
        eps,
        BLOCK=block,
        HAS_BIAS=bias is not None,
        RMS=rms,
        RESIDUAL=residual is not None,
        HAS_X_BIAS=x_bias is not None,
        num_warps=warps,
    )
    return y, mean, rstd


def _backward_triton(x, dy, weight, mean, rstd, has_bias, rms, dh=None, x_bias_grad=False):  # noqa: ANN001, ANN202
    rows, n = x.shape
    dx = empty(x.shape, like=x)
    programs = max(1, min(num_programs(x.device, BACKWARD_PROGRAMS_PER_SM), rows))
    rows_per_program = cdiv(rows, programs)
    programs = cdiv(rows, rows_per_program)
    dw_partial = empty((programs, n), like=x, dtype=torch.float32)
    db_partial = empty((programs, n), like=x, dtype=torch.float32) if has_bias else dw_partial
    dxb_partial = empty((programs, n), like=x, dtype=torch.float32) if x_bias_grad else dw_partial
    block, warps = _launch_shape(n)
    _norm_backward_kernel[(programs,)](
        x,
        dy,
        dx,
        weight,
        mean if mean is not None else rstd,
        rstd,
        dw_partial,
        db_partial,
        dh if dh is not None else dy,
        dxb_partial,
        rows,
        n,
        ROWS_PER_PROGRAM=rows_per_program,
        BLOCK=block,
        HAS_BIAS=has_bias,
        RMS=rms,
        HAS_DH=dh is not None,
        X_BIAS_GRAD=x_bias_grad,
        num_warps=warps,
    )
    dw = dw_partial.sum(0).to(weight.dtype)
    db = db_partial.sum(0).to(weight.dtype) if has_bias else None
    dxb = dxb_partial.sum(0).to(x.dtype) if x_bias_grad else None
    return dx, dw, db, dxb


if triton is not None:

    @triton.jit
    def _norm_forward_kernel(
        X,
        Y,
        W,
        B,
        MEAN,
        RSTD,
        R,
        XB,
        H,
        N,
        eps,
        BLOCK: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RMS: tl.constexpr,
        RESIDUAL: tl.constexpr,
        HAS_X_BIAS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:  # h = residual + (x + x_bias), stored, and normalized as stored (rounded)
            if HAS_X_BIAS:
                x = x + tl.load(XB + cols, mask=mask, other=0.0).to(tl.float32)
            h = (tl.load(R + row * N + cols, mask=mask, other=0.0).to(tl.float32) + x).to(H.dtype.element_ty)
            tl.store(H + row * N + cols, h, mask=mask)
            x = h.to(tl.float32)
        if RMS:
            centered = x
        else:
            mean = tl.sum(x, axis=0) / N
            centered = tl.where(mask, x - mean, 0.0)
            tl.store(MEAN + row, mean)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / N + eps)
        tl.store(RSTD + row, rstd)
        y = centered * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_backward_kernel(
        X,
        DY,
        DX,
        W,
        MEAN,
        RSTD,
        DW_PARTIAL,
        DB_PARTIAL,
        DH,
        DXB_PARTIAL,
        M,
        N,
        ROWS_PER_PROGRAM: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RMS: tl.constexpr,
        HAS_DH: tl.constexpr,
        X_BIAS_GRAD: tl.constexpr,
    ):
        program = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK], dtype=tl.float32)
        dxb_acc = tl.zeros([BLOCK], dtype=tl.float32)
        first = program * ROWS_PER_PROGRAM
        for i in range(0, ROWS_PER_PROGRAM):
            row = first + i
            row_mask = cols < tl.where(row < M, N, 0)  # (mask & (row < M) is not a boolean in the interpreter)
            x = tl.load(X + row * N + cols, mask=row_mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * N + cols, mask=row_mask, other=0.0).to(tl.float32)
            inside = tl.minimum(row, M - 1)  # past the last row x and dy load as 0; no scalar mask (the interpreter)
            rstd = tl.load(RSTD + inside)
            if RMS:
                xhat = x * rstd
            else:
                xhat = tl.where(row_mask, (x - tl.load(MEAN + inside)) * rstd, 0.0)
            wdy = w * dy
            c1 = tl.sum(xhat * wdy, axis=0) / N
            if RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                c2 = tl.sum(wdy, axis=0) / N
                dx = (wdy - (xhat * c1 + c2)) * rstd
            if HAS_DH:  # the other gradient of h (the residual branch), added before the one rounding
                dx = dx + tl.load(DH + row * N + cols, mask=row_mask, other=0.0).to(tl.float32)
            dx_out = dx.to(DX.dtype.element_ty)
            tl.store(DX + row * N + cols, dx_out, mask=row_mask)
            dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
            if X_BIAS_GRAD:  # the bias before the residual add sums the rounded gradient, as autograd would
                dxb_acc += tl.where(row_mask, dx_out.to(tl.float32), 0.0)
        tl.store(DW_PARTIAL + program * N + cols, dw_acc, mask=mask)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + program * N + cols, db_acc, mask=mask)
        if X_BIAS_GRAD:
            tl.store(DXB_PARTIAL + program * N + cols, dxb_acc, mask=mask)
