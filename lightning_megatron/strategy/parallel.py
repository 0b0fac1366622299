"""The parallel layout: what the user asked for, and what a rank knows once the groups exist.

``ParallelLayout`` is pure data, validated against the world size before any process group is made.
``ParallelContext`` is built from megatron-core's ``parallel_state`` after initialization; the
LightningModule reads it (as ``self.parallel``) to build the model chunks of its own pipeline stage,
the way Lightning's ``ModelParallelStrategy`` hands modules a ``device_mesh``. ``initialize_parallel_state``
makes megatron-core's groups for a layout (once per process and layout), and ``seed_parallel_rngs`` seeds the
random streams the layout needs, once the groups exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_megatron.compat.megatron import initialize_model_parallel
from lightning_megatron.errors import MegatronConfigError

__all__ = ["ParallelLayout", "ParallelContext", "StageSpec", "initialize_parallel_state", "seed_parallel_rngs"]


@dataclass(frozen=True)
class ParallelLayout:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None
    sequence_parallel: bool = False
    context: int = 1
    """Context parallelism: ranks that each hold a slice of every sequence (``context_parallel_size``)."""
    expert: int = 1
    """Expert parallelism: ranks over which each MoE layer's experts are split (``expert_model_parallel_size``),
    taken from the data- (and context-) parallel ranks, as in megatron-core: the rest of the model stays replicated
    over them, each expert over ``data × context / expert`` ranks (expert data parallelism)."""

    def __post_init__(self) -> None:
        for name, value in (
            ("tensor_model_parallel_size", self.tensor),
            ("pipeline_model_parallel_size", self.pipeline),
            ("context_parallel_size", self.context),
            ("expert_model_parallel_size", self.expert),
        ):
            if not isinstance(value, int) or value < 1:
                raise MegatronConfigError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.virtual_pipeline is not None:
            if not isinstance(self.virtual_pipeline, int) or self.virtual_pipeline < 1:
                raise MegatronConfigError(
                    "`virtual_pipeline_model_parallel_size` must be a positive integer or None, "
                    f"got {self.virtual_pipeline!r}."
                )
            if self.pipeline == 1:
                raise MegatronConfigError(
                    "`virtual_pipeline_model_parallel_size` needs pipeline parallelism: set "
                    "`pipeline_model_parallel_size` > 1 or leave the virtual size unset."
                )
        if self.sequence_parallel and self.tensor == 1:
            raise MegatronConfigError(
                "`sequence_parallel=True` splits activations across tensor-parallel ranks and needs "
                "`tensor_model_parallel_size` > 1."
            )

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline

    @property
    def num_chunks(self) -> int:
        """Model chunks held by each rank: one per virtual pipeline stage."""
        return self.virtual_pipeline or 1

    @property
    def ranks_per_replica(self) -> int:
        """Ranks that hold one copy of the model and see one stream of data: tensor × pipeline × context."""
        return self.model_parallel_size * self.context

    def data_parallel_size(self, world_size: int) -> int:
        per_replica = self.ranks_per_replica
        if world_size % per_replica:
            sizes = "tensor_model_parallel_size × pipeline_model_parallel_size"
            values = f"{self.tensor} × {self.pipeline}"
            if self.context > 1:
                sizes, values = f"{sizes} × context_parallel_size", f"{values} × {self.context}"
            raise MegatronConfigError(
                f"The world size {world_size} is not divisible by {sizes} = {values} = {per_replica}. "
                f"Launch a multiple of {per_replica} processes (Trainer devices × num_nodes) "
                "or change the parallel sizes."
            )
        data = world_size // per_replica
        if (data * self.context) % self.expert:
            raise MegatronConfigError(
                f"expert_model_parallel_size={self.expert} must divide the data-parallel size × "
                f"context_parallel_size = {data} × {self.context} (experts are split over those ranks; the world "
                f"size {world_size} leaves {data} data-parallel replicas). Launch more processes or lower "
                "expert_model_parallel_size."
            )
        return data

    def check_seq_length(self, seq_length: int) -> None:
        """Raise unless a sequence of ``seq_length`` tokens splits over the context-parallel ranks: ``2 ×
        context_parallel_size`` equal chunks (the load-balanced split), each rank's share then over the tensor-parallel
        ranks under sequence parallelism."""
        if self.context == 1:
            return
        parts = 2 * self.context * (self.tensor if self.sequence_parallel else 1)
        if seq_length % parts:
            what = f"2 × context_parallel_size = {2 * self.context}"
            if self.sequence_parallel:
                what = f"2 × context_parallel_size × tensor_model_parallel_size = {parts} (sequence parallelism)"
            raise MegatronConfigError(
                f"The sequence length {seq_length} does not split into {what} equal parts. Use a sequence length "
                f"that is a multiple of {parts}, or another context_parallel_size."
            )

    def check_num_layers(self, num_layers: int) -> None:
        """Raise unless ``num_layers`` splits evenly over pipeline (and virtual) stages."""
        stages = self.pipeline * self.num_chunks
        if num_layers % stages:
            what = (
                f"pipeline_model_parallel_size × virtual_pipeline_model_parallel_size = {self.pipeline} × "
                f"{self.virtual_pipeline} = {stages}"
                if self.virtual_pipeline
                else f"pipeline_model_parallel_size = {self.pipeline}"
            )
            raise MegatronConfigError(
                f"The model has {num_layers} layers, which do not split evenly over {what} stages. "
                "Choose a layer count that is a multiple of the number of stages, or other parallel sizes."
            )


@dataclass(frozen=True)
class StageSpec:
    """One model chunk this rank builds: its virtual stage and whether it holds the embedding or the head."""

    vp_stage: Optional[int]
    pre_process: bool
    post_process: bool


class ParallelContext:
    """Ranks, groups and stages of this process, valid once the strategy has set up megatron-core."""

    def __init__(self, layout: ParallelLayout, precision_dtype: torch.dtype, on_cpu: bool) -> None:
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("ParallelContext needs megatron-core's parallel state to be initialized first.")
        self.layout = layout
        self.params_dtype = precision_dtype
        self.on_cpu = on_cpu
        self.tensor_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.data_parallel_rank = parallel_state.get_data_parallel_rank()
        self.data_parallel_size = parallel_state.get_data_parallel_world_size()
        self.context_parallel_rank = parallel_state.get_context_parallel_rank()
        self.context_parallel_size = parallel_state.get_context_parallel_world_size()
        self.expert_parallel_rank = parallel_state.get_expert_model_parallel_rank()
        required = ["tp", "pp", "mp", "cp", "dp", "dp_cp", "embd", "pos_embd"]
        if layout.expert > 1:
            required += ["ep", "expt_tp", "expt_dp", "tp_ep"]
        self.process_groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=required)

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's (dp, pp, tp) coordinates, the names used in logs and trace files (and ep with experts
        split over ranks)."""
        coordinates = {"dp": self.data_parallel_rank, "pp": self.pipeline_rank, "tp": self.tensor_rank}
        if self.layout.expert > 1:
            coordinates["ep"] = self.expert_parallel_rank
        return coordinates

    @property
    def is_first_pipeline_stage(self) -> bool:
        return parallel_state.is_pipeline_first_stage(ignore_virtual=True)

    @property
    def is_last_pipeline_stage(self) -> bool:
        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    def stages(self) -> list[StageSpec]:
        """The model chunks this rank must build, in virtual-stage order."""
        if self.layout.virtual_pipeline is None:
            return [StageSpec(None, self.is_first_pipeline_stage, self.is_last_pipeline_stage)]
        return [
            StageSpec(
                vp_stage=v,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            )
            for v in range(self.layout.virtual_pipeline)
        ]

    def config_kwargs(self) -> dict[str, Any]:
        """The ``TransformerConfig`` fields the strategy owns; pass them when building the model config.

        Parallel sizes and dtypes decide how layers are split and allocated, so they must be right when
        the model is built. The run-time hooks (gradient sync, loss scaling) are installed by the
        strategy afterwards.
        """
        half = self.params_dtype in (torch.bfloat16, torch.float16)
        return {
            "tensor_model_parallel_size": self.layout.tensor,
            "pipeline_model_parallel_size": self.layout.pipeline,
            "virtual_pipeline_model_parallel_size": self.layout.virtual_pipeline,
            "sequence_parallel": self.layout.sequence_parallel,
            "context_parallel_size": self.layout.context,
            "expert_model_parallel_size": self.layout.expert,
            "params_dtype": self.params_dtype,
            "pipeline_dtype": self.params_dtype,
            "bf16": self.params_dtype == torch.bfloat16,
            "fp16": self.params_dtype == torch.float16,
            # Megatron-LM keeps softmax in fp32 for half precision; the local attention needs it for fp16.
            "attention_softmax_in_fp32": half,
            "use_cpu_initialization": self.on_cpu,
            # The loss contract is token-weighted sums: megatron-core then scales gradients by the
            # global token count once, which makes the loss exact across microbatches and replicas.
            "calculate_per_token_loss": True,
        }


