"""Per-rank bodies of the transport conformance suite (``test_transport.py``); they run inside forked ranks.

Every case opens the named transport on the default gloo group's rendezvous store, connects every other rank,
exchanges messages and closes; on failure it raises (the harness attaches the traceback). Cases are written
only against the :class:`~lightning_megatron.transport.Transport` contract, so each transport runs them alike.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError, TransportUsageError
from lightning_megatron.transport import (
    MAX_TAG,
    DelayedTransport,
    LinkDelay,
    PeerLost,
    Transport,
    TransportError,
    TransportTimeout,
    create_transport,
    register_transport,
    transport_class,
)
from lightning_megatron.transport.header import DTYPE_CODES
from lightning_megatron.transport.ucx import UcxTransport

MiB = 1 << 20

JITTER = LinkDelay(kind="exponential", mean_s=0.0005, probability=0.5, seed=11)
"""The link delay of the ``shm+delay`` transport: half the messages wait (0.5 ms on average), half go at once."""


class JitteryShm(DelayedTransport):
    """``shm`` behind :data:`JITTER` on every link: the conformance suite runs against the delay wrapper too
    (registered as ``shm+delay``; the name ``create_transport`` takes, with the inner transport's arguments)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(create_transport("shm", **kwargs), JITTER)


register_transport("shm+delay", JitteryShm)  # imported by the test module before the ranks fork: they have it too


class UcxPulls(UcxTransport):
    """``ucx`` with its GPU receive path driven on host memory (``_emulate_device_path``): every message UCX
    delivers by rendezvous is kept by the engine and pulled when taken, with the take-ahead across tags
    (registered as ``ucx+pull``): the conformance suite checks the contract on the path GPU tensors take."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._emulate_device_path()


register_transport("ucx+pull", UcxPulls)


def init() -> tuple[int, int]:
    """This rank's default gloo group (ranks keep it across cases)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


@contextmanager
def opened(name: str, timeout: float = 30.0, peers: Optional[list[int]] = None, **kwargs: Any) -> Iterator[Transport]:
    """A connected transport; on a clean exit the ranks meet at a barrier before closing (no message in flight)."""
    rank, world = init()
    transport = create_transport(name, timeout=timeout, **kwargs)
    try:
        dist.barrier()  # ranks reach connect together, so short timeouts measure the case, not the start
        transport.connect(peers if peers is not None else [r for r in range(world) if r != rank])
        yield transport
        dist.barrier()
    finally:
        transport.close()


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` deterministic, position-dependent bytes (cheap for hundreds of MiB)."""
    words = torch.arange(seed, seed + (nbytes + 7) // 8, dtype=torch.int64)
    words.mul_(6364136223846793005).add_(1442695040888963407)  # wraps: a different 8-byte value everywhere
    return words.view(torch.uint8)[:nbytes].clone() if nbytes % 8 else words.view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def check_received(got: torch.Tensor, want: torch.Tensor, what: str, device: str = "cpu") -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.is_contiguous(), f"{what}: received tensor is not contiguous"
    assert got.device.type == device, f"{what}: on {got.device}, not {device}"
    assert same_bytes(got, want), f"{what}: bytes differ"


def poll_until(transport: Transport, peer: int, tag: int, timeout: float = 20.0) -> torch.Tensor:
    deadline = time.monotonic() + timeout
    while True:
        tensor = transport.poll(peer, tag)
        if tensor is not None:
            return tensor
        assert time.monotonic() < deadline, f"poll({peer}, {tag}) found nothing within {timeout} s"
        time.sleep(1e-4)


# -- ordering ---------------------------------------------------------------------------------------------------


def in_order(name: str) -> int:
    """Each rank in turn sends tags 0..19; the other receives them in the order sent."""
    rank, _ = init()
    peer = 1 - rank
    with opened(name) as t:
        for sender in (0, 1):
            if rank == sender:
                for tag in range(20):
                    t.isend(peer, tag, torch.full((tag + 1,), float(100 * sender + tag)))
                t.wait_sends()
            else:
                for tag in range(20):
                    check_received(t.recv(peer, tag), torch.full((tag + 1,), float(100 * sender + tag)), f"tag {tag}")
    return 20


def out_of_order(name: str) -> dict[str, Any]:
    """The receiver asks in another order than sent; ``poll`` before arrival and after taking returns None."""
    rank, _ = init()
    peer = 1 - rank
    tags = [3, 1, 4, 15, 9, 2, 6, 5, 35, 8, MAX_TAG, 0]
    with opened(name) as t:
        early = [t.poll(peer, tag) for tag in tags]  # nothing was sent yet
        assert early == [None] * len(tags), early
        dist.barrier()
        for tag in tags:
            t.isend(peer, tag, torch.tensor([tag % 1000, rank], dtype=torch.int64))
        asked = tags[::-1]
        random.Random(7).shuffle(asked)
        for i, tag in enumerate(asked):
            want = torch.tensor([tag % 1000, peer], dtype=torch.int64)
            got = t.recv(peer, tag) if i % 2 else poll_until(t, peer, tag)
            check_received(got, want, f"tag {tag}")
            assert t.poll(peer, tag) is None, f"tag {tag} delivered twice"
        t.wait_sends()
    return {"asked": asked}


def fifo(name: str, count: int = 40) -> int:
    """Messages with the same (peer, tag) arrive in the order sent, whatever else is interleaved."""
    rank, _ = init()
    peer = 1 - rank
    with opened(name) as t:
        for i in range(count):  # both ranks send at once
            t.isend(peer, 5, torch.tensor([i, rank]))
            if i % 3 == 0:
                t.isend(peer, 6, torch.tensor([-i, rank]))
        t.isend(peer, 5, torch.zeros(3, 1000))  # a bigger one last, same tag
        for i in range(0, count, 3):
            check_received(t.recv(peer, 6), torch.tensor([-i, peer]), f"tag 6 message {i}")
        for i in range(count):
            check_received(t.recv(peer, 5), torch.tensor([i, peer]), f"tag 5 message {i}")
        check_received(t.recv(peer, 5), torch.zeros(3, 1000), "tag 5 last message")
        assert t.poll(peer, 5) is None and t.poll(peer, 6) is None
        t.wait_sends()
    return count


def peers_independent(name: str) -> int:
    """Three ranks: the same tag from different peers is a different message."""
    rank, world = init()
    others = [r for r in range(world) if r != rank]
    with opened(name) as t:
        for peer in others:
            for tag in (5, 6):
                t.isend(peer, tag, torch.tensor([rank, peer, tag]))
        for peer in reversed(others):
            for tag in (6, 5):
                check_received(t.recv(peer, tag), torch.tensor([peer, rank, tag]), f"from rank {peer} tag {tag}")
        t.wait_sends()
    return len(others)


# -- contents ---------------------------------------------------------------------------------------------------

NAN_PATTERNS = {  # NaNs with payloads (quiet and signalling, both signs), infinities, -0.0: bit patterns as ints
    torch.float16: (torch.int16, [0x7E01, 0x7C01, -0x3FF, 0x7C00, -0x8000]),
    torch.bfloat16: (torch.int16, [0x7FC1, 0x7F81, -0x7F, 0x7F80, -0x8000]),
    torch.float32: (torch.int32, [0x7FC00001, 0x7F800001, -0x3FFFFF, 0x7F800000, -0x80000000]),
    torch.float64: (torch.int64, [0x7FF8000000000001, 0x7FF0000000000001, -0x7FFFFFFFFFFFF, 0x7FF0000000000000]),
}


def dtype_tensor(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A (3, 5) tensor of ``dtype`` with random bytes (bool: 0/1), NaN payloads first for floats."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (3, 5), generator=gen).bool()
    raw = torch.randint(0, 256, (15 * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    tensor = raw.view(dtype).view(3, 5)
    if dtype in NAN_PATTERNS:
        int_dtype, bits = NAN_PATTERNS[dtype]
        tensor.view(int_dtype).view(-1)[: len(bits)] = torch.tensor(bits, dtype=int_dtype)
    return tensor


def dtypes(name: str) -> list[str]:
    """Every dtype the header knows round-trips bit-exactly (both directions at once)."""
    rank, _ = init()
    peer = 1 - rank
    names = []
    with opened(name) as t:
        for code, dtype in enumerate(DTYPE_CODES):
            t.isend(peer, code, dtype_tensor(dtype, 1000 * rank + code))
        for code, dtype in enumerate(DTYPE_CODES):
            check_received(t.recv(peer, code), dtype_tensor(dtype, 1000 * peer + code), f"dtype {dtype}")
            names.append(str(dtype))
        # 0-d and 0-element tensors of a few dtypes as well
        for i, dtype in enumerate([torch.bool, torch.bfloat16, torch.complex64, torch.float8_e4m3fn, torch.int8]):
            t.isend(peer, 100 + i, dtype_tensor(dtype, i)[1, 2])
            t.isend(peer, 200 + i, torch.empty(0, 4, dtype=dtype))
        for i, dtype in enumerate([torch.bool, torch.bfloat16, torch.complex64, torch.float8_e4m3fn, torch.int8]):
            check_received(t.recv(peer, 100 + i), dtype_tensor(dtype, i)[1, 2], f"0-d {dtype}")
            check_received(t.recv(peer, 200 + i), torch.empty(0, 4, dtype=dtype), f"0-element {dtype}")
        t.wait_sends()
    return names


def shape_cases() -> list[tuple[str, torch.Tensor]]:
    base = torch.arange(2 * 3 * 4 * 5 * 6, dtype=torch.float32).view(2, 3, 4, 5, 6)
    wide = torch.arange(64, dtype=torch.int64)
    return [
        ("0-d", torch.tensor(3.5)),
        ("0-d view with offset", wide[17]),
        ("0 elements", torch.empty(0)),
        ("0 elements 3-d", torch.empty(3, 0, 2, dtype=torch.int16)),
        ("1-d", torch.arange(7.0)),
        ("2-d", base[0, 0, 0].clone()),
        ("3-d", base[0, 0].clone()),
        ("4-d", base[0].clone()),
        ("5-d", base.clone()),
        ("transposed", base[0, 0, 0].t()),
        ("strided slice", wide[3::5]),
        ("expanded (stride 0)", torch.arange(3.0).expand(4, 3)),
        ("permuted 5-d", base.permute(4, 2, 0, 3, 1)),
        ("narrowed (storage offset)", base[1, 1:3, :, 2:4]),
        ("channels_last", base[0].contiguous(memory_format=torch.channels_last)),
        ("flipped copy", base[0, 0].flip(0)),
    ]


def shapes(name: str) -> int:
    rank, _ = init()
    peer = 1 - rank
    cases = shape_cases()
    with opened(name) as t:
        handles = [t.isend(peer, i, tensor) for i, (_, tensor) in enumerate(cases)]
        for i, (what, tensor) in enumerate(cases):
            got = t.recv(peer, i)
            check_received(got, tensor.contiguous(), what)
            assert torch.equal(got, tensor), what  # values, not only bytes of the contiguous copy
        t.wait_sends()
        assert all(h.done() for h in handles)
    return len(cases)


SIZES = [1, 7, 4096, 65536 - 256, 65536 - 255, 65536 + 3, MiB, 4 * MiB + 1]


def sizes(name: str, nbytes: list[int] = SIZES) -> list[int]:
    """Byte messages of assorted sizes, both directions at once, each bit-exact."""
    rank, _ = init()
    peer = 1 - rank
    with opened(name) as t:
        for i, n in enumerate(nbytes):
            t.isend(peer, i, pattern(n, seed=10 * i + rank))
        for i, n in enumerate(nbytes):
            check_received(t.recv(peer, i), pattern(n, seed=10 * i + peer), f"{n} bytes")
        t.wait_sends()
    return nbytes


def big_message(name: str, nbytes: int) -> float:
    """One message of hundreds of MiB, rank 0 to rank 1; returns the seconds it took."""
    rank, _ = init()
    with opened(name, timeout=120.0) as t:
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            t.isend(1, 1, pattern(nbytes, seed=5))
            t.wait_sends()
        else:
            got = t.recv(0, 1)
            elapsed = time.perf_counter() - start
            check_received(got, pattern(nbytes, seed=5), f"{nbytes} bytes")
            return elapsed
    return time.perf_counter() - start


def both_ways(name: str, count: int = 200) -> int:
    """Both ranks send many messages to each other at once, then receive them all in a shuffled order."""
    rank, _ = init()
    peer = 1 - rank

    def message(src: int, i: int) -> torch.Tensor:
        n = 64 * 1024 if i % 50 == 0 else 1 + (i * 37) % 3000
        return torch.full((n,), float(i), dtype=torch.float32) + src * 0.5

    with opened(name) as t:
        for i in range(count):
            t.isend(peer, 1000 + i, message(rank, i))
        order = list(range(count))
        random.Random(rank).shuffle(order)
        for i in order:
            check_received(t.recv(peer, 1000 + i), message(peer, i), f"message {i}")
        t.wait_sends()
        assert t.sends_done()
    return count


def burst(name: str, count: int = 64, nbytes: int = 4 * MiB) -> dict[str, float]:
    """``count`` messages of ``nbytes`` posted before the receiver receives anything (more than any ring holds)."""
    rank, _ = init()
    with opened(name, timeout=60.0) as t:
        if rank == 0:
            start = time.perf_counter()
            handles = [t.isend(1, i, torch.full((nbytes,), i, dtype=torch.uint8)) for i in range(count)]
            posted = time.perf_counter() - start
            dist.barrier()  # only now does rank 1 start receiving
            t.wait_sends()
            assert all(h.done() for h in handles)
            return {"posted_s": posted}
        dist.barrier()
        for i in reversed(range(count)):  # the last one first: everything before it must be filed on the way
            got = t.recv(1 - rank, i)
            assert got.shape == (nbytes,) and got.dtype == torch.uint8, (i, got.shape, got.dtype)
            assert int(got.min()) == int(got.max()) == i, f"message {i} has wrong contents"
    return {}


# -- completion tracking, timeouts ------------------------------------------------------------------------------


def completion(name: str) -> dict[str, Any]:
    rank, _ = init()
    peer = 1 - rank
    with opened(name) as t:
        t.begin_step(3)
        assert t.step == 3
        assert t.sends_done(3) and t.sends_done(99)  # nothing sent in them
        step3 = [t.isend(peer, 100 + i, torch.full((50_000,), float(i))) for i in range(4)]
        assert [h.step for h in step3] == [3] * 4 and all(h.peer == peer for h in step3)
        assert [h.tag for h in step3] == [100, 101, 102, 103] and step3[0].nbytes == 200_000
        t.begin_step(4)
        step4 = t.isend(peer, 200, torch.ones(10))
        assert step4.step == 4
        t.wait_sends(3)
        assert all(h.done() for h in step3) and t.sends_done(3)
        deadline = time.monotonic() + 20
        while not t.sends_done(4):  # the current step, by default
            assert time.monotonic() < deadline, "step 4's send never completed"
            time.sleep(1e-3)
        t.wait_sends()
        assert t.sends_done() and step4.done()
        step4.wait(1.0)  # a completed handle's wait returns at once
        for i in range(4):
            check_received(t.recv(peer, 100 + i), torch.full((50_000,), float(i)), f"step 3 message {i}")
        check_received(t.recv(peer, 200), torch.ones(10), "step 4 message")
    return {"steps": [3, 4]}


def timeouts(name: str) -> dict[str, float]:
    """``recv`` of a tag never sent raises TransportTimeout naming peer and tag in time; the channel survives."""
    rank, _ = init()
    peer = 1 - rank
    out = {}
    with opened(name, timeout=1.0) as t:
        for tag, timeout in ((777, 0.5), (778, None)):
            start = time.monotonic()
            try:
                t.recv(peer, tag, timeout=timeout)
            except TransportTimeout as exc:
                elapsed = time.monotonic() - start
                assert isinstance(exc, TimeoutError) and isinstance(exc, TransportError)
                assert f"rank {peer}" in str(exc) and str(tag) in str(exc), str(exc)
            else:
                raise AssertionError(f"recv of tag {tag} that was never sent returned")
            limit = 0.5 if timeout else 1.0
            assert limit <= elapsed < limit + 1.0, f"tag {tag}: raised after {elapsed:.2f} s, not ~{limit} s"
            out[str(tag)] = elapsed
        dist.barrier()
        t.isend(peer, 777, torch.tensor([rank]))  # the tag that timed out still arrives afterwards
        check_received(t.recv(peer, 777, timeout=10), torch.tensor([peer]), "tag 777 after its timeout")
        t.wait_sends()
    return out


# -- wait-any ---------------------------------------------------------------------------------------------------


def any_out_of_order(name: str) -> dict[str, Any]:
    """``poll_any``/``wait_any`` return the index of the key whose message came, whatever the order of arrival
    and of the keys; among several arrived ones, the first in ``keys``."""
    rank, _ = init()
    peer = 1 - rank
    keys = [(peer, 10), (peer, 11), (peer, 12)]
    out: dict[str, Any] = {}
    with opened(name) as t:
        assert t.poll_any(keys) is None  # nothing sent yet
        dist.barrier()
        # Both ranks send tag 12 only: wait_any must return index 2, whatever came before on other keys.
        t.isend(peer, 12, torch.tensor([12, rank]))
        index, got = t.wait_any(keys, timeout=10)
        assert index == 2, f"wait_any returned index {index} for a message with tag 12"
        check_received(got, torch.tensor([12, peer]), "wait_any tag 12")
        assert t.poll_any(keys) is None, "a message delivered twice"
        dist.barrier()
        # Now tags 10 and 11 both arrive, then tag 13 as a marker. Every transport here moves one peer's messages
        # over one ordered channel, so once 13 is filed, 10 and 11 are: poll_any must prefer the first in keys.
        t.isend(peer, 10, torch.tensor([10, rank]))
        t.isend(peer, 11, torch.tensor([11, rank]))
        t.isend(peer, 13, torch.tensor([13, rank]))
        check_received(t.recv(peer, 13), torch.tensor([13, peer]), "marker")
        got_any = t.poll_any([(peer, 11), (peer, 10)])
        assert got_any is not None and got_any[0] == 0, f"poll_any preferred {got_any}, not the first key (tag 11)"
        check_received(got_any[1], torch.tensor([11, peer]), "poll_any tag 11")
        index, got = t.wait_any([(peer, 11), (peer, 10)], timeout=10)
        assert index == 1, index
        check_received(got, torch.tensor([10, peer]), "wait_any tag 10")
        # FIFO per key holds through wait_any, and keys of one tag from a single peer listed twice work.
        for i in range(5):
            t.isend(peer, 20, torch.tensor([i, rank]))
        for i in range(5):
            index, got = t.wait_any([(peer, 21), (peer, 20), (peer, 20)], timeout=10)
            assert index == 1, index
            check_received(got, torch.tensor([i, peer]), f"tag 20 message {i}")
        # A wait that started before the message was sent.
        dist.barrier()
        if rank == 0:
            start = time.monotonic()
            index, got = t.wait_any([(peer, 30), (peer, 31)], timeout=10)
            out["waited_s"] = time.monotonic() - start
            assert index == 1, index
            check_received(got, torch.tensor([31]), "tag 31 sent while waiting")
        else:
            time.sleep(0.05)
            t.isend(peer, 31, torch.tensor([31]))
        t.wait_sends()
    return out


def any_timeout_and_checks(name: str) -> dict[str, Any]:
    """``wait_any`` of tags never sent raises TransportTimeout naming rank, peer, tags and timeout, in time;
    bad keys raise TransportUsageError naming the fix; the channel survives the timeout."""
    rank, _ = init()
    peer = 1 - rank
    out: dict[str, Any] = {}
    with opened(name, timeout=0.5) as t:
        for timeout, limit in ((0.2, 0.2), (None, 0.5)):
            start = time.monotonic()
            try:
                t.wait_any([(peer, 901), (peer, 902)], timeout=timeout)
            except TransportTimeout as exc:
                elapsed = time.monotonic() - start
                text = str(exc)
                assert isinstance(exc, TimeoutError), type(exc)
                for word in (f"rank {rank}", f"rank {peer}", "901", "902", f"{limit:g} s"):
                    assert word in text, f"{word!r} not in {text!r}"
            else:
                raise AssertionError("wait_any of tags never sent returned")
            assert limit <= elapsed < limit + 1.0, f"raised after {elapsed:.2f} s, not ~{limit} s"
            out[str(timeout)] = elapsed
        start = time.monotonic()
        assert t.poll_any([(peer, 901)]) is None
        out["poll_any_s"] = time.monotonic() - start
        out["empty"] = expect(TransportUsageError, t.poll_any, [], words=("at least one",))
        expect(TransportUsageError, t.wait_any, [], words=("at least one",))
        expect(TransportUsageError, t.wait_any, [(peer,)], words=("(peer, tag)",))
        expect(TransportUsageError, t.poll_any, [(peer, -1)], words=("-1",))
        expect(TransportUsageError, t.poll_any, (peer, 5), words=("(peer, tag)",))  # one pair, not a list of pairs
        expect(TransportUsageError, t.poll_any, [(rank, 5)], words=("connect",))
        dist.barrier()
        t.isend(peer, 901, torch.tensor([rank]))  # a tag that timed out still arrives afterwards
        index, got = t.wait_any([(peer, 902), (peer, 901)], timeout=10)
        assert index == 1
        check_received(got, torch.tensor([peer]), "tag 901 after its timeout")
        t.wait_sends()
    out["closed"] = expect(TransportError, t.poll_any, [(peer, 1)], words=("closed",))
    return out


def any_peer_closed(name: str) -> dict[str, Any]:
    """Rank 1 closes its transport: rank 0's poll_any/wait_any still deliver what had arrived, then raise PeerLost
    naming rank 1 and a tag, fast (not at the timeout)."""
    rank, _ = init()
    t = create_transport(name, timeout=30.0)
    t.connect([1 - rank])
    out: dict[str, Any] = {}
    if rank == 1:
        t.isend(0, 43, torch.tensor([43]))
        t.isend(0, 44, torch.tensor([44]))
        t.wait_sends()
        dist.barrier()  # rank 0 has both
        t.close()
        dist.barrier()
    else:
        check_received(t.recv(1, 44), torch.tensor([44]), "marker")  # one ordered channel: 43 is filed too
        dist.barrier()
        dist.barrier()  # rank 1 has closed
        keys = [(1, 42), (1, 43)]
        got = t.poll_any(keys)
        assert got is not None and got[0] == 1, f"poll_any did not deliver the arrived message first: {got}"
        check_received(got[1], torch.tensor([43]), "arrived before the close")
        start = time.monotonic()
        try:
            t.wait_any(keys, timeout=20.0)
            out["wait_any"] = "returned"
        except TransportError as exc:
            out["wait_any"] = type(exc).__name__
            out["message"] = str(exc)
        out["wait_any_s"] = time.monotonic() - start
        try:
            t.poll_any(keys)
            out["poll_any"] = "returned"
        except PeerLost:
            out["poll_any"] = "PeerLost"
        t.close()
    dist.barrier()
    return out


# -- lost peers -------------------------------------------------------------------------------------------------


def peer_death(name: str, victim: int = 1) -> Optional[dict[str, Any]]:
    """``victim`` SIGKILLs itself while the other rank waits in ``recv``; the survivor must get PeerLost fast."""
    rank, _ = init()
    peer = 1 - rank
    t = create_transport(name, timeout=30.0)
    t.connect([peer])
    t.isend(peer, 1, torch.tensor([rank]))
    check_received(t.recv(peer, 1), torch.tensor([peer]), "before the death")
    t.wait_sends()
    dist.barrier()
    if rank == victim:
        time.sleep(0.5)  # the survivor is in recv by now
        os.kill(os.getpid(), signal.SIGKILL)
    out: dict[str, Any] = {}
    start = time.monotonic()
    try:
        t.recv(peer, 99, timeout=30.0)
        out["recv"] = "returned"
    except TransportError as exc:
        out["recv"] = type(exc).__name__
        out["recv_message"] = str(exc)
    out["recv_s"] = time.monotonic() - start
    start = time.monotonic()
    try:
        t.isend(peer, 100, torch.ones(1000)).wait(10.0)
        out["send"] = "completed"
    except TransportError as exc:
        out["send"] = type(exc).__name__
        out["send_is_timeout"] = isinstance(exc, TransportTimeout)
    out["send_s"] = time.monotonic() - start
    start = time.monotonic()
    t.close()
    out["close_s"] = time.monotonic() - start
    return out


def peer_closed(name: str) -> dict[str, Any]:
    """Rank 1 closes its transport; rank 0's recv of a tag that will never come raises PeerLost, not a timeout."""
    rank, _ = init()
    t = create_transport(name, timeout=30.0)
    t.connect([1 - rank])
    out: dict[str, Any] = {}
    if rank == 1:
        t.close()
        dist.barrier()
    else:
        dist.barrier()
        start = time.monotonic()
        try:
            t.recv(1, 42, timeout=20.0)
            out["recv"] = "returned"
        except TransportError as exc:
            out["recv"] = type(exc).__name__
            out["recv_message"] = str(exc)
        out["recv_s"] = time.monotonic() - start
        t.close()
    dist.barrier()
    return out


# -- bad input --------------------------------------------------------------------------------------------------


def expect(error: type[BaseException], fn: Any, *args: Any, words: tuple[str, ...] = ()) -> str:
    try:
        fn(*args)
    except error as exc:
        for word in words:
            assert word in str(exc), f"{error.__name__} message {str(exc)!r} does not mention {word!r}"
        return str(exc)
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} did not raise {error.__name__}")


def bad_input(name: str) -> dict[str, str]:
    rank, world = init()
    peer = 1 - rank
    x = torch.ones(3)
    out = {}
    out["timeout"] = expect(MegatronConfigError, lambda: create_transport(name, timeout=0), words=("timeout",))
    out["device"] = expect(MegatronConfigError, lambda: create_transport(name, device="meta"), words=("meta",))
    t = create_transport(name, timeout=10.0)
    try:
        out["unconnected"] = expect(TransportUsageError, t.isend, peer, 0, x, words=("connect",))
        expect(TransportUsageError, t.poll, peer, 0, words=("connect",))
        expect(TransportUsageError, t.recv, peer, 0, words=("connect",))
        out["self"] = expect(TransportUsageError, t.connect, [rank], words=(str(rank),))
        expect(TransportUsageError, t.connect, [world], words=(str(world),))
        expect(TransportUsageError, t.connect, [-1])
        t.connect([peer])
        t.connect([peer])  # connecting again is a no-op
        out["negative tag"] = expect(TransportUsageError, t.isend, peer, -1, x, words=("-1",))
        expect(TransportUsageError, t.isend, peer, MAX_TAG + 1, x)
        expect(TransportUsageError, t.isend, peer, 1.5, x)
        expect(TransportUsageError, t.recv, peer, -3)
        expect(TransportUsageError, t.poll, peer, -1)
        out["not a tensor"] = expect(TypeError, t.isend, peer, 0, [1, 2, 3])
        out["meta tensor"] = expect(TransportUsageError, t.isend, peer, 0, torch.ones(2, device="meta"))
        dist.barrier()
    finally:
        t.close()
    t.close()  # idempotent
    out["closed"] = expect(TransportError, t.isend, peer, 0, x, words=("closed",))
    expect(TransportError, t.poll, peer, 0, words=("closed",))
    expect(TransportError, t.recv, peer, 0, words=("closed",))
    dist.barrier()
    return out


def probe(name: str) -> Optional[str]:
    """Whether ``name`` can run here: None, or the reason the transport gives (raised on creation or connect)."""
    rank, _ = init()
    try:
        transport_class(name)
        with opened(name, timeout=20.0):
            pass
    except Exception as exc:  # noqa: BLE001  (any failure is the reason, reported as the skip message)
        return f"{type(exc).__name__}: {exc}"
    return None


def across_namespaces(name: str) -> dict[str, Any]:
    """Run in two network namespaces (``WorkerGroup(rank_setup=...)``): messages both ways over the veth pair."""
    rank, _ = init()
    peer = 1 - rank
    nbytes = [10, 65536 + 7, 4 * MiB]
    with opened(name) as t:
        for i, n in enumerate(nbytes):
            t.isend(peer, i, pattern(n, seed=10 * rank + i))
        for i, n in enumerate(nbytes):
            check_received(t.recv(peer, i), pattern(n, seed=10 * peer + i), f"{n} bytes across namespaces")
        t.wait_sends()
    return {"netns": os.readlink("/proc/self/ns/net"), "sent_bytes": sum(nbytes)}


# -- torch-specific ---------------------------------------------------------------------------------------------


def torch_backends_isolated() -> int:
    """torch: the transport's messages never mix with the job's own point-to-point on the default group, and its
    helper threads end once both sides closed."""
    rank, _ = init()
    peer = 1 - rank
    with opened("torch") as t:
        for i in range(10):
            if rank == 0:
                t.isend(peer, i, torch.tensor([i]))
                dist.send(torch.tensor([-i]), peer)  # default group, default tag
            else:
                got = torch.zeros(1, dtype=torch.int64)
                dist.recv(got, peer)
                assert int(got) == -i
        if rank == 1:
            for i in reversed(range(10)):
                check_received(t.recv(peer, i), torch.tensor([i]), f"tag {i}")
        t.wait_sends()
    # Both ends closed: every helper thread of the transport ends (its backends are freed with it).
    deadline = time.monotonic() + 10
    while [th for th in threading.enumerate() if th.name.startswith("torch-transport-")]:
        assert time.monotonic() < deadline, [th.name for th in threading.enumerate()]
        time.sleep(0.01)
    return 10


def cuda_cases(name: str) -> int:
    """On ``cuda:<rank>`` (a spawned pair, one GPU each): every dtype, 0-d and 0-element, sizes up to 64 MiB,
    out-of-order tags and both directions at once; received tensors are on this rank's GPU."""
    rank, _ = init()
    peer = 1 - rank
    device = f"cuda:{rank}"
    torch.cuda.set_device(rank)

    def to(tensor: torch.Tensor) -> torch.Tensor:  # through bytes: every dtype, even those CUDA cannot copy
        return tensor.contiguous().reshape(-1).view(torch.uint8).to(device).view(tensor.dtype).view(tensor.shape)

    def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        assert got.device == torch.device(device), f"{what}: on {got.device}, not {device}"
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous(), what
        assert torch.equal(got.reshape(-1).view(torch.uint8).cpu(), want.reshape(-1).view(torch.uint8)), what

    messages = {code: dtype_tensor(dtype, code) for code, dtype in enumerate(DTYPE_CODES)}
    messages.update(
        {100: torch.tensor(2.5), 101: torch.empty(0, 3, dtype=torch.bfloat16), 102: torch.ones((), dtype=torch.bool)}
    )
    messages.update({200 + i: pattern(n, seed=i) for i, n in enumerate([1, 4096 + 3, MiB, 64 * MiB])})
    count = 0
    with opened(name, timeout=120.0, device=device) as t:
        for tag, tensor in messages.items():
            t.isend(peer, tag, to(tensor))
        for tag in reversed(list(messages)):
            check(t.recv(peer, tag), messages[tag], f"tag {tag}")
            count += 1
        t.wait_sends()
        torch.cuda.synchronize()
    return count


def torch_bad_config() -> dict[str, str]:
    init()
    out = {}
    out["gloo+cuda"] = expect(
        MegatronConfigError, lambda: create_transport("torch", backend="gloo", device="cuda"), words=("gloo",)
    )
    out["nccl+cpu"] = expect(MegatronConfigError, lambda: create_transport("torch", backend="nccl"), words=("nccl",))
    out["mpi"] = expect(MegatronConfigError, lambda: create_transport("torch", backend="mpi"), words=("mpi",))
    if not torch.cuda.is_available():
        out["cuda here"] = expect(MegatronConfigError, lambda: create_transport("torch", device="cuda"))
    with opened("torch") as t:
        peer = 1 - dist.get_rank()
        quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
        out["quantized"] = expect(TransportUsageError, t.isend, peer, 0, quantized, words=("int_repr",))
        out["too many dims"] = expect(TransportUsageError, t.isend, peer, 0, torch.ones([1] * 27), words=("27",))
    return out
