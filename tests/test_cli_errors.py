"""What a person sees from the ``lightning-megatron`` console script.

* A mistake (a missing file, a malformed config or corpus, a layout that does not divide the processes) ends every
  command with exactly one ``error: ...`` line naming the thing, a non-zero exit status and no traceback; on a
  multi-process run the line is printed once. ``LIGHTNING_MEGATRON_DEBUG=1`` / ``--debug`` bring the traceback
  back.
* A first run reads cleanly: ``preprocess``, a short ``fit`` of the tiny recipe (TP2 × PP2 on 4 processes) and
  ``sample`` print no third-party warnings, no advertising tips and no ``Total FLOPs: 0``; the progress bar
  shows the step and the losses.

Each command runs the real console script in a subprocess (about 6 s to start on 2 cores).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gpt-tiny-cpu.yaml"
CORPUS = ROOT / "recipes" / "data" / "kjv.jsonl.gz"
SCRIPT = Path(sys.executable).with_name("lightning-megatron")


def cli(args: list[str], cwd: Path, *, debug: bool = False, timeout: float = 90) -> subprocess.CompletedProcess:
    """Run ``lightning-megatron ARGS`` as a user would: no warning filters of ours in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "LIGHTNING_MEGATRON_DEBUG")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if debug:
        env["LIGHTNING_MEGATRON_DEBUG"] = "1"
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "lightning_megatron.cli"]
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def assert_one_error_line(proc: subprocess.CompletedProcess, *words: str, prefix: str = "error:") -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("mistakes")
    (base / "bad.yaml").write_text("trainer:\n  max_steps: [3\n")
    (base / "bad.jsonl").write_text('{"text": "In the beginning"}\n{"text": oops}\n')
    return base


@pytest.mark.parametrize(
    ("args", "words"),
    [
        pytest.param(["fit", "--config", "missing.yaml"], ["missing.yaml", "does not exist"], id="fit-missing-config"),
        pytest.param(["fit", "--config", "bad.yaml"], ["malformed YAML", "bad.yaml", "line 2"], id="fit-bad-yaml"),
        pytest.param(
            ["fit", "--config", str(RECIPE), "--data.init_args.data_path=nowhere/corpus", "--trainer.devices=1"]
            + [f"--trainer.strategy.init_args.{size}_model_parallel_size=1" for size in ("tensor", "pipeline")],
            ["nowhere/corpus", "preprocess"],
            id="fit-missing-corpus",
        ),
        pytest.param(
            ["preprocess", "--input", "missing.jsonl", "--output-prefix", "out/x", "--tokenizer", "train:300"],
            ["missing.jsonl", "does not exist"],
            id="preprocess-missing-input",
        ),
        pytest.param(
            ["preprocess", "--input", "bad.jsonl", "--output-prefix", "out/x", "--tokenizer", "train:300"],
            ["bad.jsonl:2", "invalid JSON"],
            id="preprocess-bad-jsonl",
        ),
        pytest.param(["sample", "nowhere/last.ckpt"], ["nowhere/last.ckpt", "does not exist"], id="sample-missing"),
        pytest.param(["scope", "serve", "nowhere/last.ckpt"], ["nowhere/last.ckpt", "does not exist"], id="scope"),
        pytest.param(
            ["dpp", "simulate", "--pipeline", "3", "--chunks", "2", "--microbatches", "4", "--seeds", "1"],
            ["microbatches=4", "use 3 or 6"],
            id="dpp-bad-scenario",
        ),
        pytest.param([], ["give a command", "preprocess", "sample"], id="no-command"),
    ],
)
def test_a_mistake_is_one_line(files: Path, args: list[str], words: list[str]) -> None:
    proc = cli(args, cwd=files)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_error_line(proc, *words)


def test_scan_reports_a_missing_trace_directory_in_one_line(files: Path) -> None:
    """MegaScan's commands report their own mistakes (prefixed with the command's name)."""
    proc = cli(["scan", "aggregate", "nowhere", "-o", "merged.json.gz"], cwd=files)
    assert_one_error_line(proc, "nowhere", prefix="megascan aggregate:")


