"""Float8 GEMMs in megatron-core's tensor-parallel linear layers, through torchao, without Transformer Engine.

Why: megatron-core trains in FP8 only through Transformer Engine's layers; torchao brings float8 training to plain
PyTorch, but only to ``nn.Linear`` (``convert_to_float8_training``) and DTensor tensor parallelism. A
``ColumnParallelLinear`` or ``RowParallelLinear`` is neither. This module gives such a layer an autograd function
whose three GEMMs run in float8 with torchao's own scaling and casting (``hp_tensor_to_float8_dynamic``, the
``Float8LinearConfig`` of a recipe) and its ``Float8TrainingTensor`` matmul (``torch._scaled_mm`` on GPUs, its
emulation in fp32 elsewhere), while the layer keeps megatron-core's parallelism around them:

* forward: the sequence-parallel all-gather of the input, then ``input @ weight.t()`` in float8 (e4m3), the bias in
  bf16;
* backward: the input gradient in float8 (``grad_output`` in e5m2 for ``tensorwise``), reduced over the
  tensor-parallel group (all-reduce, or reduce-scatter under sequence parallelism) while the weight gradient's GEMM
  runs; the weight gradient ``grad_output.t() @ input`` in float8, handed to :func:`.wgrad_accumulate.weight_grad`
  like every backward of this package: added to the fp32 ``main_grad`` (``_scaled_mm`` has no accumulate
  operand, so the GEMM writes a weight-sized fp32 result, ``tensorwise``, or bf16, the rowwise recipes, and it is
  added), or stashed for a zero-bubble schedule's W.

What stays as it was: weights and master weights (bf16 weights, fp32 master weights, so checkpoints do not know FP8
was used and a fit resumes in either), the activations between pipeline stages, and the layers Transformer
Engine also keeps in high precision: the embedding and the output layer (the logits' GEMM feeds a softmax over
the vocabulary). Scales are computed on the GPU from each tensor's absolute maximum (dynamic "current" scaling,
no amax history, no host synchronisation), so a CUDA-graphed step captures them. Each tensor-parallel rank scales
its own shard: its weight slice and its part of the activations (the scale of a shard is at least as fine as the
whole tensor's, and needs no collective).

Recipes are torchao's names: ``tensorwise`` (one scale per tensor, cuBLAS's FP8 GEMM, the fastest), ``rowwise``
(one scale per row, e4m3 everywhere, scales rounded to powers of two: more accurate, slower), and
``rowwise_with_gw_hp`` (rowwise, the weight gradient in bf16).
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.collective_matmul import all_gather_rows
from lightning_megatron.layers.wgrad_accumulate import weight_grad

__all__ = [
    "FLOAT8_RECIPES",
    "Float8Linear",
    "Float8Recipe",
    "check_float8_device",
    "check_float8_precision",
    "float8_recipe_option",
    "float8_shape_problem",
]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def float8_recipe_option(recipe: Any, tp_comm_overlap: bool = False) -> Optional[str]:
    """The strategy's ``fp8_recipe`` checked when it is built: a recipe name, or None (no FP8)."""
    if recipe is None or recipe is False:
        return None
    if recipe not in FLOAT8_RECIPES:
        raise MegatronConfigError(
            f"`fp8_recipe` must be one of {list(FLOAT8_RECIPES)} (torchao's float8 recipes) or unset (no FP8), "
            f"got {recipe!r}."
        )
    if tp_comm_overlap:
        raise MegatronConfigError(
            f"`fp8_recipe={recipe!r}` does not combine with `tp_comm_overlap=True` yet (the overlapped layers' GEMMs "
            "are bf16): unset one of them."
        )
    try:
        _torchao()
    except ImportError as error:
        raise MegatronConfigError(
            f"`fp8_recipe={recipe!r}` needs torchao (`pip install 'lightning-megatron[fp8]'`, torchao 0.18.0): {error}"
        ) from error
    return recipe


