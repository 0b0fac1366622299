"""Every replacement of another project's function, in one table.

Why a table: a release of megatron-core, Lightning or torch that renames or changes one of these breaks the
project where nobody looks, so the list of what the project replaces, why, and how it is undone is kept as data,
next to the code that does it. ``tests/test_patch_inventory.py`` checks each entry: the replaced target exists in
the installed versions, the installer exists, and where it can run in one CPU process, that it installs where
stated and that its restore puts the original back. The user docs' table is generated from :data:`PATCHES`
(:func:`markdown_table`).

Only replacements count: a function or method of another project swapped for one of ours, on a module, a class, an
instance, or (the CPU layer) for the whole process. Private names merely *called* (``compat.torch``'s store, the
Lightning launcher ``compat.lightning`` imports) and subclasses overriding a private method
(``display``'s progress bar) are not patches; they are listed in the module docstrings that use them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PATCHES", "Patch", "markdown_table"]


@dataclass(frozen=True, kw_only=True)
class Patch:
    target: str
    """What is replaced: ``package.module:attribute.path`` (resolvable in the tested versions)."""
    installer: str
    """The project's function that replaces it: ``package.module:function``."""
    scope: str
    """``process`` (for the life of the process), ``fit`` (installed for a fit or a traced window, restored after),
    ``instance`` (on one object, gone with it or restored)."""
    why: str
    restored: str
    """How the original comes back (or why it need not)."""
    tested: str
    """The versions it was tested with."""
    covered_by: str
    """The test file that exercises it."""
    also: tuple[str, ...] = ()
    """The same installer's other replacements, for the same reason (same ``package.module:attribute`` form)."""


_MCORE = "megatron-core 0.16.1"
_TORCH = "torch 2.13 (CPU), 2.11 (CUDA 13.0)"
_LIGHTNING = "Lightning 2.6.6"

