"""MegaScope on one GPU: what probes cost per generated token, how fast a token reaches the client, and what
a sampled training step costs.

    python benchmarks/megascope_latency.py --out benchmarks/results/megascope/megascope.json     # GPU, GPT-2-medium shape
    python benchmarks/megascope_latency.py --cpu-dry-run --out /tmp/megascope.json       # plumbing only

Generation (GPT-2-medium shape: 24 layers, hidden 1024, 16 heads, vocab 50257, bf16, KV cache, sdpa
spec, greedy, a batch of 4 prompts of 32-64 tokens, 128 new tokens) — four cases, alternated ``--rounds``
times in one process:

* ``plain``: ``GPTModule.generate``;
* ``off``: the MegaScope engine with nothing requested (no probes, alternatives or attention: no hooks);
* ``default``: the engine through a real ``ScopeServer`` and a Socket.IO client in another process, with the
  default probes (residual stream, attention and MLP outputs of every layer, 64 bins) and 5 alternatives;
* ``all``: every probe point of every layer (64 bins each), every layer's attention rows, top-10
  alternatives, and PCA at the end.

Per case: seconds per generated token (wall time of the generation over new positions), and for the served
cases the token-computed-to-client-received latency (the engine stamps each token event; the client notes
its arrival; same clock), p50/p95. Training: ``MegaScope(interval=2, window=1)`` with the default training
probes (per-token norms of every layer's residual, attention and MLP outputs) on the same model shape,
every other step sampled; median sampled / unsampled step time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT2_MEDIUM = dict(vocab_size=50257, seq_length=1024, num_layers=24, hidden_size=1024, num_attention_heads=16)
CPU_MODEL = dict(vocab_size=256, seq_length=128, num_layers=4, hidden_size=64, num_attention_heads=4)


class Tokens:
    """Ids as text (the benchmark needs no trained tokenizer): prompts are given as space-separated ids."""

    def __init__(self, vocab: int) -> None:
        self.vocab_size, self.eod_id = vocab, 0

    def encode(self, text: str) -> list[int]:
        return [int(t) % self.vocab_size for t in text.split()]

    def decode(self, ids: Any) -> str:
        return " ".join(str(i) for i in ids)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _build(model: dict[str, Any], gpu: bool) -> Any:
    from lightning_megatron.models import GPTModule
    from lightning_megatron.models.loading import prepare

    module = GPTModule(**model, layer_spec="sdpa")
    prepare(module, accelerator="gpu" if gpu else "cpu", precision="bf16-mixed" if gpu else "32-true")
    return module


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _client(url: str, commands: Any, answers: Any) -> None:
    """A client in its own process, as a browser is (its decoding must not compete with the model for the GIL):
    runs each generate request it is given to its finish event and answers with the token-to-client
    latencies (the engine stamps each token event with the time the token was decided; same machine, same clock)."""
    from lightning_megatron.scope.client import ScopeClient

    with ScopeClient(url) as client:
        while (request := commands.get()) is not None:
            client.send(request)
            received = [(time.time(), event) for event in client.events()]
            answers.put(
                {
                    "latency_ms": [1e3 * (t - e["t"]) for t, e in received if e.get("type") == "token"],
                    "events": len(received),
                    "errors": [e for _, e in received if e.get("type") == "error"],
                }
            )


def generation(model: dict[str, Any], gpu: bool, rounds: int, new_tokens: int) -> dict[str, Any]:
    import random

    from lightning_megatron.scope.engine import DEFAULT_PROBES, ScopeEngine
    from lightning_megatron.scope.server import ScopeServer

    module = _build(model, gpu)
    layers = model["num_layers"]
    rng = random.Random(0)
    prompts = [" ".join(str(rng.randrange(model["vocab_size"])) for _ in range(n)) for n in (32, 40, 56, 64)]
    ids = [Tokens(model["vocab_size"]).encode(p) for p in prompts]
    engine = ScopeEngine(module, Tokens(model["vocab_size"]))
    base = {"prompts": prompts, "max_new_tokens": new_tokens, "temperature": 0}
    requests = {
        "off": {**base, "probes": [], "alternatives": 0},
        "default": {**base, "probes": list(DEFAULT_PROBES), "alternatives": 5},
        "all": {
            **base,
            "probes": [{"name": "*", "reduce": [{"kind": "downsample", "axis": -1, "bins": 64}]}],
            "attention": {"layers": list(range(layers))},
            "alternatives": 10,
            "pca": True,
        },
    }
    positions = max(len(p) for p in ids) + new_tokens - min(len(p) for p in ids)  # forwards after the prefill
    server = ScopeServer(engine, max_queue=1 << 16).start()
    # The client is another process, as a browser is: its decoding must not compete with the model for the GIL.
    ctx = multiprocessing.get_context("spawn")
    commands, answers = ctx.Queue(), ctx.Queue()
    client = ctx.Process(target=_client, args=(server.url, commands, answers), daemon=True)
    client.start()
    results: dict[str, Any] = {
        name: {"s_per_token": [], "latency_ms": [], "events": [], "scope_share": []} for name in ("plain", *requests)
    }
    for round_index in range(rounds + 1):  # round 0 warms up every path (compilation, allocator, caches)
        for name in ("plain", "off", "default", "all"):
            print(f"generation round {round_index}: {name}", flush=True)
            _sync()
            start = time.perf_counter()
            if name == "plain":
                module.generate(ids, new_tokens, temperature=0)
            elif name == "off":
                engine.generate({**requests["off"], "id": "off"}, lambda event: None, lambda: False)
            else:
                commands.put({"v": 1, "type": "generate", "id": f"{name}{round_index}", **requests[name]})
                answer = answers.get(timeout=600)
                if answer["errors"]:
                    raise RuntimeError(f"{name}: {answer['errors'][0]}")
            _sync()
            elapsed = time.perf_counter() - start
            if round_index:
                results[name]["s_per_token"].append(elapsed / positions)
                if name != "plain":
                    results[name]["scope_share"].append(
                        engine.last_stats["scope_seconds"] / engine.last_stats["seconds"]
                    )
                if name in ("default", "all"):
                    results[name]["latency_ms"] += answer["latency_ms"]
                    results[name]["events"].append(answer["events"])
    commands.put(None)
    client.join(30)
    server.stop()
    summary: dict[str, Any] = {"positions_per_generation": positions, "prompts": [len(p) for p in ids], "cases": {}}
    plain = statistics.median(results["plain"]["s_per_token"])
    for name, r in results.items():
        med = statistics.median(r["s_per_token"])
        # each round ran every case back to back: the median of per-round ratios cancels drift between rounds
        paired = statistics.median(a / b for a, b in zip(r["s_per_token"], results["plain"]["s_per_token"]))
        case = {
            "ms_per_token_median": 1e3 * med,
            "ratio_to_plain": med / plain,
            "paired_ratio_median": paired,
            "ms_per_token_runs": [1e3 * s for s in r["s_per_token"]],
        }
        if r["scope_share"]:
            # the time spent inside MegaScope's per-token callback (flush, events), as a share of the generation:
            # the cost itself, free of the run-to-run noise of a launch-bound decode loop
            case["scope_time_share_median"] = statistics.median(r["scope_share"])
        if r["latency_ms"]:
            case.update(
                token_to_client_ms_p50=_percentile(r["latency_ms"], 0.5),
                token_to_client_ms_p95=_percentile(r["latency_ms"], 0.95),
                token_to_client_samples=len(r["latency_ms"]),
                events_per_generation=statistics.median(r["events"]),
            )
        summary["cases"][name] = case
    return summary


def training(model: dict[str, Any], gpu: bool, steps: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule
    from lightning_megatron.scope.callback import MegaScope

    times: dict[int, float] = {}

    class StepTimer(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            _sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            _sync()
            times[trainer.global_step - 1] = time.perf_counter() - self.start

    scope = MegaScope(interval=2, window=1, start_step=0, serve=False)
    micro, batch = (4, 8) if gpu else (2, 4)
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        strategy=MegatronAppStrategy(micro_batch_size=micro),
        precision="bf16-mixed" if gpu else "32-true",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[scope, StepTimer()],
    )
    data = SyntheticTokenDataModule(
        vocab_size=model["vocab_size"],
        seq_length=model["seq_length"],
        global_batch_size=batch,
        num_train_samples=batch * steps,
    )
    trainer.fit(GPTModule(**model, layer_spec="sdpa"), data)
    warm = {s: t for s, t in times.items() if s >= 4}  # the first steps compile and allocate
    sampled = [t for s, t in warm.items() if scope.is_sampled(s)]
    plain = [t for s, t in warm.items() if not scope.is_sampled(s)]
    del trainer
    torch.cuda.empty_cache() if gpu else None
    return {
        "batch": batch,
        "micro_batch": micro,
        "steps": steps,
        "sampled_step_ms_median": 1e3 * statistics.median(sampled),
        "unsampled_step_ms_median": 1e3 * statistics.median(plain),
        "sampled_over_unsampled": statistics.median(sampled) / statistics.median(plain),
        "step_ms": {str(s): 1e3 * t for s, t in sorted(times.items())},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/megascope/megascope.json")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the four generation cases")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-steps", type=int, default=24)
    parser.add_argument("--only", nargs="*", default=["generation", "training"])
    parser.add_argument("--hang-seconds", type=float, default=540, help="print every thread's stack and exit then")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU: checks the plumbing only")
    args = parser.parse_args()
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)  # a hung run says where it hung

    gpu = torch.cuda.is_available() and not args.cpu_dry_run
    if not gpu and not args.cpu_dry_run:
        parser.error("no GPU here: use --cpu-dry-run to check the plumbing")
    model = GPT2_MEDIUM if gpu else CPU_MODEL
    out: dict[str, Any] = {
        "what": "MegaScope per-token cost, token-to-client latency and sampled training step cost (one GPU)",
        **provenance(),
        "model": model,
        "targets": {
            "off_ratio_max": 1.01,
            "default_token_to_client_p50_ms_max": 100,
            "default_token_to_client_p95_ms_max": 250,
        },
    }
    if "generation" in args.only:
        out["generation"] = generation(model, gpu, args.rounds, args.new_tokens if gpu else 8)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    if "training" in args.only:
        out["training"] = training(model, gpu, args.train_steps if gpu else 8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k in ("generation", "training")}, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
