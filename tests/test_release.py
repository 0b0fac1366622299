"""What a fit leaves behind in a long-lived process (real gloo ranks that run one fit after another).

* The DDP wrappers, their gradient buffers and the optimizer are freed when the fit ends, by reference counting,
  while the caller still holds the module (before, they lived until the garbage collector's next full pass,
  held by megatron-core's model config and the parameters' hooks: forty fits ran a GPU out of memory).
* Process groups of earlier fits do not pile up: each fit's gloo groups (a loop thread each) used to live on in
  reference cycles, ~50 threads per layout per rank, hundreds over a test session.
"""

from __future__ import annotations

from typing import Any

import pytest
import release_cases as rc


@pytest.mark.parametrize(
    "strategy",
    [
        {"pipeline_model_parallel_size": 2},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True},
        {"precision": "bf16-mixed", "use_distributed_optimizer": True},  # fp32 master copies on the parameters
        {"precision": "bf16-mixed", "pipeline_model_parallel_size": 2},
    ],
    ids=["pp2", "dp2-distopt-overlap", "bf16-distopt", "bf16-pp2"],
)
def test_training_state_is_freed_when_the_fit_ends(ranks: Any, strategy: dict[str, Any]) -> None:
    for rank, seen in enumerate(ranks.run(2, rc.fit_and_look, 2, **strategy)):
        assert seen["alive"] == {"ddp": 0, "optimizer": 0}, (rank, seen)
        assert seen["main_grads"] == 0 and seen["config_hooks"] == [], (rank, seen)


def test_process_groups_do_not_pile_up(ranks: Any) -> None:
    layouts = [
        {"pipeline_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2},
        {"use_distributed_optimizer": True},
        {"pipeline_model_parallel_size": 2, "schedule": "dpp", "schedule_options": {"transport": "torch"}},
        {"pipeline_model_parallel_size": 2},
    ]
    counts = [ranks.run(2, rc.threads_after, 2, **layout) for layout in layouts]
    for rank in range(2):
        mine = [c[rank] for c in counts]
        assert max(mine) - min(mine) <= 8, f"rank {rank}: threads after each fit {mine}"
