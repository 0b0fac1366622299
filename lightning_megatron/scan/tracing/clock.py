"""Each rank's clock offset to rank 0, measured NTP-style over a gloo group.

Ranks on different hosts have unrelated monotonic clocks, and even one host's ranks start their traces at
different moments; laying iterations end to end (what MegatronApp does) hides exactly the skew a slow rank
causes. So every rank measures: rank 0 answers ``rounds`` pings from each rank in turn; from the four
timestamps of a round trip (client send t0, server receive t1, server send t2, client receive t3) the
offset is ``((t1 - t0) + (t2 - t3)) / 2`` and the error is at most half the round trip minus the server's
hold time. The round with the smallest round trip wins. Rank 0's offset is 0 by definition.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ClockOffset", "now_us", "measure_offset"]


def now_us() -> float:
    """The clock every MegaScan timestamp is on: the host's monotonic clock, in microseconds."""
    return time.perf_counter_ns() / 1000.0


def clock_domain() -> str:
    """Which monotonic clock :func:`now_us` reads: one per booted kernel (processes in containers and network
    namespaces of one machine share it), so ranks with equal domains need no clock alignment between them.
    A host name is not enough: containers on different machines often share one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return f"host:{socket.gethostname()}"


@dataclass(frozen=True)
class ClockOffset:
    offset_us: float
    """Add to a local timestamp to get rank 0's clock."""
    uncertainty_us: float
    at_us: float
    """Local time of the measurement."""
    round_trips: int


def measure_offset(group: Any, rounds: int = 8) -> ClockOffset:
    """Collective over ``group`` (gloo, every rank of the world): this rank's offset to the group's rank 0."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    at = now_us()
    if world == 1:
        return ClockOffset(0.0, 0.0, at, 0)
    try:
        return _measure(group, rank, world, rounds, at)
    finally:
        # Rank 0 serves the ranks one after another; leaving together keeps that queue out of the next
        # step's timings (the first-served rank would otherwise wait for the last one in its next collective).
        dist.barrier(group=group)


def _measure(group: Any, rank: int, world: int, rounds: int, at: float) -> ClockOffset:
    if rank == 0:
        ping, pong = torch.zeros(1, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        for peer in range(1, world):
            peer_global = dist.get_global_rank(group, peer)
            for _ in range(rounds):
                dist.recv(ping, src=peer_global, group=group)
                pong[0] = now_us()
                pong[1] = now_us()
                dist.send(pong, dst=peer_global, group=group)
        return ClockOffset(0.0, 0.0, at, 0)
    root = dist.get_global_rank(group, 0)
    best: tuple[float, float] = (float("inf"), 0.0)
    ping, pong = torch.zeros(1, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    for _ in range(rounds):
        ping[0] = t0 = now_us()
        dist.send(ping, dst=root, group=group)
        dist.recv(pong, src=root, group=group)
        t3 = now_us()
        t1, t2 = float(pong[0]), float(pong[1])
        delay = (t3 - t0) - (t2 - t1)
        if delay < best[0]:
            best = (delay, ((t1 - t0) + (t2 - t3)) / 2)
    return ClockOffset(best[1], best[0] / 2, at, rounds)
