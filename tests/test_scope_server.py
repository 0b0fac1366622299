"""MegaScope's server against real clients: a real server on 127.0.0.1, real ``socketio.Client``s over
websocket, plain HTTP for the page, and the real ``ScopeEngine`` over a tiny GPT generating on CPU in this
process (a scripted engine only to send what a model would not)."""

from __future__ import annotations

import base64
import functools
import gc
import http.client
import json
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from typing import Any, Optional

import numpy as np
import pytest
import socketio
import torch
import websocket
from jsonschema import Draft202012Validator
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model

from lightning_megatron import MegatronConfigError
from lightning_megatron.compat import megatron as compat_megatron
from lightning_megatron.models import GPTModule
from lightning_megatron.models.loading import prepare
from lightning_megatron.scope import protocol
from lightning_megatron.scope.client import ScopeClient
from lightning_megatron.scope.engine import ScopeEngine
from lightning_megatron.scope.server import TOKEN_ENV, ScopeServer

VOCAB, SEQ = 128, 32
PROBE = "blocks.0.hook_resid_post"


# -- engines ------------------------------------------------------------------------------------------------
def encode(text: str) -> list[int]:
    return [byte % VOCAB for byte in text.encode()]


class ByteTokenizer:
    """Byte-level: one token per byte of the UTF-8 text (the tests' prompts are ASCII, within VOCAB)."""

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def real_engine(module: GPTModule) -> ScopeEngine:
    return ScopeEngine(module, ByteTokenizer())


def first_layer(module: GPTModule) -> TransformerLayer:
    return next(m for m in unwrap_model(module.model_chunks[0]).modules() if isinstance(m, TransformerLayer))


class HeldEngine(ScopeEngine):
    """The real engine, its first generation held in its first forward until the server cancels it: a generation
    that cannot end on its own (for the busy, stop and cancel tests). ``forwards[request id]`` counts each
    generation's forwards; ``hold`` is the first layer's forward pre-hook."""

    def __init__(self, module: GPTModule) -> None:
        super().__init__(module, ByteTokenizer())
        self.forwards: Counter = Counter()
        self.running: tuple = ("", lambda: False)
        self.held = False

    def generate(self, request, emit, cancelled) -> None:
        self.running = (request["id"], cancelled)
        super().generate(request, emit, cancelled)

    def hold(self, _layer, _args) -> None:
        rid, cancelled = self.running
        self.forwards[rid] += 1
        if not self.held:
            self.held = True
            deadline = time.monotonic() + 20
            while not cancelled() and time.monotonic() < deadline:
                time.sleep(0.005)


class ScriptedEngine:
    """Emits a fixed list of events, then finish; sets ``emitted`` when done."""

    def __init__(self, events: list[dict]) -> None:
        self.events, self.emitted = events, threading.Event()

    def describe(self) -> dict:
        return {"mode": "generate"}

    def set_perturbations(self, perturbations: list) -> None: ...

    def control(self, request: dict) -> None:
        raise MegatronConfigError("no training here")

    def generate(self, request: dict, emit, cancelled) -> None:
        for event in self.events:
            emit(event)
        emit({"type": "finish", "texts": request["prompts"], "reasons": ["length"] * len(request["prompts"])})
        self.emitted.set()


@pytest.fixture(autouse=True)
def quick_client_close(monkeypatch):
    """python-engineio's client closes its websocket and then waits (websocket-client: up to 3 s) for a close
    frame that its own read loop has already consumed; browsers do not wait. Keep the tests' clients quick."""
    monkeypatch.setattr(websocket.WebSocket, "close", functools.partialmethod(websocket.WebSocket.close, timeout=0.2))


