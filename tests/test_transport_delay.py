"""Link delays inside the transport (``lightning_megatron.transport.delay``): the receiver sees messages late,
the sender is never blocked, per-link FIFO holds under jitter, delays are reproducible from the seed, only the
listed links are delayed, ``close`` joins the timer thread, and bad specs fail naming the field and the fix.

The transport contract itself (every case of ``test_transport.py``, wait-any included) runs against the wrapper
as the ``shm+delay`` transport there. The distributed cases below run on real forked gloo ranks (``ranks``),
with ``shm`` inside; times are compared across the ranks on ``time.monotonic()``, one clock for the machine.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport import (
    DelayedTransport,
    LinkDelay,
    SendHandle,
    Transport,
    TransportError,
    create_transport,
)
from lightning_megatron.transport.delay import DelayedSendHandle, delay_for


def _threads() -> list[str]:
    return [th.name for th in threading.enumerate() if th.name.startswith("lmt-link-delay")]


def _opened(delay: LinkDelay) -> tuple[DelayedTransport, int, int]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = create_transport("shm", timeout=30.0, link_delay=delay)
    assert isinstance(t, DelayedTransport)
    dist.barrier()
    t.connect([1 - rank])
    return t, rank, 1 - rank


# -- the spec ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"kind": "gaussian", "mean_s": 0.01}, ("kind='gaussian'", "'exponential'")),
        ({"kind": "constant", "mean_s": -0.01}, ("mean_s=-0.01", ">= 0")),
        ({"kind": "constant", "mean_s": float("nan")}, ("mean_s=nan", "finite")),
        ({"kind": "constant", "mean_s": "5ms"}, ("mean_s='5ms'", "seconds")),
        ({"kind": "constant", "mean_s": True}, ("mean_s=True",)),
        ({"kind": "constant", "mean_s": 500}, ("mean_s=500", "write 0.5 for 500 ms")),
        ({"kind": "constant", "mean_s": 0.01, "spread_s": 0.005}, ("spread_s=0.005", "uniform")),
        ({"kind": "uniform", "mean_s": 0.01, "spread_s": 0.02}, ("spread_s=0.02", "negative")),
        ({"kind": "exponential", "mean_s": 0.01, "max_s": 0.001}, ("max_s=0.001", "below mean_s")),
        ({"kind": "spike", "mean_s": 0.1, "probability": 1.5}, ("probability=1.5", "[0, 1]")),
        ({"kind": "constant", "mean_s": 0.01, "links": [[0, 1, 2]]}, ("links=", "(src, dst) pair")),
        ({"kind": "constant", "mean_s": 0.01, "links": [[1, 1]]}, ("links=", "to itself")),
        ({"kind": "constant", "mean_s": 0.01, "links": [[0, -1]]}, ("links=", ">= 0")),
        ({"kind": "constant", "mean_s": 0.01, "links": []}, ("links=[]", "None for all")),
        ({"kind": "constant", "mean_s": 0.01, "links": "0->1"}, ("links='0->1'", "[[0, 1], [1, 2]]")),
        ({"kind": "constant", "mean_s": 0.01, "seed": 1.5}, ("seed=1.5", "an int")),
    ],
)
def test_bad_specs_name_the_field_and_the_fix(fields: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(MegatronConfigError) as info:
        LinkDelay(**fields)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    with pytest.raises(MegatronConfigError):  # the same through create_transport, before any transport opens
        create_transport("shm", rank=0, world_size=2, store=dist.HashStore(), link_delay=fields)


def test_spec_from_a_mapping() -> None:
    spec = LinkDelay.coerce({"kind": "uniform", "mean_s": 0.01, "spread_s": 0.002, "links": [[0, 1], [1, 0], [0, 1]]})
    assert spec.links == ((0, 1), (1, 0))  # YAML lists become pairs; duplicates dropped
    assert spec.applies(0, 1) and spec.applies(1, 0) and not spec.applies(1, 2)
    assert LinkDelay.coerce(spec.to_dict()) == spec
    assert LinkDelay("constant", 0).applies(5, 3)  # links=None: every link
    with pytest.raises(MegatronConfigError, match="unknown field.*mean_ms.*the fields are kind, mean_s"):
        LinkDelay.coerce({"kind": "constant", "mean_ms": 5})
    with pytest.raises(MegatronConfigError, match="mean_s missing"):
        LinkDelay.coerce({"kind": "constant"})
    with pytest.raises(MegatronConfigError, match="pass a LinkDelay or a mapping"):
        LinkDelay.coerce(0.05)  # type: ignore[arg-type]


def test_delays_are_a_pure_function_of_seed_link_and_number() -> None:
    spec = LinkDelay("exponential", 0.004, seed=7)
    a = [delay_for(spec, 0, 1, n) for n in range(2000)]
    assert a == [delay_for(LinkDelay("exponential", 0.004, seed=7), 0, 1, n) for n in range(2000)]
    assert a != [delay_for(LinkDelay("exponential", 0.004, seed=8), 0, 1, n) for n in range(2000)]
    assert a != [delay_for(spec, 1, 0, n) for n in range(2000)]  # each link draws its own
    assert 0.0036 < statistics.mean(a) < 0.0044 and min(a) >= 0
    assert max(delay_for(LinkDelay("exponential", 0.004, max_s=0.006, seed=7), 0, 1, n) for n in range(2000)) == 0.006
    u = [delay_for(LinkDelay("uniform", 0.01, spread_s=0.002), 2, 3, n) for n in range(1000)]
    assert 0.008 <= min(u) and max(u) <= 0.012 and len(set(u)) > 900
    spikes = [delay_for(LinkDelay("spike", 0.5, probability=0.1, seed=1), 0, 1, n) for n in range(4000)]
    assert set(spikes) == {0.0, 0.5} and 0.08 < spikes.count(0.5) / 4000 < 0.12
    assert {delay_for(LinkDelay("constant", 0.05, links=[(0, 1)]), s, d, 0) for s, d in [(1, 0), (0, 2)]} == {0.0}
    # Lowering the probability keeps the delays of the messages still delayed.
    full = [delay_for(LinkDelay("exponential", 0.004, seed=7, probability=1.0), 0, 1, n) for n in range(100)]
    half = [delay_for(LinkDelay("exponential", 0.004, seed=7, probability=0.5), 0, 1, n) for n in range(100)]
    assert all(h in (0.0, f) for h, f in zip(half, full)) and 30 < half.count(0.0) < 70


# -- in one process: the timer thread and its bookkeeping ------------------------------------------------------------


class _Handle(SendHandle):
    __slots__ = ()

    def done(self) -> bool:
        return True


class _Recorder(Transport):
    """A transport of rank 0 in a world of 2 that records (time, peer, tag, value) of what is handed to it."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=2, store=object())
        self.sent: list[tuple[float, int, int, int]] = []
        self.fail_tag: Optional[int] = None

    def _connect(self, peers: list[int]) -> None:
        pass

    def _isend(self, peer: int, tag: int, tensor: torch.Tensor, step: int) -> SendHandle:
        if tag == self.fail_tag:
            raise TransportError(f"recorder: tag {tag} fails")
        self.sent.append((time.monotonic(), peer, tag, int(tensor)))
        return _Handle(peer, tag, 8, step)

    def _poll(self, peer: int, tag: int) -> Optional[torch.Tensor]:
        return None


