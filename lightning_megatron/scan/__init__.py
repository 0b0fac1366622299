"""MegaScan: per-rank tracing of training steps, one clock-aligned timeline, and slow-rank detection.

* ``MegaScan`` (callback): traces windows of steps on every rank into Chrome Trace Event Format files.
* ``lightning-megatron scan aggregate|detect`` (``scan.aggregate``, ``scan.detect``): merge, diagnose.
* ``lightning-megatron scan bubbles`` (``scan.bubbles``): pipeline bubbles apart from transfers, per stage and link.
* ``SlowdownInjector`` / ``LinkDelayInjector`` (callbacks): reproduce a slow GPU or link, for evaluation.

The callbacks need torch and are loaded on first access (PEP 562 ``__getattr__``): the offline tools
(``format``, ``aggregate``, ``detect``, ``bubbles``, ``report``, ``synthetic``) read JSON only and must stay
importable without torch, for the TensorBoard plugin and for machines that only analyse traces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_megatron.lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_megatron.scan.callback import MegaScan
    from lightning_megatron.scan.inject import LinkDelayInjector, SlowdownInjector

__all__ = ["LinkDelayInjector", "MegaScan", "SlowdownInjector"]

# public name → the module that defines it, imported on first access
_LAZY = {
    "MegaScan": "lightning_megatron.scan.callback",
    "LinkDelayInjector": "lightning_megatron.scan.inject",
    "SlowdownInjector": "lightning_megatron.scan.inject",
}


__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)
