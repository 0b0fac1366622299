"""Single-process unit tests (no Trainer, no process group) of pipeline/registry.py: the registry of schedules by name,
and the layout and microbatch checks of the built-in ones."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import pytest

from lightning_megatron import MegatronAppStrategy, MegatronConfigError
from lightning_megatron.pipeline import available_schedules, get_schedule, register_schedule, registry
from lightning_megatron.pipeline.megatron_schedules import Interleaved, OneFOneB


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """Schedules registered by a test are removed afterwards, and built-ins restored if overridden."""
    saved = dict(registry._REGISTRY)
    yield
    for name in set(registry._REGISTRY) - set(saved):
        del registry._REGISTRY[name]
    registry._REGISTRY.update(saved)


def _fake_schedule(**kwargs: Any) -> list:
    return []


def _other_schedule(**kwargs: Any) -> list:
    return [1]


def test_builtin_schedules_registered() -> None:
    """Importing the package registers megatron-core's two schedules under their documented names."""
    assert {"1f1b", "interleaved"} <= set(available_schedules())
    assert isinstance(get_schedule("1f1b"), OneFOneB)
    assert get_schedule("1f1b").virtual_stages is False
    assert isinstance(get_schedule("interleaved"), Interleaved)
    assert get_schedule("interleaved").virtual_stages is True


@pytest.mark.usefixtures("scratch_registry")
def test_register_get_available() -> None:
    entry = register_schedule("test-sched_a", _fake_schedule, virtual_stages=True, description="for tests")
    assert get_schedule("test-sched_a") is entry
    assert entry.forward_backward is _fake_schedule and entry.virtual_stages and entry.description == "for tests"
    names = available_schedules()
    assert "test-sched_a" in names and names == sorted(names)


@pytest.mark.usefixtures("scratch_registry")
def test_register_duplicate_and_override() -> None:
    """A name clash is refused unless override=True, which replaces the entry."""
    register_schedule("test-dup", _fake_schedule)
    with pytest.raises(ValueError, match="already registered.*override=True"):
        register_schedule("test-dup", _other_schedule)
    assert get_schedule("test-dup").forward_backward is _fake_schedule
    register_schedule("test-dup", _other_schedule, override=True)
    assert get_schedule("test-dup").forward_backward is _other_schedule


@pytest.mark.usefixtures("scratch_registry")
@pytest.mark.parametrize("name", ["", "two words", "a/b", "x!"])
def test_register_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="identifiers"):
        register_schedule(name, _fake_schedule)
    assert name not in registry._REGISTRY


@pytest.mark.usefixtures("scratch_registry")
def test_unknown_schedule_lists_registered_names() -> None:
    register_schedule("test-listed", _fake_schedule)
    with pytest.raises(MegatronConfigError, match="Unknown pipeline schedule 'nope'") as info:
        get_schedule("nope")
    for name in ("1f1b", "interleaved", "test-listed"):
        assert name in str(info.value)


def test_interleaved_without_virtual_stages_is_refused_at_any_pipeline_size() -> None:
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size"):
        MegatronAppStrategy(schedule="interleaved")


def test_schedule_validate_virtual_stages() -> None:
    """Interleaved needs a virtual size (at PP > 1); 1F1B refuses one. Each message points to the other."""
    one_f, inter = get_schedule("1f1b"), get_schedule("interleaved")
    inter.validate(pipeline=2, virtual=2)
    one_f.validate(pipeline=2, virtual=None)
    one_f.validate(pipeline=1, virtual=None)
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size") as info:
        inter.validate(pipeline=2, virtual=None)
    assert "1f1b" in str(info.value)
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size=2") as info:
        one_f.validate(pipeline=2, virtual=2)
    assert "interleaved" in str(info.value)


@pytest.mark.parametrize(
    ("count", "fragment"),
    [(1, "at least pipeline_model_parallel_size=2"), (3, "multiple of pipeline_model_parallel_size=2")],
)
def test_interleaved_microbatch_counts(count: int, fragment: str) -> None:
    with pytest.raises(MegatronConfigError, match=fragment) as info:
        get_schedule("interleaved").validate_microbatches(count, pipeline=2, virtual=2)
    assert f"cannot run {count} microbatches" in str(info.value) and "micro_batch_size" in str(info.value)


def test_microbatch_counts_accepted() -> None:
    """Interleaved takes multiples of PP; 1F1B takes any positive count; nobody takes zero."""
    for count in (2, 4, 6):
        get_schedule("interleaved").validate_microbatches(count, pipeline=2, virtual=2)
    get_schedule("interleaved").validate_microbatches(8, pipeline=4, virtual=2)
    with pytest.raises(MegatronConfigError, match="multiple of pipeline_model_parallel_size=4"):
        get_schedule("interleaved").validate_microbatches(6, pipeline=4, virtual=2)
    for count in (1, 3, 7):
        get_schedule("1f1b").validate_microbatches(count, pipeline=2, virtual=None)
    for name in ("1f1b", "interleaved"):
        with pytest.raises(MegatronConfigError, match="at least one microbatch"):
            get_schedule(name).validate_microbatches(0, pipeline=2, virtual=None)


@pytest.mark.usefixtures("scratch_registry")
def test_custom_microbatch_check_reason_is_reported() -> None:
    """A plugged-in schedule's own reason reaches the user in the error."""
    seen: list[tuple[int, int, Optional[int]]] = []

    def even_only(n: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        seen.append((n, pipeline, virtual))
        return None if n % 2 == 0 else "this schedule wants an even count"

    schedule = register_schedule("test-even", _fake_schedule, check_microbatches=even_only)
    schedule.validate_microbatches(4, pipeline=3, virtual=None)
    with pytest.raises(MegatronConfigError, match="wants an even count"):
        schedule.validate_microbatches(5, pipeline=3, virtual=None)
    assert seen == [(4, 3, None), (5, 3, None)]
