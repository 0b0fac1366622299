"""Transport bandwidth and latency vs message size, two processes on one host.

    python benchmarks/transport.py                     # CPU: every importable transport + the memcpy reference
    python benchmarks/transport.py --quick             # smoke run: a few sizes, one repeat (seconds)
    python benchmarks/transport.py --transports torch shm --max-size 64MiB
    python benchmarks/transport.py --transports ucx ucx-cma ucx-tcp shm tcp --max-size 64MiB --repeats 5 \
        --out benchmarks/results/transport/transport_cpu_ucx.json   # ucx (the ucx extra) beside shm and tcp
    python benchmarks/transport.py --gpu               # 2 GPUs: shm (and ucx) GPU-to-GPU vs NCCL send/recv vs torch over NCCL
    python benchmarks/transport.py --one-gpu --transports shm ucx ucx-short-spin   # both processes on GPU 0 (no NCCL)
    python benchmarks/transport.py --replot benchmarks/results/transport/transport_cpu.json   # redraw the plot only

Per transport and message size (4 KiB ... 256 MiB, powers of 4):

* **latency**: half the round trip of a ping-pong of messages of that size (rank 0 sends, rank 1 sends the
  message back), averaged over the iterations of a run;
* **bandwidth**: one-way streaming from rank 0 to rank 1 with a window of outstanding sends (rank 0 waits for
  the oldest send when the window is full); the clock runs on rank 0 from the first send until rank 1's
  one-byte acknowledgement of the last message arrives. Bytes of payload per second, GB/s = 1e9 B/s. Beside it,
  ``stream_cores`` (sender) and ``receiver_stream_cores``: each process's CPU time during the stream, every
  thread counted (progress and copy threads too), over its wall time: the cores a transport keeps busy.

Each figure is the median of ``--repeats`` runs, after a warm-up run. The reference on CPU is one process's
``dst.copy_(src)`` of preallocated tensors with one thread (same GB/s convention: bytes copied per second; the
multi-threaded copy is recorded too), the target being ``shm`` at >= 70% of it from 16 MiB up; on GPUs it is NCCL's own send/recv through torch.distributed (receives
into preallocated buffers), the target being ``shm`` at >= 80% of it from 16 MiB up.

``ucx`` is measured with UCX's own choice of fabric (recorded under ``details``: UCX's version and lanes),
``ucx-tcp`` with ``UCX_TLS=tcp``, ``ucx-cma`` with CMA's zero-copy rendezvous (``UCX_CMA_MEMORY_INVALIDATE=y``),
``ucx-short-spin`` with the progress thread polling 20 µs after its last event, the CPU default, also on a
GPU (where the default is 2 ms: ``lightning_megatron.transport.ucx.SPIN_SECONDS``), and ``ucx-one-pull`` with
deferred device messages received one at a time (``pull_ahead=0``).

``--one-gpu`` puts both processes on GPU 0 (CUDA IPC within one device; gloo only, so no NCCL channel): a GPU
transport's per-message costs, measured where two GPUs are not to be had. Its copies run at one device's memory
bandwidth, not over NVLink, so compare transports within such a run, never with a ``--gpu`` one.

``torch`` over gloo is the baseline "torch.distributed gloo" (the transport's headers and receive thread
included). Received tensors are fresh allocations on every transport (the receiver owns them), which costs
page faults for large messages; NCCL's baseline receives into preallocated buffers, as a training loop does.

Results (JSON with provenance) go to ``benchmarks/results/transport/transport_{cpu,gpu}.json`` and a plot beside it
(``.png``: bandwidth and latency vs size, log-x).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB * 4**i for i in range(9)]  # 4 KiB ... 256 MiB
QUICK_SIZES = [4 * KiB, 256 * KiB, 16 * MiB]
LABELS = {
    "torch": "torch transport (torch.distributed gloo)",
    "torch-nccl": "torch transport (torch.distributed NCCL)",
    "nccl": "torch.distributed NCCL send/recv",
    "shm": "shm transport",
    "tcp": "tcp transport (loopback)",
    "rdma": "rdma transport",
    "ucx": "ucx transport (UCX's own choice of fabric)",
    "ucx-tcp": "ucx transport, UCX_TLS=tcp (loopback)",
    "ucx-cma": "ucx transport, UCX_CMA_MEMORY_INVALIDATE=y (CMA rendezvous)",
    "ucx-short-spin": "ucx transport, progress thread polls 20 µs after its last event",
    "ucx-one-pull": "ucx transport, deferred device messages pulled one at a time (pull_ahead=0)",
}
VARIANTS = {
    "ucx-tcp": ("ucx", {"ucx_config": {"TLS": "tcp"}}),
    "ucx-cma": ("ucx", {"ucx_config": {"CMA_MEMORY_INVALIDATE": "y"}}),  # zero-copy CMA rendezvous on one host
    "ucx-short-spin": ("ucx", {"spin_seconds": 20e-6}),
    "ucx-one-pull": ("ucx", {"pull_ahead": 0}),
}
"""Channels that are a transport with settings: name -> (transport, create_transport arguments)."""
ACK_TAG = 1 << 40
TIMEOUT = 60.0
"""Seconds a transport may wait for one message before the run counts as failed (no run takes this long)."""


def parse_size(text: str) -> int:
    units = {"kib": KiB, "k": KiB, "mib": MiB, "m": MiB, "gib": 1 << 30, "g": 1 << 30}
    lower = text.strip().lower()
    for unit, factor in units.items():
        if lower.endswith(unit):
            return int(float(lower[: -len(unit)]) * factor)
    return int(lower)


def human(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


# -- what one measurement moves ---------------------------------------------------------------------------------


def pingpong_iters(size: int, quick: bool) -> int:
    return max(3, min(200 if quick else 1000, (32 if quick else 256) * MiB // size))


def stream_plan(size: int, quick: bool) -> tuple[int, int]:
    """(messages, window) of one bandwidth run: about 1 GiB (quick: 128 MiB), at least 4 messages."""
    total = (128 if quick else 1024) * MiB
    return max(4, min(4000, total // size)), max(2, min(16, 256 * MiB // size))


# -- the channels measured --------------------------------------------------------------------------------------


class TransportChannel:
    """One of this repository's transports, between rank 0 and rank 1."""

    def __init__(self, name: str, rank: int, device: str) -> None:
        from lightning_megatron.transport import create_transport

        self.peer = 1 - rank
        name, kwargs = VARIANTS.get(name, ("torch" if name == "torch-nccl" else name, {}))
        self.transport = create_transport(name, device=device, timeout=TIMEOUT, **kwargs)
        self.transport.connect([self.peer])
        self.details: dict[str, Any] = {}
        if name == "ucx" or name in VARIANTS:  # what UCX chose, for the record
            self.details = {
                "ucx_version": self.transport.ucx_version,
                "lanes": self.transport.transports_to(self.peer),
                "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
            }

    def isend(self, tag: int, tensor: Any) -> Any:
        return self.transport.isend(self.peer, tag, tensor)

    def wait(self, handle: Any) -> None:
        handle.wait(TIMEOUT)

    def recv(self, tag: int, like: Any) -> Any:
        return self.transport.recv(self.peer, tag)

    def close(self) -> None:
        self.transport.close()


