"""How fast NCCL's tensor-parallel collectives go here under each NCCL setting, and what NCCL picks itself.

    python benchmarks/nccl_collectives.py --nccl-info --out benchmarks/results/transport/nccl_collectives_2gpu.json   # 2 GPUs
    python benchmarks/nccl_collectives.py --settings default Simple NCCL_MIN_NCHANNELS=32 --sizes-mib 16 32
    python benchmarks/nccl_collectives.py --cpu-dry-run --out /tmp/nccl.json                                 # gloo

Why: in the profiles of the 1.3B GPT at TP2 (``throughput_profile_gpt-1.3b_*``) the 32 MiB activation all-reduces
are 20% of the step's GPU time at about 196 GB/s of bus bandwidth, where this workplace's H100 machines reached
329-361 GB/s on 1 GiB. Which protocol ran is not in the profile: NCCL names a kernel after the one protocol it
inlines (``..._RING_LL``) and runs whichever its tuner picked (NCCL issues #1595, #2196); nor how many channels
(thread blocks, each driving its share of the links) NCCL gave a small VM's GPUs. This measures, per setting, the
median time of ``all_reduce``, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` of bf16 messages of the
given sizes and the bus bandwidth (nccl-tests' definition). A setting is ``default`` (NCCL's own choices), a
protocol (``Simple``, ``LL128``, ``LL``: ``NCCL_PROTO``), or environment variables (``NCCL_MIN_NCHANNELS=32``,
several joined by commas). ``--nccl-info`` keeps NCCL's log of its set-up and tuning from the first default run:
how the GPUs are connected, the channels, the algorithm and protocol of each call.

``--ops`` may also name torch's symmetric-memory all-reduces (``symm_one_shot``, ``symm_two_shot``: each rank
reads its peers' buffers over NVLink with its own kernel, no NCCL), the candidates for the tensor-parallel
all-reduce where NCCL's ring is what limits the step; GPUs only, and an op that fails records its error and
leaves the others to run. megatron-core's own switch for them (``symmetric_ar_type``) needs Transformer Engine.

Every setting runs in its own processes (NCCL reads its environment when it starts), one after another, the order
reversed every other round; a size's figure is the median over its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
OPS = ("all_reduce", "reduce_scatter", "all_gather")
SYMMETRIC_OPS = ("symm_one_shot", "symm_two_shot")  # torch.ops.symm_mem all-reduces (GPUs only)
# nccl-tests' bus bandwidth: the bytes each rank's link carries per byte of the message, for n ranks (the
# symmetric-memory all-reduces are given the ring's factor, so that a figure compares with NCCL's at one size)
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}
BUS_FACTOR["all_gather"] = BUS_FACTOR["reduce_scatter"]
for _op in SYMMETRIC_OPS:
    BUS_FACTOR[_op] = BUS_FACTOR["all_reduce"]


def _worker(spec: dict[str, Any]) -> None:
    """One rank: time every op and size, write ``rank{N}.json`` into ``spec["out_dir"]``."""
    import torch
    import torch.distributed as dist

    on_gpu = not spec["cpu"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    rows: list[dict[str, Any]] = []
    for op in spec["ops"]:
        for mib in spec["sizes_mib"]:
            item = torch.empty((), dtype=dtype).element_size()
            elements = int(mib * 2**20) // item // world * world  # divisible by the ranks
            try:
                if op in SYMMETRIC_OPS:
                    call = _symmetric_all_reduce(op, elements, dtype, device)
                else:
                    full = torch.ones(elements, dtype=dtype, device=device)
                    shard = torch.ones(elements // world, dtype=dtype, device=device)
                    call = _collective(op, full, shard)
                for _ in range(spec["warmup"]):
                    call()
                times = _timed(call, spec["iterations"], on_gpu)
            except Exception as error:  # an API this torch lacks: say so, and time the other ops
                rows.append({"op": op, "mib": mib, "us": None, "error": f"{type(error).__name__}: {error}"[:500]})
                continue
            seconds = statistics.median(times)
            bus = BUS_FACTOR[op](world) * elements * item / seconds / 1e9
            rows.append({"op": op, "mib": mib, "us": seconds * 1e6, "bus_gb_s": bus})
    Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _collective(op: str, full: Any, shard: Any) -> Any:
    """A call of ``op`` on these buffers (``full``: the whole message, ``shard``: one rank's part)."""
    import torch.distributed as dist

    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    return lambda: dist.all_gather_into_tensor(full, shard)


def _symmetric_all_reduce(op: str, elements: int, dtype: Any, device: Any) -> Any:
    """A call of torch's symmetric-memory all-reduce on a buffer every rank allocated from symmetric memory and
    exchanged handles for (``rendezvous``): one-shot (each rank reads every peer's whole buffer and sums) or
    two-shot (each reduces its share, then gathers the others'), in place."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    buffer = symm_mem.empty(elements, dtype=dtype, device=device)
    buffer.fill_(1)
    symm_mem.rendezvous(buffer, dist.group.WORLD)
    if op == "symm_one_shot":
        return lambda: torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", group_name)
    return lambda: torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group_name)


def _timed(call: Any, iterations: int, on_gpu: bool) -> list[float]:
    """Seconds per call: CUDA events around each call on GPUs (the host queues ahead), wall time on CPUs."""
    import time

    import torch

    out = []
    for _ in range(iterations):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            call()
            out.append(time.perf_counter() - began)
    return out


PROTOCOLS = ("Simple", "LL128", "LL")


def setting_env(setting: str) -> dict[str, str]:
    """The environment variables a setting stands for (``default``: none; a protocol: ``NCCL_PROTO``)."""
    if setting == "default":
        return {}
    if setting in PROTOCOLS:
        return {"NCCL_PROTO": setting}
    pairs = [item.split("=", 1) for item in setting.split(",")]
    if any(len(pair) != 2 or not pair[0].startswith("NCCL_") for pair in pairs):
        raise SystemExit(f"--settings {setting!r}: use default, {', '.join(PROTOCOLS)}, or NCCL_VAR=value[,...]")
    return dict(pairs)


def _launch(
    setting: str, spec: dict[str, Any], workdir: Path, gpus: int, nccl_log: list[str] | None = None
) -> list[dict[str, Any]] | dict[str, Any]:
    """One setting's processes; with ``nccl_log`` (a list) NCCL logs its set-up and tuning, and each distinct
    message is added to the list."""
    out_dir = Path(tempfile.mkdtemp(prefix="nccl-", dir=workdir))
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")}
    env.update(setting_env(setting))
    if nccl_log is not None:
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,GRAPH,TUNING,ENV")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", __file__]
    command += ["--worker-spec", json.dumps({**spec, "out_dir": str(out_dir)})]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if nccl_log is not None:
        seen = set(nccl_log)  # without host and process prefixes: one line per distinct message, in order
        for line in (proc.stdout + proc.stderr).splitlines():
            message = line.split(" NCCL INFO ", 1)[-1].strip() if " NCCL INFO " in line else None
            if message and message not in seen:
                seen.add(message)
                nccl_log.append(message)
    ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != gpus:
        return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    # a collective ends when its slowest rank's does: the slowest rank's median per op and size
    return [max((r[i] for r in ranks), key=_slowest) for i in range(len(ranks[0]))]


def _slowest(row: dict[str, Any]) -> float:
    """The sort key of a rank's row: its time, a failed op first (its error is what to show)."""
    return float("inf") if row["us"] is None else row["us"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["default", *PROTOCOLS, "NCCL_MIN_NCHANNELS=32"],
        help="default, a protocol, or NCCL_VAR=value[,NCCL_VAR=value]",
    )
    parser.add_argument("--sizes-mib", nargs="+", type=float, default=[1, 4, 16, 32, 64, 256])
    parser.add_argument("--ops", nargs="+", choices=OPS + SYMMETRIC_OPS, default=list(OPS))
    parser.add_argument("--gpus", type=int, default=None, help="processes (default: every GPU; 2 on CPU)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument(
        "--nccl-info",
        action="store_true",
        help="log NCCL's set-up and tuning (NCCL_DEBUG=INFO) in the first round's default run; kept under nccl_info",
    )
    parser.add_argument("--cpu-dry-run", action="store_true", help="gloo on CPU, small sizes: checks the plumbing")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/transport/nccl_collectives.json")
    args = parser.parse_args()
    if args.worker_spec:
        _worker(json.loads(args.worker_spec))
        return 0

    import torch

    gpus = args.gpus or (2 if args.cpu_dry_run else torch.cuda.device_count())
    if gpus < 2:
        raise SystemExit("nccl_collectives.py needs 2 or more GPUs (or --cpu-dry-run)")
    if args.cpu_dry_run and set(args.ops) & set(SYMMETRIC_OPS):
        raise SystemExit(f"--ops {' '.join(SYMMETRIC_OPS)}: symmetric memory needs GPUs; leave them out of a CPU run")
    sizes = [0.25, 1.0] if args.cpu_dry_run else args.sizes_mib
    spec = {"cpu": args.cpu_dry_run, "ops": args.ops, "sizes_mib": sizes, "warmup": 5, "iterations": args.iterations}
    report: dict[str, Any] = {
        "what": "NCCL collectives per setting (protocol, channels), bf16 (fp32 on CPU), median of the slowest rank",
        "settings": {setting: setting_env(setting) for setting in args.settings},
        **provenance(),
        "processes": gpus,
        "rounds": args.rounds,
        "results": {},
    }
    rounds: dict[str, list[Any]] = {setting: [] for setting in args.settings}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = args.settings if round_index % 2 == 0 else args.settings[::-1]
            for setting in order:
                log = [] if args.nccl_info and round_index == 0 and setting == "default" else None
                rounds[setting].append(_launch(setting, spec, Path(tmp), gpus, log))
                if log is not None:
                    report["nccl_info"] = log[:400]
                report["results"] = {p: _summary(r) for p, r in rounds.items() if r}
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1))
    for setting, rows in report["results"].items():
        for row in rows if isinstance(rows, list) else [rows]:
            shown = "  ".join(f"{k}={v}" for k, v in row.items() if k != "us_by_round")
            print(f"{setting:>24} {shown}")
    return 0 if all(isinstance(r, list) for r in report["results"].values()) else 1


def _summary(results: list[Any]) -> list[dict[str, Any]] | dict[str, Any]:
    """Per op and size, the median over the rounds that ran (each round's figure kept under ``us_by_round``)."""
    good = [r for r in results if isinstance(r, list)]
    if not good:
        return results[-1]
    out = []
    for i in range(len(good[0])):
        timed = [g[i] for g in good if g[i]["us"] is not None]
        if not timed:
            out.append(good[0][i])  # the op failed in every round: its error
            continue
        row, per_round = timed[0], [t["us"] for t in timed]
        median = statistics.median(per_round)
        bus = row["bus_gb_s"] * row["us"] / median
        out.append({**row, "us": round(median, 2), "bus_gb_s": round(bus, 1), "us_by_round": per_round})
    return out


if __name__ == "__main__":
    sys.exit(main())
