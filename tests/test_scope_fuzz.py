"""MegaScope's server under property-based requests: every request drawn from the protocol's schema (valid,
near-valid and mutated) and every malformed Socket.IO packet gets a result or an error naming what was wrong,
never an internal error and never silence, and the server keeps answering a good request afterwards.

The real server, the real ``ScopeEngine`` over a tiny GPT on CPU and real python-socketio clients (those of
``test_scope_server``). Requests are generated from ``schema/megascope-v1.schema.json`` itself, so a field added
to the protocol is fuzzed without editing this file."""

from __future__ import annotations

import json
import queue
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_scope_server import Client, module, ping, quick_client_close, real_engine  # noqa: F401  (fixtures)

from lightning_megatron.scope import protocol
from lightning_megatron.scope.server import ScopeServer

SCHEMA = protocol.load_schema()
DEFS = SCHEMA["$defs"]
EXAMPLES = 100
LONELY = ["\ud800", "\udfff", "a\udc00b"]

# Values that have broken servers: tiny and huge numbers, lone surrogates, wrong types.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 99, 2**31, 2**63, 2**70, -(2**70), 10**300]),
    st.sampled_from([1e-300, 5e-324, -0.0, 1e300, float("nan"), float("inf")]),
    st.sampled_from(LONELY),
    st.text(max_size=8),
    st.lists(st.integers(-3, 300), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = DEFS[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _number(schema: dict, integer: bool) -> st.SearchStrategy:
    low = schema.get("minimum", schema.get("exclusiveMinimum", -1000))
    high = schema.get("maximum", 1000)
    if integer:
        low, high = int(max(low, -(2**40))), int(min(high, 2**40))
        edges = [low, high, low - 1, high + 1]
        return st.one_of(st.integers(low, min(high, low + 40)), st.sampled_from(edges))
    edges = [low, high, 1e-300, 5e-324, high * (1 - 1e-16), high + 1]
    return st.one_of(st.floats(low, high, allow_nan=False), st.sampled_from(edges))


def _text(schema: dict) -> st.SearchStrategy:
    parts = [st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 12), 12))]
    if "pattern" in schema:
        parts.append(st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= 64))
    parts.append(st.sampled_from(LONELY))
    return st.one_of(*parts)


def from_schema(schema: dict, depth: int = 0) -> st.SearchStrategy:
    """Values close to ``schema``: mostly valid, sometimes just outside (bounds, junk, extra or missing fields)."""
    schema = _resolve(schema)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of(*[from_schema(branch, depth + 1) for branch in schema["oneOf"]])
    kinds = schema.get("type", "object")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    choices = []
    for kind in kinds:
        if kind == "object":
            choices.append(_object(schema, depth))
        elif kind == "array":
            items = from_schema(schema.get("items", {}), depth + 1) if depth < 4 else JUNK
            choices.append(
                st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
            )
        elif kind in ("integer", "number"):
            choices.append(_number(schema, kind == "integer"))
        elif kind == "string":
            choices.append(_text(schema))
        elif kind == "boolean":
            choices.append(st.booleans())
        elif kind == "null":
            choices.append(st.none())
    return st.one_of(*choices) if choices else JUNK


@st.composite
def _object(draw: Any, schema: dict, depth: int) -> dict:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    value = {}
    for name, sub in properties.items():
        if name in required or draw(st.booleans()):
            value[name] = draw(from_schema(sub, depth + 1) if depth < 4 else JUNK)
    mutation = draw(st.integers(0, 9))
    if mutation == 0 and value:  # a field of the wrong kind
        value[draw(st.sampled_from(sorted(value)))] = draw(JUNK)
    elif mutation == 1 and value:  # a required field missing
        value.pop(draw(st.sampled_from(sorted(value))))
    elif mutation == 2:  # an unknown field
        value[draw(st.sampled_from(["extra", "__proto__", "\ud800"]))] = draw(JUNK)
    return value


def _request(kind: str) -> st.SearchStrategy:
    name = protocol.REQUEST_TYPES[kind]
    return from_schema(DEFS[name]).map(lambda r: {**r, "id": r.get("id", "r")} if isinstance(r, dict) else r)


def _small_generation(request: Any) -> Any:
    """Generations short enough for the test's time budget (a few positions of a 32-position model)."""
    if isinstance(request, dict) and request.get("type") == "generate":
        if isinstance(request.get("max_new_tokens"), int) and request["max_new_tokens"] > 4:
            request = {**request, "max_new_tokens": 4}
        if isinstance(request.get("probes"), list):
            request = {**request, "probes": request["probes"][:2]}
    return request


REQUESTS = st.one_of(*[_request(kind) for kind in protocol.REQUEST_TYPES]).map(_small_generation)


@pytest.fixture(scope="module")
def fuzzed(module):  # noqa: F811
    with ScopeServer(real_engine(module)) as server:
        client = Client(server)
        yield server, client
        client.close()


