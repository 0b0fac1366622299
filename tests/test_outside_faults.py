"""``benchmarks/outside_faults.py``: fault sources MegaScan's evaluation did not build (``stress-ng``, the kernel's CPU
bandwidth limit) start on the named rank from their step, really act, and leave nothing behind. Skipped where
``stress-ng`` is not installed (CI installs it: ``.ci/run``) or no cgroup can be made (not root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from outside_faults import CpuQuota, StressNg, cpu_quota_available, stress_ng_available  # noqa: E402

needs_stress_ng = pytest.mark.skipif(
    not stress_ng_available(), reason="stress-ng is not installed (apt-get install stress-ng)"
)
needs_cgroups = pytest.mark.skipif(not cpu_quota_available(), reason="no writable cgroup with the CPU controller")


def _stressors(before: set[int]) -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True) if c.pid not in before and c.is_running()]


@needs_stress_ng
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


@needs_stress_ng
def test_stress_ng_starts_only_on_its_rank_and_checks_its_load() -> None:
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    other = StressNg(rank=1)
    other.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=5), None, None, 0)
    assert _stressors(before) == []
    with pytest.raises(ValueError, match="cpu_load"):
        StressNg(rank=0, cpu_load=0)


_QUOTA_CHILD = """
import json, sys, time
from types import SimpleNamespace
sys.path.insert(0, {benchmarks!r})
from outside_faults import CpuQuota
quota = CpuQuota(rank=0, start_step=2, cpus=0.25)
def cpu_cgroup():
    return [line for line in open("/proc/self/cgroup").read().splitlines() if "cpu" in line.split(":")[1].split(",")]
def share(seconds=0.6):
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        pass
    return (time.process_time() - cpu) / (time.perf_counter() - wall)
home = cpu_cgroup()
quota.on_train_batch_start(SimpleNamespace(global_rank=1, global_step=5), None, None, 0)  # another rank
quota.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=1), None, None, 0)  # before its step
result = {{"moved_early": cpu_cgroup() != home}}
quota.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=2), None, None, 0)
cgroup = quota.cgroup
result.update(during=share(), throttled=quota.throttled()["nr_throttled"], inside=cpu_cgroup() != home)
getattr(quota, {end!r})(*{args})
result.update(back=cpu_cgroup() == home, left=cgroup.exists())
print(json.dumps(result))
"""


@needs_cgroups
@pytest.mark.parametrize("end", ["on_fit_end", "on_exception", "teardown"])
def test_a_cpu_quota_limits_the_ranks_process_from_its_step_and_is_removed(end: str) -> None:
    """In a child process (a failure must not leave pytest throttled): the limit applies only on its rank and from
    its step, the kernel throttles the process to about its quota of CPU time (a quarter), and at the end it is
    back in its own cgroup with the quota's cgroup gone."""
    args = {
        "on_fit_end": "(None, None)",
        "on_exception": "(None, None, RuntimeError())",
        "teardown": "(None, None, 'fit')",
    }
    code = _QUOTA_CHILD.format(
        benchmarks=str(Path(__file__).resolve().parents[1] / "benchmarks"), end=end, args=args[end]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["moved_early"] and result["inside"] and result["back"] and not result["left"], result
    assert result["throttled"] > 0 and result["during"] < 0.45, result  # 0.25 CPUs, with slack for the period edges


def test_a_cpu_quota_refuses_bad_settings() -> None:
    for kwargs, word in ((dict(cpus=0), "cpus"), (dict(period_ms=0.1), "period_ms")):
        with pytest.raises(ValueError, match=word):
            CpuQuota(rank=0, **kwargs)


@needs_cgroups
def test_a_cpu_quota_removes_the_cgroup_a_killed_process_left() -> None:
    """``kill -9`` skips every hook: the next ``CpuQuota`` on the machine removes the cgroup left behind."""
    from types import SimpleNamespace

    code = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'benchmarks')!r})\n"
        "from types import SimpleNamespace\n"
        "from outside_faults import CpuQuota\n"
        "quota = CpuQuota(rank=0)\n"
        "quota.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=0), None, None, 0)\n"
        "print(quota.cgroup, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        left = Path(child.stdout.readline().strip())
        assert left.exists()
    finally:
        child.kill()
        child.wait()
    assert left.exists()  # nothing ran at its death
    quota = CpuQuota(rank=0)
    quota.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=0), None, None, 0)
    try:
        assert not left.exists()
    finally:
        quota.stop()
    assert quota.cgroup is None
