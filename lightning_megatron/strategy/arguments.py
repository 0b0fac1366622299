"""The strategy's scalar arguments and the Trainer settings it cannot work with, checked before any process starts.

Each check raises a ``MegatronConfigError`` that names the argument and the fix, so a YAML typo fails in the launching
process instead of as an internal error (or a hang) inside the ranks. The arguments that belong to one capability
are checked by that capability's module (``ParallelLayout``, ``graphs.check_cuda_graphs``, the schedule registry,
``layers.*_option``, ``chunks.ddp_options``); what is left, and the Trainer, is here.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.errors import MegatronConfigError

__all__ = ["check_scalar_arguments", "check_trainer"]


def check_scalar_arguments(
    *, micro_batch_size: Any, process_group_backend: Any, gradient_accumulation_fusion: Any
) -> None:
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise MegatronConfigError(f"`micro_batch_size` must be a positive integer, got {micro_batch_size!r}.")
    if process_group_backend not in (None, "nccl", "gloo"):
        raise MegatronConfigError(
            f"`process_group_backend` must be 'nccl' (GPUs) or 'gloo' (CPUs), got {process_group_backend!r}."
        )
    if gradient_accumulation_fusion not in (None, True, False):
        raise MegatronConfigError(
            f"`gradient_accumulation_fusion` must be true, false or unset (automatic), got "
            f"{gradient_accumulation_fusion!r}."
        )


def check_trainer(trainer: Any) -> None:
    """Trainer settings the strategy replaces: gradient accumulation (microbatches) and manual optimization."""
    if trainer.accumulate_grad_batches != 1:
        raise MegatronConfigError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not used with "
            "MegatronAppStrategy: one batch is one optimizer step, accumulated over microbatches. Raise the "
            "global batch size instead (microbatches = batch size per data-parallel rank / micro_batch_size)."
        )
    if not trainer.lightning_module.automatic_optimization:
        raise MegatronConfigError(
            "MegatronAppStrategy drives the optimizer itself (the pipeline schedule runs forward and backward "
            "inside training_step); keep `automatic_optimization = True`."
        )
