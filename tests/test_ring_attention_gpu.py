"""Ring attention on two GPUs over NCCL (skipped without them): the kernels the CPU tests cannot reach.

In bf16 the blocks run on SDPA's flash kernel forward and backward (``_scaled_dot_product_flash_attention`` and its
backward, dense: no cumulative sequence lengths), in fp32 on the plain-torch blocks. Output and q/k/v gradients,
gathered back into sequence order, are compared with causal SDPA on the whole sequence in fp32: ring attention's
relative error must stay within twice that of bf16 SDPA on one GPU (the same roundings, in another order), and
1e-5 in fp32. MHA and GQA, a sequence of 4,096 tokens (2,048 a GPU).
"""

from __future__ import annotations

import json

import pytest
import torch
from gpu_work import run_scripts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one node"),
]

_RING = r"""
import json, os, socket, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.nn.functional as F


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def rank_main(rank, world, port, dtype_name, kv_heads, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    from lightning_megatron.context import gather_sequence, ring_attention, split_sequence

    dtype = getattr(torch, dtype_name)
    b, h, s, d = 2, 8, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    full = {n: torch.randn(b, heads, s, d, generator=g, device="cuda") for n, heads in
            (("q", h), ("k", kv_heads), ("v", kv_heads), ("dout", h))}
    scale, gqa = d**-0.5, kv_heads != h

    def sdpa(dt):
        q, k, v = (full[n].to(dt).clone().requires_grad_() for n in "qkv")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out.backward(full["dout"].to(dt))
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    want = sdpa(torch.float32)
    plain = sdpa(dtype)
    local = [split_sequence(full[n].to(dtype), 2, world, rank).detach().requires_grad_() for n in "qkv"]
    out = ring_attention(*local, group=dist.group.WORLD, scale=scale)
    out.backward(split_sequence(full["dout"].to(dtype), 2, world, rank))
    got = {"out": gather_sequence(out.detach(), 2, dist.group.WORLD)}
    for n, t in zip("qkv", local):
        got["d" + n] = gather_sequence(t.grad, 2, dist.group.WORLD)
    torch.cuda.synchronize()
    if rank == 0:
        queue.put({n: {"ring": rel(got[n], want[n]), "sdpa": rel(plain[n], want[n])} for n in want})
    dist.destroy_process_group()


if __name__ == "__main__":
    dtype_name, kv_heads = sys.argv[1], int(sys.argv[2])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(rank_main, args=(2, port, dtype_name, kv_heads, queue), nprocs=2, join=True)
    print("RESULT", json.dumps(queue.get(timeout=60)))
"""

CASES = {
    "bf16-mha": ["bfloat16", "8"],
    "bf16-gqa": ["bfloat16", "2"],
    "fp32-gqa": ["float32", "2"],
}


@pytest.fixture(scope="module")
def errors() -> dict:
    return run_scripts(_RING, CASES, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_ring_attention_on_two_gpus_equals_causal_sdpa(errors: dict, case: str) -> None:
    for name, error in errors[case].items():
        bound = 1e-5 if case.startswith("fp32") else 2 * error["sdpa"] + 1e-4
        assert error["ring"] <= bound, f"{case} {name}: {json.dumps(error)} (bound {bound:.2g})"