@pytest.fixture(scope="module")
def module():
    """The tiny model, in this process, on one intra-op thread; afterwards the process is left as it was found
    for the test modules that fork ranks later: a forked child hangs in torch's intra-op pool if the parent ran
    it, and segfaults or hangs destroying gloo groups the parent created."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"  # Lightning would otherwise set torch's thread count from the CPUs
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = GPTModule(vocab_size=VOCAB, seq_length=SEQ, num_layers=2, hidden_size=32, num_attention_heads=4)
    prepare(module, accelerator="cpu")
    yield module
    # Every process group of this process destroyed and unreferenced, so their destructors run here, not in a
    # forked child.
    compat_megatron.release_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


@pytest.fixture
def server(module):
    with ScopeServer(real_engine(module)) as running:
        yield running


@pytest.fixture
def held(module):
    engine = HeldEngine(module)
    hook = first_layer(module).register_forward_pre_hook(engine.hold)
    yield engine
    hook.remove()


# -- clients ------------------------------------------------------------------------------------------------
class Client:
    """A Socket.IO client over a real websocket, read by one thread in the order the server sent, as a browser
    reads its socket; every event it receives is checked against the schema.

    Not ``socketio.Client``: it hands each incoming message to a new thread, so a token and the probes sent
    after it can reach the test in either order."""

    def __init__(self, server: ScopeServer) -> None:
        self.events: queue.Queue = queue.Queue()
        self.invalid: list = []
        self.disconnected = threading.Event()
        self.scope = ScopeClient(f"http://127.0.0.1:{server.port}/?token={server.token}", timeout=5, decode=False)
        self._reader = threading.Thread(target=self._read, name="test-client-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                self._record(self.scope.next_event(timeout=None))
        except Exception:  # the connection closed: by us, or by the server
            pass
        finally:
            self.disconnected.set()

    def _record(self, event: dict) -> None:
        try:
            protocol.validate_event(event)
        except protocol.ProtocolError as error:
            self.invalid.append((event.get("type"), error.field, error.message))
        self.events.put(event)

    def emit(self, name: str, *args: Any) -> None:
        """A Socket.IO event of any name and arguments (a well-behaved client sends one ``request``)."""
        self.send_packet("2" + json.dumps([name, *args]))

    def send_packet(self, packet: str | bytes) -> None:
        """A Socket.IO packet as it is (text), or a binary attachment (bytes)."""
        if isinstance(packet, bytes):
            self.scope._ws.send_binary(packet)
        else:
            self.scope._ws.send("4" + packet)  # an Engine.IO message

    def send(self, message: Any) -> None:
        self.emit("request", message)

    def next(self, timeout: float = 10.0) -> dict:
        return self.events.get(timeout=timeout)

    def until(self, done, timeout: float = 20.0) -> list[dict]:
        """Events up to and including the first for which ``done(event)``."""
        received, deadline = [], time.monotonic() + timeout
        while True:
            received.append(self.next(max(0.01, deadline - time.monotonic())))
            if done(received[-1]):
                return received

    def ask(self, message: dict) -> dict:
        self.send(message)
        return self.next()

    def disconnect(self) -> None:
        """Leave as a browser tab does: a Socket.IO disconnect, then the socket closes."""
        if not self.disconnected.is_set():
            try:
                self.scope._ws.send("41")
            except Exception:
                pass
            self.scope._ws.shutdown()
        self._reader.join(5)

    def close(self) -> None:
        self.disconnect()
        assert not self.invalid, self.invalid


@pytest.fixture
def client(server):
    connected = Client(server)
    yield connected
    connected.close()


def ping(rid: str = "p") -> dict:
    return {"v": 1, "type": "ping", "id": rid}


def generate(rid: str, prompts: list[str], **options: Any) -> dict:
    return {"v": 1, "type": "generate", "id": rid, "prompts": prompts, **options}


def http_get(port: int, path: str, host: Optional[str] = None, headers: Optional[dict] = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
    conn.putheader("Host", host or f"127.0.0.1:{port}")
    for key, value in (headers or {}).items():
        conn.putheader(key, value)
    conn.endheaders()
    response = conn.getresponse()
    body = response.read() if response.status != 101 else b""
    conn.close()
    return response, body


def websocket_handshake(port: int, host: str, origin: Optional[str] = None) -> int:
    headers = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
        "Sec-WebSocket-Version": "13",
    }
    if origin:
        headers["Origin"] = origin
    response, _ = http_get(port, "/socket.io/?EIO=4&transport=websocket", host=host, headers=headers)
    return response.status


# -- the schema ---------------------------------------------------------------------------------------------
def test_schema_is_valid_and_matches_the_module():
    schema = protocol.load_schema()
    Draft202012Validator.check_schema(schema)
    defs = schema["$defs"]
    assert defs["ErrorEvent"]["properties"]["code"]["enum"] == list(protocol.ERROR_CODES)
    requests = {defs[ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["const"] for ref in defs["Request"]["oneOf"]}
    assert requests == set(protocol.REQUEST_TYPES)
    events = {defs[ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["const"] for ref in defs["Event"]["oneOf"]}
    assert protocol.GENERATION_EVENTS | protocol.BROADCAST_EVENTS <= events


# -- access -------------------------------------------------------------------------------------------------
def test_token_is_required_to_connect(server):
    wrong = ("y" if server.token.startswith("x") else "x") + server.token[1:]  # one character off
    for auth in (None, {}, {"token": ""}, {"token": 123}, {"token": wrong}, {"token": "\ud800"}, server.token):
        with pytest.raises(socketio.exceptions.ConnectionError):
            socketio.Client(reconnection=False).connect(
                f"http://127.0.0.1:{server.port}", auth=auth, transports=["websocket"], wait_timeout=5
            )
    good = Client(server)
    assert good.ask(ping("ok")) == {"v": 1, "type": "pong", "id": "ok"}
    good.close()


def test_token_from_environment_and_url(module, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "a-token-of-twenty-chars")
    with ScopeServer(real_engine(module)) as server:
        assert server.token == "a-token-of-twenty-chars"
        assert server.url == f"http://127.0.0.1:{server.port}/?token=a-token-of-twenty-chars"
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(MegatronConfigError, match="16 characters"):
        ScopeServer(real_engine(module))
    monkeypatch.delenv(TOKEN_ENV)
    assert len(ScopeServer(real_engine(module)).token) >= 32


@pytest.mark.parametrize("bundle", ["shipped", "missing"])
def test_page_needs_token_and_sends_security_headers(module, tmp_path, caplog, bundle):
    """The page (the shipped web UI, or a self-contained notice when the bundle is missing) needs the token
    and comes with the security headers."""
    caplog.set_level(logging.DEBUG, logger="lightning_megatron.scope")
    static = {"shipped": None, "missing": tmp_path}[bundle]
    with ScopeServer(real_engine(module), static_dir=static) as server:
        _check_page(server, bundle, caplog)


def _check_page(server: ScopeServer, bundle: str, caplog: Any) -> None:
    assert http_get(server.port, "/")[0].status == 401
    assert http_get(server.port, "/?token=nope")[0].status == 403
    response, body = http_get(server.port, f"/?token={server.token}")
    assert response.status == 200
    if bundle == "missing":
        assert b"protocol version 1" in body and b"not built" in body
        assert b"src=" not in body and b"href=" not in body  # self-contained
    else:
        assert b'<div id="app">' in body and b"/static/assets/" in body
    headers = {k.lower(): v for k, v in response.getheaders()}
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert f"connect-src 'self' ws://127.0.0.1:{server.port}" in csp
    assert server.token not in caplog.text  # request lines are logged without the query


def test_foreign_host_and_origin_are_refused(server):
    port = server.port
    assert http_get(port, f"/?token={server.token}", host=f"evil.example:{port}")[0].status == 403
    assert http_get(port, f"/?token={server.token}", host="127.0.0.1:1")[0].status == 403
    assert http_get(port, f"/?token={server.token}", host=f"localhost:{port}")[0].status == 200
    assert websocket_handshake(port, f"evil.example:{port}") == 403
    assert websocket_handshake(port, f"127.0.0.1:{port}", origin="http://evil.example") == 400
    assert websocket_handshake(port, f"127.0.0.1:{port}", origin=f"http://evil.example:{port}") == 400
    assert websocket_handshake(port, f"127.0.0.1:{port}", origin=f"http://localhost:{port}") == 101
    still = Client(server)
    assert still.ask(ping())["type"] == "pong"
    still.close()


def test_non_loopback_host_warns_and_needs_token(module, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_megatron.scope"):
        with ScopeServer(real_engine(module), host="0.0.0.0") as server:
            assert "reachable from other machines" in caplog.text
            assert server.url.startswith(f"http://127.0.0.1:{server.port}/?token=")
            with pytest.raises(socketio.exceptions.ConnectionError):
                socketio.Client(reconnection=False).connect(
                    f"http://127.0.0.1:{server.port}", transports=["websocket"], wait_timeout=5
                )


def test_static_files_stay_in_their_folder(module, tmp_path):
    static = tmp_path / "static"
    (static / "assets").mkdir(parents=True)
    (static / "index.html").write_text("<title>the bundle</title>")
    (static / "assets" / "app.js").write_text("console.log(1)")
    (tmp_path / "secret.txt").write_text("secret")
    with ScopeServer(real_engine(module), static_dir=static) as server:
        port = server.port
        assert http_get(port, f"/?token={server.token}")[1] == b"<title>the bundle</title>"
        response, body = http_get(port, "/static/assets/app.js")
        assert response.status == 200 and body == b"console.log(1)"
        assert response.getheader("X-Content-Type-Options") == "nosniff"
        for path in (
            "/../../etc/passwd",
            "/static/../secret.txt",
            "/static/..%2fsecret.txt",
            "/static/%2e%2e/secret.txt",
            "/static/..%2f..%2f..%2fetc%2fpasswd",
            "/static//etc/passwd",
            "/static/assets/../../secret.txt",
        ):
            response, body = http_get(port, path)
            assert response.status == 404, path
            assert b"secret" not in body and b"root:" not in body


# -- messages -----------------------------------------------------------------------------------------------
HOSTILE = [
    ({"v": 1, "type": "launch", "id": "h1"}, "unknown_type", "/type"),
    ({"v": 1, "type": "ping", "id": "h2", "extra": 1}, "invalid_field", "/extra"),
    ({"v": 2, "type": "ping", "id": "h3"}, "unsupported_version", "/v"),
    (generate("h4", "not a list"), "invalid_field", "/prompts"),
    (generate("h5", ["x" * 5000]), "too_large", "/prompts/0"),
    (generate("h6", ["x"] * 9), "too_large", "/prompts"),
    (generate("h7", ["x"], max_new_tokens="5"), "invalid_field", "/max_new_tokens"),
    (generate("h8", ["x"], max_new_tokens=2.0), "invalid_field", "/max_new_tokens"),
    (generate("h9", ["x"], temperature=-1), "invalid_field", "/temperature"),
    (
        generate("h10", ["x"], probes=[{"name": "__import__('os').system('touch /tmp/pwned')"}]),
        "invalid_field",
        "/probes/0/name",
    ),
    (
        generate("h11", ["x"], probes=[{"name": "x", "reduce": [{"kind": "eval", "expr": "data.mean()"}]}]),
        "invalid_field",
        "/probes/0/reduce/0/kind",
    ),
    (
        generate("h12", ["x"], probes=[{"name": "x", "reduce": [{"kind": "mean", "axis": 0, "method": "x"}]}]),
        "invalid_field",
        "/probes/0/reduce/0/method",
    ),
    (generate("h13", ["x"], attention={"layers": [-1]}), "invalid_field", "/attention/layers/0"),
    (
        {"v": 1, "type": "set_perturbations", "id": "h14", "perturbations": [{"site": "../../etc", "kind": "zero"}]},
        "invalid_field",
        "/perturbations/0/site",
    ),
    (
        {"v": 1, "type": "set_perturbations", "id": "h15", "perturbations": [{"site": "x", "kind": "stuck"}]},
        "invalid_field",
        "/perturbations/0/value",
    ),
    ({"v": 1, "type": "train", "id": "h16", "action": "pause", "steps": 3}, "invalid_field", "/steps"),
    ({"v": 1, "type": "ping", "id": "bad id!"}, "invalid_field", "/id"),
    ({"v": 1, "type": "ping", "id": "h18", "a/b": 1}, "invalid_field", "/a~1b"),
    ([1, 2, 3], "bad_request", ""),
    ('{"v": 1}', "bad_request", ""),
]


def test_hostile_and_malformed_messages_get_errors_naming_the_field(client):
    for message, code, field in HOSTILE:
        reply = client.ask(message)
        assert (reply["type"], reply["code"], reply.get("field")) == ("error", code, field), message
        rid = protocol.request_id_of(message)
        assert reply.get("id") == rid
        assert "__import__" not in reply["message"] and "xxxxx" not in reply["message"]  # never echoed
        assert client.ask(ping("after"))["type"] == "pong"
    assert not os.path.exists("/tmp/pwned")
    # a non-finite number (Python's json accepts NaN) is refused like any bad value
    reply = client.ask(generate("nan", ["x"], temperature=float("nan")))
    assert (reply["code"], reply["field"]) == ("invalid_field", "/temperature")
    # other Socket.IO events, and more than one argument
    client.emit("generate", {"prompts": ["x"]})
    assert client.next()["code"] == "unknown_type"
    client.emit("request", ping("a"), ping("b"))
    assert client.next()["code"] == "bad_request"
    # the engine's own refusal (a prompt as long as the model's 32 positions) is a bad_request
    client.send(generate("long", ["x" * SEQ], max_new_tokens=8))
    reply = client.until(lambda e: e["type"] in ("finish", "error"))[-1]
    assert (reply["type"], reply["code"], reply["id"]) == ("error", "bad_request", "long")
    assert client.ask(ping("end"))["type"] == "pong"


def raw_connection(server: ScopeServer) -> websocket.WebSocket:
    """A websocket speaking Engine.IO/Socket.IO by hand, to send what a well-behaved client cannot."""
    ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/socket.io/?EIO=4&transport=websocket", timeout=5)
    assert ws.recv().startswith("0")  # Engine.IO open
    ws.send("40" + json.dumps({"token": server.token}))  # Socket.IO connect with auth
    assert ws.recv().startswith("40")
    return ws


def raw_request(ws: websocket.WebSocket, message: dict) -> dict:
    ws.send('42["request",' + json.dumps(message) + "]")
    name, event = json.loads(ws.recv()[2:])
    assert name == "event"
    return event


def test_oversized_and_unparsable_messages(server):
    big = Client(server)
    big.send(generate("big", ["x" * (protocol.MAX_MESSAGE_BYTES + 1000)]))
    assert big.disconnected.wait(5)  # refused while it arrived: that connection is closed
    ws = raw_connection(server)
    ws.send("4" + "x" * (protocol.MAX_MESSAGE_BYTES + 10))
    with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError)):
        while ws.recv() not in ("", b""):
            pass
        raise ConnectionError
    # Socket.IO packets that do not parse are answered with what was wrong; the connection stays usable
    ws = raw_connection(server)
    ws.send('42["request",' + "[" * 20000 + "]" * 20000 + "]")  # deeper than the parser's stack
    reply = read_event(ws)
    assert (reply["code"], reply["field"]) == ("bad_request", "") and "nested too deeply" in reply["message"]
    ws.send('42["request",{"v": 1, "type": ')  # not JSON
    reply = read_event(ws)
    assert (reply["code"], reply["field"]) == ("bad_request", "") and "not valid JSON" in reply["message"]
    ws.send('42["request",{"v": 1, "type": "ping", "id": ' + "7" * 5000 + "}]")  # a 5000-digit integer
    assert "too many digits" in read_event(ws)["message"]
    assert raw_request(ws, ping("raw")) == {"v": 1, "type": "pong", "id": "raw"}
    # bytes smuggled in as a binary attachment are not a request
    ws.send('451-["request",{"_placeholder":true,"num":0}]')
    ws.send_binary(b"\x80\x04K\x01.")  # a pickle
    reply = json.loads(ws.recv()[2:])[1]
    assert (reply["code"], reply["field"]) == ("bad_request", "")
    assert raw_request(ws, ping("raw2"))["type"] == "pong"
    ws.close()
    fresh = Client(server)
    assert fresh.ask(ping("alive"))["type"] == "pong"
    fresh.close()


def test_info_ack_and_train_refusal(client):
    info = client.ask({"v": 1, "type": "info", "id": "i"})
    assert info["type"] == "info" and info["protocol"] == 1
    assert info["server"]["max_message_bytes"] == protocol.MAX_MESSAGE_BYTES
    engine = info["engine"]
    assert PROBE in engine["probes"] and engine["model"]["vocab_size"] == VOCAB and engine["perturbations"] == []
    perturbation = {"site": PROBE, "kind": "zero", "strength": 0.5}
    reply = client.ask({"v": 1, "type": "set_perturbations", "id": "s", "perturbations": [perturbation]})
    assert reply == {"v": 1, "type": "ack", "id": "s"}
    assert [
        {key: p[key] for key in perturbation}
        for p in client.ask({"v": 1, "type": "info", "id": "i2"})["engine"]["perturbations"]
    ] == [perturbation]
    bad = {"site": PROBE, "kind": "zero", "heads": [0]}  # valid to the schema; the engine refuses it
    reply = client.ask({"v": 1, "type": "set_perturbations", "id": "s2", "perturbations": [bad]})
    assert (reply["type"], reply["code"], reply["id"]) == ("error", "bad_request", "s2")
    assert "needs sites with heads" in reply["message"]
    reply = client.ask({"v": 1, "type": "train", "id": "t", "action": "step"})
    assert (reply["type"], reply["code"], reply["id"]) == ("error", "bad_request", "t")
    assert "training controls need" in reply["message"]


def test_perturbations_set_by_one_client_are_told_to_the_others(server):
    """The client that sets perturbations gets its ack; every other client gets an ``info`` holding the new set,
    so no page shows "off" while the engine applies a perturbation another page chose."""
    setter, watcher = Client(server), Client(server)
    try:
        perturbation = {"site": PROBE, "kind": "zero", "strength": 0.5}
        reply = setter.ask({"v": 1, "type": "set_perturbations", "id": "s", "perturbations": [perturbation]})
        assert reply == {"v": 1, "type": "ack", "id": "s"}
        told = watcher.next()
        assert (told["type"], told["id"]) == ("info", "perturbations-changed")
        assert [{key: p[key] for key in perturbation} for p in told["engine"]["perturbations"]] == [perturbation]
        assert setter.ask(ping("after"))["type"] == "pong"  # the setter's own stream holds its replies only
        setter.ask({"v": 1, "type": "set_perturbations", "id": "s2", "perturbations": []})
        assert watcher.next()["engine"]["perturbations"] == []
    finally:
        setter.close()
        watcher.close()


# -- generation -----------------------------------------------------------------------------------------------
def reference_forward(module: GPTModule, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's output ([seq, hidden]) and the logits ([seq, VOCAB]) at every position of ``ids``, by one
    plain forward of the model (no KV cache, no MegaScope)."""
    chunk = module.model_chunks[0]
    captured: dict[str, torch.Tensor] = {}

    def keep(_layer, _args, output) -> None:
        captured["resid"] = output[0].detach()

    hook = first_layer(module).register_forward_hook(keep)
    modes = [(m, m.training) for m in chunk.modules()]
    chunk.eval()
    try:
        with torch.no_grad():
            tokens = torch.tensor([ids])
            logits = chunk(input_ids=tokens, position_ids=torch.arange(len(ids)).unsqueeze(0), attention_mask=None)
    finally:
        hook.remove()
        for m, training in modes:
            m.training = training
    return captured["resid"][:, 0].float(), logits[0, :, :VOCAB].float()


