"""What the strategy tells observers about a step, without anyone patching a schedule.

megatron-core's schedules, p2p layer and gradient sync call ``config.timers(name).start()/.stop()`` around
every forward and backward compute, every pipeline send/receive and the gradient sync, whatever the
schedule (a future one included, as long as it follows megatron-core's conventions). The strategy owns the
forward step, so it also knows which microbatch and model chunk each forward and backward belongs to.
``StepListener`` is that interface: tracing (``lightning_megatron.scan``) and fault injection implement it;
the strategy installs a dispatcher as ``config.timers`` only while a listener is registered.

A step replayed as a CUDA graph runs none of this Python: the calls happen once, while the step is captured. A
listener whose work inside the step is only recording CUDA events declares ``graph_safe = True``; the strategy
then keeps the graph, tells it when a capture starts and ends (``graph_capture``) and around every replay
(``graph_replay``), and the listener reads each replay's timing from the events it recorded during the capture.
Any other listener (a fault injector, MegaScope's hooks) makes the strategy run the step eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["P2P_TIMERS", "ListenerEvents", "StepListener", "TimedLoader", "TimersDispatcher"]

# megatron-core's pipeline timer names → (sends, receives), each as (pipeline neighbour, direction).
P2P_TIMERS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "forward-recv": ((), (("prev", "forward"),)),
    "forward-send": ((("next", "forward"),), ()),
    "backward-recv": ((), (("next", "backward"),)),
    "backward-send": ((("prev", "backward"),), ()),
    "forward-send-backward-recv": ((("next", "forward"),), (("next", "backward"),)),
    "backward-send-forward-recv": ((("prev", "backward"),), (("prev", "forward"),)),
    "forward-send-forward-recv": ((("next", "forward"),), (("prev", "forward"),)),
    "backward-send-backward-recv": ((("prev", "backward"),), (("next", "backward"),)),
    "forward-backward-send-forward-backward-recv": (
        (("next", "forward"), ("prev", "backward")),
        (("prev", "forward"), ("next", "backward")),
    ),
}


class StepListener:
    """Receives the spans of every training step; override what you need (all no-ops here).

    ``nesting`` orders listeners: higher runs inside lower (started after, stopped before), so a fault
    injector (1) acts inside the spans a tracer (0) measures.
    """

    nesting: int = 0
    graph_safe: bool = False
    """Its work inside a step only records CUDA events (``torch.cuda.Event(external=True)`` while capturing), so
    the step may be captured with it and replayed."""

    def span_start(self, name: str) -> None:
        """A megatron-core timer started: ``forward-compute``, ``backward-compute``, ``forward-send``, ...; or one
        of the strategy's own spans: ``data-fetch`` (the loader's ``next()``, between steps, ``TimedLoader``),
        ``step-sync`` (Lightning's synchronisation of the ranks before each batch, between steps,
        ``compat.lightning.announce_step_sync``) and ``optimizer-step`` (the optimizer's update,
        ``StrategyOptimizer.step``)."""

    def span_stop(self, name: str) -> None:
        """The timer of that name stopped."""

    def microbatch(self, phase: str, chunk: int, microbatch: int) -> None:
        """The ``phase`` (``"forward"`` or ``"backward"``) now running is that of this chunk's microbatch."""

    def p2p_messages(self, name: str, sends: list[dict[str, Any]], recvs: list[dict[str, Any]]) -> None:
        """The open p2p span ``name`` moves these messages: told by megatron-core's pipeline calls (what each
        call really posted, ``compat/megatron_p2p.py``) and by schedules with their own transports (MegaDPP,
        MegaFBD, or one registered from outside: ``lightning_megatron.pipeline.tracing.traced_p2p``).

        Each is ``{"peer", "bytes", "seq", "direction", ...}``; ``seq`` is the same on both ends of a message
        (MegaDPP: its tag), so a tracer pairs sends with receives whatever order they ran in."""

    def graph_capture(self, started: bool) -> None:
        """Graph-safe listeners: the step now running is being captured into a CUDA graph (``started``), or that
        capture has ended, also when it failed. The calls in between happen once; their GPU work at every replay."""

    def graph_replay(self, started: bool) -> None:
        """Graph-safe listeners: the captured step is about to be replayed (``started``), or has just been queued.
        Events recorded during the capture are overwritten by each replay: read them before the next one."""


class _Timer:
    __slots__ = ("name", "listeners")

    def __init__(self, name: str, listeners: list[StepListener]) -> None:
        self.name = name
        self.listeners = listeners

    def start(self, barrier: bool = False) -> None:
        for listener in sorted(self.listeners, key=lambda listener: listener.nesting):
            listener.span_start(self.name)

    def stop(self, barrier: bool = False) -> None:
        for listener in sorted(self.listeners, key=lambda listener: -listener.nesting):
            listener.span_stop(self.name)

    def elapsed(self, *args: Any, **kwargs: Any) -> float:  # part of megatron's timer interface; unused here
        return 0.0


class TimersDispatcher:
    """Stands in for megatron-core's ``Timers`` (``config.timers``) and forwards each start/stop to listeners."""

    def __init__(self, listeners: list[StepListener]) -> None:
        self.listeners = listeners
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str, log_level: Any = None) -> _Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(name, self.listeners)
        return timer

    def messages(self, name: str, sends: list[dict[str, Any]], recvs: list[dict[str, Any]]) -> None:
        """Not megatron's API: a schedule tells the listeners what the open span ``name`` moves."""
        for listener in self.listeners:
            listener.p2p_messages(name, sends, recvs)

    def log(self, *args: Any, **kwargs: Any) -> None:  # megatron's Timers API; nothing to print here
        return None


class ListenerEvents:
    """The step events a schedule session is handed (``ScheduleContext.events``): the spans and messages it reports
    reach the listeners registered at that moment, in the same order as megatron-core's timers' (``nesting``)."""

    def __init__(self, listeners: list[StepListener]) -> None:
        self._listeners = listeners  # the strategy's own list: listeners added after the session opened count

    @property
    def active(self) -> bool:
        return bool(self._listeners)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        timer = _Timer(name, self._listeners)
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def microbatch(self, phase: str, chunk: int, microbatch: int) -> None:
        for listener in self._listeners:
            listener.microbatch(phase, chunk, microbatch)

    def messages(self, name: str, sends: list[dict[str, Any]], recvs: list[dict[str, Any]]) -> None:
        for listener in self._listeners:
            listener.p2p_messages(name, sends, recvs)


class TimedLoader:
    """A dataloader whose every ``next()`` is announced to the step's listeners as the span ``data-fetch``.

    The fetch itself is what a slow data pipeline makes longer; the host gap between two steps also holds
    Lightning's per-step bookkeeping and synchronisation, which a contended GPU lengthens. Everything else
    (``len``, ``sampler``, ``dataset``, ...) is the wrapped loader's, so Lightning treats it as the loader."""

    def __init__(self, loader: Any, listeners: list[StepListener]) -> None:
        self.__dict__["_loader"], self.__dict__["_listeners"] = loader, listeners

    def __iter__(self) -> Any:
        iterator = iter(self._loader)
        listeners = self._listeners
        while True:
            timed = list(listeners)  # listeners attached now (none: no cost but this copy)
            for listener in timed:
                listener.span_start("data-fetch")
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                for listener in reversed(timed):
                    listener.span_stop("data-fetch")
            yield item

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._loader, name, value)