def test_timer_thread_order_completion_and_close() -> None:
    inner = _Recorder()
    spec = LinkDelay("exponential", 0.003, seed=5)
    t = DelayedTransport(inner, spec)
    t.connect([1])
    assert t.name == "recorder+delay" and t.peers == {1} and inner.peers == {1}
    assert _threads() == [], "a thread before any delayed send"
    handles = [t.isend(1, i % 3, torch.tensor(i)) for i in range(200)]
    delayed = [h for h in handles if isinstance(h, DelayedSendHandle)]
    assert delayed and not t.sends_done() and t.pending > 0
    assert [h.due for h in delayed] == sorted(h.due for h in delayed)  # FIFO on the link
    t.wait_sends(timeout=5)
    assert t.sends_done() and t.pending == 0 and all(h.done() for h in handles)
    assert [v for _, _, _, v in inner.sent] == list(range(200)), "the link reordered messages"
    assert [d for _, _, _, d in t.drawn] == [delay_for(spec, 0, 1, n) for n in range(200)]
    for i, h in enumerate(handles):  # handed over no earlier than due
        if isinstance(h, DelayedSendHandle):
            assert inner.sent[i][0] >= h.due
    # A failing inner send surfaces through the handle; the thread lives on.
    inner.fail_tag = 9
    bad = t.isend(1, 9, torch.tensor(-1))
    assert isinstance(bad, DelayedSendHandle)
    with pytest.raises(TransportError, match="tag 9 fails"):
        bad.wait(5)
    t.isend(1, 1, torch.tensor(500)).wait(5)
    assert inner.sent[-1][3] == 500
    # close() drops what is still waiting (its handles raise) and joins the thread.
    slow = DelayedTransport(_Recorder(), LinkDelay("constant", 10.0))
    slow.connect([1])
    posted = time.monotonic()
    waiting = slow.isend(1, 0, torch.tensor(0))
    assert time.monotonic() - posted < 5.0  # isend never waits for a delay (this one is 10 s), however busy the host
    assert isinstance(waiting, DelayedSendHandle) and not waiting.done()
    assert len(_threads()) == 2 and all(th.daemon for th in threading.enumerate() if th.name in _threads())
    start = time.monotonic()
    slow.close()
    t.close()
    assert time.monotonic() - start < 1.0
    assert _threads() == [], _threads()
    with pytest.raises(TransportError, match="closed before the delayed message"):
        waiting.done()
    with pytest.raises(TransportError, match="closed"):
        t.isend(1, 0, torch.tensor(0))
    with pytest.raises(MegatronConfigError, match=r"link \[0, 5\].*world size 2"):
        DelayedTransport(_Recorder(), LinkDelay("constant", 0.01, links=[(0, 5)]))


