"""Every transport ends cleanly: two fresh processes create it, exchange messages, close it and exit.

The conformance suite's ranks live for the whole session, so it cannot see what happens when a process exits:
the ``torch`` transport used to leave its receive threads inside gloo's ``wait()`` and both processes died with
SIGABRT ("terminate called without an active exception"). Here every case is two freshly spawned processes; each
creates, uses and closes the transport twice and reports the threads, sockets and /dev/shm entries each round
left behind, and must exit with code 0. Threads and shared memory must never stay; a socket may stay after the
first round only (a library's one-time state: on the 2xH200 machine the ucx transport left one socket there,
with the CUDA-enabled UCX wheel; its cause is not confirmed), never after the second.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transport_cases  # noqa: F401  (registers shm+delay; the spawned ranks import this module, so they have it too)
from distributed import free_port

from lightning_megatron.transport import available_transports, create_transport


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _holdings() -> dict[str, Any]:
    return {
        "threads": {t.name for t in threading.enumerate()},
        "sockets": _sockets(),
        "shm": set(os.listdir("/dev/shm")),
    }


def _added(before: dict[str, Any]) -> dict[str, Any]:
    now = _holdings()
    return {
        "threads": sorted(now["threads"] - before["threads"]),
        # gloo's store may close a socket of its own meanwhile: only sockets added count
        "sockets": max(0, now["sockets"] - before["sockets"]),
        "shm": sorted(now["shm"] - before["shm"]),
    }


def _use(transport: Any, rank: int) -> None:
    peer = 1 - rank
    transport.connect([peer])
    for tag, size in enumerate((0, 10, 1 << 20)):
        transport.isend(peer, tag, torch.full((size,), float(rank)))
    for tag, size in enumerate((0, 10, 1 << 20)):
        got = transport.recv(peer, tag, timeout=30)
        assert got.numel() == size and (size == 0 or float(got[0]) == peer)
    transport.wait_sends(timeout=30)  # close() drops what has not left this process (the contract)
    transport.close()


def _rank(rank: int, port: int, name: str, destroy: bool, out: Any) -> None:
    """Two rounds of create, exchange, close: what the first leaves behind besides sockets, or anything the second
    adds, is a leak. A library's one-time state (UCX's or the CUDA driver's sockets once it is loaded) is not."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    start = _holdings()
    try:
        transport = create_transport(name, timeout=30)
    except Exception as exc:  # noqa: BLE001  (e.g. no RDMA device on this host)
        out.put((rank, "unavailable", str(exc).splitlines()[0]))
        return
    _use(transport, rank)
    del transport
    first = _added(start)
    dist.barrier()
    again = _holdings()
    _use(create_transport(name, timeout=30), rank)
    second = _added(again)
    if destroy:
        dist.destroy_process_group()
    out.put((rank, "ok", {"first": first, "second": second}))


@pytest.mark.parametrize("destroy", [False, True], ids=["close", "close+destroy_process_group"])
@pytest.mark.parametrize("name", available_transports())
def test_processes_exit_cleanly(name: str, destroy: bool) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, name, destroy, out)) for r in range(2)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(2):
            rank, status, detail = out.get(timeout=120)
            reports[rank] = (status, detail)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(status == "unavailable" for status, _ in reports.values()):
        pytest.skip(f"transport {name!r} cannot be created here: {reports[0][1]}")
    assert [p.exitcode for p in procs] == [0, 0], f"{name}: exit codes {[p.exitcode for p in procs]}"
    for rank, (_, left) in reports.items():
        first, second = left["first"], left["second"]
        assert first["threads"] == [] and first["shm"] == [], f"{name} rank {rank} left {first} after close()"
        assert second == {"threads": [], "sockets": 0, "shm": []}, (
            f"{name} rank {rank}: a second transport left {second} after close() (the first left {first})"
        )