def test_a_layout_that_does_not_divide_the_processes_is_reported_once(files: Path) -> None:
    """TP2 × PP2 on 3 processes: rank 0 reports it, stops the two ranks it launched (which would report it too),
    and nothing hangs."""
    proc = cli(["fit", "--config", str(RECIPE), "--trainer.devices=3"], cwd=files, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = assert_one_error_line(proc, "world size 3", "2 × 2 = 4")
    assert not line.startswith("error: [rank") and "zombies" not in proc.stderr


@pytest.mark.parametrize("how", ["environment", "flag"])
def test_debug_shows_the_traceback(files: Path, how: str) -> None:
    args = ["sample", "nowhere/last.ckpt"]
    proc = cli(args, cwd=files, debug=True) if how == "environment" else cli(["--debug", *args], cwd=files)
    assert proc.returncode != 0
    assert (
        "Traceback" in proc.stderr and "FileNotFoundError: checkpoint nowhere/last.ckpt does not exist" in proc.stderr
    )


def test_bugs_are_not_mistakes(tmp_path: Path) -> None:
    """Only the user's mistakes lose their traceback: a file missing from the installation is a broken install."""
    from lightning_megatron.cli_errors import describe, is_user_error
    from lightning_megatron.errors import MegatronConfigError

    inside = Path(sys.prefix) / "lib" / "gone.py"
    assert not is_user_error(FileNotFoundError(2, "No such file or directory", str(inside)))
    assert not is_user_error(RuntimeError("a bug")) and not is_user_error(KeyError("x"))
    missing = FileNotFoundError(2, "No such file or directory", str(tmp_path / "corpus.jsonl"))
    assert is_user_error(missing) and describe(missing) == f"{tmp_path / 'corpus.jsonl'}: no such file or directory"
    assert is_user_error(MegatronConfigError("`micro_batch_size` must be\n  positive"))
    assert (
        describe(MegatronConfigError("`micro_batch_size` must be\n  positive")) == "`micro_batch_size` must be positive"
    )


# -- a first run -----------------------------------------------------------------------------------------------------

NOISE = [
    re.compile(r"\w+Warning\b"),  # Python warnings (UserWarning: ..., FutureWarning: ...)
    re.compile(r"\.py:\d+: "),  # any warning's location, including Lightning's category-less format
    re.compile(r"Tip:"),
    re.compile(r"Total FLOPs"),
    re.compile(r"v_num"),
    re.compile(r"Epoch \d+/-"),
    re.compile(r"callbacks used to create the checkpoint"),
    re.compile(r"Traceback"),
]


def assert_clean(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    for pattern in NOISE:
        assert not pattern.search(output), f"{pattern.pattern!r} in:\n{output[-4000:]}"
    return output


def test_a_first_run_reads_cleanly(tmp_path: Path) -> None:
    """`make demo`'s three commands, the fit shortened to 4 steps with a validation after 2."""
    prefix = "runs/data/kjv"
    assert_clean(
        cli(
            ["preprocess", "--input", str(CORPUS), "--output-prefix", prefix, "--tokenizer", "train:2048"]
            + ["--append-eod", "--workers", "2"],
            cwd=tmp_path,
            timeout=120,
        )
    )
    fit = assert_clean(
        cli(
            ["fit", "--config", str(RECIPE), "--trainer.max_steps=4", "--trainer.val_check_interval=2"]
            + ["--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1"],
            cwd=tmp_path,
            timeout=180,
        )
    )
    assert re.search(r"GPTModule: [\d.]+ [KM] parameters, TP 2 × PP 2 × DP 1 on 4 processes; per rank: stage 0", fit)
    assert re.search(r"step: 4", fit) and re.search(r"train_loss:\s+\d", fit) and re.search(r"val_loss:\s+\d", fit)
    sample = assert_clean(
        cli(
            ["sample", "runs/gpt-tiny-cpu/checkpoints/last.ckpt", "--prompt", "And God said", "--max-new-tokens", "4"],
            cwd=tmp_path,
        )
    )
    assert "--- And God said" in sample
