"""Two "hosts" on one machine: two network namespaces joined by a veth pair (root only; skipped otherwise).

A fit at TP2 × PP2 spans both (2 ranks each, the pipeline boundary between them), launched as a cluster would:
``torchrun --nnodes 2`` on each host, or one process per rank with SLURM's variables (Lightning's
``SLURMEnvironment``). Checked: every rank exits 0 with the same losses as the same fit on one host, gradients and
activations really crossed the veth pair, and MegaScan's four rank files merge into one timeline with every
pipeline message paired.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import free_port
from test_transport import _tx_bytes, veth_namespaces

from lightning_megatron.scan.analysis.aggregate import aggregate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "multinode_fit.py")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out.decode(errors="replace")[-3000:])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out
    return outputs


def _check(tmp_path: Path, sent: int) -> list[dict]:
    records = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in records] == [0, 0, 1, 1]
    assert all(len(r["losses"]) == 3 and r["losses"] == records[0]["losses"] for r in records), records
    assert sent > 100_000, f"only {sent} bytes crossed the veth pair"  # stage 0 -> stage 1, every step
    summary = aggregate(tmp_path / "trace", tmp_path / "merged.json.gz", progress=False)
    assert summary["ranks_present"] == 4 and summary["missing_ranks"] == [] and summary["clock_missing_ranks"] == []
    flows = summary["flows"]
    # 2 traced steps x 8 microbatches x 2 directions x 2 TP ranks cross the pipeline boundary (between the hosts)
    assert flows["p2p"] == 2 * 8 * 2 * 2 and flows["unmatched_sends"] == flows["unmatched_recvs"] == 0, flows
    return records


@pytest.fixture(scope="module")
def one_host_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    tmp = tmp_path_factory.mktemp("one-host")
    (tmp / "out").mkdir()
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
             SCRIPT, str(tmp / "out"), str(tmp / "trace")],
            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for node in range(2)
    ]  # fmt: skip
    _finish(procs)
    return json.loads((tmp / "out" / "rank0.json").read_text())["losses"]


def test_torchrun_across_two_hosts(tmp_path: Path, one_host_losses: list[float]) -> None:
    (tmp_path / "out").mkdir()
    with veth_namespaces() as (names, veths, addrs):
        port = str(free_port())
        before = _tx_bytes(names[0], veths[0])
        procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", names[node], sys.executable, "-m", "torch.distributed.run",
                 "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                 "--master-addr", addrs[0], "--master-port", port,
                 SCRIPT, str(tmp_path / "out"), str(tmp_path / "trace")],
                env=_env(GLOO_SOCKET_IFNAME=veths[node]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
            for node in range(2)
        ]  # fmt: skip
        _finish(procs)
        sent = _tx_bytes(names[0], veths[0]) - before
    records = _check(tmp_path, sent)
    assert records[0]["losses"] == one_host_losses
    assert {r["environment"] for r in records} == {"TorchElasticEnvironment"}


def test_slurm_variables_across_two_hosts(tmp_path: Path, one_host_losses: list[float]) -> None:
    (tmp_path / "out").mkdir()
    with veth_namespaces() as (names, veths, addrs):
        port = str(free_port())
        before = _tx_bytes(names[0], veths[0])
        procs = []
        for rank in range(4):
            node = rank // 2
            slurm = dict(
                SLURM_JOB_ID="4242", SLURM_JOB_NAME="lightning-megatron", SLURM_NTASKS="4", SLURM_NNODES="2",
                SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2),
                SLURM_NODEID=str(node), SLURM_NODELIST="host[0-1]", MASTER_ADDR=addrs[0], MASTER_PORT=port,
                GLOO_SOCKET_IFNAME=veths[node],
            )  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        names[node],
                        sys.executable,
                        SCRIPT,
                        str(tmp_path / "out"),
                        str(tmp_path / "trace"),
                    ],
                    env=_env(**slurm),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
        _finish(procs)
        sent = _tx_bytes(names[0], veths[0]) - before
    records = _check(tmp_path, sent)
    assert records[0]["losses"] == one_host_losses
    assert {r["environment"] for r in records} == {"SLURMEnvironment"}
