"""MegaScope's server: one engine, served to browsers over Socket.IO, secure by default.

Contract: ``ScopeServer(engine)`` serves an :class:`~lightning_megatron.scope.protocol.Engine` at ``url``
between ``start()`` and ``stop()`` (or inside ``with``); ``stop()`` frees the port and ends every thread
it started. Messages are those of ``scope.protocol`` (Socket.IO event ``"request"`` in, ``"event"`` out).
MegatronApp's server bound 0.0.0.0 without authentication and evaluated text from the browser; this one:

* binds 127.0.0.1 unless told otherwise (any other host logs a warning and still needs the token);
* needs a token for the page (``/?token=``: 401 without, 403 when wrong) and for every Socket.IO connection
  (``auth={"token": ...}``, refused otherwise), compared in constant time. It comes from ``LM_SCOPE_TOKEN``
  or ``secrets.token_urlsafe(32)``, never from a command-line argument (``ps`` shows those), and never
  reaches a log: request lines are logged without their query;
* defeats DNS rebinding: the Host header of every HTTP request and websocket handshake must name this
  server (127.0.0.1, localhost or [::1] with the port, the bound host, ``allowed_hosts``), and an Origin must
  be one of the served origins (not Engine.IO's default "Origin equals Host", which a rebinding page passes);
* sends ``Referrer-Policy: no-referrer``, a strict CSP, ``nosniff`` and ``X-Frame-Options: DENY`` with every
  page response; serves files only from the UI bundle folder (``scope/static``), through ``safe_join``;
* speaks websocket only, refuses a message over ``MAX_MESSAGE_BYTES`` while it arrives (the connection is
  closed, the server goes on), validates every request against the schema and answers a bad one with an
  error naming the field; a packet that does not even decode (invalid JSON, nested too deeply, an integer
  of too many digits, a bad binary placeholder) is answered with ``bad_request`` saying which; an engine's
  refusal of a value (a layer or head the model lacks) names the field too; the connection stays usable;
* calls the engine from two worker threads (generation; everything else), never from a connection's thread
  (on CPU runs, inside ``compat.cpu.cpu_thread()``). One generation runs at a time (another gets ``busy``);
  ``stop`` from any client cancels it (all hold the same token), and so does its client leaving;
* queues outgoing events in one bounded queue drained by one sender thread, which waits while a client's
  transport has more than a few packets unsent, so a slow client fills *this* queue and not memory: when it is
  full the oldest probe/attention events are dropped (never token, finish or error) and the client is sent a
  ``dropped`` event with the counts before its next event. A client that stops reading slows the others down.

The worker threads, the queue and the sender are ``scope.delivery``'s; the Engine.IO/Socket.IO internals it
needs are ``compat.engineio``'s; this module is HTTP, Socket.IO, the security above and what each request does.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import flask
import flask_socketio
import simple_websocket
from socketio.exceptions import ConnectionRefusedError
from werkzeug.serving import WSGIRequestHandler, make_server

from lightning_megatron import __version__
from lightning_megatron.compat import engineio as compat_engineio
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope.delivery import Item, Outbox, Sender, Worker
from lightning_megatron.scope.protocol import (
    BROADCAST_EVENTS,
    GENERATION_EVENTS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Engine,
    ProtocolError,
    request_id_of,
    validate_request,
)

__all__ = ["TOKEN_ENV", "ScopeServer"]

TOKEN_ENV = "LM_SCOPE_TOKEN"
PERTURBATIONS_CHANGED = "perturbations-changed"
"""The id of the ``info`` event every client gets when a client changes the perturbations."""
_log = logging.getLogger(__name__)

_FALLBACK_SCRIPT = 'history.replaceState(null, "", location.pathname);'
_SCRIPT_HASH = "sha256-" + base64.b64encode(hashlib.sha256(_FALLBACK_SCRIPT.encode()).digest()).decode()
_FALLBACK_PAGE = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>MegaScope</title>
<script>{_FALLBACK_SCRIPT}</script>
<style>body{{font-family:system-ui,sans-serif;max-width:42em;margin:3em auto;line-height:1.5}}</style>
</head><body><h1>MegaScope</h1>
<p>The server runs MegaScope protocol version {PROTOCOL_VERSION}, but the web UI bundle is not built
(no <code>lightning_megatron/scope/static/index.html</code>).</p>
<p>Clients connect with Socket.IO over websocket with <code>auth: {{token}}</code>; the messages are described by
<code>lightning_megatron/scope/schema/megascope-v1.schema.json</code>.</p>
</body></html>
""".encode()


