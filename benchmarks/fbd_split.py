"""MegaFBD's rank split: forward replicas and backward replicas, vs data-parallel training on the same GPUs.

Run through ``benchmarks/fbd.py --split`` (torchrun, N processes). One model, PP1, ``--tp`` GPUs per replica
(tensor parallelism inside each role), data-parallel size ``DP = N / tp``, of which the last ``--forward-replicas``
(``F``) run forwards and the other ``B = DP − F`` backwards (2 GPUs: 1:1; 4 GPUs: ``--tp 2`` for TP2 in each
role, ``--forward-replicas 1`` or ``3`` for 1:3 and 3:1). Cases alternated in rounds within one launch (median
step time of ``strategy.forward_backward``):

* ``dpN`` — megatron-core's schedule, every GPU trains (DP × M microbatches per step; the baseline);
* ``fbd-recompute`` — the forward replicas run forwards only, the backward replicas recompute and run the
  backwards (B × M per step). At PP1 a forward replica's work feeds nobody (the backward's recompute starts from
  the tokens), so this is the mode's floor: a backward GPU alone does F + B per microbatch;
* ``fbd-ship`` — the forward replicas run each forward with autograd and ship the saved activations; the
  backward replicas replay the graph without its GEMMs and run the backward.

For each rank-split case: throughput relative to ``dpN`` (samples per second), and the session's performance
model (measured parts of the second and third steps, composed) against the measured median: the check is
|error| ≤ 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from dpp import MODEL_1_3B, MODEL_CPU, MODEL_TINY  # noqa: E402  (benchmarks/ is the script's directory)
from provenance import provenance  # noqa: E402


def split_cases(data_parallel: int, forward_replicas: int) -> list[dict[str, Any]]:
    split = {"forward_replicas": forward_replicas}
    return [
        dict(name=f"dp{data_parallel}", schedule="1f1b", options=None),
        dict(name="fbd-recompute", schedule="fbd", options={"mode": "recompute", **split}),
        dict(name="fbd-ship", schedule="fbd", options={"mode": "ship", **split}),
    ]


def split_worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule
    from lightning_megatron.pipeline.fbd.perfmodel import describe

    on_cpu = args.cpu_dry_run or args.cpu
    shape = MODEL_TINY if args.cpu_dry_run else MODEL_CPU if args.cpu else MODEL_1_3B
    micro_batch = 2
    on_gpu = torch.cuda.is_available() and not on_cpu
    if on_cpu:
        torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 2))
    tp = args.tp
    if world % tp or world // tp <= args.forward_replicas:
        raise SystemExit(
            f"{world} processes, --tp {tp}: a data-parallel size of {world / tp:g}, which must be a whole number "
            f"above --forward-replicas {args.forward_replicas}"
        )
    dp = world // tp
    backward = dp - args.forward_replicas
    cases = split_cases(dp, args.forward_replicas)
    baseline = cases[0]["name"]
    results: dict[str, list[float]] = {}
    predictions: dict[str, list[float]] = {}
    models: dict[str, str] = {}
    peaks: dict[str, float] = {}

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    class Bench(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            strategy = trainer.strategy
            batch = strategy.batch_to_device(next(iter(trainer.datamodule.train_dataloader())))

            def run_case(case: dict[str, Any], steps: int) -> list[float]:
                options = None if case["options"] is None else {"transport": "shm", "report": False, **case["options"]}
                times = []
                with strategy.using_schedule(case["schedule"], options) as session:
                    for _ in range(steps):
                        sync()
                        start = time.perf_counter()
                        strategy.forward_backward(batch)
                        sync()
                        times.append(time.perf_counter() - start)
                    prediction = getattr(session, "prediction", None)
                    if prediction is not None:
                        predictions.setdefault(case["name"], []).append(prediction)
                        models[case["name"]] = describe(session.parts, prediction)
                return times

            for round_ in range(args.rounds):
                for case in cases if round_ % 2 == 0 else list(reversed(cases)):
                    if on_gpu:
                        torch.cuda.reset_peak_memory_stats()
                    times = run_case(case, args.warmup + args.steps)
                    results.setdefault(case["name"], []).extend(times[args.warmup :])
                    if on_gpu:
                        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=strategy.root_device)
                        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
                        peaks[case["name"]] = max(peaks.get(case["name"], 0.0), float(peak))
                    if rank == 0:
                        print(
                            f"round {round_} {case['name']}: {statistics.median(times[args.warmup :]):.4f} s",
                            flush=True,
                        )
            trainer.should_stop = True

    gbs = micro_batch * args.microbatches * dp  # each replica's batch holds `microbatches` microbatches
    trainer = pl.Trainer(
        accelerator="cpu" if on_cpu else "gpu",
        devices=world,
        precision="32-true" if on_cpu else "bf16-mixed",
        strategy=MegatronAppStrategy(
            micro_batch_size=micro_batch,
            tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1,
            cuda_graphs=False,  # eager against eager: a rank split's step is not graphed, and the comparison is of schedules
            timeout=600,
        ),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Bench()],
    )
    model = GPTModule(**shape, activation="gelu_tanh", split_invariant_init=False, layer_spec=args.layer_spec)
    data = SyntheticTokenDataModule(
        vocab_size=shape["vocab_size"], seq_length=shape["seq_length"], global_batch_size=gbs, num_train_samples=gbs * 4
    )
    trainer.fit(model, data)
    if rank != 0:
        return
    base = statistics.median(results[baseline])
    rows = []
    for case in cases:
        median = statistics.median(results[case["name"]])
        samples = micro_batch * args.microbatches * (dp if case["name"] == baseline else backward)
        row: dict[str, Any] = {
            "case": case["name"],
            "median_step_s": round(median, 5),
            "steps_s": [round(t, 5) for t in results[case["name"]]],
            "samples_per_s": round(samples / median, 3),
            "throughput_vs_data_parallel": round((samples / median) / (dp * micro_batch * args.microbatches / base), 4),
            "peak_memory_gib": round(peaks.get(case["name"], 0.0), 2),
        }
        if case["name"] in predictions:
            predicted = statistics.median(predictions[case["name"]])
            row["predicted_step_s"] = round(predicted, 5)
            row["prediction_error"] = round((predicted - median) / median, 4)
            row["within_10_percent"] = abs(predicted - median) <= 0.1 * median
            row["performance_model"] = models[case["name"]]
        rows.append(row)
    summary = {
        "benchmark": f"fbd rank split (PP1, TP{tp}, DP{dp}: {args.forward_replicas} forward + {backward} backward "
        f"replica(s)) vs DP{dp}",
        "tensor_parallel": tp,
        "forward_replicas": args.forward_replicas,
        "backward_replicas": backward,
        "model": shape,
        "layer_spec": args.layer_spec,
        "micro_batch_size": micro_batch,
        "microbatches_per_replica": args.microbatches,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "cuda_graphs": False,
        "rows": rows,
        "theory": f"recompute: B/DP = {backward / dp:.3g}x of data-parallel (a backward GPU does F + B per "
        f"microbatch, as a data-parallel one); ship: <= (B/DP)(F+B)/B = {backward / dp * 1.5:.3g}x with B = 2F, if "
        "the forwards, transfers and replays hide (and no more than the forward replicas can feed)",
        **provenance(),
    }
    for row in rows:
        print(
            f"{row['case']:>14}: {row['median_step_s'] * 1e3:9.1f} ms  {row['throughput_vs_data_parallel']:.3f}x "
            f"{baseline}  "
            f"predicted {row.get('predicted_step_s', 0) * 1e3:9.1f} ms ({row.get('prediction_error', 0):+.1%})  "
            f"peak {row['peak_memory_gib']} GiB"
        )
        if "performance_model" in row:
            print(row["performance_model"])
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
