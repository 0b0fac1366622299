"""Where MegaScan's files land, and that the tools which read them find them.

A run's files go beside its logger's (``<log_dir>/megascan``: rank files, ``megascan-report.json``, Kineto traces
under ``profile/``), the same directory on every rank although only rank 0's logger knows its version number;
an explicit ``trace_dir`` still wins. ``profile_steps`` writes one Kineto trace per rank that torch-tb-profiler,
run for real in a ``tensorboard`` process, lists under the rank's worker name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import scan_files_cases as sc
from distributed import free_port

from lightning_megatron import MegatronConfigError
from lightning_megatron.scan import MegaScan
from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file
from lightning_megatron.scan.analysis.report import DetectionReport

WORKERS = ["rank00000-dp0-pp0-tp0", "rank00001-dp0-pp1-tp0"]


@pytest.fixture(scope="module")
def profiled_run(ranks: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One 2-rank fit with a TensorBoardLogger, the default trace_dir and step 2 profiled (shared: fits cost)."""
    root = tmp_path_factory.mktemp("profiled")
    return root, ranks.run(2, sc.fit_with_logger, str(root), "tensorboard", profile_steps=[2])


def test_files_follow_the_loggers_directory(profiled_run: tuple[Path, list[dict[str, Any]]]) -> None:
    root, result = profiled_run
    # version_0 on every rank: the other ranks' loggers would pick version_1 (rank 0 created version_0 first)
    megascan = root / "runs" / "gpt-tiny-cpu" / "version_0" / "megascan"
    assert [Path(r["trace_dir"]) for r in result] == [megascan, megascan]
    assert sorted(list_rank_files(megascan)) == [0, 1]
    assert not (root / "runs" / "gpt-tiny-cpu" / "version_1").exists()
    report = DetectionReport.from_json((megascan / "megascan-report.json").read_text())
    # step 2 ran under torch.profiler: its step spans say so, and detection left it out
    assert sorted(report.per_rank) == [0, 1] and report.steps == [1, 3]
    for path in list_rank_files(megascan).values():
        marked = {
            e["args"]["step"] for e in read_rank_file(path) if e.get("cat") == "step" and e["args"].get("profiled")
        }
        assert marked == {2}, (path, marked)
    assert not any(r["profiling"] for r in result)  # nothing left running


def test_profiled_steps_leave_one_kineto_trace_per_rank(profiled_run: tuple[Path, list[dict[str, Any]]]) -> None:
    root, _ = profiled_run
    profile = root / "runs" / "gpt-tiny-cpu" / "version_0" / "megascan" / "profile"
    traces = sorted(profile.glob("*.pt.trace.json"))
    assert [path.name.split(".")[0] for path in traces] == WORKERS
    for path in traces:
        steps = {e["name"] for e in json.loads(path.read_text())["traceEvents"] if "ProfilerStep#" in e["name"]}
        assert steps == {"ProfilerStep#2"}, (path, steps)


