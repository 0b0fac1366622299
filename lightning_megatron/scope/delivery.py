"""MegaScope's server threads between the engine and the clients: workers that call the engine, and the
bounded queue and sender thread that carry events out.

Contract:

* ``Worker(name, limit, stopping)`` runs submitted jobs one at a time, in order, on its own thread (inside
  ``compat.cpu.cpu_thread()``, so the engine can run megatron-core there on CPU runs); ``submit`` refuses a
  job beyond ``limit`` pending ones, jobs submitted once ``stopping`` is set are skipped, and a job's exception
  is logged without ending the thread. ``close(timeout)`` ends it after the jobs already queued.
* ``Outbox(size)`` holds at most ``size`` ``Item``\\ s (events encoded by ``Item.of``). When it is full the
  oldest droppable item (``protocol.DROPPABLE_EVENTS``: probe, attention) makes room, or a droppable newcomer is
  dropped; anything else waits for room, so token, finish and error events are never lost. Drops are counted per
  (recipient, request id).
* ``Sender(outbox, ...)`` drains the outbox in order on one thread. Before each event it waits while the
  recipient's transport has more than ``TRANSPORT_WINDOW`` packets unsent (``backlog``), so a slow client fills
  the outbox and not memory, and sends that recipient a ``dropped`` event with its counts first. An event for
  every client (``sid`` None) goes to each one connected when it leaves the queue. A client that stops reading
  slows the others down. ``close(timeout)`` ends it and releases every ``put`` still waiting.

Nothing here knows Socket.IO: the server passes ``clients``, ``emit`` and ``backlog`` in.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from lightning_megatron.compat import cpu as compat_cpu
from lightning_megatron.scope.protocol import DROPPABLE_EVENTS, PROTOCOL_VERSION, encode_event

__all__ = ["TRANSPORT_WINDOW", "Item", "Outbox", "Sender", "Worker"]

TRANSPORT_WINDOW = 16
"""Engine.IO packets a client may have unsent before the sender waits for it."""
_log = logging.getLogger(__name__)


@dataclass(eq=False)
class Item:
    """One outgoing event, encoded for the wire."""

    sid: Optional[str]  # None: every client
    event: dict
    droppable: bool
    rid: Optional[str]

    @classmethod
    def of(cls, sid: Optional[str], event: dict, rid: Optional[str]) -> Item:
        """Encode ``event`` (``protocol.encode_event``; raises on what the wire cannot carry), stamped with the
        protocol version and, when given, the request id ``rid``."""
        encoded = {**encode_event(event), "v": PROTOCOL_VERSION}
        if rid is not None:
            encoded["id"] = rid
        return cls(sid, encoded, encoded["type"] in DROPPABLE_EVENTS, rid)


class Outbox:
    """Bounded FIFO: when full, the oldest droppable item makes room (or a droppable newcomer is dropped);
    anything else waits for room. Drops are counted per (recipient, request id)."""

    def __init__(self, size: int) -> None:
        self._size, self._items, self._closed = size, deque(), False
        self._cond = threading.Condition()
        self._drops: dict[tuple, Counter] = {}

    def _count(self, item: Item) -> None:
        self._drops.setdefault((item.sid, item.rid), Counter())[item.event["type"]] += 1

    def put(self, item: Item) -> None:
        with self._cond:
            while len(self._items) >= self._size and not self._closed:
                victim = next((queued for queued in self._items if queued.droppable), None)
                if victim is not None:
                    self._items.remove(victim)
                    self._count(victim)
                    break
                if item.droppable:
                    self._count(item)
                    return
                self._cond.wait()
            if not self._closed:
                self._items.append(item)
                self._cond.notify_all()

    def get(self) -> Optional[Item]:
        """The oldest item, waiting for one; None once closed."""
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def take_drops(self, sid: Optional[str]) -> dict[Optional[str], dict[str, int]]:
        """The drop counts of recipient ``sid`` by request id (and forget them)."""
        with self._cond:
            keys = [key for key in self._drops if key[0] == sid]
            return {key[1]: dict(self._drops.pop(key)) for key in keys}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Sender:
    """The thread draining ``outbox``: ``clients()`` lists who gets an event for every client, ``emit(sid, event)``
    sends one, ``backlog(sid)`` counts a client's unsent packets (None once it is gone)."""

    def __init__(
        self,
        outbox: Outbox,
        *,
        clients: Callable[[], list[str]],
        emit: Callable[[str, dict], None],
        backlog: Callable[[str], Optional[int]],
        stopping: threading.Event,
    ) -> None:
        self._outbox, self._stopping = outbox, stopping
        self._clients, self._emit, self._backlog = clients, emit, backlog
        self.thread = threading.Thread(target=self._run, name="megascope-sender", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self._outbox.get()) is not None:
            recipients = [item.sid] if item.sid is not None else self._clients()
            drops = self._outbox.take_drops(item.sid)
            for sid in recipients:
                if not self._drained(sid):
                    continue
                for rid, counts in drops.items():
                    dropped = {"v": PROTOCOL_VERSION, "type": "dropped", "counts": counts}
                    self._emit(sid, dropped if rid is None else {**dropped, "id": rid})
                self._emit(sid, item.event)

    def _drained(self, sid: str) -> bool:
        """Wait until ``sid``'s transport has at most a few packets unsent; False if the client is gone."""
        while not self._stopping.is_set():
            backlog = self._backlog(sid)
            if backlog is None:
                return False
            if backlog <= TRANSPORT_WINDOW:
                return True
            self._stopping.wait(0.002)
        return False

    def close(self, timeout: float) -> None:
        self._outbox.close()
        self.thread.join(timeout)


class Worker:
    """One thread running jobs in order; ``submit`` refuses beyond ``limit`` pending jobs."""

    def __init__(self, name: str, limit: int, stopping: threading.Event) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._limit, self._stopping = limit, stopping
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> bool:
        if self._jobs.qsize() >= self._limit:
            return False
        self._jobs.put(job)
        return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._stopping.is_set():
                continue
            try:
                with compat_cpu.cpu_thread():  # the engine runs the model here
                    job()
            except Exception:  # jobs report their own errors; this keeps the worker alive
                _log.exception("MegaScope worker job failed")

    def close(self, timeout: float) -> None:
        self._jobs.put(None)
        self.thread.join(timeout)