def check_float8_precision(recipe: Optional[str], params_dtype: torch.dtype) -> None:
    """FP8 GEMMs take bf16 operands here (torchao's casts from the layer's weights and activations)."""
    if recipe and params_dtype != torch.bfloat16:
        raise MegatronConfigError(
            f"`fp8_recipe={recipe!r}` needs bf16 weights and activations: use Trainer(precision='bf16-mixed') "
            f"(got weights in {str(params_dtype).replace('torch.', '')})."
        )


def check_float8_device(recipe: Optional[str], device: torch.device) -> None:
    """Float8 GEMMs (``torch._scaled_mm``) need an sm89+ GPU: Ada, Hopper, Blackwell. CPUs emulate them."""
    if not recipe or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise MegatronConfigError(
            f"`fp8_recipe={recipe!r}` needs a GPU with float8 matrix units (compute capability 8.9 or newer: Ada, "
            f"Hopper, Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}. Unset `fp8_recipe` to "
            "train in bf16."
        )


def float8_shape_problem(module: torch.nn.Module) -> Optional[str]:
    """Why ``torch._scaled_mm`` cannot run this layer's GEMMs on a GPU (its dimensions must be multiples of 16)."""
    weight = module._parameters.get("weight")
    if weight is None:
        return "it has no weight of its own"
    out_features, in_features = weight.shape
    if out_features % 16 or in_features % 16:
        return f"its weight shard is {out_features} x {in_features}, and float8 GEMMs need multiples of 16"
    return None


@functools.lru_cache(maxsize=1)
def _torchao() -> Any:
    """torchao's float8 modules, imported on first use: the import takes seconds and, on machines without its
    CUDA kernels, logs one warning per kernel library it could not load (quiet here: float8 training does not use
    them)."""
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torchao.float8.config as config
        import torchao.float8.float8_ops as ops
        import torchao.float8.float8_utils as utils
    finally:
        logger.setLevel(level)
    return types.SimpleNamespace(config=config, ops=ops, utils=utils)


Operand = tuple[torch.Tensor, torch.Tensor]  # float8 data and its scale (a 0-d tensor, or one per row/column)


