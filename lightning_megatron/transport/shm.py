"""``shm``: ranks on one node, through lock-free rings in POSIX shared memory (one per ordered pair).

Connect: each rank creates its inbound ring from every peer under a random name (``/lmt-<random>``),
publishes the name, its pid and its node identity through the rendezvous store, maps the peer's ring, and
both unlink the names as soon as both sides have mapped them, so nothing is left in /dev/shm after
``connect`` returns, whatever happens to the processes later. A peer's death is seen through its pid
(pidfd) within about 0.1 s.

CUDA tensors (a transport with ``device="cuda:N"``) move GPU to GPU through CUDA IPC staging slots
(:mod:`~lightning_megatron.transport.cuda_ipc`); the rings carry only their descriptors. Where torch's CUDA
runtime cannot be bound, they are staged through the host instead.

A descriptor arrives as soon as the sender has *queued* its copy-in, possibly long before its GPU has computed
the tensor. ``poll``, ``poll_any`` and ``wait_any`` report a CUDA message only once the sender's copy-in event
has completed: a descriptor whose data is not ready is *parked* (per ``(peer, tag)``, in arrival order, ahead of
anything the mailbox still holds for that key) and reported as not arrived; later polls look at parked messages
first. ``wait_any`` blocks on the mailbox while nothing is parked, and looks at the parked events every 10 to 200
microseconds otherwise (an interprocess event cannot be waited on together with the mailbox). ``recv`` keeps
delivering at arrival: it has committed to that message, and the copy-out on the caller's current stream waits
for the sender's event, so the GPU orders the work and the host does not wait.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from typing import Any, Optional

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport import header as hdr
from lightning_megatron.transport.base import PeerLost, SendHandle, Transport, TransportError
from lightning_megatron.transport.native import NativeTransport, _native, node_identity

__all__ = ["ShmTransport"]

_READY_POLL_S = (10e-6, 200e-6)
"""``wait_any`` with parked CUDA messages: first and longest sleep between looks at their events (doubling)."""
_PEER_LOST = 3  # the engine's peer_state() of a peer that died


class ShmTransport(NativeTransport):
    """Shared-memory rings between ranks of one node.

    ``ring_bytes``: size of each ring (a power of two; messages of any size stream through it).
    ``copy_threads``: threads copying queued sends into rings (shared by all peers).
    ``inline_bytes``: sends up to this size are copied by the calling thread when the ring is idle.
    ``heap_bytes``: per inbound segment, a landing heap the sender copies payloads of at least ``heap_min_bytes``
    into directly (one copy, split over the copy threads; the received tensor views it in place). When it is
    full, or ``heap_bytes=0``, or /dev/shm has no room for it, messages stream through the ring (two copies).
    ``copy_slice``: heap copies are split into slices of this size for the copy threads.
    ``streaming_bytes``: payloads from this size are written to their destination (heap pages or receive buffer)
    with non-temporal stores, which keep them from evicting the source and the ring from the cache.
    ``pool_bytes``: receive buffers (for streamed messages) kept for reuse.
    ``cuda_slots``: with a CUDA ``device``, the most GPU staging slots per peer (sends in flight before the next
    is staged through the host).
    """

    name = "shm"
    devices = ("cpu", "cuda")

    def __init__(
        self,
        *,
        ring_bytes: int = 4 << 20,
        copy_threads: int = 2,
        inline_bytes: int = 64 << 10,
        chunk_bytes: int = 256 << 10,
        streaming_bytes: int = 8 << 20,
        heap_bytes: int = 64 << 20,
        heap_min_bytes: int = 64 << 10,
        copy_slice: int = 1 << 20,
        cuda_slots: int = 16,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._parked: dict[tuple[int, int], deque[tuple[bytes, Any]]] = {}
        """CUDA descriptors taken from the mailbox whose data was not ready yet, per ``(peer, tag)`` in order."""
        self._cuda: Optional[Any] = None
        if self.device.type == "cuda":
            from lightning_megatron.transport.cuda_ipc import CudaIpcChannel

            if cuda_slots < 1:
                raise MegatronConfigError(f"transport 'shm': cuda_slots={cuda_slots} must be >= 1.")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._cuda = CudaIpcChannel(self, self.device, max_slots=int(cuda_slots))
        if ring_bytes < 4096 or ring_bytes & (ring_bytes - 1):
            raise MegatronConfigError(
                f"transport 'shm': ring_bytes={ring_bytes} must be a power of two >= 4096 (e.g. 4 << 20)."
            )
        if copy_threads < 1:
            raise MegatronConfigError(f"transport 'shm': copy_threads={copy_threads} must be >= 1.")
        if heap_bytes < 0 or heap_min_bytes < 0:
            raise MegatronConfigError(
                f"transport 'shm': heap_bytes={heap_bytes} and heap_min_bytes={heap_min_bytes} must be >= 0."
            )
        if chunk_bytes < 4096:
            raise MegatronConfigError(f"transport 'shm': chunk_bytes={chunk_bytes} must be >= 4096.")
        self.ring_bytes = int(ring_bytes)
        self._engine = _native.ShmEngine(
            self.label,
            self.rank,
            self.world_size,
            self.pool_bytes,
            int(copy_threads),
            int(inline_bytes),
            int(min(chunk_bytes, ring_bytes // 2)),
            int(streaming_bytes),
            int(heap_bytes),
            int(heap_min_bytes),
            int(copy_slice),
        )
        self.segment_names: list[str] = []
        """Every shared-memory name this transport used (all unlinked once ``connect`` returns)."""

    def _connect(self, peers: list[int]) -> None:
        me = node_identity()
        try:
            prefixes = {}
            for peer in peers:
                prefixes[peer] = prefix = self._pair_prefix(peer)
                name = f"/lmt-{secrets.token_hex(8)}-{self.rank}from{peer}"
                self._engine.create_ring(peer, name, self.ring_bytes)
                self.segment_names.append(name)
                self._publish(prefix, {"name": name, "pid": os.getpid(), "node": me})
            for peer in peers:
                info = self._fetch(prefixes[peer], peer)
                if info["node"] != me:
                    raise MegatronConfigError(
                        f"transport 'shm' connects ranks of one node, but rank {peer} runs on {info['node'].split('/')[0]} "
                        f"and rank {self.rank} on {me.split('/')[0]}: use transport='tcp' (or 'rdma') between nodes."
                    )
                self._engine.open_ring(peer, info["name"], int(info["pid"]))
            for peer in peers:
                self._engine.finish_connect(peer, self.timeout)
        except BaseException:
            # Leave nothing behind in /dev/shm: a failed connect closes the transport.
            self.close()
            raise

    def transfer_stats(self) -> dict[str, int]:
        """Messages received so far ``in_place`` (through the heap: one copy) and ``streamed`` (through the ring)."""
        return {"in_place": self._engine.received_in_place, "streamed": self._engine.received_streamed}

    # -- CUDA tensors -------------------------------------------------------------------------------------

    def _isend(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> SendHandle:
        if tensor.is_cuda:
            if self._cuda is not None and self._cuda.available and tensor.device == self.device:
                handle = self._cuda.send(peer, tag, tensor, step)
                if handle is not None:
                    return handle
            tensor = tensor.cpu()  # staged through the host: no CUDA IPC here, another device, or no free slot
        return super()._isend(peer, tag, tensor, step)

    # -- CUDA tensors: report a message once its data is ready (see the module docstring) --------------------

    def _payload_ready(self, peer: int, tag: int, header: bytes) -> bool:
        try:
            ready = self._cuda.ready(peer, header)
        except RuntimeError as exc:  # a CUDA error of the event query
            raise TransportError(
                f"{self.label}: the CUDA event of the message from rank {peer} with tag {tag} failed: {exc}"
            ) from exc
        if not ready and self._engine.peer_state(peer) == _PEER_LOST:
            raise PeerLost(
                f"{self.label}: rank {peer} died before the data of its message with tag {tag} was ready on its GPU; "
                "it will not come."
            )
        return ready

    def _ready_or_park(self, peer: int, tag: int, header: bytes, buf: Any) -> Optional[torch.Tensor]:
        """A message just taken from the mailbox (nothing parked for its key): its tensor, or park it."""
        if hdr.kind_of(header) == hdr.KIND_CUDA and not self._payload_ready(peer, tag, header):
            self._parked.setdefault((peer, tag), deque()).append((header, buf))
            return None
        return self._decode(peer, tag, header, buf)

    def _unpark(self, key: tuple[int, int]) -> tuple[bytes, Any]:
        parked = self._parked[key]
        entry = parked.popleft()
        if not parked:
            del self._parked[key]
        return entry

    def _poll(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        if self._cuda is None:
            return super()._poll(peer, tag)
        parked = self._parked.get((peer, tag))
        if parked:  # the oldest message of the key: nothing behind it may overtake it
            header, buf = parked[0]
            if not self._payload_ready(peer, tag, header):
                return None
            self._unpark((peer, tag))
            return self._decode(peer, tag, header, buf)
        msg = self._engine.take(peer, tag)
        return None if msg is None else self._ready_or_park(peer, tag, *msg)

    def _poll_any(self, keys: list[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        if self._cuda is None:
            return super()._poll_any(keys)
        return Transport._poll_any(self, keys)  # key by key through the parking _poll, in the order given

    def _wait_any(self, keys: list[tuple[int, int]], timeout: float) -> Optional[tuple[int, torch.Tensor]]:
        if self._cuda is None:
            return super()._wait_any(keys, timeout)
        deadline = time.monotonic() + timeout
        pause = _READY_POLL_S[0]
        while True:
            got = self._poll_any(keys)
            if got is not None:
                return got
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            free = [i for i, key in enumerate(keys) if key not in self._parked]
            if len(free) == len(keys):  # nothing parked: sleep in the mailbox until something arrives
                slice_s = remaining
            else:  # a parked message may become ready any moment: look again soon
                slice_s = min(remaining, pause)
                pause = min(2 * pause, _READY_POLL_S[1])
            if not free:
                time.sleep(slice_s)
                continue
            msg = self._engine.wait_take_any([keys[i] for i in free], slice_s)
            if msg is None:
                continue
            index = free[msg[0]]
            tensor = self._ready_or_park(*keys[index], msg[1], msg[2])
            if tensor is not None:
                return index, tensor

    def _recv(self, peer: int, tag: int, timeout: float) -> Optional[torch.Tensor]:
        # recv delivers at arrival, ready or not: the copy-out on the caller's stream waits for the sender's event.
        if self._cuda is not None and (peer, tag) in self._parked:
            return self._decode(peer, tag, *self._unpark((peer, tag)))
        return super()._recv(peer, tag, timeout)

    def _decode(self, peer: int, tag: int, header: bytes, buf: Any) -> torch.Tensor:
        if self._cuda is not None and hdr.kind_of(header) == hdr.KIND_CUDA:
            return self._cuda.receive(peer, header)
        tensor = super()._decode(peer, tag, header, buf)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _close(self) -> None:
        self._parked.clear()
        if self._cuda is not None:
            self._cuda.close()
        super()._close()

    def linked_segments(self) -> list[str]:
        """Names of this transport's segments still present in /dev/shm (empty after a successful connect)."""
        return [n for n in self.segment_names if os.path.exists("/dev/shm" + n)]
