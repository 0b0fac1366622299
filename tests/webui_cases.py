"""What the browser tests (``test_webui.py``) run in subprocesses, so the pytest process never holds a
model, a process group or a server thread (other test modules fork ranks from it):

* ``prepare OUT``: a byte-level BPE tokenizer trained on a slice of the KJV corpus and a 2-step CPU fit of
  a tiny GPT through ``lightning-megatron fit`` (a checkpoint with its config.yaml), for ``scope serve``;
* ``fit-live``: a CPU fit followed by the ``MegaScope`` callback (serve=True, start_paused=True, port 0);
  it prints ``MegaScope: following the run at URL``;
* ``replay``: a GPT-2-medium-shaped generation stream (24 layers, 16 heads, hidden 1024, 1,024 positions;
  the page's default probes: residual / attention out / MLP out of every layer at 64 bins; top-5
  alternatives; attention rows of the layers the page asks for) synthesised from the schema's event shapes
  and served by the real ``ScopeServer`` at a fixed rate (``--rate`` positions per second). It prints
  ``MegaScope replay at URL``. Every event it emits is valid under the protocol schema (``stream_events``
  is checked by ``test_replay_stream_follows_the_schema``).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
from trainers import quiet_trainer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "recipes" / "data" / "kjv.jsonl.gz"

# -- a GPT-2-medium-shaped stream -------------------------------------------------------------------------
ATTENTION_ROWS = 64
GPT2_MEDIUM = {
    "num_layers": 24,
    "hidden_size": 1024,
    "num_heads": 16,
    "num_query_groups": 16,
    "ffn_hidden_size": 4096,
    "vocab_size": 50257,
    "max_seq_length": 1024,
}
PER_LAYER_SITES = [
    "hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_pattern", "attn.hook_z",
    "hook_attn_out", "hook_resid_mid", "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
    "attn.W_QKV", "attn.W_O", "mlp.W_in", "mlp.W_out",
]  # fmt: skip
WORDS = (
    " the model| attention| of| layer| residual| stream| and| a| token|,|.| is| in| to| probe| we| see| that|"
    " heads| MLP| output| perturbation| noise| loss| training| step| bit| flip| GPU| parallel"
).split("|")


def default_probes() -> list[dict[str, Any]]:
    from lightning_megatron.scope.engine import DEFAULT_PROBES

    return [dict(p) for p in DEFAULT_PROBES]


def replay_info(probes: list[dict[str, Any]]) -> dict[str, Any]:
    names = ["hook_embed"] + [f"blocks.{layer}.{site}" for layer in range(24) for site in PER_LAYER_SITES]
    return {
        "mode": "generate",
        "model": dict(GPT2_MEDIUM),
        "layout": {"tensor": 1, "pipeline": 1, "virtual_pipeline": 1, "sequence_parallel": False},
        "probes": names + ["ln_final.hook_normalized", "hook_logits"],
        "default_probes": probes,
        "perturbation_kinds": ["gaussian", "uniform", "bitflip", "zero", "stuck"],
        "perturbation_groups": {
            "storage": ["attn.W_QKV"],
            "calculation": ["hook_attn_out"],
            "system": ["hook_resid_post"],
        },
        "limits": {"max_prompts": 8, "max_new_tokens": 1024, "max_probes": 64, "max_perturbations": 16},
    }


def _layers_of(pattern: str) -> list[tuple[int, str]]:
    """blocks.*.site (or blocks.N.site) → [(layer, name)]."""
    parts = pattern.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks":
        layers = range(24) if parts[1] == "*" else [int(parts[1])] if parts[1].isdigit() else []
        return [(layer, f"blocks.{layer}.{parts[2]}") for layer in layers]
    return []


def _bins(probe: dict[str, Any]) -> int:
    for reducer in probe.get("reduce", []):
        if reducer.get("kind") == "downsample":
            return min(int(reducer["bins"]), GPT2_MEDIUM["hidden_size"])
    return 64


def stream_events(request: dict[str, Any], seed: int = 0) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """The events of one generation, grouped by decode step: yields (step, events) with step 0 the prefill
    (start, the first token, every probe and attention row of the prompt) and step i the i-th new position;
    the last group holds the PCA per layer and finish. Arrays are numpy (the server encodes them)."""
    from lightning_megatron.scope.protocol import Array

    rng = np.random.default_rng(seed)
    prompts = list(request["prompts"])
    batch = len(prompts)
    new = int(request.get("max_new_tokens", 32))
    total = GPT2_MEDIUM["max_seq_length"]
    prompt_len = max(1, total - new)
    heads = GPT2_MEDIUM["num_heads"]
    rid = request["id"]
    probes = request.get("probes")
    probes = default_probes() if probes is None else probes
    chains = [(name, _bins(p)) for p in probes for _, name in _layers_of(p["name"])]
    attention_layers = list((request.get("attention") or {}).get("layers", []))
    alternatives = int(request.get("alternatives", 5))
    scale = {name: 0.5 + 0.1 * int(name.split(".")[1]) for name, _ in chains}
    profile = {
        name: rng.standard_normal(bins, dtype=np.float32) * rng.choice([0.3, 1.0, 3.0], bins) for name, bins in chains
    }
    token_ids = rng.integers(0, len(WORDS), size=(batch, total))

    def token_event(position: int) -> dict[str, Any]:
        rows, alts = [], []
        for b in range(batch):
            logits = rng.standard_normal(alternatives + 3) * 2.0
            probs = np.sort(np.exp(logits) / np.exp(logits).sum() * 0.9)[::-1][:alternatives]
            ids = [int(token_ids[b, position])] + [int(i) for i in rng.integers(0, len(WORDS), alternatives - 1)]
            alts.append([{"id": i, "text": WORDS[i], "p": float(p)} for i, p in zip(ids, probs)])
            rows.append({"id": ids[0], "text": WORDS[ids[0]], "in_prompt": False, "done": False})
        return {
            "type": "token",
            "id": rid,
            "t": time.time(),
            "position": position,
            "tokens": rows,
            "alternatives": alts,
        }

    def positions(start: int, end: int) -> list[dict[str, Any]]:
        n = end - start
        events = []
        for layer in attention_layers:
            # Rows in chunks of ATTENTION_ROWS queries, uint8 in [0, 1] (what engine.py should send; see
            # the module docstring): peaked rows summing to 1 over the keys each query may see.
            for lo in range(start, end, ATTENTION_ROWS):
                hi = min(end, lo + ATTENTION_ROWS)
                # softmax rows shaped like a trained model's: a sink at key 0, the last few tokens, a few
                # keys a head keeps returning to, the rest faint
                queries = np.arange(lo, hi)[:, None]
                keys = np.arange(hi)[None, :]
                distance = queries - keys
                logits = rng.standard_normal((batch, heads, hi - lo, hi), dtype=np.float32)
                logits += np.where(keys == 0, 5.0, 0.0) + np.where(
                    (distance >= 0) & (distance < 4), 4.0 - distance, 0.0
                )
                logits += np.where(keys % (7 + 3 * np.arange(heads))[:, None, None] == 0, 2.5, 0.0)[None]
                logits = np.where(distance >= 0, logits, -np.inf)
                weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
                weights /= weights.sum(axis=-1, keepdims=True)
                data = Array(weights, "uint8", low=0.0, high=1.0)
                events.append(
                    {
                        "type": "attention",
                        "id": rid,
                        "layer": layer,
                        "start": lo,
                        "end": hi,
                        "heads": None,
                        "data": data,
                    }
                )
        for name, bins in chains:
            # activations have structure: a fixed profile per layer and site (outlier features are stripes
            # along the positions), token-to-token variation around it, and a few spikes
            data = profile[name][None, None, :bins] + rng.standard_normal((batch, n, bins), dtype=np.float32) * 0.15
            data *= scale[name]
            data[rng.random(data.shape) < 0.002] *= 8
            layer = int(name.split(".")[1])
            events.append(
                {"type": "probe", "id": rid, "name": name, "layer": layer, "start": start, "end": end, "data": data}
            )
        return events

    start = {
        "type": "start",
        "id": rid,
        "prompts": [
            {"ids": token_ids[b, :prompt_len].astype(np.int32), "tokens": [WORDS[i] for i in token_ids[b, :prompt_len]]}
            for b in range(batch)
        ],
        "num_layers": GPT2_MEDIUM["num_layers"],
        "perturbations": [],
    }
    yield 0, [start, token_event(prompt_len), *positions(0, prompt_len)]
    for step, position in enumerate(range(prompt_len + 1, prompt_len + new), start=1):
        yield step, [token_event(position), *positions(position - 1, position)]
    last: list[dict[str, Any]] = []
    if request.get("pca"):
        end = prompt_len + new
        for layer in range(GPT2_MEDIUM["num_layers"]):
            coords = np.cumsum(rng.standard_normal((batch, end, 2), dtype=np.float32), axis=1)
            last.append({"type": "pca", "id": rid, "layer": layer, "coords": coords})
    last.append({"type": "finish", "id": rid, "texts": prompts, "reasons": ["length"] * batch})
    yield new, last


class ReplayEngine:
    """A ``scope.protocol.Engine`` that streams ``stream_events`` at ``rate`` positions per second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.perturbations: list[dict[str, Any]] = []
        self.stats: dict[str, Any] = {}

    def describe(self) -> dict[str, Any]:
        return {**replay_info(default_probes()), "perturbations": self.perturbations}

    def set_perturbations(self, perturbations: list[dict[str, Any]]) -> None:
        self.perturbations = [p for p in perturbations if p.get("enabled", True)]

    def control(self, request: dict[str, Any]) -> None:
        from lightning_megatron.errors import MegatronConfigError

        raise MegatronConfigError("a replay does not train")

    def generate(self, request: dict[str, Any], emit: Callable[[dict], None], cancelled: Callable[[], bool]) -> None:
        groups = list(stream_events(request))  # recorded first: the replay's clock measures delivery only
        began = time.monotonic()
        count = 0
        late = 0.0
        for step, events in groups:
            due = began + step / self.rate
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            else:
                late = max(late, -wait)
            if cancelled() and events[-1]["type"] != "finish":
                emit(
                    {
                        "type": "finish",
                        "id": request["id"],
                        "texts": request["prompts"],
                        "reasons": ["callback"] * len(request["prompts"]),
                    }
                )
                return
            for event in events:
                if event["type"] == "token":
                    event["t"] = time.time()
                emit(event)
                count += 1
        seconds = time.monotonic() - began
        print(
            json.dumps({"replay": {"events": count, "seconds": round(seconds, 3), "max_late_s": round(late, 3)}}),
            flush=True,
        )


