"""Faults from outside the job, for evaluating slow-rank detection against what its design did not assume.

``scan.evaluation.inject`` stretches a rank's own spans (MegaScan's model of a slow GPU); these make the machine slow the
way real machines are, and leave it to the job to feel it (or not):

* ``CompetingProcess(kind="gpu")``: another process running matrix multiplications on a rank's GPU (a second
  job, a stuck inference server). It takes time slices from the training kernels; with ``on_s``/``off_s`` it
  comes and goes (bursty). CUDA only.
* ``CompetingProcess(kind="gpu-memory")``: another process copying large buffers on a rank's GPU: bandwidth-bound
  work (a data-parallel inference job, a memory-bound preprocessing kernel) instead of GEMMs.
* ``CompetingProcess(kind="cpu")``: processes spinning on the CPUs the rank's process may run on (its affinity
  set): a noisy neighbour on the host, which slows the host's kernel launches, data loading and Python.
* ``HostStall``: a callback that blocks a rank's host in one of Lightning's hooks each step (a synchronous metrics
  upload, a checkpoint copy, a garbage collection): after the step, where the GPU has finished and idles, or
  before the optimizer step, behind queued GPU work that may hide it. The job's own Python, not a neighbour.
* ``SlowDataset``: a dataset wrapper that sleeps in ``__getitem__`` on the chosen ranks (a slow file system
  behind one rank's loader). With ``num_workers=0`` the sleep is inside the loader's ``next()``, where MegaScan's
  ``data-fetch`` span times it.

A slow link is ``scan.evaluation.inject.LinkDelayInjector`` (inside the transport, as a slow wire is).

All can begin mid-fit (``CompetingProcess(start_step=...)``, ``HostStall(start_step=...)``,
``SlowDataset(after_reads=...)``): a machine that
turns slow during a run, which a rank alone in its job can only show against its own earlier steps.

The competing processes start at fit start, which returns only once each of them is competing (a spawned
process spends seconds importing torch and making a CUDA context: a short fit would otherwise end before the
fault began; the first GPU evaluation was measured so), and stop at fit end, on exception and at teardown
(terminated, then killed); they are spawned (not forked) so they hold no copy of the training process's CUDA
context or communicators.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError

__all__ = ["READY_TIMEOUT_S", "CompetingProcess", "HostStall", "SlowDataset"]

READY_TIMEOUT_S = 120.0
"""How long fit start waits for the competing processes to be competing (importing torch, a CUDA context)."""


def _paused(active: Any) -> bool:
    """Whether to idle now (``active`` cleared: a kept-alive competitor between fits); waits a little if so."""
    if active.is_set():
        return False
    active.wait(0.05)
    return True


def _burn_gpu(device: int, on_s: float, off_s: float, stop: Any, active: Any, ready: Any, size: int) -> None:
    """Matrix multiplications on ``device`` for ``on_s`` seconds, idle ``off_s``, while ``active``, until ``stop``."""
    torch.cuda.set_device(device)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    (a @ b).sum().item()  # CUDA context, cuBLAS handle and the GEMM kernel are up: burning from here on
    ready.set()

    latest = [a]

    def gemm() -> None:
        latest[0] = (latest[0] @ b).clamp_(-1, 1)

    _burn_on_gpu(gemm, on_s, off_s, stop, active)


def _burn_on_gpu(work: Any, on_s: float, off_s: float, stop: Any, active: Any) -> None:
    """``work()`` eight times, then a synchronize, for ``on_s`` seconds, idle ``off_s``, while ``active``, until
    ``stop``."""
    while not stop.is_set():
        if _paused(active):
            continue
        until = time.monotonic() + on_s
        while time.monotonic() < until and not stop.is_set() and active.is_set():
            for _ in range(8):
                work()
            torch.cuda.synchronize()
        if off_s > 0:
            stop.wait(off_s)


MEMORY_BURN_BYTES = 512 * 2**20
"""The memory burner's buffer (twice: source and destination): far above the L2 cache, so each copy streams HBM."""


