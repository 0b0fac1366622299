"""Sends of the ``ucx`` transport that wait for their CUDA data: one ordered queue per transport.

The contract: :meth:`Poster.submit` takes a send handle, the CUDA event recorded behind the tensor's producers
(or None) and a function that hands the message to the engine; the engine gets each message only once its event
has completed, in submission order (so FIFO per ``(peer, tag)`` holds), inline when nothing waits before it and
its data is ready, else from one thread that waits on the events. UCX then never reads GPU memory a kernel is
still writing. :class:`QueuedSendHandle` is the caller's handle: done once UCX is done with the source.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_megatron.transport.base import SendHandle, TransportError, TransportTimeout

__all__ = ["Poster", "QueuedSendHandle"]


class QueuedSendHandle(SendHandle):
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


class Poster:
    """Hands sends to the engine in order, each once its CUDA event (if any) has completed: inline when nothing
    waits before it and its data is ready, else through one thread that waits on the events (GIL released)."""

    def __init__(self, label: str, device: torch.device) -> None:
        self.label, self.device = label, device
        self._items: deque[tuple[QueuedSendHandle, Optional[torch.cuda.Event], Callable[[], Any]]] = deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.queued = 0  # sends that waited for their data (for tests and benchmarks)

    def submit(self, handle: QueuedSendHandle, event: Optional[torch.cuda.Event], post: Callable[[], Any]) -> None:
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
    def _post(handle: QueuedSendHandle, post: Callable[[], Any]) -> None:
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
