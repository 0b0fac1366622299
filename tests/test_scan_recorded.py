"""Detection on traces recorded on GPUs, not generated: ``tests/data/megascan_h200_pp2.tar.gz`` holds four fits
of ``benchmarks/megascan_eval.py`` on 2x H200 (a 16-layer, 2048-wide GPT at PP2, every step traced with layer
spans, 2026-11-23), kept with ``--keep-traces``. The faults came from outside MegaScan's own injector: another
process multiplying matrices on rank 0's GPU, processes spinning on rank 0's CPUs, and (the injector) a delayed
link from rank 0 to rank 1. Before the rules below existed the first was named ``link`` and the second a slow
link (a host-paced send); these cases keep them fixed."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from lightning_megatron.scan.detect import detect

ARCHIVE = Path(__file__).parent / "data" / "megascan_h200_pp2.tar.gz"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recorded")
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(root, filter="data")
    return root / "pp2"


def named(report) -> list[tuple[int, str]]:
    return [(s.rank, s.kind) for s in report.suspects]


def test_clean_fit_names_nothing(recorded: Path) -> None:
    report = detect(recorded / "clean-0")
    assert report.suspects == [], report.table()


def test_a_time_sliced_gpu_is_named_compute_with_its_slower_link_as_evidence(recorded: Path) -> None:
    """Another process on rank 0's GPU made one layer part of its stage about 3x slower, the others not, and its
    kernels only +3% (the GPU ran the other process between them): the typical layer per step across stages
    names it ``compute``, and its link, slower too, is that suspect's evidence, not a second cause."""
    report = detect(recorded / "gpu-contention-2")
    assert named(report) == [(0, "compute")], report.table()
    evidence = report.suspects[0].evidence
    assert evidence["per_step_layers"]["mean_excess"] > 0.4, evidence
    assert evidence["gpu_paced_only"] and evidence["link_peer"] == 1 and evidence["link_ms"] > 1.0, evidence


def test_host_paced_sends_are_not_a_slow_link(recorded: Path) -> None:
    """CPU contention on rank 0's host: its sends lasted as long as its host took to post them; nothing is named
    (the job was 1% slower)."""
    report = detect(recorded / "cpu-contention-2")
    assert report.suspects == [], report.table()


def test_a_delayed_link_is_still_named(recorded: Path) -> None:
    report = detect(recorded / "link-delay-0")
    assert named(report) == [(0, "link")], report.table()
    assert report.suspects[0].peer == 1 and report.suspects[0].impact_ms > 10
