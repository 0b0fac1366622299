"""The ``ucx`` transport between two GPUs of one node: skipped unless there are 2 GPUs and a UCX with its CUDA
transport modules (the ``libucx-cu12``/``-cu13`` wheels). Two spawned processes, one GPU each, a gloo group only
for the rendezvous store; modelled on ``test_transport_gpu.py`` (the ``shm`` transport's CUDA IPC path).

Run it with ``pytest -q -s tests/test_transport_ucx_gpu.py``: ``-s`` shows each rank's report (UCX's version,
the lanes ``transports_to`` names, how many messages were received straight into GPU memory, timings). Every
failure names the case and carries both ranks' reports and the tail of their step logs; a rank that hangs is
killed after ``PAIR_TIMEOUT_S`` and its Python stacks (faulthandler) are in its log.

``test_ucx_moves_cuda_tensors_between_two_gpus``: every dtype of ``DTYPES``, 0-d, empty and non-contiguous
tensors, sizes up to 64 MiB, both ways at once and out of order, one tag in FIFO order, poll/poll_any/wait_any,
bit-exact. ``test_ucx_sends_cuda_tensors_only_once_computed``: the sender sends a tensor that a long chain of
matmuls (~0.3 s) is still computing; ``isend`` must return at once and the receiver must get the final values.
"""

from __future__ import annotations

import faulthandler
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

from lightning_megatron.transport import available_transports

PAIR_TIMEOUT_S = 420.0
"""The two ranks of one test, start-up included (a hang is killed after this and reported)."""


def _skip_reason() -> str:
    if torch.cuda.device_count() < 2:
        return "needs 2 GPUs of one node"
    if "ucx" not in available_transports():
        return "UCX is not installed: pip install 'lightning-megatron[ucx]' (a libucx-cu* wheel)"
    from lightning_megatron.transport.ucx import UcxTransport, ucx_cuda_modules

    if "cuda" not in UcxTransport.devices:
        return (
            f"this UCX has no CUDA transport modules next to libucp ({ucx_cuda_modules()}) or LMT_UCX_CUDA=0: "
            "install a libucx-cu* wheel"
        )
    return ""


_SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "runs")

MiB = 1 << 20


