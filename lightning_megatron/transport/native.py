"""The native extension (``lightning_megatron.transport._native``, C++ in ``native/``) and everything the shm,
tcp and rdma transports share: the message header (kind, dtype, shape), send handles, receive paths,
connection bookkeeping through the rendezvous store, and closing at exit.

A message on the wire is an opaque *header* (encoded here, in Python) plus a payload of raw bytes. The C++
side files arrivals per ``(peer, tag)`` into pooled, pre-faulted receive buffers; a received tensor is a view
of such a buffer (``torch.frombuffer`` keeps it alive), and freeing the tensor returns the buffer to the pool.

The header is :mod:`~lightning_megatron.transport.header`'s (the one encoding of every transport). A small
control message (:meth:`NativeTransport.isend_bytes`) carries its bytes right behind the header and has no
payload; another kind of message (a CUDA-IPC handle, say) is added the same way, by extending
:meth:`NativeTransport._decode`.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch

from lightning_megatron.transport import header as hdr
from lightning_megatron.transport.base import SendHandle, Transport, TransportError, TransportTimeout

try:
    from lightning_megatron.transport import _native  # noqa: F401  (shm, tcp and rdma import it from here)
except ImportError as _error:  # pragma: no cover - exercised only on a broken install
    raise TransportError(
        f"lightning_megatron's native transport extension could not be imported ({_error}). It is built when the "
        "package is installed: run `make setup` (or `pip install -e .`) in the repository; that needs a C++ "
        "compiler (Debian/Ubuntu: apt-get install g++)."
    ) from _error

__all__ = ["NativeSendHandle", "NativeTransport", "decode_message", "encode_bytes_message", "node_identity"]


def encode_bytes_message(tag: int, data: bytes) -> bytes:
    """A control message: the header of a 1-d uint8 tensor with the bytes themselves right behind it, so it
    travels with no payload (nothing to keep alive, done as soon as it is queued)."""
    return hdr.pack(hdr.encode(tag, torch.empty(len(data), dtype=torch.uint8))) + bytes(data)


def decode_message(header: bytes, buf: Any) -> torch.Tensor:
    """The tensor of a received message: a view of the pooled receive buffer ``buf`` (the tensor keeps it
    alive; freeing the tensor returns the buffer to the pool), or of the bytes riding behind the header."""
    h = hdr.unpack(header[: hdr.HEADER_BYTES])
    if h.kind != hdr.KIND_DATA:
        raise TransportError(f"unexpected message kind {h.kind} (tag {h.tag})")
    if len(header) > hdr.HEADER_BYTES:
        data = torch.frombuffer(bytearray(header[hdr.HEADER_BYTES :]), dtype=torch.uint8)
    elif buf is not None:
        data = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        data = torch.empty(0, dtype=torch.uint8)
    if data.numel() != h.nbytes:
        raise TransportError(f"message with tag {h.tag} carries {data.numel()} bytes, its header says {h.nbytes}")
    return hdr.from_bytes(data, h)


def node_identity() -> str:
    """Same string on every process of one machine (boot): ranks compare it before using shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class NativeSendHandle(SendHandle):
    """Holds the source tensor until the C++ side has copied (or written) it."""

    __slots__ = ("_op", "_tensor")

    def __init__(self, peer: int, tag: int, nbytes: int, step: int, op: Any, tensor: Optional[torch.Tensor]) -> None:
        super().__init__(peer, tag, nbytes, step)
        self._op, self._tensor = op, tensor

    def done(self) -> bool:
        if self._op.done():  # raises PeerLost / TransportError if the send failed
            self._tensor = None
            return True
        return False

    def wait(self, timeout: Optional[float] = None) -> None:
        # Blocks in C++ (GIL released) instead of the base class's sleep loop: no added latency.
        if not self._op.wait(1e9 if timeout is None else max(float(timeout), 0.0)):
            raise TransportTimeout(
                f"send to rank {self.peer} with tag {self.tag} ({self.nbytes} bytes) not complete after "
                f"{timeout:.1f} s: is rank {self.peer} receiving?"
            )
        self._tensor = None


