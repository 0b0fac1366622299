"""The transport conformance suite: every transport passes the same cases, on real forked ranks over gloo.

Parametrized over :data:`TRANSPORTS`. A transport whose Python module does not exist yet is skipped with a
TEMPORARY reason (the native ``shm``/``tcp``/``rdma`` are being written); once the module exists, any import
error fails. ``rdma`` is skipped with the reason the transport gives where it cannot run (no RDMA device), ``ucx``
where its extra (UCX's libraries) is not installed.
The per-rank bodies are in ``transport_cases.py``; peer-death cases run in their own fresh rank pair
(``may_die``), and the network-namespace case in a pair whose ranks sit in two namespaces joined by a veth pair.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import transport_cases as tc
from distributed import WorkerGroup, free_port

from lightning_megatron.errors import MegatronConfigError, TransportUsageError
from lightning_megatron.transport import available_transports, create_transport
from lightning_megatron.transport import header as hdr

TRANSPORTS = ["torch", "shm", "tcp", "rdma", "ucx", "shm+delay", "ucx+pull"]
OPTIONAL = {"ucx": "ucx", "ucx+pull": "ucx"}  # listed by available_transports() only where its extra is installed
MODULES = {name: f"lightning_megatron.transport.{'torch_p2p' if name == 'torch' else name}" for name in TRANSPORTS}
MODULES["shm+delay"] = "lightning_megatron.transport.delay"  # shm behind link jitter (transport_cases.JitteryShm)
MODULES["ucx+pull"] = "lightning_megatron.transport.ucx"  # ucx's GPU receive path on host memory (tc.UcxPulls)
MiB = 1 << 20

_reasons: dict[str, Optional[str]] = {}


def require(name: str, ranks: Any) -> None:
    """Skip while the transport's module is not written; skip rdma where it says it cannot run, ucx where its
    extra is not installed."""
    if importlib.util.find_spec(MODULES[name]) is None:
        pytest.skip(f"TEMPORARY: {MODULES[name]} does not exist yet (native transports in progress)")
    if name in OPTIONAL and OPTIONAL[name] not in available_transports():
        pytest.skip(f"{name} is not installed here: pip install 'lightning-megatron[{OPTIONAL[name]}]'")
    if name == "rdma":
        if name not in _reasons:
            _reasons[name] = next((r for r in ranks.run(2, tc.probe, name, timeout=60) if r), None)
        if _reasons[name]:
            pytest.skip(f"rdma cannot run here: {_reasons[name]}")


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, ranks: Any) -> str:
    require(request.param, ranks)
    return request.param


# -- the contract, per transport ----------------------------------------------------------------------------------


def test_in_order_tags(ranks: Any, transport: str) -> None:
    assert ranks.run(2, tc.in_order, transport) == [20, 20]


def test_out_of_order_tags(ranks: Any, transport: str) -> None:
    ranks.run(2, tc.out_of_order, transport)


def test_fifo_per_peer_and_tag(ranks: Any, transport: str) -> None:
    ranks.run(2, tc.fifo, transport)


def test_peers_are_independent(ranks: Any, transport: str) -> None:
    assert ranks.run(3, tc.peers_independent, transport) == [2, 2, 2]


def test_every_dtype_bit_exact(ranks: Any, transport: str) -> None:
    names = ranks.run(2, tc.dtypes, transport)[0]
    assert len(names) == len(hdr.DTYPE_CODES) >= 30


def test_shapes_and_noncontiguous(ranks: Any, transport: str) -> None:
    assert ranks.run(2, tc.shapes, transport) == [len(tc.shape_cases())] * 2


def test_sizes(ranks: Any, transport: str) -> None:
    ranks.run(2, tc.sizes, transport)


def test_256_mib_message(ranks: Any, transport: str) -> None:
    ranks.run(2, tc.big_message, transport, 256 * MiB, timeout=180)


def test_concurrent_sends_both_ways(ranks: Any, transport: str) -> None:
    assert ranks.run(2, tc.both_ways, transport) == [200, 200]


def test_burst_larger_than_any_ring(ranks: Any, transport: str) -> None:
    sender, _ = ranks.run(2, tc.burst, transport, 64, 4 * MiB, timeout=180)
    assert sender["posted_s"] < 30  # isend returned for all 64 before anything was received


def test_completion_tracking(ranks: Any, transport: str) -> None:
    ranks.run(2, tc.completion, transport)


def test_recv_timeout(ranks: Any, transport: str) -> None:
    ranks.run(2, tc.timeouts, transport)


def test_bad_input(ranks: Any, transport: str) -> None:
    out = ranks.run(2, tc.bad_input, transport)[0]
    assert "connect([1])" in out["unconnected"]


def test_peer_closed_raises_peer_lost(ranks: Any, transport: str) -> None:
    survivor = ranks.run(2, tc.peer_closed, transport)[0]
    assert survivor["recv"] == "PeerLost", survivor
    assert survivor["recv_s"] < 10, survivor
    assert "rank 1" in survivor["recv_message"], survivor


def test_wait_any_out_of_order(ranks: Any, transport: str) -> None:
    out = ranks.run(2, tc.any_out_of_order, transport)[0]
    assert out["waited_s"] < 5, out


def test_wait_any_timeout_and_bad_keys(ranks: Any, transport: str) -> None:
    out = ranks.run(2, tc.any_timeout_and_checks, transport)[0]
    assert out["poll_any_s"] < 0.1, out  # never blocks
    assert "(peer, tag)" in out["empty"], out


def test_wait_any_peer_closed_raises_peer_lost(ranks: Any, transport: str) -> None:
    survivor = ranks.run(2, tc.any_peer_closed, transport)[0]
    assert survivor["wait_any"] == "PeerLost", survivor
    assert survivor["wait_any_s"] < 10, survivor
    assert "rank 1" in survivor["message"] and "42" in survivor["message"], survivor
    assert survivor["poll_any"] == "PeerLost", survivor


def test_peer_death(transport: str, tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    group = WorkerGroup(2, tmp_path)  # a pair of its own: rank 1 dies
    try:
        survivor, victim = group.run(tc.peer_death, transport, may_die={1}, timeout=90)
    finally:
        group.shutdown(kill=True)
    # multiprocessing's named semaphores (sem.mp-*) belong to whatever other Python process runs on the machine
    left = sorted(name for name in set(os.listdir("/dev/shm")) - before if not name.startswith("sem.mp-"))
    assert not left, f"shared memory left behind in /dev/shm: {left}"
    assert victim is None, "rank 1 was meant to die"
    assert survivor["recv"] == "PeerLost", survivor
    assert survivor["recv_s"] < 8, (
        f"PeerLost came {survivor['recv_s']:.1f} s after the wait began"
    )  # 0.5 s is the victim's
    assert "rank 1" in survivor["recv_message"] and "99" in survivor["recv_message"], survivor["recv_message"]
    # The transport has just reported rank 1 lost: a send to it must fail (in isend or its handle), not "complete".
    assert survivor["send"] in ("PeerLost", "TransportError"), f"isend to a lost peer: {survivor}"
    assert survivor["send_s"] < 8, survivor
    assert survivor["close_s"] < 8, survivor


# -- transport-independent --------------------------------------------------------------------------------------


def test_unknown_transport_name() -> None:
    assert set(TRANSPORTS) - set(OPTIONAL) <= set(available_transports())
    with pytest.raises(MegatronConfigError, match="carrier-pigeon.*choose one of.*torch"):
        create_transport("carrier-pigeon")


def test_header_round_trip() -> None:
    codes = list(hdr.DTYPE_CODES.values())
    assert len(set(codes)) == len(codes)
    assert hdr.DTYPE_CODES[torch.float32] == 12 and hdr.DTYPE_CODES[torch.bfloat16] == 11  # wire codes are stable
    for tensor in [torch.tensor(1.5), torch.empty(0, 3, dtype=torch.int8), torch.ones(2, 3, 4, dtype=torch.bool)]:
        words = hdr.encode(2**63 - 1, tensor)
        assert len(words) == hdr.HEADER_WORDS and len(hdr.pack(words)) == hdr.HEADER_BYTES
        header = hdr.unpack(hdr.pack(words))
        assert (header.tag, header.dtype, header.shape, header.nbytes, header.kind) == (
            2**63 - 1,
            tensor.dtype,
            tuple(tensor.shape),
            tensor.numel() * tensor.element_size(),
            hdr.KIND_DATA,
        )
        data = hdr.as_bytes(tensor.contiguous())
        assert torch.equal(hdr.from_bytes(data.clone(), header), tensor)
    assert hdr.decode(hdr.encode(5, None, hdr.KIND_CLOSE)).kind == hdr.KIND_CLOSE
    words = hdr.encode(1, torch.ones(4))
    with pytest.raises(ValueError, match="not a transport header"):
        hdr.decode([0, *words[1:]])
    with pytest.raises(ValueError, match="not 16 bytes|is not"):
        hdr.decode(words[:4] + [17] + words[5:])  # nbytes that do not match the shape
    with pytest.raises(TransportUsageError, match="int_repr"):
        hdr.dtype_code(torch.qint8)


# -- torch-specific ---------------------------------------------------------------------------------------------


def test_torch_messages_never_mix_with_default_group_p2p(ranks: Any) -> None:
    ranks.run(2, tc.torch_backends_isolated)


def test_torch_bad_config(ranks: Any) -> None:
    out = ranks.run(2, tc.torch_bad_config)[0]
    assert "device=" in out["gloo+cuda"]


def _spawned_rank(rank: int, port: int, fn: Any, args: tuple, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    try:
        out.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001
        out.put((rank, False, traceback.format_exc()[-4000:]))


def run_spawned_pair(fn: Any, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Two fresh spawned ranks (CUDA does not survive fork): ``fn(*args)`` on each, results in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(r, port, fn, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(2):
            rank, ok, payload = out.get(timeout=timeout)
            assert ok, f"rank {rank} failed:\n{payload}"
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return [results[0], results[1]]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one node (NCCL)")
def test_torch_over_nccl() -> None:
    counts = run_spawned_pair(tc.cuda_cases, "torch")
    assert counts[0] == counts[1] == len(hdr.DTYPE_CODES) + 7


# -- TCP between two network namespaces -------------------------------------------------------------------------

CLONE_NEWNET = 0x40000000
CLONE_NEWNS, MS_REC, MS_SLAVE, MNT_DETACH = 0x00020000, 0x4000, 0x80000, 2


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def veth_namespaces() -> Iterator[tuple[list[str], list[str], list[str]]]:
    """Two fresh network namespaces joined by a veth pair (10.213.7.1 <-> 10.213.7.2); always removed."""
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root; loopback is covered by the main suite")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed; loopback is covered by the main suite")
    tag = f"lmt{os.getpid() % 100000}"
    names, veths, addrs = [f"{tag}a", f"{tag}b"], [f"{tag}va", f"{tag}vb"], ["10.213.7.1", "10.213.7.2"]
    steps = [
        ("netns", "add", names[0]),
        ("netns", "add", names[1]),
        ("link", "add", veths[0], "type", "veth", "peer", "name", veths[1]),
        *[("link", "set", veths[i], "netns", names[i]) for i in range(2)],
        *[("-n", names[i], "addr", "add", f"{addrs[i]}/30", "dev", veths[i]) for i in range(2)],
        *[("-n", names[i], "link", "set", dev, "up") for i in range(2) for dev in (veths[i], "lo")],
    ]
    try:
        for step in steps:
            result = _ip(*step)
            if result.returncode:
                pytest.skip(f"cannot create network namespaces here (ip {' '.join(step)}: {result.stderr.strip()})")
        yield names, veths, addrs
    finally:
        for name in names:
            _ip("netns", "del", name)
        _ip("link", "del", veths[0])  # only there if it never moved into its namespace


def _enter_netns(name: str, own_sysfs: bool = False) -> None:
    """Join network namespace ``name``. ``own_sysfs``: also show its interfaces in /sys/class/net, as ``ip netns
    exec`` does (a private mount namespace with sysfs mounted again): UCX lists network devices from there, and a
    real second host has its own /sys."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")
    finally:
        os.close(fd)
    if own_sysfs:
        steps = [
            lambda: libc.unshare(CLONE_NEWNS),
            lambda: libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None),  # nothing leaks back to the host
            lambda: libc.umount2(b"/sys", MNT_DETACH),
            lambda: libc.mount(name.encode(), b"/sys", b"sysfs", 0, None),
        ]
        for step in steps:
            if step() != 0:
                raise OSError(ctypes.get_errno(), f"cannot mount a sysfs of network namespace {name}")


