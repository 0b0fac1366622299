"""MegaScope's wire protocol v1: what a client may send, what it receives, how arrays travel.

Contract: ``schema/megascope-v1.schema.json`` (JSON Schema 2020-12, shipped in the wheel) is the protocol;
this module applies it and nothing else decides what is valid. ``validate_request(message)`` returns the
request with the schema's defaults filled in, or raises :class:`ProtocolError` whose ``field`` is a JSON
pointer to the offending value, so a client is told exactly what to fix and the connection stays usable.
Nothing a client sends is ever evaluated, unpickled or used as a file path: probe names and reducers are
data, checked by pattern and range (MegatronApp evaluated a Python expression sent by the browser).

``encode_event(event)`` turns an engine's event into what goes on the wire: every ``torch.Tensor`` or
``numpy.ndarray`` (wrap it in :class:`Array` to choose the encoding) becomes a binary frame
``{"dtype", "shape", "data": bytes[, "scale", "offset"]}`` that python-socketio sends as a binary attachment
(no JSON float lists); 0-d tensors and numpy scalars become plain numbers. Non-finite values survive, because
they are what a bit-flip experiment produces: float frames keep NaN and infinities bit-exact (float16 unless a
finite value would overflow it, then float32, so no finite value becomes an infinity), uint8 frames reserve
codes 253/254/255 for NaN/+inf/-inf, and JSON floats that are not finite become the strings ``"NaN"``,
``"Infinity"``, ``"-Infinity"`` (JSON has no such numbers; browsers reject Python's ``NaN`` token).

The :class:`Engine` protocol is the contract between the server and the model side (``scope.engine``).
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, Optional, Protocol

import numpy as np
import torch
from jsonschema import Draft202012Validator, validators

__all__ = [
    "ERROR_CODES",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Array",
    "Engine",
    "ProtocolError",
    "decode_array",
    "decode_float",
    "encode_array",
    "encode_event",
    "load_schema",
    "request_id_of",
    "validate_event",
    "validate_request",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
"""Largest client message; a longer one closes that client's connection (websocket close 1009)."""

ERROR_CODES = (
    "bad_request",
    "unknown_type",
    "invalid_field",
    "too_large",
    "unsupported_version",
    "busy",
    "unauthorized",
    "internal",
)
REQUEST_TYPES = {
    "ping": "PingRequest",
    "info": "InfoRequest",
    "generate": "GenerateRequest",
    "stop": "StopRequest",
    "set_perturbations": "SetPerturbationsRequest",
    "train": "TrainRequest",
}
GENERATION_EVENTS = frozenset({"start", "token", "probe", "attention", "pca", "finish"})
"""What ``Engine.generate`` may emit."""
BROADCAST_EVENTS = frozenset({"train_step", "train_state", "probe", "attention"})
"""What a training run may publish to every client."""
DROPPABLE_EVENTS = frozenset({"probe", "attention"})
"""What the server drops, oldest first, when a client reads too slowly."""

_FLOAT16_MAX = 65504.0
_UINT8_LEVELS = 252  # codes 0..252 are values; 253 NaN, 254 +inf, 255 -inf
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class ProtocolError(ValueError):
    """A message the protocol does not allow; ``code`` is one of ``ERROR_CODES``, ``field`` a JSON pointer."""

    def __init__(self, code: str, field: Optional[str], message: str) -> None:
        super().__init__(message)
        self.code, self.field, self.message = code, field, message

    def event(self, request_id: Optional[str] = None) -> dict[str, Any]:
        event: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": "error", "code": self.code, "message": self.message}
        if self.field is not None:
            event["field"] = self.field
        if request_id is not None:
            event["id"] = request_id
        return event


