"""The ``shm`` transport between two GPUs of one node (CUDA IPC slots): skipped on CPU machines, run on the
device machine (2 GPUs). Two spawned processes, one GPU each, a gloo group only for the rendezvous store.

``test_shm_reports_cuda_messages_once_the_data_is_ready``: the sender sends a tensor that a long chain of
matmuls (~0.3 s) is still computing; ``poll``/``poll_any``/``wait_any`` on the receiver must not report it until
the sender's copy-in event has completed (its descriptor arrives at once and is parked meanwhile), and the data
must be bit-exact. Times are compared across the two processes on ``time.monotonic()`` (one clock per machine).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import free_port
from gpu_work import DTYPES, KERNEL_S, SLACK_S, long_producer, random_value

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one node")


def _cases(transport, rank: int, device: str) -> None:
    peer = 1 - rank
    # every dtype and shape, round-trip bit-exactly
    tag = 0
    for dtype in DTYPES:
        for shape in [(), (0,), (7,), (3, 5, 7), (2, 1, 4, 1, 3)]:
            tag += 1
            if rank == 0:
                transport.isend(peer, tag, random_value(tag, shape, dtype, device)).wait(30)
            else:
                got = transport.recv(peer, tag, timeout=30)
                want = random_value(tag, shape, dtype, device)
                assert got.device == torch.device(device) and got.dtype == dtype and got.shape == want.shape
                a, b = got.reshape(-1), want.reshape(-1)
                if dtype != torch.bool:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                assert torch.equal(a, b), (dtype, shape)
    # out of order, more in flight than the 16 slots (the rest staged through the host), both ways at once
    sizes = [8 << 20] * 20 + [3, 1 << 20, 300 << 20]
    handles = [
        transport.isend(peer, 1000 + i, random_value(1000 + i + rank, (n // 4,), torch.float32, device))
        for i, n in enumerate(sizes)
    ]
    for i in reversed(range(len(sizes))):
        got = transport.recv(peer, 1000 + i, timeout=60)
        want = random_value(1000 + i + peer, (sizes[i] // 4,), torch.float32, device)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), i  # bitwise: random bytes hold NaNs
    for h in handles:
        h.wait(60)
    # the source may be overwritten once the send is done; the receiver still gets the original
    if rank == 0:
        src = torch.full((1 << 20,), 3.0, device=device)
        h = transport.isend(peer, 5000, src)
        h.wait(30)
        src.fill_(-1.0)
    else:
        assert bool((transport.recv(peer, 5000, timeout=30) == 3.0).all())
    # a CPU tensor on a CUDA transport arrives on the transport's device
    if rank == 0:
        transport.isend(peer, 6000, torch.arange(10)).wait(30)
    else:
        assert torch.equal(transport.recv(peer, 6000, timeout=30), torch.arange(10, device=device))
    transport.wait_sends(timeout=60)
    torch.cuda.synchronize()


def _pair_worker(rank: int, port: int, out: str, body: Callable[[Any, int, str], Any]) -> None:
    """One of two spawned ranks: an ``shm`` transport on ``cuda:rank`` with CUDA IPC; ``body``'s report (JSON) or
    the traceback (``FAILED``) goes to ``out.rank``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        from lightning_megatron.transport import create_transport

        with create_transport("shm", device=f"cuda:{rank}", timeout=60) as transport:
            transport.connect([1 - rank])
            assert transport._cuda is not None and transport._cuda.available, "CUDA IPC path not available"
            report = body(transport, rank, f"cuda:{rank}")
            torch.distributed.barrier()
        Path(f"{out}.{rank}").write_text(json.dumps(report))
    except BaseException:
        Path(f"{out}.{rank}").write_text("FAILED\n" + traceback.format_exc())
        raise


def _run_pair(body: Callable[[Any, int, str], Any], out: str) -> list[Any]:
    import torch.multiprocessing as mp

    mp.start_processes(_pair_worker, args=(free_port(), out, body), nprocs=2, start_method="spawn", join=True)
    reports = []
    for rank in range(2):
        text = Path(f"{out}.{rank}").read_text()
        assert not text.startswith("FAILED"), text
        reports.append(json.loads(text))
    return reports


def _moves_tensors(transport: Any, rank: int, device: str) -> str:
    _cases(transport, rank, device)
    assert transport._cuda.host_staged > 0  # the burst outran the slots and still arrived
    return "ok"


