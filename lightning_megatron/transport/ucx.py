"""``ucx``: ranks on one host or many, over UCX (Unified Communication X), which picks the fabric itself.

The engine (``native/src/ucx_channel.*``) drives one UCP worker per transport from one progress thread and sends
every message as a UCP *active message*: the tag, a per-peer sequence number and the header travel in the AM
header, the payload straight from the tensor; the receiver files arrivals in the mailbox every native transport
shares (eager data copied into a pooled buffer, rendezvous data received straight into one). Workers exchange
their addresses through the job's rendezvous store (no ports); endpoints use UCX's peer error handling, so a
dead peer raises :class:`~lightning_megatron.transport.base.PeerLost`.

UCX is optional (the ``ucx`` extra: ``pip install 'lightning-megatron[ucx]'``, the ``libucx`` wheel). The native
extension is built against vendored UCP headers and loads ``libucp`` at run time (``dlopen``), so it builds
and imports without UCX; without it, creating this transport raises :class:`MegatronConfigError` naming the
extra. A system UCX (``libucp.so.0`` on the library path) is used where the wheel is not installed.

UCX chooses its transports from ``UCX_TLS`` and friends, which are left to the user (unset: UCX's own choice --
POSIX shared memory within a host, TCP across hosts, InfiniBand/RoCE where its libraries and devices exist;
``transports_to(peer)`` says what it chose). This transport changes three UCX defaults, each overridden by the
``UCX_*`` variable of the same name or a ``ucx_config`` entry: ``NET_DEVICES`` is the loopback interface when
every rank is on this host (``MASTER_ADDR`` is loopback, as the strategy sets it on one node), so UCX's TCP
transport listens on nothing else; ``POSIX_ERROR_HANDLING=y`` (see
:data:`UCX_DEFAULTS`: without it UCX would use TCP loopback between ranks of one host) and ``KEEPALIVE_INTERVAL``
(20 s in UCX, ``keepalive_interval`` = 1 s here, so a dead peer on another host is noticed within seconds; a
peer on this host is also watched by its pid, noticed within ~0.1 s).

CUDA tensors (a transport with ``device="cuda:N"``; ``devices`` lists ``"cuda"`` where torch is built with CUDA
and UCX has its CUDA transport modules, as the ``libucx-cu12``/``-cu13`` wheels do, unless ``LMT_UCX_CUDA=0``)
move through UCX's own CUDA transports (``cuda_ipc`` GPU to GPU on one host, ``cuda_copy`` staging, whatever UCX
chooses; ``transports_to`` lists the lanes), never through a copy of ours:

* Sending: ``isend`` records an event on the tensor's device's current stream (behind the tensor's producers,
  the ``contiguous()`` copy included) and returns at once; the message is handed to UCX (as
  ``UCS_MEMORY_TYPE_CUDA``, flagged as device data in the frame) only once that event has completed, so UCX
  never reads data a kernel is still writing. Until then it waits, in order, in a queue of this transport
  (one thread, ``lmt-ucx-post``, that waits on the events); every later send goes through the queue too while it
  is not empty, so FIFO per ``(peer, tag)`` holds. ``done()`` is true once UCX is done with the source. A CUDA
  tensor on another device, or on a transport whose ``device`` is the CPU, is staged through the host
  (``tensor.cpu()``), as ``shm`` does.
* Receiving: a device message that UCX delivers by rendezvous (all but the smallest) is *not* received when it
  arrives: the engine keeps UCX's descriptor and files the message in its place in the order. When Python takes
  it (``poll``/``recv``/``poll_any``/``wait_any``), it allocates the tensor on the transport's device with torch's
  allocator (``torch.empty`` on a side stream that runs nothing, then ``record_stream`` on the caller's current
  stream, so the block is reused only after the caller's work on it) and has UCX receive the data straight into
  it (``ucp_am_recv_data_nbx``, ``UCS_MEMORY_TYPE_CUDA``), waiting for it to land (up to the transport's
  ``timeout``) before returning it; so taking such a message blocks for the length of the GPU-to-GPU transfer
  (the data is already computed: the sender waited for it). Eager device messages (small) arrive in a host
  buffer and are copied to the device, as are messages from host memory. Received tensors are on the
  transport's device, as with ``shm``. A take also takes the messages already waiting behind it on the same
  ``(peer, tag)``, then the deferred ones from that peer that head other tags' queues (up to ``pull_ahead``
  messages and ``PREFETCH_BYTES`` waiting), and starts their pulls, kept in order for the next takes of each key,
  so a stream of large messages is received side by side, not one pull at a time. While a pull is in flight the
  progress thread polls UCX without sleeping (the copy's completion wakes no file descriptor).

Tested: ``tests/test_transport_ucx_gpu.py`` on two GPUs of one host with peer access (NVLink) and the
``libucx-cu13`` wheel: UCX chose ``["posix/memory", "cuda_ipc/cuda"]`` (a rendezvous zero-copy read over CUDA
IPC), and with the event wait removed its still-being-computed case got stale data (so the case does catch it).
The streaming benchmark (``benchmarks/transport.py --gpu``) puts ucx close to NCCL for large messages (the
figures, with versions and hardware: docs/evaluation/throughput.md). The mechanics of the deferred receive are
also checked on CPUs with host memory standing in for GPU memory
(``tests/test_transport_ucx.py::test_device_path_with_host_memory``). Not tested: other UCX versions, GPUs
without peer access or on other hosts (UCX would stage through the host or use its network transports),
torch's ``expandable_segments`` allocator, a peer dying mid-pull.
"""