class NcclChannel:
    """torch.distributed's own send/recv over the default (NCCL) group, into preallocated buffers."""

    def __init__(self, name: str, rank: int, device: str) -> None:
        import torch

        self.peer = 1 - rank
        self.device = torch.device(device)
        self.buffers: dict[tuple[int, Any], Any] = {}
        self.details: dict[str, Any] = {}

    def isend(self, tag: int, tensor: Any) -> Any:
        import torch.distributed as dist

        return dist.isend(tensor, self.peer)

    def wait(self, handle: Any) -> None:
        handle.wait()

    def recv(self, tag: int, like: Any) -> Any:
        import torch
        import torch.distributed as dist

        key = (like.numel(), like.dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty_like(like)
        buf = self.buffers[key]
        dist.recv(buf, self.peer)
        return buf

    def close(self) -> None:
        pass


def measure(channel: Any, rank: int, size: int, device: str, quick: bool, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    payload = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    ack = torch.ones(1, dtype=torch.uint8, device=device)
    iters = pingpong_iters(size, quick)
    count, window = stream_plan(size, quick)

    def pingpong() -> float:
        dist.barrier()
        start = time.perf_counter()
        for i in range(iters):
            if rank == 0:
                channel.wait(channel.isend(i, payload))
                channel.recv(i, payload)
                sync()
            else:
                got = channel.recv(i, payload)
                channel.wait(channel.isend(i, got))
        return (time.perf_counter() - start) / (2 * iters)

    def stream() -> tuple[float, float]:
        """(GB/s, cores): this process's CPU time (every thread: progress threads included) over the run's wall."""
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        if rank == 0:
            pending: list[Any] = []
            for i in range(count):
                if len(pending) >= window:
                    channel.wait(pending.pop(0))
                pending.append(channel.isend(i, payload))
            for handle in pending:
                channel.wait(handle)
            channel.recv(ACK_TAG, ack)
            sync()
        else:
            for i in range(count):
                channel.recv(i, payload)
            sync()
            channel.wait(channel.isend(ACK_TAG, ack))
        wall = time.perf_counter() - start
        return count * size / wall / 1e9, (time.process_time() - cpu) / wall

    pingpong(), stream()  # warm-up (connections, allocator, page cache)
    latencies = [pingpong() for _ in range(repeats)]
    streams = [stream() for _ in range(repeats)]
    bandwidths = [gbps for gbps, _ in streams]
    return {
        "bytes": size,
        "latency_us": statistics.median(latencies) * 1e6,
        "bandwidth_gbps": statistics.median(bandwidths),
        "stream_cores": round(statistics.median(cores for _, cores in streams), 3),
        "latency_runs_us": [round(x * 1e6, 2) for x in latencies],
        "bandwidth_runs_gbps": [round(x, 4) for x in bandwidths],
        "pingpong_iters": iters,
        "stream_messages": count,
        "stream_window": window,
    }


def worker(rank: int, port: int, name: str, sizes: list[int], quick: bool, repeats: int, gpus: int, out: Any) -> None:
    """Rank ``rank`` of one pair: on CPU (``gpus=0``), both on GPU 0 (1), or on GPU ``rank`` (2)."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        import torch
        import torch.distributed as dist

        device = "cpu"
        if gpus == 2:
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device(device))
        elif gpus == 1:  # NCCL refuses two ranks on one device
            torch.cuda.set_device(0)
            device = "cuda:0"
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo")
        channel = (NcclChannel if name == "nccl" else TransportChannel)(name, rank, device)
        rows = []
        for size in sizes:
            rows.append(measure(channel, rank, size, device, quick, repeats))
            if rank == 0:
                row = rows[-1]
                print(
                    f"  {name:>10} {human(size):>8}: {row['bandwidth_gbps']:8.3f} GB/s  "
                    f"latency {row['latency_us']:10.1f} us",
                    flush=True,
                )
        channel.close()
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, True, {"rows": rows, "details": channel.details}))
    except BaseException:  # noqa: BLE001  (report the failure, the parent records it)
        out.put((rank, False, traceback.format_exc()[-3000:]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(name: str, sizes: list[int], quick: bool, repeats: int, gpus: int, timeout: float) -> dict[str, Any]:
    """Both ranks in fresh processes (spawned for GPUs: CUDA does not survive fork)."""
    ctx = mp.get_context("spawn" if gpus else "fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, name, sizes, quick, repeats, gpus, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            rank, ok, payload = out.get(timeout=1.0)
            results[rank] = (ok, payload)
            if not ok:
                break
        except Exception:  # noqa: BLE001  (queue.Empty: check the processes)
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    if len(results) == 2 and all(ok for ok, _ in results.values()):
        rows = results[0][1]["rows"]  # the sender's, with the receiver's CPU use beside its own
        for row, theirs in zip(rows, results[1][1]["rows"]):
            row["receiver_stream_cores"] = theirs["stream_cores"]
        entry = {"label": LABELS.get(name, name), "results": rows}
        return {**entry, "details": results[0][1]["details"]} if results[0][1]["details"] else entry
    errors = [payload for ok, payload in results.values() if not ok] or ["no result (timed out or died)"]
    return {"label": LABELS.get(name, name), "error": errors[0].strip().splitlines()[-1], "traceback": errors[0]}


# -- the single-process reference -------------------------------------------------------------------------------


def memcpy(sizes: list[int], quick: bool, repeats: int, device: str = "cpu", threads: int = 1) -> list[dict[str, Any]]:
    import torch

    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    for size in sizes:
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        iters = max(5, min(2000, (256 if quick else 2048) * MiB // size))
        runs = []
        for rep in range(max(repeats, 3) + 1):
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            if device != "cpu":
                torch.cuda.synchronize()
            if rep:  # the first is the warm-up
                runs.append(iters * size / (time.perf_counter() - start) / 1e9)
        rows.append(
            {"bytes": size, "bandwidth_gbps": statistics.median(runs), "runs_gbps": [round(x, 3) for x in runs]}
        )
        print(f"  {f'memcpy x{threads}':>10} {human(size):>8}: {rows[-1]['bandwidth_gbps']:8.3f} GB/s", flush=True)
    torch.set_num_threads(default_threads)
    return rows


# -- targets, plot ----------------------------------------------------------------------------------------------


def target(results: dict[str, Any], candidate: str, reference: list[dict[str, Any]], ratio: float) -> dict[str, Any]:
    rows = results.get(candidate, {}).get("results")
    if not rows or not reference:
        return {"target": ratio, "met": None, "why": f"{candidate} or the reference was not measured"}
    ref = {r["bytes"]: r["bandwidth_gbps"] for r in reference}
    ratios = {human(r["bytes"]): r["bandwidth_gbps"] / ref[r["bytes"]] for r in rows if r["bytes"] >= 16 * MiB}
    if not ratios:
        return {"target": ratio, "met": None, "why": "no size >= 16 MiB was measured"}
    return {
        "target": ratio,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "min_ratio": round(min(ratios.values()), 3),
        "met": min(ratios.values()) >= ratio,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, lat) = plt.subplots(1, 2, figsize=(13, 5))
    for entry in report["transports"].values():
        rows = entry.get("results")
        if not rows:
            continue
        xs = [r["bytes"] for r in rows]
        bw.plot(xs, [r["bandwidth_gbps"] for r in rows], marker="o", label=entry["label"])
        lat.plot(xs, [r["latency_us"] for r in rows], marker="o", label=entry["label"])
    for key, style in (("reference", "k--"), ("memcpy_all_threads", "k:")):
        ref = report.get(key)
        if ref and ref.get("results"):
            rows = ref["results"]
            bw.plot([r["bytes"] for r in rows], [r["bandwidth_gbps"] for r in rows], style, label=ref["label"])
    for ax in (bw, lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["sizes"], [human(s) for s in report["sizes"]], rotation=45)
        ax.set_xlabel("message size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    bw.set_ylabel("bandwidth, GB/s (one way, window of sends)")
    bw.set_title("bandwidth")
    bw.set_yscale("log")
    lat.set_yscale("log")
    lat.set_ylabel("latency, µs (half round trip)")
    lat.set_title("latency")
    fig.suptitle(f"transports, 2 processes on {report['provenance']['device']} ({report['provenance']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def importable(name: str) -> Optional[str]:
    """None if the transport's class imports here, else why not."""
    from lightning_megatron.transport import transport_class

    try:
        transport_class("torch" if name in ("torch-nccl", "nccl") else VARIANTS.get(name, (name,))[0])
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def ucx_moves_cuda() -> bool:
    """Whether the ``ucx`` transport has its CUDA path here (UCX's CUDA modules; checked without loading UCX)."""
    from lightning_megatron.transport import transport_class

    return "cuda" in transport_class("ucx").devices


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="2 GPUs of this host: shm and torch-nccl vs NCCL")
    parser.add_argument("--one-gpu", action="store_true", help="both processes on GPU 0 (no NCCL): see above")
    parser.add_argument("--quick", action="store_true", help="a few sizes, one repeat: a smoke run")
    parser.add_argument(
        "--transports", nargs="+", help="default: CPU torch shm tcp (ucx); GPU nccl torch-nccl shm (ucx)"
    )
    parser.add_argument("--min-size", type=parse_size, default=4 * KiB)
    parser.add_argument("--max-size", type=parse_size, default=256 * MiB)
    parser.add_argument("--repeats", type=int, help="runs per figure, median reported (default 3; quick 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one transport's whole sweep")
    parser.add_argument(
        "--out", type=Path, help="JSON path (default benchmarks/results/transport/transport_{cpu,gpu}.json)"
    )
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the plot of an earlier result")
    args = parser.parse_args(argv)
    if args.replot:
        report = json.loads(args.replot.read_text())
        plot(report, args.replot.with_suffix(".png"))
        print(f"wrote {args.replot.with_suffix('.png')}")
        return report

    sizes = [s for s in (QUICK_SIZES if args.quick else SIZES) if args.min_size <= s <= args.max_size]
    repeats = args.repeats or (1 if args.quick else 3)
    from lightning_megatron.transport import available_transports

    cpu_names = ["torch", "shm", "tcp"] + (["ucx"] if "ucx" in available_transports() else [])
    gpu_names = ["nccl", "torch-nccl", "shm"] + (["ucx"] if "ucx" in cpu_names and ucx_moves_cuda() else [])
    if args.gpu and args.one_gpu:
        parser.error("--gpu (one GPU per process) and --one-gpu (both on GPU 0): choose one")
    gpus = 2 if args.gpu else 1 if args.one_gpu else 0
    if args.one_gpu:
        gpu_names = [n for n in gpu_names if n not in ("nccl", "torch-nccl")]
        refused = [n for n in args.transports or () if n in ("nccl", "torch-nccl")]
        if refused:
            parser.error(f"--one-gpu: {refused} need NCCL, which refuses two ranks on one GPU; use --gpu on 2 GPUs")
    names = args.transports or (gpu_names if gpus else cpu_names)
    mode = {0: "cpu", 1: "one-gpu", 2: "gpu"}[gpus]
    out = args.out or ROOT / "benchmarks" / "results" / "transport" / f"transport_{mode.replace('-', '_')}.json"
    started = time.perf_counter()

    import torch

    print(f"sizes {[human(s) for s in sizes]}, {repeats} repeat(s), torch threads {torch.get_num_threads()}")
    report: dict[str, Any] = {
        "benchmark": "transport",
        "mode": mode,
        "provenance": provenance(),
        "units": {"bandwidth": "GB/s (1e9 bytes of payload per second)", "latency": "microseconds, half round trip"},
        "settings": {
            "sizes": sizes,
            "repeats": repeats,
            "quick": args.quick,
            "torch_threads": torch.get_num_threads(),
            "stream_total_bytes": (128 if args.quick else 1024) * MiB,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "sizes": sizes,
        "transports": {},
        "reference": None,
        "targets": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    transports = report["transports"]
    for name in names:
        why = importable(name)
        if why is not None:
            transports[name] = {"label": LABELS.get(name, name), "error": why}
            print(f"  {name:>10}: not measured ({why})")
            continue
        transports[name] = run_pair(name, sizes, args.quick, repeats, gpus, args.timeout)
        if "error" in transports[name]:
            print(f"  {name:>10}: failed ({transports[name]['error']})")
        out.write_text(json.dumps(report, indent=2) + "\n")  # what is measured so far survives a later failure

    # The reference runs after the pairs, in this process (the pairs ran in their own).
    if args.gpu:
        reference = transports.get("nccl", {}).get("results")
        reference_label = LABELS["nccl"]
    elif args.one_gpu:
        reference, reference_label = None, ""  # transports compared with each other only
    else:
        # One copying thread: the reference that does not depend on how busy the other cores are (torch's
        # multi-threaded copy waits for its slowest thread, a scheduler tick on a loaded machine).
        reference = memcpy(sizes, args.quick, repeats, threads=1)
        reference_label = "memcpy (1 process, dst.copy_(src), 1 thread)"
        threads = torch.get_num_threads()
        if threads > 1:
            report["memcpy_all_threads"] = {
                "label": f"memcpy (1 process, dst.copy_(src), {threads} threads)",
                "results": memcpy(sizes, args.quick, repeats, threads=threads),
            }
    report["settings"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["reference"] = {"label": reference_label, "results": reference} if reference else None
    report["targets"] = (
        {"shm >= 80% of NCCL at >= 16 MiB": target(transports, "shm", reference or [], 0.8)}
        if args.gpu
        else {}
        if args.one_gpu
        else {
            "shm >= 70% of memcpy (1 thread) at >= 16 MiB": target(transports, "shm", reference or [], 0.7),
            "shm >= 70% of memcpy (all threads) at >= 16 MiB": target(
                transports, "shm", (report.get("memcpy_all_threads") or {}).get("results") or [], 0.7
            ),
        }
    )
    if transports.get("ucx", {}).get("results") and transports.get("shm", {}).get("results"):
        report["targets"]["ucx >= shm at >= 16 MiB (same host)"] = target(
            transports, "ucx", transports["shm"]["results"], 1.0
        )
    for entry in transports.values():
        if "ucx_version" in entry.get("details", {}):
            report["provenance"]["ucx"] = entry["details"]["ucx_version"]
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} ({report['elapsed_s']} s)")
    if not args.no_plot:
        png = out.with_suffix(".png")
        plot(report, png)
        print(f"wrote {png}")
    for what, verdict in report["targets"].items():
        print(f"target {what}: {verdict}")
    return report


if __name__ == "__main__":
    main()
