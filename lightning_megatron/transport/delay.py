"""Link delays inside the transport: a wrapper that delivers each message on chosen links late, reproducibly.

To compare pipeline schedules on a slow or jittery interconnect fairly, the *receiver* must see a message late
while the *sender's* host goes on working, as on a real wire. The sleep-after-the-span injector of
:mod:`lightning_megatron.scan.evaluation.inject` (``LinkDelayInjector``) blocks the sender's host instead, which penalises a
dynamic schedule that could have run another task meanwhile. :class:`DelayedTransport` wraps any transport:

* ``isend`` returns at once with a handle; the message is handed to the inner transport after its delay by one
  background timer thread (a heap of due times). ``handle.done()`` is True only once the inner send is done, so
  ``sends_done``/``wait_sends`` count the messages still waiting in the heap.
* Per link ``(src, dst)`` the due time of a message is never earlier than the previous one's, so messages on a
  link keep their order (FIFO per ``(peer, tag)`` holds, and more: the link is one ordered wire).
* The delay of the ``n``-th message on a link is a pure function of ``(seed, src, dst, n)``
  (:func:`delay_for`), never of wall time: the same spec and the same sends give the same delays on every run.
* Receives, ``poll_any``/``wait_any``, ``begin_step``, ``connect`` and ``close`` go to the inner transport.
  ``close`` stops and joins the thread (messages still waiting are dropped, their handles raise); the thread is a
  daemon, ends by itself after a second with nothing to do, and live wrappers are closed at exit, so nothing
  is left behind after Ctrl-C either.

Reach it as ``create_transport("shm", link_delay=LinkDelay(kind="exponential", mean_s=0.002, seed=1))`` or with
``link_delay={"kind": "constant", "mean_s": 0.05, "links": [[0, 1]]}`` (from a YAML config).
"""

from __future__ import annotations

import atexit
import dataclasses
import heapq
import itertools
import math
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport.base import SendHandle, Transport, TransportError, TransportTimeout

__all__ = ["KINDS", "DelayedSendHandle", "DelayedTransport", "LinkDelay", "delay_for"]

KINDS = ("constant", "exponential", "uniform", "spike")
"""``constant``: every delayed message waits ``mean_s``. ``exponential``: exponentially distributed with mean
``mean_s`` (queueing jitter). ``uniform``: uniform in ``mean_s ± spread_s``. ``spike``: ``mean_s`` for a fraction
``probability`` of the messages, none for the others (rare stalls)."""

MAX_MEAN_S = 60.0
"""Delays are in seconds; a mean beyond this is taken for a unit mistake (milliseconds)."""

DRAWN_KEEP = 100_000
""":attr:`DelayedTransport.drawn` keeps the delays of this many latest messages (bounded: long runs)."""

_JOIN_S = 30.0
_IDLE_S = 1.0


def _fail(field: str, value: Any, why: str) -> MegatronConfigError:
    return MegatronConfigError(f"LinkDelay({field}={value!r}): {why}")


def _seconds(field: str, value: Any, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _fail(field, value, f"a finite number of seconds >= 0 is needed (e.g. {example}).")
    if value > MAX_MEAN_S:
        raise _fail(
            field,
            value,
            f"delays are in seconds, and more than {MAX_MEAN_S:g} s per message looks like milliseconds: "
            f"write {value / 1000:g} for {value:g} ms.",
        )
    return float(value)


def _links(value: Any) -> Optional[tuple[tuple[int, int], ...]]:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail("links", value, "a list of (src, dst) global-rank pairs, e.g. [[0, 1], [1, 2]], or None (all).")
    out: list[tuple[int, int]] = []
    for link in value:
        try:
            src, dst = link
        except (TypeError, ValueError):
            raise _fail("links", value, f"{link!r} is not a (src, dst) pair of global ranks, e.g. [0, 1].") from None
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in (src, dst)):
            raise _fail("links", value, f"link {link!r}: src and dst are global ranks, ints >= 0.")
        if src == dst:
            raise _fail("links", value, f"link {link!r} goes from rank {src} to itself; a link joins two ranks.")
        if (src, dst) not in out:
            out.append((int(src), int(dst)))
    if not out:
        raise _fail("links", value, "an empty list delays no link: list the (src, dst) links, or None for all.")
    return tuple(out)


