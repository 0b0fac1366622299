"""MegaScan sees the collectives megatron-core hides: sequence parallelism's gathers and scatters inside the linear
layers (bound at import time in ``tensor_parallel.layers``) and the blocked part of asynchronous collectives.

Two forked gloo ranks at TP2 with sequence parallelism: the traced steps must hold tensor-parallel
``all_gather`` and ``reduce_scatter`` spans (before, ``tensor_parallel.layers``' aliases went untraced) and
``collective.wait`` spans for the asynchronous ones, and net compute must take those waits out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cases

from lightning_megatron.scan import MegaScan
from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file


def _fit(trace_dir: str) -> None:
    scan = MegaScan(trace_dir, interval=1, window=1, detect=False)
    cases.fit_gpt(
        2,
        steps=3,
        callbacks=[scan],
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        model={"num_layers": 2},
    )


def test_sequence_parallel_and_async_collectives_are_traced(ranks: Any, tmp_path: Path) -> None:
    ranks.run(2, _fit, str(tmp_path / "trace"))
    files = list_rank_files(tmp_path / "trace")
    assert sorted(files) == [0, 1]
    for path in files.values():
        spans = [e for e in read_rank_file(path) if e.get("ph") == "X"]
        tp = [e for e in spans if e.get("cat") == "collective" and e["args"].get("group_name") == "tp"]
        kinds = {e["name"] for e in tp}
        assert {"all_gather", "reduce_scatter"} <= kinds, kinds
        asynchronous = [e for e in tp if e["args"]["async"]]
        waits = [e for e in spans if e.get("cat") == "collective.wait"]
        assert asynchronous and len(waits) == len(asynchronous), (len(asynchronous), len(waits))
        by_key = {(e["args"]["group_name"], e["args"]["seq"]): e for e in asynchronous}
        for wait in waits:  # each wait lies inside its collective's span (issue → wait() returned)
            issued = by_key[(wait["args"]["group_name"], wait["args"]["seq"])]
            assert issued["ts"] <= wait["ts"] + 1 and wait["ts"] + wait["dur"] <= issued["ts"] + issued["dur"] + 1
