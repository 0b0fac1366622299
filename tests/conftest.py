"""Shared fixtures. Importing the package here loads torch, Lightning and megatron-core once, before any
rank is forked, so every forked rank starts with them already imported."""

from __future__ import annotations

import pytest
from distributed import WorkerPool

import lightning_megatron.strategy  # noqa: F401  (import before forking ranks: torch, Lightning, megatron-core)


@pytest.fixture(scope="session")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    """``ranks.run(world_size, fn, *args)`` runs ``fn`` on ``world_size`` forked gloo ranks."""
    pool = WorkerPool(tmp_path_factory.mktemp("rank-logs"))
    yield pool
    pool.close()