from __future__ import annotations

import glob
import os
import struct
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any, Optional

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.loopback import is_loopback, loopback_interface
from lightning_megatron.transport import find_libucp
from lightning_megatron.transport import header as hdr
from lightning_megatron.transport.base import SendHandle, TransportError, TransportTimeout
from lightning_megatron.transport.native import NativeTransport, _native, node_identity
from lightning_megatron.transport.tcp import default_ifaddr
from lightning_megatron.transport.ucx_post import Poster, QueuedSendHandle

__all__ = ["EXTRA", "UcxTransport", "load_ucx", "ucx_cuda_modules"]

EXTRA = "pip install 'lightning-megatron[ucx]'"

SPIN_SECONDS = {"cpu": 20e-6, "cuda": 2e-3}
"""How long the progress thread polls after its last event before it sleeps on UCX's event fd, by device.

With a CUDA device a message's steps (the rendezvous, the copy on UCX's stream, its completion, the ack) follow
each other by tens to hundreds of microseconds; a thread that slept in between waited for a wake-up at each one.
Polling 2 ms instead of 20 µs cuts the latency of a message by a third and lifts the bandwidth of a stream of
large ones well towards NCCL's, both processes on one GPU and on two (``benchmarks/transport.py --one-gpu`` and
``--gpu``; the figures: docs/evaluation/throughput.md).

The price is a core polling for 2 ms after each message, which GPU hosts have and CPU-only machines may not:
host-only transports keep 20 µs."""

UCX_DEFAULTS = {
    # Peer error handling (needed to raise PeerLost instead of hanging) makes UCX drop shared memory unless the
    # transport says it supports it, and POSIX shared memory does when asked: its segments are files that stay
    # mapped after the peer dies. Without this, ranks on one host would talk over TCP loopback. (CMA's zero-copy
    # rendezvous stays off under error handling unless UCX_CMA_MEMORY_INVALIDATE=y; in ``benchmarks/transport.py``
    # on CPUs POSIX's pipelined copy-in/copy-out was the faster of the two.)
    "POSIX_ERROR_HANDLING": "y",
}
"""UCX settings this transport changes (a ``UCX_*`` environment variable or ``ucx_config`` entry wins)."""


# The marking of a deferred device message and device mode's flag (native/src/ucx_channel.h, ucxwire).
_NO_CONTEXT = 1  # device mode flag: leave the progress thread's CUDA context alone
_HOST, _CUDA = 0, 1  # ucs_memory_type_t
KIND_PULL = 0x4C4C5550
"""The kind word of a message the engine kept for a pull into device memory (its trailer: token, length)."""
_TRAILER = struct.Struct("<QQ")
_WORDS = struct.Struct(f"<{hdr.HEADER_WORDS}q")
_AM_FRAME_BYTES = 32  # ucxwire::AmFrame, in front of the Python header in the AM header