PATCHES: tuple[Patch, ...] = (
    Patch(
        target="torch.cuda:current_device",
        installer="lightning_megatron.compat.cpu:apply",
        scope="process",
        why="megatron-core assumes CUDA for buffers, streams, events, RNG states and synchronisation even when every "
        "tensor is on the CPU; CPU runs redirect torch.cuda's runtime (current_device, synchronize, streams, events, "
        "empty_cache, RNG state, manual_seed) to no-ops or the CPU, plus a torch-function mode for device='cuda' (which "
        "also drops pin_memory=True, as context parallelism's RoPE slice asks)",
        restored="never: CPU-only processes in which no GPU is visible (apply() refuses otherwise)",
        tested=f"{_MCORE}, torch 2.13 (CPU)",
        covered_by="tests/test_training.py",
        also=tuple(
            f"torch.cuda:{name}"
            for name in (
                "synchronize",
                "current_stream",
                "default_stream",
                "Stream",
                "Event",
                "stream",
                "empty_cache",
                "get_rng_state",
                "set_rng_state",
                "manual_seed",
            )
        ),
    ),
    Patch(
        target="megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        installer="lightning_megatron.compat.cpu:apply",
        scope="process",
        why="the tensor-parallel RNG tracker saves and restores CUDA RNG states; on CPU they are the CPU generator's "
        "(also _set_cuda_rng_state)",
        restored="never: CPU-only processes",
        tested=f"{_MCORE}, torch 2.13 (CPU)",
        covered_by="tests/test_training.py",
        also=("megatron.core.tensor_parallel.random:_set_cuda_rng_state",),
    ),
    Patch(
        target="megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
        installer="lightning_megatron.compat.megatron_p2p:install",
        scope="fit",
        why="megatron-core names its p2p timers after the call, not after what the call moves; the wrapper reports "
        "the messages each call really posted, so MegaScan pairs sends with receives",
        restored="megatron_p2p.uninstall, when the last step listener of the user's goes (and at teardown)",
        tested=_MCORE,
        covered_by="tests/test_patch_inventory.py",
    ),
    Patch(
        target="megatron.core.tensor_parallel.mappings:_reduce",
        installer="lightning_megatron.compat.symmetric_all_reduce:install",
        scope="fit",
        why="symmetric_ar_type: megatron-core's tensor-parallel all-reduce through torch's symmetric-memory kernels "
        "(one_shot, two_shot) without Transformer Engine",
        restored="SymmetricAllReduce.restore at teardown (layers.install.TensorParallelLayers.restore)",
        tested=f"{_MCORE}, {_TORCH}",
        covered_by="tests/test_symmetric_all_reduce.py",
    ),
    Patch(
        target="megatron.core.tensor_parallel.layers:ColumnParallelLinear._forward_impl",
        installer="lightning_megatron.compat.megatron_linear:replace",
        scope="instance",
        why="the weight-gradient split (zero-bubble schedules, fused accumulation into main_grad) and the overlapped "
        "tensor-parallel collectives need the layers' own backward; set per layer instance (RowParallelLinear's "
        "_forward_impl too, and with tp_comm_overlap its forward), never on the class",
        restored="megatron_linear.restore (layers.wgrad.SplitLinears.restore) at teardown or session close",
        tested=f"{_MCORE}, {_TORCH}",
        covered_by="tests/test_wgrad.py",
        also=(
            "megatron.core.tensor_parallel.layers:RowParallelLinear._forward_impl",
            "megatron.core.tensor_parallel.layers:RowParallelLinear.forward",
        ),
    ),
    Patch(
        target="megatron.core.optimizer.clip_grads:l2_norm_impl",
        installer="lightning_megatron.compat.multi_tensor:install",
        scope="process",
        why="without Transformer Engine or Apex megatron-core's fallbacks synchronise once per parameter (norm) or "
        "loop per tensor (scale); torch's foreach kernels compute the same (also multi_tensor_scale_impl of "
        "clip_grads and optimizer.optimizer); only replaced while they hold the local fallbacks",
        restored="never: the same arithmetic; TE's or Apex's kernels are never replaced",
        tested=f"{_MCORE}, {_TORCH}",
        covered_by="tests/test_patch_inventory.py",
        also=(
            "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
            "megatron.core.optimizer.optimizer:multi_tensor_scale_impl",
        ),
    ),
    Patch(
        target="megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb",
        installer="lightning_megatron.compat.rope:install",
        scope="process",
        why="apply_rope_fusion=True needs this global, which megatron-core fills only from Transformer Engine; set to "
        "kernels.rope only while it is None",
        restored="never: only set where it was None (Transformer Engine's kernel is kept)",
        tested=_MCORE,
        covered_by="tests/test_patch_inventory.py",
    ),
    Patch(
        target="megatron.core.transformer.moe.moe_utils:RouterGatingLinearFunction.forward",
        installer="lightning_megatron.compat.moe:install",
        scope="process",
        why="the MoE router's gating linear (forward and backward) reads the global te_general_gemm, which "
        "moe_utils defines only when Transformer Engine imports (NameError without it); install defines it as None "
        "where it is missing, so both take their torch.mm path",
        restored="never: only defined where it was missing (Transformer Engine's GEMM is kept)",
        tested=_MCORE,
        covered_by="tests/test_moe.py",
        also=("megatron.core.transformer.moe.moe_utils:RouterGatingLinearFunction.backward",),
    ),
    Patch(
        target="megatron.core.transformer.moe.moe_utils:MoEAuxLossAutoScaler.set_loss_scale",
        installer="lightning_megatron.compat.moe:scale_router_loss_gradients",
        scope="fit",
        why="with calculate_per_token_loss each router scales its load-balancing and z-losses by the tokens it "
        "routed, so where sequence or context parallelism splits a microbatch's tokens over ranks their gradients "
        "came out 1 / (TP x CP) of one process's; the scale the schedules set before each backward is multiplied "
        "by the number of ranks the tokens are split over",
        restored="scale_router_loss_gradients(1) when the fit's training state is released (strategy teardown)",
        tested=_MCORE,
        covered_by="tests/test_moe.py",
    ),
    Patch(
        target="megatron.core.transformer.moe.router:Router.gating",
        installer="lightning_megatron.compat.router:logits_site",
        scope="instance",
        why="no module boundary carries a router's logits between its gating linear and its top-k; MegaScope sets "
        "one router instance's gating to one that passes the logits through an identity module its capture and "
        "perturbation hooks attach to (hook_router_logits, a disabled expert)",
        restored="not needed: the identity returns the logits unchanged, and without hooks it is skipped; it goes "
        "with the router",
        tested=_MCORE,
        covered_by="tests/test_scope_moe.py",
    ),
    Patch(
        target="megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        installer="lightning_megatron.compat.moe:install",
        scope="process",
        why="the all-to-all dispatcher's split sizes become numpy arrays only when they are CUDA tensors; on CPUs "
        "they stay tensors, which all_to_all_single rejects; the dispatcher's copy also converts CPU tensors "
        "when asked for numpy (CUDA tensors go to megatron-core's)",
        restored="never: the same values for CUDA tensors, and the conversion megatron-core meant for CPU ones",
        tested=f"{_MCORE}, {_TORCH}",
        covered_by="tests/test_moe.py",
    ),
    Patch(
        target="megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
        installer="lightning_megatron.compat.gloo_uneven:install",
        scope="process",
        why="gloo has no all_gather of unequal parts and no reduce_scatter, which the MoE dispatcher runs over the "
        "tensor-parallel group with split sizes; on gloo processes, calls with split sizes pad and gather, or "
        "all-reduce and slice (also _reduce_scatter_along_first_dim); calls without go to megatron-core's",
        restored="never: CPU (gloo) processes, the same values",
        tested=f"{_MCORE}, torch 2.13 (CPU)",
        covered_by="tests/test_moe.py",
        also=("megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim",),
    ),
    Patch(
        target="megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
        installer="lightning_megatron.compat.megatron:use_in_process_checkpoint_results",
        scope="process",
        why="the checkpoint writer otherwise spawns a multiprocessing.Manager per rank that outlives a killed rank; "
        "synchronous saves need only a thread queue",
        restored="never: only set where it was None",
        tested=_MCORE,
        covered_by="tests/test_checkpoint.py",
    ),
    Patch(
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
        installer="lightning_megatron.compat.megatron:prepare_distributed_optimizer_load",
        scope="instance",
        why="loading a distributed-optimizer checkpoint without TE/Apex copies torch AdamW's 'step' wrongly "
        "(KeyError); the wrapper leaves 'step' alone when the checkpoint does not carry it",
        restored="not needed: set on the fit's optimizer instances only, which go with the fit",
        tested=f"{_MCORE}, {_TORCH}",
        covered_by="tests/test_checkpoint.py",
    ),
    Patch(
        target="lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor",
        installer="lightning_megatron.compat.lightning:announce_step_sync",
        scope="instance",
        why="Lightning's per-batch synchronisation of the ranks is where a late rank keeps the others waiting; the "
        "wrapper tells step listeners (span 'step-sync'); a Lightning without the method is left alone",
        restored="not needed: set on one Trainer's loop, which goes with the Trainer",
        tested=_LIGHTNING,
        covered_by="tests/test_patch_inventory.py",
    ),
    Patch(
        target="torch.distributed:all_reduce",
        installer="lightning_megatron.scan.tracing.collectives:CollectiveTracer.install",
        scope="fit",
        why="MegaScan traces collectives that megatron-core's timers do not announce (sequence-parallel and async "
        "ones, and the MoE dispatcher's all-to-all exchanges): torch.distributed's all_reduce, "
        "all_gather_into_tensor, _all_gather_base, reduce_scatter_tensor, _reduce_scatter_base, broadcast, "
        "all_to_all_single, all_to_all, and megatron-core's module aliases of them (dist_all_gather_func, "
        "dist_reduce_scatter_func in mappings, layers and param_and_grad_buffer); lives in scan/, not compat/",
        restored="CollectiveTracer.uninstall after each traced window",
        tested=f"{_MCORE}, {_TORCH}",
        covered_by="tests/test_scan_collectives.py",
        also=(
            "torch.distributed:all_gather_into_tensor",
            "torch.distributed:_all_gather_base",
            "torch.distributed:reduce_scatter_tensor",
            "torch.distributed:_reduce_scatter_base",
            "torch.distributed:broadcast",
            "torch.distributed:all_to_all_single",
            "torch.distributed:all_to_all",
            "megatron.core.tensor_parallel.mappings:dist_all_gather_func",
            "megatron.core.tensor_parallel.mappings:dist_reduce_scatter_func",
            "megatron.core.tensor_parallel.layers:dist_all_gather_func",
            "megatron.core.tensor_parallel.layers:dist_reduce_scatter_func",
            "megatron.core.distributed.param_and_grad_buffer:dist_all_gather_func",
            "megatron.core.distributed.param_and_grad_buffer:dist_reduce_scatter_func",
        ),
    ),
    Patch(
        target="socketio.server:Server._handle_eio_message",
        installer="lightning_megatron.compat.engineio:guard_messages",
        scope="instance",
        why="python-socketio decodes a packet inside Engine.IO's message handler and only logs what raises there, so "
        "a client sending a packet that does not decode got silence; MegaScope's server wraps the handler of its "
        "own Engine.IO server (eio.handlers['message']) and answers with a named error. install_drivers likewise "
        "sets entries of that server's own driver table (eio._async: the size-limited websocket driver, a sleep "
        "that ends at stop())",
        restored="goes away with the server object",
        tested="python-engineio 4.15, python-socketio 5.18, Flask-SocketIO 5.7",
        covered_by="tests/test_compat_engineio.py",
    ),
)
"""Every replacement of another project's function (see the module docstring)."""


def markdown_table() -> str:
    """:data:`PATCHES` as the Markdown table of the user docs."""
    rows = [
        "| Replaced | By | Scope | Why | Restored | Tested with |",
        "|---|---|---|---|---|---|",
    ]
    for patch in PATCHES:
        replaced = ", ".join(f"`{t}`" for t in (patch.target, *patch.also))
        cells = (replaced, f"`{patch.installer}`", patch.scope, patch.why, patch.restored, patch.tested)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
