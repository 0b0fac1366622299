"""Detection on traces recorded on GPUs and CPUs, not generated, kept by ``benchmarks/megascan_eval.py
--keep-traces``. The faults came from outside MegaScan's own injector.

* ``tests/data/megascan_h200_pp2.tar.gz``: four fits on 2x H200 (a 16-layer, 2048-wide GPT at PP2, every step
  traced with layer spans, 2026-11-23): another process multiplying matrices on rank 0's GPU, processes spinning
  on rank 0's CPUs, and (the injector) a delayed link from rank 0 to rank 1. Before the rules below existed the
  first was named ``link`` and the second a slow link (a host-paced send); these cases keep them fixed.
* ``tests/data/megascan_h100_single_early.tar.gz``: fifteen one-process fits on one H100 (the ``medium`` GPT, 34
  steps, CUDA graphs, 2026-11-24, ``--layouts single --onset 0.25``), the faults beginning at step 10: clean fits,
  a competitor on the GPU in bursts, a slow loader and CPU contention. The rank's own earlier steps are the only
  baseline; with three fixed splits the rule found none of the bursty fits and two of five slow loaders.
* ``tests/data/megascan_h100_single_host.tar.gz``: fifteen one-process fits on one H100 (``medium`` and
  ``llama``, 34 steps, CUDA graphs, 2026-11-24, ``--layouts single``), the faults beginning at step 18: the
  job's own host blocking for a quarter of a step (``scan.evaluation.faults.HostStall``) between steps, inside the traced
  step after the GPU finished, and before the optimizer step behind queued GPU work (which hid it); the same
  stall before the optimizer step at 125% of a step, longer than the queued work (no synchronisation before
  it); and another process copying buffers on the GPU. Before ``measure.host_waits_in_steps`` the stalls inside
  steps were named by nothing (a quarter of each step lost).
* ``tests/data/megascan_cpu_pp2.tar.gz``: seven fits of the tiny CPU GPT at PP2 on this 2-vCPU machine (each
  stage pinned to one vCPU, 14 steps, layer spans, 2026-11-24, ``--cpu --layouts pp2``), the faults from the
  first step: two clean fits, processes spinning on one stage's vCPU (Python, and ``stress-ng``), the stage's
  host blocking between steps and before its optimizer step, and (the injector) a delayed link. Both stages are
  alone in their stage: before the cross-stage rules on means and host waits none but the link and the loaders
  were named (1 of 30 contention and host-stall fits), and a delayed link also named its sender ``compute``.
* ``tests/data/megascan_cpu_waits.tar.gz``: four fits of the same model and machine (DP2 and PP2, 2026-11-25,
  ``--cpu``) with the training thread's waits for a CPU on every step (``cpu_wait_us``): a clean fit, a
  container's CPU limit on one rank (``outside_faults.CpuQuota``, 0.5 CPUs; DP2 and PP2) and our spinning
  competitor (DP2). Before that counter the span rules found the CPU limit in 6 of 10 DP2 and 2 of 10 PP2 fits.
* ``tests/data/megascan_h100_single_cpuset.tar.gz``: six one-process fits on one H100 (the launch-bound ``small``
  GPT, 34 steps, CUDA graphs, 2026-11-25, ``--layouts single --cpus-per-rank 1``): the process pinned to one of
  the host's CPUs, as a container's CPU set would, and from step 18 our spinning competitor on that CPU (the job
  26% slower). Three clean fits, and three with the competitor in which the rules before the 16th session named
  a host gap 1-2 ms longer than before (2-4% of a step) instead of the 27-29 ms a step the training thread waited
  for its CPU.
* ``tests/data/megascan_h200_tp2sp.tar.xz``: two fits on 2x H200 (the ``medium`` GPT at TP2 with sequence
  parallelism, eager, 14 steps, 2026-11-27, ``--layouts tp2-sp``), the faults from the first step: rank 1's host
  blocking before the optimizer step (a quarter of a step, +28% that launch), and another process multiplying
  matrices in bursts on rank 0's GPU (the job +1%). The tensor-parallel ranks meet in 670 collectives a step,
  and which of them waits there swings by hundreds of milliseconds between steps: the first was named by
  nothing, the second named the *other* rank ``host`` (spans +292% against its host's queueing +9%).
* ``tests/data/megascan_h200_dp2_eager.tar.xz``: five fits on 2x H200 (the ``medium`` GPT at DP2, every step from
  step 2 traced eagerly, 14 steps, 2026-11-27, ``--layouts dp2``): two clean fits that named rank 0 ``host`` (its
  host queued the same kernels 12-49% slower, its kernels no longer), a host stall between steps and one before
  the optimizer step on rank 0, and another process copying buffers on rank 1's GPU. Read as the default job
  traces them (each step marked as run in place of a replay), the launch pace is no longer named.
* ``tests/data/megascan_h200_pp2_defaults.tar.xz``: three fits on 2x H200 (the ``gpt-medium`` GPT, 16 layers,
  2048 wide, at PP2 and PP2 x VPP2 with MegaScan's default settings, 14 steps, 2026-11-28): two clean PP2 fits
  that named stage 0 ``compute`` (its few "GPU-paced" backward attention spans, which its GPU reached 30-100 µs
  after they were queued and its host took 90-95% of to queue, +24% and +36% against stage 1's; the kernels'
  busy time the same), and a PP2 x VPP2 fit with another process multiplying matrices on rank 0's GPU that
  named rank 0's backward link (its transfers 18x slower) once the compute suspect was dropped for idle time.
"""