# -- real ranks ----------------------------------------------------------------------------------------------------


DELAY_S = 0.5
"""Long enough that the checks below keep a wide margin on a loaded 2-core machine."""


def _constant_delay() -> dict[str, Any]:
    """Link 0->1 delayed by DELAY_S, 1->0 not; sender and receiver report their times."""
    t, rank, peer = _opened(LinkDelay("constant", DELAY_S, links=[(0, 1)]))
    out: dict[str, Any] = {}
    try:
        dist.barrier()
        if rank == 0:
            sent_at = time.monotonic()
            handle = t.isend(peer, 5, torch.arange(1000))
            out["isend_s"] = time.monotonic() - sent_at
            out["done_at_once"], out["sends_done_at_once"], out["pending"] = handle.done(), t.sends_done(), t.pending
            dist.broadcast(torch.tensor([sent_at], dtype=torch.float64), 0)
            t.wait_sends(timeout=5)
            out["wait_sends_s"] = time.monotonic() - sent_at
            out["done"] = handle.done()
            got = t.recv(peer, 6, timeout=5)
            out["reverse_s"] = time.monotonic() - float(t.recv(peer, 7, timeout=5))
            assert torch.equal(got, torch.ones(3))
        else:
            stamp = torch.zeros(1, dtype=torch.float64)
            dist.broadcast(stamp, 0)
            sent_at = float(stamp)
            time.sleep(max(sent_at + 0.05 - time.monotonic(), 0))
            out["early"] = t.poll(peer, 5)
            out["early_poll_at"] = time.monotonic() - sent_at
            out["late"] = t.recv(peer, 5, timeout=5)
            out["late_at"] = time.monotonic() - sent_at
            handle = t.isend(peer, 6, torch.ones(3))  # 1 -> 0 is not listed: handed over at once
            out["reverse_handle"] = type(handle).__name__
            t.isend(peer, 7, torch.tensor([time.monotonic()], dtype=torch.float64))
            out["reverse_drawn"] = list(t.drawn)
            t.wait_sends(timeout=5)
        dist.barrier()
        return out
    finally:
        t.close()