def ucx_cuda_modules() -> list[str]:
    """UCX's CUDA transport modules (``libuct_cuda``) beside the ``libucp`` this transport would load (in its
    ``ucx/`` module folder, as the ``libucx-cu*`` wheels ship them), found without loading UCX."""
    path = find_libucp()
    if path is None:
        return []
    if os.path.isabs(path):
        folders = [os.path.join(os.path.dirname(path), "ucx")]
    else:  # a system UCX's soname: its modules are in the library folder's ucx/
        folders = [
            f"{root}/ucx"
            for root in (
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu",
                "/usr/lib64",
                "/usr/lib",
                "/usr/local/lib",
            )
        ]
    return sorted(hit for folder in folders for hit in glob.glob(os.path.join(folder, "libuct_cuda.so*")))


def _cuda_devices() -> tuple[str, ...]:
    """``("cuda",)`` where CUDA tensors can go over UCX here: torch built with CUDA, UCX with its CUDA modules
    (neither loaded nor initialised to find out), and ``LMT_UCX_CUDA`` not ``0``."""
    if os.environ.get("LMT_UCX_CUDA", "1") == "0" or torch.version.cuda is None:
        return ()
    try:
        return ("cuda",) if ucx_cuda_modules() else ()
    except Exception:  # noqa: BLE001  (a broken libucx install: the CPU path reports it when used)
        return ()


def load_ucx() -> str:
    """Load UCX into this process once (the wheel's loader first: it honours RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY)
    and return its version; :class:`MegatronConfigError` naming the extra where there is none."""
    candidates = []
    try:
        import libucx

        loaded = [lib for lib in libucx.load_library() if lib is not None]
        candidates += [lib._name for lib in loaded if os.path.basename(lib._name).startswith("libucp.")]
    except ImportError:
        pass
    except OSError as exc:  # the wheel is there but its libraries do not load (wrong platform, say)
        candidates.append(f"<libucx: {exc}>")
    system = find_libucp()
    if system is not None:
        candidates.append(system)
    errors = []
    for path in candidates:
        if path.startswith("<"):
            errors.append(path)
            continue
        try:
            return _native.ucx_load(path)
        except TransportError as exc:
            errors.append(str(exc))
    raise MegatronConfigError(
        f"transport 'ucx' needs the UCX libraries: {EXTRA} (or a system UCX >= 1.18 with libucp.so.0 on the "
        f"library path). Tried: {'; '.join(errors)}"
    )


