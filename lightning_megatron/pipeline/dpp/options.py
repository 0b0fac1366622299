"""The settings of the ``"dpp"`` schedule (``MegatronAppStrategy(schedule="dpp", schedule_options={...})``).

Parsed when the strategy is built, so a typo or a bad value fails at once, naming the key and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.dpp.policy import POLICIES
from lightning_megatron.pipeline.transports import check_keys, check_transport_settings

__all__ = ["WEIGHT_GRAD_MEMORY", "DppOptions", "parse_options"]

WEIGHT_GRAD_MEMORY = ("first-rank", "own-rank")


@dataclass(frozen=True)
class DppOptions:
    policy: str = "adaptive"
    """``static`` (megatron-core's order), ``adaptive``, ``depth-first`` or ``breadth-first``."""
    extra_activations: int = 0
    """Activations a rank may hold beyond the interleaved schedule's peak, to run ahead when a link is late."""
    transport: str = "auto"
    """``shm`` on one node (CUDA IPC on GPUs), ``torch``, ``tcp``, ``rdma``; ``auto``: shm if the job fits a node."""
    transport_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the transport (``ring_bytes``, ``cuda_slots``, ...)."""
    link_delay: Optional[dict[str, Any]] = None
    """For evaluation: delay messages on chosen links (``transport.LinkDelay`` fields), inside the transport."""
    grace_fraction: float = 0.1
    """``adaptive``: leave megatron-core's order once its next input is this many forward times late."""
    max_ahead: int = 2
    """GPUs: tasks the host may queue ahead of the GPU (a deeper queue makes decisions on stale readiness)."""
    split_weight_grads: bool = False
    """Backwards compute input gradients only; weight gradients run later, in what would be waits (zero bubble)."""
    max_deferred_weight_grads: Optional[int] = None
    """With ``split_weight_grads``: most microbatches whose weight gradients wait. Default: no count; the memory
    rule alone bounds them (a pending W counts as a held activation, under ``weight_grad_memory``'s peak)."""
    weight_grad_memory: Union[str, float] = 1.05
    """With ``split_weight_grads``, what bounds the activations held + Ws pending before a forward:

    * a number from 1.0 to 4.0 (default 1.05), a byte budget: ``"own-rank"``'s count, and beyond it pending weight
      gradients kept (the oldest run layer by layer until the rest fit) while this rank stays within that multiple
      of the most loaded pipeline rank's peak GPU memory, measured in the first training step (which runs
      ``"own-rank"``). Later ranks so defer part of their Ws, for nearly ``"first-rank"``'s speed at little more
      than 1F1B's peak memory (the figures: docs/evaluation/schedules.md). CPUs keep no allocator statistics:
      there it is ``"own-rank"``;
    * ``"own-rank"``: each rank's own 1F1B peak, counted in microbatches (no rank above its 1F1B memory; later
      ranks defer less, so it gains less);
    * ``"first-rank"``: the first pipeline rank's 1F1B peak, counted, on every rank (later ranks defer Ws into the
      room 1F1B leaves them, the fastest, but counts are not bytes: the last rank also holds the logits, and its
      peak grows well above the first rank's)."""


def _check_weight_grad_memory(value: Any) -> None:
    if isinstance(value, str) and value in WEIGHT_GRAD_MEMORY:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 1.0 <= value <= 4.0:
        return
    raise MegatronConfigError(
        f"schedule_options.weight_grad_memory={value!r}: choose a number from 1.0 to 4.0 (a byte budget: that "
        "multiple of the most loaded pipeline rank's measured peak GPU memory; default 1.05), 'own-rank' (every "
        "rank within its own 1F1B peak, counted in microbatches) or 'first-rank' (every rank within the first "
        "rank's)."
    )


def parse_options(raw: Mapping[str, Any]) -> DppOptions:
    check_keys("dpp", raw, DppOptions)
    options = DppOptions(**raw)
    if options.policy not in POLICIES:
        raise MegatronConfigError(
            f"schedule_options.policy={options.policy!r}: choose one of {', '.join(POLICIES)} (default 'adaptive')."
        )
    if not isinstance(options.extra_activations, int) or options.extra_activations < 0:
        raise MegatronConfigError(
            f"schedule_options.extra_activations={options.extra_activations!r}: a whole number >= 0 (each extra "
            "activation costs one microbatch's stage activations in memory)."
        )
    _check_weight_grad_memory(options.weight_grad_memory)
    limit = options.max_deferred_weight_grads
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise MegatronConfigError(
            f"schedule_options.max_deferred_weight_grads={limit!r}: a whole number >= 0, or unset for the default."
        )
    if not isinstance(options.max_ahead, int) or options.max_ahead < 1:
        raise MegatronConfigError(f"schedule_options.max_ahead={options.max_ahead!r}: a whole number >= 1.")
    if not isinstance(options.grace_fraction, (int, float)) or options.grace_fraction < 0:
        raise MegatronConfigError(
            f"schedule_options.grace_fraction={options.grace_fraction!r}: a number >= 0 (0 reorders at once)."
        )
    check_transport_settings(options.transport, options.transport_options)
    return options
