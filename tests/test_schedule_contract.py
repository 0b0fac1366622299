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


def test_traced_p2p_reports_the_span_and_the_message_to_listeners() -> None:
    """The one tracing helper of every schedule, through the strategy's step events: the span megatron-core would
    name, the message inside it, and nothing at all without listeners."""
    import torch

    from lightning_megatron.pipeline.registry import NO_EVENTS
    from lightning_megatron.pipeline.tracing import traced_p2p
    from lightning_megatron.strategy.listeners import ListenerEvents, StepListener

    class Seen(StepListener):
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def span_start(self, name: str) -> None:
            self.calls.append(("start", name))

        def span_stop(self, name: str) -> None:
            self.calls.append(("stop", name))

        def p2p_messages(self, name: str, sends: list, recvs: list) -> None:
            self.calls.append(("messages", name, sends, recvs))

    listeners: list[StepListener] = []
    events = ListenerEvents(listeners)
    tensor = torch.ones(4)
    assert not events.active
    assert traced_p2p(events, "send", "forward", lambda: tensor, peer=1, seq=7, microbatch=2, stage=0) is tensor
    seen = Seen()
    listeners.append(seen)  # a listener added after the session opened is told too
    traced_p2p(events, "recv", "backward", lambda: tensor, peer=3, seq=9, microbatch=1, stage=1)
    record = {"peer": 3, "bytes": 16, "seq": 9, "direction": "backward", "microbatch": 1, "stage": 1}
    assert seen.calls == [
        ("start", "backward-recv"),
        ("messages", "backward-recv", [], [record]),
        ("stop", "backward-recv"),
    ]
    assert traced_p2p(NO_EVENTS, "send", "forward", lambda: tensor, peer=1, seq=1, microbatch=0, stage=0) is tensor
    with pytest.raises(ValueError, match="direction"):
        traced_p2p(events, "send", "sideways", lambda: tensor, peer=1, seq=1, microbatch=0, stage=0)
