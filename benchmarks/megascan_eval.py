"""MegaScan's detection against faults it was not built from: recall and precision per fault kind and layout.

    python benchmarks/megascan_eval.py --runs 10 --out benchmarks/results/megascan/megascan_eval_2xh200.json   # 2 GPUs
    python benchmarks/megascan_eval.py --cpu --runs 4 --out benchmarks/results/megascan/megascan_eval_cpu.json  # gloo

    python benchmarks/megascan_eval.py --layouts single --steps 34 --runs 10 --out ...   # one GPU, faults mid-fit

One ``torchrun`` launch per layout (DP2, TP2 with sequence parallelism, PP2, PP2 × VPP2: 2 processes; ``single``: one);
inside it, fits one after another (the strategy supports many fits per process), every step from step 2 traced
(one in ``--interval`` N: the others replayed as CUDA graphs at DP/TP, as in the default job), detection at fit end with its default thresholds. Cases, each ``--runs`` times, the faulted rank alternating
between 0 and 1:

* ``clean``;
* ``gpu-contention`` / ``gpu-contention-bursty``: another process multiplying matrices on the rank's GPU,
  continuously / 0.3 s on, 0.3 s off (``scan.evaluation.faults.CompetingProcess``; GPUs only);
* ``gpu-memory-contention``: another process copying 512 MiB buffers on the rank's GPU, continuously
  (bandwidth-bound kernels instead of GEMMs; ``CompetingProcess(kind="gpu-memory")``; GPUs only);
* ``cpu-contention``: spinning processes on the rank's CPUs (its affinity set; on GPUs ``--cpus-per-rank N`` first
  gives each rank N CPUs of its own, as a container's CPU set would, else they share the host's);
* ``cpu-contention-stress-ng``: the same CPUs loaded by ``stress-ng --cpu`` (a tool we did not write,
  ``outside_faults.StressNg``), where ``stress-ng`` is installed;
* ``cpu-quota`` / ``cpu-quota-bursty``: the rank's process under a container's CPU limit, 0.5 / 0.8 CPUs per
  100 ms (the kernel's CFS bandwidth control, ``outside_faults.CpuQuota``: it runs at full speed, then is stopped
  until the next period), where a cgroup can be made (root);
* ``host-stall`` / ``host-stall-in-step`` / ``host-stall-hidden``: the rank's own Python blocks for about 25% of a
  clean step per step (``scan.evaluation.faults.HostStall``): in ``on_train_batch_end`` after MegaScan's (the host gap
  before the next step), the same before MegaScan's (inside the traced step, after the GPU finished: the
  evaluation's step timer synchronizes first, as a logged loss would), and in ``on_before_optimizer_step``,
  behind the step's queued GPU work (which may hide it: then it must not be named wrongly);
* ``host-stall-exposed``: the same ``on_before_optimizer_step`` stall, 125% of a clean step: longer than the
  GPU work queued before it, so the GPU idles inside the step with no synchronisation in front of the stall;
* ``slow-loader`` / ``slow-loader-mild``: the rank's samples take longer to read
  (``scan.evaluation.faults.SlowDataset``), about 25% / 2% of a clean step per batch;
* ``link-delay`` (PP2 only): pipeline messages from rank 0 to rank 1 arrive later, about 25% of a clean step per
  step (``scan.evaluation.inject.LinkDelayInjector``).

``single`` is one process on one GPU (CUDA graphs replayed by default there, and traced so): no peer to compare
with, so its faults begin during the run, ``--onset`` of the way through the traced steps (default halfway;
``onset_step``: ``CompetingProcess(start_step=...)``, ``SlowDataset(after_reads=...)``), a machine that turns slow
during a run, which only the rank's own earlier steps can show. Use at least 34 steps (16 analysed steps on
each side of a halfway onset).

Scoring (``score``): a fault *slows the job* when its runs' step times (from one step's end to the next, the
fetch included) are in the median ≥ 10% above the clean runs' of the same launch (``--append`` joins launches
on different machines, whose clean steps differed by up to 20%). For those, recall is the fraction of runs
naming the faulted rank (for the link: its sender) with an expected kind. A fault below that bar may be named
rightly (it does cost time: the mild loader about 2% of a step) and is counted apart
(``runs_naming_it_rightly``); any other suspect of a faulted run is a wrong one (``runs_with_a_wrong_suspect``).
Precision: right suspects over all suspects of the case's runs. Clean runs must name nothing. Every run's
suspects are kept, so what was named is visible, and so is what each rank's host did (``hosts``:
``host_usage.HostUsage``, a fixed CPU probe after every step and the main thread's CPU time), a check independent
of MegaScan on a ``host`` suspect where nothing was injected.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from host_usage import HostUsage  # noqa: E402
from megascan_overhead import CPU_MODEL, GPU_MODELS, MICRO_BATCH, fit_once  # noqa: E402  (benchmarks/ is on the path)
from megascan_score import EXPECTED, rescore, score, suspect_record  # noqa: E402
from outside_faults import CpuQuota, StressNg, cpu_quota_available, stress_ng_available  # noqa: E402
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = {
    "dp2": {},
    "tp2-sp": _TP2_SP,
    "pp2": {"pipeline_model_parallel_size": 2},
    "pp2-vpp2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    "single": {},
    # 4 and 8 GPUs (issue 18's machines): more than one peer, and peers and stages together
    "dp4": {},
    "dp2-pp2": {"pipeline_model_parallel_size": 2},
    "tp2-pp2": {**_TP2_SP, "pipeline_model_parallel_size": 2},
    "dp8": {},
    "dp2-tp2-pp2": {**_TP2_SP, "pipeline_model_parallel_size": 2},
}
DEVICES = {"single": 1, "dp4": 4, "dp2-pp2": 4, "tp2-pp2": 4, "dp8": 8, "dp2-tp2-pp2": 8}  # processes (2 otherwise)
TRACED_FROM = 2  # MegaScan(start_step=...): the first steps compile, capture graphs and fill caches
MICROBATCHES = 4


def cases(layout: str, gpu: bool) -> list[str]:
    names = ["clean", "cpu-contention", "slow-loader", "slow-loader-mild"]
    names += ["host-stall", "host-stall-in-step", "host-stall-hidden", "host-stall-exposed"]
    if stress_ng_available():
        names.insert(2, "cpu-contention-stress-ng")
    if cpu_quota_available():
        names[names.index("slow-loader") : names.index("slow-loader")] = ["cpu-quota", "cpu-quota-bursty"]
    if gpu:
        names[1:1] = ["gpu-contention", "gpu-contention-bursty", "gpu-memory-contention"]
    if LAYOUTS[layout].get("pipeline_model_parallel_size", 1) > 1:
        names.append("link-delay")
    return names


COMPETITORS = {
    "gpu-contention": dict(kind="gpu"),
    "gpu-contention-bursty": dict(kind="gpu", on_s=0.3, off_s=0.3),
    "gpu-memory-contention": dict(kind="gpu-memory"),
    "cpu-contention": dict(kind="cpu"),
}


def _callbacks(
    case: str, rank: int, step_ms: float, trace_dir: Path, spec: dict[str, Any], competitors: dict[tuple[str, int], Any]
) -> tuple[list, Any]:
    """The MegaScan callback, the fault's callbacks, and a dataset wrapper for the loader faults. Competing
    processes are kept alive between fits (``competitors``: one per case and rank, paused between its fits), so
    each run's fit starts with its fault already competing and pays no process start-up. From ``spec``: the
    layout, the micro-batch size, the granularity, ``onset_step`` (the fault begins at this step; 0: from the
    start) and ``trace_replays`` (``MegaScan(trace_replays=True)``: traced steps replayed as CUDA graphs at DP/TP
    too, where the strategy graphs the step: not at PP)."""
    from lightning_megatron.scan import LinkDelayInjector, MegaScan
    from lightning_megatron.scan.evaluation.faults import HostStall, SlowDataset

    scan = MegaScan(
        trace_dir,
        interval=spec.get("interval", 1),
        window=1,
        start_step=TRACED_FROM,
        granularity=spec["granularity"],
        trace_replays=spec.get("trace_replays") or None,
    )
    callbacks: list[Any] = [scan]
    wrap = None
    micro_batch, onset_step = spec["micro_batch_size"], spec["onset_step"]
    if case in COMPETITORS:
        callbacks.append(_competitor(case, rank, onset_step, competitors))
    elif case.startswith("slow-loader"):
        share = 0.02 if case.endswith("mild") else 0.25
        samples = MICROBATCHES * micro_batch  # in a rank's batch
        per_sample_ms = share * step_ms / samples
        wrap = lambda dataset: SlowDataset(dataset, per_sample_ms, [rank], after_reads=onset_step * samples)  # noqa: E731
    elif case.startswith("host-stall"):
        behind_queued_work = case.endswith(("hidden", "exposed"))
        hook = "before_optimizer_step" if behind_queued_work else "batch_end"
        share = 1.25 if case.endswith("exposed") else 0.25
        stall = HostStall([rank], delay_ms=share * step_ms, hook=hook, start_step=onset_step)
        callbacks.insert(0 if case.endswith("in-step") else len(callbacks), stall)  # before or after MegaScan's
    elif case == "cpu-contention-stress-ng":
        callbacks.append(StressNg(rank, start_step=onset_step))
    elif case.startswith("cpu-quota"):
        callbacks.append(CpuQuota(rank, start_step=onset_step, cpus=0.8 if case.endswith("bursty") else 0.5))
    elif case == "link-delay":
        next_stage = spec["devices"] // spec["layout"].get("pipeline_model_parallel_size", 1)  # rank 0's next stage
        callbacks.append(LinkDelayInjector(src=0, dst=next_stage, delay_ms=0.25 * step_ms / MICROBATCHES))
    return callbacks, wrap


def _pin_cpus(per_rank: int | None = None) -> None:
    """Each rank on CPUs of its own, so a fault on one rank's CPUs competes with that rank alone: on CPUs an equal
    share (where there are at least as many CPUs as ranks), as it would be on a GPU host; on GPUs ``per_rank``
    CPUs each (``--cpus-per-rank``), as a container's or a scheduler's CPU set gives them."""
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cpus = sorted(os.sched_getaffinity(0))
    share = per_rank or len(cpus) // world
    if share * world > len(cpus):
        raise SystemExit(f"--cpus-per-rank {per_rank}: {world} ranks need {share * world} CPUs, {len(cpus)} here")
    if share >= 1:
        os.sched_setaffinity(0, cpus[rank * share : (rank + 1) * share])
        torch.set_num_threads(share)


def _faulted_rank(case: str, run: int, devices: int) -> int:
    """The rank a run's fault hits: each rank in turn (the link's sender is rank 0)."""
    return 0 if case == "link-delay" else run % devices


def _competitor(case: str, rank: int, onset_step: int, competitors: dict) -> Any:
    """The case's competing processes for ``rank``: one ``CompetingProcess`` per case and rank, kept alive between
    its fits (made here on first use)."""
    from lightning_megatron.scan.evaluation.faults import CompetingProcess

    if (case, rank) not in competitors:
        competitors[(case, rank)] = CompetingProcess(
            [rank], keep_alive=True, start_step=onset_step, **COMPETITORS[case]
        )
    return competitors[(case, rank)]


def _start_competitors(plan: list[tuple[str, int]], spec: dict[str, Any], competitors: dict) -> None:
    """Every competing process this rank's runs will use, started side by side and paused until its fits (one
    at a time, each paid 15-20 s of start-up on a GPU host: a quarter of a layout's first two rounds)."""
    me = int(os.environ["RANK"])
    device = int(os.environ.get("LOCAL_RANK", "0")) if spec["accelerator"] == "gpu" else None
    for case, i in plan:
        rank = _faulted_rank(case, i, spec["devices"])
        if case in COMPETITORS and rank == me:
            _competitor(case, rank, spec["onset_step"], competitors).start(device)  # no-op once started
    for competitor in competitors.values():
        competitor.wait_ready()


