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
``transports_to(peer)`` says what it chose). This transport changes two UCX defaults, each overridden by the
``UCX_*`` variable of the same name or a ``ucx_config`` entry: ``POSIX_ERROR_HANDLING=y`` (see
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
  transport's device, as with ``shm``.

Tested so far: ``tests/test_transport_ucx_gpu.py`` passed once on 2 H200s (NVLink) with the ``libucx-cu13``
1.22.0 wheel, torch 2.11+cu130, Python 3.12: UCX chose ``["posix/memory", "cuda_ipc/cuda"]``, a 64 MiB tensor
made the round trip at ~122 GB/s, and with the event wait removed its still-being-computed case got stale data
(so the case does catch it). The streaming benchmark (``benchmarks/transport.py --gpu --quick``) gave ucx 78
GB/s at 16 MiB against shm's 175 GB/s: each deferred message is received when taken, one at a time. The
mechanics of the deferred receive are also checked on CPUs with host memory standing in for GPU memory
(``tests/test_transport_ucx.py::test_device_path_with_host_memory``). Not tested: other UCX versions, GPUs
without peer access or on other hosts (UCX would stage through the host or use its network transports),
torch's ``expandable_segments`` allocator, a peer dying mid-pull.
"""

from __future__ import annotations

import glob
import os
import struct
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport import find_libucp
from lightning_megatron.transport import header as hdr
from lightning_megatron.transport.base import SendHandle, TransportError, TransportTimeout
from lightning_megatron.transport.native import NativeTransport, _native, node_identity

__all__ = ["EXTRA", "UcxTransport", "load_ucx", "ucx_cuda_modules"]

EXTRA = "pip install 'lightning-megatron[ucx]'"

UCX_DEFAULTS = {
    # Peer error handling (needed to raise PeerLost instead of hanging) makes UCX drop shared memory unless the
    # transport says it supports it, and POSIX shared memory does when asked: its segments are files that stay
    # mapped after the peer dies. Without this, ranks on one host would talk over TCP loopback. (CMA's zero-copy
    # rendezvous stays off under error handling unless UCX_CMA_MEMORY_INVALIDATE=y; on the 2-core machine of
    # benchmarks/results/transport_cpu_ucx.json POSIX's pipelined copy-in/copy-out was the faster of the two.)
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


class _QueuedSendHandle(SendHandle):
    """A send that may wait in the transport's queue (for its CUDA data to be computed) before UCX gets it."""

    __slots__ = ("_error", "_op", "_posted", "_tensor")

    def __init__(self, peer: int, tag: int, nbytes: int, step: int, tensor: Optional[torch.Tensor]) -> None:
        super().__init__(peer, tag, nbytes, step)
        self._tensor = tensor
        self._op: Any = None
        self._error: Optional[BaseException] = None
        self._posted = threading.Event()

    def done(self) -> bool:
        if self._error is not None:
            raise self._error
        op = self._op
        if op is None or not op.done():  # op.done() raises PeerLost / TransportError if the send failed
            return False
        self._tensor = None
        return True

    def wait(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._posted.wait(timeout):
            raise TransportTimeout(
                f"send to rank {self.peer} with tag {self.tag} ({self.nbytes} bytes) not handed to UCX after "
                f"{timeout:.1f} s: the kernels computing the tensor on its GPU (or the sends before it) have not finished."
            )
        if self._error is not None:
            raise self._error
        left = 1e9 if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._op.wait(left):
            raise TransportTimeout(
                f"send to rank {self.peer} with tag {self.tag} ({self.nbytes} bytes) not complete after "
                f"{timeout:.1f} s: is rank {self.peer} receiving?"
            )
        self._tensor = None


class _Poster:
    """Hands sends to the engine in order, each once its CUDA event (if any) has completed: inline when nothing
    waits before it and its data is ready, else through one thread that waits on the events (GIL released)."""

    def __init__(self, label: str, device: torch.device) -> None:
        self.label, self.device = label, device
        self._items: deque[tuple[_QueuedSendHandle, Optional[torch.cuda.Event], Callable[[], Any]]] = deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.queued = 0  # sends that waited for their data (for tests and benchmarks)

    def submit(self, handle: _QueuedSendHandle, event: Optional[torch.cuda.Event], post: Callable[[], Any]) -> None:
        with self._cv:
            if self._closed:
                raise TransportError(f"{self.label} is closed.")
            if not self._items and (event is None or event.query()):
                self._post(handle, post)  # under the lock: nothing can overtake it
                return
            self._items.append((handle, event, post))
            self.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmt-ucx-post", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    @staticmethod
    def _post(handle: _QueuedSendHandle, post: Callable[[], Any]) -> None:
        try:
            handle._op = post()
        except BaseException as exc:  # noqa: BLE001  (reported by the handle)
            handle._error = exc if isinstance(exc, TransportError) else TransportError(str(exc))
            handle._tensor = None
        handle._posted.set()

    def _run(self) -> None:
        try:
            torch.cuda.set_device(self.device)  # event waits must not make a context on another GPU
        except Exception:  # noqa: BLE001
            pass
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if not self._items:
                    return
                handle, event, post = self._items[0]  # stays first (later sends queue behind it) until posted
            error = None
            try:
                if event is not None:
                    event.synchronize()
            except Exception as exc:  # noqa: BLE001  (a CUDA error: the tensor's producers failed)
                error = TransportError(
                    f"{self.label}: waiting for the data of the send with tag {handle.tag} to rank {handle.peer} "
                    f"on {self.device} failed: {exc}"
                )
            with self._cv:
                if self._items and self._items[0][0] is handle:
                    self._items.popleft()
                    if error is None and self._closed:
                        error = TransportError(f"{self.label} was closed before this message was sent")
                    if error is not None:
                        handle._error, handle._tensor = error, None
                        handle._posted.set()
                    else:
                        self._post(handle, post)
                self._cv.notify_all()

    def pending(self) -> bool:
        with self._cv:
            return bool(self._items)

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            while len(self._items) > 1:  # the first may be in the thread's hands; it fails itself
                handle, _, _ = self._items.pop()
                handle._error = TransportError(f"{self.label} was closed before this message was sent")
                handle._tensor = None
                handle._posted.set()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)


class UcxTransport(NativeTransport):
    """UCX active messages between ranks (one UCP worker and progress thread per transport, C++).

    ``ucx_config``: UCX settings for this transport's context, as ``{"TLS": "tcp"}`` or ``{"UCX_TLS": "tcp"}``
    (an environment variable of the same name wins). ``keepalive_interval``: seconds between UCX's liveness
    checks of each peer (how soon a killed peer is noticed where no transport reports it). ``spin_seconds``: how
    long the progress thread polls after an event before sleeping. ``close_timeout``: how long ``close`` waits
    for its goodbyes to be flushed.

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
        spin_seconds: float = 20e-6,
        close_timeout: float = 5.0,
        **kwargs: Any,
    ) -> None:
        self._poster: Optional[_Poster] = None
        self._alloc_stream: Any = None
        self._direct: Optional[torch.device] = None  # tensors on this device are sent from their own memory
        self._memory_type = _CUDA
        self.pulls = 0  # messages received straight into device memory (for tests and benchmarks)
        self._orphans: list[torch.Tensor] = []
        """Destinations of pulls that failed or timed out: UCX may still write into them, so they live until close."""
        self.cuda_direct = False
        """Whether CUDA tensors on ``device`` are sent from GPU memory (else staged through the host)."""
        super().__init__(**kwargs)
        if keepalive_interval <= 0 or spin_seconds < 0 or close_timeout <= 0:
            raise MegatronConfigError(
                f"transport 'ucx': keepalive_interval={keepalive_interval} and close_timeout={close_timeout} must be "
                f"> 0 and spin_seconds={spin_seconds} >= 0 (seconds)."
            )
        settings = {name: (value, False) for name, value in UCX_DEFAULTS.items()}
        settings["KEEPALIVE_INTERVAL"] = (f"{float(keepalive_interval)}s", False)
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
        self._poster = _Poster(self.label, self.device)

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
        self._poster = _Poster(self.label, self.device)

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
        handle = _QueuedSendHandle(peer, tag, nbytes, step, tensor)
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
        handle = _QueuedSendHandle(peer, tag, len(data), self._step, None)
        self._poster.submit(handle, None, lambda: self._engine.isend(peer, tag, message, 0, 0))
        return handle

    def _decode(self, peer: int, tag: int, header: bytes, buf: Any) -> torch.Tensor:
        if len(header) == hdr.HEADER_BYTES + _TRAILER.size and hdr.kind_of(header) == KIND_PULL:
            return self._pull(peer, tag, header)
        tensor = super()._decode(peer, tag, header, buf)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _pull(self, peer: int, tag: int, header: bytes) -> torch.Tensor:
        """Receive a deferred device message straight into a fresh tensor on this transport's device."""
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
            if not op.wait(self.timeout):
                raise TransportTimeout(
                    f"{self.label}: the data of the message from rank {peer} with tag {tag} ({length} bytes) did not "
                    f"land in GPU memory within {self.timeout:.1f} s."
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
