"""Fault injection for evaluating slow-rank detection: a slower rank, a slower link.

GPUs must never be down-clocked here, so these reproduce the *effect*: ``SlowdownInjector`` stretches a
rank's forward and backward compute by ``factor`` (host sleep proportional to the measured span on CPUs;
on GPUs a spin kernel, ``torch.cuda._sleep``, sized from the rank's own recent compute times, so the GPU
really is busy longer and the host never waits). ``LinkDelayInjector`` makes every pipeline message from one rank
to another arrive ``delay_ms`` later (on GPUs, a spin kernel on the receiver's stream). Both are callbacks; they act only on the ranks they name and only through the strategy's step
listener interface, innermost (``nesting = 1``), so a tracer sees their delay inside the spans it times.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.strategy.listeners import P2P_TIMERS, StepListener

__all__ = ["SlowdownInjector", "LinkDelayInjector"]

_COMPUTE_TIMERS = ("forward-compute", "backward-compute")


class _GpuSpinner:
    """Busy-waits the current CUDA stream for a given time (calibrated once: cycles per millisecond)."""

    def __init__(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)

    def spin(self, ms: float) -> None:
        if ms > 0:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))


class _Injector(pl.Callback, StepListener):
    nesting = 1

    def __init__(self) -> None:
        self._strategy: Any = None
        self._spinner: Optional[_GpuSpinner] = None

    def _applies(self, rank: int) -> bool:
        raise NotImplementedError

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if stage == "fit" and self._applies(rank) and hasattr(trainer.strategy, "add_step_listener"):
            self._strategy = trainer.strategy
            self._strategy.add_step_listener(self)
            if trainer.strategy.root_device.type == "cuda":
                self._spinner = _GpuSpinner()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._strategy is not None:
            self._strategy.remove_step_listener(self)
            self._strategy = None


class SlowdownInjector(_Injector):
    """Make the compute of ``ranks`` (global ranks) ``factor`` times slower (1.2 = 20% slower)."""

    def __init__(self, ranks: Sequence[int], factor: float) -> None:
        super().__init__()
        if factor < 1.0:
            raise MegatronConfigError(f"SlowdownInjector(factor={factor}): a slowdown factor is >= 1.0 (1.2 = 20%).")
        self.ranks, self.factor = {int(r) for r in ranks}, float(factor)
        self._started: dict[str, Any] = {}
        self._pending: collections.deque = collections.deque()
        self._mean_ms: dict[str, float] = {}

    def _applies(self, rank: int) -> bool:
        return rank in self.ranks and self.factor > 1.0

    def span_start(self, name: str) -> None:
        if name not in _COMPUTE_TIMERS:
            return
        if self._spinner is None:
            self._started[name] = time.perf_counter()
        else:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._started[name] = event

    def span_stop(self, name: str) -> None:
        start = self._started.pop(name, None)
        if start is None:
            return
        if self._spinner is None:
            time.sleep((self.factor - 1.0) * (time.perf_counter() - start))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((name, start, end))
        self._learn_durations()
        self._spinner.spin((self.factor - 1.0) * self._mean_ms.get(name, 0.0))

    def _learn_durations(self) -> None:
        """Fold finished spans into a running mean, without waiting for unfinished ones."""
        while self._pending and self._pending[0][2].query():
            name, start, end = self._pending.popleft()
            measured = start.elapsed_time(end)
            previous = self._mean_ms.get(name)
            self._mean_ms[name] = measured if previous is None else 0.8 * previous + 0.2 * measured


class LinkDelayInjector(_Injector):
    """Make pipeline messages from global rank ``src`` to global rank ``dst`` take ``delay_ms`` longer.

    As on a slow link with rendezvous transfers: a receive from ``src`` completes ``delay_ms`` later on
    ``dst``, and a send to ``dst`` that ``src`` posts on its own completes ``delay_ms`` later (host sleep,
    or a spin kernel on the stream, at the end of the operation). A send that megatron-core combines
    with a receive in one operation is not delayed on the sender: that would also delay the receive, a
    message of the healthy reverse direction.
    """

    def __init__(self, src: int, dst: int, delay_ms: float) -> None:
        super().__init__()
        if delay_ms < 0:
            raise MegatronConfigError(f"LinkDelayInjector(delay_ms={delay_ms}): the delay must be >= 0.")
        self.src, self.dst, self.delay_ms = int(src), int(dst), float(delay_ms)

    def _applies(self, rank: int) -> bool:
        return rank in (self.src, self.dst)

    def span_stop(self, name: str) -> None:
        sends, recvs = P2P_TIMERS.get(name, ((), ()))
        peers = {
            "next": parallel_state.get_pipeline_model_parallel_next_rank(),
            "prev": parallel_state.get_pipeline_model_parallel_prev_rank(),
        }
        rank = dist.get_rank() if dist.is_initialized() else 0
        delayed_recv = rank == self.dst and any(peers[n] == self.src for n, _ in recvs)
        delayed_send = rank == self.src and not recvs and any(peers[n] == self.dst for n, _ in sends)
        if delayed_recv or delayed_send:
            if self._spinner is None:
                time.sleep(self.delay_ms / 1000.0)
            else:
                self._spinner.spin(self.delay_ms)