def serve_replay(rate: float) -> None:
    from lightning_megatron.scope.server import ScopeServer

    # On a small CI machine the replay server and the browser share the cores: what is measured is the page,
    # so the browser gets the cores first (the server stays on time: it sleeps most of each 50 ms step).
    os.nice(5)
    static = os.environ.get("LM_WEBUI_STATIC")  # another bundle (e.g. an unminified build to profile)
    server = ScopeServer(ReplayEngine(rate), port=0, max_queue=100_000, static_dir=static or None)
    server.start()
    print(f"MegaScope replay at {server.url}", flush=True)
    _wait_for_stdin_close()
    server.stop()


# -- a checkpoint for `scope serve` --------------------------------------------------------------------------
TINY_MODEL = {"vocab_size": 512, "seq_length": 128, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
TINY_MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 96, "add_bias_linear": False}
"""``prepare --moe``: the tiny GPT with 4 experts (top-2) in both layers, for the router views (no linear biases:
megatron-core 0.16.1's expert MLP adds its bias in place to a tensor-parallel output, which autograd refuses)."""


def prepare(out: Path, moe: bool = False) -> None:
    """A tokenizer and a 2-step checkpoint of a tiny GPT under ``out`` (tokenizer.json, ckpt/last.ckpt); ``moe``:
    with mixture-of-experts layers (``TINY_MOE``)."""
    import yaml

    from lightning_megatron.cli import main as cli
    from lightning_megatron.data.tokenizers import train_bpe_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(CORPUS, "rt") as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 2000)]
    tokenizer = train_bpe_tokenizer(texts, TINY_MODEL["vocab_size"], out / "tokenizer.json")
    assert tokenizer.vocab_size <= TINY_MODEL["vocab_size"], tokenizer.vocab_size
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "strategy": {"class_path": "lightning_megatron.MegatronAppStrategy", "init_args": {"micro_batch_size": 2}},
            "max_steps": 2,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(out),
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(out / "ckpt"), "save_last": True},
                }
            ],
        },
        "model": {
            "class_path": "lightning_megatron.models.GPTModule",
            "init_args": {**TINY_MODEL, **(TINY_MOE if moe else {})},
        },
        "data": {
            "class_path": "SyntheticTokenDataModule",
            "init_args": {
                "vocab_size": TINY_MODEL["vocab_size"],
                "seq_length": TINY_MODEL["seq_length"],
                "global_batch_size": 4,
            },
        },
    }
    path = out / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    code = cli(["fit", "--config", str(path)])
    if code not in (None, 0):
        raise SystemExit(code)
    print(f"prepared {out / 'ckpt' / 'last.ckpt'}", flush=True)


