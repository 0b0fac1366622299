"""The private parts of python-engineio / python-socketio that MegaScope's server uses, in one place.

``scope.server`` needs four things neither library offers publicly:

* a websocket driver with a size limit enforced while a message arrives: Engine.IO's threading driver
  (``engineio.async_drivers._websocket_wsgi.SimpleWebSocketWSGI``) is subclassed, and installed with a
  ``sleep`` that ends at ``stop()`` through the server's driver table (``eio._async``);
* how many packets a client's transport has not written yet (``manager.eio_sid_from_sid``, the Engine.IO
  socket's ``queue``), so a slow client fills the server's bounded queue and not memory;
* an answer to a packet that does not decode: python-socketio parses a Socket.IO packet (JSON, binary
  placeholders) inside Engine.IO's ``message`` handler and only logs what raises there, so the client gets
  silence. ``guard_messages`` wraps that handler (``eio.handlers["message"]``) and reports the failure, with
  the client's Socket.IO sid, to the server, which answers it; a half-received binary packet
  (``server._binary_packet``) is dropped so the connection stays usable.

Nothing is patched module-wide: every change is on one server object. Tested with python-engineio 4.15,
python-socketio 5.18 and Flask-SocketIO 5.7 (``pyproject.toml`` bounds them below the next major or minor
version that could move these names); ``tests/test_compat_engineio.py`` fails if one of them moves.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Optional

from engineio.async_drivers._websocket_wsgi import SimpleWebSocketWSGI

__all__ = ["SimpleWebSocketWSGI", "backlog", "bad_packet_reason", "guard_messages", "install_drivers"]

_log = logging.getLogger(__name__)


def install_drivers(eio: Any, **drivers: Any) -> None:
    """Replace entries of Engine.IO's driver table of this server only (``websocket``, ``sleep``, ...)."""
    unknown = sorted(set(drivers) - set(eio._async))
    if unknown:
        raise KeyError(
            f"python-engineio has no async driver entry {unknown}; see lightning_megatron/compat/engineio.py"
        )
    eio._async = {**eio._async, **drivers}


def backlog(server: Any, sid: str, namespace: str = "/") -> Optional[int]:
    """Packets queued in the Engine.IO transport of Socket.IO client ``sid`` and not yet written; None once gone."""
    eio_sid = server.manager.eio_sid_from_sid(sid, namespace)
    transport = server.eio.sockets.get(eio_sid) if eio_sid is not None else None
    if transport is None or transport.closed:
        return None
    return transport.queue.qsize()


def bad_packet_reason(error: BaseException) -> str:
    """What was wrong with a packet python-socketio could not decode, in words for the client."""
    if isinstance(error, RecursionError):
        return "the message is nested too deeply (JSON arrays and objects: at most a few hundred levels)"
    if isinstance(error, json.JSONDecodeError):
        return f"the message is not valid JSON ({error.msg} at character {error.pos})"
    if isinstance(error, ValueError) and ("digits" in str(error) or "too large" in str(error)):
        # python-engineio's JSON refuses integers of more than 100 digits, Python's of more than 4300
        return "an integer in the message has too many digits (the protocol's integers fit in 64 bits)"
    if isinstance(error, (IndexError, KeyError, TypeError)):
        return (
            "a binary placeholder does not name a received attachment, or the packet is not a Socket.IO event "
            '(send ["request", {...}] with {"_placeholder": true, "num": N} for attachment N)'
        )
    return "the message is not a Socket.IO packet this server understands"


def guard_messages(server: Any, on_bad: Callable[[Optional[str], BaseException], None], namespace: str = "/") -> None:
    """Make ``server`` (a ``socketio.Server``) call ``on_bad(sid, error)`` for a packet it cannot decode or
    dispatch, instead of logging a traceback and answering nothing. ``sid`` is the client's Socket.IO sid in
    ``namespace``, None if it has not connected there. The server's own event handlers must catch what they raise:
    anything escaping them is reported the same way."""
    eio = server.eio
    handle = eio.handlers["message"]

    def guarded(eio_sid: str, data: Any) -> Any:
        try:
            return handle(eio_sid, data)
        except Exception as error:  # noqa: BLE001  (decoding a hostile packet can raise anything)
            server._binary_packet.pop(eio_sid, None)
            sid = server.manager.sid_from_eio_sid(eio_sid, namespace)
            _log.debug("undecodable Socket.IO packet from %s: %r", eio_sid, error)
            on_bad(sid, error)
            return None

    eio.handlers["message"] = guarded