@dataclass(frozen=True)
class LinkDelay:
    """Which links to delay and how; plain values only, so it reads from and writes to YAML (``to_dict``).

    ``kind``: one of :data:`KINDS`. ``mean_s``: the mean delay in seconds (``spike``: the delay of a spike).
    ``spread_s``: ``uniform`` only: half-width of the interval (default ``mean_s``: uniform in [0, 2·mean_s]).
    ``max_s``: cap on any one delay (the tail of ``exponential``); None: no cap.
    ``probability``: the fraction of messages delayed, the others go at once (``spike``: the spikes; any kind).
    ``links``: ``(src, dst)`` global-rank pairs to delay, directed; None: every link.
    ``seed``: with the link and the message's number on it, determines every delay (:func:`delay_for`).
    """

    kind: str
    mean_s: float
    spread_s: Optional[float] = None
    max_s: Optional[float] = None
    probability: float = 1.0
    links: Optional[Sequence[tuple[int, int]]] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _fail("kind", self.kind, f"choose one of {', '.join(repr(k) for k in KINDS)}.")
        mean = _seconds("mean_s", self.mean_s, "0.005 for 5 ms")
        spread = None
        if self.spread_s is not None:
            if self.kind != "uniform":
                raise _fail(
                    "spread_s", self.spread_s, f"only kind='uniform' has a spread; remove it for kind={self.kind!r}."
                )
            spread = _seconds("spread_s", self.spread_s, "0.001")
            if spread > mean:
                raise _fail(
                    "spread_s",
                    self.spread_s,
                    f"a spread larger than mean_s={mean:g} would draw negative delays: use spread_s <= mean_s.",
                )
        cap = None
        if self.max_s is not None:
            cap = _seconds("max_s", self.max_s, "0.1")
            if cap < mean:
                raise _fail("max_s", self.max_s, f"the cap is below mean_s={mean:g}: raise max_s or lower mean_s.")
        p = self.probability
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise _fail("probability", p, "the fraction of messages delayed, a number in [0, 1] (e.g. 0.01).")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _fail("seed", self.seed, "an int (the same seed gives the same delays on every run).")
        object.__setattr__(self, "mean_s", mean)
        object.__setattr__(self, "spread_s", spread)
        object.__setattr__(self, "max_s", cap)
        object.__setattr__(self, "probability", float(p))
        object.__setattr__(self, "links", _links(self.links))

    @classmethod
    def coerce(cls, value: Union[LinkDelay, Mapping[str, Any]]) -> LinkDelay:
        """``value`` itself, or a :class:`LinkDelay` made from a mapping (a YAML/CLI config section)."""
        if isinstance(value, LinkDelay):
            return value
        if not isinstance(value, Mapping):
            raise MegatronConfigError(
                f"link_delay={value!r}: pass a LinkDelay or a mapping like "
                "{'kind': 'constant', 'mean_s': 0.05, 'links': [[0, 1]]}."
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise MegatronConfigError(
                f"link_delay: unknown field(s) {', '.join(unknown)}; the fields are {', '.join(known)}."
            )
        missing = [k for k in ("kind", "mean_s") if k not in value]
        if missing:
            raise MegatronConfigError(
                f"link_delay: {' and '.join(missing)} missing; e.g. {{'kind': 'exponential', 'mean_s': 0.002}}."
            )
        return cls(**dict(value))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (links as lists) for a YAML config; ``LinkDelay.coerce`` reads it back."""
        out = dataclasses.asdict(self)
        out["links"] = None if self.links is None else [list(link) for link in self.links]
        return out

    def applies(self, src: int, dst: int) -> bool:
        """Whether messages from global rank ``src`` to ``dst`` are delayed."""
        return self.links is None or (src, dst) in self.links


def delay_for(spec: LinkDelay, src: int, dst: int, n: int) -> float:
    """The delay in seconds of the ``n``-th message (from 0) from rank ``src`` to rank ``dst`` under ``spec``.

    A pure function of ``(seed, src, dst, n)``: reproducible across runs and processes, independent of timing
    and of the traffic on other links. The probability draw comes first, so changing ``probability`` leaves the
    delays of the messages still delayed unchanged."""
    if not spec.applies(src, dst):
        return 0.0
    rng = random.Random(f"lmt-link-delay/{spec.seed}/{src}/{dst}/{n}")  # str seed: hashed with SHA-512, stable
    if rng.random() >= spec.probability:
        return 0.0
    mean = spec.mean_s
    if spec.kind == "exponential":
        value = rng.expovariate(1.0 / mean) if mean > 0 else 0.0
    elif spec.kind == "uniform":
        spread = mean if spec.spread_s is None else spec.spread_s
        value = rng.uniform(mean - spread, mean + spread)
    else:  # constant, spike
        value = mean
    if spec.max_s is not None:
        value = min(value, spec.max_s)
    return max(value, 0.0)


class DelayedSendHandle(SendHandle):
    """A send waiting for its due time; then the inner transport's handle does the work."""

    __slots__ = ("_error", "_handed", "_inner", "_ready", "_tensor", "due")

    def __init__(
        self, peer: int, tag: int, nbytes: int, step: int, tensor: torch.Tensor, due: float, ready: Any
    ) -> None:
        super().__init__(peer, tag, nbytes, step)
        self._tensor: Optional[torch.Tensor] = tensor
        self._ready = ready  # CUDA: an event recorded on the sender's stream at isend (the tensor's producers)
        self.due = due
        """``time.monotonic()`` at which the message is handed to the inner transport."""
        self._inner: Optional[SendHandle] = None
        self._error: Optional[TransportError] = None
        self._handed = threading.Event()

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        inner = self._inner
        if inner is None or not inner.done():  # inner.done() raises the inner send's failure
            return False
        self._tensor = self._ready = None
        return True

    def wait(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._handed.wait(timeout):
            raise TransportTimeout(
                f"send to rank {self.peer} with tag {self.tag} ({self.nbytes} bytes) still held back by its link delay "
                f"after {timeout:.1f} s (due in {self.due - time.monotonic():.3f} s)."
            )
        if self._error is not None:
            raise self._error
        assert self._inner is not None
        self._inner.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        self._tensor = self._ready = None


_LIVE: weakref.WeakSet[DelayedTransport] = weakref.WeakSet()
_atexit_registered = False


def _close_all() -> None:
    """At exit: stop the timer threads before the inner transports' own exit hooks close their engines (this
    hook is registered when the first wrapper is made, after its inner transport's module, so it runs first)."""
    for transport in list(_LIVE):
        try:
            transport.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


def _abandon_all() -> None:
    """In a forked child: the parent's timer threads do not exist here; make the parent's wrappers closed."""
    for transport in list(_LIVE):
        transport._abandon()


os.register_at_fork(after_in_child=_abandon_all)


class DelayedTransport(Transport):
    """``inner`` with every message on the links of ``delay`` handed over late (see the module docstring).

    Its ``name`` is the inner's with ``+delay``; ``inner`` is the wrapped transport; :attr:`drawn` lists
    ``(src, dst, n, delay_s)`` of the latest delayed messages.
    """

    def __init__(self, inner: Transport, delay: Union[LinkDelay, Mapping[str, Any]]) -> None:
        if not isinstance(inner, Transport):
            raise MegatronConfigError(
                f"DelayedTransport(inner={inner!r}): wrap a Transport, e.g. create_transport('shm', link_delay=...)."
            )
        if isinstance(inner, DelayedTransport):
            raise MegatronConfigError("DelayedTransport: the inner transport already delays its links; wrap it once.")
        spec = LinkDelay.coerce(delay)
        for link in spec.links or ():
            if max(link) >= inner.world_size:
                raise MegatronConfigError(
                    f"LinkDelay(links=...): link {list(link)} names a rank beyond this job's world size "
                    f"{inner.world_size}; links are (src, dst) global ranks in [0, {inner.world_size})."
                )
        self.inner = inner
        self.delay = spec
        self.name = f"{inner.name}+delay"  # type: ignore[misc]  (instance value of the class-level name)
        self.devices = inner.devices  # type: ignore[misc]
        super().__init__(
            rank=inner.rank, world_size=inner.world_size, store=inner.store, device=inner.device, timeout=inner.timeout
        )
        self.peers = set(inner.peers)
        self.drawn: deque[tuple[int, int, int, float]] = deque(maxlen=DRAWN_KEEP)
        """``(src, dst, n, delay_s)`` of the latest delayed messages, in posting order (for tests and reports)."""
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, DelayedSendHandle]] = []
        self._seq = itertools.count()
        self._counts: dict[int, int] = {}  # per destination: messages posted on the link so far
        self._last_due: dict[int, float] = {}  # per destination: the latest due time (FIFO on the link)
        self._waiting: dict[int, int] = {}  # per destination: messages not handed to the inner transport yet
        self._thread: Optional[threading.Thread] = None
        self._retired: Optional[threading.Thread] = None  # the last thread that ended idle (may still be exiting)
        self._stopping = False
        global _atexit_registered
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        _LIVE.add(self)

    # -- connection ---------------------------------------------------------------------------------------

    def _connect(self, peers: list[int]) -> None:
        self.inner.connect(peers)

    # -- sending ------------------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Messages waiting for their due time (not handed to the inner transport yet)."""
        with self._cond:
            return sum(self._waiting.values())

    def _isend(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> SendHandle:
        src, dst = self.rank, peer
        if not self.delay.applies(src, dst):
            return self.inner.isend(peer, tag, tensor)
        with self._cond:
            if self._stopping:
                raise TransportError(f"transport {self.name!r} on rank {self.rank} is closed.")
            n = self._counts.get(dst, 0)
            self._counts[dst] = n + 1
            delay = delay_for(self.delay, src, dst, n)
            self.drawn.append((src, dst, n, delay))
            now = time.monotonic()
            due = max(now + delay, self._last_due.get(dst, 0.0))
            if due <= now and not self._waiting.get(dst):
                # Nothing of this link is waiting: hand it over here (under the lock, so nothing can overtake it).
                return self.inner.isend(peer, tag, tensor)
            self._last_due[dst] = due
            ready = None
            if tensor.is_cuda:  # the timer thread's stream must wait for the tensor's producers on this one
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(tensor.device))
            handle = DelayedSendHandle(peer, tag, tensor.numel() * tensor.element_size(), step, tensor, due, ready)
            heapq.heappush(self._heap, (due, next(self._seq), handle))
            self._waiting[dst] = self._waiting.get(dst, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"lmt-link-delay-{self.rank}", daemon=True
                )  # daemon: Ctrl-C and exit never wait for it; close() joins it
                self._thread.start()
            if self._heap[0][2] is handle:
                self._cond.notify()  # it is due before whatever the thread sleeps for
        return handle

    def _run(self) -> None:
        """The timer thread: hand each message to the inner transport at its due time, in due order. It ends
        after ``_IDLE_S`` with nothing to do (the next delayed send starts another), so an idle or forgotten
        wrapper holds no thread and no reference to itself."""
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    if self._heap:
                        wait = self._heap[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    elif not self._cond.wait(_IDLE_S) and not self._heap:
                        self._thread, self._retired = None, threading.current_thread()  # close() joins it
                        return
                handle = heapq.heappop(self._heap)[2]
            try:
                self._hand_over(handle)
            finally:
                with self._cond:
                    self._waiting[handle.peer] -= 1

    def _hand_over(self, handle: DelayedSendHandle) -> None:
        tensor = handle._tensor
        assert tensor is not None
        try:
            if handle._ready is not None:
                with torch.cuda.device(tensor.device):
                    torch.cuda.current_stream().wait_event(handle._ready)
                    handle._inner = self.inner.isend(handle.peer, handle.tag, tensor)
            else:
                handle._inner = self.inner.isend(handle.peer, handle.tag, tensor)
        except TransportError as exc:
            handle._error = exc
        except Exception as exc:  # noqa: BLE001  (surfaces through the handle, never kills the thread)
            handle._error = TransportError(
                f"transport {self.name!r}: delayed send from rank {self.rank} to rank {handle.peer} with tag "
                f"{handle.tag} failed in the inner transport: {type(exc).__name__}: {exc}"
            )
        handle._handed.set()

    # -- receiving: the inner transport's ---------------------------------------------------------------------

    def _poll(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        return self.inner._poll(peer, tag)

    def _recv(self, peer: int, tag: int, timeout: float) -> Optional[torch.Tensor]:
        return self.inner._recv(peer, tag, timeout)

    def _poll_any(self, keys: list[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        return self.inner._poll_any(keys)

    def _wait_any(self, keys: list[tuple[int, int]], timeout: float) -> Optional[tuple[int, torch.Tensor]]:
        return self.inner._wait_any(keys, timeout)

    # -- completion tracking ------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.inner.begin_step(step)  # its own bookkeeping of the sends handed to it

    # -- lifetime -----------------------------------------------------------------------------------------

    def _close(self) -> None:
        _LIVE.discard(self)
        with self._cond:
            self._stopping = True
            dropped = [entry[2] for entry in self._heap]
            self._heap.clear()
            threads = [th for th in (self._thread, self._retired) if th is not None]
            self._cond.notify_all()
        for handle in dropped:
            with self._cond:
                self._waiting[handle.peer] -= 1
            handle._error = TransportError(
                f"transport {self.name!r} on rank {self.rank} was closed before the delayed message with tag "
                f"{handle.tag} to rank {handle.peer} was due; it was dropped."
            )
            handle._tensor = handle._ready = None
            handle._handed.set()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_S)
        self.inner.close()
        if any(thread.is_alive() for thread in threads if thread is not threading.current_thread()):
            raise TransportError(
                f"transport {self.name!r} on rank {self.rank}: the link-delay thread did not stop within {_JOIN_S:.0f} s "
                "(the inner transport's isend is blocked)."
            )

    def _abandon(self) -> None:
        _LIVE.discard(self)
        self._cond = threading.Condition()  # the parent's thread may have held the old one at the fork
        self._closed = self._stopping = True
        self._heap.clear()
        self._thread = self._retired = None

    def __repr__(self) -> str:
        return f"DelayedTransport({self.inner!r}, {self.delay!r})"
