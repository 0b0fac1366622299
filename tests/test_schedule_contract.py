"""The schedule contract (``lightning_megatron.pipeline.Schedule``): a schedule written against it alone,
registered from outside the package (``schedule_contract_cases.GPipe``: every forward, then every backward, over a
transport the context opens), runs at PP2 on real gloo ranks with 1F1B's losses and gradients, and reports its
messages to MegaScan's listeners like the project's own schedules."""

from __future__ import annotations

from typing import Any

import pytest
import schedule_contract_cases as sc
from test_dpp import assert_close

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.pipeline import Schedule, available_schedules, get_schedule, register_schedule, registry


@pytest.fixture
def scratch_registry() -> Any:
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_a_schedule_from_outside_matches_1f1b_at_pp2(ranks: Any) -> None:
    common = dict(pipeline_model_parallel_size=2, model={"num_layers": 4})
    want = ranks.run(2, sc.fit_with, 2, schedule="1f1b", **common)
    got = ranks.run(2, sc.fit_with, 2, schedule=sc.NAME, schedule_options={"transport": "torch"}, **common)
    for rank in range(2):
        assert got[rank]["loss"] and len(got[rank]["loss"]) == len(want[rank]["loss"])
        assert_close(got[rank], want[rank], 1e-6, f"{sc.NAME} rank {rank}")


@pytest.mark.usefixtures("scratch_registry")
def test_the_contracts_defaults_and_checks_reach_the_user() -> None:
    sc.register()
    assert sc.NAME in available_schedules() and isinstance(get_schedule(sc.NAME), Schedule)
    with pytest.raises(MegatronConfigError, match="pipeline_model_parallel_size >= 2"):
        MegatronAppStrategy(schedule=sc.NAME)
    with pytest.raises(MegatronConfigError, match="'transport' only"):
        MegatronAppStrategy(schedule=sc.NAME, pipeline_model_parallel_size=2, schedule_options={"polcy": 1})
    with pytest.raises(MegatronConfigError, match="one model chunk per rank"):
        get_schedule(sc.NAME).validate(pipeline=2, virtual=2)

    class Bare(Schedule):
        name = "test-bare"

    bare = register_schedule(Bare())
    assert bare.data_parallel_shard(None, 1, 4) == (1, 4)
    assert bare.check_microbatches(3, 2, None) is None
    with pytest.raises(MegatronConfigError, match="takes no schedule_options"):
        bare.options({"x": 1})
    with pytest.raises(NotImplementedError, match="open"):
        bare.open(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Schedule subclass"):
        register_schedule("test-nothing")
    with pytest.raises(TypeError, match="Schedule or a name"):
        register_schedule(3)  # type: ignore[arg-type]
