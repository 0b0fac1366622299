"""The outside faults of ``scan.evaluation.faults`` (what ``benchmarks/megascan_eval.py`` evaluates detection against) do
what they say on the ranks they name, and leave nothing running: competing processes stop at fit end and on
an exception."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from lightning_megatron import MegatronConfigError
from lightning_megatron.scan.evaluation.faults import CompetingProcess, HostStall, SlowDataset

CPU_TRAINER = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), global_step=0)


def _children() -> list[psutil.Process]:
    """Child processes, less multiprocessing's resource tracker (one per process, started with the first spawn)."""
    return [
        c
        for c in psutil.Process().children(recursive=True)
        if c.is_running() and not any("resource_tracker" in part for part in c.cmdline())
    ]


@pytest.mark.parametrize("end", ["on_fit_end", "on_exception"])
def test_competing_cpu_processes_run_on_the_named_rank_and_stop(end: str) -> None:
    before = {c.pid for c in _children()}
    fault = CompetingProcess([0], kind="cpu", on_s=0.2, off_s=0.1, processes=2)
    fault.on_fit_start(CPU_TRAINER, None)
    spinning = [c for c in _children() if c.pid not in before]
    assert len(spinning) == 2
    time.sleep(0.5)
    assert sum(c.cpu_times().user for c in spinning) > 0.05  # they really compete for the CPUs
    if end == "on_fit_end":
        fault.on_fit_end(CPU_TRAINER, None)
    else:
        fault.on_exception(CPU_TRAINER, None, RuntimeError("boom"))
    assert [c.pid for c in _children() if c.pid not in before] == []
    other = CompetingProcess([3], kind="cpu")  # rank 3 is not this process (rank 0): nothing starts
    other.on_fit_start(CPU_TRAINER, None)
    assert [c.pid for c in _children() if c.pid not in before] == []


def test_bad_settings_name_the_parameter() -> None:
    with pytest.raises(MegatronConfigError, match="kind"):
        CompetingProcess([0], kind="disk")  # type: ignore[arg-type]
    with pytest.raises(MegatronConfigError, match="on_s"):
        CompetingProcess([0], on_s=0)
    with pytest.raises(MegatronConfigError, match="needs CUDA"):
        CompetingProcess([0], kind="gpu").on_fit_start(CPU_TRAINER, None)
    with pytest.raises(MegatronConfigError, match="delay_ms"):
        SlowDataset([1], delay_ms=-1, ranks=[0])
    with pytest.raises(MegatronConfigError, match="start_step"):
        CompetingProcess([0], start_step=-1)
    with pytest.raises(MegatronConfigError, match="after_reads"):
        SlowDataset([1], delay_ms=1, ranks=[0], after_reads=-1)
    with pytest.raises(MegatronConfigError, match="needs CUDA"):
        CompetingProcess([0], kind="gpu-memory").on_fit_start(CPU_TRAINER, None)
    with pytest.raises(MegatronConfigError, match="hook"):
        HostStall([0], delay_ms=1, hook="on_validation_end")  # type: ignore[arg-type]
    with pytest.raises(MegatronConfigError, match="delay_ms"):
        HostStall([0], delay_ms=-1)


@pytest.mark.parametrize("hook", ["batch_end", "before_optimizer_step"])
def test_host_stall_blocks_its_hook_on_the_named_rank_from_its_step(hook: str) -> None:
    """The host blocks in the chosen hook only, on rank 0 only, from ``start_step`` on (``on_train_batch_end``
    sees the step already counted: ``global_step - 1`` is the batch's step)."""
    stall, other = HostStall([0], delay_ms=40, hook=hook, start_step=3), HostStall([1], delay_ms=40, hook=hook)

    def hooks(fault: HostStall, step: int) -> float:
        started = time.perf_counter()
        fault.on_before_optimizer_step(SimpleNamespace(global_step=step), None, None)
        fault.on_train_batch_end(SimpleNamespace(global_step=step + 1), None, None, None, 0)
        return time.perf_counter() - started

    assert hooks(stall, 2) < 0.03 and hooks(other, 5) < 0.03
    assert hooks(stall, 3) >= 0.04 and hooks(stall, 4) >= 0.04 and stall.stalls == 2 and other.stalls == 0


def test_slow_dataset_delays_only_the_named_ranks() -> None:
    data = list(range(5))
    slow, fast = SlowDataset(data, delay_ms=30, ranks=[0]), SlowDataset(data, delay_ms=30, ranks=[1])
    started = time.perf_counter()
    assert [slow[i] for i in range(5)] == data
    slow_s = time.perf_counter() - started
    started = time.perf_counter()
    assert [fast[i] for i in range(5)] == data and len(fast) == 5
    assert slow_s >= 0.15 > time.perf_counter() - started