from __future__ import annotations

import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_megatron.scan.analysis.detect import detect

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from megascan_score import marked_in_place_of_replays  # noqa: E402

DATA = Path(__file__).parent / "data"


# fixture name → (archive in tests/data, its folder): each a module-scoped fixture with the folder extracted
ARCHIVES = {
    "recorded": ("megascan_h200_pp2.tar.gz", "pp2"),
    "host_faults": ("megascan_h100_single_host.tar.gz", "host"),
    "cpuset": ("megascan_h100_single_cpuset.tar.gz", "cpuset"),
    "one_gpu": ("megascan_h100_single_early.tar.gz", "single"),
    "cpu_pp2": ("megascan_cpu_pp2.tar.gz", "pp2"),
    "cpu_waits": ("megascan_cpu_waits.tar.gz", ""),
    "tp2sp": ("megascan_h200_tp2sp.tar.xz", "tp2sp"),
    "dp2_eager": ("megascan_h200_dp2_eager.tar.xz", "dp2"),
    "pp2_defaults": ("megascan_h200_pp2_defaults.tar.xz", "pp2_defaults"),
}


def _archive_fixture(archive_name: str, folder: str) -> Callable[[pytest.TempPathFactory], Path]:
    @pytest.fixture(scope="module")
    def extracted(tmp_path_factory: pytest.TempPathFactory) -> Path:
        root = tmp_path_factory.mktemp("recorded")
        with tarfile.open(DATA / archive_name) as archive:
            archive.extractall(root, filter="data")
        return root / folder

    return extracted


for _name, (_archive_name, _folder) in ARCHIVES.items():
    globals()[_name] = _archive_fixture(_archive_name, _folder)


def named(report) -> list[tuple[int, str]]:
    return [(s.rank, s.kind) for s in report.suspects]


def test_clean_fit_names_nothing(recorded: Path) -> None:
    report = detect(recorded / "clean-0")
    assert report.suspects == [], report.table()


def test_a_time_sliced_gpu_is_named_compute_not_a_slow_link(recorded: Path) -> None:
    """Another process on rank 0's GPU made one layer part of its stage about 3x slower, the others not, and its
    kernels only +3% (the GPU ran the other process between them): the typical layer per step across stages
    names it ``compute``. Its link looked 10x slower on transfers whose spans kept their host's pace; without
    those (``measure.host_paced``) both directions move their bytes alike, and no link is named."""
    report = detect(recorded / "gpu-contention-2")
    assert named(report) == [(0, "compute")], report.table()
    evidence = report.suspects[0].evidence
    assert evidence["per_step_layers"]["mean_excess"] > 0.4, evidence
    assert evidence["gpu_paced_only"], evidence