def _collect(client: Client, until: Any, timeout: float = 30.0) -> list[dict]:
    events, deadline = [], time.monotonic() + timeout
    while True:
        try:
            events.append(client.next(max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout} s; got {events}") from None
        if until(events[-1]):
            return events


def _check_errors(events: list[dict], context: Any) -> None:
    for event in events:
        if event["type"] == "error":
            assert event["code"] in protocol.ERROR_CODES and event["code"] != "internal", (context, event)
            assert event["message"], (context, event)
            if event["code"] == "invalid_field":
                assert "field" in event, (context, event)


def _still_answers(client: Client, n: int) -> None:
    rid = f"alive{n}"
    client.send(ping(rid))
    events = _collect(client, lambda e: e.get("id") == rid and e["type"] == "pong")
    _check_errors(events, "ping")


COUNTER = iter(range(10**9))


def _has_huge_integer(value: Any) -> bool:
    """An integer python-engineio's JSON parser refuses (over 100 digits)."""
    if isinstance(value, dict):
        return any(_has_huge_integer(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_huge_integer(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and len(str(abs(value))) > 100


def _perturbations(*items: dict) -> dict:
    return {"v": 1, "type": "set_perturbations", "id": "p", "perturbations": list(items)}


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
@given(request=REQUESTS)
# what a tester found: each once answered with an internal error or acknowledged and then ignored
@example(request={"v": 1, "type": "generate", "id": "g", "prompts": ["ab"], "temperature": 1e-300, "max_new_tokens": 2})
@example(request={"v": 1, "type": "generate", "id": "g", "prompts": ["ab"], "temperature": 1, "top_p": 1e-300})
@example(request={"v": 1, "type": "generate", "id": "g", "prompts": ["a\ud800"]})
@example(request=_perturbations({"site": "blocks.*.hook_resid_post", "kind": "zero", "layers": [99]}))
@example(request=_perturbations({"site": "blocks.0.attn.hook_q", "kind": "zero", "heads": [99]}))
@example(request=_perturbations({"site": "blocks.*.attn.hook_k", "kind": "zero", "heads": [4]}))
@example(request=_perturbations({"site": "blocks.0.hook_resid_post", "kind": "zero", "layers": [1]}))
def test_every_request_is_served_or_named(fuzzed, request):
    server, client = fuzzed
    rid = protocol.request_id_of(request)
    try:
        expected = protocol.validate_request(request)
        refused = None
    except protocol.ProtocolError as error:
        expected, refused = None, error
    if _has_huge_integer(request):  # the packet does not decode: nothing of it is known, the whole is refused
        expected, refused, rid = None, protocol.ProtocolError("bad_request", "", "too many digits"), None
    client.send(request)
    if refused is not None:
        reply = _collect(client, lambda e: e["type"] == "error")[-1]
        assert (reply["code"], reply.get("field"), reply.get("id")) == (refused.code, refused.field, rid), request
    else:
        kind = expected["type"]
        final = {"generate": ("finish",), "ping": ("pong",), "info": ("info",)}.get(kind, ("ack",))
        events = _collect(client, lambda e: e.get("id") == rid and (e["type"] in final or e["type"] == "error"))
        _check_errors(events, request)
        if kind == "train":
            assert events[-1]["code"] == "bad_request"  # this engine serves generation
        if kind == "set_perturbations" and events[-1]["type"] == "ack":  # acknowledged: it is applied, in range
            client.send({"v": 1, "type": "info", "id": "active"})
            info = _collect(client, lambda e: e.get("id") == "active")[-1]["engine"]
            layers, heads = info["model"]["num_layers"], info["model"]["num_heads"]
            for item in info["perturbations"]:
                assert all(0 <= layer < layers for layer in item["layers"] or ()), (request, item)
                assert all(0 <= head < heads for head in item["heads"] or ()), (request, item)
            client.send({"v": 1, "type": "set_perturbations", "id": "clear", "perturbations": []})
            _collect(client, lambda e: e.get("id") == "clear")
    assert not client.invalid, client.invalid
    _still_answers(client, next(COUNTER))


PACKETS = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
    st.integers(1, 1200).map(lambda n: "[" * n + "]" * n),
    st.integers(4301, 6000).map(lambda n: '{"v":1,"type":"ping","id":"' + "x" * 3 + '","n":' + "9" * n + "}"),
    st.sampled_from(["", "null", "[]", "{}", "[1]", '{"_placeholder":true,"num":0}', "1e999", "-", '"\\ud800"']),
)


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
@given(body=PACKETS)
def test_every_malformed_packet_is_answered(fuzzed, body):
    """A Socket.IO event packet whose payload is anything: an answer before the next request's."""
    server, client = fuzzed
    client.send_packet('2["request",' + body + "]")  # a Socket.IO EVENT
    rid = f"after{next(COUNTER)}"
    client.send(ping(rid))
    events = _collect(client, lambda e: e.get("id") == rid and e["type"] == "pong")
    _check_errors(events, body)
    assert len(events) >= 2, f"no answer to {body[:80]!r}"


@pytest.mark.parametrize(
    "packet, attachments",
    [
        ('51-["request",{"_placeholder":true,"num":5}]', [b"x"]),  # names an attachment that never came
        ('51-["request",{"_placeholder":true,"num":"0"}]', [b"x"]),  # num of the wrong type
        ('51-["request",{"_placeholder":true,"num":0}]', [b"\x80\x04K\x01."]),  # bytes (a pickle) as a request
        ('51-[{"_placeholder":true,"num":0},{}]', [b"request"]),  # bytes as the event's name
        (
            '2["request",'
            + json.dumps({"v": 1, "type": "ping", "id": "big", "n": 1}).replace("1}", "9" * 5000 + "}")
            + "]",
            [],
        ),
    ],
)
def test_bad_binary_placeholders_and_huge_integers(fuzzed, packet, attachments):
    server, client = fuzzed
    client.send_packet(packet)
    for attachment in attachments:
        client.send_packet(attachment)
    reply = client.next()
    assert reply["type"] == "error" and reply["code"] in ("bad_request", "unknown_type"), reply
    _still_answers(client, next(COUNTER))