# -- a live training run ----------------------------------------------------------------------------------------
def fit_live(steps: int) -> None:
    """A CPU fit followed by MegaScope on a free port, paused at the start."""

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data.synthetic import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule
    from lightning_megatron.scope.callback import MegaScope

    torch_threads()
    scope = MegaScope(serve=True, start_paused=True, port=0, interval=1, command_timeout=0.2)
    trainer = quiet_trainer(strategy=MegatronAppStrategy(micro_batch_size=2), max_steps=steps, callbacks=[scope])
    module = GPTModule(vocab_size=256, seq_length=32, num_layers=2, hidden_size=64, num_attention_heads=4, lr=3e-3)
    data = SyntheticTokenDataModule(vocab_size=256, seq_length=32, global_batch_size=4, num_train_samples=100_000)
    trainer.fit(module, data)
    print(f"fit ended at step {trainer.global_step}", flush=True)


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)


def _wait_for_stdin_close() -> None:
    """Serve until the parent closes our stdin (or dies)."""
    done = threading.Event()

    def watch() -> None:
        try:
            sys.stdin.read()
        finally:
            done.set()

    threading.Thread(target=watch, daemon=True).start()
    done.wait()


def main(argv: Optional[list[str]] = None) -> None:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_command = commands.add_parser("prepare")
    prepare_command.add_argument("out", type=Path)
    prepare_command.add_argument("--moe", action="store_true")
    commands.add_parser("fit-live").add_argument("--steps", type=int, default=400)
    commands.add_parser("replay").add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.out, args.moe)
    elif args.command == "fit-live":
        fit_live(args.steps)
    else:
        serve_replay(args.rate)


