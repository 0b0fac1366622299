"""Shared fixtures. Importing the package here loads torch, Lightning and megatron-core once, before any
rank is forked, so every forked rank starts with them already imported."""

from __future__ import annotations

import os

import pytest
from distributed import WorkerPool

import lightning_megatron.strategy  # noqa: F401  (import before forking ranks: torch, Lightning, megatron-core)


@pytest.fixture(scope="session")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    """``ranks.run(world_size, fn, *args)`` runs ``fn`` on ``world_size`` forked gloo ranks."""
    pool = WorkerPool(tmp_path_factory.mktemp("rank-logs"))
    yield pool
    pool.close()


# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: a one-node fit points them at loopback (strategy/rendezvous.py); a
# two-"host" test's subprocesses must not inherit that.
_LAUNCHER_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "RANK",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
)


@pytest.fixture(autouse=True)
def launcher_environment_restored():
    """Lightning's launcher writes ``LOCAL_RANK``, ``MASTER_PORT`` and the like into the environment of the process a
    Trainer starts in, and leaves them there (a fit that fails before its processes start does too). A later test
    whose subprocess inherits ``LOCAL_RANK`` takes itself for a launched rank and waits for peers that never start
    (``tests/test_cli.py`` after ``tests/test_graphs.py``: 300 s, then a store timeout). Every test ends with the
    launcher variables it began with."""
    before = {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