def _tx_bytes(namespace: str, dev: str) -> int:
    result = _ip("-n", namespace, "-s", "-j", "link", "show", "dev", dev)
    return int(json.loads(result.stdout)[0]["stats64"]["tx"]["bytes"])


@pytest.mark.parametrize("name", ["tcp", "torch", "ucx"])
def test_across_network_namespaces(name: str, ranks: Any, tmp_path: Path) -> None:
    """One rank in each of two network namespaces: the store and the transport cross the veth pair (ucx: over
    TCP, as between two hosts without InfiniBand; UCX's shared memory cannot cross network namespaces anyway)."""
    require(name, ranks)
    with veth_namespaces() as (names, veths, addrs):

        def enter(rank: int) -> dict[str, str]:  # runs in the forked rank, before anything opens a socket
            _enter_netns(names[rank], own_sysfs=name == "ucx")
            env = {"MASTER_ADDR": addrs[0], "GLOO_SOCKET_IFNAME": veths[rank], "LM_TEST_NETNS": names[rank]}
            return {**env, "UCX_TLS": "tcp"} if name == "ucx" else env

        sent_before = _tx_bytes(names[0], veths[0])
        group = WorkerGroup(2, tmp_path, rank_setup=enter)
        try:
            results = group.run(tc.across_namespaces, name, timeout=90)
        finally:
            group.shutdown()
        sent = _tx_bytes(names[0], veths[0]) - sent_before
    own_netns = os.readlink("/proc/self/ns/net")
    assert len({own_netns, results[0]["netns"], results[1]["netns"]}) == 3, results  # three different namespaces
    assert sent >= results[0]["sent_bytes"], f"only {sent} bytes left rank 0's veth; it sent {results[0]['sent_bytes']}"