def _bytes(n: int, seed: int, device: str) -> torch.Tensor:
    """``n`` deterministic bytes made on the GPU (cheap at 64 MiB)."""
    words = torch.arange(seed, seed + (n + 7) // 8, dtype=torch.int64, device=device)
    words.mul_(6364136223846793005).add_(1442695040888963407)
    return words.view(torch.uint8)[:n].clone()


def _check(got: Any, want: torch.Tensor, device: str, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}"
    assert got.device == torch.device(device), f"{what}: on {got.device}, not {device}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.is_contiguous(), f"{what}: not contiguous"
    torch.cuda.synchronize()
    a, b = got.reshape(-1), want.contiguous().reshape(-1).to(device)
    if got.dtype != torch.bool:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if not torch.equal(a, b):
        diff = (a != b).nonzero()
        raise AssertionError(
            f"{what}: bytes differ at {diff.numel()} of {a.numel()} positions, first {diff[:5].flatten().tolist()}"
        )


# -- the pair of ranks ------------------------------------------------------------------------------------------


class _Log:
    """Each rank's step log (``out.rank.log``): the last line says where a failing or hanging rank was."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115  (kept open for faulthandler)
        self.start = time.monotonic()

    def __call__(self, what: str) -> None:
        self.file.write(f"{time.monotonic() - self.start:9.3f} s  {what}\n")


def _pair_worker(rank: int, port: int, out: str, body: Callable[..., Any]) -> None:
    """One of two spawned ranks: a ``ucx`` transport on ``cuda:rank``; ``body``'s report (JSON) or ``FAILED`` and
    the traceback go to ``out.rank``, its steps to ``out.rank.log``."""
    log = _Log(f"{out}.{rank}.log")
    faulthandler.dump_traceback_later(PAIR_TIMEOUT_S - 30, exit=False, file=log.file)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    report: dict[str, Any] = {"rank": rank}
    transport = None
    try:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        report.update(
            torch=torch.__version__,
            torch_cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name(rank),
            ucx_env={k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        )
        log("init_process_group")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        from lightning_megatron.transport import create_transport
        from lightning_megatron.transport.ucx import ucx_cuda_modules

        report["ucx_cuda_modules"] = ucx_cuda_modules()
        log("create_transport")
        transport = create_transport("ucx", device=device, timeout=60)
        report["ucx_version"] = transport.ucx_version
        report["max_am_header"] = transport._engine.max_am_header
        report["cuda_direct"] = transport.cuda_direct
        log("connect")
        transport.connect([1 - rank])
        report["lanes_at_connect"] = transport.transports_to(1 - rank)
        log(f"lanes {report['lanes_at_connect']}")
        assert transport.cuda_direct, "the CUDA path is off (UCX's AM header too small?): tensors go via the host"
        report.update(body(transport, rank, device, log) or {})
        report["lanes_after"] = transport.transports_to(1 - rank)
        report["pulls"] = transport.pulls
        report["sends_queued_for_their_data"] = transport._poster.queued
        log("barrier")
        torch.distributed.barrier()
        log("close")
        transport.close()
        transport = None
        log("done")
        Path(f"{out}.{rank}").write_text(json.dumps(report))
    except BaseException:
        report["traceback"] = traceback.format_exc()
        Path(f"{out}.{rank}").write_text("FAILED\n" + json.dumps(report, indent=1, default=str))
        log("FAILED")
        if transport is not None:
            try:
                transport.close()
            except BaseException:  # noqa: BLE001
                pass
        raise


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run_pair(body: Callable[..., Any], out: str) -> list[dict[str, Any]]:
    """Both ranks in spawned processes (CUDA does not survive fork); killed after ``PAIR_TIMEOUT_S``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_pair_worker, args=(rank, port, out, body)) for rank in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + PAIR_TIMEOUT_S
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1.0))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    texts = [Path(f"{out}.{rank}").read_text() if Path(f"{out}.{rank}").exists() else "" for rank in range(2)]
    logs = "\n".join(f"--- rank {rank} log (tail) ---\n{_tail(Path(f'{out}.{rank}.log'))}" for rank in range(2))
    detail = "\n".join(f"--- rank {rank} report ---\n{text or '(none)'}" for rank, text in enumerate(texts))
    print(detail + "\n" + logs)
    assert not hung, f"rank(s) {hung} still running after {PAIR_TIMEOUT_S:.0f} s: killed\n{detail}\n{logs}"
    for rank, (p, text) in enumerate(zip(procs, texts)):
        assert text and not text.startswith("FAILED") and p.exitcode == 0, (
            f"rank {rank} failed (exit code {p.exitcode})\n{detail}\n{logs}"
        )
    return [json.loads(text) for text in texts]


def _lanes_note(reports: list[dict[str, Any]]) -> None:
    """``transports_to`` should name a CUDA transport (cuda_ipc, cuda_copy): recorded, asserted only with
    ``LMT_UCX_EXPECT_CUDA_LANE=1`` (which lanes ep_query lists for CUDA memory is UCX's business)."""
    for report in reports:
        lanes = report.get("lanes_after", []) + report.get("lanes_at_connect", [])
        has_cuda = any("cuda" in lane for lane in lanes)
        print(f"rank {report['rank']}: UCX {report.get('ucx_version')} lanes {lanes} -> names cuda: {has_cuda}")
        if os.environ.get("LMT_UCX_EXPECT_CUDA_LANE") == "1":
            assert has_cuda, f"transports_to names no cuda transport: {lanes}"


# -- every dtype, shape and size --------------------------------------------------------------------------------


