"""Workarounds for megatron-core 0.16, in one place: a process its checkpoint writer spawns, a pipeline
communication bug, a checkpoint-loading bug of its distributed optimizer without Transformer Engine, and process
groups its ``destroy_model_parallel`` forgets without destroying.
Each function says what it works around and how it was found; drop them as megatron-core fixes these. Two of them
replace megatron-core's functions (``use_in_process_checkpoint_results``: the writer's results queue;
``prepare_distributed_optimizer_load``: a method on the fit's optimizer instances); :mod:`.inventory` lists them.
"""

from __future__ import annotations

import queue

import torch

__all__ = [
    "batched_p2p_is_safe",
    "finish_distributed_optimizer_load",
    "initialize_model_parallel",
    "prepare_distributed_optimizer_load",
    "release_model_parallel",
    "use_in_process_checkpoint_results",
]


def use_in_process_checkpoint_results() -> None:
    """Keep megatron-core's checkpoint writer from spawning a helper process per rank.

    The sharded writer hands per-file write results back through a queue it creates with a *spawned*
    ``multiprocessing.Manager`` (``filesystem_async._results_queue``): an extra Python process per rank
    that re-imports the training script (~0.4 GB each), started at the first save and left running when
    the rank is killed. Synchronous saves, the only kind this project makes, pass those results within
    the saving process, so a plain thread queue does the same job.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def batched_p2p_is_safe(*, on_cpu: bool, pipeline: int, virtual_pipeline: int | None) -> bool:
    """Whether megatron-core 0.16's batched pipeline send/receive (``batch_p2p_comm``) gives right results.

    With two pipeline stages and virtual stages, both directions of the interleaved schedule go to the
    same peer with the same shape, and the batched ``batch_isend_irecv`` pairs them up wrongly. Seen in a
    GPU parity run (``benchmarks/gpu_parity.py``, NCCL, bf16): the gradient norm and the loss of PP2×VPP2 were
    far off those of one GPU, while PP4×VPP2 was exact; on gloo the gradients come out about three orders of
    magnitude too large. Unbatched send/receive is exact. On gloo, batching also calls
    ``torch.cuda.synchronize``, so it is off on CPUs altogether.
    """
    return not on_cpu and not (pipeline == 2 and virtual_pipeline is not None)


def _distributed_parts(megatron_optimizer: object) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    return [p for p in parts if isinstance(p, DistributedOptimizer)]


def prepare_distributed_optimizer_load(megatron_optimizer: object) -> None:
    """Let megatron-core 0.16's distributed optimizer load checkpoints without Transformer Engine or Apex.

    Without TE/Apex the inner optimizer is torch's AdamW, whose per-parameter state holds a ``step``
    next to ``exp_avg``/``exp_avg_sq``. Three places in ``DistributedOptimizer`` then mishandle it:

    * building the template to load into calls ``state_dict()``, which reads every parameter's ``step``
      and fails on a fresh optimizer that has not stepped (``assert len(steps) == 1``);
    * every parameter-state loader skips ``step`` in the checkpoint (it is restored separately from the
      param groups) but then copies *every* key of the live state, ``step`` included (``KeyError: 'step'``);
    * ``load_state_dict`` restores that step as *one* tensor shared by all parameters, which torch's
      AdamW then increments once per parameter per step, corrupting the bias correction after a resume.

    The first is met by megatron-core's own dummy initializer (one step on zero gradients; the load then
    overwrites states and master weights), the second by wrapping, on these optimizer instances only,
    the per-parameter setter so that it leaves ``step`` alone when the checkpoint tensors do not carry
    it. ``finish_distributed_optimizer_load`` fixes the third.
    """
    for part in _distributed_parts(megatron_optimizer):
        if getattr(part, "_step_safe_loading", False):
            continue
        if not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()
        original = part._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, part=part, original=original):  # noqa: ANN001, ANN202
            if "step" in tensors:
                return original(model_param, tensors)
            group_index, group_order = part.model_param_group_index_map[model_param]
            state = part.optimizer.state[part.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                return original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        part._set_main_param_and_optimizer_states = set_states
        part._step_safe_loading = True


def finish_distributed_optimizer_load(megatron_optimizer: object) -> None:
    """Give every parameter its own ``step`` tensor again (see ``prepare_distributed_optimizer_load``)."""
    for part in _distributed_parts(megatron_optimizer):
        for state in part.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


_MODEL_PARALLEL_GROUPS: list = []  # the process groups our last initialize_model_parallel created


def initialize_model_parallel(**kwargs) -> None:
    """megatron-core's ``initialize_model_parallel``, destroying the groups of the previous call first.

    ``parallel_state.destroy_model_parallel`` only forgets its process groups; torch.distributed keeps them
    registered, with their threads and sockets (gloo: a listening socket and a loop thread per group, and megatron
    creates dozens per call). A process that trains at several layouts (a sweep, a test suite) piled up thousands
    of threads, some of them busy, until the machine crawled. Groups are told apart from the user's by taking
    the registry before and after the call (torch has no public list of groups).
    """
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    if parallel_state.model_parallel_is_initialized() or _MODEL_PARALLEL_GROUPS:
        release_model_parallel()
    before = set(distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(**kwargs)
    _MODEL_PARALLEL_GROUPS.extend(g for g in distributed_c10d._world.pg_map if g not in before)


def release_model_parallel() -> None:
    """Undo ``initialize_model_parallel`` completely, leaving the default (world) group alone.

    Calls megatron-core's ``destroy_model_parallel``, destroys in torch.distributed the groups the last
    ``initialize_model_parallel`` above created, and clears the module globals megatron-core 0.16.1's
    ``destroy_model_parallel`` leaves pointing at a group (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO``, found by listing ``parallel_state``'s globals after it).
    Afterwards neither megatron-core's parallel state nor torch.distributed's registry holds those groups, so they
    are freed in this process once the model built on them goes: a process that forks later (a test suite's rank
    pool) would otherwise hand its children gloo groups whose destructors segfault or hang there. The model can no
    longer run collectives. Idempotent, and a no-op before any ``initialize_model_parallel``.
    """
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    parallel_state.destroy_model_parallel()
    for group in _MODEL_PARALLEL_GROUPS:
        if group in distributed_c10d._world.pg_map:
            torch.distributed.destroy_process_group(group)
    _MODEL_PARALLEL_GROUPS.clear()
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)