@pytest.mark.parametrize("fit", ["clean-0", "clean-5"])
def test_clean_lone_stages_whose_gpu_kept_its_hosts_pace_name_nothing(pp2_defaults: Path, fit: str) -> None:
    """Stage 0 of a launch-bound GPT at PP2: its GPU reached a few spans 30-100 µs after they were queued and then
    kept its host's pace to their end; those spans time the host, not the GPU (``measure.host_paced``)."""
    report = detect(pp2_defaults / "pp2" / fit)
    assert report.suspects == [], report.table()


def test_a_shared_gpu_at_virtual_pipeline_stages_is_compute_not_a_slow_link(pp2_defaults: Path) -> None:
    """Another process on rank 0's GPU (PP2 x VPP2): its layer parts +77% against the other stage's, its kernels
    +7% over both sampled steps but +8% in one (``attribution._largest_layer_excess``), so it stays ``compute``
    and its slower sends are that suspect's evidence, not a ``link`` of their own."""
    report = detect(pp2_defaults / "pp2-vpp2" / "gpu-contention-4")
    assert named(report) == [(0, "compute")], report.table()
    evidence = report.suspects[0].evidence
    assert evidence["busy_window_excess"] >= 0.08 and evidence["link_peer"] == 1, evidence


def test_host_paced_sends_are_not_a_slow_link(recorded: Path) -> None:
    """CPU contention on rank 0's host: its sends lasted as long as its host took to post them; nothing is named
    (the job was 1% slower)."""
    report = detect(recorded / "cpu-contention-2")
    assert report.suspects == [], report.table()


def test_a_delayed_link_is_still_named(recorded: Path) -> None:
    report = detect(recorded / "link-delay-0")
    assert named(report) == [(0, "link")], report.table()
    assert report.suspects[0].peer == 1 and report.suspects[0].impact_ms > 10


def test_one_process_clean_fits_and_cpu_contention_name_nothing(one_gpu: Path) -> None:
    """CPU contention did not slow this job (+0.2%): nothing to name."""
    for fit in [f"clean-{i}" for i in range(5)] + ["cpu-contention-0"]:
        report = detect(one_gpu / fit)
        assert report.suspects == [], (fit, report.table())
        # one process has no other stage: the advice to trace layers (for lone pipeline stages) does not apply
        assert any("one rank, no peers" in w for w in report.warnings), report.warnings
        assert not any("granularity='layer'" in w for w in report.warnings), report.warnings


def test_one_process_changes_that_begin_early_are_found_against_its_own_history(one_gpu: Path) -> None:
    """From step 10 of 34: GPU contention (+90%), bursts of it (+45%) and a slow loader (+25%) against the rank's
    own earlier steps, split where the change began. One bursty fit of five stays below the level (the bursts
    spared enough of its later steps)."""
    report = detect(one_gpu / "gpu-contention-0")
    assert named(report) == [(0, "compute")], report.table()
    assert report.suspects[0].evidence["later_steps"][0] <= 12, report.suspects[0].evidence
    bursty = [named(detect(one_gpu / f"gpu-contention-bursty-{i}")) for i in range(5)]
    assert sum(found == [(0, "compute")] for found in bursty) >= 4 and all(f in ([], [(0, "compute")]) for f in bursty)
    for fit in ("slow-loader-0", "slow-loader-2", "slow-loader-3"):  # the fixed splits missed these three
        report = detect(one_gpu / fit)
        assert named(report) == [(0, "data")], (fit, report.table())
        assert report.suspects[0].evidence["rule"] == "later steps against the rank's own earlier steps"


@pytest.mark.parametrize("model", ["medium", "llama"])
def test_a_host_that_blocks_inside_the_step_is_named_host(host_faults: Path, model: str) -> None:
    """A callback sleeping a quarter of a step before MegaScan's step end, with the GPU idle: +25% per step, in no
    traced span; the GPU's wait for its host inside the steps names it, where it began (step 18)."""
    fits = [f"host-stall-in-step-{i}" for i in range(3 if model == "medium" else 1)]
    for fit in fits:
        report = detect(host_faults / model / fit)
        assert named(report) == [(0, "host")], (fit, report.table())
        suspect = report.suspects[0]
        assert suspect.evidence["where"].startswith("inside steps") and 16 <= suspect.evidence["later_steps"][0] <= 20
        assert 0.15 < suspect.slowdown < 0.35 and suspect.impact_ms > 30, suspect  # the share of a step it costs
        assert "inside steps" in report.table()


