"""The contract every transport keeps: tagged, asynchronous, point-to-point tensor messages.

Dynamic pipeline schedules (MegaDPP, MegaFBD) decide at run time which microbatch a stage works on next, so
messages must be matched by *tag* (for example ``(microbatch, chunk, direction)`` packed into an int), not by
posting order as NCCL and gloo point-to-point do. A transport therefore carries, with every tensor, a header
(tag, dtype, shape) and files arrivals per ``(peer, tag)``; the receiver asks for the tag it wants and takes
whichever has arrived (``poll``) or waits for it (``recv``).

Semantics, the same for every implementation (``tests/test_transport.py`` checks each one against them):

* ``isend(peer, tag, tensor) -> SendHandle`` returns at once. The tensor must not be modified until
  ``handle.done()``; the handle keeps it alive. Any dtype, any shape (0-d included), any device the transport
  supports; non-contiguous tensors are sent as their contiguous copy.
* Messages with the same ``(peer, tag)`` arrive in the order they were sent; different tags are independent.
* ``poll(peer, tag)`` never blocks: the tensor, or ``None`` if it has not (completely) arrived.
* ``recv(peer, tag, timeout)`` blocks, and raises :class:`TransportTimeout` naming the peer and the tag instead
  of hanging; a dead or departed peer raises :class:`PeerLost` as soon as the transport can tell (messages that
  had fully arrived are still delivered first), and sends to it fail (``done()`` raises) from then on.
* Wait-any, for schedules that run whichever task's input comes first: ``poll_any(keys)`` (never blocks) and
  ``wait_any(keys, timeout)`` (blocks; :class:`TransportTimeout` naming every peer and tag waited for) take the
  first arrived message among the ``(peer, tag)`` keys, checked in the order given, and return
  ``(index into keys, tensor)``. When none has arrived and the peer of one key is gone, they raise
  :class:`PeerLost` for that key (as ``poll``/``recv`` do; arrived messages are still delivered first).
* "Arrived" means *usable*: where a payload is produced asynchronously (CUDA IPC in ``shm``), ``poll``,
  ``poll_any`` and ``wait_any`` report a message only once its data is ready, so a schedule never picks a task
  whose input is still being computed on the sender's GPU. ``recv``, which commits to one message, may return
  earlier and order the caller's stream after the data instead (``shm`` does).
* Received tensors are contiguous, on the transport's ``device``, and owned by the caller.
* Completion tracking: every send belongs to the step set by ``begin_step``; ``sends_done(step)`` says whether
  all of that step's sends have left this process's hands (their buffers may be reused), and ``wait_sends``
  blocks until they have.

Implementations are chosen by name (:func:`create_transport`); see ``lightning_megatron.transport`` for the list.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Optional, Union

import torch

from lightning_megatron.errors import MegatronConfigError, TransportUsageError

__all__ = [
    "MAX_TAG",
    "PeerLost",
    "SendHandle",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "describe_keys",
]

MAX_TAG = 2**62 - 1
"""Tags are non-negative integers below 2**62; the tags above are the transports' own (acknowledgements)."""


class TransportError(RuntimeError):
    """A transport failed; the message names the transport, both ranks and, where known, the tag."""


class TransportTimeout(TransportError, TimeoutError):
    """A receive or a send did not complete in time (the peer is alive but did not send, or is stuck)."""


class PeerLost(TransportError):
    """The peer process died or closed its end while a message was expected from or sent to it."""


