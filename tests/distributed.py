"""Real multi-process tests on CPU: groups of forked ranks over gloo on 127.0.0.1.

Ranks are forked from the pytest process, which has already imported torch, Lightning and
megatron-core, so a group starts in well under a second (spawning fresh interpreters costs 6-15 s a
scenario). A group stays alive and runs case after case (``WorkerGroup.run``); every case runs on all
ranks, and its per-rank return values come back to the test. A case that fails or exceeds its timeout
gets its tracebacks and the tail of each rank's log attached to the error, and the group is replaced
by a fresh one (new processes, new port) before the next case, so one dead rank cannot hang the suite
or poison later cases.

Two options serve cases that need more than a plain group: ``WorkerGroup(..., rank_setup=fn)`` runs ``fn(rank)``
in each forked rank before it reads its first case (to enter a network namespace, say) and applies the
environment variables it returns; ``run(..., may_die={r})`` lets rank ``r`` die during the case (a peer-death
test), returns ``None`` for it, and retires the group afterwards.

Ranks see the environment Lightning's external launchers (torchrun, SLURM) provide, so a
``Trainer(devices=world_size)`` inside a case joins the group like a torchrun-launched job.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Optional

__all__ = ["CaseFailed", "WorkerGroup", "free_port"]


class CaseFailed(AssertionError):
    """A distributed case raised on some rank, or did not finish in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the pytest process dies, so no orphaned ranks survive it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(
    rank: int,
    world_size: int,
    port: int,
    tasks: Any,
    results: Any,
    log_path: str,
    rank_setup: Optional[Callable[[int], Optional[dict[str, str]]]] = None,
) -> None:
    _die_with_parent()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # pytest's capture replaces sys.stdout/err with objects writing to its own files: point Python's streams at
    # the log too, or a failed case's log tail comes back empty and its output lands in some test's capture.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        CUDA_VISIBLE_DEVICES="",
    )
    if rank_setup is not None:
        os.environ.update(rank_setup(rank) or {})
    import torch

    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            break
        case_id, fn, args, kwargs = task
        print(f"===== case {case_id}: {getattr(fn, '__qualname__', fn)}", flush=True)
        try:
            results.put((case_id, rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001  (report everything, including SystemExit)
            results.put((case_id, rank, False, traceback.format_exc()[-6000:]))


class WorkerGroup:
    """``world_size`` forked ranks that run cases one after another."""

    _case_ids = itertools.count(1)

    def __init__(
        self,
        world_size: int,
        log_dir: Optional[Path] = None,
        rank_setup: Optional[Callable[[int], Optional[dict[str, str]]]] = None,
    ) -> None:
        self.world_size = world_size
        self.port = free_port()
        # a folder of its own is removed at shutdown (a failed case already quoted the logs' tails)
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"lm-ranks{world_size}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ctx = mp.get_context("fork")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, self.port, self._tasks[r], self._results, str(self.log_path(r)), rank_setup),
                # Not daemonic: megatron-core's checkpoint writer forks helper processes.
                name=f"rank{r}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        atexit.register(self.shutdown, kill=True)
        self.broken = False

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"port{self.port}-rank{rank}.log"

    def _log_tail(self, rank: int, start: int, limit: int = 4000) -> str:
        try:
            with open(self.log_path(rank), "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return text[-limit:]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 120.0,
        may_die: Collection[int] = (),
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Ranks in ``may_die`` may exit during the case (their result is ``None``); if any did, the group is shut
        down afterwards (its survivors share a process group with a dead rank)."""
        if self.broken:
            raise RuntimeError("this worker group was shut down after a failed case")
        case_id = next(self._case_ids)
        offsets = [self.log_path(r).stat().st_size if self.log_path(r).exists() else 0 for r in range(self.world_size)]
        for tasks in self._tasks:
            tasks.put((case_id, fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        died: set[int] = set()
        while len(outcomes) + len(died) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in outcomes]
            died.update(r for r in dead if r in may_die)
            if remaining <= 0 or set(dead) - set(may_die):
                break
            if any(not ok for ok, _ in outcomes.values()):
                # Peers of a failed rank may block in a collective: give them a moment, then stop.
                remaining = min(remaining, 5.0)
                deadline = min(deadline, time.monotonic() + remaining)
            try:
                cid, rank, ok, payload = self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if cid == case_id:
                outcomes[rank] = (ok, payload)
        if len(outcomes) + len(died) == self.world_size and all(ok for ok, _ in outcomes.values()):
            results = [outcomes[r][1] if r in outcomes else None for r in range(self.world_size)]
            if died:
                self.shutdown(kill=True)
            return results
        self.shutdown(kill=True)
        report = []
        for r in range(self.world_size):
            ok, payload = outcomes.get(r, (None, "no result (timed out, or blocked behind a failed peer)"))
            if ok:
                continue
            report.append(f"--- rank {r}: {payload}\n--- rank {r} log tail:\n{self._log_tail(r, offsets[r])}")
        raise CaseFailed(
            f"case {getattr(fn, '__qualname__', fn)} failed on {self.world_size} ranks:\n" + "\n".join(report)
        )

    def shutdown(self, kill: bool = False) -> None:
        if self.broken:
            return
        self.broken = True
        if not kill:
            for tasks in self._tasks:
                tasks.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)


class WorkerPool:
    """One live group per world size, replaced when a case breaks it."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._groups: dict[int, WorkerGroup] = {}

    def group(self, world_size: int) -> WorkerGroup:
        group = self._groups.get(world_size)
        if group is None or group.broken:
            group = self._groups[world_size] = WorkerGroup(world_size, self.log_dir)
        return group

    def run(
        self, world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        return self.group(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for group in self._groups.values():
            group.shutdown()