def _worker(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from lightning_megatron.scan import MegaScan

    if spec["accelerator"] == "cpu" or spec.get("cpus_per_rank"):
        _pin_cpus(spec.get("cpus_per_rank"))

    steps, runs = spec["steps"], spec["runs"]
    records: list[dict[str, Any]] = []
    workdir = Path(spec["workdir"])
    clean_ms: list[float] = []
    competitors: dict[tuple[str, int], Any] = {}
    chosen = cases(spec["layout_name"], spec["accelerator"] == "gpu")
    if spec.get("cases"):
        chosen = ["clean"] + [case for case in chosen if case in spec["cases"] and case != "clean"]
    first = spec.get("first_run", 0)  # --append: numbered after the earlier launches' runs (and trace folders)
    plan = [(case, i) for i in range(first, first + runs) for case in chosen]
    # Round by round (each round's clean run first: the faults' sizes come from the clean runs so far), so a
    # deadline cuts every case alike and slow drift of the machine falls on every case alike.
    try:
        _start_competitors(plan, spec, competitors)
        for case, i in plan:
            # Past the deadline no new fit starts (rank 0 decides for both, so neither waits on the other; the
            # process group exists from the first fit on).
            late = [bool(records) and spec.get("deadline") is not None and time.time() > spec["deadline"]]
            if records:
                dist.broadcast_object_list(late, src=0)
            if late[0]:
                if dist.get_rank() == 0:
                    print(
                        f"{spec['layout_name']}: deadline reached, {len(records)} of {len(plan)} runs made", flush=True
                    )
                break
            rank = _faulted_rank(case, i, spec["devices"])
            step_ms = statistics.median(clean_ms) if clean_ms else 100.0
            callbacks, wrap = _callbacks(case, rank, step_ms, workdir / f"{case}-{i}", spec, competitors)
            host = HostUsage()
            started = time.perf_counter()
            times = fit_once(spec, [*callbacks, host], steps, wrap_dataset=wrap, wall=True)  # fetches included
            hosts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, host.summary(TRACED_FROM))  # what each rank's host did (clean runs)
            median_ms = 1000 * statistics.median(times[max(1, spec["onset_step"]) :])  # the faulted steps
            if case == "clean":
                clean_ms.append(median_ms)
            scan = next(c for c in callbacks if isinstance(c, MegaScan))
            report = scan.report
            records.append(
                {
                    "case": case,
                    "run": i,
                    "launch": first,  # the launch's first run: its clean runs are this run's baseline
                    "faulted_rank": None if case == "clean" else rank,
                    "step_ms": round(median_ms, 3),
                    "granularity": scan.granularity,
                    "seconds": round(time.perf_counter() - started, 1),
                    "suspects": [suspect_record(s) for s in (report.suspects if report is not None else [])],
                    "hosts": hosts,
                }
            )
            if dist.get_rank() == 0:
                print(
                    f"{spec['layout_name']} {case} run {i}: step {median_ms:.1f} ms, named "
                    f"{[(s['rank'], s['kind']) for s in records[-1]['suspects']]}; host probes (ms) "
                    f"{[h['probe_ms'] for h in hosts]}",
                    flush=True,
                )
                Path(spec["result"]).write_text(json.dumps(records))  # after every run: a cut-off launch keeps them

    finally:
        for competitor in competitors.values():  # kept alive between fits: end them now
            competitor.close()


