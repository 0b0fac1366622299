"""MegaScan: per-rank tracing of training steps, one clock-aligned timeline, and slow-rank detection.

Three subpackages, split along what they need:

* ``scan.tracing`` (torch, Lightning, megatron-core): the ``MegaScan`` callback and what it runs inside a fit:
  span recording, clock alignment, collective tracing, GPU busy-time sampling, run-queue delays, the profiler,
  online detection. It writes Chrome Trace Event Format rank files.
* ``scan.analysis`` (torch-free, JSON only): reading rank files (``format``), measuring (``measure``, ``waits``,
  ``gpu_measure``), statistics (``compare``), the detection rules and their pipeline (``rules``, ``detect``),
  the report, pipeline bubbles apart from transfers (``bubbles``), merging (``aggregate``), validation and plots. The TensorBoard plugin and machines that only
  analyse traces import this alone; a test keeps it free of torch.
* ``scan.evaluation``: what detection is evaluated against: injected slowdowns (``SlowdownInjector``,
  ``LinkDelayInjector``), outside faults (``faults``) and the synthetic trace generator (``synthetic``).

``lightning-megatron scan aggregate|detect|plot`` (``scan.cli``) runs the analysis. The public callbacks and
``REPORT_FILE`` are importable from here; the callbacks are loaded on first access (PEP 562 ``__getattr__``), so
importing this package (or ``scan.analysis``) loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_megatron.lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_megatron.scan.analysis.report import REPORT_FILE
    from lightning_megatron.scan.evaluation.inject import LinkDelayInjector, SlowdownInjector
    from lightning_megatron.scan.tracing.callback import MegaScan

__all__ = ["REPORT_FILE", "LinkDelayInjector", "MegaScan", "SlowdownInjector"]

# public name → the module that defines it, imported on first access
_LAZY = {
    "MegaScan": "lightning_megatron.scan.tracing.callback",
    "REPORT_FILE": "lightning_megatron.scan.analysis.report",
    "LinkDelayInjector": "lightning_megatron.scan.evaluation.inject",
    "SlowdownInjector": "lightning_megatron.scan.evaluation.inject",
}


__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)
