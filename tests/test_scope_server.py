"""MegaScope's server against real clients: a real server on 127.0.0.1, real ``socketio.Client``s over
websocket, plain HTTP for the page, and a real tiny GPT generating on CPU in this process."""

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
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import pytest
import socketio
import torch
import websocket
from jsonschema import Draft202012Validator
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model
from torch.utils.data import DataLoader

from lightning_megatron import MegatronAppStrategy, MegatronConfigError
from lightning_megatron.compat import megatron as compat_megatron
from lightning_megatron.models import GPTModule
from lightning_megatron.scope import protocol
from lightning_megatron.scope.server import TOKEN_ENV, ScopeServer

VOCAB, SEQ = 128, 32
PROBE = "blocks.0.hook_resid_post"


# -- engines ------------------------------------------------------------------------------------------------
def encode(text: str) -> list[int]:
    return [byte % VOCAB for byte in text.encode()]


class TinyEngine:
    """Streams ``GPTModule.generate`` token by token: token events from ``on_token`` (which also checks
    ``cancelled()``), one probe event per token with the first layer's output at the position the token was
    predicted from. ``delay`` slows each token down (for busy/stop tests)."""

    def __init__(self, module: GPTModule, delay: float = 0.0) -> None:
        chunk = unwrap_model(module.model_chunks[0])
        self.module, self.delay = module, delay
        self.layer = next(m for m in chunk.modules() if isinstance(m, TransformerLayer))
        self.perturbations: list = []
        self.threads: set[str] = set()

    def describe(self) -> dict:
        model = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": VOCAB, "seq_length": SEQ}
        return {
            "mode": "generate",
            "model": model,
            "probes": [PROBE],
            "perturbation_kinds": ["zero"],
            "perturbations": self.perturbations,
        }

    def set_perturbations(self, perturbations: list) -> None:
        self.perturbations = perturbations

    def control(self, request: dict) -> None:
        raise MegatronConfigError("this engine generates; it does not train")

    def generate(self, request: dict, emit, cancelled) -> None:
        self.threads.add(threading.current_thread().name)
        rows = [encode(text) for text in request["prompts"]]
        emit(
            {
                "type": "start",
                "prompts": [{"ids": torch.tensor(r, dtype=torch.int32), "tokens": [chr(t) for t in r]} for r in rows],
            }
        )
        captured: dict[str, torch.Tensor] = {}
        hook = self.layer.register_forward_hook(lambda _m, _a, out: captured.__setitem__("resid", out[0].detach()))

        def on_token(step) -> bool:
            if request.get("probes"):
                resid = captured["resid"]  # [positions, batch, hidden] of the pass that predicted this token
                emit(
                    {
                        "type": "probe",
                        "name": PROBE,
                        "layer": 0,
                        "start": step.position - 1,
                        "end": step.position,
                        "data": resid[-1],
                    }
                )
            probs = step.logits.softmax(-1)
            top = probs.topk(request["alternatives"], dim=-1)
            tokens = [
                {"id": int(t), "text": chr(int(t)), "p": float(probs[i, t]), "in_prompt": bool(p), "done": bool(d)}
                for i, (t, p, d) in enumerate(zip(step.tokens, step.in_prompt, step.done))
            ]
            alternatives = [
                [{"id": int(j), "text": chr(int(j)), "p": v} for v, j in zip(top.values[i], top.indices[i])]
                for i in range(len(rows))
            ]
            emit({"type": "token", "position": step.position, "tokens": tokens, "alternatives": alternatives})
            time.sleep(self.delay)
            return cancelled()

        try:
            out = self.module.generate(rows, request["max_new_tokens"], temperature=0, on_token=on_token)
        finally:
            hook.remove()
        emit({"type": "finish", "texts": ["".join(map(chr, r)) for r in out.tokens], "reasons": out.stop_reasons})


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
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MegatronAppStrategy(),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    batch = {"tokens": torch.zeros(1, 16, dtype=torch.long), "labels": torch.zeros(1, 16, dtype=torch.long)}
    trainer.validate(module, DataLoader([batch], batch_size=None), verbose=False)
    yield module
    release_process_groups()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