def _launch(spec: dict[str, Any]) -> dict[str, Any]:
    """One torchrun launch of the layout. Its progress lines are echoed as they come, and the runs made so far
    are read back even when this process is stopped (SIGTERM from an outer ``timeout``, Ctrl-C): the worker
    writes them after every fit."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['devices']}"]
    command += [__file__, "--worker-spec", json.dumps(spec)]
    log_path = Path(spec["workdir"] + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    returncode: int | str = "stopped"
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        ) as proc,
    ):
        try:
            for line in proc.stdout:
                log.write(line)
                if " run " in line or "deadline" in line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            returncode = proc.wait(timeout=3600)
        except (SystemExit, KeyboardInterrupt):
            pass  # returncode stays "stopped": the runs made so far are read below and written by main
        finally:
            if proc.poll() is None:  # stopped from outside: end the launch's whole process group, then read
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    runs = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).exists() else []
    if returncode != 0 or not runs:
        text = log_path.read_text()
        first = text.find("Traceback (most recent call last)")
        return {"error": f"exit {returncode}", "first_traceback": text[first : first + 4000], "runs": runs}
    return {"runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--layouts", nargs="*", default=[n for n in LAYOUTS if n not in DEVICES], choices=list(LAYOUTS))
    parser.add_argument("--model", choices=sorted(GPU_MODELS), default="medium")
    parser.add_argument("--cpu", action="store_true", help="gloo processes and a tiny model (no GPU faults)")
    parser.add_argument(
        "--onset",
        type=float,
        default=None,
        help="the faults begin this fraction of the way through the traced steps (single: default 0.5; other "
        "layouts: from the first step unless given)",
    )
    parser.add_argument(
        "--cpus-per-rank",
        type=int,
        help="GPU runs: pin each rank to this many CPUs of its own (a container's CPU set); cpu-contention then "
        "competes for those",
    )
    parser.add_argument(
        "--trace-replays",
        action="store_true",
        help="MegaScan(trace_replays=True): at DP2 and TP2 the traced steps stay CUDA-graph replays, as the "
        "untraced ones (default: they run eagerly there, paced by the host on a launch-bound model)",
    )
    parser.add_argument(
        "--interval",
        type=int,
        default=1,
        help="trace one step in N from step 2 (MegaScan(interval=N, window=1)); with N >= 2 at DP2 and TP2 the "
        "untraced steps replay the CUDA graph between the eagerly traced ones, as in the default job (default 1: "
        "every step traced, nothing replayed; use about N times the steps)",
    )
    parser.add_argument(
        "--granularity",
        choices=["stage", "layer", "op"],
        default=None,
        help="MegaScan(granularity=...); default: MegaScan's own (chosen per job: 'layer' at pure PP)",
    )
    parser.add_argument("--keep-traces", type=Path, help="copy every run's traces here (one folder per layout)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="time limit in seconds for all layouts, shared equally; no fit starts past a layout's share",
    )
    parser.add_argument(
        "--cases",
        nargs="*",
        choices=["clean", *EXPECTED],
        help="run only these fault cases (clean always runs: it sizes the faults; `--cases clean`: clean runs "
        "alone); default all",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep what --out holds from other launches: other layouts, and this layout's earlier runs (scored together)",
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        metavar="TRACES",
        help="no launch: detect again on the traces kept by --keep-traces, for the runs of the result named by --from",
    )
    parser.add_argument("--from", dest="source", type=Path, help="with --rescore: the evaluation's result JSON")
    parser.add_argument(
        "--as-replayed-between",
        action="store_true",
        help="with --rescore: read the traced steps as run eagerly in place of CUDA-graph replays (the default job "
        "at DP/TP, whose untraced steps replay), whatever the fits did",
    )
    args = parser.parse_args()
    if args.rescore:
        if args.source is None or args.out is None:
            parser.error("--rescore needs --from RESULT.json and --out")
        rescored = rescore(json.loads(args.source.read_text()), args.rescore, args.as_replayed_between)
        rescored["rescore_command"] = " ".join(["python", "benchmarks/megascan_eval.py", *sys.argv[1:]])
        rescored["rescored_at"] = provenance()["date"]
        for name, outcome in rescored["layouts"].items():
            print(json.dumps({name: outcome["score"]}, indent=1))
        args.out.write_text(json.dumps(rescored, indent=1))
        return 0
    if not args.worker_spec:  # an outer `timeout` stops us with SIGTERM: unwind, so the runs made are written
        signal.signal(
            signal.SIGTERM, lambda *_: sys.exit(f"stopped by SIGTERM; the runs made so far are in {args.out}")
        )
    if args.worker_spec:
        _worker(json.loads(args.worker_spec))
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.interval < 1:
        parser.error(f"--interval {args.interval}: trace one step in N, N >= 1")
    base = {
        "accelerator": "cpu" if args.cpu else "gpu",
        "model": CPU_MODEL if args.cpu else GPU_MODELS[args.model],
        "model_name": "cpu-tiny" if args.cpu else args.model,
        "micro_batch_size": 1 if args.cpu else MICRO_BATCH[args.model],
        "steps": args.steps,
        "runs": args.runs,
        "cpus_per_rank": args.cpus_per_rank,
        "trace_replays": args.trace_replays,
        "interval": args.interval,
    }
    command = " ".join(["python", "benchmarks/megascan_eval.py", *sys.argv[1:]])
    result: dict[str, Any] = {"what": "MegaScan detection against outside faults", **provenance(), "command": command}
    result.update(base)
    result["layouts"] = {}
    if args.append and args.out.exists():
        previous = json.loads(args.out.read_text())
        result["layouts"] = previous["layouts"]
        result["commands"] = previous.get("commands", [previous["command"]]) + [command]
    began = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        for k, name in enumerate(args.layouts):
            layout, devices = LAYOUTS[name], DEVICES.get(name, 2)
            model_parallel = layout.get("tensor_model_parallel_size", 1) * layout.get("pipeline_model_parallel_size", 1)
            dp = devices // model_parallel
            fraction = args.onset if args.onset is not None else (0.5 if devices == 1 else None)
            onset = 0 if fraction is None else TRACED_FROM + round((args.steps - TRACED_FROM) * fraction)
            if fraction is not None and min(onset - TRACED_FROM, args.steps - onset) < 8:
                parser.error(
                    f"--layouts {name}: --steps {args.steps} with --onset {fraction} leaves under 8 traced steps "
                    "before or after the onset; use more steps or an onset nearer 0.5"
                )
            earlier = result["layouts"].get(name, {}).get("runs", [])
            spec = {
                **base,
                "first_run": 1 + max((r["run"] for r in earlier), default=-1),
                "devices": devices,
                "onset_step": onset,
                "layout": layout,
                "layout_name": name,
                "granularity": args.granularity,
                "micro_batch_size": base["micro_batch_size"],
                "global_batch_size": base["micro_batch_size"] * MICROBATCHES * dp,
                "cases": args.cases,
                "workdir": f"{workdir}/{name}",
                "result": f"{workdir}/{name}.json",
                "deadline": began + args.budget_s * (k + 1) / len(args.layouts) if args.budget_s else None,
            }
            outcome = {"devices": devices, "onset_step": onset, **_launch(spec)}
            if args.keep_traces:
                shutil.copytree(spec["workdir"], args.keep_traces / name, dirs_exist_ok=True)
            if earlier:  # --append: this launch's runs join the layout's earlier ones
                outcome["runs"] = earlier + outcome["runs"]
            if outcome["runs"]:
                outcome["score"] = score(outcome["runs"])
                print(json.dumps({name: outcome["score"]}, indent=1), flush=True)
            result["layouts"][name] = outcome
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
            if outcome.get("error") == "exit stopped":
                print(f"stopped: the runs made so far are in {args.out}", flush=True)
                return 1
    return 0


if __name__ == "__main__":
    if os.environ.get("RANK") is None and "--worker-spec" in sys.argv:
        sys.exit("the worker runs under torch.distributed.run (started by main)")
    sys.exit(main())