if __name__ == "__main__":
    main()


# -- for the tests: a subprocess whose output is read in the background ---------------------------------------
class Background:
    """``python ARGS`` with stdout+stderr collected by a thread; ``wait_for(pattern)`` returns the first match."""

    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> None:
        import subprocess

        self.lines: list[str] = []
        self._cond = threading.Condition()
        full_env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=cwd or ROOT,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120.0) -> Any:
        import re

        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise TimeoutError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-40:]))
                self._cond.wait(min(left, 0.5))

    def join(self, timeout: float) -> int:
        """Wait for the process to end by itself; its exit code."""
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return self.proc.returncode

    def output(self, last: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-last:])

    def stop(self, timeout: float = 15.0) -> int:
        import subprocess

        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # replay servers end when stdin closes
            except OSError:
                pass
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode


# -- how busy the host is, and how much of that is us -----------------------------------------------------------
def _proc_stat(pid: str) -> Optional[tuple[int, int]]:
    """(ppid, utime + stime in clock ticks) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _descendants(root: int) -> dict[int, int]:
    """``root`` and every process below it, each with its CPU time so far (clock ticks)."""
    stats = {int(pid): _proc_stat(pid) for pid in os.listdir("/proc") if pid.isdigit()}
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    found, stack = {}, [root]
    while stack:
        pid = stack.pop()
        stat = stats.get(pid)
        if stat is not None:
            found[pid] = stat[1]
        stack.extend(children.get(pid, []))
    return found


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far: ``host`` (every core's busy time, /proc/stat) and ``ours`` (this process and its
    descendants: the browser, the servers). Two snapshots tell how much of the host's work was foreign."""
    ticks = os.sysconf("SC_CLK_TCK")
    line = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in line]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    host = (sum(values[:8]) - idle) / ticks
    ours = sum(_descendants(os.getpid()).values())
    return {"host": host, "ours": ours / ticks, "time": time.monotonic()}


