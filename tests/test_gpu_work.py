"""The GPU tests' helper for scripts run in subprocesses: a failing two-rank fit must show why it failed, not the
NCCL heartbeat noise its surviving rank prints afterwards (how a DP2 failure on 2 x H200 went unexplained)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_work import failure_text, run_script  # noqa: E402

NOISE = "\n".join(
    f'[rank1]:[W1127 19:52:5{i}] ProcessGroupNCCL.cpp:1826] Failed to check the "should dump" flag on TCPStore\n'
    f"frame #{i}: <unknown function> + 0x9cb84 (0x7f116409cb84 in /lib/x86_64-linux-gnu/libc.so.6)"
    for i in range(200)
)


def test_a_traceback_is_found_before_the_noise_that_follows_it() -> None:
    stderr = (
        'warming up\n[rank0]: Traceback (most recent call last):\n[rank0]:   File "fit.py", line 3, in <module>\n'
        "[rank0]:     fit()\n[rank0]: RuntimeError: CUDA error: operation not permitted when stream is capturing\n"
        + NOISE
    )
    shown = failure_text(stderr)
    assert shown.startswith("Traceback (most recent call last):"), shown[:200]
    assert shown.endswith("RuntimeError: CUDA error: operation not permitted when stream is capturing")
    assert "heartbeat" not in shown and "frame #" not in shown


def test_chained_tracebacks_are_all_kept_and_no_traceback_keeps_the_end() -> None:
    chained = (
        "Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "b.py", line 2\nValueError: bad\n'
    )
    assert failure_text(chained).splitlines()[2] == "KeyError: 'x'"
    assert failure_text(chained).endswith("ValueError: bad")
    assert failure_text("x" * 10_000, limit=100) == "x" * 100


def test_run_script_fails_with_the_scripts_traceback(tmp_path: Path) -> None:
    """The noise comes after the traceback (an exit handler writes it, as a peer's heartbeat would), and is longer
    than what the end of stderr would show."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('[rank1] heartbeat: TCPStore broken pipe\\n' * 500))\n"
        "raise ValueError('the real cause')\n"
    )
    with pytest.raises(AssertionError, match="ValueError: the real cause") as raised:
        run_script(script)
    assert "heartbeat" not in str(raised.value)
