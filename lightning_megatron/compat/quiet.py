"""What this package keeps off the console: other projects' messages that are not the user's to act on.

Every filter here is narrow: it matches one message (a regular expression on its start), from the modules that
emit it, of its category; each states why the user cannot act on it. Everything else, the user's own
warnings above all, still shows. Drop an entry when the project that emits the message fixes it.

* ``filter_warnings()``: warnings raised while importing or running megatron-core, Lightning and torch the way
  this package does. Installed when ``lightning_megatron`` is imported (it imports nothing heavy), so before any
  of its modules imports megatron-core, whose import warns.
* ``filter_cpu_warnings()``: warnings that are advice for GPUs, installed when a strategy sets up on CPU.
* ``quiet_cli_logs()``: log lines of Lightning that the ``lightning-megatron`` command hides: advertising
  tips, and the seed line repeated by every rank the launcher starts (rank 0 prints it once).
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["filter_cpu_warnings", "filter_warnings", "quiet_cli_logs"]

# (category, module regex, message regex, why the user cannot act on it)
_WARNINGS: tuple[tuple[type[Warning], str, str, str], ...] = (
    (
        UserWarning,
        r"megatron\.core\.",
        r"(Transformer Engine and Apex are|Transformer Engine is|Apex is) not installed",
        "The models here are built from megatron-core's local (torch) layers on purpose; these fallbacks are what "
        "runs. megatron-core warns at import, once per module and per process.",
    ),
    (
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config\Z",
        r"full scope is deprecated",
        "megatron-core 0.16's own default (cuda_graph_scope='full') triggers its deprecation notice for every "
        "TransformerConfig; no CUDA graphs are used here.",
    ),
    (
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree\Z",
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning 2.6 builds torch's deprecated LeafSpec when it measures a batch (torch >= 2.10); Lightning's to fix.",
    ),
    (
        FutureWarning,
        r"megatron\.core\.dist_checkpointing\.",
        r"`load_state_dict` is deprecated",
        "megatron-core's checkpoint loader calls torch.distributed.checkpoint's deprecated entry point.",
    ),
    (
        FutureWarning,
        r"(torch|megatron|lightning_megatron)\.",
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "megatron-core's dist_checkpointing builds torch ShardedTensors when it saves and loads checkpoints.",
    ),
)

_CPU_WARNINGS: tuple[tuple[type[Warning], str, str, str], ...] = (
    (
        UserWarning,
        r"megatron\.core\.tensor_parallel\.layers\Z",
        r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment "
        r"variable CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_DEVICE_MAX_CONNECTIONS orders CUDA streams; on CPU there are none. (On GPUs the advice stands.)",
    ),
)

# Log records of Lightning's loggers that the command line drops: (logger name, message regex).
_CLI_LOG_LINES: tuple[tuple[str, str], ...] = (
    # Lightning advertises its cloud services when no LitLogger / LitModelCheckpoint is configured.
    # (rank_zero_info logs to whichever of these two Lightning packages bound it last.)
    ("lightning.pytorch.utilities.rank_zero", r"💡 Tip: "),
    ("lightning.fabric.utilities.rank_zero", r"💡 Tip: "),
    # LightningCLI seeds in every process the launcher starts; rank 0's line says the same.
    ("lightning.fabric.utilities.seed", r"\[rank: [1-9][0-9]*\] Seed set to "),
)


def _install(entries: tuple[tuple[type[Warning], str, str, str], ...]) -> None:
    for category, module, message, _why in entries:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def filter_warnings() -> None:
    """Ignore the third-party warnings listed above (idempotent: ``filterwarnings`` drops duplicates)."""
    _install(_WARNINGS)


def filter_cpu_warnings() -> None:
    """Ignore the GPU advice that megatron-core gives on CPU too."""
    _install(_CPU_WARNINGS)


class _DropLines(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_cli_logs() -> None:
    """Drop Lightning's tips and the per-rank seed lines (for the ``lightning-megatron`` command only)."""
    for name, pattern in _CLI_LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropLines(pattern))