def _moves_tensors(transport: Any, rank: int, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    peer = 1 - rank
    report: dict[str, Any] = {}
    # every dtype and shape (0-d and empty included), round-trip bit-exactly, one direction after the other
    log("dtypes")
    tag = 0
    for sender in (0, 1):
        for dtype in DTYPES:
            for shape in [(), (0,), (7,), (3, 5, 7), (2, 1, 4, 1, 3), (1024, 1024)]:
                tag += 1
                if rank == sender:
                    transport.isend(peer, tag, random_value(tag, shape, dtype, device)).wait(60)
                else:
                    got = transport.recv(peer, tag, timeout=60)
                    _check(got, random_value(tag, shape, dtype, device), device, f"tag {tag}: {dtype} {shape}")
    # non-contiguous sources: their contiguous copies go (made on the current stream, waited for)
    log("non-contiguous")
    base = random_value(500 + rank, (2048, 3072), torch.float32, device)
    views = {501: base.t(), 502: base[:, ::3], 503: base[::2, 1::2].t(), 504: base[5]}
    handles = [transport.isend(peer, t, v) for t, v in views.items()]
    other = random_value(500 + peer, (2048, 3072), torch.float32, device)
    peer_views = {501: other.t(), 502: other[:, ::3], 503: other[::2, 1::2].t(), 504: other[5]}
    for t in reversed(list(peer_views)):
        _check(transport.recv(peer, t, timeout=60), peer_views[t], device, f"non-contiguous tag {t}")
    for h in handles:
        h.wait(60)
    # sizes up to 64 MiB, both ways at once, received out of order
    log("sizes")
    sizes = [1, 1000, 8 << 10, 64 << 10, 256 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 3, 64 * MiB]
    start = time.monotonic()
    handles = [transport.isend(peer, 1000 + i, _bytes(n, 1000 * rank + i, device)) for i, n in enumerate(sizes)]
    report["isend_s"] = time.monotonic() - start
    for i in reversed(range(len(sizes))):
        _check(
            transport.recv(peer, 1000 + i, timeout=60),
            _bytes(sizes[i], 1000 * peer + i, device),
            device,
            f"{sizes[i]} bytes",
        )
    for h in handles:
        h.wait(60)
    # one tag: FIFO whatever the protocol of each message (rendezvous ones wait for their pull, eager ones do not)
    log("fifo")
    fifo = [32 * MiB, 5, 0, 8 * MiB, 100, 2 * MiB]
    handles = [transport.isend(peer, 2000, _bytes(n, 2000 * rank + i, device)) for i, n in enumerate(fifo)]
    for i, n in enumerate(fifo):
        _check(transport.recv(peer, 2000, timeout=60), _bytes(n, 2000 * peer + i, device), device, f"FIFO message {i}")
    for h in handles:
        h.wait(60)
    # poll, poll_any, wait_any deliver CUDA messages too (a deferred one is received when taken)
    log("poll / poll_any / wait_any")
    handles = [transport.isend(peer, 3000 + i, _bytes(8 * MiB, 3000 * rank + i, device)) for i in range(3)]
    deadline = time.monotonic() + 60
    got = None
    while got is None:
        got = transport.poll(peer, 3000)
        assert time.monotonic() < deadline, "poll: nothing within 60 s"
    _check(got, _bytes(8 * MiB, 3000 * peer, device), device, "poll")
    found = None
    while found is None:
        found = transport.poll_any([(peer, 3999), (peer, 3001)])
        assert time.monotonic() < deadline, "poll_any: nothing within 60 s"
    assert found[0] == 1, found[0]
    _check(found[1], _bytes(8 * MiB, 3000 * peer + 1, device), device, "poll_any")
    index, got = transport.wait_any([(peer, 3999), (peer, 3002)], timeout=60)
    assert index == 1, index
    _check(got, _bytes(8 * MiB, 3000 * peer + 2, device), device, "wait_any")
    for h in handles:
        h.wait(60)
    # the source may be overwritten once the send is done; the receiver still gets the original
    log("overwrite after done")
    if rank == 0:
        src = torch.full((4 * MiB,), 3.0, device=device)
        transport.isend(peer, 5000, src).wait(60)
        src.fill_(-1.0)
        torch.cuda.synchronize()
    else:
        got = transport.recv(peer, 5000, timeout=60)
        assert bool((got == 3.0).all()), "the received tensor changed with the sender's source after done()"
    # a CPU tensor on a CUDA transport arrives on the transport's device
    log("cpu tensor")
    if rank == 0:
        transport.isend(peer, 6000, torch.arange(10)).wait(60)
        transport.isend(peer, 6001, torch.arange(4 * MiB, dtype=torch.int32)).wait(60)
    else:
        _check(transport.recv(peer, 6000, timeout=60), torch.arange(10), device, "small CPU tensor")
        _check(
            transport.recv(peer, 6001, timeout=60),
            torch.arange(4 * MiB, dtype=torch.int32),
            device,
            "16 MiB CPU tensor",
        )
    transport.wait_sends(timeout=60)
    torch.cuda.synchronize()
    # 64 MiB GPU to GPU, timed (for the record)
    log("timing")
    x = _bytes(64 * MiB, 7, device)
    rounds = []
    for r in range(5):
        torch.distributed.barrier()
        t0 = time.monotonic()
        if rank == 0:
            transport.isend(peer, 7000 + r, x).wait(60)
            transport.recv(peer, 7100 + r, timeout=60)
        else:
            got = transport.recv(peer, 7000 + r, timeout=60)
            transport.isend(peer, 7100 + r, got).wait(60)
        rounds.append(time.monotonic() - t0)
    report["roundtrip_64MiB_s"] = rounds
    report["roundtrip_64MiB_GBps"] = 2 * 64 * MiB / min(rounds) / 1e9
    return report


def test_ucx_moves_cuda_tensors_between_two_gpus(tmp_path: Path) -> None:
    reports = _run_pair(_moves_tensors, str(tmp_path / "moves"))
    _lanes_note(reports)
    for report in reports:
        # the 64 MiB messages at least come by rendezvous: received straight into GPU memory
        assert report["pulls"] > 0, f"rank {report['rank']}: no message was received into GPU memory: {report}"


# -- a tensor still being computed when it is sent ---------------------------------------------------------------


def _still_computing(transport: Any, rank: int, device: str, log: Callable[[str], None]) -> dict[str, Any]:
    peer = 1 - rank
    produce, expected_s = long_producer(device, KERNEL_S)
    report: dict[str, Any] = {"kernel_s": expected_s}
    log("warm-up")
    if rank == 0:
        transport.isend(peer, 1, torch.zeros(4096, 4096, device=device)).wait(60)
    else:
        assert bool((transport.recv(peer, 1, timeout=60) == 0).all())
    for r, how in enumerate(["recv", "poll", "wait_any"]):
        tag = 100 * (r + 1)
        log(f"round {how}")
        torch.distributed.barrier()
        if rank == 0:
            x = produce()  # queued: the GPU is busy with it for ~KERNEL_S from now
            finished = torch.cuda.Event()
            finished.record()
            sent_at = time.monotonic()
            handle = transport.isend(peer, tag, x)
            posted_s = time.monotonic() - sent_at
            done_early = handle.done()
            finished.synchronize()
            done_at = time.monotonic()
            handle.wait(60)
            truth = x.cpu()  # after the chain: the final values
            transport.isend(peer, tag + 1, truth)  # the truth, through the host
            transport.isend(peer, tag + 2, torch.tensor([sent_at, done_at, posted_s], dtype=torch.float64))
            transport.wait_sends(timeout=60)
            assert done_at - sent_at > 0.1, f"{how}: the kernel ended {done_at - sent_at:.3f} s after the send"
            assert not done_early, f"{how}: the send was done while its data was still being computed"
            report[how] = {"posted_s": posted_s, "kernel_after_send_s": done_at - sent_at}
            continue
        if how == "recv":
            got = transport.recv(peer, tag, timeout=60)
        elif how == "poll":
            deadline = time.monotonic() + 60
            got = None
            while got is None:
                got = transport.poll(peer, tag)
                assert time.monotonic() < deadline, "poll: nothing within 60 s"
                time.sleep(1e-4)
        else:
            index, got = transport.wait_any([(peer, tag + 50), (peer, tag)], timeout=60)
            assert index == 1, index
        now = time.monotonic()
        truth = transport.recv(peer, tag + 1, timeout=60)
        sent_at, done_at, _ = transport.recv(peer, tag + 2, timeout=60).cpu().tolist()
        torch.cuda.synchronize()
        assert got.device == torch.device(device) and got.dtype == torch.float32 and got.shape == (4096, 4096)
        if not torch.equal(got.view(torch.uint8), truth.view(torch.uint8)):
            same = int((got.cpu() == truth.cpu()).sum())
            raise AssertionError(f"{how}: stale or wrong data: {same} of {truth.numel()} values equal the final ones")
        report[how] = {"got_after_send_s": now - sent_at, "got_minus_kernel_end_s": now - done_at}
        # the sender hands the message to UCX only once its kernels are done: nothing can arrive earlier
        assert now >= done_at - SLACK_S, (
            f"{how}: got the message {done_at - now:.3f} s before the sender's kernel ended"
        )
    transport.wait_sends(timeout=60)
    torch.cuda.synchronize()
    return report


def test_ucx_sends_cuda_tensors_only_once_computed(tmp_path: Path) -> None:
    sender, receiver = _run_pair(_still_computing, str(tmp_path / "computing"))
    _lanes_note([sender, receiver])
    assert all(sender[how]["posted_s"] < 0.05 for how in ("recv", "poll", "wait_any")), sender  # isend did not block
    assert sender["sends_queued_for_their_data"] >= 3, sender  # the three sends waited for their kernels