def test_slow_dataset_turns_slow_after_its_reads() -> None:
    slow = SlowDataset(list(range(6)), delay_ms=40, ranks=[0], after_reads=3)
    started = time.perf_counter()
    assert [slow[i] for i in range(3)] == [0, 1, 2]
    quick_s = time.perf_counter() - started
    started = time.perf_counter()
    assert [slow[i] for i in range(3, 6)] == [3, 4, 5]
    assert time.perf_counter() - started >= 0.12 > quick_s


def _busy_seconds(child: psutil.Process) -> float:
    """CPU seconds the child used in one second (a spinner on a loaded 2-core machine still gets 0.3 or so)."""
    start = sum(child.cpu_times()[:2])
    time.sleep(1.0)
    return sum(child.cpu_times()[:2]) - start


def test_competitors_with_a_start_step_wait_for_it() -> None:
    """``start_step``: started and ready at fit start, idle until the step, competing from it on (a machine that
    turns slow mid-run)."""
    before = {c.pid for c in _children()}
    fault = CompetingProcess([0], kind="cpu", processes=1, start_step=3)
    try:
        fault.on_fit_start(CPU_TRAINER, None)
        (child,) = [c for c in _children() if c.pid not in before]
        time.sleep(0.2)
        assert _busy_seconds(child) < 0.05  # ready, waiting for step 3
        fault.on_train_batch_start(SimpleNamespace(global_step=2), None, None, 0)
        assert _busy_seconds(child) < 0.05
        fault.on_train_batch_start(SimpleNamespace(global_step=3), None, None, 0)
        assert _busy_seconds(child) > 0.1
    finally:
        fault.on_fit_end(CPU_TRAINER, None)
    assert [c.pid for c in _children() if c.pid not in before] == []


def test_fit_start_waits_for_the_competitors_and_reports_one_that_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fit start returns only once every competing process competes (a spawned one takes seconds to import
    torch: a short fit would end first); one that dies before that is an error at once, not a silent no-fault."""
    before = {c.pid for c in _children()}
    fault = CompetingProcess([0], kind="cpu", processes=1)
    started = time.monotonic()
    fault.on_fit_start(CPU_TRAINER, None)
    assert len([c for c in _children() if c.pid not in before]) == 1
    fault.on_fit_end(CPU_TRAINER, None)
    assert time.monotonic() - started < 60
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {100_000})  # no such CPU: the child fails to start
    broken = CompetingProcess([0], kind="cpu", processes=1)
    with pytest.raises(RuntimeError, match=r"did not start within .* \(exit code 1\)"):
        broken.on_fit_start(CPU_TRAINER, None)
    assert [c.pid for c in _children() if c.pid not in before] == []


def test_kept_alive_competitors_pause_between_fits_and_close() -> None:
    """``keep_alive``: started once, paused at fit end (idle), competing again at the next fit start, ended by
    ``close``: an evaluation of many short fits pays the start-up once."""
    before = {c.pid for c in _children()}
    fault = CompetingProcess([0], kind="cpu", processes=1, keep_alive=True)
    busy_seconds = _busy_seconds
    try:
        fault.on_fit_start(CPU_TRAINER, None)
        (child,) = [c for c in _children() if c.pid not in before]
        assert busy_seconds(child) > 0.1
        fault.on_fit_end(CPU_TRAINER, None)
        time.sleep(0.2)
        assert child.is_running() and busy_seconds(child) < 0.05  # paused (waiting on an event), not ended
        fault.on_fit_start(CPU_TRAINER, None)
        assert [c.pid for c in _children() if c.pid not in before] == [child.pid]  # the same process
        assert busy_seconds(child) > 0.1
    finally:
        fault.close()
    assert [c.pid for c in _children() if c.pid not in before] == []


def test_competitors_started_side_by_side_wait_paused_for_their_fit() -> None:
    """``start`` spawns without waiting (an evaluation starts all its competitors at once) and ``wait_ready``
    leaves them ready but idle: they compete only once a fit they belong to starts, in that same process."""
    before = {c.pid for c in _children()}
    faults = [CompetingProcess([0], kind="cpu", processes=1, keep_alive=True) for _ in range(2)]
    try:
        children = []
        for fault in faults:
            fault.start(None)
            children += [c for c in _children() if c.pid not in before and c not in children]  # its own child
        for fault in faults:
            fault.wait_ready()
        assert len(children) == 2
        time.sleep(0.2)
        assert all(_busy_seconds(child) < 0.05 for child in children)  # ready and paused
        faults[0].on_fit_start(CPU_TRAINER, None)
        assert [c.pid for c in _children() if c.pid not in before] == [c.pid for c in children]  # no new process
        busy = {child.pid: _busy_seconds(child) for child in children}
        assert busy[children[0].pid] > 0.1 and busy[children[1].pid] < 0.05, busy
        with pytest.raises(MegatronConfigError, match="needs CUDA"):
            CompetingProcess([0], kind="gpu").start(None)
    finally:
        for fault in faults:
            fault.close()
    assert [c.pid for c in _children() if c.pid not in before] == []