def release_process_groups() -> None:
    """Destroy every process group of this process and drop each reference to one, so their destructors run
    here and not in a forked child."""
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for name, value in list(vars(parallel_state).items()):  # destroy_model_parallel leaves a few set
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)
    compat_megatron._MODEL_PARALLEL_GROUPS.clear()  # the strategy's record of the groups it created
    gc.collect()


@pytest.fixture
def server(module):
    with ScopeServer(TinyEngine(module)) as running:
        yield running


# -- clients ------------------------------------------------------------------------------------------------
class Client:
    """A real Socket.IO client; every event it receives is checked against the schema."""

    def __init__(self, server: ScopeServer, token: Optional[str] = None, on_event=None) -> None:
        self.events: queue.Queue = queue.Queue()
        self.invalid: list = []
        self.disconnected = threading.Event()
        self.sio = socketio.Client(reconnection=False)
        self.sio.on("event", on_event or self._record)
        self.sio.on("disconnect", lambda *_: self.disconnected.set())
        auth = {"token": server.token if token is None else token}
        self.sio.connect(f"http://127.0.0.1:{server.port}", auth=auth, transports=["websocket"], wait_timeout=5)

    def _record(self, event: dict) -> None:
        try:
            protocol.validate_event(event)
        except protocol.ProtocolError as error:
            self.invalid.append((event.get("type"), error.field, error.message))
        self.events.put(event)

    def send(self, message: Any) -> None:
        self.sio.emit("request", message)

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

    def close(self) -> None:
        self.sio.disconnect()
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
    wrong = "x" + server.token[1:]
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
    with ScopeServer(TinyEngine(module)) as server:
        assert server.token == "a-token-of-twenty-chars"
        assert server.url == f"http://127.0.0.1:{server.port}/?token=a-token-of-twenty-chars"
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(MegatronConfigError, match="16 characters"):
        ScopeServer(TinyEngine(module))
    monkeypatch.delenv(TOKEN_ENV)
    assert len(ScopeServer(TinyEngine(module)).token) >= 32


def test_page_needs_token_and_sends_security_headers(server, caplog):
    caplog.set_level(logging.DEBUG, logger="lightning_megatron.scope")
    assert http_get(server.port, "/")[0].status == 401
    assert http_get(server.port, "/?token=nope")[0].status == 403
    response, body = http_get(server.port, f"/?token={server.token}")
    assert response.status == 200
    assert b"protocol version 1" in body and b"not built" in body
    assert b"src=" not in body and b"href=" not in body  # self-contained
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
        with ScopeServer(TinyEngine(module), host="0.0.0.0") as server:
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
    with ScopeServer(TinyEngine(module), static_dir=static) as server:
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
    client.sio.emit("generate", {"prompts": ["x"]})
    assert client.next()["code"] == "unknown_type"
    client.sio.emit("request", (ping("a"), ping("b")))
    assert client.next()["code"] == "bad_request"
    # the engine's own refusal (prompt + tokens longer than the model's 32 positions) is a bad_request
    client.send(generate("long", ["x" * 30], max_new_tokens=8))
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
    # Socket.IO packets that do not parse are logged and ignored; the connection stays usable
    ws = raw_connection(server)
    ws.send('42["request",' + "[" * 20000 + "]" * 20000 + "]")  # deeper than the parser's stack
    ws.send('42["request",{"v": 1, "type": ')  # not JSON
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
    assert info["engine"]["probes"] == [PROBE]
    perturbations = [{"site": PROBE, "kind": "zero", "strength": 0.5}]
    assert client.ask({"v": 1, "type": "set_perturbations", "id": "s", "perturbations": perturbations})["type"] == "ack"
    reply = client.ask({"v": 1, "type": "train", "id": "t", "action": "step"})
    assert (reply["type"], reply["code"], reply["id"]) == ("error", "bad_request", "t")
    assert "does not train" in reply["message"]


# -- generation -----------------------------------------------------------------------------------------------
def reference_residuals(module: GPTModule, tokens: list[int]) -> torch.Tensor:
    """The first layer's output at every position of ``tokens`` ([seq, hidden]), by one full forward."""
    layer = next(m for m in unwrap_model(module.model_chunks[0]).modules() if isinstance(m, TransformerLayer))
    captured: dict[str, torch.Tensor] = {}

    def keep(_module, _args, output) -> None:
        captured.setdefault("resid", output[0].detach())

    hook = layer.register_forward_hook(keep)
    try:
        module.generate([tokens], 1, temperature=0)  # the prefill pass computes every position of tokens
    finally:
        hook.remove()
    return captured["resid"][:, 0].float()


