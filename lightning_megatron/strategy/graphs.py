"""A training step's forward and backward as one CUDA graph: captured once, then replayed every step.

Why: a model that is small for its GPU is bound by the host, not the GPU. GPT-2-medium launches about 5,000
kernels a step; on a current data-centre GPU, Python, autograd and the launches take longer than the kernels,
so the GPU idles between them. Replaying a CUDA graph launches the whole step at once. megatron-core offers the same
(``cuda_graph_impl="local"`` with the ``full_iteration`` scope); its wrapper keeps class-level state, assumes
dict batches and Megatron-LM's training loop. This one is the strategy's, per fit, and knows the step's
contract.

Contract:

* ``StepGraph()(run, microbatches)`` returns ``run(microbatches)``'s :class:`StepOutput`, like calling
  ``run`` directly. ``run`` is the whole step: the schedule's forwards and backwards, the gradient
  reduction and the loss.
* The first ``warmup_steps`` steps with the same *signature* (microbatch count, every tensor's shape, dtype
  and device, every other leaf's value) run eagerly: lazy initialisation, compiled kernels and NCCL
  communicators happen there. The next step is captured into the graph and then replayed; every later step
  with that signature copies its inputs into the captured (static) input buffers and replays.
* A new signature drops the graph and starts again with warm-up steps. After ``max_captures`` graphs the
  shapes are taken to vary on purpose and every later step runs eagerly, with one warning.
* What ``run`` does must be capturable: GPU work only, no host synchronisation (``.item()``, host copies),
  no tensors that change address between steps (parameters, ``main_grad`` buffers and optimizer state
  keep theirs). Host-side effects of ``run`` (hooks, logging) happen once, at capture, not per replay.
* ``strict=True`` (the user asked for graphs): a step that cannot be captured raises
  :class:`MegatronConfigError` naming the cause and ``cuda_graphs``. ``strict=False`` (graphs chosen
  automatically): it warns once and every later step runs eagerly; when the failed step's work did not run
  (a failed capture), :class:`StepNotRun` tells the caller to run it again eagerly.
* megatron-core's tensor-parallel RNG streams are registered with the graph, so dropout draws fresh
  numbers on every replay. That needs the graph-safe tracker (``use_cudagraphable_rng``), which the
  strategy seeds when graphs are on.
* ``open()`` switches the thread to a CUDA stream of the graph's own, ``close()`` switches back (and frees the
  graph). The strategy opens it before megatron-core's DDP wraps the model: the DDP creates every parameter's
  gradient-accumulator node then, and autograd runs that node on the stream that was current at creation. On
  the legacy default stream the capture would fail (it may not wait on a capturing stream); on the graph's
  stream the whole step, accumulation included, is captured where it runs.
* ``observers`` (the strategy's graph-safe step listeners, ``strategy.listeners``) are told when a capture starts
  and ends (``graph_capture``) and around each replay (``graph_replay``); ``key`` (which observers) is part of the
  signature, so a changed set is captured anew.
* The outputs are copied out of the graph's memory after each replay, so a loss the caller keeps is not
  overwritten by the next step. ``reset()`` frees the graph and its memory pool.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_megatron.compat.graph_capture import capturing
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.strategy.step import StepOutput

__all__ = [
    "StepGraph",
    "StepNotRun",
    "check_cuda_graphs",
    "check_graphable_precision",
    "declares_graph_safe_step",
    "resolve_accumulation_fusion",
    "resolve_cuda_graphs",
    "settings_not_run_graphed",
]

StepFn = Callable[[Sequence[Any]], StepOutput]


class StepNotRun(RuntimeError):
    """A non-strict step graph gave up while capturing: the step's work did not run. Clear the gradients and
    run the step eagerly (later calls run eagerly by themselves)."""


class StepGraph:
    """One fit's step graph: warm-up, capture, replay, re-capture on a new signature (the module's contract)."""

    def __init__(self, warmup_steps: int = 2, max_captures: int = 4, *, strict: bool = True) -> None:
        if warmup_steps < 1:
            raise MegatronConfigError(
                f"StepGraph(warmup_steps={warmup_steps}): at least one eager step must run before the capture "
                "(lazy initialisation and compiled kernels must not happen inside it)."
            )
        self.warmup_steps = warmup_steps
        self.max_captures = max_captures
        self.strict = strict
        self.gave_up_because: Optional[str] = None  # why a non-strict graph stopped capturing (for callers and tests)
        self.captures = 0  # graphs captured so far (tests, the benchmark)
        self.replays = 0
        self.eager_steps_by_caller = 0  # steps the caller ran without the graph (MegaScope, fault injectors)
        self._signature: Optional[tuple[Any, ...]] = None
        self._eager_steps = 0
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._static_inputs: list[torch.Tensor] = []
        self._static_output: Optional[StepOutput] = None
        self._gave_up = False
        self._stream: Optional[torch.cuda.Stream] = None
        self._previous_stream: Optional[torch.cuda.Stream] = None

    def open(self) -> None:
        """Run this thread's CUDA work on the graph's stream from now on (see the module's contract)."""
        if self._stream is not None:
            return
        self._previous_stream = torch.cuda.current_stream()
        self._stream = torch.cuda.Stream()
        self._stream.wait_stream(self._previous_stream)
        torch.cuda.set_stream(self._stream)

    def close(self) -> None:
        """Free the graph and return to the stream that was current before ``open`` (a later fit starts afresh)."""
        self.reset()
        self._gave_up = False
        if self._stream is not None and self._previous_stream is not None:
            self._previous_stream.wait_stream(self._stream)
            torch.cuda.set_stream(self._previous_stream)
        self._stream = self._previous_stream = None

    def __call__(
        self, run: StepFn, microbatches: Sequence[Any], observers: Sequence[Any] = (), key: Any = ()
    ) -> StepOutput:
        if self._gave_up:
            return run(microbatches)
        signature = (_signature(microbatches), key)
        if signature != self._signature:
            if self._signature is not None and self.captures >= self.max_captures:
                self._gave_up = True
                self.reset()
                rank_zero_warn(
                    f"cuda_graphs: the step's input shapes changed again after {self.captures} CUDA graphs were "
                    "captured; the remaining steps run without graphs. Keep shapes fixed (pad every batch to one "
                    "sequence length, drop_last=True) to replay one graph."
                )
                return run(microbatches)
            self.reset()
            self._signature = signature
        if self._graph is None:
            if self._eager_steps < self.warmup_steps:
                self._eager_steps += 1
                if self._eager_steps < self.warmup_steps:
                    return run(microbatches)
                out, places = _run_checking_syncs(run, microbatches)  # the last eager step: find the places here
                if places:
                    self._give_up(
                        "the training step waits for the GPU from the host (an .item(), a Python `if` on a GPU "
                        "tensor, a copy to the host), which a CUDA graph cannot capture, at: " + ", ".join(places)
                    )
                return out
            try:
                _tell(observers, "graph_capture", True)
                try:
                    self._capture(run, microbatches)
                finally:
                    _tell(observers, "graph_capture", False)
            except _CaptureFailed as failure:
                self._give_up(str(failure), cause=failure.__cause__)
                raise StepNotRun(str(failure)) from failure.__cause__
        else:
            for static, new in zip(self._static_inputs, _tensors(microbatches)):
                static.copy_(new, non_blocking=True)
        assert self._graph is not None and self._static_output is not None
        _tell(observers, "graph_replay", True)
        self._graph.replay()
        self.replays += 1
        _tell(observers, "graph_replay", False)
        out = self._static_output
        return StepOutput(loss=out.loss.clone(), loss_sum=out.loss_sum.clone(), num_tokens=out.num_tokens.clone())

    def note_eager_step(self, why: str) -> None:
        """The caller ran a step without the graph; say so once if the user asked for graphs."""
        self.eager_steps_by_caller += 1
        if self.eager_steps_by_caller == 1 and self.strict:
            rank_zero_warn(f"cuda_graphs=True: {why}, so it runs eagerly (without the CUDA graph).")

    def _give_up(self, why: str, cause: Optional[BaseException] = None) -> None:
        """Strict: raise, naming the fix. Otherwise: warn once; this fit's later steps run eagerly."""
        if self.strict:
            raise MegatronConfigError(
                f"cuda_graphs=True: {why}. Change that place, or set MegatronAppStrategy(cuda_graphs=False)."
            ) from cause
        self._gave_up = True
        self.gave_up_because = why
        self.reset()
        torch.cuda.empty_cache()  # the graph's pool: the eager steps from here on need that memory
        rank_zero_warn(
            f"cuda_graphs (automatic): {why}. The fit goes on without CUDA graphs. Set "
            "MegatronAppStrategy(cuda_graphs=False) to skip the attempt, or change that place to replay the step "
            "as one graph (faster where the host is the bottleneck)."
        )

    def reset(self) -> None:
        """Free the graph, its memory pool and the static inputs; the next step warms up again."""
        self._graph = None
        self._static_inputs = []
        self._static_output = None
        self._eager_steps = 0
        self._signature = None

    def _capture(self, run: StepFn, microbatches: Sequence[Any]) -> None:
        if self._stream is None or torch.cuda.current_stream() != self._stream:
            raise MegatronConfigError(
                "StepGraph: call open() before the model's gradient hooks are made (the strategy does, in setup) "
                "and capture on the stream it opens; the legacy default stream cannot be captured."
            )
        static = _clone_tree(microbatches)
        self._static_inputs = list(_tensors(static))
        graph = torch.cuda.CUDAGraph()
        trackers = _tracker_generators()
        for generator in trackers:
            graph.register_generator_state(generator)
        torch.cuda.synchronize()
        try:
            with capturing(graph, self._stream, trackers):  # a failed capture leaves nothing behind
                output = run(static)
        except Exception as error:  # say where it failed and what to do
            self.reset()
            first = error
            while first.__context__ is not None:  # the first failure; later ones only say the capture is invalid
                first = first.__context__  # type: ignore[assignment]
            raise _CaptureFailed(
                f"capturing the training step as a CUDA graph failed at {_where(first)}: "
                f"{str(first).splitlines()[0] if str(first) else repr(first)}. A captured step may only queue GPU "
                "work: no host synchronisation, no host-to-GPU copy, no CPU tensor moved to the GPU"
            ) from error
        self._graph, self._static_output = graph, output
        self.captures += 1


def _tell(observers: Sequence[Any], hook: str, started: bool) -> None:
    """Call ``hook(started)`` on each observer: in order when something starts, in reverse when it ends."""
    for observer in observers if started else reversed(observers):
        getattr(observer, hook)(started)


class _CaptureFailed(Exception):
    """The capture raised; the message says where (the cause is the original error)."""


def check_cuda_graphs(enabled: Any, *, pipeline: int, context: int = 1) -> Optional[bool]:
    """The strategy's ``cuda_graphs`` argument, checked when the strategy is built (before any process starts).
    Off (``False``) under context parallelism, whose ring exchanges are not captured."""
    if enabled is not None and not isinstance(enabled, bool):
        raise MegatronConfigError(f"`cuda_graphs` must be true, false or null (automatic), got {enabled!r}.")
    if context > 1:
        if enabled:
            raise MegatronConfigError(
                "cuda_graphs=True is not supported with context_parallel_size > 1 yet (the ring's exchanges are "
                "not captured); leave cuda_graphs unset or False."
            )
        return False
    if not enabled:
        return enabled
    if pipeline > 1:
        raise MegatronConfigError(
            f"cuda_graphs=True with pipeline_model_parallel_size={pipeline}: the step graph covers one rank's "
            "whole step, which only megatron-core's no-pipelining schedule keeps on the GPU (pipeline schedules wait "
            "on other stages from the host: MegaDPP and MegaFBD from their transport threads). Use "
            "pipeline_model_parallel_size=1 (tensor and data parallelism are fine), or cuda_graphs=False."
        )
    return True


def resolve_cuda_graphs(
    requested: Optional[bool],
    *,
    module: Any,
    on_cpu: bool,
    params_dtype: torch.dtype,
    fitting: bool = True,
    pipeline: int = 1,
    num_nodes: int = 1,
    unchecked: tuple[str, ...] = (),
) -> bool:
    """Whether this run replays its training step as a CUDA graph. ``True``/``False`` are the user's; ``None``
    (automatic) turns graphs on where they were measured faster and checked against the eager step: GPUs of one
    node without pipeline stages, bf16 or fp32, and a module that declares its ``forward_step`` capturable
    (:func:`declares_graph_safe_step`; ``GPTModule`` does). Tensor and data parallelism replay their collectives
    inside the graph: the fits of ``tests/test_graphs_gpu.py`` at TP2 with and without sequence parallelism, DP2,
    and DP2 with the distributed optimizer and overlapped reduction match the eager ones, and the graphed step
    is much faster than the eager one at DP2 and TP2 (docs/evaluation/throughput.md).
    Across nodes it stays opt-in: never run there; so do the settings named in ``unchecked`` (on in this run, never
    run graphed with more than one process: the strategy names them). Asked for where it cannot work: an error, in
    any run.

    Only fits have training steps: a ``validate``/``test``/``predict`` run (``fitting=False``) replays nothing, so
    what is chosen with the graph (``GPTModule``'s automatic fused kernels, slower in eager steps) stays off."""
    if requested is True:
        if on_cpu:
            raise MegatronConfigError(
                "cuda_graphs=True replays CUDA graphs and needs GPUs, but the Trainer runs on CPU. Use "
                "accelerator='gpu', or leave cuda_graphs unset."
            )
        check_graphable_precision(params_dtype)
        return fitting
    return (
        requested is None
        and fitting
        and not on_cpu
        and pipeline == 1
        and num_nodes == 1
        and not unchecked
        and params_dtype != torch.float16
        and declares_graph_safe_step(module)
    )


def resolve_accumulation_fusion(
    requested: Optional[bool],
    *,
    graphs: bool,
    on_cpu: bool,
    params_dtype: torch.dtype,
    pipeline: int = 1,
) -> bool:
    """Whether the weight-gradient GEMMs accumulate into ``main_grad`` (``gradient_accumulation_fusion``).
    ``True``/``False`` are the user's; ``None`` (automatic) turns it on with the graph, where it was measured
    faster: a step replayed as a CUDA graph with half-precision weights, where the host's extra work per layer is
    gone from the step and the GEMM saves the separate add and the bf16 temporary: a few percent on one GPU, at
    TP2 and at DP2 (docs/evaluation/throughput.md). Graphed and eager fits matched bit for bit with it at TP2
    and DP2 (``tests/test_graphs_gpu.py``). Eager one-GPU steps ran slower with it (host-bound), so it stays off
    without the graph; graphed pipelines have run no parity test with it, so automatic stays off at PP until
    one has (asking for it works)."""
    if requested is not None:
        return requested
    half = params_dtype in (torch.bfloat16, torch.float16)
    return graphs and pipeline == 1 and half and not on_cpu


def settings_not_run_graphed(
    *, overlap_param_gather: bool, tp_comm_overlap: bool, world_size: int = 2
) -> tuple[str, ...]:
    """The settings on in a multi-process run that no graph parity test (``tests/test_graphs_gpu.py``) has run
    with, for ``resolve_cuda_graphs(unchecked=...)``: megatron-core's parameter all-gather waits inside the forward
    on work started in the optimizer step, and the overlapped and split linears issue their own collectives and
    GEMMs. The fused weight-gradient GEMM is not among them: graphed and eager fits matched bit for bit with it
    at TP2 and at DP2 (``tests/test_graphs_gpu.py``)."""
    if world_size == 1:
        return ()  # one process: nothing of these reaches another rank
    named = {"overlap_param_gather": overlap_param_gather, "tp_comm_overlap": tp_comm_overlap}
    return tuple(name for name, on in named.items() if on)


def resolve_step_settings(
    graphs: Optional[bool],
    accumulation_fusion: Optional[bool],
    *,
    params_dtype: torch.dtype,
    on_cpu: bool,
    pipeline: int,
    **graph_conditions: Any,
) -> tuple[bool, bool]:
    """``(cuda_graphs, gradient_accumulation_fusion)`` as this run uses them: :func:`resolve_cuda_graphs` (with
    ``graph_conditions``), then :func:`resolve_accumulation_fusion`, which follows the graph."""
    replays = resolve_cuda_graphs(
        graphs, on_cpu=on_cpu, params_dtype=params_dtype, pipeline=pipeline, **graph_conditions
    )
    fusion = resolve_accumulation_fusion(
        accumulation_fusion, graphs=replays, on_cpu=on_cpu, params_dtype=params_dtype, pipeline=pipeline
    )
    return replays, fusion


def declares_graph_safe_step(module: Any) -> bool:
    """Whether the class that defines ``module.forward_step`` also sets ``graph_safe_forward_step = True``: its
    forward step only queues GPU work and has no per-call host effects. A subclass that overrides
    ``forward_step`` does not inherit the promise; it makes its own. An instance may withdraw it
    (``self.graph_safe_forward_step = False``: ``GPTModule`` with MoE layers, whose dispatcher reads token counts on
    the host)."""
    if vars(module).get("graph_safe_forward_step", True) is False:
        return False
    for klass in type(module).__mro__:
        if "forward_step" in vars(klass):
            return vars(klass).get("graph_safe_forward_step", False) is True
    return False


def check_graphable_precision(params_dtype: torch.dtype) -> None:
    if params_dtype == torch.float16:
        raise MegatronConfigError(
            "cuda_graphs=True with fp16: the loss scale changes between steps, and a graph would keep scaling by "
            "the one it was captured with. Use precision='bf16-mixed' (or 32), or cuda_graphs=False."
        )


def _run_checking_syncs(run: StepFn, microbatches: Sequence[Any]) -> tuple[StepOutput, list[str]]:
    """``run`` under torch's CUDA sync debug mode, and the places (file:line) where it waited for the GPU: such
    a step cannot be captured, and here the error can say where it waits (a capture only says that it failed)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = run(microbatches)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    places = []
    for warning in caught:
        if "synchronizing CUDA operation" in str(warning.message):
            places.append(f"{warning.filename}:{warning.lineno}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return out, list(dict.fromkeys(places))


def _where(error: BaseException) -> str:
    """The innermost place outside torch's own files: the line that called what failed."""
    frames = traceback.extract_tb(error.__traceback__)
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    outside = [frame for frame in frames if not frame.filename.startswith(torch_dir)] or frames
    return f"{outside[-1].filename}:{outside[-1].lineno} ({outside[-1].name})" if outside else "an unknown place"


def _tracker_generators() -> list[torch.Generator]:
    """megatron-core's tensor-parallel RNG streams, which a captured dropout draws from (the default CUDA
    generator is registered by the capture itself)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    states = tracker.get_states().values()
    if states and not getattr(tracker, "use_cudagraphable_rng", False):
        raise MegatronConfigError(
            "cuda_graphs=True needs megatron-core's graph-safe RNG tracker (model_parallel_cuda_manual_seed(..., "
            "use_cudagraphable_rng=True)); MegatronAppStrategy(cuda_graphs=True) seeds it so. Something re-seeded "
            "the tracker without it after the strategy's setup."
        )
    return [s for s in states if isinstance(s, torch.Generator)]


def _signature(tree: Any) -> tuple[Any, ...]:
    if isinstance(tree, torch.Tensor):
        return ("tensor", tuple(tree.shape), tree.dtype, tree.device)
    if isinstance(tree, Mapping):
        return ("map", tuple((k, _signature(v)) for k, v in tree.items()))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(_signature(v) for v in tree))
    return ("value", tree)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves in a fixed order (the order ``_signature`` and ``_clone_tree`` walk)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, Mapping):
        return type(tree)((k, _clone_tree(v)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(_clone_tree(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone_tree(v) for v in tree)
    return tree