def initialize_parallel_state(layout: ParallelLayout, timeout: timedelta) -> None:
    """megatron-core's process groups for ``layout``; kept when they already exist with the same sizes (a later
    fit or validate in the same process: its model holds these groups)."""
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == layout.tensor
            and parallel_state.get_pipeline_model_parallel_world_size() == layout.pipeline
            and parallel_state.get_virtual_pipeline_model_parallel_world_size() == layout.virtual_pipeline
            and parallel_state.get_context_parallel_world_size() == layout.context
            and parallel_state.get_expert_model_parallel_world_size() == layout.expert
        )
        if same:
            return
    initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        distributed_timeout_minutes=max(1, int(timeout.total_seconds() // 60)),
    )


def seed_parallel_rngs(base_seed: int, *, graph_safe: bool) -> None:
    """Seed torch and megatron-core's tensor-parallel RNG tracker as Megatron-LM does: pipeline stages get
    distinct dropout streams; tensor-parallel ranks get distinct streams inside TP regions and equal ones
    outside. ``graph_safe``: the tracker's generators are ones a CUDA graph can register (the step graph
    replays dropout with fresh numbers); a tracker of the other kind is replaced."""
    seed = base_seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    reset = getattr(tracker, "use_cudagraphable_rng", False) != graph_safe
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graph_safe, force_reset_rng=reset)
