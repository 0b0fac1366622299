"""The MegaScan trace format: Chrome Trace Event Format, one file per rank, one event per line.

A rank file (``rank00003-dp0-pp1-tp1.json`` or ``.json.gz``) is Chrome's *JSON Array Format*: a ``[`` line,
then one event object per line, each followed by a comma. The closing ``]`` is optional in that format, so a
file cut short by a crash still opens in Perfetto / chrome://tracing, and ``read_rank_file`` recovers every
complete line of it. Writers append; nothing is ever rewritten.

Clocks: ``ts`` and ``dur`` are microseconds (floats) on the rank's own monotonic host clock
(``time.perf_counter_ns`` / 1000; GPU spans are mapped onto it). ``megascan.clock`` records say how that clock
relates to rank 0's: ``rank0_time = local_time + offset_us`` within ``± uncertainty_us``.

Events (``pid`` = global rank everywhere; ``tid`` one of ``TID``):

* metadata (``ph: "M"``): ``process_name``, ``process_sort_index``, ``thread_name`` (Chrome's own), and
  ``megascan.rank`` (``args``: rank, world_size, dp, pp, tp, host, clock_domain, device, backend, granularity,
  pipeline_size, tensor_size, data_parallel_size, virtual_pipeline_size, schedule, start_step) and
  ``megascan.clock`` (``args``: offset_us, uncertainty_us, at_us, round_trips): several, one per measurement.
* complete events (``ph: "X"``, with ``ts`` and ``dur``), ``cat`` and ``args`` by kind:

  ======================  =====================================  ==================================================
  cat                     name                                   args
  ======================  =====================================  ==================================================
  ``step``                ``step 12``                            step; cpu_wait_us (the training thread's run-queue
                                                                 delay in the step, ``scan.tracing.sched``; Linux)
  ``compute``             ``forward`` / ``backward``             step, microbatch, chunk; on GPUs also
                                                                 enqueue_us, queued_us (``scan.tracing.recorder``)
  ``compute.layer``       ``layer 3 attention`` / ``... mlp``    step, layer, part, direction (forward|backward)
  ``compute.op``          module name (``layer 3 linear_fc1``)   step, layer, direction
  ``p2p``                 megatron-core's op name, e.g.          step, sends: [{peer, bytes, seq, direction}],
                          ``forward-send-backward-recv``         recvs: [{peer, bytes, seq, direction}]
  ``collective``          ``all_reduce`` / ``all_gather`` /      step, group (ranks, sorted), group_name (tp, dp,
                          ``reduce_scatter`` / ``broadcast`` /   pp, ep, ...), seq, bytes, async; an MoE layer's
                          ``all_to_all``; in an MoE layer:       exchanges also layer, exchange (dispatch|combine),
                          ``all_to_all layer 3 dispatch          direction (forward|backward)
                          forward``
  ``collective.wait``     ``all_gather wait`` / ...              as ``collective``: the time blocked in an
                                                                 async collective's ``wait()``
  ``ring``                ``ring kv forward`` / ``ring kv        step, sends, recvs (as ``p2p``; ``direction`` is
                          backward`` / ``ring dkv backward``     the name): one exchange of ring attention (context
                                                                 parallelism), issue to end of ``wait()``
  ``ring.wait``           ``ring kv forward wait`` / ...         step: the time blocked in the exchange's ``wait()``
  ``grad_sync``           ``grad-sync``                          step
  ``optimizer``           ``optimizer-step``                     step
  ``data``                ``data-fetch`` (the loader's ``next``) step (of the step it precedes)
  ``sync``                ``step-sync`` (Lightning's per-batch   step (of the step it precedes)
                          synchronisation of the ranks)
  ``host``                ``host-gap`` (between two steps)       step, cpu_wait_us (as ``step``); older traces:
                                                                 ``data`` / ``data-wait``
  ======================  =====================================  ==================================================

Counter events (``ph: "C"``, cat ``moe``, ``tid`` 0): ``tokens per expert · layer 3`` at each traced step's start,
``args`` ``{"expert 5": tokens, ...}``: the tokens each of the rank's local experts received in that step, summed
over its microbatches (``scan.tracing.moe``).

Matching across ranks (what aggregation draws as flows and detection compares):

* a p2p send ``{peer: Q, seq: k, direction: d}`` on rank P in step s is received by the recv
  ``{peer: P, seq: k, direction: d}`` on rank Q in step s (``direction`` is ``forward`` for activations,
  ``backward`` for gradients; ``seq`` counts per step, per peer and direction from 0). Messages between two
  ranks are delivered in posting order, so matching by ``(P, Q, step, seq)`` alone is also exact. Ring
  attention's exchanges (cat ``ring``) pair the same way; their directions (``ring kv forward``, ...) keep them
  apart from the pipeline's messages;
* a collective is one instance per ``(tuple(group), seq)``: every member counts the collectives it traced on
  that group from 0 at fit start, in the same order (all ranks trace the same steps).

The merged file (``lightning-megatron scan aggregate``) is the same format on one clock (rank 0's), plus flow
events (``ph: "s"`` / ``"f"`` with ``bp: "e"``), global iteration markers (``ph: "i"``, ``s: "g"``) and a
``megascan.merged`` metadata event (ranks, missing ranks, residual clock skew).
"""