class Engine(Protocol):
    """The model side the server drives. The server calls every method from its own worker threads, never
    from a connection's thread; ``set_perturbations`` and ``control`` may run while ``generate`` does, so an
    engine that supports that must make them thread-safe. Requests arrive validated, defaults filled in."""

    def describe(self) -> dict:
        """JSON-able facts for the ``info`` event ($defs/EngineInfo): ``mode`` ("generate" or "train"),
        ``model`` (shape), ``layout``, ``probes`` (names a probe pattern may match), ``default_probes``,
        ``perturbation_kinds``, ``perturbation_groups``, ``perturbations`` (the active set), ``limits``."""
        ...

    def generate(self, request: dict, emit: Callable[[dict], None], cancelled: Callable[[], bool]) -> None:
        """Run one ``generate`` request: ``emit`` start; after each forward pass its token event, then its
        probe/attention events (a client may get either order; the token first is what a reader waits for);
        pca events if asked; last, finish (per prompt ``reasons``: "callback" for those
        still running once ``cancelled()`` turned true; check it between tokens). Events are dicts as in
        $defs/Event without ``v``/``id`` (the server adds them); arrays may be tensors, ndarrays or
        :class:`Array`. ``emit`` may block while the client catches up, and raises (TypeError, ValueError) for
        an event the wire cannot carry. Raise ``MegatronConfigError`` for values this model cannot serve (the
        client gets ``bad_request`` with the message), or a :class:`ProtocolError` to name the field; any other
        exception becomes ``internal``."""
        ...

    def set_perturbations(self, perturbations: list[dict]) -> None:
        """Replace the active set with ``perturbations`` ($defs/Perturbation items; empty removes all). Refuse,
        rather than accept and ignore, what the model cannot apply (``scope.perturb.requested`` does)."""
        ...

    def control(self, request: dict) -> None:
        """Training commands (a ``train`` request: pause, resume, step). Engines that do not train raise
        ``MegatronConfigError``."""
        ...


# -- the schema ---------------------------------------------------------------------------------------------
@functools.cache
def load_schema() -> dict[str, Any]:
    """The protocol's JSON Schema, as shipped in the package."""
    text = resources.files("lightning_megatron.scope").joinpath("schema/megascope-v1.schema.json").read_text("utf-8")
    return json.loads(text)


# JSON Schema counts 1.0 as an integer; an engine doing range(1.0) would fail, so integers must be ints.
_Validator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, x: isinstance(x, int) and not isinstance(x, bool)
    ),
)


@functools.cache
def _validator(definition: str) -> Any:
    return _Validator({**load_schema(), "$ref": f"#/$defs/{definition}"})


def _resolve(schema: Any) -> Any:
    while isinstance(schema, dict) and "$ref" in schema:
        schema = load_schema()["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _branch_for(branches: list, instance: Any) -> Optional[dict]:
    """The ``oneOf`` branch whose discriminator (``kind`` or ``type``: const or enum) matches ``instance``."""
    if not isinstance(instance, dict):
        return None
    for branch in branches:
        properties = _resolve(branch).get("properties", {})
        for key in ("kind", "type"):
            if key in properties and key in instance:
                allowed = properties[key].get("enum", [properties[key].get("const")])
                if instance[key] in allowed and isinstance(instance[key], str):
                    return branch
    return None


def _pointer(path: Any) -> str:
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


def _describe(error: Any, path: tuple) -> ProtocolError:
    """The error for one jsonschema error at ``path``. Messages never echo the client's value."""
    where, value = _pointer(path), error.validator_value
    keyword = error.validator
    if keyword == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return ProtocolError("invalid_field", where + _pointer([extra[0]]), "unknown field")
    if keyword == "required":
        missing = [name for name in value if name not in error.instance]
        return ProtocolError("invalid_field", where + _pointer([missing[0]]), "missing")
    if keyword == "oneOf":
        branches = [_resolve(branch) for branch in value]
        key = "kind" if any("kind" in b.get("properties", {}) for b in branches) else "type"
        if not isinstance(error.instance, dict):
            return ProtocolError("invalid_field", where, "must be an object")
        names = [n for b in branches for n in b["properties"][key].get("enum", [b["properties"][key].get("const")])]
        return ProtocolError("invalid_field", f"{where}/{key}", f"must be one of {names}")
    messages = {
        "type": lambda: f"must be of type {value if isinstance(value, str) else ' or '.join(value)}",
        "enum": lambda: f"must be one of {json.dumps(value)}",
        "const": lambda: f"must be {json.dumps(value)}",
        "pattern": lambda: f"must match {value}",
        "minLength": lambda: f"must have at least {value} characters",
        "maxLength": lambda: f"must have at most {value} characters",
        "minItems": lambda: f"must have at least {value} items",
        "maxItems": lambda: f"must have at most {value} items",
        "minimum": lambda: f"must be >= {value}",
        "maximum": lambda: f"must be <= {value}",
        "exclusiveMinimum": lambda: f"must be > {value}",
        "exclusiveMaximum": lambda: f"must be < {value}",
    }
    message = messages[keyword]() if keyword in messages else "not allowed here"
    code = "too_large" if keyword in ("maxLength", "maxItems", "maxProperties") else "invalid_field"
    return ProtocolError(code, where, message)


def _first_error(validator: Any, instance: Any, prefix: tuple = ()) -> Optional[ProtocolError]:
    errors = list(validator.iter_errors(instance))
    if not errors:
        return None
    # Prefer concrete errors over a failed oneOf, then document order; a oneOf is judged by its discriminated branch.
    error = min(errors, key=lambda e: (e.validator == "oneOf", [str(p) for p in e.absolute_path]))
    path = prefix + tuple(error.absolute_path)
    if error.validator == "oneOf":
        branch = _branch_for(error.validator_value, error.instance)
        if branch is not None:
            inner = _first_error(_validator(branch["$ref"].rsplit("/", 1)[1]), error.instance, path)
            if inner is not None:
                return inner
    return _describe(error, path)


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): JSON can carry it, no tokenizer or UTF-8 can
        return False
    return True


