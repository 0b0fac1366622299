"""MegaScan on GPUs: tracing overhead, and detection accuracy with injected slowdowns.

    python benchmarks/megascan_overhead.py --out benchmarks/results/megascan/megascan.json            # 1 and 4 GPUs
    python benchmarks/megascan_overhead.py --cpu-dry-run --out /tmp/megascan.json           # plumbing only
    python benchmarks/megascan_overhead.py --only overhead --layout dp-tp2-pp2 --out OUT.json  # 8 GPUs: DP2 x TP2 x PP2

* Overhead (1 GPU and all GPUs, DP × PP): the same training alternates between no callback,
  ``MegaScan(interval=1, window=1, granularity="stage")`` (every step traced; GPU busy time measured in every
  tenth window, the default), the same with busy time in every window (``gpu_busy_every=1``), the default with
  CUPTI left attached after each busy-time session (``TEARDOWN_CUPTI=0``: how MegaScan ran before
  ``compat/cupti_teardown.py``), and the tracer alone (``gpu_busy=False``), ``--pairs`` times, in the same
  processes; the ratios of median step times are the overheads. These fits run eagerly (``cuda_graphs=False``),
  the layout MegaScan's rules were built on. On one GPU two more fits per pair keep the default (the step
  replayed as a CUDA graph), untraced and traced (the graph's own events, ``scan.tracing.recorder``): their ratio is
  ``overhead_default_graphs``, and ``traced_over_default_graphs`` what tracing cost when traced steps ran
  eagerly. ``--cases`` keeps only some of them, e.g. ``--cases plain_default_graphs traced_default_graphs``.
* Overhead at the defaults (any GPU count): ``plain_defaults`` (the strategy's defaults, no callback) against
  ``scan_defaults`` (the same with ``MegaScan()``: every default, two steps in every five traced,
  the granularity chosen per job, detection at fit end); ``overhead_defaults`` is the ratio of their *mean* step
  times from one step's end to the next (what a job pays over all its steps, every hook included: the traced
  steps cost more than the others) and
  ``overhead_defaults_median`` that of their medians.
* Detection (4 GPUs, DP2 × PP2): ``--runs`` runs for each injected slowdown (10%, 20%, 50% on a random
  rank, ``SlowdownInjector``) and as many clean runs; each run's fit-end report is scored: a hit names the
  slowed rank with cause "compute"; any other named rank is a false alarm.

Every measurement runs inside one ``torchrun`` launch per GPU count; results are written after each phase.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# "small" is launch-bound on an H200 (a 4 ms forward is about as long as the host takes to enqueue it): the
# worst case for the tracer's per-span cost, and a regime where a slower GPU barely slows the step. "medium"
# keeps the GPU busy, as training at scale does. "llama" is "medium" Llama-style (rotary embeddings, RMSNorm,
# SwiGLU, no biases, 4 query groups): other kernels, and other spans between them, than the GPT-2-style ones.
GPU_MODELS = {
    "small": dict(vocab_size=32000, seq_length=1024, num_layers=8, hidden_size=1024, num_attention_heads=16),
    "medium": dict(vocab_size=32000, seq_length=2048, num_layers=16, hidden_size=2048, num_attention_heads=16),
}
GPU_MODELS["llama"] = dict(
    GPU_MODELS["medium"],
    num_query_groups=4,
    ffn_hidden_size=5632,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
)
MICRO_BATCH = {"small": 4, "medium": 2, "llama": 2}
CPU_MODEL = dict(vocab_size=256, seq_length=32, num_layers=4, hidden_size=64, num_attention_heads=4)
FACTORS = [1.1, 1.2, 1.5]
MULTI_GPU_LAYOUTS: dict[str, dict[str, int]] = {  # the overhead's all-GPU fits (--layout)
    "dp-pp2": {"pipeline_model_parallel_size": 2},
    "dp": {},
    "tp2": {"tensor_model_parallel_size": 2},
    "dp-tp2-pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
}
OVERHEAD_CASES = (  # the *_default_graphs ones on one GPU only
    "plain",
    "traced",
    "traced_busy_every_window",
    "traced_cupti_left_attached",
    "traced_no_busy_time",
    "plain_default_graphs",
    "traced_default_graphs",
    "plain_defaults",
    "scan_defaults",
    "scan_defaults_no_busy_time",
    "scan_defaults_stage",
)


def fit_once(
    spec: dict[str, Any],
    callbacks: list,
    steps: int,
    wrap_dataset: Any = None,
    wall: bool = False,
    strategy_options: Optional[dict[str, Any]] = None,
) -> list[float]:
    """One Trainer.fit; per-step seconds (after a synchronize at both ends of each step). ``wrap_dataset``:
    applied to the training set (``scan.evaluation.faults.SlowDataset``). ``wall``: the seconds from one step's end to
    the next's instead, the fetch of the batch included (what a slow data loader lengthens)."""
    import lightning.pytorch as pl
    import torch

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule

    times: list[float] = []
    ends: list[float] = []

    class StepTimer(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            times.append(ends[-1] - self.start)

    model = spec["model"]
    gbs = spec["global_batch_size"]
    trainer = pl.Trainer(
        accelerator=spec["accelerator"],
        devices=spec["devices"],
        precision="bf16-mixed" if spec["accelerator"] == "gpu" else "32-true",
        strategy=MegatronAppStrategy(
            micro_batch_size=spec["micro_batch_size"], **spec["layout"], **(strategy_options or {})
        ),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[StepTimer(), *callbacks],
    )
    module = GPTModule(**model, layer_spec="sdpa", split_invariant_init=False)
    data = SyntheticTokenDataModule(
        vocab_size=model["vocab_size"],
        seq_length=model["seq_length"],
        global_batch_size=gbs,
        num_train_samples=gbs * steps,
    )
    if wrap_dataset is not None:
        data.setup("fit")
        data.train_set = wrap_dataset(data.train_set)
    trainer.fit(module, data)
    # Trainer, strategy and module reference each other: without a full collection their GPU memory lives on
    # until Python's oldest generation is next collected, and forty fits in one process run out of memory.
    del trainer, module, data
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if wall:
        return [b - a for a, b in zip(ends, ends[1:])]
    return times


def _worker(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from lightning_megatron.scan import MegaScan, SlowdownInjector

    rank = int(os.environ.get("RANK", 0))
    out: dict[str, Any] = {}
    steps = spec["steps"]
    if spec["phase"] == "overhead":
        eager = {"cuda_graphs": False}
        times: dict[str, list[float]] = {
            "plain": [],
            "traced": [],
            "traced_busy_every_window": [],
            "traced_cupti_left_attached": [],
            "traced_no_busy_time": [],
        }
        graphs = spec["devices"] == 1  # the default replays the step as a CUDA graph on one GPU only
        if graphs:
            times.update(plain_default_graphs=[], traced_default_graphs=[])
        times.update(plain_defaults=[], scan_defaults=[], scan_defaults_no_busy_time=[], scan_defaults_stage=[])
        times = {name: t for name, t in times.items() if not spec.get("cases") or name in spec["cases"]}
        per_pair: dict[str, list[float]] = {name: [] for name in times}
        for pair in range(spec["pairs"]):
            work = Path(spec["workdir"]) / f"overhead-{pair}"
            cases = {
                "plain": [],
                "traced": [MegaScan(work / "traced", interval=1, window=1, detect=False)],
                "traced_busy_every_window": [
                    MegaScan(work / "busy", interval=1, window=1, detect=False, gpu_busy_every=1)
                ],
                # what MegaScan did before compat/cupti_teardown.py: CUPTI stays attached after each busy window
                "traced_cupti_left_attached": [MegaScan(work / "attached", interval=1, window=1, detect=False)],
                # the tracer alone: no profiler session at all
                "traced_no_busy_time": [MegaScan(work / "nobusy", interval=1, window=1, detect=False, gpu_busy=False)],
                # one GPU, the default strategy: the step replayed as a CUDA graph, traced from the graph's events
                "plain_default_graphs": [],
                "traced_default_graphs": [MegaScan(work / "graphs", interval=1, window=1, detect=False)],
                # what a user gets: the strategy's and MegaScan's defaults, nothing chosen for the benchmark
                "plain_defaults": [],
                "scan_defaults": [MegaScan(work / "defaults")],
                # which part of the defaults costs: the busy-time sessions, or the granularity chosen per job
                "scan_defaults_no_busy_time": [MegaScan(work / "defaults-nobusy", gpu_busy=False)],
                "scan_defaults_stage": [MegaScan(work / "defaults-stage", granularity="stage")],
            }
            cases = {name: callbacks for name, callbacks in cases.items() if name in times}
            order = list(cases) if pair % 2 == 0 else list(reversed(cases))  # alternate: spread the drift
            for name in order:
                attached = name == "traced_cupti_left_attached"
                if attached:
                    os.environ["TEARDOWN_CUPTI"] = "0"
                options = None if name.endswith("_default_graphs") or "_defaults" in name else eager
                # the defaults' pair is timed from one step's end to the next: every hook of the callback counted
                wall = "_defaults" in name
                measured = fit_once(spec, cases[name], steps, strategy_options=options, wall=wall)[3:]  # warm-up
                times[name] += measured
                per_pair[name].append(1000 * statistics.median(measured))
                if attached:
                    _detach_cupti()  # so that the next fit does not pay for it
        median = {name: statistics.median(t) for name, t in times.items()}
        out = {f"{name}_step_ms": 1000 * m for name, m in median.items()}
        if times.get("plain_defaults"):  # a job pays the mean, traced steps included
            means = {name: statistics.fmean(t) for name, t in times.items() if "_defaults" in name and t}
            for name in means:
                if name.startswith("scan_defaults"):
                    key = "overhead" + name.removeprefix("scan")
                    out[key] = means[name] / means["plain_defaults"] - 1.0
                    out[key + "_median"] = median[name] / median["plain_defaults"] - 1.0
            out["defaults_mean_step_ms"] = {name: 1000 * m for name, m in means.items()}
            out["defaults_step_ms_first_pair"] = {
                name: [round(1000 * t, 1) for t in times[name][: len(times[name]) // spec["pairs"]]] for name in means
            }
        for name, base in [
            (n, "plain") for n in median if n.startswith("traced") and "graphs" not in n and n in median
        ] + [("traced_default_graphs", "plain_default_graphs")]:
            if name in median and base in median:  # "overhead" is the default's: MegaScan's defaults, eager
                key = "overhead" if name == "traced" else f"overhead_{name.removeprefix('traced_')}"
                out[key] = median[name] / median[base] - 1.0
        if "traced" in median and "plain_default_graphs" in median:  # what tracing cost before it kept the graph
            out["traced_over_default_graphs"] = median["traced"] / median["plain_default_graphs"] - 1.0
        out.update(
            median_step_ms_per_pair=per_pair,
            steps_each=len(next(iter(times.values()), [])),
            note="fits eager (cuda_graphs=False) except *_default_graphs; MegaScan's default gpu_busy_every=10",
        )
    else:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
        chooser = random.Random(spec["seed"])
        runs = []
        for factor in [1.0, *spec["factors"]]:
            for i in range(spec["runs"]):
                slow = chooser.randrange(world)
                callbacks: list[Any] = [
                    MegaScan(Path(spec["workdir"]) / f"detect-{factor}-{i}", interval=1, window=1, start_step=2)
                ]
                if factor > 1.0:
                    callbacks.append(SlowdownInjector(ranks=[slow], factor=factor))
                fit_once(spec, callbacks, steps)
                report = callbacks[0].report
                named = {s.rank: s.kind for s in report.suspects}
                runs.append(
                    {
                        "factor": factor,
                        "slowed_rank": slow if factor > 1.0 else None,
                        "named": {str(k): v for k, v in named.items()},
                        "found": factor > 1.0 and named.get(slow) == "compute",
                        "false_alarms": sorted(r for r in named if factor == 1.0 or r != slow),
                        "estimated_slowdown": next((s.slowdown for s in report.suspects if s.rank == slow), None),
                        "report": report.to_dict(),
                    }
                )
        out = {"runs": runs}
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(out))


def _detach_cupti() -> None:
    """One empty busy-time session with ``TEARDOWN_CUPTI=1``: Kineto detaches CUPTI when it stops."""
    import torch

    from lightning_megatron.scan.tracing.busy import KernelActivity

    os.environ["TEARDOWN_CUPTI"] = "1"
    activity = KernelActivity()
    if torch.cuda.is_available() and activity.start():
        activity.stop()


def _launch(spec: dict[str, Any], nproc: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += [__file__, "--worker-spec", json.dumps(spec)]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not Path(spec["result"]).exists():
        log = proc.stdout + proc.stderr
        first = log.find("Traceback (most recent call last)")  # the failing rank's, before the launcher's noise
        return {
            "error": f"exit {proc.returncode}",
            "first_traceback": log[first : first + 4000],
            "log_tail": log[-3000:],
        }
    return {**json.loads(Path(spec["result"]).read_text()), "seconds": round(time.perf_counter() - started, 1)}


def _score(runs: list[dict[str, Any]]) -> dict[str, Any]:
    scores: dict[str, Any] = {}
    for factor in sorted({r["factor"] for r in runs}):
        group = [r for r in runs if r["factor"] == factor]
        alarms = sum(len(r["false_alarms"]) for r in group)
        if factor == 1.0:
            scores["clean"] = {"runs": len(group), "runs_with_false_alarm": sum(bool(r["false_alarms"]) for r in group)}
            continue
        hits = sum(r["found"] for r in group)
        scores[f"{round((factor - 1) * 100)}%"] = {
            "runs": len(group),
            "recall": hits / len(group),
            "precision": hits / max(hits + alarms, 1),
            "false_alarms": alarms,
        }
    return scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/megascan/megascan.json")
    parser.add_argument("--runs", type=int, default=10, help="detection runs per slowdown and clean")
    parser.add_argument("--pairs", type=int, default=3, help="overhead: alternations of plain and traced fits")
    parser.add_argument("--only", nargs="*", default=["overhead", "detection"])
    parser.add_argument("--cases", nargs="*", choices=OVERHEAD_CASES, help="overhead: only these cases")
    parser.add_argument("--model", choices=sorted(GPU_MODELS), default="medium", help="GPU model size")
    parser.add_argument(
        "--layout",
        nargs="+",
        choices=sorted(MULTI_GPU_LAYOUTS),
        default=["dp-pp2"],
        help="overhead on all GPUs, one launch each: data parallel over what the model-parallel part leaves (8 GPUs: "
        "dp-pp2 is DP4 x PP2, dp is DP8, dp-tp2-pp2 is DP2 x TP2 x PP2 with sequence parallelism; 2 GPUs: dp is "
        "DP2, tp2 TP2 with sequence parallelism, dp-pp2 PP2)",
    )
    parser.add_argument("--no-single", action="store_true", help="overhead: skip the one-GPU fits")
    parser.add_argument("--steps", type=int, default=20, help="overhead: steps per fit (the first 3 are not timed)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU processes (gloo)")
    parser.add_argument("--keep-traces", type=Path, help="also write the detection runs' traces here (.tar.gz)")
    args = parser.parse_args()
    if args.worker_spec:
        _worker(json.loads(args.worker_spec))
        return 0

    import torch

    gpus = 4 if args.cpu_dry_run else torch.cuda.device_count()
    base = {
        "accelerator": "cpu" if args.cpu_dry_run else "gpu",
        "model": CPU_MODEL if args.cpu_dry_run else GPU_MODELS[args.model],
        "model_name": "cpu-tiny" if args.cpu_dry_run else args.model,
        "micro_batch_size": 2 if args.cpu_dry_run else MICRO_BATCH[args.model],
    }
    report: dict[str, Any] = {"what": "MegaScan overhead and slow-rank detection", **provenance(), **base}
    report["results"] = {}
    report["multi_gpu_layout"] = args.layout[0] if len(args.layout) == 1 else args.layout

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory() as workdir:
        if "overhead" in args.only:
            runs = [] if args.no_single or gpus == 1 else [(1, None)]
            runs += [(gpus, name) for name in args.layout] if gpus > 1 else [(1, None)]
            for devices, layout_name in runs:
                layout = {} if devices == 1 else dict(MULTI_GPU_LAYOUTS[layout_name])
                if layout.get("tensor_model_parallel_size", 1) > 1:
                    layout["sequence_parallel"] = True
                model_parallel = layout.get("pipeline_model_parallel_size", 1) * layout.get(
                    "tensor_model_parallel_size", 1
                )
                if devices % model_parallel:
                    raise SystemExit(f"--layout {layout_name} needs a multiple of {model_parallel} GPUs, not {devices}")
                dp = devices // model_parallel
                spec = {
                    **base,
                    "phase": "overhead",
                    "devices": devices,
                    "layout": layout,
                    "global_batch_size": base["micro_batch_size"] * 4 * dp,
                    "steps": 6 if args.cpu_dry_run and args.steps == 20 else args.steps,
                    "pairs": args.pairs,
                    "cases": args.cases,
                    "workdir": workdir,
                    "result": f"{workdir}/overhead-{devices}.json",
                }
                key = f"overhead/{devices}gpu" + (f"/{layout_name}" if devices > 1 and len(args.layout) > 1 else "")
                report["results"][key] = _launch(spec, devices)
                save()
                print(f"{key}: {report['results'][key]}", flush=True)
        if "detection" in args.only and gpus >= 4:
            spec = {
                **base,
                "phase": "detection",
                "devices": 4,
                "layout": {"pipeline_model_parallel_size": 2},
                "global_batch_size": base["micro_batch_size"] * 4 * 2,
                "steps": 6 if args.cpu_dry_run else 10,
                "runs": args.runs,
                "factors": FACTORS,
                "seed": 0,
                "workdir": workdir,
                "result": f"{workdir}/detection.json",
            }
            result = _launch(spec, 4)
            if "runs" in result:
                result["scores"] = _score(result["runs"])
            report["results"]["detection/4gpu"] = result
            save()
            if args.keep_traces:
                with tarfile.open(args.keep_traces, "w:gz") as tar:
                    for run in sorted(Path(workdir).glob("detect-*")):
                        tar.add(run, arcname=run.name)
            print(f"detection: {result.get('scores', result.get('error'))}", flush=True)
    failed = any("error" in r for r in report["results"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
