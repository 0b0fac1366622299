"""Strict checks of a Chrome Trace Event Format file: what Perfetto and chrome://tracing would silently drop.

Viewers are lenient: an unmatched ``B``, a flow without its other end or a slice out of order does not fail the
load, it just vanishes or renders wrongly, which is exactly how a trace tool's bugs go unnoticed. So the tests
of the writer and of the aggregator run every file they produce through ``validate_trace``, which reports
instead of tolerating:

* the file is JSON (object form ``{"traceEvents": [...]}`` or array form, plain or gzip); the array form may
  lack its closing ``]`` (a rank file still being written), but a line cut in half is an error; ``NaN`` and
  ``Infinity`` are not JSON;
* every event has a known ``ph``, ``pid``, ``tid`` where the phase needs one, a finite numeric ``ts`` (all but
  metadata), a ``name``; ``X`` has ``dur ≥ 0``;
* per (pid, tid), slice events (``B``/``E``/``X``) have non-decreasing timestamps in file order, and every ``B``
  is closed by an ``E`` in LIFO order;
* flows: per (cat, id) exactly one ``s`` and one ``f`` (any number of ``t``), the ``f`` not before the ``s``,
  both bound to a slice on their thread (the ``s`` and a ``bp: "e"`` ``f`` inside one, a plain ``f`` before the
  start of one), since an unbound flow is not drawn;
* metadata events are well-formed (``process_name`` / ``thread_name`` with a string ``args.name``,
  ``*_sort_index`` with an integer ``args.sort_index``, ``args`` an object).
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["validate_trace", "validate_events"]

MAX_ERRORS = 200

# Every phase of the Trace Event Format (including the deprecated async ones S/T/p/F and object/memory events).
PHASES = frozenset("BEXiICbneSTpFstfPNODMVvRc()=")
NEEDS_TID = frozenset("BEXstf")
SLICES = frozenset("BEX")
FLOWS = frozenset("stf")
NEEDS_ID = frozenset("bneSTpFstfNOD")
INSTANT_SCOPES = ("g", "p", "t")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _load(path: Path) -> tuple[Any, list[str]]:
    """The parsed document, or None and the reason it is not one."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError) as err:
            return None, [f"gzip stream is damaged or cut short: {err}"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, [f"not UTF-8: {err}"]
    try:
        return json.loads(text, parse_constant=_reject_constant), []
    except (json.JSONDecodeError, ValueError) as err:
        first_error = f"not valid JSON: {err}"
    stripped = text.rstrip()
    if stripped.startswith("[") and not stripped.endswith("]"):
        # JSON Array Format allows the closing bracket to be missing (a trace still being written or cut short).
        try:
            return json.loads(stripped.rstrip(",") + "]", parse_constant=_reject_constant), []
        except (json.JSONDecodeError, ValueError) as err:
            return None, [f"not valid JSON even with the optional closing ']' added: {err}"]
    return None, [first_error]


def validate_trace(path: str | Path) -> list[str]:
    """Every violation of the Trace Event Format in the file at ``path``; an empty list means valid."""
    document, errors = _load(Path(path))
    if errors:
        return errors
    if isinstance(document, dict):
        events = document.get("traceEvents")
        if not isinstance(events, list):
            return ["object form without a 'traceEvents' list"]
        unit = document.get("displayTimeUnit")
        if unit is not None and unit not in ("ms", "ns"):
            errors.append(f"displayTimeUnit must be 'ms' or 'ns', not {unit!r}")
    elif isinstance(document, list):
        events = document
    else:
        return [f"top level must be an object or an array, not {type(document).__name__}"]
    return errors + validate_events(events)


class _Errors(list):
    """A list of messages that stops growing at MAX_ERRORS and counts the rest."""

    dropped = 0

    def add(self, message: str) -> None:
        if len(self) < MAX_ERRORS:
            self.append(message)
        else:
            self.dropped += 1


def validate_events(events: list[Any]) -> list[str]:
    """The checks of ``validate_trace`` on an already parsed event list."""
    errors = _Errors()
    stacks: dict[tuple[Any, Any], list[tuple[int, str, float]]] = defaultdict(list)
    last_ts: dict[tuple[Any, Any], float] = {}
    slices: dict[tuple[Any, Any], list[tuple[float, float]]] = defaultdict(list)
    flows: dict[tuple[Any, str], dict[str, list[tuple[int, float, tuple[Any, Any], Any]]]] = defaultdict(
        lambda: {"s": [], "t": [], "f": []}
    )

    for index, event in enumerate(events):
        where = f"event {index}"
        if not isinstance(event, dict):
            errors.add(f"{where}: not an object")
            continue
        ph = event.get("ph")
        where = f"event {index} ({event.get('name')!r}, ph={ph!r})"
        if not isinstance(ph, str) or ph not in PHASES:
            errors.add(f"{where}: unknown or missing phase")
            continue
        if ph != "E" and not isinstance(event.get("name"), str):
            errors.add(f"{where}: missing or non-string name")
        if not _is_id(event.get("pid")):
            errors.add(f"{where}: missing or invalid pid")
            continue
        needs_tid = ph in NEEDS_TID or (ph in "iI" and event.get("s", "t") == "t")
        if needs_tid and not _is_id(event.get("tid")):
            errors.add(f"{where}: missing or invalid tid")
            continue
        if ph == "M":
            _check_metadata(event, where, errors)
            continue
        ts = event.get("ts")
        if not _is_number(ts) or not math.isfinite(ts):
            errors.add(f"{where}: missing or non-numeric ts")
            continue
        thread = (event["pid"], event.get("tid"))
        if ph in NEEDS_ID and not (_is_id(event.get("id")) or isinstance(event.get("id2"), dict)):
            errors.add(f"{where}: missing id")
            continue
        if ph in SLICES:
            if thread in last_ts and ts < last_ts[thread]:
                errors.add(f"{where}: ts {ts} before the previous slice event's {last_ts[thread]} on pid/tid {thread}")
            last_ts[thread] = max(ts, last_ts.get(thread, ts))
        if ph == "X":
            dur = event.get("dur")
            if not _is_number(dur) or not math.isfinite(dur) or dur < 0:
                errors.add(f"{where}: X needs a finite dur >= 0, has {dur!r}")
            else:
                slices[thread].append((ts, ts + dur))
        elif ph == "B":
            stacks[thread].append((index, event["name"], ts))
        elif ph == "E":
            if not stacks[thread]:
                errors.add(f"{where}: E without an open B on pid/tid {thread}")
            else:
                _, name, start = stacks[thread].pop()
                if "name" in event and event["name"] != name:
                    errors.add(f"{where}: E named {event['name']!r} closes B {name!r} (not LIFO)")
                slices[thread].append((start, ts))
        elif ph in FLOWS:
            if not isinstance(event.get("cat"), str):
                errors.add(f"{where}: flow event without a cat")
                continue
            if ph == "f" and event.get("bp", "e") != "e":
                errors.add(f"{where}: bp must be 'e' when given, not {event.get('bp')!r}")
            key = (json.dumps(event.get("id", event.get("id2")), sort_keys=True), event["cat"])
            flows[key][ph].append((index, ts, thread, event.get("bp")))
        elif ph in "iI" and event.get("s", "t") not in INSTANT_SCOPES:
            errors.add(f"{where}: instant scope must be one of g/p/t, not {event.get('s')!r}")
        elif ph == "C":
            args = event.get("args")
            if not isinstance(args, dict) or not all(_is_number(v) for v in args.values()):
                errors.add(f"{where}: counter needs args of numbers")

    for thread, stack in stacks.items():
        for index, name, _ in stack:
            errors.add(f"event {index} ({name!r}, ph='B'): never closed by an E on pid/tid {thread}")
    _check_flows(flows, slices, errors)
    if errors.dropped:
        errors.append(f"... and {errors.dropped} more errors")
    return list(errors)


def _check_metadata(event: dict[str, Any], where: str, errors: _Errors) -> None:
    args = event.get("args")
    if not isinstance(args, dict):
        errors.add(f"{where}: metadata needs an args object")
        return
    name = event["name"] if isinstance(event.get("name"), str) else ""
    if name in ("process_name", "thread_name") and not isinstance(args.get("name"), str):
        errors.add(f"{where}: {name} needs a string args.name")
    elif name in ("process_sort_index", "thread_sort_index") and not (
        isinstance(args.get("sort_index"), int) and not isinstance(args.get("sort_index"), bool)
    ):
        errors.add(f"{where}: {name} needs an integer args.sort_index")
    elif name == "process_labels" and not isinstance(args.get("labels"), str):
        errors.add(f"{where}: process_labels needs a string args.labels")
    if name.startswith("thread_") and not _is_id(event.get("tid")):
        errors.add(f"{where}: {name} needs a tid")


class _Threads:
    """Slices per thread, sorted, for 'is there a slice around / after this time' questions."""

    def __init__(self, slices: dict[tuple[Any, Any], list[tuple[float, float]]]) -> None:
        self.starts: dict[tuple[Any, Any], list[float]] = {}
        self.reach: dict[tuple[Any, Any], list[float]] = {}  # running max of slice ends, in start order
        for thread, spans in slices.items():
            spans.sort()
            self.starts[thread] = [start for start, _ in spans]
            reach, best = [], -math.inf
            for _, end in spans:
                best = max(best, end)
                reach.append(best)
            self.reach[thread] = reach

    def enclosed(self, thread: tuple[Any, Any], ts: float) -> bool:
        i = bisect.bisect_right(self.starts.get(thread, []), ts) - 1
        return i >= 0 and self.reach[thread][i] >= ts

    def followed(self, thread: tuple[Any, Any], ts: float) -> bool:
        starts = self.starts.get(thread, [])
        return bisect.bisect_left(starts, ts) < len(starts)


def _check_flows(
    flows: dict[tuple[Any, str], dict[str, list[tuple[int, float, tuple[Any, Any], Any]]]],
    slices: dict[tuple[Any, Any], list[tuple[float, float]]],
    errors: _Errors,
) -> None:
    threads = _Threads(slices)
    for (flow_id, cat), ends in flows.items():
        label = f"flow id={flow_id} cat={cat!r}"
        if len(ends["s"]) != 1 or len(ends["f"]) != 1:
            errors.add(f"{label}: needs exactly one 's' and one 'f', has {len(ends['s'])} and {len(ends['f'])}")
        for ph, points in ends.items():
            for index, ts, thread, bp in points:
                bound = threads.followed(thread, ts) if ph == "f" and bp != "e" else threads.enclosed(thread, ts)
                if not bound:
                    errors.add(f"{label}: '{ph}' (event {index}) at {ts} is bound to no slice on pid/tid {thread}")
        if ends["s"] and ends["f"]:
            start, end = ends["s"][0][1], ends["f"][0][1]
            if end < start:
                errors.add(f"{label}: ends at {end}, before it starts at {start}")
            for index, ts, _, _ in ends["t"]:
                if not start <= ts <= end:
                    errors.add(f"{label}: step 't' (event {index}) at {ts} outside [{start}, {end}]")
