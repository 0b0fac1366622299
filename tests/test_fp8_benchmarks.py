"""The FP8 benchmarks' dry runs on CPUs: ``benchmarks/throughput.py`` with the strategy's ``fp8_recipe`` variant and
the plain PyTorch + torchao peers, and ``benchmarks/fp8_loss_curves.py`` end to end (corpus, fits, JSON, PNG).

The GPU machines are rarely at hand: what would break these scripts there for a reason a CPU also has (a renamed
torchao argument, a runner the worker does not know, a curve the plot cannot draw) breaks here first. Both run
as a user runs them, in subprocesses (``torchrun`` workers and all), with float8 emulated by torchao."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from fp8_loss_curves import compare  # noqa: E402
from throughput import _check_runners, raised_exceptions  # noqa: E402


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(ROOT / "benchmarks" / script), "--cpu-dry-run", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_throughput_dry_run_fp8_strategy_and_peer(tmp_path: Path) -> None:
    """A strategy run with ``fp8_recipe`` and torchao's ``convert_to_float8_training`` peer both measure steps."""
    out = tmp_path / "throughput.json"
    variants = json.dumps({"-fp8": {"strategy_options": {"fp8_recipe": "tensorwise"}}})
    proc = _run(
        "throughput.py",
        *("--out", str(out), "--only", "dry-run-llama/1gpu", "--runners", "strategy-sdpa", "hf-fp8-rowwise"),
        *("--variants", variants, "--baseline", "strategy-sdpa-fp8"),
    )
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert proc.returncode == 0, {run: r.get("raised") for run, r in runs.items()} or proc.stderr[-3000:]
    assert set(runs) == {"dry-run-llama/1gpu/strategy-sdpa-fp8", "dry-run-llama/1gpu/hf-fp8-rowwise"}
    assert runs["dry-run-llama/1gpu/strategy-sdpa-fp8"]["strategy_options"] == {"fp8_recipe": "tensorwise"}
    assert all(r["tokens_per_second"] > 0 for r in runs.values())
    assert set(report["ratios_to_strategy-sdpa-fp8"]) == {"dry-run-llama/1gpu/hf-fp8-rowwise"}


def test_throughput_refuses_unknown_runners() -> None:
    _check_runners(["strategy-sdpa", "mcore-local", "hf", "hf-bf16", "hf-compile", "hf-fp8-tensorwise"])
    for typo in ("hf-fp8-columnwise", "hf-compiled", "stratgy-sdpa"):
        with pytest.raises(SystemExit, match=typo):
            _check_runners([typo])


def test_loss_curves_dry_run(tmp_path: Path) -> None:
    """bf16 and one FP8 recipe, fresh processes each, on the shipped corpus: the JSON holds every step's loss of
    both from the same start, the comparison, and the provenance; the plot is written."""
    out = tmp_path / "curves.json"
    proc = _run("fp8_loss_curves.py", "--recipes", "bf16", "tensorwise", "--out", str(out))
    report = json.loads(out.read_text())
    assert proc.returncode == 0, {r: c.get("raised") for r, c in report["curves"].items()} or proc.stderr[-3000:]
    bf16, fp8 = report["curves"]["bf16"]["loss"], report["curves"]["tensorwise"]["loss"]
    assert len(bf16) == len(fp8) == 5
    assert bf16 != fp8, "the float8 fit gave bf16's losses bit for bit: were its GEMMs float8?"
    # same weights and first batch: the first losses differ only by the float8 forward GEMMs
    assert abs(fp8[0] - bf16[0]) < 1e-2 * bf16[0]
    row = report["comparison_to_bf16"]["tensorwise"]
    assert row["steps_compared"] == 5 and 0.98 < row["final_loss_ratio"] < 1.02
    assert "--cpu-dry-run" in report["command"] and report["device"].startswith("CPU")
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_compare_measures_against_bf16() -> None:
    """The final-loss ratio averages the last steps; the largest divergence is relative to bf16's loss."""
    curves = {
        "bf16": {"loss": [4.0, 3.0, 2.0, 2.0]},
        "tensorwise": {"loss": [4.0, 3.6, 2.2, 2.2]},
        "rowwise": {"loss": [4.0, 3.0]},  # a fit that died: compared over the steps it has
    }
    summary = compare(curves, last=2)
    assert summary["tensorwise"]["final_loss_ratio"] == pytest.approx(1.1)
    assert summary["tensorwise"]["max_relative_difference"] == pytest.approx(0.2)
    assert summary["tensorwise"]["max_relative_difference_step"] == 2
    assert summary["rowwise"]["steps_compared"] == 2 and summary["rowwise"]["final_loss_ratio"] == 1.0
    assert "bf16" not in summary


def test_a_failed_runs_exceptions_are_kept_whatever_their_names() -> None:
    """A worker's exception lines reach the result (dynamo's ``FailOnRecompileLimitHit`` has no "Error" in it);
    torchrun's later lines that merely mention errors do not."""
    log = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "worker.py", line 3, in <module>',
            "[rank0]:     step()",
            "[rank0]: torch._dynamo.exc.FailOnRecompileLimitHit: recompile_limit reached with fullgraph=True",
            "E1129 torch.distributed.elastic.multiprocessing.api: failed (exitcode: 1) ChildFailedError",
        ]
    )
    assert raised_exceptions(log) == [
        "torch._dynamo.exc.FailOnRecompileLimitHit: recompile_limit reached with fullgraph=True"
    ]