def _unusable(message: Any) -> Optional[ProtocolError]:
    """The first NaN or infinity (Python's json parser accepts them; JSON Schema ranges do not catch NaN) or
    string holding a lone surrogate, as an error at its path. Iterative: a deeply nested message must not
    exhaust the stack."""
    stack: list[tuple[tuple, Any]] = [((), message)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return ProtocolError("invalid_field", _pointer(path), "must be a finite number")
        if isinstance(value, str) and not _is_text(value):
            return ProtocolError("invalid_field", _pointer(path), "must be Unicode text (a lone surrogate is not)")
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and not _is_text(key):
                    return ProtocolError("invalid_field", _pointer(path), "field names must be Unicode text")
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend(reversed([((*path, key), child) for key, child in children]))
    return None


def _fill_defaults(instance: Any, schema: Any) -> None:
    schema = _resolve(schema)
    if not isinstance(schema, dict):
        return
    if "oneOf" in schema:
        branch = _branch_for(schema["oneOf"], instance)
        if branch is not None:
            _fill_defaults(instance, branch)
        return
    if isinstance(instance, dict):
        for name, sub in schema.get("properties", {}).items():
            for candidate in (sub, _resolve(sub)):
                if name not in instance and isinstance(candidate, dict) and "default" in candidate:
                    instance[name] = copy.deepcopy(candidate["default"])
            if name in instance:
                _fill_defaults(instance[name], sub)
    elif isinstance(instance, list) and "items" in schema:
        for item in instance:
            _fill_defaults(item, schema["items"])


def request_id_of(message: Any) -> Optional[str]:
    """The message's ``id`` if it is a well-formed one (so even a rejected request's error can carry it)."""
    rid = message.get("id") if isinstance(message, dict) else None
    ok = isinstance(rid, str) and 1 <= len(rid) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-") for c in rid)
    return rid if ok else None


def validate_request(message: Any) -> dict[str, Any]:
    """A copy of ``message`` with defaults filled in, or :class:`ProtocolError` naming the bad field."""
    if not isinstance(message, dict):
        raise ProtocolError("bad_request", "", "a request is one JSON object")
    bad = _unusable(message)
    if bad is not None:
        raise bad
    if message.get("v") != PROTOCOL_VERSION or isinstance(message.get("v"), bool):
        raise ProtocolError("unsupported_version", "/v", f"this server speaks protocol version {PROTOCOL_VERSION}")
    kind = message.get("type")
    if not isinstance(kind, str) or kind not in REQUEST_TYPES:
        raise ProtocolError("unknown_type", "/type", f"must be one of {sorted(REQUEST_TYPES)}")
    error = _first_error(_validator(REQUEST_TYPES[kind]), message)
    if error is not None:
        raise error
    request = copy.deepcopy(message)
    _fill_defaults(request, {"$ref": f"#/$defs/{REQUEST_TYPES[kind]}"})
    if kind == "train" and request["action"] == "step":
        request.setdefault("steps", 1)
    return request


def validate_event(event: Any) -> None:
    """Check an encoded event against $defs/Event (for tests and engine authors); :class:`ProtocolError`."""
    kind = event.get("type") if isinstance(event, dict) else None
    name = "".join(part.capitalize() for part in str(kind).split("_")) + "Event"
    if name not in load_schema()["$defs"]:
        raise ProtocolError("unknown_type", "/type", f"no event type {kind!r}")
    error = _first_error(_validator(name), event)
    if error is not None:
        raise error


# -- arrays and events --------------------------------------------------------------------------------------
class Array:
    """An array with its wire encoding chosen: ``dtype`` "float16" (default for floats), "float32", "int32"
    (default for integers) or "uint8" (quantized; ``low``/``high`` fix the range, e.g. 0..1 for attention
    probabilities, else the finite min/max; values outside are clamped)."""

    __slots__ = ("dtype", "high", "low", "value")

    def __init__(
        self, value: Any, dtype: Optional[str] = None, *, low: Optional[float] = None, high: Optional[float] = None
    ):
        if dtype not in (None, "float16", "float32", "int32", "uint8"):
            raise ValueError(f"Array dtype={dtype!r}: one of float16, float32, int32, uint8.")
        self.value, self.dtype, self.low, self.high = value, dtype, low, high


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.is_floating_point() and value.dtype not in (torch.float16, torch.float32, torch.float64):
            value = value.float()  # bfloat16, float8: numpy has no such dtype
        return value.cpu().numpy()
    return np.asarray(value)


def encode_array(
    value: Any, dtype: Optional[str] = None, *, low: Optional[float] = None, high: Optional[float] = None
) -> dict:
    """A tensor or ndarray as a binary frame ($defs/Array)."""
    array = _numpy(value)
    shape = [int(n) for n in array.shape]
    if array.dtype.kind in "biu":
        if dtype not in (None, "int32"):
            array = array.astype(np.float64)
        else:
            if array.size and (array.min() < -(2**31) or array.max() > 2**31 - 1):
                raise ValueError("an integer array does not fit int32; send it as floats")
            return {"dtype": "int32", "shape": shape, "data": array.astype("<i4", copy=False).tobytes()}
    if array.dtype.kind != "f":
        raise TypeError(f"cannot send an array of dtype {array.dtype}")
    if dtype == "int32":
        raise TypeError("int32 frames carry integer arrays; this one holds floats")
    if dtype == "uint8":
        return _quantize(array.astype(np.float64), low, high, shape)
    finite = np.isfinite(array)
    largest = float(np.abs(array[finite]).max()) if finite.any() else 0.0
    wire = "float32" if dtype == "float32" or largest > _FLOAT16_MAX else "float16"
    return {"dtype": wire, "shape": shape, "data": array.astype("<f4" if wire == "float32" else "<f2").tobytes()}


def _quantize(array: np.ndarray, low: Optional[float], high: Optional[float], shape: list[int]) -> dict:
    finite = np.isfinite(array)
    values = array[finite]
    low = float(values.min()) if low is None and values.size else 0.0 if low is None else float(low)
    high = float(values.max()) if high is None and values.size else low if high is None else float(high)
    if not (math.isfinite(low) and math.isfinite(high)) or high < low:
        raise ValueError(f"uint8 range [{low}, {high}] must be finite and ordered")
    scale = (high - low) / _UINT8_LEVELS if high > low else 1.0
    codes = np.clip(np.rint((np.where(finite, array, low) - low) / scale), 0, _UINT8_LEVELS).astype(np.uint8)
    codes[np.isnan(array)] = 253
    codes[array == np.inf] = 254
    codes[array == -np.inf] = 255
    return {"dtype": "uint8", "shape": shape, "scale": scale, "offset": low, "data": codes.tobytes()}


def decode_array(frame: Mapping[str, Any]) -> np.ndarray:
    """A received frame back as an ndarray (uint8 frames as float32 values)."""
    dtype, shape = frame["dtype"], tuple(frame["shape"])
    wire = {"float16": "<f2", "float32": "<f4", "int32": "<i4", "uint8": "u1"}[dtype]
    array = np.frombuffer(frame["data"], dtype=wire).reshape(shape)
    if dtype != "uint8":
        return array
    values = (frame["offset"] + array.astype(np.float64) * frame["scale"]).astype(np.float32)
    values[array == 253] = np.nan
    values[array == 254] = np.inf
    values[array == 255] = -np.inf
    return values


def decode_float(value: Any) -> Any:
    """$defs/Float back to a Python float ("NaN", "Infinity", "-Infinity" included)."""
    return _NON_FINITE[value] if isinstance(value, str) and value in _NON_FINITE else value


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, Array):
        return encode_array(value.value, value.dtype, low=value.low, high=value.high)
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return _encode(value.item(), where) if value.ndim == 0 else encode_array(value)
    if isinstance(value, np.generic):
        return _encode(value.item(), where)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"event field {where or '/'}: keys must be strings")
        return {key: _encode(item, f"{where}/{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(item, f"{where}/{i}") for i, item in enumerate(value)]
    raise TypeError(f"event field {where or '/'}: cannot send a {type(value).__name__}")


def encode_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """An engine's event as sent: arrays as binary frames, scalars as JSON numbers, non-finite floats as strings."""
    if not isinstance(event, Mapping) or not isinstance(event.get("type"), str):
        raise TypeError("an event is a mapping with a string 'type'")
    return _encode(event, "")
