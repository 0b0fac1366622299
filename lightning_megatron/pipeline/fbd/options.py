"""The settings of the ``"fbd"`` schedule (``MegatronAppStrategy(schedule="fbd", schedule_options={...})``).

Parsed when the strategy is built, so a typo or a bad value fails at once, naming the key and the fix. What
depends on the job's size (``forward_replicas`` below the data-parallel size) is checked when the session opens,
on every rank, before any message is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline.transports import check_keys, check_transport_settings

__all__ = ["MODES", "FbdOptions", "parse_options"]

MODES = ("recompute", "ship")


@dataclass(frozen=True)
class FbdOptions:
    forward_replicas: int = 1
    """How many data-parallel replicas run forwards only; the others run backwards (the forward:backward ratio)."""
    mode: str = "recompute"
    """``recompute``: a forward replica ships each stage's input and the backward replica recomputes the stage
    before its backward; ``ship``: it ships every tensor the stage's backward needs (no recompute, far more bytes)."""
    prefetch: int = 2
    """``ship``: microbatches a forward replica may send ahead of its backward partner (each holds one microbatch's
    saved activations on both GPUs)."""
    transport: str = "auto"
    """``shm`` on one node (CUDA IPC on GPUs), ``torch``, ``tcp``, ``rdma``; ``auto``: shm if the job fits a node."""
    transport_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the transport (``ring_bytes``, ``cuda_slots``, ...)."""
    report: bool = True
    """Print the performance model (measured parts, predicted step time) after the third step, on rank 0."""


def parse_options(raw: Mapping[str, Any]) -> FbdOptions:
    check_keys("fbd", raw, FbdOptions)
    options = FbdOptions(**raw)
    if not isinstance(options.forward_replicas, int) or options.forward_replicas < 1:
        raise MegatronConfigError(
            f"schedule_options.forward_replicas={options.forward_replicas!r}: a whole number >= 1, below the "
            "data-parallel size (the remaining replicas run the backwards)."
        )
    if options.mode not in MODES:
        raise MegatronConfigError(
            f"schedule_options.mode={options.mode!r}: choose 'recompute' (ship stage inputs, recompute on the "
            "backward ranks) or 'ship' (ship the saved activations)."
        )
    if not isinstance(options.prefetch, int) or options.prefetch < 1:
        raise MegatronConfigError(f"schedule_options.prefetch={options.prefetch!r}: a whole number >= 1.")
    check_transport_settings(options.transport, options.transport_options)
    return options