class Float8Recipe:
    """One recipe's casts and GEMMs (torchao's ``Float8LinearConfig``), on plain tensors.

    Each GEMM takes high-precision operands, casts them as the recipe says (torchao's ``tensor_to_scale`` and
    ``to_fp8_saturated``: the scale from the absolute maximum, divided in fp64, the product in fp32, saturated)
    and multiplies them with torchao's ``addmm_float8_unwrapped`` (``torch._scaled_mm``), or, with ``emulate``, as
    torchao emulates it: the dequantised operands' product in fp32 (what runs on CPUs).

    ``compile``: each GEMM with its casts compiled by ``torch.compile`` (GPUs). Eager, a cast is five kernels and
    five passes over the tensor (absolute value, maximum, scaling to fp32, clamp, conversion) and the operand
    transposes ``_scaled_mm`` needs are more; compiled, the absolute maximum is one reduction and the scaling,
    conversion and transpose one pass. torchao's own numbers (and this project's first measurement: eager casts
    made the 0.85B Llama 2.3 times slower in float8 than in bf16) assume compilation.
    """

    def __init__(self, name: str, emulate: bool, compile: bool = False) -> None:
        ao = self._ao = _torchao()  # the methods below read it from here: compiled code cannot call the import
        self.name = name
        self.emulate = emulate
        self.config = ao.config.Float8LinearConfig.from_recipe_name(name)
        self.compiled = compile
        self.casts_once = name == "tensorwise"  # every operand has one cast for all its GEMMs (see Float8Linear)
        if compile:
            # Not ``fullgraph=True``: each GEMM meets every layer's shapes, dtypes and layouts, and past dynamo's
            # recompile limit (8 variants of a function) a full-graph compile is a hard error, where this one runs
            # the further variants eagerly (slower, correct). With ``fullgraph=True`` one cast function shared by
            # every operand made 8 variants on a 2-layer Llama-style model on a CPU (3 with ``dynamic=True`` and
            # parameters detached), and failed at the Llama shape on an H200.
            self.output = torch.compile(self.output)  # type: ignore[method-assign]
            self.grad_input = torch.compile(self.grad_input)  # type: ignore[method-assign]
            self.grad_weight = torch.compile(self.grad_weight)  # type: ignore[method-assign]
            # one graph for every shape (each layer's input, weight and gradient meet this one function)
            self._scale_and_cast = torch.compile(self._scale_and_cast, dynamic=True)  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"Float8Recipe({self.name!r}, emulate={self.emulate}, compile={self.compiled})"

    def _cast(self, tensor: torch.Tensor, cast_config: Any, axis: int) -> Optional[Operand]:
        """``tensor`` in float8 with its scale as ``cast_config`` says (``axis``: along which rowwise scales are
        taken), or None where the recipe keeps this operand in high precision."""
        ao = self._ao
        if cast_config.scaling_type is ao.config.ScalingType.DISABLED:
            return None
        axiswise = cast_config.scaling_granularity is ao.config.ScalingGranularity.AXISWISE
        scale = ao.utils.tensor_to_scale(
            tensor,
            cast_config.target_dtype,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=axis if axiswise else None,
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )
        return ao.utils.to_fp8_saturated(tensor.to(torch.float32) * scale, cast_config.target_dtype), scale

    def quantize(
        self, tensor_2d: torch.Tensor, float8_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tensorwise cast of ``tensor_2d`` for all the GEMMs it takes part in: ``(data, data.t() stored
        row-major, scale)``, the transposed copy written by the same pass (``_scaled_mm`` wants its first operand
        row-major and its second column-major, and each operand is used both ways across forward and backward).

        The absolute maximum is one reduction kernel (``vector_norm(inf)``; compiled, the same reduction ran at a
        fifth of the memory bandwidth), the rest torchao's arithmetic (``amax_to_scale``, ``to_fp8_saturated``):
        the same bits as its ``hp_tensor_to_float8_dynamic``.
        """
        tensor_2d = tensor_2d.detach()  # a parameter and a plain tensor would be two compiled variants
        amax = torch.linalg.vector_norm(tensor_2d, ord=float("inf"), dtype=torch.float32)
        return self._scale_and_cast(tensor_2d, amax, float8_dtype)

    def _scale_and_cast(self, tensor_2d: torch.Tensor, amax: torch.Tensor, float8_dtype: torch.dtype) -> Any:
        ao = self._ao
        scale = ao.utils.amax_to_scale(amax, float8_dtype)
        data = ao.utils.to_fp8_saturated(tensor_2d.to(torch.float32) * scale, float8_dtype)
        return data, data.t().contiguous(), scale

    def scaled_mm(self, a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
        """``a @ b`` of float8 operands already laid out for ``_scaled_mm`` (public name of :meth:`_mm`)."""
        return self._mm(a, b, out_dtype, fast_accum)

    def grad_weight_cast(
        self,
        grad_output_t: torch.Tensor,
        input_t: torch.Tensor,
        out_dtype: Optional[torch.dtype] = None,
        *,
        grad_output_scale: torch.Tensor,
        input_scale: torch.Tensor,
    ) -> torch.Tensor:
        """The weight gradient from operands :meth:`quantize` cast already (both transposed copies)."""
        fast = self.config.gemm_config_grad_weight.use_fast_accum
        out_dtype = out_dtype or torch.bfloat16
        return self._mm((grad_output_t, grad_output_scale), (input_t.t(), input_scale), out_dtype, fast)

    def _mm(self, a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
        """``a @ b`` of two float8 operands, dequantised by their scales, in ``out_dtype``."""
        ao = self._ao
        (a_data, a_scale), (b_data, b_scale) = a, b
        if self.emulate or a_data.shape[1] % 16 or b_data.shape[1] % 16:
            # ``_scaled_mm`` needs the contraction and output widths in multiples of 16. The layers' own widths
            # are checked when they are chosen (``float8_shape_problem``); the weight gradient contracts over the
            # microbatch's tokens, which can be any number: that GEMM is then the float8 operands' product in
            # fp32, the emulation's arithmetic.
            if not self.emulate:
                _warn_unaligned(a_data.shape[1])
            return torch.mm(a_data.float() / a_scale, b_data.float() / b_scale).to(out_dtype)
        if not ao.utils.is_row_major(a_data.stride()):  # cuBLAS: A row-major, B column-major
            a_data = a_data.contiguous()
        if ao.utils.is_row_major(b_data.stride()):
            b_data = b_data.t().contiguous().t()
        # ``_scaled_mm`` takes both operands tensorwise or both rowwise: a tensorwise scale beside a rowwise one is
        # repeated along its rows or columns (``rowwise_with_gw_hp``'s input gradient), as torchao does
        if a_scale.dim() == 0 and b_scale.dim() == 2:
            a_scale = a_scale.repeat(a_data.shape[0]).reshape(-1, 1)
        elif a_scale.dim() == 2 and b_scale.dim() == 0:
            b_scale = b_scale.repeat(b_data.shape[1]).reshape(1, -1)
        return ao.ops.addmm_float8_unwrapped(
            a_data, a_scale, b_data, b_scale, out_dtype, output_scale=None, bias=None, use_fast_accum=fast_accum
        )

    def output(self, input_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``input_2d @ weight.t()`` (the forward GEMM), in the input's dtype."""
        c = self.config
        a = self._cast(input_2d, c.cast_config_input, -1)
        b = self._cast(weight.t(), c.cast_config_weight, 0)
        assert a is not None and b is not None  # every recipe casts the forward's operands
        return self._mm(a, b, input_2d.dtype, c.gemm_config_output.use_fast_accum)

    def grad_input(self, grad_output_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``grad_output_2d @ weight`` (the input gradient's GEMM)."""
        c = self.config
        a = self._cast(grad_output_2d, c.cast_config_grad_output, -1)
        b = self._cast(weight.t(), c.cast_config_weight_for_grad_input, -1)
        assert a is not None and b is not None
        return self._mm(a, _transposed(b), grad_output_2d.dtype, c.gemm_config_grad_input.use_fast_accum)

    def grad_weight(
        self, grad_output_2d: torch.Tensor, input_2d: torch.Tensor, out_dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        """``grad_output_2d.t() @ input_2d`` (the weight gradient's GEMM), in ``out_dtype`` (default: the
        operands'): fp32 where it is added to an fp32 ``main_grad``, straight from the GEMM's fp32 accumulator
        (``tensorwise``; cuBLAS's rowwise FP8 GEMM has no fp32 output: torchao rounds it to bf16 first)."""
        c = self.config
        out_dtype = out_dtype or grad_output_2d.dtype
        a = self._cast(grad_output_2d, c.cast_config_grad_output_for_grad_weight, 0)
        b = self._cast(input_2d, c.cast_config_input_for_grad_weight, 0)
        if a is None or b is None:  # rowwise_with_gw_hp: this GEMM in high precision
            return torch.mm(grad_output_2d.t(), input_2d).to(out_dtype)
        return self._mm(_transposed(a), b, out_dtype, c.gemm_config_grad_weight.use_fast_accum)


@torch.compiler.disable
def _warn_unaligned(contracted: int) -> None:
    import warnings

    warnings.warn(
        f"float8 GEMMs over {contracted} rows (the tokens of a microbatch, not a multiple of 16) run as fp32 "
        "products of their float8 operands, slower than torch._scaled_mm: make micro_batch_size x seq_length "
        "(per tensor-parallel rank under sequence parallelism, per context-parallel rank) a multiple of 16.",
        stacklevel=2,
    )


def _transposed(operand: Operand) -> Operand:
    data, scale = operand
    return data.t(), (scale.t() if scale.dim() == 2 else scale)


class Float8Linear(torch.autograd.Function):
    """A tensor-parallel linear layer's forward and backward with float8 GEMMs (module docstring).

    Where the recipe casts each operand the same way for all its GEMMs (``tensorwise``: one scale per tensor, the
    same float8 type), each is cast once: the input and the weight in the forward, the output gradient in the
    backward, each into both layouts its GEMMs need, and the forward keeps the float8 input (and weight) for the
    backward instead of the bf16 ones: a third of the casts torchao's ``Float8Linear`` runs, half the memory of
    the saved input, and, under sequence parallelism, no second all-gather in the backward. torchao casts the
    same tensors with the same scales again, so the numbers are the same. Other recipes cast per GEMM (rowwise
    scales run along different axes for different GEMMs) through :meth:`Float8Recipe.output` and friends.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, accumulate, recipe):  # noqa: ANN001, ANN205
        ctx.accumulate, ctx.recipe = accumulate, recipe
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        total_input = all_gather_rows(input, tp_group) if sequence_parallel else input
        input_2d = total_input.reshape(-1, total_input.shape[-1])
        if recipe.casts_once:
            c = recipe.config
            x, x_t, x_scale = recipe.quantize(input_2d, c.cast_config_input.target_dtype)
            w, w_t, w_scale = recipe.quantize(weight, c.cast_config_weight.target_dtype)
            fast = c.gemm_config_output.use_fast_accum
            output = recipe.scaled_mm((x, x_scale), (w.t(), w_scale), input_2d.dtype, fast)
            ctx.save_for_backward(x_t, x_scale, w_t, w_scale, weight)
            ctx.input_shape, ctx.input_dtype = input.shape, input.dtype
        else:
            ctx.save_for_backward(input, weight)
            output = recipe.output(input_2d, weight)
        output = output.reshape(*total_input.shape[:-1], output.shape[-1])
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        if ctx.recipe.casts_once:
            return Float8Linear._backward_from_casts(ctx, grad_output)
        input, weight = ctx.saved_tensors
        tp_group, recipe = ctx.tp_group, ctx.recipe
        gathering = None
        if ctx.sequence_parallel:  # under the input gradient's GEMM, as megatron-core orders it
            gathering, total_input = all_gather_rows(input, tp_group, async_op=True)
        else:
            total_input = input
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = recipe.grad_input(grad_output_2d, weight).reshape(*grad_output.shape[:-1], weight.shape[1])
        if gathering is not None:
            gathering.wait()
        grad_input, reducing = _start_reduction(ctx, grad_input, input.shape, input.dtype)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        placeholder = weight_grad(weight, grad_output, total_input, ctx.accumulate, gemm=recipe.grad_weight)
        if reducing is not None:
            reducing.wait()
        return grad_input, placeholder, grad_bias, None, None, None, None, None

    @staticmethod
    def _backward_from_casts(ctx, grad_output):  # noqa: ANN001, ANN205
        x_t, x_scale, w_t, w_scale, weight = ctx.saved_tensors
        recipe, c = ctx.recipe, ctx.recipe.config
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        g, g_t, g_scale = recipe.quantize(grad_output_2d, c.cast_config_grad_output.target_dtype)
        fast = c.gemm_config_grad_input.use_fast_accum
        grad_input = recipe.scaled_mm((g, g_scale), (w_t.t(), w_scale), grad_output.dtype, fast)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])
        grad_input, reducing = _start_reduction(ctx, grad_input, ctx.input_shape, ctx.input_dtype)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        gemm = functools.partial(recipe.grad_weight_cast, grad_output_scale=g_scale, input_scale=x_scale)
        placeholder = weight_grad(weight, g_t, x_t, ctx.accumulate, gemm=gemm)
        if reducing is not None:
            reducing.wait()
        return grad_input, placeholder, grad_bias, None, None, None, None, None


def _start_reduction(ctx: Any, grad_input: torch.Tensor, input_shape: Any, input_dtype: torch.dtype) -> Any:
    """Start the input gradient's tensor-parallel reduction (reduce-scatter to the layer's sequence-parallel
    input shape, or all-reduce), to run under the weight-gradient GEMM: ``(grad_input, work or None)``."""
    if ctx.sequence_parallel:
        local = torch.empty(input_shape, dtype=input_dtype, device=grad_input.device)
        return local, dist.reduce_scatter_tensor(local, grad_input, group=ctx.tp_group, async_op=True)
    if ctx.allreduce_dgrad:
        return grad_input, dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
    return grad_input, None
