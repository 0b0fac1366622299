"""``torch``: the transport that works everywhere, torch.distributed point-to-point (gloo for CPU, NCCL for CUDA).

Point-to-point in torch matches strictly in posting order, so every message is a fixed-size int64 header
(:mod:`~lightning_megatron.transport.header`: tag, dtype, shape, size) followed by the tensor's bytes, and the
receiver files what arrives under ``(peer, tag)``.

Design
------
* **Own channels.** ``connect`` builds, per peer and per *direction*, a 2-rank ``ProcessGroupGloo`` over the job's
  rendezvous store under a store prefix of its own (and, for CUDA tensors, a 2-rank ``ProcessGroupNCCL`` beside
  it). Nothing is registered in torch.distributed's group list, and the job's other point-to-point traffic (the
  default group, megatron-core's pipeline groups) can neither steal nor mismatch the transport's messages, which
  travel with the gloo point-to-point tag :data:`GLOO_TAG`. The backends' own timeout is a year
  (:data:`BACKEND_TIMEOUT`): an idle header receive must never trip gloo's pair timeout (which closes the pair)
  or NCCL's watchdog; the transport enforces its own deadlines.
* **Headers over gloo, always.** A message is a 256-byte header (:mod:`~lightning_megatron.transport.header`)
  followed by the payload bytes. CPU: payloads up to :data:`INLINE_BYTES` ride in the header's message (gloo
  receives into a larger buffer), bigger ones follow as a second gloo message. CUDA: the payload goes through
  NCCL, and its receive is posted only once the header has announced it. NCCL never has a receive posted ahead
  of time: such a kernel would block the device for ``torch.cuda.synchronize()``, ``cudaFree`` and other
  communicators' set-up until a message came.
* **Receive progress.** One thread per peer waits for the next header, receives the payload of the announced
  size and dtype, files the tensor (FIFO per ``(peer, tag)``) and waits for the next header, so messages are
  received eagerly (the senders' buffers free up without the application polling) and ``poll`` is a look-up
  under a lock. Why a thread and not a progress engine driven by ``poll``: gloo's point-to-point
  ``Work.is_completed()`` stays ``False`` until someone calls ``wait()`` (gloo has no non-blocking completion
  test), and a ``wait(timeout)`` that expires closes the pair for good; the thread's ``wait()`` releases the
  GIL. NCCL payload receives are polled with ``is_completed()``.
* **Deadlines** are ours: ``recv`` (and ``wait_any``, over several keys) waits on a condition variable until
  its deadline and raises
  :class:`TransportTimeout`; the channel stays usable, and the message can still be received later.
* **Sends**: header, then payload, under a per-peer lock (threads cannot interleave them). A second thread per
  peer waits on the send works in order and marks the handles ``done()`` (the backends have read the tensor).
* **Peer death**: gloo raises "Connection closed by peer" in the waiting thread as soon as the socket closes;
  the peer is marked lost and ``poll``/``recv``/``isend`` for it raise :class:`PeerLost` naming the peer and the
  tag (messages that had fully arrived are still delivered first).
* **close()** sends a close notice to each peer (its receive thread ends on it; its ``recv`` for a message that
  never came raises :class:`PeerLost`) and returns; this side's receive threads end when the peers' notices
  arrive (or their connections drop), and the backends are freed with them.
"""

from __future__ import annotations

import datetime
import itertools
import queue
import threading
import time
from collections import deque
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport import header as hdr
from lightning_megatron.transport.base import PeerLost, SendHandle, Transport, TransportError, TransportTimeout

__all__ = ["BACKEND_TIMEOUT", "GLOO_TAG", "HEADERS_POSTED", "TorchTransport"]

GLOO_TAG = 0x4C4D
"""torch point-to-point tag of the transport's headers (on its own backends); payloads use ``GLOO_TAG + 1``."""
_PAYLOAD_TAG = GLOO_TAG + 1
HEADERS_POSTED = 8
"""Header receives kept posted per peer: gloo sends only once the receive is posted, so this many small
messages can be in flight at once (payloads have their own tag, so they never land in a header's buffer)."""
BACKEND_TIMEOUT = datetime.timedelta(days=365)
"""The backends' own operation timeout: effectively none; the transport enforces its deadlines itself."""
INLINE_BYTES = 64 * 1024 - 256
"""gloo: payloads up to this size travel in the header's message."""
_CLOSE_GRACE = 5.0
"""How long ``close`` waits for its close notices to be taken by live peers."""