def test_shm_moves_cuda_tensors_between_two_gpus(tmp_path: Path) -> None:
    assert _run_pair(_moves_tensors, str(tmp_path / "result")) == ["ok", "ok"]


# -- "arrived" means the data is ready ------------------------------------------------------------------------------


def _ready_rounds(transport: Any, rank: int, device: str) -> dict[str, Any]:
    peer = 1 - rank
    produce, expected_s = long_producer(device, KERNEL_S)
    report: dict[str, Any] = {"kernel_s": expected_s}
    # Warm-up: the first send to a peer allocates and exports its staging slot; the timed rounds reuse it.
    if rank == 0:
        transport.isend(peer, 1, torch.zeros(4096, 4096, device=device)).wait(60)
    else:
        assert bool((transport.recv(peer, 1, timeout=60) == 0).all())
    for r, how in enumerate(["poll", "poll_any", "wait_any", "recv"]):
        tag = 100 * (r + 1)
        torch.distributed.barrier()
        if rank == 0:
            x = produce()  # queued: the GPU is busy with it for ~KERNEL_S from now
            finished = torch.cuda.Event()
            finished.record()
            sent_at = time.monotonic()
            handle = transport.isend(peer, tag, x)
            posted_s = time.monotonic() - sent_at
            finished.synchronize()
            done_at = time.monotonic()
            handle.wait(60)
            transport.isend(peer, tag + 1, x.cpu())  # the truth, through the host
            transport.isend(peer, tag + 2, torch.tensor([sent_at, done_at, posted_s], dtype=torch.float64))
            transport.wait_sends(timeout=60)
            assert done_at - sent_at > 0.1, f"{how}: the kernel ended {done_at - sent_at:.3f} s after the send"
            report[how] = {"posted_s": posted_s, "kernel_after_send_s": done_at - sent_at}
            continue
        start = time.monotonic()
        first_parked = None
        not_ready_polls = 0
        if how in ("poll", "poll_any"):
            while True:
                if how == "poll":
                    got = transport.poll(peer, tag)
                else:
                    found = transport.poll_any([(peer, tag + 50), (peer, tag)])
                    if found is not None:
                        assert found[0] == 1, found[0]
                    got = None if found is None else found[1]
                now = time.monotonic()
                if got is not None:
                    break
                if (peer, tag) in transport._parked:  # the descriptor is here, its data is not
                    first_parked = first_parked if first_parked is not None else now
                    not_ready_polls += 1
                assert now - start < 60, f"{how}: nothing within 60 s"
                time.sleep(1e-4)
        elif how == "wait_any":
            index, got = transport.wait_any([(peer, tag + 50), (peer, tag)], timeout=60)
            now = time.monotonic()
            assert index == 1, index
        else:
            got = transport.recv(peer, tag, timeout=60)  # delivers at arrival: the copy waits on the stream
            now = time.monotonic()
        truth = transport.recv(peer, tag + 1, timeout=60)
        sent_at, done_at, _ = transport.recv(peer, tag + 2, timeout=60).cpu().tolist()
        torch.cuda.synchronize()
        assert got.device == torch.device(device) and got.dtype == torch.float32 and got.shape == (4096, 4096)
        assert torch.equal(got.view(torch.uint8), truth.view(torch.uint8)), f"{how}: bytes differ"
        entry = {"got_after_send_s": now - sent_at, "got_minus_kernel_end_s": now - done_at}
        if how != "recv":
            assert now >= done_at - SLACK_S, (
                f"{how} reported the message {done_at - now:.3f} s before the sender's kernel ended"
            )
        if how in ("poll", "poll_any"):
            assert first_parked is not None and not_ready_polls > 0, f"{how}: the descriptor was never parked"
            assert now - first_parked > 0.05, f"{how}: parked for only {now - first_parked:.3f} s"
            entry.update(parked_s=now - first_parked, not_ready_polls=not_ready_polls)
        report[how] = entry
    transport.wait_sends(timeout=60)
    torch.cuda.synchronize()
    return report


def test_shm_reports_cuda_messages_once_the_data_is_ready(tmp_path: Path) -> None:
    sender, receiver = _run_pair(_ready_rounds, str(tmp_path / "ready"))
    print(json.dumps({"sender": sender, "receiver": receiver}, indent=1))  # timings, for the record (pytest -s)
    assert all(sender[how]["posted_s"] < 0.05 for how in ("poll", "poll_any", "wait_any", "recv")), sender
