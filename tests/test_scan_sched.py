"""Waits for a CPU (``scan.tracing.sched``, ``scan.analysis.cpu_rules``): the kernel's run-queue delay of the training thread, and the
rule that names a rank ``host`` from it. The rule on recorded fits is in ``tests/test_scan_recorded.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from lightning_megatron.scan.analysis.cpu_rules import cpu_wait_history_suspects, cpu_wait_suspects, merge_cpu_waits
from lightning_megatron.scan.analysis.measure import RankTrace
from lightning_megatron.scan.analysis.report import DetectionReport, RankSummary, Suspect
from lightning_megatron.scan.analysis.rules_common import DetectionContext
from lightning_megatron.scan.analysis.waits import DataWaits
from lightning_megatron.scan.tracing import sched

linux_schedstat = pytest.mark.skipif(sched.RunDelay().read() is None, reason="no /proc/thread-self/schedstat")


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@linux_schedstat
def test_run_delay_counts_time_slices_lost_to_another_process_not_sleep() -> None:
    """On one CPU shared with a spinning process the thread waits for about half the wall time; asleep it waits
    for none. Per thread: a second thread reads its own counter, not the first one's."""
    cpu = min(os.sched_getaffinity(0))
    original = os.sched_getaffinity(0)
    delay = sched.RunDelay()
    os.sched_setaffinity(0, {cpu})
    spinner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nt = time.time()\nwhile time.time() - t < 5: pass",
        ]
    )
    try:
        time.sleep(0.3)
        before = delay.read()
        _busy(0.6)
        contended = delay.read() - before
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(0, original)
    before = delay.read()
    time.sleep(0.3)
    asleep = delay.read() - before
    assert contended > 150_000, contended  # µs of 600 000: a fair share is half
    # asleep it waits only to be woken: a few ms on a loaded 2-core CI machine (5.2 ms once), far from contention's
    assert asleep < 30_000, asleep
    seen: list[object] = []
    worker = threading.Thread(target=lambda: seen.append(delay.read()))
    worker.start()
    worker.join()
    assert isinstance(seen[0], float) and delay._thread == worker.native_id  # reopened for that thread
    delay.close()


def test_run_delay_without_the_kernels_counter_reads_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sched, "_PATH", "/proc/no-such-file")
    delay = sched.RunDelay()
    assert delay.read() is None and delay.read() is None


def _waits(per_rank: dict[int, list[float]]) -> DataWaits:
    return DataWaits(
        {r: list(v) for r, v in per_rank.items()},
        {r: {step: 1e6 * step for step in range(len(v))} for r, v in per_rank.items()},
    )


def _context(traces: dict[int, RankTrace], per_rank: dict[int, RankSummary], waits: DataWaits) -> DetectionContext:
    """What the CPU-wait rules read: these waits, the job's median step of 40 ms (``_job``), ``min_slowdown`` 8%."""
    context = DetectionContext(traces, per_rank, min_slowdown=0.08)
    context.cpu_waits = waits  # measured from these numbers, not from trace files
    return context


def _job(ranks: int) -> tuple[dict[int, RankTrace], dict[int, RankSummary]]:
    traces = {r: RankTrace(rank=r, dp=r) for r in range(ranks)}
    per_rank = {r: RankSummary(rank=r, dp=r, pp=0, tp=0, host="h", steps=12, step_ms=40.0) for r in range(ranks)}
    return traces, per_rank


def test_a_rank_stopped_in_some_steps_by_a_cpu_limit_is_named_host() -> None:
    """A CFS quota stops the process in the periods it overran: 20 ms in 5 of 12 steps of 40 ms (8.3 ms a step,
    21%), the other steps as clean as the peers'. Medians see nothing; the mean and the sign flips do."""
    traces, per_rank = _job(4)
    noise = [30.0, 80.0, 10.0, 55.0, 20.0, 40.0, 70.0, 15.0, 60.0, 25.0, 45.0, 35.0]
    stopped = [20_000.0 if step % 5 in (0, 2) else noise[step] for step in range(12)]
    waits = _waits({0: noise, 1: noise[::-1], 2: stopped, 3: noise[3:] + noise[:3]})
    (suspect,) = cpu_wait_suspects(_context(traces, per_rank, waits))
    assert (suspect.rank, suspect.kind) == (2, "host") and 0.15 < suspect.slowdown < 0.25, suspect
    assert suspect.evidence["hit_steps_fraction"] == pytest.approx(5 / 12, abs=0.01)
    table = DetectionReport(trace_dir="t", suspects=[suspect], per_rank=per_rank).table()
    assert "training thread waited for a CPU 8.36 ms per step" in table and "42% of 12 steps hit" in table, table
    calm = _waits({0: noise, 1: noise[::-1], 2: [x + 500.0 for x in noise], 3: noise})  # 0.5 ms: under the bar
    assert cpu_wait_suspects(_context(traces, per_rank, calm)) == []