class SendHandle(abc.ABC):
    """One posted send. Holds the source tensor until the transport no longer needs it."""

    __slots__ = ("nbytes", "peer", "step", "tag")

    def __init__(self, peer: int, tag: int, nbytes: int, step: int) -> None:
        self.peer, self.tag, self.nbytes, self.step = peer, tag, nbytes, step

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the data has left the source tensor (it may be modified or freed now). Never blocks.

        Raises :class:`TransportError` if the send failed."""

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until :meth:`done`; :class:`TransportTimeout` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-6
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TransportTimeout(
                    f"send to rank {self.peer} with tag {self.tag} ({self.nbytes} bytes) not complete after "
                    f"{timeout:.1f} s: is rank {self.peer} receiving?"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1e-4)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(peer={self.peer}, tag={self.tag}, nbytes={self.nbytes}, step={self.step})"


def describe_keys(keys: Sequence[tuple[int, int]]) -> str:
    """``(peer, tag)`` keys for an error message, grouped by peer: ``"rank 1 tags [3, 4]; rank 2 tag 5"``."""
    by_peer: dict[int, list[int]] = {}
    for peer, tag in keys:
        by_peer.setdefault(peer, []).append(tag)
    parts = []
    for peer, tags in by_peer.items():
        shown = ", ".join(str(t) for t in tags[:8]) + (f", ... ({len(tags)} tags)" if len(tags) > 8 else "")
        parts.append(f"rank {peer} tag {shown}" if len(tags) == 1 else f"rank {peer} tags [{shown}]")
    return "; ".join(parts)


def _finished(handle: SendHandle) -> bool:
    """For housekeeping: a send that failed is kept, so its error surfaces in ``wait_sends``/``sends_done``."""
    try:
        return handle.done()
    except TransportError:
        return False


class Transport(abc.ABC):
    """Tagged point-to-point tensor messages between the ranks of one job.

    ``rank``/``world_size`` default to torch.distributed's default group, ``store`` to its rendezvous store
    (connection data and job-unique names are exchanged through it: no fixed ports, no fixed names).
    ``connect(peers)`` must be called by both ends of every pair before the first message between them.
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    """Device types the transport can send from and receive into."""

    def __init__(
        self,
        *,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        store: Optional[Any] = None,
        device: Union[str, torch.device, None] = None,
        timeout: float = 300.0,
    ) -> None:
        from lightning_megatron.compat.torch import default_store

        if rank is None or world_size is None:
            if not torch.distributed.is_initialized():
                raise MegatronConfigError(
                    f"transport {self.name!r}: pass `rank` and `world_size` (and `store`), or initialise "
                    "torch.distributed first (the strategy does this in setup)."
                )
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.rank, self.world_size = int(rank), int(world_size)
        self.store = store if store is not None else default_store()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type not in self.devices:
            raise MegatronConfigError(
                f"transport {self.name!r} moves tensors on {', '.join(self.devices)}, not {self.device.type}: "
                "pick another `transport` or `device`."
            )
        if timeout <= 0:
            raise MegatronConfigError(f"transport timeout={timeout}: a positive number of seconds.")
        self.timeout = float(timeout)
        self.peers: set[int] = set()
        self._step = 0
        self._handles: dict[int, list[SendHandle]] = {}
        self._handles_lock = threading.Lock()
        self._closed = False

    # -- connection ---------------------------------------------------------------------------------------

    def connect(self, peers: Iterable[int]) -> None:
        """Set up channels to ``peers`` (each of which must call ``connect`` with this rank among its peers)."""
        new = []
        for peer in peers:
            peer = int(peer)
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise TransportUsageError(
                    f"transport {self.name!r} on rank {self.rank}: peer {peer} is not another rank of this job "
                    f"(world size {self.world_size})."
                )
            if peer not in self.peers:
                new.append(peer)
        if new:
            self._connect(sorted(new))
            self.peers.update(new)

    @abc.abstractmethod
    def _connect(self, peers: list[int]) -> None: ...

    # -- messages -----------------------------------------------------------------------------------------

    def isend(self, peer: int, tag: int, tensor: torch.Tensor) -> SendHandle:
        self._check_peer(peer)
        self._check_tag(tag)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"isend(peer={peer}, tag={tag}): expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type not in self.devices:
            raise TransportUsageError(
                f"transport {self.name!r} cannot send a {tensor.device.type} tensor (tag {tag} to rank {peer}): "
                f"it moves tensors on {', '.join(self.devices)}."
            )
        handle = self._isend(peer, tag, tensor.detach().contiguous(), self._step)
        with self._handles_lock:
            handles = self._handles.setdefault(self._step, [])
            handles.append(handle)
            if len(handles) % 256 == 0:  # a caller that never asks must not pile up finished handles
                handles[:] = [h for h in handles if not _finished(h)]
        return handle

    def poll(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        self._check_peer(peer)
        self._check_tag(tag)
        return self._poll(peer, tag)

    def recv(self, peer: int, tag: int, timeout: Optional[float] = None) -> torch.Tensor:
        self._check_peer(peer)
        self._check_tag(tag)
        timeout = self.timeout if timeout is None else float(timeout)
        tensor = self._recv(peer, tag, timeout)
        if tensor is None:
            raise TransportTimeout(
                f"transport {self.name!r}: rank {self.rank} got no message from rank {peer} with tag {tag} "
                f"within {timeout:.1f} s (rank {peer} is alive but did not send it: check the schedule's tags)."
            )
        return tensor

    def poll_any(self, keys: Sequence[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        """The first arrived message among ``keys`` (``(peer, tag)`` pairs, checked in the order given) as
        ``(index into keys, tensor)``, or ``None`` if none has arrived. Never blocks.

        A dynamic schedule asks for the inputs of every task it could run next and runs whichever came first.
        Raises :class:`PeerLost` for a key whose peer is gone when no key has a message (arrived messages are
        delivered first, as with :meth:`poll`)."""
        checked = self._check_keys(keys, "poll_any")
        return self._poll_any(checked)

    def wait_any(self, keys: Sequence[tuple[int, int]], timeout: Optional[float] = None) -> tuple[int, torch.Tensor]:
        """Block until one of ``keys`` (``(peer, tag)`` pairs) has a message; return ``(index into keys, tensor)``
        of the first arrived one (in the order of ``keys`` when several have).

        ``timeout`` (default: the transport's) raises :class:`TransportTimeout` naming the peers and tags waited
        for instead of hanging; :class:`PeerLost` as in :meth:`poll_any`."""
        checked = self._check_keys(keys, "wait_any")
        timeout = self.timeout if timeout is None else float(timeout)
        got = self._wait_any(checked, timeout)
        if got is None:
            raise TransportTimeout(
                f"transport {self.name!r}: rank {self.rank} got none of the messages it waited for "
                f"({describe_keys(checked)}) within {timeout:.3g} s (the peers are alive but did not send them: "
                "check the schedule's tags)."
            )
        return got

    @abc.abstractmethod
    def _isend(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> SendHandle: ...

    @abc.abstractmethod
    def _poll(self, peer: int, tag: int) -> Optional[torch.Tensor]: ...

    def _recv(self, peer: int, tag: int, timeout: float) -> Optional[torch.Tensor]:
        """Wait for ``(peer, tag)``; ``None`` on timeout. Implementations with a blocking primitive override it."""
        got = Transport._wait_any(self, [(peer, tag)], timeout)
        return None if got is None else got[1]

    def _poll_any(self, keys: list[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        """``_poll`` over ``keys`` in order; a key whose peer is gone is reported only if no key has a message.
        Implementations that can look at all keys in one go (under one lock) override it."""
        lost: Optional[PeerLost] = None
        for index, (peer, tag) in enumerate(keys):
            try:
                tensor = self._poll(peer, tag)
            except PeerLost as exc:
                lost = lost or exc
                continue
            if tensor is not None:
                return index, tensor
        if lost is not None:
            raise lost
        return None

    def _wait_any(self, keys: list[tuple[int, int]], timeout: float) -> Optional[tuple[int, torch.Tensor]]:
        """Wait for any of ``keys``; ``None`` on timeout. Implementations with a blocking primitive override it."""
        deadline = time.monotonic() + timeout
        delay = 1e-6
        while True:
            got = self._poll_any(keys)
            if got is not None:
                return got
            if time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 5e-4)

    # -- completion tracking ------------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Sends posted from now on belong to ``step`` (for ``sends_done``/``wait_sends``)."""
        self._step = int(step)
        with self._handles_lock:  # forget earlier steps whose sends have all completed
            for old in [s for s, hs in self._handles.items() if s != self._step and all(_finished(h) for h in hs)]:
                del self._handles[old]

    @property
    def step(self) -> int:
        return self._step

    def sends_done(self, step: Optional[int] = None) -> bool:
        """Whether every send of ``step`` (default: the current step) has completed. Never blocks."""
        step = self._step if step is None else int(step)
        with self._handles_lock:
            handles = self._handles.get(step, [])
            handles[:] = [h for h in handles if not h.done()]
            return not handles

    def wait_sends(self, step: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """Block until every send of ``step`` (default: the current step) has completed."""
        step = self._step if step is None else int(step)
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        with self._handles_lock:
            handles = list(self._handles.get(step, []))
        for handle in handles:
            handle.wait(max(deadline - time.monotonic(), 0.0))
        with self._handles_lock:
            self._handles.pop(step, None)

    # -- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release channels, threads and shared memory. Idempotent; pending messages are dropped."""
        if not self._closed:
            self._closed = True
            self._close()

    def _close(self) -> None:  # noqa: B027  (optional hook)
        pass

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    # -- checks -------------------------------------------------------------------------------------------

    def _check_peer(self, peer: int) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name!r} on rank {self.rank} is closed.")
        if peer not in self.peers:
            raise TransportUsageError(
                f"transport {self.name!r} on rank {self.rank}: rank {peer} is not connected; call "
                f"connect([{peer}]) on both ranks first (connected: {sorted(self.peers)})."
            )

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
            raise TransportUsageError(f"transport tag {tag!r}: tags are ints in [0, 2**62).")

    def _check_keys(self, keys: Sequence[tuple[int, int]], what: str) -> list[tuple[int, int]]:
        """``keys`` as a list of ``(peer, tag)`` int pairs, each peer connected and each tag valid."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TransportUsageError(
                f"{what}(keys={keys!r}): keys must be a list of (peer, tag) pairs, e.g. [(1, 7), (2, 7)]."
            )
        if not keys:
            raise TransportUsageError(
                f"{what}(keys=[]) on rank {self.rank}: there is nothing to wait for; pass at least one (peer, tag) "
                "pair (a schedule with no receivable task should run or wait on something else)."
            )
        checked = []
        for key in keys:
            try:
                peer, tag = key
            except (TypeError, ValueError):
                raise TransportUsageError(
                    f"{what}: key {key!r} is not a (peer, tag) pair; pass keys like [(1, 7), (2, 7)]."
                ) from None
            if isinstance(peer, bool) or not isinstance(peer, int):
                raise TransportUsageError(f"{what}: key {key!r}: the peer must be an int rank, not {peer!r}.")
            self._check_peer(peer)
            self._check_tag(tag)
            checked.append((peer, tag))
        return checked

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, peers={sorted(self.peers)})"