from __future__ import annotations

import gzip
import io
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "TID",
    "THREAD_NAMES",
    "RANK_FILE_PATTERN",
    "rank_file_name",
    "complete",
    "metadata",
    "rank_metadata",
    "clock_metadata",
    "open_for_append",
    "read_rank_file",
    "list_rank_files",
]

# Thread ids inside a rank's process: one row per kind of work in the trace viewer.
TID = {"steps": 0, "compute": 1, "communication": 2, "host": 3, "layers": 4}
THREAD_NAMES = {
    TID["steps"]: "steps",
    TID["compute"]: "compute (forward / backward)",
    TID["communication"]: "communication (p2p, collectives)",
    TID["host"]: "host (data, grad sync, optimizer)",
    TID["layers"]: "layers",
}
RANK_FILE_PATTERN = re.compile(r"^rank(\d+)-dp(\d+)-pp(\d+)-tp(\d+)\.json(\.gz)?$")


def rank_file_name(rank: int, dp: int, pp: int, tp: int, gzipped: bool = False) -> str:
    return f"rank{rank:05d}-dp{dp}-pp{pp}-tp{tp}.json" + (".gz" if gzipped else "")


def complete(
    name: str, cat: str, pid: int, tid: int, ts: float, dur: float, args: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """A complete ("X") event."""
    event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        event["args"] = args
    return event


def metadata(name: str, pid: int, args: dict[str, Any], tid: int = 0) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def rank_metadata(rank: int, info: dict[str, Any]) -> list[dict[str, Any]]:
    """The metadata events that open a rank file: names for the viewer and ``megascan.rank``."""
    coords = f"dp{info['dp']} pp{info['pp']} tp{info['tp']}"
    events = [
        metadata("process_name", rank, {"name": f"rank {rank} · {coords} · {info.get('host', '?')}"}),
        metadata("process_sort_index", rank, {"sort_index": rank}),
        metadata("megascan.rank", rank, {"rank": rank, **info}),
    ]
    events += [metadata("thread_name", rank, {"name": name}, tid=tid) for tid, name in THREAD_NAMES.items()]
    return events


def clock_metadata(rank: int, offset_us: float, uncertainty_us: float, at_us: float, round_trips: int) -> dict:
    return metadata(
        "megascan.clock",
        rank,
        {"offset_us": offset_us, "uncertainty_us": uncertainty_us, "at_us": at_us, "round_trips": round_trips},
    )


def open_for_append(path: Path) -> io.TextIOBase:
    """Open a rank file for appending events (creating it with its ``[`` line); gzip by suffix."""
    new = not path.exists()
    stream = gzip.open(path, "at", compresslevel=3) if path.suffix == ".gz" else open(path, "a")
    if new:
        stream.write("[\n")
    return stream


def read_rank_file(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete event of a rank file, in file order; warns (does not fail) on a truncated or damaged file."""
    opener = gzip.open if path.suffix == ".gz" else open
    damaged = 0
    try:
        with opener(path, "rt") as stream:
            for line in stream:
                line = line.strip().rstrip(",")
                if not line or line in ("[", "]"):
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    damaged += 1
    except (EOFError, OSError) as err:  # a gzip stream cut short
        warnings.warn(f"{path}: truncated ({err}); using the events before the cut", stacklevel=2)
    if damaged:
        warnings.warn(f"{path}: skipped {damaged} damaged line(s)", stacklevel=2)


def list_rank_files(trace_dir: Path) -> dict[int, Path]:
    """Rank → file for every rank file in ``trace_dir`` (merged files and others are ignored)."""
    files: dict[int, Path] = {}
    for path in sorted(Path(trace_dir).iterdir()):
        match = RANK_FILE_PATTERN.match(path.name)
        if match:
            files[int(match.group(1))] = path
    return files