@pytest.mark.parametrize("model", ["medium", "llama"])
def test_a_stall_longer_than_the_queued_gpu_work_is_named_host(host_faults: Path, model: str) -> None:
    """A stall before the optimizer step with no synchronisation in front of it, 125% of a clean step: the
    queued forward and backward hide part of it, the rest (+112 ms / +74 ms a step) idles the GPU inside the
    step, and only that part is what it costs."""
    report = detect(host_faults / model / "host-stall-exposed-0")
    assert named(report) == [(0, "host")], report.table()
    suspect = report.suspects[0]
    assert suspect.evidence["where"].startswith("inside steps") and 16 <= suspect.evidence["later_steps"][0] <= 20
    assert 0.2 < suspect.slowdown < 0.45 and suspect.impact_ms > 50, suspect


def test_a_host_stall_the_gpu_hid_and_clean_fits_name_nothing(host_faults: Path) -> None:
    """The same stall before the optimizer step, behind the step's queued GPU work: the job +0.2%, nothing named."""
    fits = [("medium", f) for f in ("clean-0", "clean-1", "host-stall-hidden-0", "host-stall-hidden-1")]
    fits += [("medium", "host-stall-hidden-2"), ("llama", "clean-0"), ("llama", "host-stall-hidden-0")]
    for model, fit in fits:
        report = detect(host_faults / model / fit)
        assert report.suspects == [], (model, fit, report.table())


def test_other_host_and_gpu_faults_keep_their_names(host_faults: Path) -> None:
    """A stall between steps stays the host gap's; a bandwidth-bound competitor on the GPU is ``compute``, its
    longer waits inside steps folded into it as evidence."""
    report = detect(host_faults / "medium" / "host-stall-0")
    assert named(report) == [(0, "host")] and "where" not in report.suspects[0].evidence, report.table()
    report = detect(host_faults / "medium" / "gpu-memory-contention-0")
    assert named(report) == [(0, "compute")], report.table()


def test_a_tensor_parallel_peer_kept_waiting_by_a_host_stall_names_it(tp2sp: Path) -> None:
    """Rank 1's host stalls before the optimizer step; rank 0 waits it out in the next all-reduce (114-191 ms a
    step). Rank 1's own in-step gaps show the stall, and its peer's waits during those very gaps say it cost the
    peer (``waits.host_waits_in_steps``: ``waited_during``); the step's total waits, at TP, do not."""
    report = detect(tp2sp / "host-stall-hidden-1")
    assert named(report) == [(1, "host")], report.table()
    suspect = report.suspects[0]
    assert suspect.evidence["where"].startswith("inside steps") and suspect.evidence["late_ms"] > 100, suspect
    assert 0.1 < suspect.slowdown < 0.3, suspect


def test_a_tensor_parallel_rank_is_not_named_host_for_idle_time_its_host_does_not_explain(tp2sp: Path) -> None:
    """Bursty contention on rank 0's GPU, which the job hardly felt: rank 1's spans +292% with its kernels no
    slower and its host's queueing only +9% (``attribution._HOST_EXPLAINS``): nothing is named."""
    report = detect(tp2sp / "gpu-contention-bursty-2")
    assert report.suspects == [], report.table()


def test_lone_cpu_stages_name_nothing_when_clean(cpu_pp2: Path) -> None:
    """``clean-3``: the first stage's typical layer is 10% slower than the second's (two processes on a VM's two
    vCPUs are not independent), under the CPU stage margin."""
    for fit in ("clean-0", "clean-3"):
        assert named(detect(cpu_pp2 / fit)) == [], fit


def test_cpu_contention_on_a_lone_stage_is_named_compute(cpu_pp2: Path) -> None:
    """Time slices taken by another process hit few layer spans hard: the median layer part moved by +7%, the mean
    by +58% (``stage_rules``: a typical layer per step from the parts' means)."""
    for fit, rank in (("cpu-contention-0", 0), ("cpu-contention-stress-ng-3", 1)):
        report = detect(cpu_pp2 / fit)
        assert named(report) == [(rank, "compute")], (fit, report.suspects)
        assert report.suspects[0].evidence["across_stages"]