def foreign_load(before: dict[str, float], after: dict[str, float]) -> float:
    """Average number of cores other processes kept busy between two snapshots."""
    seconds = max(1e-6, after["time"] - before["time"])
    return max(0.0, (after["host"] - before["host"]) - (after["ours"] - before["ours"])) / seconds


class RunQueueWait:
    """How long Chromium's renderer main threads waited for a core, sampled while a replay runs.

    ``/proc/PID/schedstat``'s second field is the time (ns) the process's main thread was runnable but not
    running: on 2 cores, the part of a long frame's wall time that the scheduler, not the page, added (the replay
    server and Chromium's other processes take turns with it). ``start()`` finds this process's renderer
    descendants and samples them every ``interval`` seconds on a thread until ``stop()``; ``waited_ms(pid, lo,
    hi)`` interpolates the wait between two ``time.monotonic()`` instants."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.samples: dict[int, list[tuple[float, float]]] = {}  # pid -> [(monotonic s, cumulative wait ms)]
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def _renderers() -> list[int]:
        found = []
        for pid in _descendants(os.getpid()):
            try:
                if b"--type=renderer" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
        return found

    def start(self) -> None:
        pids = self._renderers()
        self.samples = {pid: [] for pid in pids}

        def sample() -> None:
            while not self._stop.is_set():
                now = time.monotonic()
                for pid in pids:
                    try:
                        waited_ns = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1])
                    except (OSError, IndexError, ValueError):
                        continue
                    self.samples[pid].append((now, waited_ns / 1e6))
                self._stop.wait(self.interval)

        self._stop.clear()
        self._thread = threading.Thread(target=sample, name="run-queue-wait", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def waited_ms(self, pid: int, lo: float, hi: float) -> Optional[float]:
        """The main thread's run-queue wait between monotonic instants ``lo`` and ``hi``; None if not sampled."""
        points = self.samples.get(pid) or []
        if len(points) < 2 or lo < points[0][0] or hi > points[-1][0]:
            return None
        times = [t for t, _ in points]
        values = [v for _, v in points]
        return float(np.interp(hi, times, values) - np.interp(lo, times, values))


def main_thread_cpu(trace_path: Path, mark: str, frames: list[dict[str, Any]]) -> tuple[int, list[float]]:
    """Per long animation frame (``start``/``duration`` in page milliseconds), the CPU time the renderer's main
    thread spent in it, from a Chromium trace (category ``toplevel``: tasks with thread time ``tdur``) that
    holds the performance mark ``mark`` (it maps page time to trace time); and the renderer's pid (the
    trace's, the operating system's on Linux)."""
    data = json.loads(trace_path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    marker = next(e for e in events if e.get("name") == mark and e.get("cat") == "blink.user_timing")
    offset = marker["ts"] - marker["args"]["data"]["startTime"] * 1000.0  # trace µs = page ms * 1000 + offset
    tasks = [
        (e["ts"], e["ts"] + e["dur"], e.get("tdur", e["dur"]))
        for e in events
        if e.get("ph") == "X"
        and e.get("pid") == marker["pid"]
        and e.get("tid") == marker["tid"]
        and e.get("name") in ("ThreadControllerImpl::RunTask", "RunTask")
        and e.get("dur", 0) > 0
    ]
    tasks.sort()
    top: list[tuple[float, float, float]] = []  # drop tasks nested in another (both names may appear)
    for task in tasks:
        if top and task[1] <= top[-1][1]:
            continue
        top.append(task)
    out = []
    for frame in frames:
        lo = frame["start"] * 1000.0 + offset
        hi = lo + frame["duration"] * 1000.0
        cpu = 0.0
        for start, end, thread in top:
            overlap = min(end, hi) - max(start, lo)
            if overlap > 0:
                cpu += thread * overlap / (end - start)
        out.append(cpu / 1000.0)
    return int(marker["pid"]), out
