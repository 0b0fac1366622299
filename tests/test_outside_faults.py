"""``benchmarks/outside_faults.py``: fault sources MegaScan's evaluation did not build (``stress-ng``) start on the
named rank's CPUs from their step, really load them, and leave nothing behind. Skipped where ``stress-ng`` is not
installed (CI installs it: ``.ci/run``)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from outside_faults import StressNg, stress_ng_available  # noqa: E402

pytestmark = pytest.mark.skipif(
    not stress_ng_available(), reason="stress-ng is not installed (apt-get install stress-ng)"
)


def _stressors(before: set[int]) -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True) if c.pid not in before and c.is_running()]


@pytest.mark.parametrize("end", ["on_fit_end", "on_exception", "teardown"])
def test_stress_ng_loads_the_named_ranks_cpus_from_its_step_and_stops(end: str) -> None:
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    fault = StressNg(rank=0, start_step=3)
    fault.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=2), None, None, 0)
    assert _stressors(before) == []  # not before its step
    fault.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=3), None, None, 0)
    time.sleep(1.0)
    running = _stressors(before)
    assert running, "stress-ng did not start"
    cpus = set(os.sched_getaffinity(0))
    assert all(set(p.cpu_affinity()) <= cpus for p in running)  # on this rank's CPUs only
    assert sum(p.cpu_times().user + p.cpu_times().system for p in running) > 0.3  # it really competes
    hook = getattr(fault, end)
    hook(None, None, *([RuntimeError("boom")] if end == "on_exception" else ["fit"] if end == "teardown" else []))
    time.sleep(0.2)
    alive = [p for p in running if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []  # the tool and its stressors are gone, not just orphaned


def test_stress_ng_starts_only_on_its_rank_and_checks_its_load() -> None:
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    other = StressNg(rank=1)
    other.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=5), None, None, 0)
    assert _stressors(before) == []
    with pytest.raises(ValueError, match="cpu_load"):
        StressNg(rank=0, cpu_load=0)