class UcxTransport(NativeTransport):
    """UCX active messages between ranks (one UCP worker and progress thread per transport, C++).

    ``ucx_config``: UCX settings for this transport's context, as ``{"TLS": "tcp"}`` or ``{"UCX_TLS": "tcp"}``
    (an environment variable of the same name wins). ``keepalive_interval``: seconds between UCX's liveness
    checks of each peer (how soon a killed peer is noticed where no transport reports it). ``spin_seconds``: how
    long the progress thread polls after an event before sleeping; unset, ``SPIN_SECONDS`` for the device (see
    there). ``close_timeout``: how long ``close`` waits for its goodbyes to be flushed. ``pull_ahead``: how many
    deferred device messages a take may start receiving before they are asked for (0: one pull at a time).

    With a CUDA ``device`` (see the module docstring): received tensors land on that device; CUDA tensors on it
    are sent from GPU memory through UCX once their producers have finished.
    """

    name = "ucx"
    devices = ("cpu", *_cuda_devices())

    def __init__(
        self,
        *,
        ucx_config: Optional[Mapping[str, str]] = None,
        keepalive_interval: float = 1.0,
        spin_seconds: Optional[float] = None,
        close_timeout: float = 5.0,
        pull_ahead: int = 8,
        **kwargs: Any,
    ) -> None:
        self._poster: Optional[Poster] = None
        self._alloc_stream: Any = None
        self._direct: Optional[torch.device] = None  # tensors on this device are sent from their own memory
        self._memory_type = _CUDA
        self.pulls = 0  # messages received straight into device memory (for tests and benchmarks)
        self.pulled_ahead = 0  # ... of them, those whose pull started before they were asked for
        self._orphans: list[torch.Tensor] = []
        """Destinations of pulls that failed or timed out: UCX may still write into them, so they live until close."""
        self._ahead: dict[tuple[int, int], deque[tuple[torch.Tensor, Any, int]]] = {}
        """Per ``(peer, tag)``, in FIFO order: messages taken from the mailbox early, so the pulls of deferred ones
        run at once, side by side (tensor, its pull or None when it is complete already, length). No key holds an
        empty queue."""
        self._ahead_count = 0  # pulls in _ahead (landed or not): the pull_ahead limit
        self._ahead_bytes = 0  # ... their bytes: the PREFETCH_BYTES limit
        self.cuda_direct = False
        """Whether CUDA tensors on ``device`` are sent from GPU memory (else staged through the host)."""
        super().__init__(**kwargs)
        if spin_seconds is None:
            spin_seconds = SPIN_SECONDS[self.device.type]
        if isinstance(pull_ahead, bool) or not isinstance(pull_ahead, int) or pull_ahead < 0:
            raise MegatronConfigError(
                f"transport 'ucx': pull_ahead={pull_ahead!r} must be an int >= 0 (messages; 0 pulls one at a time)."
            )
        self.pull_ahead = pull_ahead
        if keepalive_interval <= 0 or spin_seconds < 0 or close_timeout <= 0:
            raise MegatronConfigError(
                f"transport 'ucx': keepalive_interval={keepalive_interval} and close_timeout={close_timeout} must be "
                f"> 0 and spin_seconds={spin_seconds} >= 0 (seconds)."
            )
        settings = {name: (value, False) for name, value in UCX_DEFAULTS.items()}
        settings["KEEPALIVE_INTERVAL"] = (f"{float(keepalive_interval)}s", False)
        if is_loopback(default_ifaddr()):  # every rank on this host: no listening socket beyond loopback
            settings["NET_DEVICES"] = (loopback_interface(), False)
        for key, value in (ucx_config or {}).items():
            if not isinstance(key, str) or not isinstance(value, (str, int, float)):
                raise MegatronConfigError(
                    f"transport 'ucx': ucx_config entry {key!r}: {value!r} must map a UCX setting name to a value, "
                    'e.g. {"TLS": "tcp"}.'
                )
            settings[key.upper().removeprefix("UCX_")] = (str(value), True)
        self.ucx_version = load_ucx()
        try:
            self._engine = _native.UcxEngine(
                self.label,
                self.rank,
                self.world_size,
                self.pool_bytes,
                float(spin_seconds),
                float(close_timeout),
                [(name, value, required) for name, (value, required) in sorted(settings.items())],
            )
        except ValueError as exc:  # a UCX setting UCX refused (unknown name or bad value)
            raise MegatronConfigError(f"{exc} (see `ucx_info -c` for UCX's settings)") from None
        if self.device.type == "cuda":
            try:
                self._setup_cuda()
            except BaseException:
                self.close()
                raise

    def _setup_cuda(self) -> None:
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        index = self.device.index
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # torch's primary context on this device exists from here on
            self._alloc_stream = torch.cuda.Stream(self.device)
        # The progress thread goes current on that context, and rendezvous device messages wait for a pull.
        self._device_mode(index, 0)
        need = _AM_FRAME_BYTES + hdr.HEADER_BYTES
        self.cuda_direct = self._engine.max_am_header >= need
        if self.cuda_direct:
            self._direct = self.device
        else:
            warnings.warn(
                f"{self.label}: UCX's largest active-message header here is {self._engine.max_am_header} bytes (< "
                f"{need}): CUDA tensors are staged through host memory.",
                RuntimeWarning,
                stacklevel=3,
            )
        self._poster = Poster(self.label, self.device)

    def _device_mode(self, index: int, flags: int) -> None:
        op = self._engine.device_mode(index, flags)
        try:
            if not op.wait(self.timeout):
                raise TransportTimeout(
                    f"{self.label}: the progress thread did not enter device mode in {self.timeout:.1f} s"
                )
        except TransportTimeout:
            raise
        except TransportError as exc:
            warnings.warn(f"{exc}; UCX may still find the device's context itself.", RuntimeWarning, stacklevel=4)

    def _emulate_device_path(self) -> None:
        """Tests on machines without GPUs: drive the device path (flagged sends, deferred rendezvous messages
        pulled into tensors allocated here) with host memory, on a CPU transport. Call before ``connect``."""
        assert self.device.type == "cpu" and self._poster is None
        self._device_mode(0, _NO_CONTEXT)
        self._memory_type = _HOST
        self._direct = self.device
        self.cuda_direct = True
        self._poster = Poster(self.label, self.device)

    def transports_to(self, peer: int) -> list[str]:
        """What UCX chose for the endpoint to ``peer``: ``"transport/device"`` per lane, e.g. ``["posix/memory"]``
        on one host, ``["tcp/eth0"]`` between hosts (empty where libucp cannot tell)."""
        self._check_peer(peer)
        return list(self._engine.transports(peer, self.timeout))

    def _connect(self, peers: list[int]) -> None:
        prefixes = {}
        for peer in peers:
            prefixes[peer] = prefix = self._pair_prefix(peer)
            self._publish(prefix, {"address": self._engine.address.hex(), "node": node_identity(), "pid": os.getpid()})
        for peer in peers:
            info = self._fetch(prefixes[peer], peer)
            pid = int(info["pid"]) if info["node"] == node_identity() else -1  # same host: watch its pid too
            self._engine.connect_peer(peer, bytes.fromhex(info["address"]), pid, self.timeout)
        for peer in peers:
            if not self._engine.wait_connected(peer, self.timeout):
                raise TransportTimeout(
                    f"{self.label}: no greeting from rank {peer} within {self.timeout:.1f} s (call connect([{self.rank}]) "
                    f"on rank {peer} too; can UCX reach it? check UCX_TLS / UCX_NET_DEVICES)."
                )

    # -- CUDA tensors (see the module docstring) ------------------------------------------------------------

    def _isend(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> SendHandle:
        if tensor.is_cuda and tensor.device != self._direct:
            tensor = tensor.cpu()  # staged through the host: a CPU transport, another device, or no direct path
        if self._poster is None:
            return super()._isend(peer, tag, tensor, step)
        header = hdr.pack(hdr.encode(tag, tensor))
        nbytes = tensor.numel() * tensor.element_size()
        handle = QueuedSendHandle(peer, tag, nbytes, step, tensor)
        engine = self._engine
        address = tensor.data_ptr() if nbytes else 0
        event = None
        if nbytes and tensor.device == self._direct:
            if tensor.is_cuda:  # handed to UCX once the tensor's producers (and the contiguous copy) have run
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            memory_type = self._memory_type

            def post() -> Any:
                return engine.isend_device(peer, tag, header, address, nbytes, memory_type)
        else:

            def post() -> Any:
                return engine.isend(peer, tag, header, address, nbytes)

        self._poster.submit(handle, event, post)
        return handle

    def isend_bytes(self, peer: int, tag: int, data: bytes) -> SendHandle:
        if self._poster is None or not self._poster.pending():
            return super().isend_bytes(peer, tag, data)
        self._check_peer(peer)
        self._check_tag(tag)
        from lightning_megatron.transport.native import encode_bytes_message

        message = encode_bytes_message(tag, data)
        handle = QueuedSendHandle(peer, tag, len(data), self._step, None)
        self._poster.submit(handle, None, lambda: self._engine.isend(peer, tag, message, 0, 0))
        return handle

    # -- receiving ------------------------------------------------------------------------------------------------
    # A deferred device message is received when Python takes it. One at a time, each take would wait for its own
    # transfer, and a stream of large messages would move at the speed of one pull after another. So a take also
    # takes the messages already waiting behind it on the same (peer, tag), then the deferred messages from the
    # same peer that head the queues of other tags (oldest first: pipelines and the benchmark's stream give every
    # message its own tag), up to ``pull_ahead`` messages and PREFETCH_BYTES pulled and not yet taken, starts their
    # pulls, and keeps them (``_ahead``) in order for the next takes of each key.

    PREFETCH_BYTES = 512 << 20

    def _is_deferred(self, header: bytes) -> bool:
        return len(header) == hdr.HEADER_BYTES + _TRAILER.size and hdr.kind_of(header) == KIND_PULL

    def _decode(self, peer: int, tag: int, header: bytes, buf: Any) -> torch.Tensor:
        if not self._is_deferred(header):
            tensor = super()._decode(peer, tag, header, buf)
            return tensor if self.device.type == "cpu" else tensor.to(self.device)
        out, op, length = self._start_pull(peer, tag, header)
        self._take_ahead(peer, tag)
        return self._finish_pull(peer, tag, out, op, length, self.timeout)

    def _take_ahead(self, peer: int, tag: int) -> None:
        """Take what already waits behind a deferred message on ``(peer, tag)``, then deferred messages from
        ``peer`` on other tags, starting the pulls, while fewer than ``pull_ahead`` messages / PREFETCH_BYTES pulled
        messages (landed or not) wait in ``_ahead`` on any key: the GPU memory taken before it is asked for.

        The totals are kept as messages come and go (``_ahead_count``, ``_ahead_bytes``) and a key whose queue is
        empty is removed: pipelines tag every message anew, and a scan of every key ever seen made each take
        slower as a run went on (in the transport benchmark's sweep, a fraction of NCCL's bandwidth with the scan,
        close to it without)."""
        while self._ahead_count < self.pull_ahead and self._ahead_bytes < self.PREFETCH_BYTES:
            msg = self._engine.take(peer, tag)
            if msg is None:
                break
            header, buf = msg
            if self._is_deferred(header):
                self._keep_ahead(peer, tag, self._start_pull(peer, tag, header))
            else:
                self._ahead.setdefault((peer, tag), deque()).append((self._decode(peer, tag, header, buf), None, 0))
        while self._ahead_count < self.pull_ahead and self._ahead_bytes < self.PREFETCH_BYTES:
            taken = self._engine.take_deferred(peer, 1)
            if not taken:
                return
            other, header = taken[0]
            self._keep_ahead(peer, other, self._start_pull(peer, other, header))

    def _keep_ahead(self, peer: int, tag: int, pull: tuple[torch.Tensor, Any, int]) -> None:
        """File a pull started before its message was asked for."""
        self._ahead.setdefault((peer, tag), deque()).append(pull)
        self._ahead_count += 1
        self._ahead_bytes += pull[2]
        self.pulled_ahead += 1

    def _next_ahead(self, peer: int, tag: int, timeout: Optional[float]) -> Optional[torch.Tensor]:
        """The oldest message taken ahead on ``(peer, tag)``: at once (``timeout=None``: only if its data is
        there), else after waiting up to ``timeout``; None if there is none (or, polling, not there yet)."""
        ahead = self._ahead.get((peer, tag))
        if not ahead:
            return None
        out, op, length = ahead[0]
        if op is not None and timeout is None and not op.done():
            return None
        ahead.popleft()
        if not ahead:
            del self._ahead[(peer, tag)]
        if op is None:
            return out
        self._ahead_count -= 1
        self._ahead_bytes -= length
        self._take_ahead(peer, tag)  # keep the pipeline full
        return self._finish_pull(peer, tag, out, op, length, self.timeout if timeout is None else timeout)

    def _poll(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        if self._ahead.get((peer, tag)):
            return self._next_ahead(peer, tag, None)
        return super()._poll(peer, tag)

    def _recv(self, peer: int, tag: int, timeout: float) -> Optional[torch.Tensor]:
        if self._ahead.get((peer, tag)):
            return self._next_ahead(peer, tag, timeout)
        return super()._recv(peer, tag, timeout)

    def _poll_any(self, keys: list[tuple[int, int]]) -> Optional[tuple[int, torch.Tensor]]:
        waiting = False
        for index, (peer, tag) in enumerate(keys):
            if self._ahead.get((peer, tag)):
                waiting = True
                tensor = self._next_ahead(peer, tag, None)
                if tensor is not None:
                    return index, tensor
        if not waiting:
            return super()._poll_any(keys)
        # keys with messages taken ahead get later ones only after those: ask the mailbox for the others
        rest = [(i, key) for i, key in enumerate(keys) if not self._ahead.get(key)]
        if not rest:
            return None
        got = super()._poll_any([key for _, key in rest])
        return None if got is None else (rest[got[0]][0], got[1])

    def _wait_any(self, keys: list[tuple[int, int]], timeout: float) -> Optional[tuple[int, torch.Tensor]]:
        for index, (peer, tag) in enumerate(keys):
            if self._ahead.get((peer, tag)):  # a message is there (its data may still be landing): take it
                tensor = self._next_ahead(peer, tag, timeout)
                return None if tensor is None else (index, tensor)
        return super()._wait_any(keys, timeout)

    def poll_bytes(self, peer: int, tag: int) -> Optional[bytes]:
        if self._ahead.get((peer, tag)):
            raise TransportError(self._mixed(peer, tag))
        return super().poll_bytes(peer, tag)

    def recv_bytes(self, peer: int, tag: int, timeout: Optional[float] = None) -> bytes:
        if self._ahead.get((peer, tag)):
            raise TransportError(self._mixed(peer, tag))
        return super().recv_bytes(peer, tag, timeout)

    def _mixed(self, peer: int, tag: int) -> str:
        return (
            f"{self.label}: bytes asked for on tag {tag} from rank {peer}, where device tensors already taken wait to "
            "be received; use one tag for tensors and another for bytes."
        )

    def _start_pull(self, peer: int, tag: int, header: bytes) -> tuple[torch.Tensor, Any, int]:
        """Allocate the deferred message's tensor on this transport's device and start receiving into it."""
        if self._direct is None:
            raise TransportError(f"{self.label}: a deferred message from rank {peer} (tag {tag}) on a CPU transport")
        words = list(_WORDS.unpack(header[: hdr.HEADER_BYTES]))
        words[1] = hdr.KIND_DATA
        try:
            h = hdr.decode(words)
        except ValueError as e:
            raise TransportError(f"{self.label}: bad message from rank {peer} with tag {tag}: {e}") from e
        token, length = _TRAILER.unpack_from(header, hdr.HEADER_BYTES)
        if length != h.nbytes:
            raise TransportError(
                f"{self.label}: message from rank {peer} with tag {tag} carries {length} bytes, its header says {h.nbytes}"
            )
        if self._memory_type == _CUDA:
            with torch.cuda.device(self.device):
                with torch.cuda.stream(self._alloc_stream):  # a stream that runs nothing: the block is idle
                    out = torch.empty(h.shape, dtype=h.dtype, device=self.device)
                out.record_stream(torch.cuda.current_stream(self.device))  # reused only after the caller's work
        else:
            out = torch.empty(h.shape, dtype=h.dtype)
        try:
            op = self._engine.pull(peer, token, out.data_ptr(), length, self._memory_type)
        except BaseException:
            self._orphans.append(out)
            raise
        return out, op, length

    def _finish_pull(
        self, peer: int, tag: int, out: torch.Tensor, op: Any, length: int, timeout: float
    ) -> torch.Tensor:
        """Wait for a pull's data to land (up to ``timeout``) and hand the tensor over."""
        try:
            if not op.wait(timeout):
                raise TransportTimeout(
                    f"{self.label}: the data of the message from rank {peer} with tag {tag} ({length} bytes) did not "
                    f"land in GPU memory within {timeout:.1f} s."
                )
        except BaseException:  # a timeout, a lost peer, Ctrl-C: UCX may still write into `out`
            self._orphans.append(out)
            raise
        self.pulls += 1
        return out

    def _abandon(self) -> None:
        self._poster = None  # its thread is the parent's
        super()._abandon()

    def _close(self) -> None:
        if self._poster is not None:
            self._poster.close()
        super()._close()
        self._orphans = []  # the engine is closed: UCX writes nothing any more
        self._ahead = {}
        self._ahead_count = self._ahead_bytes = 0