def test_constant_delay_reaches_the_receiver_late(ranks: Any) -> None:
    sender, receiver = ranks.run(2, _constant_delay)
    assert sender["isend_s"] < DELAY_S / 2, sender  # the sender's host is not held back
    assert not sender["done_at_once"] and not sender["sends_done_at_once"] and sender["pending"] == 1, sender
    assert DELAY_S <= sender["wait_sends_s"] < DELAY_S + 2.0 and sender["done"], sender
    # Polled before the delay was over (unless the host was too busy to poll in time), it was not there yet.
    assert receiver["early"] is None or receiver["early_poll_at"] >= DELAY_S, receiver
    assert torch.equal(receiver["late"], torch.arange(1000)) and receiver["late_at"] >= DELAY_S, receiver
    assert receiver["reverse_handle"] != "DelayedSendHandle" and receiver["reverse_drawn"] == [], receiver
    assert sender["reverse_s"] < DELAY_S / 2, sender  # not delayed


def _jitter_fifo(seed: int, count: int) -> dict[str, Any]:
    """Both ranks send ``count`` messages over 3 tags with exponential jitter; each tag must arrive in order."""
    spec = LinkDelay("exponential", 0.005, seed=seed)
    t, rank, peer = _opened(spec)
    try:
        handles = [t.isend(peer, i % 3, torch.tensor([i, rank])) for i in range(count)]
        dues = [h.due for h in handles if isinstance(h, DelayedSendHandle)]
        assert dues == sorted(dues), "due times on one link went backwards"
        for tag in range(3):
            for i in range(tag, count, 3):
                got = t.recv(peer, tag, timeout=10)
                assert got.tolist() == [i, peer], f"tag {tag}: expected message {i}, got {got.tolist()}"
        t.wait_sends(timeout=10)
        drawn = [d for _, _, _, d in t.drawn]
        assert drawn == [delay_for(spec, rank, peer, n) for n in range(count)]
        dist.barrier()
        return {"drawn": drawn}
    finally:
        t.close()
        assert _threads() == [], _threads()


def test_jitter_keeps_fifo_and_is_reproducible(ranks: Any) -> None:
    first = ranks.run(2, _jitter_fifo, 3, 150)
    again = ranks.run(2, _jitter_fifo, 3, 150)
    other = ranks.run(2, _jitter_fifo, 4, 150)
    for rank in range(2):
        drawn = first[rank]["drawn"]
        assert drawn == again[rank]["drawn"], "the same seed drew other delays"
        assert drawn != other[rank]["drawn"], "another seed drew the same delays"
        assert any(b < a for a, b in zip(drawn, drawn[1:])), "no jitter to reorder (FIFO untested)"
    assert first[0]["drawn"] != first[1]["drawn"]  # the two directions are two links


def test_idle_thread_ends_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing to hand over the timer thread ends (no thread, no reference kept); the next send restarts it."""
    import lightning_megatron.transport.delay as delay_module

    monkeypatch.setattr(delay_module, "_IDLE_S", 0.05)
    inner = _Recorder()
    t = DelayedTransport(inner, LinkDelay("constant", 0.01))
    t.connect([1])
    try:
        for value in (1, 2):
            t.isend(1, 0, torch.tensor(value)).wait(5)
            assert inner.sent[-1][3] == value
            deadline = time.monotonic() + 5
            while _threads():
                assert time.monotonic() < deadline, "the idle timer thread did not end"
                time.sleep(0.01)
    finally:
        t.close()
    assert _threads() == []