def test_one_process_that_loses_its_cpu_during_the_run_is_named_against_its_own_steps() -> None:
    """One process has no other rank: a CPU limit from step 16 of 32 (20 ms stops in 3 of every 5 steps) is
    found against its own earlier steps; the same process without it is not."""
    traces, per_rank = _job(1)
    clean = [30.0 + 7.0 * (step % 5) for step in range(32)]
    limited = [x + (20_000.0 if step >= 16 and step % 5 in (0, 1, 3) else 0.0) for step, x in enumerate(clean)]
    (suspect,) = cpu_wait_history_suspects(_context(traces, per_rank, _waits({0: limited})), [])
    assert (suspect.rank, suspect.kind) == (0, "host") and "waits for a CPU" in suspect.evidence["rule"], suspect
    assert suspect.evidence["later_steps"][0] in range(14, 19), suspect.evidence
    assert cpu_wait_history_suspects(_context(traces, per_rank, _waits({0: clean})), []) == []
    # a rank already named host by another rule keeps one name: the one that costs more per step
    named = Suspect(rank=0, dp=0, pp=0, tp=0, host="h", kind="host", slowdown=0.03, evidence={"impact_ms": 1.2})
    found = cpu_wait_history_suspects(_context(traces, per_rank, _waits({0: limited})), [named])
    (merged,) = merge_cpu_waits([named], found)
    assert "waits for a CPU" in merged.evidence["rule"] and merged.evidence["host_gap"]["impact_ms"] == 1.2, merged
    # ... and a rank named for its CPU waits against the others is not tested against itself as well
    by_peers = Suspect(
        rank=0, dp=0, pp=0, tp=0, host="h", kind="host", slowdown=0.3, evidence={"impact_ms": 9.0, "cpu_wait_ms": 9.0}
    )
    assert cpu_wait_history_suspects(_context(traces, per_rank, _waits({0: limited})), [by_peers]) == []


def test_one_rank_one_name_when_the_cpu_wait_explains_it() -> None:
    """A compute suspect whose excess the CPU wait explains becomes its evidence; a rank already named ``host``
    keeps that name; a compute suspect on another rank stays."""
    host = Suspect(
        rank=2, dp=2, pp=0, tp=0, host="h", kind="host", slowdown=0.3, evidence={"impact_ms": 12.0, "cpu_wait_ms": 12.5}
    )
    compute = Suspect(rank=2, dp=2, pp=0, tp=0, host="h", kind="compute", slowdown=0.4, evidence={"impact_ms": 15.0})
    other = Suspect(rank=1, dp=1, pp=0, tp=0, host="h", kind="compute", slowdown=0.2, evidence={"impact_ms": 8.0})
    merged = merge_cpu_waits([compute, other], [host])
    assert [(s.rank, s.kind) for s in merged] == [(1, "compute"), (2, "host")]
    assert merged[1].evidence["compute"]["impact_ms"] == 15.0
    # a rank named host by another rule keeps one host suspect, the one that costs more per step
    gap = Suspect(
        rank=2, dp=2, pp=0, tp=0, host="h", kind="host", slowdown=0.6, evidence={"impact_ms": 20.0, "late_ms": 20.0}
    )
    merged = merge_cpu_waits([gap], [host])
    assert merged == [gap] and gap.evidence["cpu_wait_ms"] == 12.5
    small_gap = Suspect(
        rank=2, dp=2, pp=0, tp=0, host="h", kind="host", slowdown=0.03, evidence={"impact_ms": 1.0, "late_ms": 1.0}
    )
    merged = merge_cpu_waits([small_gap], [host])
    assert merged == [host] and host.evidence["host_gap"]["impact_ms"] == 1.0
