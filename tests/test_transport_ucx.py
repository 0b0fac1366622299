"""What is specific to the ``ucx`` transport; the contract itself is checked by ``test_transport.py``, which runs
every case on ``ucx`` where UCX is installed (two network namespaces as two hosts included), and the exit
checks by ``test_transport_exit.py``.

Here: UCX picks shared memory on one host (not TCP loopback), settings it refuses and a peer that never comes
are clear errors, a peer SIGKILLed mid-transfer raises PeerLost on both receives and sends and leaves no shared
memory, thread or file descriptor behind, and without the ``ucx`` extra the error names it.

UCX is never loaded into the pytest process: ranks are forked from it, and a process must not fork with UCX
initialised and use it in the child. Every case runs in forked ranks or in a spawned interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from distributed import WorkerGroup
from transport_cases import check_received, expect, pattern

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport import TransportError, TransportTimeout, available_transports
from lightning_megatron.transport import create_transport as create

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
needs_ucx = pytest.mark.skipif(
    "ucx" not in available_transports(), reason="UCX is not installed: pip install 'lightning-megatron[ucx]'"
)


def _init() -> tuple[int, int]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _leftovers() -> dict[str, Any]:
    """What a transport may leave in this process: its threads (ours is "lmt-ucx", UCX's "async"), its file
    descriptors, and its /dev/shm entries."""
    threads = []
    for tid in os.listdir("/proc/self/task"):
        try:
            threads.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            pass
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return {
        "threads": sorted(t for t in threads if t in ("lmt-ucx", "async")),
        "fds": fds,
        "shm": set(os.listdir("/dev/shm")),
    }


def _sysv_segments() -> set[str]:
    """SysV shared-memory segment ids (UCX's sysv transport makes some; they must go away with the processes)."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {line.split()[1] for line in lines}


@contextmanager
def _fresh_pair(tmp_path: Path) -> Iterator[WorkerGroup]:
    """A pair of ranks of its own (a case that kills a rank, or leaves the pair's connect counters uneven)."""
    group = WorkerGroup(2, tmp_path)
    try:
        yield group
    finally:
        group.shutdown(kill=True)


# -- one host: shared memory, nothing left behind ------------------------------------------------------------------


def _same_host() -> dict[str, Any]:
    rank, _ = _init()
    peer = 1 - rank
    big = pattern(32 * MiB, seed=rank)  # allocated (and torch's threads started) before the baseline
    dist.barrier()  # gloo's connections are up before the baseline
    before = _leftovers()
    t = create("ucx", timeout=30.0)
    try:
        dist.barrier()
        t.connect([peer])
        during = _leftovers()
        lanes = t.transports_to(peer)
        t.isend(peer, 1, big)
        check_received(t.recv(peer, 1), pattern(32 * MiB, seed=peer), "32 MiB on one host")
        t.wait_sends()
        dist.barrier()
    finally:
        t.close()
    after = _leftovers()
    return {
        "lanes": lanes,
        "threads_during": during["threads"],
        "threads_after": after["threads"],
        "new_fds": sorted(after["fds"] - before["fds"]),
        "new_shm": sorted(after["shm"] - before["shm"]),
        "version": t.ucx_version,
    }


@needs_ucx
def test_one_host_uses_shared_memory_and_leaves_nothing(ranks: Any) -> None:
    out = ranks.run(2, _same_host)[0]
    if "UCX_TLS" not in os.environ:  # UCX's own choice, with this transport's defaults (ucx.UCX_DEFAULTS)
        assert any(lane.split("/")[0] in ("posix", "sysv") for lane in out["lanes"]), out
        assert not any(lane.startswith("tcp/") for lane in out["lanes"]), out  # not loopback TCP
    assert out["threads_during"] == ["async", "lmt-ucx"], out
    assert out["threads_after"] == [] and out["new_fds"] == [] and out["new_shm"] == [], out


# -- the device path, driven with host memory ----------------------------------------------------------------------


def _device_path_on_host() -> dict[str, Any]:
    """The CUDA path's machinery (flagged sends, rendezvous messages kept by the engine and pulled into tensors
    allocated by Python, in order with eager ones) with host memory in place of GPU memory
    (``UcxTransport._emulate_device_path``): what a GPU run adds is only UCX's CUDA transports."""
    rank, _ = _init()
    peer = 1 - rank
    t = create("ucx", timeout=30.0)
    out: dict[str, Any] = {}
    try:
        t._emulate_device_path()
        dist.barrier()
        t.connect([peer])
        sizes = [0, 1, 3, 4096, 64 << 10, 1 * MiB, 8 * MiB, 32 * MiB]
        handles = [t.isend(peer, 100 + i, pattern(n, seed=1000 * rank + i)) for i, n in enumerate(sizes)]
        fifo = [4 * MiB, 5, 6 * MiB, 0, 2 * MiB]  # one tag: rendezvous and eager messages stay in order
        handles += [t.isend(peer, 200, pattern(n, seed=2000 * rank + i)) for i, n in enumerate(fifo)]
        wide = torch.arange(3 * 1024 * 1024, dtype=torch.float64).reshape(1024, 3 * 1024)
        handles.append(t.isend(peer, 300, wide[:, ::3]))  # non-contiguous: its contiguous copy goes
        handles.append(t.isend(peer, 301, torch.tensor(2.5, dtype=torch.bfloat16)))  # 0-d
        for i in reversed(range(len(sizes))):  # taken in reverse: deferred messages wait for their pull
            check_received(t.recv(peer, 100 + i), pattern(sizes[i], seed=1000 * peer + i), f"tag {100 + i}")
        for i, n in enumerate(fifo):
            got = t.poll(peer, 200) if i == 0 and n > 0 else None  # poll pulls too (it may not have arrived)
            got = got if got is not None else t.recv(peer, 200)
            check_received(got, pattern(n, seed=2000 * peer + i), f"tag 200 message {i}")
        index, got = t.wait_any([(peer, 399), (peer, 300)])
        assert index == 1 and torch.equal(got, wide[:, ::3].contiguous()), index
        check_received(t.recv(peer, 301), torch.tensor(2.5, dtype=torch.bfloat16), "0-d")
        for h in handles:
            h.wait(30)
        t.wait_sends(timeout=30)
        out["pulls"] = t.pulls
        out["poster_queued"] = t._poster.queued
        # A stream on one tag, all arrived before the first take: the takes start the pulls behind them at once
        # (taken ahead, in order), and every message still comes out whole and in order.
        dist.barrier()  # both have taken everything before: nothing of the stream is taken ahead by those takes
        stream = [t.isend(peer, 400, pattern(4 * MiB + i, seed=4000 * rank + i)) for i in range(6)]
        dist.barrier()
        time.sleep(0.5)  # the descriptors have landed in the mailbox (the data waits for the pulls: rendezvous)
        ahead_before = t.pulled_ahead
        for i in range(6):
            got = t.poll(peer, 400) if i == 1 else None  # a poll serves taken-ahead messages too
            got = got if got is not None else t.recv(peer, 400)
            check_received(got, pattern(4 * MiB + i, seed=4000 * peer + i), f"stream message {i}")
        out["pulled_ahead"] = t.pulled_ahead - ahead_before
        for h in stream:
            h.wait(30)
        # A stream with a tag per message (as pipelines and the benchmark send): a take also starts the pulls of
        # the deferred messages heading other tags' queues, oldest first. An eager message heading a tag stays in
        # the mailbox, and so does the deferred one behind it (FIFO per tag).
        dist.barrier()
        wide_tags = [t.isend(peer, 500 + i, pattern(4 * MiB + i, seed=5000 * rank + i)) for i in range(6)]
        wide_tags.append(t.isend(peer, 520, pattern(3, seed=5200 * rank)))  # eager
        wide_tags.append(t.isend(peer, 520, pattern(4 * MiB, seed=5201 * rank)))  # deferred, behind it
        dist.barrier()
        time.sleep(0.5)
        ahead_before = t.pulled_ahead
        for i in [3, 0, 1, 2, 5, 4]:  # not in arrival order
            check_received(t.recv(peer, 500 + i), pattern(4 * MiB + i, seed=5000 * peer + i), f"tag {500 + i}")
        out["pulled_across_tags"] = t.pulled_ahead - ahead_before
        out["ahead_on_520"] = len(t._ahead.get((peer, 520), ()))
        check_received(t.recv(peer, 520), pattern(3, seed=5200 * peer), "eager head of tag 520")
        check_received(t.recv(peer, 520), pattern(4 * MiB, seed=5201 * peer), "deferred behind it")
        out["left_ahead"] = sum(len(queue) for queue in t._ahead.values())
        # Nothing of a tag outlives its messages: pipelines tag every message anew, and kept keys made each take
        # slower (a scan of every tag ever seen: 16 MiB at 0.34-0.38x NCCL on 2 x H200 after a thousand tags).
        out["ahead_keys"], out["ahead_totals"] = len(t._ahead), (t._ahead_count, t._ahead_bytes)
        for h in wide_tags:
            h.wait(30)
        # A message never taken: its kept descriptor is released at close, nothing hangs.
        if rank == 0:
            t.isend(peer, 900, pattern(16 * MiB, seed=9))
        dist.barrier()
        time.sleep(0.5)  # let it arrive (and be kept) before rank 1 closes
    finally:
        start = time.monotonic()
        t.close()
        out["close_s"] = time.monotonic() - start
    dist.barrier()
    return out


@needs_ucx
def test_device_path_with_host_memory(ranks: Any) -> None:
    outs = ranks.run(2, _device_path_on_host)
    for out in outs:
        # 1, 8 and 32 MiB, the three large FIFO messages and the 12 MiB non-contiguous one come by rendezvous
        assert out["pulls"] >= 5, outs
        assert out["pulled_ahead"] >= 3, outs  # the stream's pulls ran side by side, not one take at a time
        assert out["pulled_across_tags"] == 5, outs  # the first take started the other five tags' pulls
        assert out["ahead_on_520"] == 0 and out["left_ahead"] == 0, outs
        assert out["ahead_keys"] == 0 and out["ahead_totals"] == (0, 0), outs
        assert out["close_s"] < 10, outs


# -- bad input ---------------------------------------------------------------------------------------------------


def _bad_settings() -> dict[str, Any]:
    rank, _ = _init()
    out: dict[str, Any] = {}
    out["unknown"] = expect(
        MegatronConfigError, lambda: create("ucx", ucx_config={"NO_SUCH_SETTING": "1"}), words=("NO_SUCH_SETTING",)
    )
    out["value"] = expect(
        MegatronConfigError, lambda: create("ucx", ucx_config={"UCX_KEEPALIVE_INTERVAL": "soon"}), words=("soon",)
    )
    out["type"] = expect(MegatronConfigError, lambda: create("ucx", ucx_config={"TLS": None}), words=("TLS",))
    out["interval"] = expect(MegatronConfigError, lambda: create("ucx", keepalive_interval=0), words=("keepalive",))
    out["kwarg"] = expect(TypeError, lambda: create("ucx", bogus=1), words=("bogus",))
    out["pull_ahead"] = expect(MegatronConfigError, lambda: create("ucx", pull_ahead=-1), words=("pull_ahead",))
    os.environ["UCX_TLS"] = "no_such_transport"
    try:
        out["tls"] = expect(TransportError, lambda: create("ucx"), words=("UCX_TLS=no_such_transport",))
    finally:
        del os.environ["UCX_TLS"]
    # A peer that never connects: a timeout naming it, not a hang.
    t = create("ucx", timeout=1.0)
    try:
        if rank == 0:
            start = time.monotonic()
            out["absent"] = expect(TransportTimeout, t.connect, [1], words=("rank 1", "connect([0])"))
            out["absent_s"] = time.monotonic() - start
    finally:
        t.close()
    dist.barrier()
    return out


@needs_ucx
def test_bad_settings_and_absent_peer(tmp_path: Path) -> None:
    with _fresh_pair(tmp_path) as group:  # rank 0 connects alone: its connect counter no longer matches rank 1's
        out = group.run(_bad_settings)[0]
    assert "ucx_info" in out["unknown"], out
    assert out["absent_s"] < 5, out


# -- SIGKILL mid-transfer ----------------------------------------------------------------------------------------


def _kill_mid_transfer(report: str) -> Optional[dict[str, Any]]:
    """64 MiB messages stream both ways (rendezvous: the receiver reads the sender's memory); rank 1 SIGKILLs
    itself after the first arrived. The survivor's receives must fail with PeerLost, fast. Its sends posted before
    the death may have completed (UCX may finish a send locally, e.g. the one rank 1 received, or any it chose to
    send eagerly on a loaded host): each ends, returned or PeerLost, never hangs; a send posted after the death
    must fail with PeerLost."""
    rank, _ = _init()
    peer = 1 - rank
    big = torch.ones(64 * MiB, dtype=torch.uint8)
    dist.barrier()
    before = _leftovers()
    t = create("ucx", timeout=30.0)
    dist.barrier()
    t.connect([peer])
    handles = [t.isend(peer, 10 + i, big) for i in range(4)]
    if rank == 1:
        t.recv(peer, 10)
        Path(report, "died").write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock per machine
        os.kill(os.getpid(), signal.SIGKILL)
    # the fifth message never comes: PeerLost, whether or not all four arrived before the death
    out: dict[str, Any] = {"recv": _outcome(lambda: [t.recv(peer, 10 + i, timeout=20.0) for i in range(5)])}
    start = float(Path(report, "died").read_text())
    out["recv_s"] = time.monotonic() - start
    out["sends"] = [_outcome(lambda h=h: h.wait(20.0)) for h in handles]
    out["send_s"] = time.monotonic() - start
    out["late_send"] = _outcome(lambda: t.isend(peer, 20, big).wait(20.0))
    out["late_send_s"] = time.monotonic() - start
    t.close()
    handles.clear()
    after = _leftovers()
    out.update(
        threads=after["threads"],
        new_fds=sorted(after["fds"] - before["fds"]),
        new_shm=sorted(after["shm"] - before["shm"]),
    )
    return out


def _outcome(fn: Any) -> str:
    """ "returned", or the transport error ``fn`` raised, as "Class: message"."""
    try:
        fn()
    except TransportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


@needs_ucx
def test_sigkill_mid_transfer(tmp_path: Path) -> None:
    segments, shm = _sysv_segments(), set(os.listdir("/dev/shm"))
    with _fresh_pair(tmp_path) as group:
        survivor, victim = group.run(_kill_mid_transfer, str(tmp_path), may_die={1}, timeout=90)
    assert victim is None
    assert survivor["recv"].startswith("PeerLost") and "rank 1" in survivor["recv"], survivor
    assert survivor["recv_s"] < 10 and survivor["send_s"] < 10, survivor
    assert all(s == "returned" or s.startswith("PeerLost") for s in survivor["sends"]), survivor
    assert survivor["late_send"].startswith("PeerLost") and survivor["late_send_s"] < 10, survivor
    assert survivor["threads"] == [] and survivor["new_fds"] == [] and survivor["new_shm"] == [], survivor
    assert _sysv_segments() <= segments and set(os.listdir("/dev/shm")) <= shm  # the dead rank's are gone too


# -- without the extra -------------------------------------------------------------------------------------------

_WITHOUT_UCX = textwrap.dedent(
    """
    import ctypes.util, sys
    sys.modules["libucx"] = None  # the wheel is not installed
    ctypes.util.find_library = lambda name: None  # nor is a system UCX
    import torch.distributed as dist
    from lightning_megatron.errors import MegatronConfigError
    from lightning_megatron.transport import available_transports, create_transport
    from lightning_megatron.transport import _native
    assert "ucx" not in available_transports(), available_transports()
    try:
        create_transport("ucx", rank=0, world_size=2, store=dist.HashStore())
    except MegatronConfigError as exc:
        print("ERROR:", exc)
    assert not _native.ucx_loaded()
    from lightning_megatron.pipeline.transports import check_transport_settings
    try:
        check_transport_settings("ucx", {})  # a schedule's transport option, checked when the strategy is built
    except MegatronConfigError as exc:
        print("OPTION:", exc)
    """
)


def test_without_the_extra_names_it() -> None:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_UCX], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line.split(":")[0]: line for line in result.stdout.splitlines()}
    for what in ("ERROR", "OPTION"):
        assert "pip install 'lightning-megatron[ucx]'" in lines.get(what, ""), result.stdout
