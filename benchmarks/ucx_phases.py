"""Where a ``ucx`` device message's time goes: a per-message timeline of one stream, on 2 GPUs.

    python benchmarks/ucx_phases.py --out benchmarks/results/transport/ucx_phases_2xh200.json
    python benchmarks/ucx_phases.py --size 16MiB --cases default one-pull proto-v1 fresh --out ...

``benchmarks/transport.py`` gives one number per size; its GPU runs showed a cost of 120-150 µs per message
that neither a window of sends nor pulling ahead hides (1 MiB to 16 MiB move at about one message per 150 µs,
64 MiB ones at copy speed). This script times one stream of the same shape (rank 0 sends ``--messages`` messages
of ``--size`` with a window of 16, rank 1 receives them in order) and records, per message, on one host clock
(``time.perf_counter`` is CLOCK_MONOTONIC, shared by the two processes):

* sender: the ``isend`` call, its return, the moment UCX got the message (``QueuedSendHandle._posted``) and the
  send's completion (``wait`` returned: the receiver's acknowledgement of its pull);
* receiver: each ``recv`` call and return, and how many pulls had started ahead when it returned.

Cases (one fresh pair of processes each, so each gets a UCX context of its own settings): ``default``;
``one-pull`` (``pull_ahead=0``); ``proto-v1`` (``UCX_PROTO_ENABLE=n``: UCX's older protocol selection);
``fresh`` (the sender sends a newly computed tensor each time, as a pipeline does, instead of one buffer);
``nccl`` (torch.distributed send/recv of the same stream: the reference). With ``UCX_PROTO_INFO=y`` in the
environment UCX prints the protocols it selected (stderr of the ranks, kept in the JSON).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)
from transport import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
WINDOW = 16
CASES = {
    "default": {},
    "one-pull": {"pull_ahead": 0},
    "proto-v1": {"ucx_config": {"PROTO_ENABLE": "n"}},
    "fresh": {},
    "nccl": {},
}


def _stream(rank: int, case: str, size: int, messages: int, device: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_megatron.transport import create_transport

    nccl = case == "nccl"
    transport = None if nccl else create_transport("ucx", device=device, timeout=60.0, **CASES[case])
    if transport is not None:
        transport.connect([1 - rank])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    payload = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    sink = torch.empty_like(payload)
    rows: list[dict[str, float]] = []

    def one_stream(record: bool) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        if rank == 0:
            pending: list[tuple[int, Any]] = []
            for i in range(messages):
                if len(pending) >= WINDOW:
                    j, h = pending.pop(0)
                    h.wait() if nccl else h.wait(60.0)
                    if record:
                        rows[j]["send_done"] = time.perf_counter() - start
                tensor = payload.add(i % 7) if case == "fresh" else payload  # fresh: computed now, as a pipeline's
                t0 = time.perf_counter() - start
                h = dist.isend(tensor, 1) if nccl else transport.isend(1, i, tensor)
                t1 = time.perf_counter() - start
                if record:
                    rows.append({"isend_call": t0, "isend_return": t1})
                pending.append((i, h))
            for j, h in pending:
                h.wait() if nccl else h.wait(60.0)
                if record:
                    rows[j]["send_done"] = time.perf_counter() - start
        else:
            for i in range(messages):
                t0 = time.perf_counter() - start
                if nccl:
                    dist.recv(sink, 0)
                else:
                    transport.recv(0, i)
                t1 = time.perf_counter() - start
                if record:
                    ahead = 0 if nccl else sum(len(q) for q in transport._ahead.values())
                    rows.append({"recv_call": t0, "recv_return": t1, "waiting_ahead": ahead})
        sync()
        dist.barrier()
        return time.perf_counter() - start

    one_stream(False)  # warm-up: connections, IPC handles, the allocator
    walls = [one_stream(False) for _ in range(3)]
    one_stream(True)
    out = {
        "rows": rows,
        "stream_s": statistics.median(walls),
        "gbps": messages * size / statistics.median(walls) / 1e9,
    }
    if transport is not None:
        out.update(pulls=transport.pulls, pulled_ahead=transport.pulled_ahead, lanes=transport.transports_to(1 - rank))
        out["queued_sends"] = transport._poster.queued if transport._poster is not None else None
        transport.close()
    return out


def _worker(rank: int, port: int, case: str, size: int, messages: int, out: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        import torch
        import torch.distributed as dist

        if torch.cuda.device_count() >= 2:
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device(device))
        else:  # a smoke run on CPUs (host memory over UCX, gloo for the reference)
            device = "cpu"
            dist.init_process_group("gloo")
        result = _stream(rank, case, size, messages, device)
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001  (reported by the parent)
        out.put((rank, False, traceback.format_exc()[-3000:]))


def run_case(case: str, size: int, messages: int, timeout: float = 180.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # CUDA does not survive fork
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, case, size, messages, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except Exception:  # noqa: BLE001  (queue.Empty)
            if all(not p.is_alive() for p in procs):
                break
            continue
        if not ok:
            results = {"error": payload}
            break
        results[rank] = payload
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if "error" in results or len(results) < 2:
        return {"error": results.get("error", "timed out")}
    return summarize(results[0], results[1])


def summarize(sender: dict[str, Any], receiver: dict[str, Any]) -> dict[str, Any]:
    """Medians of the per-message intervals, in microseconds, and the raw timeline."""
    s, r = sender["rows"], receiver["rows"]

    def us(values: list[float]) -> float:
        return round(1e6 * statistics.median(values), 1) if values else float("nan")

    return {
        "gbps": round(receiver["gbps"], 1),
        "stream_ms": round(1e3 * receiver["stream_s"], 3),
        "receive_spacing_us": us([b["recv_return"] - a["recv_return"] for a, b in zip(r, r[1:])]),
        "recv_blocked_us": us([x["recv_return"] - x["recv_call"] for x in r]),
        "isend_call_us": us([x["isend_return"] - x["isend_call"] for x in s]),
        "send_done_spacing_us": us([b["send_done"] - a["send_done"] for a, b in zip(s, s[1:])]),
        "send_to_receive_us": us([rr["recv_return"] - ss["isend_call"] for ss, rr in zip(s, r)]),
        "waiting_ahead_median": statistics.median(x["waiting_ahead"] for x in r),
        "pulled_ahead": receiver.get("pulled_ahead"),
        "pulls": receiver.get("pulls"),
        "queued_sends": sender.get("queued_sends"),
        "lanes": sender.get("lanes"),
        "timeline": {"sender": s, "receiver": r},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="16MiB", help="message size, e.g. 16MiB")
    parser.add_argument("--messages", type=int, default=64)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    size = int(args.size.removesuffix("MiB")) * MiB
    report: dict[str, Any] = {"benchmark": "ucx_phases", "provenance": provenance(), "size": size}
    report["messages"], report["window"], report["cases"] = args.messages, WINDOW, {}
    for case in args.cases:
        report["cases"][case] = result = run_case(case, size, args.messages)
        brief = {k: v for k, v in result.items() if k not in ("timeline", "lanes")}
        print(f"{case:>9}: {json.dumps(brief)}", flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
