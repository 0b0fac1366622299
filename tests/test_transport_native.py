"""What is specific to the native transports (``shm``, ``tcp``, ``rdma``, ``ucx``); the common semantics are in
``test_transport.py``. Real forked processes (``ranks``), no mocks: shared-memory names are unlinked once both
sides have mapped them (and stay gone when a peer is SIGKILLed mid-transfer), rings wrap and stream messages
larger than themselves, the receive pool reuses its buffers, a TCP listener drops connections without the token,
a blocked receive yields to Ctrl-C, and the build fails with a useful message where there is no compiler.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from distributed import WorkerGroup

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport import (
    PeerLost,
    TransportError,
    TransportTimeout,
    available_transports,
    create_transport,
)
from lightning_megatron.transport import header as hdr

native = pytest.importorskip("lightning_megatron.transport.native", reason="native extension not built")

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _init() -> tuple[int, int]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _connected(name: str, **kwargs: Any):
    rank, world = _init()
    t = create_transport(name, timeout=30.0, **kwargs)
    dist.barrier()
    t.connect([r for r in range(world) if r != rank])
    return t, rank, 1 - rank


def _payload(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


# -- shared memory: names ------------------------------------------------------------------------------------------


def _segments_after_connect() -> list[str]:
    t, rank, peer = _connected("shm")
    try:
        names = list(t.segment_names)
        assert len(names) == 1 and names[0].startswith("/lmt-"), names
        left = [n for n in names if os.path.exists("/dev/shm" + n)]
        assert not left, f"rank {rank}: still linked after connect: {left}"
        # The rings work without their names.
        t.isend(peer, 3, torch.arange(10) * (rank + 1))
        assert torch.equal(t.recv(peer, 3), torch.arange(10) * (peer + 1))
        dist.barrier()
        return names
    finally:
        t.close()


def test_shm_names_unlinked_after_connect(ranks: Any) -> None:
    a, b = ranks.run(2, _segments_after_connect)
    assert a != b
    assert not [n for n in a + b if os.path.exists("/dev/shm" + n)]


def _kill_mid_transfer(report_path: str) -> Optional[dict[str, Any]]:
    """Rank 1 SIGKILLs itself while 64 MiB messages stream both ways through 1 MiB rings."""
    t, rank, peer = _connected("shm", ring_bytes=1 * MiB)
    Path(report_path, f"names{rank}").write_text("\n".join(t.segment_names))
    big = torch.ones(64 * MiB, dtype=torch.uint8)
    handles = [t.isend(peer, 10 + i, big) for i in range(4)]
    if rank == 1:
        t.recv(peer, 10)  # mid-stream: more is coming both ways
        Path(report_path, "died").write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock per machine
        os.kill(os.getpid(), signal.SIGKILL)
    out: dict[str, Any] = {}
    try:
        for i in range(10):
            t.recv(peer, 10 + i, timeout=20.0)
        out["recv"] = "returned"
    except PeerLost as exc:
        out["recv"] = str(exc)
    now = time.monotonic()
    start = float(Path(report_path, "died").read_text())
    out["recv_s"] = now - start
    try:
        for h in handles:
            h.wait(20.0)
        out["sends"] = "completed"
    except TransportError as exc:
        out["sends"] = type(exc).__name__
    out["send_s"] = time.monotonic() - start
    t.close()
    return out


def test_shm_sigkill_mid_transfer_leaves_nothing(tmp_path: Path) -> None:
    group = WorkerGroup(2, tmp_path)
    try:
        survivor, victim = group.run(_kill_mid_transfer, str(tmp_path), may_die={1}, timeout=90)
    finally:
        group.shutdown(kill=True)
    names = (tmp_path / "names0").read_text().split() + (tmp_path / "names1").read_text().split()
    assert len(names) == 2
    assert not [n for n in names if os.path.exists("/dev/shm" + n)]
    assert victim is None
    assert "rank 1" in survivor["recv"] and "died" in survivor["recv"], survivor
    # The pid watch notices within ~0.1 s; the bounds only rule out a hang on a loaded machine.
    assert survivor["recv_s"] < 10.0, survivor
    assert survivor["sends"] == "PeerLost" and survivor["send_s"] < 10.0, survivor


# -- shared memory: ring mechanics -----------------------------------------------------------------------------------


def _wraparound(count: int) -> int:
    # An 8 KiB ring with 4 KiB chunks: every size below wraps it many times; several exceed it by far.
    t, rank, peer = _connected("shm", ring_bytes=8192, chunk_bytes=4096, inline_bytes=2048, heap_bytes=0)
    try:
        rng = random.Random(1234)
        sizes = [rng.choice([1, 7, 100, 4095, 4096, 4097, 8191, 8192, 8193, 30_000, 200_003]) for _ in range(count)]
        handles = [t.isend(peer, i % 5, _payload(n, i)) for i, n in enumerate(sizes)]
        for i, n in enumerate(sizes):
            got = t.recv(peer, i % 5)
            assert got.shape == (n,) and torch.equal(got, _payload(n, i)), f"message {i} ({n} bytes) corrupted"
        for h in handles:
            h.wait(30)
        dist.barrier()
        return len(sizes)
    finally:
        t.close()


def test_shm_ring_wraparound_and_messages_larger_than_the_ring(ranks: Any) -> None:
    assert ranks.run(2, _wraparound, 300) == [300, 300]


def _many_small(count: int, tags: int) -> float:
    t, rank, peer = _connected("shm")
    try:
        start = time.monotonic()
        for i in range(count):
            t.isend(peer, i % tags, torch.tensor([i, rank], dtype=torch.int32))
        for i in range(count):
            got = t.recv(peer, i % tags)
            assert got.tolist() == [i, peer], (i, got)
        t.wait_sends()
        dist.barrier()
        return time.monotonic() - start
    finally:
        t.close()


def test_shm_many_small_messages(ranks: Any) -> None:
    # Completes (the case timeout guards against a stall); speed is benchmarks/transport.py's business.
    seconds = ranks.run(2, _many_small, 20_000, 7, timeout=300)
    assert all(s > 0 for s in seconds), seconds


def _pool_reuse(nbytes: int, count: int, pool_bytes: int, heap_bytes: int) -> dict[str, Any]:
    t, rank, peer = _connected("shm", pool_bytes=pool_bytes, heap_bytes=heap_bytes)
    try:
        addresses = set()
        for i in range(count):
            if rank == 0:
                t.isend(peer, i, _payload(nbytes, i)).wait(30)
                t.recv(peer, i)  # lock-step: one receive buffer is enough
            else:
                got = t.recv(peer, i)
                assert torch.equal(got, _payload(nbytes, i))
                addresses.add(got.data_ptr())
                del got  # back to the pool
                t.isend(peer, i, torch.zeros(1)).wait(30)
        dist.barrier()
        return {"stats": t.pool_stats(), "addresses": len(addresses), "transfers": t.transfer_stats()}
    finally:
        t.close()


def test_receive_pool_reuses_buffers(ranks: Any) -> None:
    # Streamed through the ring (no heap): into the private pool, the same pre-faulted buffer every time.
    receiver = ranks.run(2, _pool_reuse, 3 * MiB + 5, 40, 1 << 30, 0)[1]
    assert receiver["transfers"] == {"in_place": 0, "streamed": 40}, receiver
    assert receiver["addresses"] == 1, receiver
    assert receiver["stats"]["misses"] <= 2 and receiver["stats"]["hits"] >= 38, receiver
    # With no room to keep buffers, every message maps a fresh one: the cap is honoured.
    receiver = ranks.run(2, _pool_reuse, 3 * MiB + 5, 10, 0, 0)[1]
    assert receiver["stats"]["misses"] >= 10 and receiver["stats"]["cached_bytes"] == 0, receiver
    # Through the shared heap: received in place, and the freed pages are the next message's.
    receiver = ranks.run(2, _pool_reuse, 3 * MiB + 5, 40, 1 << 30, 16 * MiB)[1]
    assert receiver["transfers"]["in_place"] == 40 and receiver["stats"]["misses"] <= 1, receiver
    assert receiver["addresses"] == 1, receiver


def _heap_overflow(held: int, nbytes: int) -> dict[str, int]:
    """The receiver keeps every tensor: the 1 MiB heap fills and later messages stream, in order, intact."""
    t, rank, peer = _connected("shm", heap_bytes=1 * MiB, ring_bytes=64 << 10)
    try:
        handles = [t.isend(peer, 1, _payload(nbytes + i, i)) for i in range(held)]
        kept = [t.recv(peer, 1) for _ in range(held)]
        for i, got in enumerate(kept):
            assert torch.equal(got, _payload(nbytes + i, i)), f"message {i} corrupted"
        for h in handles:
            h.wait(30)
        stats = t.transfer_stats()
        dist.barrier()  # both have counted before either sends again
        del kept  # frees the heap pages
        dist.barrier()  # ... on both sides, before the next message looks for room
        t.isend(peer, 2, _payload(nbytes, 99)).wait(30)
        assert torch.equal(t.recv(peer, 2), _payload(nbytes, 99))
        dist.barrier()
        return {**stats, "after": t.transfer_stats()["in_place"] - stats["in_place"]}
    finally:
        t.close()


def test_shm_heap_full_falls_back_to_streaming(ranks: Any) -> None:
    out = ranks.run(2, _heap_overflow, 12, 200_000)[1]
    assert out["in_place"] >= 3 and out["streamed"] >= 6, out  # 1 MiB holds four of them at most
    assert out["in_place"] + out["streamed"] == 12 and out["after"] == 1, out


# -- shared memory: CUDA messages are reported once their data is ready -----------------------------------------------

_FAKE = struct.Struct("<qd")  # id, ready_at (time.monotonic(): one clock for all processes of the machine)


class _FakeCuda:
    """Stands in for ``CudaIpcChannel`` on a CPU ``shm`` transport, so the parking of not-ready CUDA messages is
    tested here (the real one, with a long kernel, is in ``test_transport_gpu.py``): a "descriptor" carries an id
    and the time its data becomes ready."""

    available = True

    def ready(self, peer: int, header: bytes) -> bool:
        return time.monotonic() >= _FAKE.unpack_from(header, hdr.HEADER_BYTES)[1]

    def receive(self, peer: int, header: bytes) -> torch.Tensor:
        return torch.tensor(_FAKE.unpack_from(header, hdr.HEADER_BYTES), dtype=torch.float64)  # [id, ready_at]

    def close(self) -> None:
        pass


def _send_fake_cuda(t: Any, peer: int, tag: int, ident: int, ready_at: float) -> None:
    words = hdr.encode(tag, torch.empty(1, dtype=torch.int64))
    words[1] = hdr.KIND_CUDA
    t._engine.isend(peer, tag, hdr.pack(words) + _FAKE.pack(ident, ready_at), 0, 0)


def _ready_rule() -> dict[str, Any]:
    t, rank, peer = _connected("shm")
    out: dict[str, Any] = {}
    try:
        if rank == 1:
            t._cuda = _FakeCuda()
        base = torch.tensor([time.monotonic()], dtype=torch.float64)
        dist.broadcast(base, 0)  # one reference time for both ranks
        t0 = float(base)
        if rank == 0:
            _send_fake_cuda(t, peer, 1, 1, t0 + 0.3)  # not ready for 0.3 s
            _send_fake_cuda(t, peer, 1, 2, t0)  # ready, but behind id 1 on its tag
            _send_fake_cuda(t, peer, 2, 3, t0)  # ready
            t.isend(peer, 3, torch.tensor([4])).wait(10)  # a host message: ready on arrival
            _send_fake_cuda(t, peer, 4, 5, t0 + 100)  # never ready during the case: recv takes it anyway
            _send_fake_cuda(t, peer, 5, 6, t0 + 100)  # never ready: wait_any times out
            t.isend(peer, 9, torch.tensor([9])).wait(10)  # marker: everything above is filed once it is
            dist.barrier()
            time.sleep(0.05)  # rank 1 is blocked in wait_any by now
            _send_fake_cuda(t, peer, 7, 7, time.monotonic() + 0.2)
        else:
            assert int(t.recv(peer, 9)[0]) == 9
            assert t.poll(peer, 1) is None, "a CUDA message was reported before its data was ready"
            assert len(t._parked[(peer, 1)]) == 1, t._parked
            assert t.poll(peer, 1) is None, "a ready message overtook an older one of its tag"
            got = t.poll_any([(peer, 1), (peer, 2)])
            assert got is not None and got[0] == 1 and int(got[1][0]) == 3, got
            got = t.poll_any([(peer, 1), (peer, 3)])
            assert got is not None and got[0] == 1 and int(got[1][0]) == 4, got
            index, tensor = t.wait_any([(peer, 1)], timeout=5)  # every key parked: polls the events
            out["first_ready_late_s"] = time.monotonic() - (t0 + 0.3)
            assert index == 0 and int(tensor[0]) == 1, (index, tensor)
            assert int(t.poll(peer, 1)[0]) == 2  # FIFO per tag
            assert t.poll(peer, 4) is None
            start = time.monotonic()
            assert int(t.recv(peer, 4, timeout=5)[0]) == 5  # recv delivers at arrival (documented)
            out["recv_s"] = time.monotonic() - start
            start = time.monotonic()
            try:
                t.wait_any([(peer, 5)], timeout=0.2)
                raise AssertionError("wait_any returned a message whose data never became ready")
            except TransportTimeout as exc:
                out["timeout_s"] = time.monotonic() - start
                assert "tag 5" in str(exc), str(exc)
            dist.barrier()
            # Nothing parked, nothing arrived: wait_any blocks in the mailbox, takes tag 7 when it comes, parks it
            # and hands it out once ready.
            index, tensor = t.wait_any([(peer, 6), (peer, 7)], timeout=5)
            out["second_ready_late_s"] = time.monotonic() - float(tensor[1])
            assert index == 1 and int(tensor[0]) == 7, (index, tensor)
            assert not t._parked.get((peer, 7)), t._parked
        dist.barrier()
        return out
    finally:
        t.close()


def test_shm_reports_cuda_messages_once_ready(ranks: Any) -> None:
    out = ranks.run(2, _ready_rule)[1]
    assert 0 <= out["first_ready_late_s"] < 1.0, out  # after its ready time, and promptly
    assert 0 <= out["second_ready_late_s"] < 1.0, out
    assert out["recv_s"] < 0.5, out
    assert 0.2 <= out["timeout_s"] < 1.2, out


# -- TCP -----------------------------------------------------------------------------------------------------------

HELLO = struct.Struct("<IIii32s")  # magic, version, src rank, dst rank, token (native/src/tcp_channel.cpp)
HELLO_MAGIC = 0x4C4C4548


def _knock(address: tuple[str, int], payload: bytes) -> bytes:
    """Connect as a stranger, send ``payload`` and return what comes back before the listener hangs up."""
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(payload)
        s.settimeout(5)
        try:
            return s.recv(64)
        except ConnectionResetError:
            return b""


def _tcp_strangers() -> dict[str, Any]:
    t, rank, peer = _connected("tcp")
    try:
        out: dict[str, Any] = {"address": t.address}
        if rank == 1:  # rank 1 listens (the lower rank of a pair connects)
            real_token = t._token
            out["wrong_token"] = _knock(t.address, HELLO.pack(HELLO_MAGIC, 1, 0, 1, bytes(32)))
            out["garbage"] = _knock(t.address, b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
            # Right token, but rank 0 is connected already: a replayed or forged hello is refused too.
            out["replay"] = _knock(t.address, HELLO.pack(HELLO_MAGIC, 1, 0, 1, real_token))
            out["rejected"] = t.rejected_connections
        dist.barrier()
        # The real connection is unharmed.
        t.isend(peer, 5, torch.full((1000,), float(rank)))
        assert torch.equal(t.recv(peer, 5), torch.full((1000,), float(peer)))
        dist.barrier()
        return out
    finally:
        t.close()


def test_tcp_rejects_connections_without_the_token(ranks: Any) -> None:
    _, listener = ranks.run(2, _tcp_strangers)
    assert listener["address"][0] == "127.0.0.1"  # MASTER_ADDR is 127.0.0.1 in the test groups
    assert listener["wrong_token"] == b"" and listener["garbage"] == b"" and listener["replay"] == b"", listener
    assert listener["rejected"] == 3, listener


def test_tcp_bind_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_megatron.transport.tcp import default_ifaddr

    store = dist.HashStore()
    monkeypatch.delenv("LM_TRANSPORT_IFADDR", raising=False)
    assert default_ifaddr("127.0.0.1") == "127.0.0.1"
    assert default_ifaddr("") == "127.0.0.1"
    with create_transport("tcp", rank=0, world_size=2, store=store) as t:
        assert t.address[0] != "0.0.0.0" and t.address[1] > 0
    monkeypatch.setenv("LM_TRANSPORT_IFADDR", "127.0.0.2")
    with create_transport("tcp", rank=0, world_size=2, store=store) as t:
        assert t.address[0] == "127.0.0.2"
        with socket.create_connection(t.address, timeout=5):  # really listening there
            pass
    for bad, words in [("0.0.0.0", "every interface"), ("eth0", "not an IP address")]:
        with pytest.raises(MegatronConfigError, match=words):
            create_transport("tcp", rank=0, world_size=2, store=store, ifaddr=bad)


# -- both native transports ----------------------------------------------------------------------------------------


def _control_and_interrupt(name: str) -> dict[str, Any]:
    t, rank, peer = _connected(name)
    try:
        t.isend_bytes(peer, 7, b"ipc-handle:" + bytes([rank]) * 40)
        assert t.recv_bytes(peer, 7) == b"ipc-handle:" + bytes([peer]) * 40
        t.isend_bytes(peer, 8, b"\x01\x02")
        assert t.recv(peer, 8).tolist() == [1, 2]  # also readable as a uint8 tensor
        dist.barrier()
        out: dict[str, Any] = {}
        # Ctrl-C while blocked in recv or wait_any: KeyboardInterrupt comes at once, the GIL is not held meanwhile.
        for how, wait in [
            ("recv", lambda: t.recv(peer, 999, timeout=20.0)),
            ("wait_any", lambda: t.wait_any([(peer, 998), (peer, 999)], timeout=20.0)),
        ]:
            timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
            ticks: list[Any] = []
            ticker = threading.Thread(target=lambda ticks=ticks: [ticks.append(time.sleep(0.01)) for _ in range(20)])
            start = time.monotonic()
            timer.start()
            ticker.start()
            try:
                wait()
                interrupted = None
            except KeyboardInterrupt:
                interrupted = time.monotonic() - start
            ticker.join()
            out[how] = {"interrupted_s": interrupted, "ticks": len(ticks)}
        dist.barrier()
        return out
    finally:
        t.close()


# ucx where its extra is installed (tests/test_transport_ucx.py has the rest of what is specific to it).
NATIVE = [
    "shm",
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif("ucx" not in available_transports(), reason="UCX not installed")),
]


@pytest.mark.parametrize("name", NATIVE)
def test_control_messages_and_ctrl_c(ranks: Any, name: str) -> None:
    for rank_out in ranks.run(2, _control_and_interrupt, name):
        for out in rank_out.values():
            assert out["interrupted_s"] is not None and out["interrupted_s"] < 1.5, rank_out
            assert out["ticks"] == 20, rank_out  # another Python thread ran while recv/wait_any waited


def _forked_child(t: Any) -> None:
    import gc

    t.close()  # a no-op in the child: no goodbye to the peer, no join of threads that are not here
    del t
    gc.collect()


def _fork_leaves_parent_alone(name: str) -> list[Any]:
    import multiprocessing as mp

    t, rank, peer = _connected(name)
    try:
        child = mp.get_context("fork").Process(target=_forked_child, args=(t,))  # as a DataLoader worker would
        child.start()
        child.join(20)
        dist.barrier()
        t.isend(peer, 1, torch.full((3,), rank))
        got = t.recv(peer, 1, timeout=10)
        dist.barrier()
        return [child.exitcode, got.tolist()]
    finally:
        t.close()


@pytest.mark.parametrize("name", NATIVE)
def test_fork_child_leaves_the_parents_transport_alone(name: str) -> None:
    # Fresh ranks: the child collects garbage. Forked from ranks that had run the whole suite's earlier cases it
    # died with SIGSEGV in CI while collecting their leftovers (it passes on ranks that ran only transport cases).
    group = WorkerGroup(2)
    try:
        assert group.run(_fork_leaves_parent_alone, name) == [[0, [1, 1, 1]], [0, [0, 0, 0]]]
    finally:
        group.shutdown()


def test_rdma_without_device_says_so() -> None:
    from lightning_megatron.transport import _native

    if not _native.HAVE_IBVERBS:
        with pytest.raises(TransportError, match="libibverbs-dev"):
            create_transport("rdma", rank=0, world_size=2, store=dist.HashStore())
        pytest.skip("built without rdma-core headers (the error names the fix: checked)")
    try:
        t = create_transport("rdma", rank=0, world_size=2, store=dist.HashStore())
    except TransportError as exc:
        assert "no RDMA device" in str(exc) and "tcp" in str(exc), exc
        pytest.skip(f"no RDMA device here: {exc}")
    t.close()


# -- build ---------------------------------------------------------------------------------------------------------


def _lmt_build():
    spec = importlib.util.spec_from_file_location("lmt_build", ROOT / "native" / "lmt_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_without_compiler_names_the_fix(tmp_path: Path) -> None:
    b = _lmt_build()
    with pytest.raises(b.NativeBuildError, match=r"not found.*apt-get install g\+\+.*build-essential.*make setup"):
        b.check_cxx([str(tmp_path / "no-such-c++"), "-pthread"])
    broken = tmp_path / "c++"
    broken.write_text("#!/bin/sh\necho 'cc1plus: not found' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(b.NativeBuildError, match=r"(?s)cannot build a C\+\+17.*cc1plus.*apt-get install g\+\+"):
        b.check_cxx([str(broken)])
    if not any(os.access(os.path.join(d, "g++"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("no g++ here to check the positive case")
    b.check_cxx(["g++", "-pthread"])
    assert b.have_ibverbs(["g++"]) == os.path.exists("/usr/include/infiniband/verbs.h")