def _burn_gpu_memory(device: int, on_s: float, off_s: float, stop: Any, active: Any, ready: Any, size: int) -> None:
    """Buffer copies on ``device`` (bandwidth-bound kernels) for ``on_s`` seconds, idle ``off_s``, while
    ``active``, until ``stop``; ``size`` is unused (the buffer is ``MEMORY_BURN_BYTES``)."""
    torch.cuda.set_device(device)
    source = torch.empty(MEMORY_BURN_BYTES, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    ready.set()
    _burn_on_gpu(lambda: target.copy_(source), on_s, off_s, stop, active)


def _burn_cpu(cpus: Sequence[int], on_s: float, off_s: float, stop: Any, active: Any, ready: Any) -> None:
    """A busy loop on ``cpus`` for ``on_s`` seconds, idle ``off_s``, while ``active``, until ``stop`` is set."""
    os.sched_setaffinity(0, cpus)
    ready.set()
    while not stop.is_set():
        if _paused(active):
            continue
        until = time.monotonic() + on_s
        x = 0
        while time.monotonic() < until:
            for i in range(10_000):
                x += i * i
            if stop.is_set():
                return
            if not active.is_set():
                break
        if off_s > 0:
            stop.wait(off_s)


class CompetingProcess(pl.Callback):
    """Competing work on the GPU (``kind="gpu"``: GEMMs; ``"gpu-memory"``: buffer copies) or the host CPUs
    (``kind="cpu"``) of the ranks ``ranks``.

    ``on_s``/``off_s``: busy for ``on_s`` seconds, then idle for ``off_s`` (``off_s=0``: continuous).
    ``processes``: competing processes per rank (``cpu``: default one per CPU of the rank's affinity set, at most
    4). ``size``: the GPU burner's matrix size (larger: longer kernels, coarser time slices). ``keep_alive``: the
    processes only pause at fit end and compete again in the next fit this callback is part of (start-up is paid
    once: an evaluation of many short fits); :meth:`close` ends them. ``start_step``: they are started (and ready)
    at fit start but compete only from this global step on (0: from the first step)."""

    def __init__(
        self,
        ranks: Sequence[int],
        kind: Literal["gpu", "gpu-memory", "cpu"] = "gpu",
        on_s: float = 1.0,
        off_s: float = 0.0,
        processes: Optional[int] = None,
        size: int = 4096,
        keep_alive: bool = False,
        start_step: int = 0,
    ) -> None:
        if kind not in ("gpu", "gpu-memory", "cpu"):
            raise MegatronConfigError(f"CompetingProcess(kind={kind!r}): choose 'gpu', 'gpu-memory' or 'cpu'.")
        if on_s <= 0 or off_s < 0:
            raise MegatronConfigError(f"CompetingProcess(on_s={on_s}, off_s={off_s}): need on_s > 0 and off_s >= 0.")
        if processes is not None and processes < 1:
            raise MegatronConfigError(f"CompetingProcess(processes={processes}): at least 1, or None.")
        if start_step < 0:
            raise MegatronConfigError(f"CompetingProcess(start_step={start_step}): a global step >= 0.")
        self.ranks, self.kind, self.on_s, self.off_s = list(ranks), kind, on_s, off_s
        self.start_step = start_step
        self.processes, self.size, self.keep_alive = processes, size, keep_alive
        self._children: list[Any] = []
        self._readies: list[Any] = []  # started, not yet known ready (start, wait_ready)
        self._stop: Any = None
        self._active: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank not in self.ranks:
            return
        if not self._children:
            device = trainer.strategy.root_device
            self.start(device.index if device.type == "cuda" else None)
        self.wait_ready()
        self._compete_from(trainer.global_step)

    def start(self, device_index: Optional[int]) -> None:
        """Spawn the competing processes (on CUDA device ``device_index`` for the GPU kinds) without waiting for
        them: an evaluation starts all its competitors side by side, then waits for each (:meth:`wait_ready`),
        instead of paying seconds of start-up per competitor in turn. A fit starts them itself if not started."""
        if self._children:
            return
        ctx = mp.get_context("spawn")
        self._stop, self._active = ctx.Event(), ctx.Event()
        self._active.set()  # each child signals ready after its first piece of work
        if self.kind.startswith("gpu"):
            if device_index is None:
                raise MegatronConfigError(f"CompetingProcess(kind={self.kind!r}) needs CUDA; on CPUs use kind='cpu'.")
            burn = _burn_gpu if self.kind == "gpu" else _burn_gpu_memory
            target, args = burn, (device_index, self.on_s, self.off_s, self._stop, self._active)
            count = self.processes or 1
        else:
            cpus = sorted(os.sched_getaffinity(0))
            count = self.processes or min(len(cpus), 4)
            target, args = _burn_cpu, (cpus, self.on_s, self.off_s, self._stop, self._active)
        for _ in range(count):
            ready = ctx.Event()
            extra = (self.size,) if self.kind.startswith("gpu") else ()
            child = ctx.Process(target=target, args=(*args, ready, *extra), daemon=True)
            child.start()
            self._children.append(child)
            self._readies.append(ready)

    def wait_ready(self) -> None:
        """Wait until every started process has done its first piece of work, then pause them (a fit makes them
        compete from ``start_step``). A spawned child imports torch (and, on a GPU, makes a CUDA context) for
        seconds before it competes for anything: without this wait a short fit would run, and be measured, before
        the fault is there."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for ready, child in zip(self._readies, self._children):
            while not ready.wait(0.1):
                if not child.is_alive() or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(
                        f"CompetingProcess(kind={self.kind!r}): a competing process did not start within "
                        f"{READY_TIMEOUT_S:.0f} s (exit code {child.exitcode})."
                    )
        if self._readies:
            self._readies = []
            self._active.clear()

    def _compete_from(self, step: int) -> None:
        """Compete at ``step`` if it is ``start_step`` or later, else pause until then."""
        if step >= self.start_step:
            self._active.set()
        else:
            self._active.clear()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._active is not None and not self._active.is_set() and trainer.global_step >= self.start_step:
            self._active.set()

    def close(self) -> None:
        """End the competing processes (set stop; terminate, then kill, what does not end)."""
        self._stop_children()

    def _end_of_fit(self) -> None:
        if self.keep_alive and self._active is not None:
            self._active.clear()
        else:
            self._stop_children()

    def _stop_children(self) -> None:
        if self._stop is not None:
            self._stop.set()
        for child in self._children:
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
                child.join(timeout=5)
            if child.is_alive():
                child.kill()
                child.join(timeout=5)
        self._children, self._readies, self._stop, self._active = [], [], None, None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_of_fit()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_children()  # whatever keep_alive says: nothing outlives a failed fit

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end_of_fit()


class HostStall(pl.Callback):
    """The host of the ranks ``ranks`` blocks for ``delay_ms`` in one of Lightning's hooks at each step from global
    step ``start_step`` on: the job's own Python doing blocking work (a synchronous upload of metrics, a copy of
    a checkpoint, a garbage collection), not a neighbour.

    ``hook``: ``"batch_end"`` (``on_train_batch_end``, after the step's work: with anything that waits for the
    GPU before it, such as a logged loss, the GPU idles for the whole stall) or ``"before_optimizer_step"``
    (inside the step, after the forward and backward are queued: a GPU with more queued work than the stall
    hides it). Where the stall falls in MegaScan's trace depends on the callbacks' order, as for a user's own
    callback: before MegaScan's in ``callbacks``, a ``batch_end`` stall is inside the traced step; after it,
    in the host gap before the next step."""

    HOOKS = ("batch_end", "before_optimizer_step")

    def __init__(
        self,
        ranks: Sequence[int],
        delay_ms: float,
        hook: Literal["batch_end", "before_optimizer_step"] = "batch_end",
        start_step: int = 0,
    ) -> None:
        if delay_ms < 0:
            raise MegatronConfigError(f"HostStall(delay_ms={delay_ms}): a delay >= 0.")
        if hook not in self.HOOKS:
            raise MegatronConfigError(f"HostStall(hook={hook!r}): choose one of {', '.join(self.HOOKS)}.")
        if start_step < 0:
            raise MegatronConfigError(f"HostStall(start_step={start_step}): a global step >= 0.")
        self.ranks, self.delay_s, self.hook, self.start_step = set(ranks), delay_ms / 1000.0, hook, start_step
        self.stalls = 0  # how many times this process stalled (for tests and reports)

    def _stall(self, step: int) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.delay_s and rank in self.ranks and step >= self.start_step:
            time.sleep(self.delay_s)
            self.stalls += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.hook == "before_optimizer_step":
            self._stall(trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.hook == "batch_end":
            self._stall(trainer.global_step - 1)  # global_step already counts this batch's step


class SlowDataset(torch.utils.data.Dataset):
    """``dataset`` whose samples take ``delay_ms`` longer to read on the ranks ``ranks`` (a slow file system),
    from this process's ``after_reads``-th read on (0: from the first; reads are counted per process, so with
    ``num_workers=0`` they follow the steps: a rank reads its batch's samples each step)."""

    def __init__(self, dataset: Any, delay_ms: float, ranks: Sequence[int], after_reads: int = 0) -> None:
        if delay_ms < 0 or after_reads < 0:
            raise MegatronConfigError(f"SlowDataset(delay_ms={delay_ms}, after_reads={after_reads}): need both >= 0.")
        self.dataset, self.delay_s, self.ranks = dataset, delay_ms / 1000.0, set(ranks)
        self.after_reads, self.reads = after_reads, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.reads += 1
        if (
            self.delay_s
            and self.reads > self.after_reads
            and (dist.get_rank() if dist.is_initialized() else 0) in self.ranks
        ):
            time.sleep(self.delay_s)
        return self.dataset[index]