_generations: dict[tuple[int, int, str], itertools.count] = {}
_generations_lock = threading.Lock()


def _next_generation(a: int, b: int, backend: str) -> int:
    """The how-many-th connection between ranks ``a`` and ``b`` this is; both ends count alike (both connect)."""
    with _generations_lock:
        return next(_generations.setdefault((a, b, backend), itertools.count()))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class _Mailbox:
    """Arrived tensors per ``(peer, tag)`` and the peers' states; shared by the transport and its threads."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.arrived: dict[tuple[int, int], deque[torch.Tensor]] = {}
        self.lost: dict[int, str] = {}  # peer -> why (connection error text)
        self.departed: set[int] = set()  # peers that closed their end
        self.closed = False


class _Channel:
    """Both directions to one peer: the backends, the receive thread and the send-completion thread.

    ``ctl_*`` are gloo backends carrying the headers (and, on CPU, the payloads); on CUDA, ``data_*`` are NCCL
    backends carrying only payloads, each receive posted once its header has announced it."""

    def __init__(self, transport: TorchTransport, peer: int, backends: dict[str, Any]) -> None:
        self.peer = peer
        self.rank = transport.rank
        self.name = transport.name
        self.device = transport.device
        self.nccl = transport.backend == "nccl"
        # gloo receives into a buffer larger than the message, so small CPU payloads ride with their header (one
        # message instead of two); CUDA payloads always go through NCCL.
        self.inline = 0 if self.nccl else INLINE_BYTES
        self.ctl_out, self.ctl_in = backends["ctl_out"], backends["ctl_in"]
        self.data_out, self.data_in = backends.get("data_out", self.ctl_out), backends.get("data_in", self.ctl_in)
        self.mailbox = transport._mailbox
        self.send_lock = threading.Lock()
        self.hello = threading.Event()
        self.sends: queue.SimpleQueue[Optional[_TorchSendHandle]] = queue.SimpleQueue()
        self.recv_thread = threading.Thread(
            target=self._receive_loop, name=f"torch-transport-recv-{self.rank}<-{peer}", daemon=True
        )
        self.send_thread = threading.Thread(
            target=self._send_loop, name=f"torch-transport-send-{self.rank}->{peer}", daemon=True
        )

    def start(self) -> None:
        self.recv_thread.start()
        self.send_thread.start()

    # -- completion -----------------------------------------------------------------------------------------

    @staticmethod
    def _complete(work: Any, nccl: bool) -> None:
        """Block this (helper) thread until ``work`` completes; raise what the backend raises.

        gloo: ``wait()`` (releases the GIL; the only completion test gloo's point-to-point works have). NCCL:
        poll ``is_completed()`` (``wait()`` would only order streams)."""
        if not nccl:
            work.wait()
            return
        delay = 1e-5
        while not work.is_completed():
            time.sleep(delay)
            delay = min(delay * 2, 5e-4)
        try:
            failure = work.exception()
        except TypeError:  # torch 2.11's NCCL work cannot hand its exception_ptr to Python (pybind raises)
            failure = None  # NCCL reports errors through its watchdog anyway
        if failure is not None:  # pragma: no cover
            raise RuntimeError(str(failure))

    # -- receiving ------------------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        mailbox = self.mailbox
        posted: deque[tuple[torch.Tensor, Any]] = deque()
        try:
            for _ in range(HEADERS_POSTED):
                first = torch.empty(hdr.HEADER_BYTES + self.inline, dtype=torch.uint8)
                posted.append((first, self.ctl_in.recv([first], 0, GLOO_TAG)))
            while True:
                first, work = posted.popleft()
                self._complete(work, False)
                try:
                    header = hdr.decode(first[: hdr.HEADER_BYTES].view(torch.int64).tolist())
                except ValueError as exc:
                    raise TransportError(
                        f"transport {self.name!r} on rank {self.rank}: garbled message from rank {self.peer} ({exc})"
                    ) from None
                if header.kind == hdr.KIND_HELLO:
                    self.hello.set()
                    posted.append((first, self.ctl_in.recv([first], 0, GLOO_TAG)))
                    continue
                if header.kind == hdr.KIND_CLOSE:
                    with mailbox.cond:
                        mailbox.departed.add(self.peer)
                        mailbox.cond.notify_all()
                    return
                if header.nbytes == 0:
                    data = torch.empty(0, dtype=torch.uint8, device=self.device)
                elif header.nbytes <= self.inline:  # the payload came with the header
                    data = first[hdr.HEADER_BYTES : hdr.HEADER_BYTES + header.nbytes].clone()
                else:
                    data = torch.empty(header.nbytes, dtype=torch.uint8, device=self.device)
                    self._complete(self.data_in.recv([data], 0, _PAYLOAD_TAG), self.nccl)
                posted.append((first, self.ctl_in.recv([first], 0, GLOO_TAG)))  # its buffer is free again
                tensor = hdr.from_bytes(data, header)
                with mailbox.cond:
                    if not mailbox.closed:
                        mailbox.arrived.setdefault((self.peer, header.tag), deque()).append(tensor)
                        mailbox.cond.notify_all()
        except Exception as exc:  # noqa: BLE001  (anything the backend raises means the channel is gone)
            with mailbox.cond:
                if isinstance(exc, TransportError):
                    mailbox.lost[self.peer] = str(exc)
                else:
                    mailbox.lost[self.peer] = f"its connection failed: {_first_line(exc)}"
                mailbox.cond.notify_all()
        finally:
            self.hello.set()  # wake a connect() that waits for the hello

    # -- sending --------------------------------------------------------------------------------------------

    def post(self, handle: _TorchSendHandle, words: list[int], payload: Optional[torch.Tensor]) -> None:
        head = torch.frombuffer(bytearray(hdr.pack(words)), dtype=torch.uint8)
        nbytes = 0 if payload is None else payload.numel()
        if 0 < nbytes <= self.inline:  # one message: header and payload
            head, payload = torch.cat([head, payload]), None
        with self.send_lock:  # header and payload of one message stay together in both streams
            works = [(self.ctl_out.send([head], 1, GLOO_TAG), False)]
            if payload is not None and nbytes:
                works.append((self.data_out.send([payload], 1, _PAYLOAD_TAG), self.nccl))
        handle._works, handle._keep = works, (head, payload)
        self.sends.put(handle)

    def _send_loop(self) -> None:
        """Wait on the send works in posting order and mark their handles done (or failed)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        failure: Optional[str] = None
        while True:
            handle = self.sends.get()
            if handle is None:
                return
            if failure is None:
                try:
                    for work, nccl in handle._works:
                        self._complete(work, nccl)
                except Exception as exc:  # noqa: BLE001
                    failure = _first_line(exc)
            if failure is not None:
                handle._error = PeerLost(
                    f"transport {self.name!r}: send from rank {self.rank} to rank {self.peer} with tag {handle.tag} "
                    f"failed: rank {self.peer} is gone ({failure})"
                )
            handle._finish()

    def stop_sending(self) -> None:
        self.sends.put(None)


class _TorchSendHandle(SendHandle):
    __slots__ = ("_done", "_error", "_keep", "_works")

    def __init__(self, peer: int, tag: int, nbytes: int, step: int) -> None:
        super().__init__(peer, tag, nbytes, step)
        self._works: list[tuple[Any, bool]] = []
        self._keep: Any = None  # the tensors the backends read from, alive until the send completed
        self._done = False
        self._error: Optional[TransportError] = None

    def _finish(self) -> None:
        self._works, self._keep = [], None
        self._done = True

    def done(self) -> bool:
        if self._done and self._error is not None:
            raise self._error
        return self._done


class TorchTransport(Transport):
    """torch.distributed point-to-point with tag headers: gloo moves CPU tensors, NCCL CUDA tensors.

    ``backend``: ``"gloo"`` or ``"nccl"``; by default the one of ``device`` (cpu: gloo, cuda: NCCL).
    """

    name = "torch"
    devices = ("cpu", "cuda")

    def __init__(self, *, backend: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        wanted = "nccl" if self.device.type == "cuda" else "gloo"
        backend = wanted if backend is None else str(backend).lower()
        if backend not in ("gloo", "nccl"):
            raise MegatronConfigError(f"transport 'torch': backend={backend!r}; choose 'gloo' (CPU) or 'nccl' (CUDA).")
        if backend != wanted:
            raise MegatronConfigError(
                f"transport 'torch': backend {backend!r} moves {'CUDA' if backend == 'nccl' else 'CPU'} tensors, "
                f"but device={str(self.device)!r}: use device={'cuda' if backend == 'nccl' else 'cpu'!r} or "
                f"backend={wanted!r}."
            )
        if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise MegatronConfigError(
                "transport 'torch': NCCL and CUDA are not available here; use device='cpu' (gloo)."
            )
        if backend == "gloo" and not dist.is_gloo_available():
            raise MegatronConfigError("transport 'torch': this torch build has no gloo; use another transport.")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend
        self._mailbox = _Mailbox()
        self._channels: dict[int, _Channel] = {}

    # -- connection ---------------------------------------------------------------------------------------

    def _backend(self, kind: str, prefix: str, group_rank: int) -> Any:
        store = dist.PrefixStore(prefix, self.store)
        if kind == "gloo":
            return dist.ProcessGroupGloo(store, group_rank, 2, BACKEND_TIMEOUT)
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = BACKEND_TIMEOUT
        return dist.ProcessGroupNCCL(store, group_rank, 2, options)

    def _connect(self, peers: list[int]) -> None:
        deadline = time.monotonic() + self.timeout
        prefixes = {}
        for peer in peers:  # announce first, then wait: ranks that connect several peers cannot deadlock
            a, b = sorted((self.rank, peer))
            generation = _next_generation(a, b, self.backend)
            prefixes[peer] = f"lightning_megatron/transport/torch/{self.backend}/{a}-{b}/{generation}"
            self.store.set(f"{prefixes[peer]}/here/{self.rank}", "1")
        for peer in peers:  # sorted: every rank builds its pairs' backends in the same global order
            key = f"{prefixes[peer]}/here/{peer}"
            try:
                self.store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception as exc:  # noqa: BLE001  (the store raises DistStoreError or RuntimeError)
                raise TransportTimeout(
                    f"transport 'torch': rank {peer} did not connect to rank {self.rank} within {self.timeout:.1f} s "
                    f"(rank {peer} must call connect([{self.rank}]) too): {_first_line(exc)}"
                ) from None
            backends = {}
            directions = sorted([(self.rank, peer), (peer, self.rank)])
            for src, dst in directions:
                end = "out" if src == self.rank else "in"
                group_rank = 0 if src == self.rank else 1
                backends[f"ctl_{end}"] = self._backend("gloo", f"{prefixes[peer]}/{src}to{dst}/", group_rank)
                if self.backend == "nccl":
                    backends[f"data_{end}"] = self._backend("nccl", f"{prefixes[peer]}/{src}to{dst}/nccl/", group_rank)
            if self.backend == "nccl":
                self._start_nccl(peer, backends, directions, deadline)
            channel = _Channel(self, peer, backends)
            channel.start()
            self._channels[peer] = channel
            channel.post(_TorchSendHandle(peer, 0, 0, -1), hdr.encode(0, None, hdr.KIND_HELLO), None)
        for peer in peers:  # both directions carry a message before connect returns
            channel = self._channels[peer]
            if not channel.hello.wait(max(deadline - time.monotonic(), 0.0)):
                raise TransportTimeout(
                    f"transport 'torch': no hello from rank {peer} to rank {self.rank} within {self.timeout:.1f} s"
                )
            with self._mailbox.cond:
                self._raise_if_gone(peer, None)

    def _start_nccl(
        self, peer: int, backends: dict[str, Any], directions: list[tuple[int, int]], deadline: float
    ) -> None:
        """Create both NCCL communicators now, one after the other, from this thread.

        NCCL creates a communicator at its first operation. Left to the helper threads, the two directions'
        communicators would be created concurrently, and one's initialisation can wait on the device behind the
        other's first (blocking) kernel: both ranks hang. Serialised here, with no transfer in flight, it cannot."""
        one = torch.zeros(1, dtype=torch.uint8, device=self.device)
        for src, _ in directions:
            if src == self.rank:
                work = backends["data_out"].send([one], 1, GLOO_TAG)
            else:
                work = backends["data_in"].recv([one], 0, GLOO_TAG)
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TransportTimeout(
                        f"transport 'torch': the NCCL channel between ranks {self.rank} and {peer} did not come up "
                        f"within {self.timeout:.1f} s"
                    )
                time.sleep(1e-4)

    # -- messages -----------------------------------------------------------------------------------------

    def _isend(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> SendHandle:
        if tensor.device != self.device:
            tensor = tensor.to(self.device)
        words = hdr.encode(tag, tensor)
        channel = self._channels[peer]
        handle = _TorchSendHandle(peer, tag, words[4], step)
        with self._mailbox.cond:
            self._raise_if_gone(peer, tag, sending=True)
        try:
            channel.post(handle, words, hdr.as_bytes(tensor))
        except Exception as exc:  # noqa: BLE001
            raise PeerLost(
                f"transport 'torch': send from rank {self.rank} to rank {peer} with tag {tag} failed: "
                f"{_first_line(exc)}"
            ) from None
        return handle

    def _take(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        """Under the mailbox lock: the oldest arrived tensor for ``(peer, tag)``."""
        box = self._mailbox.arrived.get((peer, tag))
        if not box:
            return None
        tensor = box.popleft()
        if not box:
            del self._mailbox.arrived[(peer, tag)]
        return tensor

    def _raise_if_gone(self, peer: int, tag: Optional[int], sending: bool = False) -> None:
        mailbox = self._mailbox
        what = "" if tag is None else f" ({'sending' if sending else 'waiting for'} tag {tag})"
        if mailbox.closed:
            raise TransportError(f"transport 'torch' on rank {self.rank} was closed{what}.")
        if peer in mailbox.lost:
            raise PeerLost(f"transport 'torch' on rank {self.rank}: rank {peer} is lost{what}: {mailbox.lost[peer]}")
        if peer in mailbox.departed and tag is not None:
            raise PeerLost(
                f"transport 'torch' on rank {self.rank}: rank {peer} closed its transport"
                + (f"; the message with tag {tag} cannot be delivered." if sending else f"; tag {tag} will not come.")
            )

    def _poll(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        with self._mailbox.cond:
            tensor = self._take(peer, tag)
            if tensor is None:
                self._raise_if_gone(peer, tag)
            return tensor

    def _recv(self, peer: int, tag: int, timeout: float) -> Optional[torch.Tensor]:
        deadline = time.monotonic() + timeout
        with self._mailbox.cond:
            while True:
                tensor = self._take(peer, tag)
                if tensor is not None:
                    return tensor
                self._raise_if_gone(peer, tag)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._mailbox.cond.wait(remaining)

    def _take_any(self, keys: list[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        """Under the mailbox lock: the first of ``keys`` with an arrived tensor; else raise for a key whose peer
        is gone (nothing can come for it), else ``None``."""
        for index, (peer, tag) in enumerate(keys):
            tensor = self._take(peer, tag)
            if tensor is not None:
                return index, tensor
        for peer, tag in keys:
            self._raise_if_gone(peer, tag)
        return None

    def _poll_any(self, keys: list[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        with self._mailbox.cond:
            return self._take_any(keys)

    def _wait_any(self, keys: list[tuple[int, int]], timeout: float) -> Optional[tuple[int, torch.Tensor]]:
        # The receive threads notify the condition on every arrival and on every peer's departure or loss.
        deadline = time.monotonic() + timeout
        with self._mailbox.cond:
            while True:
                got = self._take_any(keys)
                if got is not None:
                    return got
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._mailbox.cond.wait(remaining)

    # -- lifetime -----------------------------------------------------------------------------------------

    def _close(self) -> None:
        mailbox = self._mailbox
        notices = []
        for peer, channel in self._channels.items():
            if peer in mailbox.lost:
                continue
            handle = _TorchSendHandle(peer, 0, 0, -1)
            try:
                channel.post(handle, hdr.encode(0, None, hdr.KIND_CLOSE), None)
                notices.append(handle)
            except Exception:  # noqa: BLE001,S110  (the peer is gone: nothing to tell it)
                pass
        deadline = time.monotonic() + min(self.timeout, _CLOSE_GRACE)
        for handle in notices:
            try:
                handle.wait(max(deadline - time.monotonic(), 0.0))
            except TransportError:
                pass
        channels = list(self._channels.values())
        for channel in channels:
            channel.stop_sending()
        with mailbox.cond:
            mailbox.closed = True
            mailbox.arrived.clear()
            mailbox.cond.notify_all()
        self._channels.clear()
        # Wait for the threads: a receive thread ends on the peer's close notice (or when its connection drops). A
        # process that exits while one of them is still inside a backend's wait() is aborted by the C++ runtime
        # ("terminate called without an active exception"), so closing must not return before they end. A peer
        # that stays alive without closing leaves its receive thread waiting: given up after the grace period.
        for channel in channels:
            channel.send_thread.join(max(deadline - time.monotonic(), 0.0))
        for channel in channels:
            channel.recv_thread.join(max(deadline - time.monotonic(), 0.0))