def test_torch_tb_profiler_lists_every_rank(profiled_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """A real ``tensorboard --logdir runs/`` and its torch-tb-profiler plugin, asked over HTTP as its page does."""
    root, _ = profiled_run
    port = free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    log = tmp_path / "tensorboard.log"
    with open(log, "w") as output:
        server = subprocess.Popen(
            [str(tensorboard), "--logdir", str(root / "runs"), "--host", "127.0.0.1", "--port", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group of its own: see _stop
        )
    try:
        api = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
        runs = _poll(lambda: _loaded_runs(f"{api}/runs"), timeout=75, server=server, log=log)
        assert runs == ["gpt-tiny-cpu/version_0/megascan/profile"], runs
        query = urllib.parse.urlencode({"run": runs[0], "view": "Overview"})
        assert _get(f"{api}/workers?{query}") == WORKERS
        for worker in WORKERS:  # its Overview splits the rank's trace by ProfilerStep#N: the global step
            (span,) = _get(f"{api}/spans?{urllib.parse.urlencode({'run': runs[0], 'worker': worker})}")
            query = urllib.parse.urlencode({"run": runs[0], "worker": worker, "span": span, "view": "Overview"})
            assert [row[0] for row in _get(f"{api}/overview?{query}")["steps"]["rows"]] == ["2"], worker
    finally:
        _stop(server)


def _stop(server: subprocess.Popen) -> None:
    """TensorBoard, then what it started: torch-tb-profiler's cache manager and loaders outlive a killed server,
    so the whole process group made for it goes (SIGTERM first: TensorBoard removes its temporary files)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _loaded_runs(url: str) -> Any:
    answer = _get(url)
    return answer["runs"] if answer["runs"] and not answer["loading"] else None


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _poll(probe: Any, timeout: float, server: subprocess.Popen, log: Path) -> Any:
    """``probe()`` until it answers (not None), the server dies, or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"tensorboard exited ({server.returncode}):\n{log.read_text()[-4000:]}")
        try:
            answer = probe()
        except OSError:  # not listening yet
            answer = None
        if answer is not None:
            return answer
        time.sleep(0.5)
    pytest.fail(f"torch-tb-profiler listed no loaded run in {timeout} s:\n{log.read_text()[-4000:]}")


def test_every_rank_uses_rank_0s_log_dir(ranks: Any, tmp_path: Path) -> None:
    result = ranks.run(2, sc.fit_with_logger, str(tmp_path), "csv", version_per_rank=True)
    megascan = tmp_path / "runs" / "gpt-tiny-cpu" / "seen-by-rank0" / "megascan"
    assert {r["trace_dir"] for r in result} == {str(megascan)}
    assert sorted(list_rank_files(megascan)) == [0, 1]


def test_an_explicit_trace_dir_wins(ranks: Any, tmp_path: Path) -> None:
    result = ranks.run(2, sc.fit_with_logger, str(tmp_path), "csv", trace_dir=str(tmp_path / "mine"))
    assert {r["trace_dir"] for r in result} == {str(tmp_path / "mine")}
    assert sorted(list_rank_files(tmp_path / "mine")) == [0, 1]
    assert (tmp_path / "mine" / "megascan-report.json").is_file()
    assert (tmp_path / "runs" / "gpt-tiny-cpu" / "version_0").is_dir()  # the logger's, without MegaScan's files
    assert not (tmp_path / "runs" / "gpt-tiny-cpu" / "version_0" / "megascan").exists()


def test_profile_steps_must_be_traced_steps() -> None:
    with pytest.raises(MegatronConfigError, match=r"profile_steps=\[3\]\): \[3\] are not traced.*\[1, 2, 6, 7"):
        MegaScan(interval=5, window=2, profile_steps=[3])
    with pytest.raises(MegatronConfigError, match=r"profile_steps=2\): give a list"):
        MegaScan(profile_steps=2)  # type: ignore[arg-type]
    with pytest.raises(MegatronConfigError, match="profile_options"):
        MegaScan(interval=1, window=1, profile_steps=[1], profile_options={"record_shape": True})
    assert MegaScan(interval=1, window=1, profile_steps=[3, 2, 3]).profile_steps == [2, 3]


def test_no_logger_puts_files_under_default_root_dir(ranks: Any, tmp_path: Path) -> None:
    result = ranks.run(2, sc.fit_with_logger, str(tmp_path), None)
    assert {r["trace_dir"] for r in result} == {str(tmp_path / "megascan")}
    assert (tmp_path / "megascan" / "megascan-report.json").is_file()


def test_a_failed_fit_leaves_no_profiler_running(ranks: Any, tmp_path: Path) -> None:
    result = ranks.run(2, sc.fit_failing_while_profiling, str(tmp_path))
    assert all(r["error"] == "failed in step 2" and not r["profiling"] and not r["enabled"] for r in result), result
    traces = sorted((tmp_path / "trace" / "profile").glob("*.pt.trace.json"))  # what was recorded is kept
    assert [path.name.split(".")[0] for path in traces] == WORKERS


def test_profile_steps_beside_lightnings_pytorch_profiler_are_refused(ranks: Any, tmp_path: Path) -> None:
    """Two torch.profiler sessions cannot nest: the clash is named before the fit starts, not deep inside it."""
    messages = ranks.run(2, sc.refusal, str(tmp_path), profile_steps=[2], profiler="pytorch")
    assert all("Trainer(profiler=PyTorchProfiler)" in m and "profile_steps" in m for m in messages), messages


def test_profile_steps_after_max_steps_are_refused(ranks: Any, tmp_path: Path) -> None:
    messages = ranks.run(2, sc.refusal, str(tmp_path), profile_steps=[2, 5])
    assert messages == ["MegaScan(profile_steps=[2, 5]): [5] never run with max_steps=4."] * 2
