"""Run megatron-core on CPU processes over gloo.

Why this module exists: megatron-core assumes CUDA in a handful of places even when every tensor it
touches lives on the CPU. Measured on megatron-core 0.16.1 with a CPU-only torch build:

* ``torch.cuda.current_device()`` is used as a *device* for buffers (``GlobalMemoryBuffer``, the
  pipeline receive buffers, the DDP grad buffers);
* the tensor-parallel RNG tracker saves and restores *CUDA* RNG states;
* the schedules, gradient clipping and the optimizers create tensors with ``device="cuda"``;
* the optimizers and the clip-grad code assert ``tensor.type() == "torch.cuda.FloatTensor"``;
* DDP and the p2p code ask for streams, events and ``torch.cuda.synchronize()``;
* the rotary embedding's context-parallel slice (``get_pos_emb_on_this_cp_rank``) makes its index tensor with
  ``pin_memory=True``, which needs an accelerator.

``apply()`` redirects each of these to the CPU, so that megatron-core's own schedules, DDP, optimizers
and dist_checkpointing run unchanged on gloo. The strategy calls it only for CPU runs, in a process
where no GPU is visible (the redirection is process-wide and would otherwise hide real GPUs). Part of
it, the redirection of ``device="cuda"`` and of ``tensor.type()``, is a torch-function mode, and those
are per thread: ``apply()`` enters it in the calling thread (the one that trains), and any other thread
that runs megatron-core code runs it inside ``with cpu_thread():`` (MegaScope's server does).

Nothing here is needed, or applied, on GPUs. It is one of several replacements of other projects' functions, all in
``compat/`` but for MegaScan's collective tracer; :mod:`.inventory` lists every one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply", "cpu_thread", "is_applied"]

_lock = threading.Lock()
_applied = False
_thread = threading.local()  # .redirected: this thread is inside the redirection mode


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream`` and ``torch.cuda.Event``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoOpStream:
        return _NoOpStream()

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):  # ``torch.cuda.current_device()`` style index
        return "cpu"
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` to the CPU, drops ``pin_memory=True`` (no pinned allocator without an accelerator)
    and reports CPU tensors as ``torch.cuda.*`` types.

    The type answer only exists to satisfy megatron-core's ``tensor.type()`` assertions; tensors keep
    their real CPU storage and dtype.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_cpu_device(kwargs["device"]))
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _patch_cuda_runtime() -> None:
    cuda = torch.cuda
    stream = _NoOpStream()
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: stream
    cuda.default_stream = lambda *a, **k: stream
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpStream
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    # The RNG tracker keeps one state per parallel region; on CPU those are CPU generator states.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def is_applied() -> bool:
    return _applied


@contextlib.contextmanager
def cpu_thread() -> Iterator[None]:
    """Run megatron-core on CPU in this thread too, for the duration of the block.

    ``apply()`` covers the thread that called it; a thread started to run the model elsewhere (a server's
    worker) needs this around that work, or megatron-core's ``device="cuda"`` tensors fail there. A no-op
    when ``apply()`` was not called (GPU runs), in the thread that called it, and when nested.
    """
    if not _applied or getattr(_thread, "redirected", False):
        yield
        return
    _thread.redirected = True
    try:
        with _CudaToCpuMode():
            yield
    finally:
        _thread.redirected = False


def apply() -> None:
    """Make megatron-core run on CPU in this process. Idempotent; refuses when a GPU is visible."""
    global _applied
    with _lock:
        if _applied:
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                "The CPU compatibility layer was asked for in a process that sees a GPU. Run CPU jobs with "
                "CUDA_VISIBLE_DEVICES='' (or use accelerator='gpu')."
            )
        _patch_cuda_runtime()
        _patch_megatron_rng()
        # Entered for the life of the process. Torch-function modes are per thread: this covers the
        # thread that trains (Lightning's main thread), where megatron-core's schedules, optimizer and
        # checkpointing run.
        _CudaToCpuMode().__enter__()
        _thread.redirected = True
        _applied = True
