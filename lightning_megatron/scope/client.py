"""``ScopeClient``: a small synchronous MegaScope client for scripts, notebooks, tests and benchmarks.

Contract: one websocket to a ``ScopeServer`` (Engine.IO 4 / Socket.IO 5, websocket transport, token in the
Socket.IO connect), ``send(request)`` to send a request (``v`` is added), ``next_event(timeout)`` for the next
server event in the order the server sent it, with binary arrays decoded to numpy (``protocol.decode_array``)
unless ``decode=False``. Engine.IO pings are answered while reading.

Why not ``socketio.Client``: it hands every incoming Engine.IO message to a new thread, so a burst of events
with binary attachments (a token's probes) can be reassembled out of order or fail ("Unexpected binary
attachment"). A browser's client reads its socket in order; so does this one.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any, Optional

from lightning_megatron.scope.protocol import PROTOCOL_VERSION, decode_array

__all__ = ["ScopeClient"]


class ScopeClient:
    """``ScopeClient(url)`` with the URL the server printed (``http://127.0.0.1:PORT/?token=...``)."""

    def __init__(self, url: str, *, timeout: float = 10.0, decode: bool = True) -> None:
        import websocket

        parts = urllib.parse.urlparse(url)
        token = urllib.parse.parse_qs(parts.query).get("token", [""])[0]
        self.decode = decode
        self._ws = websocket.create_connection(
            f"ws://{parts.netloc}/socket.io/?EIO=4&transport=websocket", timeout=timeout
        )
        opened = self._ws.recv()
        if not opened.startswith("0"):
            raise ConnectionError(f"not an Engine.IO server: {opened[:60]!r}")
        self._ws.send("40" + json.dumps({"token": token}))
        answer = self._receive_text()
        if not answer.startswith("0"):  # Socket.IO CONNECT (CONNECT_ERROR is "4")
            raise PermissionError(f"MegaScope refused the connection: {answer[:200]}")

    def send(self, request: dict[str, Any]) -> None:
        self._ws.send('42["request",' + json.dumps({"v": PROTOCOL_VERSION, **request}) + "]")

    def next_event(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """The next ``event`` from the server (``TimeoutError`` after ``timeout`` seconds)."""
        self._ws.settimeout(timeout)
        try:
            while True:
                packet = self._receive_text()
                kind, body = packet[0], packet[1:]
                if kind == "2":  # EVENT
                    name, event = json.loads(body)
                elif kind == "5":  # BINARY_EVENT: N attachments follow, in order
                    count, body = body.split("-", 1)
                    attachments = [self._ws.recv() for _ in range(int(count))]
                    name, event = json.loads(body)
                    event = self._fill(event, attachments)
                else:
                    continue  # acks or namespace messages this client does not use
                if name == "event":
                    return event
        except Exception as err:
            if type(err).__name__ == "WebSocketTimeoutException":
                raise TimeoutError("no MegaScope event in time") from None
            raise

    def events(self, until: tuple[str, ...] = ("finish", "error"), timeout: float = 600.0) -> Iterator[dict[str, Any]]:
        """Events up to and including the first of a type in ``until``."""
        deadline = time.monotonic() + timeout
        while True:
            event = self.next_event(max(0.01, deadline - time.monotonic()))
            yield event
            if event.get("type") in until:
                return

    def close(self) -> None:
        try:
            self._ws.send("41")
        finally:
            self._ws.close()

    def __enter__(self) -> ScopeClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- Engine.IO framing -------------------------------------------------------------------------------------
    def _receive_text(self) -> str:
        """The next Socket.IO packet (an Engine.IO message without its "4")."""
        while True:
            frame = self._ws.recv()
            if isinstance(frame, bytes):
                raise ConnectionError("a binary frame arrived outside a binary event")
            if frame == "2":  # Engine.IO ping
                self._ws.send("3")
                continue
            if frame.startswith("1"):  # Engine.IO close
                raise ConnectionError("the MegaScope server closed the connection")
            if frame.startswith("4"):
                return frame[1:]

    def _fill(self, value: Any, attachments: list[bytes]) -> Any:
        if isinstance(value, dict):
            if value.get("_placeholder"):
                return attachments[value["num"]]
            filled = {key: self._fill(item, attachments) for key, item in value.items()}
            if self.decode and isinstance(filled.get("data"), bytes) and "dtype" in filled and "shape" in filled:
                return decode_array(filled)
            return filled
        if isinstance(value, list):
            return [self._fill(item, attachments) for item in value]
        return value
