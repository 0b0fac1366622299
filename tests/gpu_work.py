"""What the GPU tests share: random tensors of every dtype, a tensor that takes a known time to compute (the
transport's "is the data ready" cases), where a test's results go (``record``), a fit in a script of its own
(``run_script``: several GPUs, as Lightning starts the other ranks by running the script again), and the
Llama-style layer settings the model tests add to a shape (``LLAMA_STYLE_LAYERS``)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LLAMA_STYLE_LAYERS = dict(
    position_embedding_type="rope", normalization="RMSNorm", activation="swiglu", add_bias_linear=False
)
"""``GPTModule`` settings of a Llama-style model (rotary embeddings, RMSNorm, SwiGLU, no biases); a shape adds its
sizes and grouped queries."""

KERNEL_S = 0.3
"""How long the sender's GPU computes the tensor after it was handed to the transport."""
SLACK_S = 0.02
"""The sender sees its kernel end (``Event.synchronize``) a little after the GPU does; the receiver may be first."""


def long_producer(device: str, seconds: float) -> tuple[Callable[[], torch.Tensor], float]:
    """A function that queues ~``seconds`` of GPU work ending in a fresh (4096, 4096) float32 tensor, and the
    calibrated duration. A chain ``x = tanh(x @ w)``: every step depends on the one before, values stay bounded."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(4096, 4096, generator=g) / 64).to(device)
    x0 = torch.randn(4096, 4096, generator=g).to(device)

    def chain(steps: int) -> torch.Tensor:
        x = x0
        for _ in range(steps):
            x = torch.tanh(x @ w)
        return x

    chain(3)
    torch.cuda.synchronize()
    start = time.perf_counter()
    chain(10)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / 10
    steps = max(1, min(4000, math.ceil(seconds / per_step)))
    return (lambda: chain(steps)), steps * per_step


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def random_value(tag: int, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random bytes seeded by ``tag``, viewed as ``dtype`` (every bit pattern: compare bitwise, NaN included)."""
    g = torch.Generator(device="cpu").manual_seed(tag)
    raw = torch.randint(
        0,
        256,
        (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
        generator=g,
        dtype=torch.uint8,
    )
    if dtype == torch.bool:
        raw = raw % 2
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return raw[:n].view(dtype).reshape(shape).to(device)


def record(file_name: str, tmp_path: Path, key: str, row: dict[str, Any]) -> None:
    """Add ``row`` under ``key`` to ``file_name`` in ``$LM_RESULTS_DIR`` (else ``tmp_path``), with the device and
    torch version: the JSON that goes to ``benchmarks/results/`` after a device run."""
    out = Path(os.environ.get("LM_RESULTS_DIR", tmp_path)) / file_name
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else {}
    rows[key] = {**row, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out.write_text(json.dumps(rows, indent=1))


def run_script(script: Path, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Run ``script`` (from the repository root) with ``args``; return the JSON of the last line it printed as
    ``RESULT {json}``. A failure shows its stderr's Python tracebacks (a crashed rank's peer fills the rest of
    stderr with NCCL heartbeat noise), else the end of its stderr."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, failure_text(done.stderr)
    return json.loads(lines[-1][len("RESULT ") :])


def failure_text(stderr: str, limit: int = 6000) -> str:
    """The Python tracebacks in ``stderr`` (each from ``Traceback`` to the exception line), else its end."""
    blocks, current = [], None
    for line in stderr.splitlines():
        line = re.sub(r"^\[rank\d+\]: ?", "", line)  # torch's per-rank prefix, where it adds one
        if line.startswith("Traceback (most recent call last)"):
            current = [line]
        elif current is not None:
            current.append(line)
            if line and not line.startswith((" ", "\t")):  # the exception line ends the traceback
                blocks.append("\n".join(current))
                current = None
    return ("\n\n".join(blocks) or stderr)[-limit:]


def run_scripts(source: str, runs: dict[str, list[str]], timeout: float = 600) -> dict[str, Any]:
    """Write ``source`` to a scratch script and :func:`run_script` it once per entry of ``runs`` (name: its
    arguments), each in its own process (megatron-core's global state is per process); the results by name."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "fit.py"
        script.write_text(source)
        return {name: run_script(script, *args, timeout=timeout) for name, args in runs.items()}