def test_generate_streams_tokens_and_probes(module, server, client):
    prompts, n = ["Hello", "Hi"], 6
    client.send(generate("g", prompts, max_new_tokens=n, alternatives=3, probes=[{"name": PROBE}]))
    events = client.until(lambda e: e["type"] in ("finish", "error"))
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
    assert finish["texts"] == ["".join(map(chr, row)) for row in expected.tokens]

    tokens = [e for e in events if e["type"] == "token"]
    probes = [e for e in events if e["type"] == "probe"]
    assert len(tokens) == len(probes) == len(expected.tokens[0]) - len(prompts[1])
    assert kinds[1:3] == ["probe", "token"]  # a pass's probes come before its token
    references = [reference_residuals(module, row) for row in expected.tokens]
    for token, probe in zip(tokens, probes):
        position = token["position"]
        assert (probe["start"], probe["end"]) == (position - 1, position)
        assert len(token["alternatives"][0]) == 3
        data = protocol.decode_array(probe["data"])
        assert probe["data"]["dtype"] == "float16" and data.shape == (2, 32)
        for row, (ids, reference) in enumerate(zip(expected.tokens, references)):
            entry = token["tokens"][row]
            if position < len(ids):
                assert entry["id"] == ids[position]
            if not (entry["in_prompt"] or entry["done"]):
                top = token["alternatives"][row][0]
                assert top["id"] == entry["id"] and top["p"] == entry["p"]
            if position - 1 < len(ids):
                np.testing.assert_allclose(
                    data[row].astype(np.float32), reference[position - 1].numpy(), rtol=1e-2, atol=1e-2
                )
    # "Hi" generates while "Hello" still reads its prompt
    assert tokens[0]["tokens"][0]["in_prompt"] and not tokens[0]["tokens"][1]["in_prompt"]
    assert client.ask(ping("again"))["type"] == "pong"
    assert server.engine.threads == {"megascope-generate"}  # never a connection's thread


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


def test_busy_and_stop(module):
    with ScopeServer(TinyEngine(module, delay=0.1)) as server:
        client, other = Client(server), Client(server)
        client.send(generate("long", ["ab"], max_new_tokens=29))
        assert client.next()["type"] == "start"
        assert client.next()["type"] == "token"
        reply = other.ask(generate("second", ["cd"], max_new_tokens=2))
        assert (reply["type"], reply["code"], reply["id"]) == ("error", "busy", "second")
        assert other.ask({"v": 1, "type": "stop", "id": "halt"}) == {"v": 1, "type": "ack", "id": "halt"}
        events = client.until(lambda e: e["type"] == "finish")
        assert events[-1]["reasons"] == ["callback"]  # stopped before its 29 tokens
        # the next generation is accepted at once
        other.send(generate("third", ["cd"], max_new_tokens=2))
        assert other.until(lambda e: e["type"] in ("finish", "error"))[-1]["type"] == "finish"
        client.close()
        other.close()


def test_client_leaving_cancels_its_generation(module):
    engine = TinyEngine(module, delay=0.1)
    with ScopeServer(engine) as server:
        leaving = Client(server)
        leaving.send(generate("g", ["ab"], max_new_tokens=29))
        assert leaving.next()["type"] == "start"
        leaving.sio.disconnect()
        other = Client(server)
        deadline = time.monotonic() + 20
        while True:
            other.send(generate("next", ["cd"], max_new_tokens=1))
            reply = other.next()
            if reply["type"] == "start" or time.monotonic() > deadline:
                break
            assert reply["code"] == "busy"
            time.sleep(0.1)
        assert reply["type"] == "start"
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
    server = ScopeServer(TinyEngine(module)).start()
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
    again = ScopeServer(TinyEngine(module), port=port).start()
    assert again.port == port
    second = Client(again)
    assert second.ask(ping())["type"] == "pong"
    second.close()
    again.stop()
    server.stop()  # idempotent
