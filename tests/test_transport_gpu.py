"""The ``shm`` transport between two GPUs of one node (CUDA IPC slots): skipped on CPU machines, run on the
device machine (2 GPUs). Two spawned processes, one GPU each, a gloo group only for the rendezvous store."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
from distributed import free_port

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one node")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def _value(tag: int, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(tag)
    raw = torch.randint(
        0,
        256,
        (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
        generator=g,
        dtype=torch.uint8,
    )
    if dtype == torch.bool:
        raw = raw % 2
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return raw[:n].view(dtype).reshape(shape).to(device)


def _cases(transport, rank: int, device: str) -> None:
    peer = 1 - rank
    # every dtype and shape, round-trip bit-exactly
    tag = 0
    for dtype in DTYPES:
        for shape in [(), (0,), (7,), (3, 5, 7), (2, 1, 4, 1, 3)]:
            tag += 1
            if rank == 0:
                transport.isend(peer, tag, _value(tag, shape, dtype, device)).wait(30)
            else:
                got = transport.recv(peer, tag, timeout=30)
                want = _value(tag, shape, dtype, device)
                assert got.device == torch.device(device) and got.dtype == dtype and got.shape == want.shape
                a, b = got.reshape(-1), want.reshape(-1)
                if dtype != torch.bool:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                assert torch.equal(a, b), (dtype, shape)
    # out of order, more in flight than the 16 slots (the rest staged through the host), both ways at once
    sizes = [8 << 20] * 20 + [3, 1 << 20, 300 << 20]
    handles = [
        transport.isend(peer, 1000 + i, _value(1000 + i + rank, (n // 4,), torch.float32, device))
        for i, n in enumerate(sizes)
    ]
    for i in reversed(range(len(sizes))):
        got = transport.recv(peer, 1000 + i, timeout=60)
        want = _value(1000 + i + peer, (sizes[i] // 4,), torch.float32, device)
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


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        from lightning_megatron.transport import create_transport

        with create_transport("shm", device=f"cuda:{rank}", timeout=60) as transport:
            transport.connect([1 - rank])
            assert transport._cuda is not None and transport._cuda.available, "CUDA IPC path not available"
            _cases(transport, rank, f"cuda:{rank}")
            assert transport._cuda.host_staged > 0  # the burst outran the slots and still arrived
            torch.distributed.barrier()
        Path(f"{out}.{rank}").write_text("ok")
    except BaseException:
        Path(f"{out}.{rank}").write_text(traceback.format_exc())
        raise


def test_shm_moves_cuda_tensors_between_two_gpus(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=2, start_method="spawn", join=True)
    for rank in range(2):
        assert Path(f"{out}.{rank}").read_text() == "ok", Path(f"{out}.{rank}").read_text()
