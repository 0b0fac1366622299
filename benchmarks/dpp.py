"""MegaDPP vs megatron-core's interleaved schedule: step time and peak memory, clean and with late links.

    torchrun --standalone --nproc-per-node 2 benchmarks/dpp.py --microbatches 8 --out benchmarks/results/schedules/dpp_m8.json
    torchrun --standalone --nproc-per-node 2 benchmarks/dpp.py --cpu --out benchmarks/results/schedules/dpp_cpu.json
    torchrun --standalone --nproc-per-node 2 benchmarks/dpp.py --cpu-dry-run --out /tmp/dpp.json   # plumbing check

One launch builds one PP × VPP2 model, one pipeline stage per process (``--nproc-per-node 4``: PP4 × VPP2; GPT
1.3B: 24 × 2048, seq 2048, micro-batch 4, bf16) and then runs every case in turn, round after round (GPU timings
drift between launches; alternating in one launch keeps the comparison fair). A *case* is a schedule and a condition:

* schedules: ``interleaved`` (megatron-core over NCCL, the baseline), ``dpp`` with ``static`` (megatron-core's
  order over the tagged ``shm`` transport with CUDA IPC) and ``adaptive`` with 0, 2 or 4 extra activations;
* conditions: ``clean``; ``jitter-0.5F`` and ``jitter-1F`` (every message delayed by an exponential time of mean
  one half / one forward time, drawn inside the transport from a seed, so every schedule meets the same
  delays); ``spike`` (10% of messages 50 ms late); ``slow-stage`` (rank 1's compute 1.2× slower: a control
  that reordering cannot fix).

Link delays live in the transport, so they apply to the ``dpp`` schedules only; megatron-core's NCCL p2p has no
such hook, and ``static`` is its order over the delayed transport (``static`` vs ``interleaved`` when clean is the
transport's own cost). A step is ``strategy.forward_backward`` (forward, backward, gradient finalization),
without the optimizer update, which no schedule changes. Each case reports the median step time, its ratio to
the baseline, peak GPU memory, and the simulator's prediction from the measured forward and backward times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_1_3B = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=50257)
MODEL_TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512)
MODEL_CPU = dict(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=512)


def cases(forward_s: float) -> list[dict[str, Any]]:
    """Every (schedule, options, condition); delays scale with the measured forward time."""
    conditions: dict[str, dict[str, Any]] = {
        "clean": {},
        "jitter-0.5F": {"link_delay": {"kind": "exponential", "mean_s": 0.5 * forward_s}},
        "jitter-1F": {"link_delay": {"kind": "exponential", "mean_s": forward_s}},
        "spike": {"link_delay": {"kind": "spike", "mean_s": 0.05, "probability": 0.1}},
        "slow-stage": {"slow_rank": 1, "factor": 1.2},
    }
    out = []
    for condition, setting in conditions.items():
        schedules: list[tuple[str, dict[str, Any]]] = []
        if "link_delay" not in setting:
            schedules.append(("interleaved", {}))
        schedules.append(("dpp", {"policy": "static"}))
        for extra in (0, 2, 4):
            schedules.append(("dpp", {"policy": "adaptive", "extra_activations": extra}))
        for schedule, options in schedules:
            name = schedule if schedule == "interleaved" else f"{options['policy']}"
            if options.get("policy") == "adaptive":
                name += f"+{options['extra_activations']}"
            out.append(dict(name=name, condition=condition, schedule=schedule, options=options, **setting))
    return out


def cpu_peak_gib(step: Any) -> float:
    """The most memory (GiB) the CPU allocator held at once during ``step()``, above what it held before: every
    allocation and free the profiler records, summed in time order (CPUs have no ``max_memory_allocated``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    held = peak = 0
    for _, delta in sorted(
        (e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage
    ):
        held += delta
        peak = max(peak, held)
    return peak / 2**30


def worker(
    args: argparse.Namespace,
    make_cases: Any = None,
    virtual: Optional[int] = 2,
    calibrate: bool = True,
    extra_report: Any = None,
) -> None:
    """Build the model once and run every case of ``make_cases(forward_s)`` in alternating rounds (see the module
    docstring). ``virtual``: virtual stages (None: plain PP2). ``extra_report(rows, timings)``: more JSON fields."""
    import lightning.pytorch as pl
    import torch

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.layers.wgrad import split_linears
    from lightning_megatron.models import GPTModule
    from lightning_megatron.pipeline import Schedule, get_schedule
    from lightning_megatron.scan.evaluation.inject import SlowdownInjector

    on_cpu = args.cpu_dry_run or args.cpu
    shape = MODEL_TINY if args.cpu_dry_run else MODEL_CPU if args.cpu else MODEL_1_3B
    stages = int(os.environ.get("WORLD_SIZE", 2))  # pipeline parallelism alone: one stage per process
    chunks_needed = stages * (virtual or 1)
    if shape["num_layers"] % chunks_needed:  # the tiny dry-run model at PP4 x VPP2: one layer per chunk
        if not args.cpu_dry_run:
            raise SystemExit(f"{shape['num_layers']} layers do not split into {stages} stages x {virtual or 1} chunks")
        shape = dict(shape, num_layers=chunks_needed)
    micro_batch = 2 if on_cpu else 4
    on_gpu = torch.cuda.is_available() and not on_cpu
    if on_cpu:
        torch.set_num_threads(1)  # two ranks on a 2-core machine: one core each
    rank = int(os.environ.get("RANK", 0))
    results: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    timings: dict[str, float] = {}
    losses: dict[str, float] = {}  # no optimizer update between cases: every schedule must give the same loss

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    class Bench(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            strategy = trainer.strategy
            batch = strategy.batch_to_device(next(iter(trainer.datamodule.train_dataloader())))

            def run_case(case: dict[str, Any], steps: int, seed: int = 0) -> list[float]:
                options = dict(case["options"])
                if "link_delay" in case:  # one seed per round: every schedule meets the same draws
                    options["link_delay"] = {**case["link_delay"], "seed": seed}
                injector = None
                if "slow_rank" in case:
                    injector = SlowdownInjector([case["slow_rank"]], case["factor"])
                    injector.setup(trainer, pl_module, "fit")
                if type(get_schedule(case["schedule"])).parse_options is not Schedule.parse_options:  # takes options
                    options = {"transport": "shm", **options}
                # gradient_accumulation_fusion for this case only (what the strategy's argument installs)
                fused = split_linears(strategy.wrapped_chunks) if case.get("fused_wgrad") else None
                times = []
                try:
                    with strategy.using_schedule(case["schedule"], options or None) as session:
                        for _ in range(steps):
                            sync()
                            start = time.perf_counter()
                            out = strategy.forward_backward(batch)
                            sync()
                            times.append(time.perf_counter() - start)
                            key = f"{case['condition']}/{case.get('name', 'calibration')}"
                            losses.setdefault(key, float(out.loss))
                        learned = getattr(session, "policy", None)
                        if getattr(learned, "forward_s", None):
                            timings["forward_s"] = learned.forward_s
                            timings["backward_s"] = learned.backward_s
                finally:
                    if fused is not None:
                        fused.restore()
                    if injector is not None:
                        injector.teardown(trainer, pl_module, "fit")
                return times

            # Calibrate: the forward and backward time of one chunk-microbatch, learned by the adaptive policy.
            if calibrate:
                run_case(dict(schedule="dpp", options={"policy": "adaptive"}, condition="clean"), args.warmup + 2)
            forward_s = torch.tensor(
                [timings.get("forward_s", 0.0), timings.get("backward_s", 0.0)], device=strategy.root_device
            )
            torch.distributed.all_reduce(forward_s, op=torch.distributed.ReduceOp.MAX)
            timings["forward_s"], timings["backward_s"] = float(forward_s[0]), float(forward_s[1])
            plan = (make_cases or cases)(timings["forward_s"])
            order = list(range(len(plan)))
            for round_ in range(args.rounds):
                for i in order if round_ % 2 == 0 else reversed(order):  # alternate, and reverse every round
                    case = plan[i]
                    key = f"{case['condition']}/{case['name']}"
                    if on_gpu:
                        torch.cuda.reset_peak_memory_stats()
                    times = run_case(case, args.warmup + args.steps, seed=round_)
                    results.setdefault(key, []).extend(times[args.warmup :])
                    if on_gpu:
                        peaks[key] = max(peaks.get(key, 0.0), torch.cuda.max_memory_allocated() / 2**30)
                    else:  # CPUs: the allocator's peak during one more (untimed) step, from the profiler
                        peaks[key] = max(
                            peaks.get(key, 0.0), cpu_peak_gib(lambda c=case, r=round_: run_case(c, 1, seed=r))
                        )
                    if rank == 0:
                        print(f"round {round_} {key}: {statistics.median(times[args.warmup :]):.4f} s", flush=True)
            self.plan = plan
            # every rank's peak: a schedule can move memory from one pipeline rank to another
            everyone: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, peaks)
            self.peaks_per_rank = {key: [p.get(key, 0.0) for p in everyone] for key in peaks}
            trainer.should_stop = True

    bench = Bench()
    gbs = micro_batch * args.microbatches
    trainer = pl.Trainer(
        accelerator="cpu" if on_cpu else "gpu",
        devices=stages,
        precision="32-true" if on_cpu else "bf16-mixed",
        strategy=MegatronAppStrategy(
            pipeline_model_parallel_size=stages,
            virtual_pipeline_model_parallel_size=virtual,
            micro_batch_size=micro_batch,
            timeout=600,
        ),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[bench],
    )
    layer_spec = getattr(args, "layer_spec", None) or "local"
    model = GPTModule(**shape, activation="gelu_tanh", split_invariant_init=False, layer_spec=layer_spec)
    data = SyntheticTokenDataModule(
        vocab_size=shape["vocab_size"], seq_length=shape["seq_length"], global_batch_size=gbs, num_train_samples=gbs * 4
    )
    trainer.fit(model, data)
    if rank != 0:
        return
    report(
        args,
        bench.plan,
        results,
        bench.peaks_per_rank,
        timings,
        losses,
        shape,
        micro_batch,
        virtual,
        extra_report,
        stages,
    )


def report(
    args: argparse.Namespace,
    plan: list[dict[str, Any]],
    results: dict[str, list[float]],
    peaks: dict[str, list[float]],
    timings: dict[str, float],
    losses: dict[str, float],
    shape: dict[str, Any],
    micro_batch: int,
    virtual: Optional[int] = 2,
    extra_report: Any = None,
    stages: int = 2,
) -> None:
    rows = []
    first = plan[0]
    clean_baseline = statistics.median(results[f"{first['condition']}/{first['name']}"])
    for case in plan:
        key = f"{case['condition']}/{case['name']}"
        median = statistics.median(results[key])
        # Under link delays the baseline is megatron-core's order over the same delayed transport (static).
        base_key = f"{case['condition']}/{case.get('baseline', 'interleaved')}"
        if base_key not in results:
            base_key = f"{case['condition']}/static"
        baseline = statistics.median(results[base_key])
        row = {
            "condition": case["condition"],
            "schedule": case["name"],
            "median_step_s": round(median, 5),
            "steps_s": [round(t, 5) for t in results[key]],
            "speedup_vs_baseline": round(baseline / median, 4),
            "baseline": base_key.split("/")[1],
            "speedup_vs_first_case": round(clean_baseline / median, 4),
            "peak_memory_gib": round(max(peaks.get(key, [0.0])), 4),  # the most loaded rank's
            "peak_memory_gib_per_rank": [round(p, 4) for p in peaks.get(key, [])],
            "predicted_step_s": predict(case, timings, args.microbatches, stages, virtual or 1)
            if calibrate_of(case)
            else None,
            "loss": losses.get(key),
        }
        rows.append(row)
    out = {
        "benchmark": "dpp",
        "provenance": provenance(),
        "settings": {
            "model": shape,
            "layer_spec": getattr(args, "layer_spec", None) or "local",
            "micro_batch_size": micro_batch,
            "microbatches": args.microbatches,
            "layout": f"PP{stages}" if virtual is None else f"PP{stages} x VPP{virtual}",
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "warmup_per_round": args.warmup,
            "measured_forward_s": timings.get("forward_s"),
            "measured_backward_s": timings.get("backward_s"),
            "step": "strategy.forward_backward (forward, backward, grad finalization; no optimizer update)",
            "transport": "shm (CUDA IPC on GPUs)",
        },
        "results": rows,
        "same_loss_everywhere": len({r["loss"] for r in rows}) == 1,
        **(extra_report(rows, timings) if extra_report else {}),
    }
    print(f"{'condition':<12} {'schedule':<12} {'median s':>9} {'vs base':>8} {'predicted':>9} {'peak GiB':>8}")
    for r in rows:
        predicted = r["predicted_step_s"]
        print(
            f"{r['condition']:<12} {r['schedule']:<12} {r['median_step_s']:>9.4f} {r['speedup_vs_baseline']:>7.3f}x "
            f"{predicted if predicted is not None else float('nan'):>9.4f} {r['peak_memory_gib']:>8.2f}"
        )
    print(f"every schedule gave the same loss on the same batch: {out['same_loss_everywhere']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


def calibrate_of(case: dict[str, Any]) -> bool:
    """Whether the simulator models the case (DPP policies and megatron-core's order; not the B/W split)."""
    return not case.get("options", {}).get("split_weight_grads") and case["schedule"] in ("dpp", "interleaved")


def predict(
    case: dict[str, Any], timings: dict[str, float], microbatches: int, stages: int, chunks: int, seeds: int = 20
) -> Any:
    """The simulator's median step time for the case, from the measured forward and backward times and the same
    delay model (``delay_for`` of the transport's own spec), over ``seeds`` draws."""
    from functools import partial

    from lightning_megatron.pipeline.dpp.simulate import Scenario, simulate
    from lightning_megatron.transport.delay import LinkDelay, delay_for

    if not timings.get("forward_s") or not timings.get("backward_s"):
        return None
    options = case["options"]
    policy = options.get("policy", "static")  # interleaved is megatron-core's order: the static policy
    steps = []
    for seed in range(seeds):
        delay = None
        if "link_delay" in case:
            delay = partial(delay_for, LinkDelay.coerce({**case["link_delay"], "seed": 1000 + seed}))
        scenario = Scenario(
            pipeline=stages,
            chunks=chunks,
            microbatches=microbatches,
            forward_s=timings["forward_s"],
            backward_s=timings["backward_s"],
            slow_ranks={case["slow_rank"]: case["factor"]} if "slow_rank" in case else None,
            delay=delay,
            extra_activations=options.get("extra_activations", 0),
            seed=seed,
        )
        steps.append(simulate(scenario, policy).step_s)
    return round(statistics.median(steps), 5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per case and round")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per case and round")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU (gloo): checks the plumbing")
    parser.add_argument("--cpu", action="store_true", help="a model big enough on CPU for compute to dominate")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run under torchrun --standalone --nproc-per-node N (N pipeline stages; see the module docstring)")
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
