"""The outside faults of ``scan.faults`` (what ``benchmarks/megascan_eval.py`` evaluates detection against) do
what they say on the ranks they name, and leave nothing running: competing processes stop at fit end and on
an exception."""

from __future__ import annotations

import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from lightning_megatron import MegatronConfigError
from lightning_megatron.scan.faults import CompetingProcess, SlowDataset

CPU_TRAINER = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))


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


def test_slow_dataset_delays_only_the_named_ranks() -> None:
    data = list(range(5))
    slow, fast = SlowDataset(data, delay_ms=30, ranks=[0]), SlowDataset(data, delay_ms=30, ranks=[1])
    started = time.perf_counter()
    assert [slow[i] for i in range(5)] == data
    slow_s = time.perf_counter() - started
    started = time.perf_counter()
    assert [fast[i] for i in range(5)] == data and len(fast) == 5
    assert slow_s >= 0.15 > time.perf_counter() - started
