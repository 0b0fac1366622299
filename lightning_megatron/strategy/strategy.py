"""``MegatronAppStrategy``: megatron-core tensor, pipeline (and virtual pipeline), data and sequence
parallelism under Lightning's ``Trainer``.

Lifecycle (Lightning's order):

1. ``setup_environment``: process group (NCCL with ``device_id`` on GPUs, gloo on CPUs), megatron-core
   parallel state, seeds including the tensor-parallel RNG tracker. On CPUs, ``compat.cpu`` first.
2. ``configure_model`` (the module's hook): builds this rank's model chunks, reading ``self.parallel``.
3. ``setup``: move to device, precision wrapper, megatron-core DDP, configuration hooks, optimizer.
4. Each ``training_step`` calls ``strategy.forward_backward(batch)``: the batch (one data-parallel
   rank's share of one global batch) is split into microbatches and run through the registered
   pipeline schedule, eagerly or replayed as a CUDA graph (``strategy.stepping``); the optimizer step
   that follows is megatron-core's.

The strategy replaces no Lightning function itself. What it needs of Lightning's privates is in
``compat.lightning``: the script launcher it imports, and the per-batch synchronisation it wraps on the Trainer's
own loop for step listeners (``announce_step_sync``). Every replacement of another project's function, Lightning's
included, is listed in ``compat.inventory``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.utils import get_model_config
from typing_extensions import override

from lightning_megatron.compat.lightning import ScriptLauncher, announce_step_sync
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.float8 import check_float8_device, check_float8_precision, float8_recipe_option
from lightning_megatron.layers.install import TensorParallelLayers, symmetric_ar_option
from lightning_megatron.layers.tp_overlap import tp_comm_overlap_options
from lightning_megatron.pipeline import get_schedule
from lightning_megatron.strategy import rendezvous
from lightning_megatron.strategy.arguments import check_scalar_arguments, check_trainer
from lightning_megatron.strategy.checkpoint import DistCheckpointIO, load_sharded, model_sharded_state_dict
from lightning_megatron.strategy.chunks import ddp_options, install_config_hooks, unwrap, validated_chunks, wrap_ddp
from lightning_megatron.strategy.collectives import DataParallelCollectives
from lightning_megatron.strategy.graphs import (
    StepGraph,
    check_cuda_graphs,
    resolve_step_settings,
    settings_not_run_graphed,
)
from lightning_megatron.strategy.listeners import StepListener, TimedLoader
from lightning_megatron.strategy.optimizer import StrategyOptimizer, build_optimizer
from lightning_megatron.strategy.parallel import (
    ParallelContext,
    ParallelLayout,
    initialize_parallel_state,
    seed_parallel_rngs,
)
from lightning_megatron.strategy.precision import MegatronPrecision, from_lightning_plugin
from lightning_megatron.strategy.release import collect_previous_fits, release_training_state
from lightning_megatron.strategy.step import StepOutput
from lightning_megatron.strategy.stepping import StepRunner

__all__ = ["MegatronAppStrategy"]


class MegatronAppStrategy(DataParallelCollectives, ParallelStrategy):
    """Train megatron-core models with tensor, pipeline, virtual-pipeline, data and sequence parallelism.

    Data parallelism is what remains of the world: ``devices × num_nodes / (TP × PP × CP)`` replicas.

    Args:
        tensor_model_parallel_size: GPUs each layer is split across (keep within a node).
        pipeline_model_parallel_size: Pipeline stages the layers are divided into.
        virtual_pipeline_model_parallel_size: Model chunks per pipeline rank (interleaved schedule).
        sequence_parallel: Split the activations outside the tensor-parallel regions along the
            sequence too (needs TP > 1; saves activation memory).
        context_parallel_size: Ranks each sequence is split over (ring attention; ``layer_spec="sdpa"``).
        expert_model_parallel_size: Ranks the experts of every MoE layer are split over (``GPTModule(
            num_moe_experts=...)``), out of the data- (and context-) parallel ranks; tokens reach their experts by
            all-to-all (:mod:`lightning_megatron.models.moe`).
        micro_batch_size: Samples per microbatch. A Lightning batch is one optimizer step; it is split
            into ``batch size / micro_batch_size`` microbatches that flow through the pipeline.
        schedule: Registered pipeline schedule (``lightning_megatron.pipeline.available_schedules()``).
            Default: ``"1f1b"``, or ``"interleaved"`` when virtual stages are set; ``"dpp"`` is MegaDPP.
        schedule_options: The schedule's own settings, e.g. ``{"policy": "adaptive", "extra_activations": 2}``
            for ``"dpp"`` (checked here, when the strategy is built).
        use_distributed_optimizer: Shard optimizer state and master weights across data-parallel
            ranks (ZeRO-1, megatron-core's distributed optimizer).
        overlap_grad_reduce: Overlap the data-parallel gradient reduction with the backward pass.
        overlap_param_gather: With the distributed optimizer, overlap the parameter all-gather with
            the next forward pass.
        grad_reduce_in_fp32: Accumulate and reduce gradients in fp32 under bf16/fp16.
        gradient_accumulation_fusion: Compute every tensor-parallel linear layer's weight gradient as one GEMM
            that accumulates into the fp32 ``main_grad`` (GPUs, bf16/fp16), without the half-precision temporary
            and the separate add; what megatron-core's flag of that name does with apex, here without apex
            (:mod:`lightning_megatron.layers.wgrad`). Elsewhere (CPUs, fp32) the arithmetic is unchanged.
            Unset: on with a CUDA-graphed step outside pipelines (one GPU, TP, DP), where it was measured
            faster (:func:`~lightning_megatron.strategy.graphs.resolve_accumulation_fusion`).
        tp_comm_overlap: Overlap the tensor-parallel all-gathers, reduce-scatters and all-reduces of every
            ``ColumnParallelLinear`` / ``RowParallelLinear`` with their GEMMs (chunked collective matmul over NCCL,
            no Transformer Engine; :mod:`lightning_megatron.layers.tp_overlap`). Same results; ignored (with a
            warning) at TP 1.
        tp_comm_overlap_chunks: With ``tp_comm_overlap``: pieces the token dimension of each GEMM is cut into.
        symmetric_ar_type: ``"two_shot"`` or ``"one_shot"``: the tensor-parallel all-reduces (the row-parallel
            layers' outputs; the input gradients too where the layers run this project's backward, as with
            ``gradient_accumulation_fusion``, but not the float8 layers of ``fp8_recipe``, whose input gradients
            stay NCCL's) on torch's symmetric memory instead of NCCL (GPUs of one node, TP > 1 without sequence
            parallelism; :mod:`lightning_megatron.compat.symmetric_all_reduce`). Unset: NCCL.
        fp8_recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (torchao's recipes): the GEMMs of
            every ``ColumnParallelLinear`` / ``RowParallelLinear`` but the output layer in float8, through torchao,
            without Transformer Engine (:mod:`lightning_megatron.layers.float8`; needs ``precision="bf16-mixed"``
            and the ``fp8`` extra; emulated on CPUs). Unset: bf16.
        ddp_bucket_size: Gradient bucket size in elements (megatron-core's default when unset).
        deallocate_pipeline_outputs: Free a stage's output activations once sent (keeps only the
            autograd graph); saves memory at no cost.
        cuda_graphs: Replay the training step (forwards, backwards, gradient reduction, loss) as one CUDA graph
            captured after two eager steps (:mod:`lightning_megatron.strategy.graphs`). GPUs, PP 1, bf16/fp32,
            fixed shapes; validation, and steps that MegaScope or a fault injector looks into, run eagerly (MegaScan
            traces the replays themselves). ``None`` (default): on
            for fits on one node without pipeline stages (one GPU, TP, DP) of modules that declare their step
            capturable (``GPTModule``), else off; a step that cannot be captured warns once and runs eagerly.
            ``True``: also across nodes, and such a step is an error.
        ddp_config: Further ``megatron.core.distributed.DistributedDataParallelConfig`` fields.
        optimizer_config: Further ``megatron.core.optimizer.OptimizerConfig`` fields (loss-scaling
            knobs, CPU offload, ...). Optimizer type and hyperparameters come from
            ``configure_optimizers``.
        seed: Base seed of the model-parallel RNGs (default: ``seed_everything``'s, else 1234).
        process_group_backend: ``"nccl"`` (GPUs, default there) or ``"gloo"`` (CPUs, default there).
        timeout: Collective timeout in seconds (or a ``timedelta``): a dead peer raises after this
            instead of hanging.
    """

    strategy_name = "megatron"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        sequence_parallel: bool = False,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        micro_batch_size: int = 1,
        schedule: Optional[str] = None,
        schedule_options: Optional[dict[str, Any]] = None,
        use_distributed_optimizer: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        grad_reduce_in_fp32: bool = True,
        gradient_accumulation_fusion: Optional[bool] = None,
        tp_comm_overlap: bool = False,
        tp_comm_overlap_chunks: int = 2,
        symmetric_ar_type: Optional[str] = None,
        fp8_recipe: Optional[str] = None,
        ddp_bucket_size: Optional[int] = None,
        deallocate_pipeline_outputs: bool = True,
        cuda_graphs: Optional[bool] = None,
        ddp_config: Optional[dict[str, Any]] = None,
        optimizer_config: Optional[dict[str, Any]] = None,
        seed: Optional[int] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = 1800.0,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[MegatronPrecision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.layout = ParallelLayout(
            tensor=tensor_model_parallel_size,
            pipeline=pipeline_model_parallel_size,
            virtual_pipeline=virtual_pipeline_model_parallel_size,
            sequence_parallel=sequence_parallel,
            context=context_parallel_size,
            expert=expert_model_parallel_size,
        )
        check_scalar_arguments(
            micro_batch_size=micro_batch_size,
            process_group_backend=process_group_backend,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
        )
        self.micro_batch_size = micro_batch_size
        self.schedule = get_schedule(schedule or ("interleaved" if virtual_pipeline_model_parallel_size else "1f1b"))
        self.schedule.validate(pipeline=self.layout.pipeline, virtual=self.layout.virtual_pipeline)
        self.schedule_options = self.schedule.options(schedule_options)
        self.cuda_graphs = check_cuda_graphs(cuda_graphs, pipeline=self.layout.pipeline, context=self.layout.context)
        self._graphs = False  # whether this run replays steps as graphs: resolved in setup_environment
        self.use_distributed_optimizer = use_distributed_optimizer
        self.deallocate_pipeline_outputs = deallocate_pipeline_outputs
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self._accumulation_fusion = bool(gradient_accumulation_fusion)  # resolved in setup_environment
        self.tp_comm_overlap = tp_comm_overlap_options(tp_comm_overlap, tp_comm_overlap_chunks, self.layout.tensor)
        self.symmetric_ar_type = symmetric_ar_option(symmetric_ar_type, self.layout.tensor, sequence_parallel)
        self.fp8_recipe = float8_recipe_option(fp8_recipe, tp_comm_overlap=self.tp_comm_overlap is not None)
        self.tp_layers = TensorParallelLayers()  # installed for a fit, restored at teardown
        named_ddp = dict(
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather,
            use_distributed_optimizer=use_distributed_optimizer,
            bucket_size=ddp_bucket_size,
        )
        self._ddp_kwargs = ddp_options(named_ddp, ddp_config)
        self._optimizer_config = dict(optimizer_config or {})
        self._seed = seed
        self._process_group_backend = process_group_backend
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._steps = StepRunner(self.schedule, self.schedule_options, micro_batch_size, self.layout, self._timeout)
        self.num_nodes = 1
        self._parallel: Optional[ParallelContext] = None
        self._chunks: list[torch.nn.Module] = []  # model chunks as the schedule sees them (wrapped)

    # -- Lightning plumbing -------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="megatron-core TP/PP/VPP/DP/SP (lightning-megatron)", override=True
        )

    @property
    @override
    def precision_plugin(self) -> MegatronPrecision:  # type: ignore[override]
        return self._precision_plugin if self._precision_plugin is not None else MegatronPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Any]) -> None:
        # Lightning builds an autocast plugin from Trainer(precision=...); megatron-core needs its own.
        self._precision_plugin = from_lightning_plugin(plugin)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = DistCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._checkpoint_io = io

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "the Trainer has not assigned devices yet"
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the sharded optimizer template exists only after setup

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # The fetch of every batch is timed for step listeners (MegaScan's data time), not the gap between steps.
        return dataloader if isinstance(dataloader, TimedLoader) else TimedLoader(dataloader, self._steps.listeners)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Model-parallel peers must see the same samples: sample by data-parallel rank only (or as the
        # schedule says: MegaFBD's forward replicas read no data of their own).
        rank, replicas = self.schedule.data_parallel_shard(
            self.schedule_options, self.parallel.data_parallel_rank, self.parallel.data_parallel_size
        )
        return {"num_replicas": replicas, "rank": rank}

    @property
    def parallel(self) -> ParallelContext:
        if self._parallel is None:
            raise RuntimeError("The parallel layout exists once the Trainer has set up the strategy's processes.")
        return self._parallel

    @property
    def replays_cuda_graphs(self) -> bool:
        """``cuda_graphs`` as resolved when the processes start (with ``None`` a step graph may still give up);
        False in ``validate``/``test``/``predict`` runs, which have no training step."""
        return self._graphs

    @property
    def fuses_gradient_accumulation(self) -> bool:
        """``gradient_accumulation_fusion`` as resolved when the processes start."""
        return self._accumulation_fusion

    @property
    def step_graph(self) -> Optional[StepGraph]:
        """This fit's step graph when steps are replayed as CUDA graphs (its ``captures``, ``replays`` and
        ``gave_up_because``); else None."""
        return self._steps.graph

    @property
    def schedule_session(self) -> Any:
        """The session the steps run under now (a schedule's ``prediction``, ``last_order``, ...); None before setup."""
        return self._steps.session

    @contextmanager
    def using_schedule(self, schedule: str, schedule_options: Optional[Mapping[str, Any]] = None) -> Iterator[Any]:
        """``forward_backward`` inside the block runs ``schedule`` (a registered name, with its own options),
        then the strategy's own again: schedules compared in one fit, on the same model, batch and processes.
        Yields the schedule's session (its ``prediction``, ``policy``, ...); a step graph never replays for it."""
        entry = get_schedule(schedule)
        entry.validate(pipeline=self.layout.pipeline, virtual=self.layout.virtual_pipeline)
        with self._steps.using(entry, entry.options(schedule_options), self.root_device) as session:
            yield session

    @property
    def wrapped_chunks(self) -> list[torch.nn.Module]:
        """The model chunks as the pipeline schedule runs them (precision- and DDP-wrapped)."""
        return list(self._chunks)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    # -- processes and parallel state ---------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        on_cpu = self.root_device.type == "cpu"
        backend = self._process_group_backend or ("gloo" if on_cpu else "nccl")
        if backend == "nccl" and on_cpu:
            raise MegatronConfigError(
                "process_group_backend='nccl' needs GPUs, but the Trainer runs on CPU. Use accelerator='gpu', or "
                "process_group_backend='gloo' (the CPU default)."
            )
        if on_cpu:
            from lightning_megatron.compat import cpu, quiet

            cpu.apply()
            quiet.filter_cpu_warnings()
        collect_previous_fits()
        super().setup_environment()  # the accelerator sets the CUDA device
        reset_seed()
        self.set_world_ranks()
        data_parallel = self.layout.data_parallel_size(self.world_size)  # raises before any collective
        check_float8_precision(self.fp8_recipe, self.precision_plugin.params_dtype)
        check_float8_device(self.fp8_recipe, self.root_device)
        self._graphs, self._accumulation_fusion = resolve_step_settings(
            self.cuda_graphs,
            self.gradient_accumulation_fusion,
            module=self.lightning_module,
            on_cpu=on_cpu,
            params_dtype=self.precision_plugin.params_dtype,
            fitting=self.lightning_module.trainer.state.fn == TrainerFn.FITTING,
            pipeline=self.layout.pipeline,
            num_nodes=self.num_nodes,
            unchecked=settings_not_run_graphed(
                overlap_param_gather=self._ddp_kwargs.get("overlap_param_gather", False),
                tp_comm_overlap=self.tp_comm_overlap is not None,
                world_size=self.world_size,
            ),
        )
        self._init_process_group(backend, on_cpu)
        initialize_parallel_state(self.layout, self._timeout)
        base_seed = self._seed if self._seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 1234))
        seed_parallel_rngs(base_seed, graph_safe=self._graphs)
        self._parallel = ParallelContext(self.layout, self.precision_plugin.params_dtype, on_cpu=on_cpu)
        assert self._parallel.data_parallel_size == data_parallel

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _init_process_group(self, backend: str, on_cpu: bool) -> None:
        if dist.is_initialized():
            return
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {} if on_cpu else {"device_id": self.root_device}
        rendezvous.init_process_group(  # loopback only on one node
            backend,
            rank=self.global_rank,
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            main_address=self.cluster_environment.main_address,
            main_port=self.cluster_environment.main_port,
            timeout=self._timeout,
            **kwargs,
        )

    # -- model setup --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        check_trainer(trainer)
        chunks = validated_chunks(self.lightning_module, self.layout.num_chunks, self.parallel.config_kwargs())
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:  # Lightning's per-batch synchronisation of the ranks, told to step listeners as ``step-sync``
            announce_step_sync(trainer, self._steps.listeners)
        wrapped_before = [unwrap(c) for c in self._chunks]
        needs_ddp = fitting and not all(isinstance(c, DistributedDataParallel) for c in self._chunks)
        if fitting and self._graphs:
            self._steps.graph = self._steps.graph or StepGraph(strict=self.cuda_graphs is True)
            self._steps.graph.open()  # before the DDP wrapper: see StepGraph.open
        if wrapped_before != chunks or needs_ddp:
            wrapped = [self.precision_plugin.convert_module(c) for c in chunks]
            self._chunks = wrap_ddp(wrapped, self._ddp_kwargs) if fitting else wrapped
        if fitting:
            self.tp_layers.install(
                self._chunks,
                accumulate=self._accumulation_fusion,
                overlap=self.tp_comm_overlap,
                symmetric_ar_type=self.symmetric_ar_type,
                tp_group=parallel_state.get_tensor_model_parallel_group(),
                on_cpu=self.parallel.on_cpu,
                fp8_recipe=self.fp8_recipe,
            )
        self._install_config_hooks()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _install_config_hooks(self) -> None:
        install_config_hooks(
            self._chunks,
            self.layout,
            on_cpu=self.parallel.on_cpu,
            deallocate_pipeline_outputs=self.deallocate_pipeline_outputs,
            overlap_grad_reduce=self._ddp_kwargs["overlap_grad_reduce"],
        )
        self._steps.follow(self._chunks)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1 or not isinstance(self.optimizers[0], torch.optim.Optimizer):
            raise MegatronConfigError(
                "configure_optimizers() must return exactly one torch optimizer (with any LR schedulers); "
                f"got {len(self.optimizers)}."
            )
        optimizer = build_optimizer(
            self.optimizers[0],
            self._chunks,
            params_dtype=self.precision_plugin.params_dtype,
            use_distributed_optimizer=self.use_distributed_optimizer,
            extra_config=self._optimizer_config,
        )
        optimizer.listeners = self._steps.listeners  # the list itself: listeners added later are told too
        self.optimizers = [optimizer]
        if self.precision_plugin.params_dtype == torch.float16:
            for config in {id(get_model_config(c)): get_model_config(c) for c in self._chunks}.values():
                config.grad_scale_func = optimizer.loss_scaler  # type: ignore[attr-defined]

    @property
    def _optimizer(self) -> Optional[StrategyOptimizer]:
        opt = self.optimizers[0] if self.optimizers else None
        return opt if isinstance(opt, StrategyOptimizer) else None

    # -- observers of the step (tracing, fault injection) -----------------------------------------------
    def add_step_listener(self, listener: StepListener) -> None:
        """Tell ``listener`` about every step's spans (see ``strategy.listeners``); used by MegaScan."""
        self._steps.add_listener(listener, self._chunks)

    def remove_step_listener(self, listener: StepListener) -> None:
        self._steps.remove_listener(listener, self._chunks)

    # -- one step -----------------------------------------------------------------------------------
    def forward_backward(self, batch: Any, *, forward_only: bool = False) -> StepOutput:
        """Run one global batch's microbatches through the pipeline schedule; return the exact global loss.

        With ``forward_only=False`` this computes the gradients of the step (after clearing the previous
        ones); the optimizer update follows in Lightning's optimizer step.
        """
        return self._steps.run(
            self.lightning_module,
            self._chunks,
            batch,
            self.root_device,
            forward_only=forward_only,
            clear_grads=self._clear_grads,
        )

    def _clear_grads(self) -> None:
        for chunk in self._chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        if self._optimizer is not None:
            self._optimizer.clear_grads()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        opt = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(opt, StrategyOptimizer) and opt.last_grad_norm is not None:
            self.lightning_module.log("grad_norm", opt.last_grad_norm, on_step=True, batch_size=1)
        if isinstance(opt, StrategyOptimizer) and opt.last_step_skipped:
            self.lightning_module.log("skipped_step", 1.0, on_step=True, batch_size=1)  # fp16 overflow
        return output

    # -- checkpoints --------------------------------------------------------------------------------
    def _model_sharded_state_dict(self) -> dict[str, Any]:
        return model_sharded_state_dict(self.lightning_module.model_chunks)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._model_sharded_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        opt = getattr(optimizer, "_optimizer", optimizer)
        assert isinstance(opt, StrategyOptimizer)
        return opt.sharded_state_dict(self._model_sharded_state_dict(), is_loading=False)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its shards (Lightning's default saves on rank 0 only)."""
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        trainer = self.lightning_module.trainer
        return load_sharded(
            self.checkpoint_io,
            checkpoint_path,
            self.lightning_module.model_chunks,
            self._optimizer,
            fitting=trainer.state.fn == TrainerFn.FITTING,
            callbacks=trainer.callbacks,
            weights_only=weights_only,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        for i, chunk in enumerate(self.lightning_module.model_chunks):
            chunk.load_state_dict(state[f"chunk{i}"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        optimizer = self._optimizer
        if optimizer is not None:
            optimizer.load_sharded_state_dict(checkpoint["optimizer_states"][0])

    @override
    def teardown(self) -> None:
        self._steps.close()
        self.tp_layers.restore()
        release_training_state(
            self._chunks, {id(get_model_config(c)): get_model_config(c) for c in self._chunks}.values()
        )
        # The chunks stay usable for forward passes after the fit (serving, generation): only the DDP goes.
        self._chunks = [c.module if isinstance(c, DistributedDataParallel) else c for c in self._chunks]
        self.optimizers = []
        self.lr_scheduler_configs = []
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
