"""MegaScan: per-rank tracing of training steps, one clock-aligned timeline, and slow-rank detection.

* ``MegaScan`` (callback): traces windows of steps on every rank into Chrome Trace Event Format files.
* ``lightning-megatron scan aggregate|detect`` (``scan.aggregate``, ``scan.detect``): merge, diagnose.
* ``SlowdownInjector`` / ``LinkDelayInjector`` (callbacks): reproduce a slow GPU or link, for evaluation.
"""

from lightning_megatron.scan.callback import MegaScan
from lightning_megatron.scan.inject import LinkDelayInjector, SlowdownInjector

__all__ = ["LinkDelayInjector", "MegaScan", "SlowdownInjector"]