@dataclass(eq=False)
class _Generation:
    sid: str
    rid: str
    cancel: threading.Event = field(default_factory=threading.Event)
    done: bool = False


class _BoundedWebSocket(compat_engineio.SimpleWebSocketWSGI):
    """Engine.IO's websocket driver with a message size limit enforced while the message arrives (Engine.IO
    checks only after simple-websocket has buffered all of it). simple-websocket wakes its reader before it
    marks an oversized connection closed, so a reader waiting without a timeout could sleep forever: wait in
    short slices and look."""

    def __init__(self, handler: Callable, server: Any, **kwargs: Any) -> None:
        super().__init__(handler, server, max_message_size=MAX_MESSAGE_BYTES, **kwargs)

    def wait(self) -> Any:
        while True:
            try:
                message = self.ws.receive(timeout=0.5)
            except simple_websocket.ConnectionClosed:
                return None
            if message is not None or not self.ws.connected:
                return message


class _RequestHandler(WSGIRequestHandler):
    """Tracks its connection (so ``stop`` can end it) and logs without query strings (the page's holds the token)."""

    scope: ScopeServer

    def setup(self) -> None:
        super().setup()
        self.scope._track(self.connection, True)

    def finish(self) -> None:
        self.scope._track(self.connection, False)
        try:
            super().finish()
        except OSError:  # stop() shut the connection down
            pass

    def connection_dropped(self, error: BaseException, environ: Any = None) -> None:
        # After a websocket (Engine.IO's driver ends one by raising ConnectionError) the socket carries no more
        # HTTP requests: do not wait for one.
        self.close_connection = True

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        path = urllib.parse.urlsplit(getattr(self, "path", "")).path
        _log.debug("%s %r %s", getattr(self, "command", "-"), path[:200], code)

    def log(self, type: str, message: str, *args: Any) -> None:
        text = (message % args) if args else message
        _log.debug("http: %s", text.replace(self.scope.token, "<token>")[:300])


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ScopeServer:
    """Serve ``engine`` to MegaScope clients (see the module docstring for what is guaranteed).

    ``port=0`` picks a free port (``port`` holds it after ``start``). ``allowed_hosts`` adds Host names the
    page may be reached under (e.g. a machine name, with a non-loopback ``host``). ``max_queue`` bounds the
    outgoing events. ``static_dir`` overrides the UI bundle folder.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allowed_hosts: Iterable[str] = (),
        max_queue: int = 2048,
        static_dir: Optional[os.PathLike] = None,
    ) -> None:
        token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
        if len(token) < 16:
            raise MegatronConfigError(f"{TOKEN_ENV} must be at least 16 characters (a short token can be guessed).")
        if max_queue < 1:
            raise MegatronConfigError(f"max_queue={max_queue}: at least 1 event.")
        self.engine, self.host, self.port = engine, host, port
        self.token = token
        self._allowed = [name.lower() for name in allowed_hosts]
        self._max_queue = max_queue
        self._static = Path(static_dir) if static_dir is not None else Path(__file__).parent / "static"
        self._lock = threading.Lock()
        self._clients: set[str] = set()
        self._connections: set[socket.socket] = set()
        self._generation: Optional[_Generation] = None
        self._httpd: Any = None
        # Everything start() fills in exists from here on (as not running), so no method meets a missing attribute.
        self._stopping = threading.Event()
        self._hosts: set[str] = set()
        self._app: Optional[flask.Flask] = None
        self._sio: Optional[flask_socketio.SocketIO] = None
        self._outbox: Optional[Outbox] = None
        self._generate_worker: Optional[Worker] = None
        self._control_worker: Optional[Worker] = None
        self._sender: Optional[Sender] = None
        self._http_thread: Optional[threading.Thread] = None

    # -- lifecycle ----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The address to open, token included (print it; do not log it)."""
        if self._httpd is None:
            raise RuntimeError("the server is not running: call start() first")
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else _bracketed(self.host)
        return f"http://{shown}:{self.port}/?token={urllib.parse.quote(self.token, safe='')}"

    def start(self) -> ScopeServer:
        """Listen and serve in background threads; returns once connections are accepted."""
        if self._httpd is not None:
            raise RuntimeError("the server is already running")
        if not _is_loopback(self.host):
            _log.warning(
                "MegaScope listens on %s, reachable from other machines; anyone there with the token can drive the model.",
                self.host,
            )
        self._stopping.clear()
        handler = type("_Handler", (_RequestHandler,), {"scope": self})
        self._httpd = make_server(self.host, self.port, self._wsgi, threaded=True, request_handler=handler)
        self.port = self._httpd.server_port
        names = {"127.0.0.1", "localhost", "[::1]", _bracketed(self.host.lower()), *self._allowed}
        self._hosts = {f"{name}:{self.port}" for name in names} | (names if self.port == 80 else set())
        self._app = self._build_app(sorted(f"http://{host}" for host in self._hosts))
        self._outbox = Outbox(self._max_queue)
        self._generate_worker = Worker("megascope-generate", 2, self._stopping)
        self._control_worker = Worker("megascope-control", 16, self._stopping)
        self._sender = Sender(
            self._outbox, clients=self._client_list, emit=self._emit, backlog=self._backlog, stopping=self._stopping
        )
        self._http_thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="megascope-http", daemon=True
        )
        self._http_thread.start()
        _log.info("MegaScope serving on %s:%d", self.host, self.port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Disconnect every client, stop serving, free the port and end the server's threads."""
        if self._httpd is None:
            return
        self._stopping.set()
        with self._lock:
            if self._generation is not None:
                self._generation.cancel.set()
            clients = list(self._clients)
        self._sio.server.eio.shutdown()  # Engine.IO's client monitor thread
        bye = threading.Thread(target=lambda: [self._disconnect(sid) for sid in clients], daemon=True)
        bye.start()
        bye.join(min(timeout, 1.0))
        self._httpd.shutdown()
        self._http_thread.join(timeout)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:  # ends websocket threads whose client stopped reading
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        bye.join(timeout)
        self._sender.close(timeout)
        for worker in (self._generate_worker, self._control_worker):
            worker.close(timeout)
            if worker.thread.is_alive():
                _log.warning("the MegaScope engine ignored stop() for %.0f s; its thread is left running", timeout)
        self._httpd.server_close()
        for _ in range(int(timeout / 0.01)):  # connection threads end once their sockets are shut
            with self._lock:
                if not self._connections:
                    break
            time.sleep(0.01)
        self._httpd = None
        _log.info("MegaScope stopped")

    def __enter__(self) -> ScopeServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def publish(self, event: dict) -> None:
        """Send a training run's event (``train_step``, or a ``probe``/``attention`` capture) to every client."""
        if event.get("type") not in BROADCAST_EVENTS:
            raise ValueError(f"publish() sends {sorted(BROADCAST_EVENTS)} events, not {event.get('type')!r}")
        if self._httpd is not None:
            self._send(None, event, None)

    # -- HTTP -------------------------------------------------------------------------------------------
    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._connections.add if add else self._connections.discard)(conn)

    def _wsgi(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        host = environ.get("HTTP_HOST", "").lower()
        if host not in self._hosts:
            _log.warning("refused a request for Host %r (DNS rebinding?)", host[:100])
            start_response("403 Forbidden", [("Content-Type", "text/plain"), ("X-Content-Type-Options", "nosniff")])
            return [b"This server does not answer to that Host name.\n"]
        return self._app(environ, start_response)

    def _build_app(self, origins: list[str]) -> flask.Flask:
        app = flask.Flask(__name__, static_folder=None)
        app.url_map.merge_slashes = False  # "/static//etc/passwd" is a 404, not a redirect
        app.add_url_rule("/", "page", self._page)
        app.add_url_rule("/static/<path:name>", "asset", self._asset)
        app.after_request(self._headers)
        self._sio = flask_socketio.SocketIO(
            app,
            async_mode="threading",
            cors_allowed_origins=origins,
            cors_credentials=False,
            transports=["websocket"],
            max_http_buffer_size=MAX_MESSAGE_BYTES,
            manage_session=False,
            async_handlers=False,  # a connection's requests are handled in order, in its own thread
            logger=False,
            engineio_logger=False,
        )
        server = self._sio.server
        server.on("connect", self._on_connect)
        server.on("disconnect", self._on_disconnect)
        server.on("request", self._on_request)
        server.on("*", self._on_other)
        compat_engineio.guard_messages(server, self._on_bad_packet)
        # Engine.IO's ping threads sleep through `sleep`: make it end at stop().
        compat_engineio.install_drivers(server.eio, websocket=_BoundedWebSocket, sleep=self._stopping.wait)
        return app

    def _page(self) -> flask.Response:
        token = flask.request.args.get("token", "")
        if not token:
            return flask.Response(
                "Open the address the server printed (with ?token=...).\n", 401, mimetype="text/plain"
            )
        if not self._token_ok(token):
            return flask.Response("Wrong token.\n", 403, mimetype="text/plain")
        index = self._static / "index.html"
        response = flask.Response(index.read_bytes() if index.is_file() else _FALLBACK_PAGE, mimetype="text/html")
        response.headers["Cache-Control"] = "no-store"
        return response

    def _asset(self, name: str) -> flask.Response:
        # The bundle is the package's public code, so assets need no token; safe_join answers 404 to any
        # path leaving the folder.
        if not self._static.is_dir():
            flask.abort(404)
        return flask.send_from_directory(self._static, name)

    def _headers(self, response: flask.Response) -> flask.Response:
        host = flask.request.host  # allow-listed by _wsgi
        response.headers["Content-Security-Policy"] = (
            f"default-src 'none'; script-src 'self' '{_SCRIPT_HASH}'; style-src 'self' 'unsafe-inline'; "
            f"img-src 'self' data:; font-src 'self'; connect-src 'self' ws://{host}; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'"
        )
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Cross-Origin-Opener-Policy"] = "same-origin"
        response.headers["Cross-Origin-Resource-Policy"] = "same-origin"
        return response

    # -- Socket.IO ----------------------------------------------------------------------------------------
    def _on_connect(self, sid: str, environ: dict, auth: Any = None) -> None:
        if not self._token_ok(auth.get("token") if isinstance(auth, dict) else None):
            _log.warning("refused a MegaScope connection without the right token")
            raise ConnectionRefusedError("unauthorized")
        with self._lock:
            self._clients.add(sid)

    def _token_ok(self, candidate: Any) -> bool:
        """Constant-time comparison (a timing difference would reveal the token character by character)."""
        if not isinstance(candidate, str):
            return False
        return hmac.compare_digest(
            candidate.encode("utf-8", "surrogatepass"), self.token.encode("utf-8", "surrogatepass")
        )

    def _on_disconnect(self, sid: str, *reason: Any) -> None:
        with self._lock:
            self._clients.discard(sid)
            if self._generation is not None and self._generation.sid == sid:
                self._generation.cancel.set()

    def _disconnect(self, sid: str) -> None:
        try:
            self._sio.server.disconnect(sid)
        except Exception:  # already gone
            _log.debug("disconnecting %s failed", sid, exc_info=True)

    def _on_other(self, event: str, sid: str, *args: Any) -> None:
        self._error(sid, None, "unknown_type", 'send requests as the Socket.IO event "request"')

    def _on_request(self, sid: str, *args: Any) -> None:
        rid = request_id_of(args[0]) if len(args) == 1 else None
        try:
            if len(args) != 1:
                raise ProtocolError("bad_request", "", "send one JSON object per request")
            self._dispatch(sid, rid, validate_request(args[0]))
        except ProtocolError as error:
            self._send(sid, error.event(rid), None)
        except Exception:  # never let a message end the connection
            _log.exception("MegaScope could not handle a request")
            self._error(sid, rid, "internal", "the server failed on this request")

    def _on_bad_packet(self, sid: Optional[str], error: BaseException) -> None:
        """A packet that python-socketio could not decode (invalid JSON, too deep, a huge integer, a bad binary
        placeholder): the client is told what was wrong, the connection goes on."""
        _log.debug("MegaScope refused an undecodable message (%s)", type(error).__name__)
        if sid is not None:
            self._send(sid, ProtocolError("bad_request", "", compat_engineio.bad_packet_reason(error)).event(), None)

    def _dispatch(self, sid: str, rid: str, request: dict) -> None:
        kind = request["type"]
        if kind == "ping":
            self._send(sid, {"type": "pong"}, rid)
        elif kind == "generate":
            self._start_generation(sid, rid, request)
        elif kind == "stop":
            with self._lock:
                if self._generation is not None:
                    self._generation.cancel.set()
            self._send(sid, {"type": "ack"}, rid)
        elif kind == "info":
            self._control(sid, rid, self._info)
        elif kind == "set_perturbations":
            self._control(sid, rid, lambda: self._set_perturbations(sid, request["perturbations"]))
        else:  # train
            self._control(sid, rid, lambda: self.engine.control(request))

    def _set_perturbations(self, sid: str, perturbations: list) -> None:
        """Set them, then tell the other clients (an ``info`` with the id ``PERTURBATIONS_CHANGED``; the one that
        asked gets its ``ack``): each page's panel shows the set the engine applies, whichever page chose it."""
        self.engine.set_perturbations(perturbations)
        info = {**self._info(), "id": PERTURBATIONS_CHANGED}
        for other in self._client_list():
            if other != sid:
                self._send(other, info, None)

    def _info(self) -> dict:
        server = {"version": __version__, "max_message_bytes": MAX_MESSAGE_BYTES, "queue_size": self._max_queue}
        server["transports"] = ["websocket"]
        return {"type": "info", "protocol": PROTOCOL_VERSION, "server": server, "engine": self.engine.describe()}

    def _control(self, sid: str, rid: str, call: Callable[[], Optional[dict]]) -> None:
        """Run ``call`` on the control worker; reply with the event it returns, else ``ack``."""

        def run() -> None:
            try:
                self._send(sid, call() or {"type": "ack"}, rid)
            except Exception as exc:
                self._send(sid, self._engine_error(exc).event(rid), None)

        if not self._control_worker.submit(run):
            self._error(sid, rid, "busy", "too many requests are pending; wait for replies")

    @staticmethod
    def _engine_error(exc: Exception) -> ProtocolError:
        if isinstance(exc, ProtocolError):  # the engine named the field
            return exc
        if isinstance(exc, MegatronConfigError):
            return ProtocolError("bad_request", None, str(exc)[:1000])
        _log.error("MegaScope engine failed", exc_info=exc)
        return ProtocolError("internal", None, f"{type(exc).__name__} in the engine: {str(exc)[:300]}; see the log")

    # -- generation -------------------------------------------------------------------------------------
    def _start_generation(self, sid: str, rid: str, request: dict) -> None:
        with self._lock:
            busy = self._generation is not None
            if not busy:
                self._generation = generation = _Generation(sid, rid)
        if busy:
            self._error(sid, rid, "busy", "a generation is running; send stop or wait for finish")
        elif not self._generate_worker.submit(lambda: self._run_generation(generation, request)):
            self._end(generation)
            self._error(sid, rid, "busy", "the engine is still finishing")

    def _end(self, generation: _Generation) -> bool:
        """Mark ``generation`` over (the next generate is accepted at once); False if it already was."""
        with self._lock:
            was_running, generation.done = not generation.done, True
            if self._generation is generation:
                self._generation = None
        return was_running

    def _run_generation(self, generation: _Generation, request: dict) -> None:
        def emit(event: dict) -> None:
            kind = event.get("type")
            if kind not in GENERATION_EVENTS:
                raise ValueError(f"emit(): a generation sends {sorted(GENERATION_EVENTS)}, not {kind!r}")
            if generation.done:
                return  # after finish (or after an error was reported)
            item = Item.of(generation.sid, event, generation.rid)
            if kind == "finish":
                self._end(generation)
            self._outbox.put(item)

        error: Optional[ProtocolError] = None
        try:
            self.engine.generate(request, emit, generation.cancel.is_set)
            if not generation.done:
                error = ProtocolError("internal", None, "the engine ended without a finish event")
        except Exception as exc:
            error = self._engine_error(exc)
        if error is not None and self._end(generation):
            self._send(generation.sid, error.event(generation.rid), None)

    # -- sending ------------------------------------------------------------------------------------------
    def _send(self, sid: Optional[str], event: dict, rid: Optional[str]) -> None:
        self._outbox.put(Item.of(sid, event, rid))

    def _error(self, sid: str, rid: Optional[str], code: str, message: str) -> None:
        self._send(sid, ProtocolError(code, None, message).event(rid), None)

    def _client_list(self) -> list[str]:
        with self._lock:
            return sorted(self._clients)

    def _emit(self, sid: str, event: dict) -> None:
        try:
            self._sio.server.emit("event", event, to=sid, namespace="/")
        except Exception:  # the client left meanwhile
            _log.debug("sending to %s failed", sid, exc_info=True)

    def _backlog(self, sid: str) -> Optional[int]:
        """Packets queued in ``sid``'s Engine.IO transport and not yet written; None once it is gone."""
        assert self._sio is not None
        return compat_engineio.backlog(self._sio.server, sid)
