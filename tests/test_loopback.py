"""Nothing the project starts on one node listens beyond loopback: fits with and without MegaScope, a served
model at a two-process layout, the transports, TensorBoard with the plugin. Each starts for real (forked gloo
ranks; TensorBoard as its own process) and every listening TCP socket or bound UDP socket of its processes is
checked. Processes also end cleanly: no rank outlives the process group's store (the message NCCL's watchdog
logs when it does is looked for in the ranks' logs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import WorkerGroup
from loopback_cases import fit_sockets, listening, serve_sockets, transport_sockets

import lightning_megatron.strategy  # noqa: F401  (imported before the ranks fork)
from lightning_megatron.loopback import is_loopback

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_ranks(tmp_path_factory: pytest.TempPathFactory):
    """Two ranks of their own: no other test's process group (or its store) in them."""
    group = WorkerGroup(2, log_dir=tmp_path_factory.mktemp("loopback-logs"))
    yield group
    group.shutdown()


def exposed(sockets: list) -> list:
    return [s for s in sockets if not is_loopback(s[1])]


def test_loopback_address_check():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")


def test_fits_listen_on_loopback_only(fresh_ranks):
    for scope in (False, True):
        per_rank = fresh_ranks.run(fit_sockets, 2, scope, timeout=300)
        assert all(per_rank), "the ranks listen on something (the store, gloo's pairs)"
        assert [exposed(s) for s in per_rank] == [[], []], (scope, per_rank)
    assert any(s[2] == fresh_ranks.port for s in per_rank[0]), "rank 0 hosts the store, on loopback"


def test_served_model_listens_on_loopback_only(fresh_ranks):
    per_rank = fresh_ranks.run(serve_sockets, 2, tensor_model_parallel_size=2, timeout=300)
    assert [exposed(s) for s in per_rank] == [[], []], per_rank


def test_transports_listen_on_loopback_only(fresh_ranks):
    fresh_ranks.run(fit_sockets, 2, False, timeout=300)  # the strategy's process group, as a fit makes it
    per_rank = fresh_ranks.run(transport_sockets, ["tcp", "shm", "ucx"], timeout=300)
    for name in ("tcp", "shm", "ucx"):
        for rank, seen in enumerate(per_rank):
            if isinstance(seen[name], str):
                continue  # not on this machine
            assert exposed(seen[name]) == [], (name, rank, seen[name])
    assert not isinstance(per_rank[0]["tcp"], str), "the tcp transport is always there"


EXITING_RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from lightning_megatron.strategy import rendezvous
rank, port = int(sys.argv[1]), int(sys.argv[2])
rendezvous.init_process_group("gloo", rank=rank, world_size=2, num_nodes=1, main_address="127.0.0.1",
                              main_port=port, timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(1))
if rank == 1:
    time.sleep(3)  # still using the process group while rank 0 is already done
print("released", time.time(), flush=True)
"""


def test_rank_zero_keeps_the_store_until_the_others_released_it(tmp_path):
    """At exit every rank destroys its process group and tells the store; rank 0, which hosts it, waits for that,
    so no rank's watchdog polls a store that is gone (NCCL logs 'TCPStore server has shut down too early')."""
    from distributed import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", EXITING_RANK, str(rank), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    ended = [0.0, 0.0]
    deadline = time.monotonic() + 180
    while any(e == 0.0 for e in ended) and time.monotonic() < deadline:
        for rank, process in enumerate(ranks):
            if not ended[rank] and process.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.02)
    outputs = [process.communicate(timeout=30)[0] for process in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    released = float(outputs[1].split("released", 1)[1].split()[0])
    assert ended[0] >= released, ("rank 0 (the store) ended before rank 1 released it", ended, released, outputs)
    assert "shut down too early" not in "".join(outputs) and "should dump" not in "".join(outputs), outputs


def test_tensorboard_with_the_plugin_listens_on_loopback_only(tmp_path):
    pytest.importorskip("tensorboard")
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--port", "0"]
    log = (tmp_path / "tensorboard.log").open("w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        deadline, seen = time.monotonic() + 120, []
        while not seen and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.5)
            seen = listening(process.pid)
        assert seen, (tmp_path / "tensorboard.log").read_text()[-2000:]
        assert exposed(seen) == [], seen
    finally:
        process.terminate()
        process.wait(30)
        log.close()
