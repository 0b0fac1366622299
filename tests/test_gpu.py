"""GPU layout parity (NCCL, bf16): skipped on CPU machines; run on the device machine, where it drives
``benchmarks/gpu_parity.py`` and leaves its JSON in ``$LM_RESULTS_DIR`` (default: a temp dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")


def test_layouts_match_one_gpu(tmp_path: Path) -> None:
    out = Path(os.environ.get("LM_RESULTS_DIR", tmp_path)) / "gpu_parity.json"
    layouts = ["tp2-sp", "pp2-vpp2", "dp2-distopt"]
    if torch.cuda.device_count() >= 4:
        layouts += ["tp2-pp2-sp", "pp4-vpp2", "dp2-tp2-distopt"]
    command = [
        sys.executable,
        "benchmarks/gpu_parity.py",
        "--only",
        *layouts,
        "--precision",
        "bf16-mixed",
        "--out",
        str(out),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["all_within_tolerance"], proc.stdout[-4000:]