def test_generate_streams_tokens_and_probes(module, server, client):
    prompts, n = ["Hello", "Hi"], 6
    threads: set[str] = set()
    watch = first_layer(module).register_forward_pre_hook(lambda *_: threads.add(threading.current_thread().name))
    try:
        client.send(generate("g", prompts, max_new_tokens=n, alternatives=3, probes=[{"name": PROBE}]))
        events = client.until(lambda e: e["type"] in ("finish", "error"))
    finally:
        watch.remove()
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "finish", kinds
    assert all(e["id"] == "g" for e in events)
    start = events[0]
    for prompt, sent in zip(prompts, start["prompts"]):
        assert protocol.decode_array(sent["ids"]).tolist() == encode(prompt)
        assert sent["ids"]["dtype"] == "int32" and "".join(sent["tokens"]) == prompt

    expected = module.generate([encode(p) for p in prompts], n, temperature=0)
    finish = events[-1]
    assert finish["reasons"] == ["length", "length"]
    assert finish["texts"] == [bytes(row).decode() for row in expected.tokens]

    tokens = [e for e in events if e["type"] == "token"]
    probes = [e for e in events if e["type"] == "probe"]
    assert len(tokens) == len(probes) == len(expected.tokens[0]) - len(prompts[1])
    assert kinds[1:3] == ["token", "probe"]  # a position's token comes before the probes of its forward
    references = [reference_forward(module, row) for row in expected.tokens]
    covered = 0
    for token, probe in zip(tokens, probes):
        position = token["position"]
        # each probe holds the positions its forward computed: the shorter prompt first, then one at a time
        assert (probe["name"], probe["layer"], probe["start"], probe["end"]) == (PROBE, 0, covered, position)
        covered = position
        data = protocol.decode_array(probe["data"])
        assert probe["data"]["dtype"] == "float16" and data.shape == (2, probe["end"] - probe["start"], 32)
        for row, (ids, (resid, logits)) in enumerate(zip(expected.tokens, references)):
            entry = token["tokens"][row]
            if position < len(ids):
                assert entry["id"] == ids[position] and entry["text"] == chr(ids[position])
            stop = min(position, len(ids))
            np.testing.assert_allclose(
                data[row, : stop - probe["start"]].astype(np.float32),
                resid[probe["start"] : stop],
                rtol=1e-2,
                atol=1e-2,
            )
            if position < len(ids):  # the alternatives: a softmax top-3 of the logits that predicted this position
                probs = logits[position - 1].softmax(-1)
                alternatives = token["alternatives"][row]
                np.testing.assert_allclose([a["p"] for a in alternatives], probs.topk(3).values, rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(
                    [a["p"] for a in alternatives], probs[[a["id"] for a in alternatives]], atol=1e-5
                )
                if not (entry["in_prompt"] or entry["done"]):
                    assert alternatives[0]["id"] == entry["id"]  # greedy
    # "Hi" generates while "Hello" still reads its prompt
    assert tokens[0]["tokens"][0]["in_prompt"] and not tokens[0]["tokens"][1]["in_prompt"]
    assert client.ask(ping("again"))["type"] == "pong"
    assert threads == {"megascope-generate"}  # the model ran on the generation worker, never a connection's thread


def test_publish_reaches_every_client(server):
    first, second = Client(server), Client(server)
    assert first.ask(ping())["type"] == second.ask(ping())["type"] == "pong"
    perturbation = {
        "site": "system",
        "kind": "bitflip",
        "strength": 1e-3,
        "seed": 1,
        "layers": None,
        "heads": None,
        "value": 0.0,
    }
    server.publish(
        {
            "type": "train_step",
            "step": 7,
            "loss": float("nan"),
            "grad_norm": torch.tensor(float("inf")),
            "paused": False,
            "perturbations": [perturbation],
        }
    )
    for client in (first, second):
        event = client.next()
        assert (event["type"], event["step"], event["loss"], event["grad_norm"]) == ("train_step", 7, "NaN", "Infinity")
        assert "id" not in event
        client.close()
    with pytest.raises(ValueError, match="publish"):
        server.publish({"type": "finish", "texts": [], "reasons": []})


def test_busy_and_stop(held):
    with ScopeServer(held) as server:
        client, other = Client(server), Client(server)
        client.send(generate("long", ["ab"], max_new_tokens=29))
        assert client.next()["type"] == "start"  # the generation now waits in its first forward
        reply = other.ask(generate("second", ["cd"], max_new_tokens=2))
        assert (reply["type"], reply["code"], reply["id"]) == ("error", "busy", "second")
        assert other.ask({"v": 1, "type": "stop", "id": "halt"}) == {"v": 1, "type": "ack", "id": "halt"}
        events = client.until(lambda e: e["type"] == "finish")
        assert [e["type"] for e in events if e["type"] != "probe"] == ["token", "finish"]
        assert events[-1]["reasons"] == ["callback"] and held.forwards["long"] == 1  # stopped at its first token
        # the next generation is accepted at once
        other.send(generate("third", ["cd"], max_new_tokens=2))
        assert other.until(lambda e: e["type"] in ("finish", "error"))[-1]["type"] == "finish"
        client.close()
        other.close()


def test_client_leaving_cancels_its_generation(held):
    with ScopeServer(held) as server:
        leaving = Client(server)
        leaving.send(generate("g", ["ab"], max_new_tokens=29))
        assert leaving.next()["type"] == "start"
        leaving.disconnect()
        other = Client(server)
        deadline = time.monotonic() + 20
        while True:
            other.send(generate("next", ["cd"], max_new_tokens=1))
            reply = other.next()
            if reply["type"] == "start" or time.monotonic() > deadline:
                break
            assert reply["code"] == "busy"
            time.sleep(0.05)
        assert reply["type"] == "start"
        assert held.forwards["g"] == 1  # cancelled at its first token
        assert other.until(lambda e: e["type"] == "finish")[-1]["texts"][0].startswith("cd")
        other.close()


def test_non_finite_values_round_trip():
    values = np.array([1.5, np.nan, np.inf, -np.inf, -0.0, 65504.0], dtype=np.float32)
    huge = np.array([1e30, np.nan, -1e6], dtype=np.float32)
    events = [
        {"type": "probe", "name": "a", "layer": 0, "start": 0, "end": 1, "data": torch.from_numpy(values)},
        {"type": "probe", "name": "b", "layer": None, "data": huge},
        {
            "type": "attention",
            "layer": 1,
            "heads": [2],
            "start": 0,
            "end": 2,
            "data": protocol.Array(np.array([[[[0.0, 1.0], [np.nan, 0.25]]]]), "uint8", low=0, high=1),
        },
        {"type": "token", "position": 1, "tokens": [{"id": 1, "text": "a", "p": float("nan")}], "alternatives": [[]]},
        {
            "type": "probe",
            "name": "ids",
            "layer": 0,
            "data": torch.tensor([[1, 2**31 - 1]]),
            "extra": np.float64(np.inf),
        },
    ]
    engine = ScriptedEngine(events[:4])
    with ScopeServer(engine) as server:
        client = Client(server)
        client.send(generate("n", ["x"]))
        received = client.until(lambda e: e["type"] == "finish")
        a, b, attention, token = received[:4]
        assert a["data"]["dtype"] == "float16"
        np.testing.assert_array_equal(protocol.decode_array(a["data"]).astype(np.float32), values)
        assert np.signbit(protocol.decode_array(a["data"])[4])
        assert b["data"]["dtype"] == "float32"  # 1e30 would overflow float16 into inf
        np.testing.assert_array_equal(protocol.decode_array(b["data"]), huge)
        decoded = protocol.decode_array(attention["data"])
        assert attention["data"]["dtype"] == "uint8" and decoded.shape == (1, 1, 2, 2)
        np.testing.assert_allclose(decoded[0, 0, 0], [0.0, 1.0])
        assert np.isnan(decoded[0, 0, 1, 0]) and abs(decoded[0, 0, 1, 1] - 0.25) < 1 / 252
        assert token["tokens"][0]["p"] == "NaN" and np.isnan(protocol.decode_float(token["tokens"][0]["p"]))
        client.close()
    # an engine sending something the wire cannot carry is an internal error, not a crash
    with ScopeServer(ScriptedEngine([{"type": "probe", "name": "x", "layer": 0, "data": object()}])) as server:
        client = Client(server)
        client.send(generate("bad", ["x"]))
        reply = client.until(lambda e: e["type"] in ("finish", "error"))[-1]
        assert reply["type"] == "error" and reply["code"] == "internal"
        client.close()
    encoded = protocol.encode_event(events[4])
    assert protocol.decode_array(encoded["data"]).tolist() == [[1, 2**31 - 1]] and encoded["extra"] == "Infinity"


def read_event(ws: websocket.WebSocket) -> dict:
    """The next Socket.IO "event" from a raw connection, binary attachments put in place."""
    while True:
        frame = ws.recv()
        if frame == "2":  # Engine.IO ping
            ws.send("3")
            continue
        kind, body = frame[1], frame[2:]
        if kind == "2":
            return json.loads(body)[1]
        assert kind == "5", frame[:40]
        count, body = body.split("-", 1)
        attachments = [ws.recv() for _ in range(int(count))]
        return _fill(json.loads(body)[1], attachments)


def _fill(value: Any, attachments: list[bytes]) -> Any:
    if isinstance(value, dict):
        if value.get("_placeholder"):
            return attachments[value["num"]]
        return {key: _fill(item, attachments) for key, item in value.items()}
    return [_fill(item, attachments) for item in value] if isinstance(value, list) else value


def test_slow_client_gets_dropped_counts(module):
    count, size = 200, 128 * 1024  # 256 KiB float16 frames: far more than the socket buffers hold
    data = np.arange(size, dtype=np.float32) / size
    events = [
        {"type": "probe", "name": "flood", "layer": 0, "start": i, "end": i + 1, "data": data} for i in range(count)
    ]
    engine = ScriptedEngine(events)
    with ScopeServer(engine, max_queue=4) as server:
        # A raw connection, so that not reading really stops reading (python-socketio's client hands every
        # message to a new thread and keeps reading).
        ws = raw_connection(server)
        ws.send('42["request",' + json.dumps(generate("flood", ["x"])) + "]")
        assert engine.emitted.wait(30)  # the engine never waits for a slow client
        received = [read_event(ws)]
        while received[-1]["type"] != "finish":
            received.append(read_event(ws))
        ws.close()
    for event in received:
        protocol.validate_event(event)
    kinds = [e["type"] for e in received]
    dropped = sum(e["counts"]["probe"] for e in received if e["type"] == "dropped")
    assert dropped > count / 2 and all(e["id"] == "flood" for e in received if e["type"] == "dropped")
    assert kinds.count("probe") + dropped == count
    starts = [e["start"] for e in received if e["type"] == "probe"]
    assert starts == sorted(starts) and starts[-1] == count - 1  # the newest survive
    last = [e for e in received if e["type"] == "probe"][-1]
    np.testing.assert_array_equal(protocol.decode_array(last["data"]), data.astype(np.float16))


def test_stop_frees_port_and_threads(module):
    before = set(threading.enumerate())
    server = ScopeServer(real_engine(module)).start()
    port = server.port
    client = Client(server)
    client.send(generate("g", ["ab"], max_new_tokens=2))
    assert client.until(lambda e: e["type"] == "finish")
    idle = Client(server)  # still connected when the server stops
    assert idle.ask(ping())["type"] == "pong"
    client.close()
    server.stop()
    assert idle.disconnected.wait(5)
    deadline = time.monotonic() + 5
    while (
        left := [t for t in threading.enumerate() if t not in before and t.is_alive()]
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, [t.name for t in left]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    again = ScopeServer(real_engine(module), port=port).start()
    assert again.port == port
    second = Client(again)
    assert second.ask(ping())["type"] == "pong"
    second.close()
    again.stop()
    server.stop()  # idempotent
