"""CUDA tensors between GPUs of one node with no trip through the host: CUDA IPC staging slots.

The ``shm`` transport carries the *descriptors*; the bytes move GPU to GPU over NVLink/PCIe:

* each sender keeps, per peer, a few staging slots in its own GPU memory (``cudaMalloc``; exported once with
  ``cudaIpcGetMemHandle``, re-exported only when a slot grows) and one interprocess CUDA event per slot;
* ``isend`` copies the tensor into a free slot on a side stream (device-local, a fraction of the link's time),
  records the slot's event and sends a descriptor (slot, generation, memory and event handles, dtype, shape) on
  the message's own tag, so tag matching is the CPU transport's;
* the receiver opens the slot once per generation (``cudaIpcOpenMemHandle``, cached), makes its current stream
  wait for the sender's event and copies the bytes into a fresh tensor with ``cudaMemcpyAsync`` on that stream
  (the caller's later work on the stream is ordered after it, as with any CUDA op), records its own
  interprocess event and acknowledges the slot on a reserved tag;
* the sender reuses a slot only after that acknowledgement, and its copy-in waits for the receiver's event;
* the descriptor travels as soon as the copy-in is *queued*, while the sender's GPU may still be computing the
  tensor. :meth:`CudaIpcChannel.ready` queries the slot's event (the copy-in, which runs after the tensor's
  producers, has completed), and the ``shm`` transport's ``poll``/``poll_any``/``wait_any`` report a message
  only once it is ready: a dynamic schedule never picks a task whose input would stall its GPU. A slot's event is
  recorded again only after the receiver acknowledged the slot, so while a descriptor waits, its event is its own.

A send never blocks and never waits for the receiver: the receiver may take messages in any tag order, so a
slot is freed only when the receiver gets round to its message. When every slot to a peer is in flight a new
one is added, up to ``max_slots``; beyond that the tensor is staged through the host (the rings buffer any
number of messages), slower but never stuck. ``done()`` means the source tensor has been copied into the slot. The CUDA runtime is the one torch loaded (found in the process's mappings); where it
cannot be found, tensors are staged through the host instead (``CudaIpcChannel.available`` is False).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_megatron.transport import header as hdr
from lightning_megatron.transport.base import SendHandle, TransportError

__all__ = ["CudaIpcChannel", "cuda_runtime"]

ACK_TAG = 2**62  # reserved: user tags stay below 2**62 (``base.MAX_TAG``)
_MIN_SLOT = 1 << 20
_IPC_HANDLE = 64  # bytes of a cudaIpcMemHandle_t / cudaIpcEventHandle_t
_DESCRIPTOR = struct.Struct(f"<qqqq{_IPC_HANDLE}s{_IPC_HANDLE}s")  # device, slot, generation, nbytes, mem, event
_ACK = struct.Struct(f"<qq{_IPC_HANDLE}s")  # slot, generation, event
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the unified address space
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _HandleStruct(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE)]


class _Runtime:
    """The few CUDA runtime calls torch does not expose, bound with ctypes to torch's own ``libcudart``."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.path = path
        self._lib = lib
        for name in ("cudaMalloc", "cudaFree", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle"):
            getattr(lib, name).restype = ctypes.c_int
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _HandleStruct, ctypes.c_uint]

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise TransportError(f"CUDA IPC: {what} failed: {self._lib.cudaGetErrorString(code).decode()} ({code})")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), f"cudaMalloc({nbytes})")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self._lib.cudaFree(ctypes.c_void_p(ptr))

    def export(self, ptr: int) -> bytes:
        handle = ctypes.create_string_buffer(_IPC_HANDLE)
        self._check(self._lib.cudaIpcGetMemHandle(handle, ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return handle.raw

    def open(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        # the handle is a 64-byte struct passed by value
        code = self._lib.cudaIpcOpenMemHandle(
            ctypes.byref(ptr), _HandleStruct.from_buffer_copy(handle), _LAZY_PEER_ACCESS
        )
        self._check(code, "cudaIpcOpenMemHandle")
        return int(ptr.value)

    def close(self, ptr: int) -> None:
        self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        code = self._lib.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, ctypes.c_void_p(stream))
        self._check(code, "cudaMemcpyAsync")


_RUNTIME: Any = False  # False: not looked up yet; None: not found


def cuda_runtime() -> Optional[_Runtime]:
    """torch's CUDA runtime library, found among the process's mapped files (None if torch links it statically)."""
    global _RUNTIME
    if _RUNTIME is False:
        _RUNTIME = None
        if torch.cuda.is_available():
            torch.cuda.init()
            try:
                with open("/proc/self/maps") as maps:
                    paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
            except OSError:
                paths = set()
            for path in sorted(paths):
                try:
                    _RUNTIME = _Runtime(path)
                    break
                except (OSError, AttributeError):
                    continue
    return _RUNTIME


@dataclass
class _Slot:
    index: int
    event: Any  # interprocess torch.cuda.Event the sender records after its copy-in
    ptr: int = 0
    capacity: int = 0
    generation: int = 0
    handle: bytes = b""
    busy: bool = False  # sent, not yet acknowledged
    released: Any = None  # the receiver's interprocess event (opened from its acknowledgement)


@dataclass
class _Incoming:
    ptr: int
    generation: int
    event: Any  # the sender's event, opened
    released: Any  # our own interprocess event, recorded after the copy-out


@dataclass
class _Peer:
    slots: list[_Slot] = field(default_factory=list)


class CudaSendHandle(SendHandle):
    __slots__ = ("_channel", "_copied", "_tensor")

    def __init__(self, channel: CudaIpcChannel, peer: int, tag: int, nbytes: int, step: int, tensor: torch.Tensor):
        super().__init__(peer, tag, nbytes, step)
        self._channel, self._tensor, self._copied = channel, tensor, None

    def done(self) -> bool:
        if self._copied.query():
            self._tensor = None
            return True
        return False


class CudaIpcChannel:
    """GPU-to-GPU messages for one transport (see the module docstring); ``transport`` is an ``shm`` transport."""

    def __init__(self, transport: Any, device: torch.device, max_slots: int = 16) -> None:
        self.transport = transport
        self.device = device
        self.runtime = cuda_runtime()
        self.available = self.runtime is not None
        self.max_slots = max_slots
        self.host_staged = 0  # sends that found every slot in flight (see the module docstring)
        self._peers: dict[int, _Peer] = {}
        self._incoming: dict[tuple[int, int], _Incoming] = {}
        self._side = torch.cuda.Stream(device) if self.available else None

    # -- sending ------------------------------------------------------------------------------------------

    def send(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> Optional[SendHandle]:
        """Post ``tensor`` to ``peer``; ``None`` when every slot is in flight (the caller stages it via the host)."""
        if tensor.device != self.device:
            raise TransportError(
                f"{self.transport.label}: a {tensor.device} tensor (tag {tag} to rank {peer}) on a transport of "
                f"{self.device}: move it first, or create the transport on that device."
            )
        state = self._peers.setdefault(peer, _Peer())
        self._collect_acks(peer, state)
        slot = next((s for s in state.slots if not s.busy), None)
        if slot is None:
            if len(state.slots) >= self.max_slots:
                self.host_staged += 1
                return None
            with torch.cuda.device(self.device):
                slot = _Slot(len(state.slots), torch.cuda.Event(interprocess=True))
            state.slots.append(slot)
        handle = CudaSendHandle(self, peer, tag, tensor.numel() * tensor.element_size(), step, tensor)
        self._dispatch(peer, slot, handle)
        return handle

    def _collect_acks(self, peer: int, state: _Peer) -> None:
        while True:
            msg = self.transport._engine.take(peer, ACK_TAG)
            if msg is None:
                return
            index, generation, event_handle = _ACK.unpack(msg[0][hdr.HEADER_BYTES :])
            slot = state.slots[index]
            if slot.released is None:
                slot.released = torch.cuda.Event.from_ipc_handle(self.device, event_handle)
            slot.busy = False

    def _dispatch(self, peer: int, slot: _Slot, handle: CudaSendHandle) -> None:
        tensor = handle._tensor
        nbytes = handle.nbytes
        rt = self.runtime
        with torch.cuda.device(self.device):
            if nbytes > slot.capacity:
                if slot.ptr:
                    if slot.released is not None:
                        slot.released.synchronize()  # the receiver's copy-out from it has run, not just been queued
                    rt.free(slot.ptr)  # the receiver re-opens by generation
                slot.capacity = max(_MIN_SLOT, 1 << (nbytes - 1).bit_length())
                slot.ptr = rt.malloc(slot.capacity)
                slot.handle = rt.export(slot.ptr)
                slot.generation += 1
            side = self._side
            side.wait_stream(torch.cuda.current_stream(self.device))  # the tensor's producers
            if slot.released is not None:
                side.wait_event(slot.released)  # the receiver's copy-out of this slot's last message
            if nbytes:
                rt.copy_async(slot.ptr, tensor.data_ptr(), nbytes, side.cuda_stream)
            tensor.record_stream(side)
            slot.event.record(side)
        slot.busy = True
        descriptor = _DESCRIPTOR.pack(
            self.device.index, slot.index, slot.generation, nbytes, slot.handle, slot.event.ipc_handle()
        )
        words = hdr.encode(handle.tag, tensor)
        words[1] = hdr.KIND_CUDA
        self.transport._engine.isend(peer, handle.tag, hdr.pack(words) + descriptor, 0, 0)
        handle._copied = slot.event

    # -- receiving ----------------------------------------------------------------------------------------

    def _incoming_for(self, peer: int, index: int, event_handle: bytes) -> _Incoming:
        incoming = self._incoming.get((peer, index))
        if incoming is None:
            with torch.cuda.device(self.device):
                # both events live as long as the slot: the sender holds on to the one it was first given
                incoming = self._incoming[(peer, index)] = _Incoming(
                    ptr=0,
                    generation=-1,
                    event=torch.cuda.Event.from_ipc_handle(self.device, event_handle),
                    released=torch.cuda.Event(interprocess=True),
                )
        return incoming

    def ready(self, peer: int, header: bytes) -> bool:
        """Whether the data of the CUDA descriptor ``header`` from ``peer`` is in its slot: the sender's copy-in
        (queued behind the tensor's producers) has completed. Never blocks; a CUDA error raises RuntimeError."""
        if self.runtime is None:
            return True  # receive() says what is wrong
        _device, index, _generation, _nbytes, _mem, event_handle = _DESCRIPTOR.unpack(header[hdr.HEADER_BYTES :])
        incoming = self._incoming_for(peer, index, event_handle)
        with torch.cuda.device(self.device):
            return bool(incoming.event.query())

    def receive(self, peer: int, header: bytes) -> torch.Tensor:
        """The tensor of a CUDA descriptor from ``peer``: copied out of the sender's slot on the current stream."""
        h = hdr.unpack(header[: hdr.HEADER_BYTES])
        _device, index, generation, nbytes, mem_handle, event_handle = _DESCRIPTOR.unpack(header[hdr.HEADER_BYTES :])
        rt = self.runtime
        if rt is None:
            raise TransportError(
                f"{self.transport.label}: a CUDA IPC message from rank {peer}, but no CUDA runtime here"
            )
        incoming = self._incoming_for(peer, index, event_handle)
        with torch.cuda.device(self.device):
            if nbytes and incoming.generation != generation:  # the sender (re)allocated the slot
                if incoming.ptr:
                    rt.close(incoming.ptr)
                incoming.ptr, incoming.generation = rt.open(mem_handle), generation
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(incoming.event)
            out = torch.empty(h.shape, dtype=h.dtype, device=self.device)
            if nbytes:
                rt.copy_async(out.data_ptr(), incoming.ptr, nbytes, stream.cuda_stream)
            incoming.released.record(stream)
        ack = hdr.pack(hdr.encode(ACK_TAG, torch.empty(0, dtype=torch.uint8))) + _ACK.pack(
            index, generation, incoming.released.ipc_handle()
        )
        self.transport._engine.isend(peer, ACK_TAG, ack, 0, 0)
        return out

    # -- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        rt = self.runtime
        if rt is None:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            for incoming in self._incoming.values():
                if incoming.ptr:
                    rt.close(incoming.ptr)
            for state in self._peers.values():
                for slot in state.slots:
                    if slot.ptr:
                        rt.free(slot.ptr)
        self._incoming.clear()
        self._peers.clear()