def test_a_lone_stage_whose_host_stalls_is_named_host(cpu_pp2: Path) -> None:
    """Between steps (``host-stall-1``: the other stage waits it out at Lightning's synchronisation) and before the
    optimizer step (``host-stall-hidden-0``: inside the step), compared with the other stage's host waits."""
    for fit, rank in (("host-stall-1", 1), ("host-stall-hidden-0", 0)):
        report = detect(cpu_pp2 / fit)
        assert named(report) == [(rank, "host")], (fit, report.suspects)
        assert report.suspects[0].evidence["across_stages"] and report.suspects[0].slowdown > 0.15


def test_a_delayed_link_does_not_also_make_its_sender_a_slow_stage(cpu_pp2: Path) -> None:
    report = detect(cpu_pp2 / "link-delay-0")
    assert named(report) == [(0, "link")], report.suspects


def test_a_rank_without_a_cpu_is_named_host_from_its_run_queue_delay(cpu_waits: Path) -> None:
    """A CPU limit stops the process wherever it is: inside compute spans, host gaps, or a collective it entered
    (where it looks like waiting for the others). The training thread's run-queue delay names it, at DP2 (against
    its peer) and PP2 (against the other stage); a competing process the same way. A clean fit names nothing."""
    assert named(detect(cpu_waits / "dp2" / "clean-0")) == []
    for fit, rank in (("dp2/cpu-quota-3", 1), ("pp2/cpu-quota-1", 1), ("dp2/cpu-contention-2", 0)):
        report = detect(cpu_waits / fit)
        assert named(report) == [(rank, "host")], (fit, report.suspects)
        evidence = report.suspects[0].evidence
        assert evidence["cpu_wait_ms"] > 5 * evidence["baseline_ms"] and evidence["p_value"] < 0.025, evidence


def test_a_gpu_process_sharing_its_one_cpu_is_named_for_its_waits_for_it(cpuset: Path) -> None:
    """The headline is what the rank lost, the training thread's waits for its CPU (about 60% of a 48 ms step),
    not a host gap a millisecond longer than before; clean fits name nothing (a host gap must cost ``min_slowdown``
    of a step against the rank's own history)."""
    for fit in ("clean-0", "clean-1", "clean-2"):
        report = detect(cpuset / fit)
        assert report.suspects == [], (fit, report.table())
    for fit in ("cpu-contention-0", "cpu-contention-5", "cpu-contention-7"):
        report = detect(cpuset / fit)
        hosts = [s for s in report.suspects if s.kind == "host"]
        assert len(hosts) == 1 and hosts[0].rank == 0, (fit, report.table())
        assert "waits for a CPU" in hosts[0].evidence["rule"] and hosts[0].impact_ms > 20, (fit, report.table())
        assert hosts[0] is report.suspects[0], (fit, report.table())  # the largest cost comes first


def test_launch_pace_is_named_only_where_the_job_pays_it(dp2_eager: Path, tmp_path: Path) -> None:
    """Eager DP2 fits (every step traced, so the job itself was eager): the clean fits name rank 0 ``host``, whose
    host launched the same kernels slower, which that job paid. Read as the default job traces them, each traced
    step run eagerly in place of a CUDA-graph replay, that pace is not the job's and nothing is named (with a
    note), while the faults stay found as before: the host stalls (outside the graph, by their own rules) and the
    other process on rank 1's GPU (``compute``)."""
    expected = {
        "clean-1": [],
        "clean-6": [],
        "host-stall-0": [(0, "host")],
        "host-stall-hidden-2": [(0, "host")],
        "gpu-memory-contention-1": [(1, "compute")],
    }
    for fit, marked_names in expected.items():
        as_recorded = detect(dp2_eager / fit)
        marked_dir = tmp_path / fit
        marked_dir.mkdir()
        marked = detect(marked_in_place_of_replays(dp2_eager / fit, marked_dir))
        assert named(marked) == marked_names, (fit, marked.table())
        if fit.startswith("clean"):
            assert named(as_recorded) == [(0, "host")], (fit, as_recorded.table())
            assert any("replays those steps as a CUDA graph" in note for note in marked.warnings), marked.warnings
        else:
            assert set(marked_names) <= set(named(as_recorded)), (fit, as_recorded.table())