_LIVE: weakref.WeakSet[NativeTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit (Ctrl-C included) join the native threads before the interpreter tears down."""
    for transport in list(_LIVE):
        try:
            transport.close()
        except Exception:  # noqa: BLE001
            pass


def _abandon_all() -> None:
    """In a forked child (a DataLoader worker, say): the parent's transports have no threads here. Make them
    closed without touching the parent's connections, and without joining threads that do not exist."""
    for transport in list(_LIVE):
        transport._abandon()


os.register_at_fork(after_in_child=_abandon_all)


class NativeTransport(Transport):
    """What shm, tcp and rdma share; subclasses create ``self._engine`` and implement ``_connect``."""

    def __init__(self, *, pool_bytes: int = 1 << 30, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if pool_bytes < 0:
            from lightning_megatron.errors import MegatronConfigError

            raise MegatronConfigError(
                f"transport {self.name!r}: pool_bytes={pool_bytes} must be >= 0 (bytes of receive buffers kept for reuse)."
            )
        self.pool_bytes = int(pool_bytes)
        self._engine: Any = None
        self._pending: list[NativeSendHandle] = []
        self._sweep_at = 64
        _LIVE.add(self)

    @property
    def label(self) -> str:
        return f"transport {self.name!r} on rank {self.rank}"

    # -- messages -----------------------------------------------------------------------------------------

    def _isend(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> SendHandle:
        header = hdr.pack(hdr.encode(tag, tensor))
        nbytes = tensor.numel() * tensor.element_size()
        op = self._engine.isend(peer, tag, header, tensor.data_ptr() if nbytes else 0, nbytes)
        return self._track(NativeSendHandle(peer, tag, nbytes, step, op, tensor))

    def isend_bytes(self, peer: int, tag: int, data: bytes) -> SendHandle:
        """Send a small control message (up to ~1 MiB) with ``tag``. It travels inside the header, so ``data`` may
        be reused at once. The receiver gets it from :meth:`recv_bytes`/:meth:`poll_bytes`, or as a uint8 tensor
        from ``recv``/``poll``."""
        self._check_peer(peer)
        self._check_tag(tag)
        op = self._engine.isend(peer, tag, encode_bytes_message(tag, data), 0, 0)
        return self._track(NativeSendHandle(peer, tag, len(data), self._step, op, None))

    def _track(self, handle: NativeSendHandle) -> NativeSendHandle:
        # Keep each unfinished send's tensor alive even if the caller drops the handle, and let go of the
        # tensors of finished ones even if nobody calls done() (amortized: a sweep when the list doubled).
        if handle._tensor is not None and not handle._op.finished:
            self._pending.append(handle)
            if len(self._pending) >= self._sweep_at:
                keep = []
                for h in self._pending:
                    if h._op.finished:
                        h._tensor = None
                    else:
                        keep.append(h)
                self._pending = keep
                self._sweep_at = max(64, 2 * len(keep))
        return handle

    def _poll(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        msg = self._engine.take(peer, tag)
        return None if msg is None else self._decode(peer, tag, *msg)

    def _recv(self, peer: int, tag: int, timeout: float) -> Optional[torch.Tensor]:
        msg = self._engine.wait_take(peer, tag, timeout)
        return None if msg is None else self._decode(peer, tag, *msg)

    def _poll_any(self, keys: list[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        msg = self._engine.take_any(keys)  # every key under one lock of the mailbox
        if msg is None:
            return None
        index, header, buf = msg
        return index, self._decode(*keys[index], header, buf)

    def _wait_any(self, keys: list[tuple[int, int]], timeout: float) -> Optional[tuple[int, torch.Tensor]]:
        # Blocks in C++ on the mailbox's condition variable (GIL released, Ctrl-C checked every 50 ms).
        msg = self._engine.wait_take_any(keys, timeout)
        if msg is None:
            return None
        index, header, buf = msg
        return index, self._decode(*keys[index], header, buf)

    def _decode(self, peer: int, tag: int, header: bytes, buf: Any) -> torch.Tensor:
        """Turn a received message into the caller's tensor (the hook for further kinds of messages)."""
        try:
            return decode_message(header, buf)
        except ValueError as e:
            raise TransportError(f"{self.label}: bad message from rank {peer} with tag {tag}: {e}") from e

    def poll_bytes(self, peer: int, tag: int) -> Optional[bytes]:
        self._check_peer(peer)
        self._check_tag(tag)
        msg = self._engine.take(peer, tag)
        return None if msg is None else self._as_bytes(peer, tag, *msg)

    def recv_bytes(self, peer: int, tag: int, timeout: Optional[float] = None) -> bytes:
        self._check_peer(peer)
        self._check_tag(tag)
        timeout = self.timeout if timeout is None else float(timeout)
        msg = self._engine.wait_take(peer, tag, timeout)
        if msg is None:
            raise TransportTimeout(
                f"{self.label}: got no message from rank {peer} with tag {tag} within {timeout:.1f} s."
            )
        return self._as_bytes(peer, tag, *msg)

    def _as_bytes(self, peer: int, tag: int, header: bytes, buf: Any) -> bytes:
        if len(header) > hdr.HEADER_BYTES:
            return header[hdr.HEADER_BYTES :]
        return bytes(self._decode(peer, tag, header, buf).reshape(-1).view(torch.uint8).numpy())

    # -- introspection (tests, benchmarks) ----------------------------------------------------------------

    def pool_stats(self) -> dict[str, int]:
        """Receive-buffer pool: ``hits``, ``misses`` (allocations), ``cached_bytes``, ``live_bytes``."""
        return dict(self._engine.pool_stats())

    # -- connection helpers -------------------------------------------------------------------------------

    def _pair_prefix(self, peer: int) -> str:
        """Store keys of this pair's next connection. Each rank counts its own connects to the pair, so the
        n-th connect on one side meets the n-th on the other even when the job makes many transports."""
        lo, hi = sorted((self.rank, peer))
        gen = self.store.add(f"lmt/{self.name}/{lo}-{hi}/gen/{self.rank}", 1)
        return f"lmt/{self.name}/{lo}-{hi}/{gen}"

    def _publish(self, prefix: str, info: dict[str, Any]) -> None:
        self.store.set(f"{prefix}/{self.rank}", json.dumps(info))

    def _fetch(self, prefix: str, peer: int, timeout: Optional[float] = None, what: str = "info") -> dict[str, Any]:
        key = f"{prefix}/{peer}" if what == "info" else f"{prefix}/{peer}/{what}"
        timeout = self.timeout if timeout is None else timeout
        try:
            self.store.wait([key], timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001  (the store raises its own timeout types)
            raise TransportTimeout(
                f"{self.label}: rank {peer} did not connect within {timeout:.1f} s (call connect([{self.rank}]) on "
                f"rank {peer} too): {e}"
            ) from e
        return json.loads(self.store.get(key))

    # -- lifetime -----------------------------------------------------------------------------------------

    def _abandon(self) -> None:
        _LIVE.discard(self)
        self._closed = True
        if self._engine is not None:
            self._engine.abandon()
        self._pending = []

    def _close(self) -> None:
        _LIVE.discard(self)
        if self._engine is not None:
            self._engine.close()  # joins the native threads; they touch no tensor after this
        self._pending = []


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)
