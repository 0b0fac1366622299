"""``compat.engineio`` against the installed python-engineio / python-socketio: every private name it uses is
still there and does what it relies on, and the installed versions are within pyproject's bounds (so a bump
that moves one fails here, not in a user's browser)."""

from __future__ import annotations

import inspect
import re
from importlib import metadata
from pathlib import Path

import engineio
import pytest
import socketio
from packaging.specifiers import SpecifierSet

from lightning_megatron.compat import engineio as compat


def _server() -> socketio.Server:
    return socketio.Server(async_mode="threading", transports=["websocket"])


def test_installed_versions_are_within_the_tested_bounds():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    scope = text.split("\nscope = [", 1)[1].split("]\n", 1)[0]  # the scope extra (Python 3.10 has no tomllib)
    for distribution in ("flask-socketio", "python-socketio", "python-engineio"):
        match = re.search(rf'"{distribution}(?:\[\w+\])?([^"]*)"', scope)
        assert match, f"{distribution} is not in the scope extra"
        bounds = SpecifierSet(match.group(1))
        assert "<" in str(bounds), f"{distribution} has no upper bound in pyproject.toml"
        assert metadata.version(distribution) in bounds, (distribution, metadata.version(distribution), str(bounds))


def test_driver_table_entries_are_replaceable():
    server = _server()
    before = dict(server.eio._async)
    assert {"websocket", "sleep", "queue"} <= set(before)
    assert before["websocket"] is compat.SimpleWebSocketWSGI  # the driver the server subclasses
    for method in ("__call__", "wait", "send", "close"):
        assert callable(getattr(compat.SimpleWebSocketWSGI, method))
    compat.install_drivers(server.eio, sleep=print)
    assert server.eio._async["sleep"] is print and server.eio._async["queue"] is before["queue"]
    assert _server().eio._async["sleep"] is before["sleep"]  # one server only, nothing module-wide
    with pytest.raises(KeyError, match="no async driver entry"):
        compat.install_drivers(server.eio, no_such_entry=print)


def test_backlog_reads_the_transport_queue():
    server = _server()
    assert compat.backlog(server, "nobody") is None
    socket = engineio.socket.Socket(server.eio, "e1")
    server.eio.sockets["e1"] = socket
    sid = server.manager.connect("e1", "/")
    assert server.manager.eio_sid_from_sid(sid, "/") == "e1"
    assert compat.backlog(server, sid) == 0
    socket.send(engineio.packet.Packet(engineio.packet.MESSAGE, data="x"))
    assert compat.backlog(server, sid) == socket.queue.qsize() == 1
    socket.closed = True
    assert compat.backlog(server, sid) is None


@pytest.mark.parametrize(
    "data, reason",
    [
        ('2["request",' + "[" * 5000 + "]" * 5000 + "]", "nested too deeply"),
        ('2["request",{"v": ', "not valid JSON"),
        ('2["request",' + "9" * 200 + "]", "too many digits"),
        ('2{"a": 1}', "binary placeholder"),  # an event whose data is not a list
    ],
)
def test_guard_reports_undecodable_packets(data, reason):
    server = _server()
    server.eio.sockets["e1"] = engineio.socket.Socket(server.eio, "e1")
    sid = server.manager.connect("e1", "/")
    reported = []
    compat.guard_messages(server, lambda who, error: reported.append((who, compat.bad_packet_reason(error))))
    server.eio.handlers["message"]("e1", data)
    assert len(reported) == 1 and reported[0][0] == sid and reason in reported[0][1], reported


def test_guard_drops_a_half_received_binary_packet():
    server = _server()
    server.eio.sockets["e1"] = engineio.socket.Socket(server.eio, "e1")
    server.manager.connect("e1", "/")
    reported = []
    compat.guard_messages(server, lambda who, error: reported.append(error))
    server.eio.handlers["message"]("e1", '51-["request",{"_placeholder":true,"num":3}]')
    assert "e1" in server._binary_packet  # waiting for its attachment
    server.eio.handlers["message"]("e1", b"attachment")
    assert "e1" not in server._binary_packet and isinstance(reported[0], IndexError)
    assert "binary placeholder" in compat.bad_packet_reason(reported[0])


def test_message_handler_signature_is_the_one_wrapped():
    assert list(inspect.signature(_server()._handle_eio_message).parameters) == ["eio_sid", "data"]
