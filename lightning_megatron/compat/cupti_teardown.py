"""Detach CUPTI after each of MegaScan's profiler sessions, so that the steps between them run at full speed.

Why: Kineto (torch's profiler back end) leaves CUPTI attached to the process when a session ends, unless the
environment variable ``TEARDOWN_CUPTI`` is ``"1"`` when it stops (``cuptiTearDown_`` in Kineto's
``CuptiActivityApi``; pytorch/pytorch#144455). While CUPTI stays attached every kernel launch pays for its
callbacks. MegaScan opens a short CUDA-only session every ``gpu_busy_every`` traced windows to measure GPU busy
time, so without this every later step of the fit paid: with CUPTI left attached, MegaScan's overhead on the
median step was several times what it is with CUPTI detached after each session (docs/evaluation/megascan.md).

torch's own profiler sets ``TEARDOWN_CUPTI=0`` where tearing down is unsafe: CUDA graphs before CUDA 12.6
(re-initialising CUPTI after a teardown crashed with graphs). The same rule holds here, and a value the user or
torch already set is never changed.
"""

from __future__ import annotations

import os

import torch

__all__ = ["detach_cupti_after_sessions"]


def detach_cupti_after_sessions() -> bool:
    """Ask Kineto to detach CUPTI when a session stops, where that is safe; True if it will."""
    if "TEARDOWN_CUPTI" in os.environ:
        return os.environ["TEARDOWN_CUPTI"] == "1"
    cuda = getattr(torch.version, "cuda", None)
    if not cuda or tuple(int(part) for part in cuda.split(".")[:2]) < (12, 6):
        return False  # CUDA graphs (on by default on one GPU) crash on CUPTI's re-initialisation there
    os.environ["TEARDOWN_CUPTI"] = "1"
    return True
