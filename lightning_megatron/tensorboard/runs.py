"""What the MegaScan tab reads: the runs under a TensorBoard logdir, and what each run's traces say, as plain data.

The contract: a logdir in, JSON-ready dicts out, and nothing outside the logdir ever read. A *run* is a directory
under the logdir holding MegaScan rank files (``scan.analysis.format.RANK_FILE_PATTERN``, e.g.
``version_0/megascan/rank00003-dp0-pp1-tp1.json.gz``), named by its path relative to the logdir (``"."`` for
the logdir itself); its optional ``megascan-report.json`` is what MegaScan's detection wrote at fit end. Every
method that takes a run name accepts only a name that ``runs()`` lists (``NotFound`` otherwise) and refuses
absolute paths, ``..`` and other odd names outright (``BadRequest``), so a request cannot name a file outside the
logdir; rank files that resolve (through symbolic links) outside the logdir make their directory no run at all.

* ``runs()``: the runs, with their rank count and whether they have a report;
* ``report(run, detect)``: the saved report, or, on request, one computed by ``scan.analysis.detect`` (cached);
* ``heatmap(run)``: per rank and step the step time split into compute, communication/waits and the rest,
  read from the rank files on each rank's own clock (durations need no alignment);
* ``timeline(run, step, ranks)``: one step of the clock-aligned timeline (``scan.analysis.aggregate``), spans and flows;
* ``merged_trace(run)``: the path of that aggregated trace (gzipped JSON), for download and Perfetto.

Results are cached by the rank files' modification times and sizes: a run still being written is re-read
(rank files only as far as they changed), a finished one is read once. Aggregated traces go to a private
temporary directory (removed at exit), never into the logdir, which may be read-only or shared. Nothing here
imports torch, Lightning or megatron-core: the plugin runs inside TensorBoard's process.
"""

from __future__ import annotations

import atexit
import bisect
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from collections import OrderedDict, defaultdict, deque
from pathlib import Path
from typing import Any, Optional, Union

from lightning_megatron.scan.analysis.format import RANK_FILE_PATTERN, THREAD_NAMES, read_rank_file
from lightning_megatron.scan.analysis.measure import merge_intervals
from lightning_megatron.scan.analysis.report import REPORT_FILE

__all__ = ["BadRequest", "NotFound", "RunError", "RunStore", "parse_ranks"]

MAX_DEPTH = 12  # how deep under the logdir runs are looked for
MAX_DIRS = 20_000  # directories visited per listing (a logdir of checkpoints and images must not stall the tab)
ACTIVE_DIRS = 2_000  # directories visited by the cheap check behind ``is_active``
LISTING_TTL_S = 5.0  # the run listing is reused this long
MAX_REPORT_BYTES = 32 * 1024 * 1024
MAX_HEATMAP_STEPS = 512  # the most recent steps shown in the heatmap
MAX_TIMELINE_RANKS = 256
MAX_TIMELINE_SPANS = 150_000
DEFAULT_TIMELINE_RANKS = 32

WAIT_CATS = frozenset({"p2p", "data", "sync", "grad_sync", "ring.wait"})  # plus blocking (not async) collectives
COMPUTE_CATS = frozenset({"compute", "compute.layer", "compute.op", "optimizer"})
_RANKS = re.compile(r"^\d{1,7}(-\d{1,7})?(,\d{1,7}(-\d{1,7})?)*$")


class RunError(Exception):
    """A request the store refuses; ``status`` is the HTTP status the plugin answers with."""

    status = 400


class BadRequest(RunError):
    status = 400


class NotFound(RunError):
    status = 404


def parse_ranks(text: str, limit: int = MAX_TIMELINE_RANKS) -> list[int]:
    """``"0-3,7"`` → ``[0, 1, 2, 3, 7]``; ``BadRequest`` for anything else or more than ``limit`` ranks."""
    if len(text) > 4096 or not _RANKS.match(text):
        raise BadRequest("ranks must look like 0-3,7")
    ranks: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first or last - first >= limit or len(ranks) + last - first >= limit:
            raise BadRequest(f"at most {limit} ranks, in increasing ranges")
        ranks.update(range(first, last + 1))
    return sorted(ranks)


def _signature(files: dict[int, Path]) -> tuple[tuple[str, int, int], ...]:
    """What changes when a rank file changes: name, mtime (ns) and size of each."""
    out = []
    for path in files.values():
        stat = path.stat()
        out.append((path.name, stat.st_mtime_ns, stat.st_size))
    return tuple(sorted(out))


def _covered(union: tuple[list[float], list[float]]) -> float:
    return sum(end - start for start, end in zip(*union))


def _overlap(start: float, end: float, union: tuple[list[float], list[float]]) -> float:
    starts, ends = union
    total, i = 0.0, bisect.bisect_right(ends, start)
    while i < len(starts) and starts[i] < end:
        total += max(0.0, min(end, ends[i]) - max(start, starts[i]))
        i += 1
    return total


def _number(value: Any) -> Optional[float]:
    """A finite float, or ``None`` for anything else (a damaged event must not fail a whole request)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _step_of(event: dict[str, Any]) -> Optional[int]:
    step = (event.get("args") or {}).get("step")
    try:
        return None if step is None else int(step)
    except (TypeError, ValueError):
        return None


def _split(items: list[tuple[str, float, float, bool]]) -> Optional[dict[str, float]]:
    """One step's time (µs) as compute, wait and other; ``None`` for an unfinished step (its ``step`` span,
    written last, is missing). Spans are (cat, ts, dur, async); the step's time runs from its first span (the
    host gap and data fetch before the ``step`` span carry its number) to its last."""
    if not any(cat == "step" for cat, _, _, _ in items):
        return None
    lo, hi = min(ts for _, ts, _, _ in items), max(ts + dur for _, ts, dur, _ in items)
    clipped = [(cat, max(ts, lo), min(ts + dur, hi), is_async) for cat, ts, dur, is_async in items]
    clipped = [item for item in clipped if item[2] > item[1]]
    waits = merge_intervals(
        [(a, b) for cat, a, b, is_async in clipped if cat in WAIT_CATS or (cat == "collective" and not is_async)]
    )
    compute = merge_intervals([(a, b) for cat, a, b, _ in clipped if cat in COMPUTE_CATS])
    wait_us = _covered(waits)
    compute_us = sum(end - start - _overlap(start, end, waits) for start, end in zip(*compute))
    step_us = hi - lo
    return {"step": step_us, "compute": compute_us, "wait": wait_us, "other": max(0.0, step_us - compute_us - wait_us)}


def _add_evidence_texts(report: dict[str, Any]) -> None:
    """Each suspect's one line of evidence (``evidence_text``) in the words of ``scan.analysis.report``'s table, so the tab
    labels each rule's numbers as the rule means them (a ``host`` suspect's CPU wait is not a data wait). A suspect
    of a report from another version whose fields do not fit gets none: the tab writes its own line then."""
    from lightning_megatron.scan.analysis.report import Suspect, evidence_text

    fields = set(Suspect.__dataclass_fields__)
    for suspect in report.get("suspects", []):
        if not isinstance(suspect, dict) or "evidence_text" in suspect:
            continue
        try:
            suspect["evidence_text"] = evidence_text(Suspect(**{k: v for k, v in suspect.items() if k in fields}))
        except (KeyError, TypeError, ValueError, IndexError):
            pass


def summarize_rank_file(path: Path) -> dict[str, Any]:
    """One rank's coordinates and, per finished step, its step time (µs, from the host gap before the step to
    the step's end) split three ways: ``compute`` is compute spans (forward, backward, layers, optimizer) less
    the time spent inside waits, ``wait`` the union of p2p, blocking collectives, gradient sync and data spans,
    ``other`` the rest (host work), so the three add up to the step time."""
    info: dict[str, Any] = {}
    match = RANK_FILE_PATTERN.match(path.name)
    if match:
        info = {"dp": int(match.group(2)), "pp": int(match.group(3)), "tp": int(match.group(4))}
    spans: dict[int, list[tuple[str, float, float, bool]]] = defaultdict(list)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a truncated file is read as far as it goes
        for event in read_rank_file(path):
            if event.get("ph") == "M" and event.get("name") == "megascan.rank":
                args = event.get("args") or {}
                info.update({k: args[k] for k in ("dp", "pp", "tp", "host") if k in args})
            elif event.get("ph") == "X":
                step = _step_of(event)
                try:
                    ts, dur = float(event["ts"]), float(event["dur"])
                except (KeyError, TypeError, ValueError):
                    continue
                if step is not None:
                    is_async = bool((event.get("args") or {}).get("async", False))
                    spans[step].append((str(event.get("cat", "")), ts, dur, is_async))
    steps = {step: split for step, items in spans.items() if (split := _split(items)) is not None}
    return {"info": info, "steps": steps}


class _Merged:
    """An aggregated trace on disk and its per-step index (windows on the aligned clock, rank coordinates)."""

    def __init__(self, signature: Any, path: Path, summary: dict[str, Any]) -> None:
        self.signature, self.path, self.summary = signature, path, summary
        self.windows: dict[int, tuple[float, float]] = {}
        self.ranks: dict[int, dict[str, Any]] = {}
        self.threads: dict[str, str] = {str(tid): name for tid, name in THREAD_NAMES.items()}


def _merged_events(path: Path) -> Any:
    """The events of a merged trace, one per line as ``scan.analysis.aggregate`` writes them (a line that is not an
    event, such as the opening ``{"traceEvents":[``, is skipped)."""
    with gzip.open(path, "rt") as stream:
        for line in stream:
            line = line.strip().rstrip(",")
            if not line.startswith('{"'):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and "ph" in event:
                yield event


class RunStore:
    """The runs under one logdir and cached readings of them (thread-safe: TensorBoard serves from threads)."""

    def __init__(self, logdir: Union[str, Path]) -> None:
        self.logdir = Path(os.path.realpath(os.path.expanduser(str(logdir)))) if str(logdir) else None
        self._lock = threading.Lock()
        self._run_locks: dict[str, threading.Lock] = {}
        self._listing: Optional[tuple[float, dict[str, Path]]] = None
        self._summaries: dict[str, tuple[int, int, dict[str, Any]]] = {}
        self._merged: dict[str, _Merged] = {}
        self._detected: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._timelines: OrderedDict[Any, dict[str, Any]] = OrderedDict()
        self._cache_dir: Optional[Path] = None

    def _run_lock(self, name: str) -> threading.Lock:
        """One lock per run: two requests never aggregate or detect the same run at once."""
        with self._lock:
            return self._run_locks.setdefault(name, threading.Lock())

    # ------------------------------------------------------------------------------------------ listing runs

    def _inside(self, path: Union[str, Path]) -> bool:
        assert self.logdir is not None
        real = os.path.realpath(path)
        return real == str(self.logdir) or real.startswith(str(self.logdir) + os.sep)

    def _walk(self, max_dirs: int, first_only: bool) -> dict[str, Path]:
        """Directories holding rank files that all resolve inside the logdir; breadth-first, bounded, no links
        followed, hidden directories skipped."""
        found: dict[str, Path] = {}
        if self.logdir is None or not self.logdir.is_dir():
            return found
        queue: deque[tuple[Path, int]] = deque([(self.logdir, 0)])
        visited = 0
        while queue and visited < max_dirs:
            directory, depth = queue.popleft()
            visited += 1
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            ranked = [e for e in entries if RANK_FILE_PATTERN.match(e.name)]
            if ranked and all(e.is_file() and self._inside(e.path) for e in ranked):
                name = directory.relative_to(self.logdir).as_posix()
                found[name] = directory
                if first_only:
                    return found
            if depth < MAX_DEPTH:
                subdirs = [e for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
                queue += [(Path(e.path), depth + 1) for e in sorted(subdirs, key=lambda e: e.name)]
        return found

    def has_runs(self) -> bool:
        """Whether any run exists, looking at no more than ``ACTIVE_DIRS`` directories (TensorBoard asks often)."""
        return bool(self._walk(ACTIVE_DIRS, first_only=True))

    def _runs(self) -> dict[str, Path]:
        with self._lock:
            if self._listing is not None and time.monotonic() - self._listing[0] < LISTING_TTL_S:
                return self._listing[1]
        runs = self._walk(MAX_DIRS, first_only=False)
        with self._lock:
            self._listing = (time.monotonic(), runs)
        return runs

    def runs(self) -> list[dict[str, Any]]:
        """Every run: ``name`` (path relative to the logdir), ``ranks`` (rank files), ``report`` (has a saved
        report), ``updated`` (newest rank file's modification time, seconds since the epoch)."""
        out = []
        for name, directory in sorted(self._runs().items()):
            files = self._rank_files(directory)
            mtimes = [p.stat().st_mtime for p in files.values() if p.exists()]
            out.append(
                {
                    "name": name,
                    "ranks": len(files),
                    "report": (directory / REPORT_FILE).is_file(),
                    "updated": max(mtimes, default=0.0),
                }
            )
        return out

    def resolve(self, name: Any) -> Path:
        """The directory of a listed run. ``BadRequest`` for a name that cannot be one (absolute, with ``..``,
        a backslash or control characters), ``NotFound`` for one that is not listed: only the listing's exact
        names open anything, so nothing a request spells can reach outside the logdir."""
        if not isinstance(name, str) or not name:
            raise BadRequest("a run name is required")
        if name != "." and (
            len(name) > 1024
            or name.startswith("/")
            or (len(name) > 1 and name[1] == ":")  # a Windows drive
            or any(ord(c) < 32 or c == "\\" for c in name)
            or any(part in ("", ".", "..") for part in name.split("/"))
        ):
            raise BadRequest("invalid run name")
        directory = self._runs().get(name)
        if directory is None or not self._inside(directory):
            raise NotFound(f"no MegaScan run {name!r} in the logdir")
        return directory

    def _rank_files(self, directory: Path) -> dict[int, Path]:
        files: dict[int, Path] = {}
        for path in sorted(directory.iterdir()):
            match = RANK_FILE_PATTERN.match(path.name)
            if match and path.is_file() and self._inside(path):
                files[int(match.group(1))] = path
        return files

    # ------------------------------------------------------------------------------------------ reports

    def report(self, name: str, detect: bool = False) -> dict[str, Any]:
        """``{"source": "file" | "detected" | None, "report": DetectionReport dict | None, "stale": bool}``.

        The saved ``megascan-report.json`` wins; without one, ``detect=True`` runs ``scan.analysis.detect`` on the rank
        files (cached until they change). ``stale``: rank files were written after the saved report."""
        directory = self.resolve(name)
        files = self._rank_files(directory)
        saved = directory / REPORT_FILE
        if saved.is_file() and self._inside(saved):
            stat = saved.stat()
            if stat.st_size > MAX_REPORT_BYTES:
                raise BadRequest(f"{REPORT_FILE} is larger than {MAX_REPORT_BYTES} bytes")
            try:
                report = json.loads(saved.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                raise BadRequest(f"{REPORT_FILE} cannot be read: {err}") from None
            if not isinstance(report, dict) or not isinstance(report.get("suspects"), list):
                raise BadRequest(f"{REPORT_FILE} is not a MegaScan detection report")
            newest = max((p.stat().st_mtime for p in files.values()), default=0.0)
            _add_evidence_texts(report)
            return {"run": name, "source": "file", "report": report, "stale": newest > stat.st_mtime + 1.0}
        if not detect:
            return {"run": name, "source": None, "report": None, "stale": False}
        signature = _signature(files)
        with self._run_lock(name):
            cached = self._detected.get(name)
            if cached is None or cached[0] != signature:
                from lightning_megatron.scan.analysis.detect import detect as run_detection

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the report lists them
                    try:
                        result = run_detection(directory).to_dict()
                    except (FileNotFoundError, ValueError) as err:
                        raise NotFound(f"detection found nothing to analyse: {err}") from None
                _add_evidence_texts(result)
                cached = (signature, result)
                self._detected[name] = cached
        return {"run": name, "source": "detected", "report": cached[1], "stale": False}

    # ------------------------------------------------------------------------------------------ heatmap

    def _summary(self, path: Path) -> dict[str, Any]:
        stat = path.stat()
        key = str(path)
        cached = self._summaries.get(key)
        if cached is not None and cached[:2] == (stat.st_mtime_ns, stat.st_size):
            return cached[2]
        summary = summarize_rank_file(path)
        self._summaries[key] = (stat.st_mtime_ns, stat.st_size, summary)
        return summary

    def heatmap(self, name: str) -> dict[str, Any]:
        """Rank × step matrices (ms, ``None`` where a rank has no finished step): ``step_ms``, ``compute_ms``,
        ``wait_ms`` (communication and waits) and ``other_ms``; rows follow ``ranks``, columns ``steps`` (the
        most recent ``MAX_HEATMAP_STEPS``; ``omitted_steps`` counts the older ones left out)."""
        directory = self.resolve(name)
        files = self._rank_files(directory)
        with self._run_lock(name):
            summaries = {rank: self._summary(path) for rank, path in files.items()}
        all_steps = sorted({step for s in summaries.values() for step in s["steps"]})
        steps = all_steps[-MAX_HEATMAP_STEPS:]
        out: dict[str, Any] = {
            "run": name,
            "steps": steps,
            "omitted_steps": len(all_steps) - len(steps),
            "ranks": [],
        }
        for key in ("step", "compute", "wait", "other"):
            out[f"{key}_ms"] = []
        for rank, summary in sorted(summaries.items()):
            info = summary["info"]
            out["ranks"].append({"rank": rank, **{k: info.get(k) for k in ("dp", "pp", "tp", "host")}})
            for key in ("step", "compute", "wait", "other"):
                row = [summary["steps"].get(step, {}).get(key) for step in steps]
                out[f"{key}_ms"].append([None if v is None else round(v / 1000.0, 4) for v in row])
        return out

    # ------------------------------------------------------------------------------------------ merged trace

    def _cache_path(self, name: str) -> Path:
        with self._lock:
            if self._cache_dir is None:
                self._cache_dir = Path(tempfile.mkdtemp(prefix="megascan-tensorboard-"))
                atexit.register(shutil.rmtree, self._cache_dir, True)
        return self._cache_dir / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".json.gz")

    def _merge(self, name: str) -> _Merged:
        """The run aggregated onto rank 0's clock (``scan.analysis.aggregate``), redone when a rank file changed."""
        directory = self.resolve(name)
        signature = _signature(self._rank_files(directory))
        with self._run_lock(name):
            merged = self._merged.get(name)
            if merged is not None and merged.signature == signature and merged.path.exists():
                return merged
            from lightning_megatron.scan.analysis.aggregate import aggregate

            path = self._cache_path(name)
            partial = path.with_suffix(".partial.gz")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # missing / truncated ranks: in the summary
                try:
                    summary = aggregate(directory, partial, progress=False)
                except (FileNotFoundError, ValueError) as err:
                    raise NotFound(f"cannot merge run {name!r}: {err}") from None
            os.replace(partial, path)
            merged = _Merged(signature, path, summary)
            self._index(merged)
            self._merged[name] = merged
            with self._lock:
                for key in [k for k in self._timelines if k[0] == name]:
                    del self._timelines[key]
            return merged

    @staticmethod
    def _index(merged: _Merged) -> None:
        """One pass over the merged trace: each step's window (aligned clock, over all ranks' spans of the step,
        the host gap and data fetch before it included), and each rank's coordinates (every rank with spans has
        an entry)."""
        for event in _merged_events(merged.path):
            ph = event.get("ph")
            if ph == "X" and isinstance(event.get("pid"), int):
                merged.ranks.setdefault(event["pid"], {})
                step, ts, dur = _step_of(event), _number(event.get("ts")), _number(event.get("dur", 0.0))
                if step is not None and ts is not None and dur is not None:
                    end = ts + dur
                    lo, hi = merged.windows.get(step, (ts, end))
                    merged.windows[step] = (min(lo, ts), max(hi, end))
            elif ph == "M" and event.get("name") == "megascan.rank" and isinstance(event.get("pid"), int):
                args = event.get("args") or {}
                merged.ranks[int(event["pid"])] = {k: args.get(k) for k in ("dp", "pp", "tp", "host")}

    def merged_trace(self, name: str) -> Path:
        """The aggregated trace of a run (gzipped Chrome JSON), inside the plugin's own cache directory."""
        return self._merge(name).path

    # ------------------------------------------------------------------------------------------ timeline

    def timeline(self, name: str, step: int, ranks: Optional[list[int]] = None) -> dict[str, Any]:
        """One step of the aligned timeline for some ranks (default: the first ``DEFAULT_TIMELINE_RANKS``).

        ``rows`` are (rank, tid) pairs, one per stream of each rank; ``spans`` refer to a row by index, with
        ``ts`` in µs from the step's start on rank 0's clock; ``flows`` are the arrows of the merged trace
        (``p2p`` send → recv, ``collective`` last arriver → waiting member) whose both ends are shown."""
        merged = self._merge(name)
        if step not in merged.windows:
            raise NotFound(f"step {step} is not in run {name!r}")
        available = sorted(merged.ranks)
        chosen = [r for r in (ranks if ranks is not None else available[:DEFAULT_TIMELINE_RANKS]) if r in available]
        key = (name, merged.signature, step, tuple(chosen))
        with self._lock:
            if key in self._timelines:
                self._timelines.move_to_end(key)
                return self._timelines[key]
        result = self._read_step(merged, step, set(chosen))
        result.update(run=name, step=step, available_ranks=available, steps=sorted(merged.windows))
        with self._lock:
            self._timelines[key] = result
            while len(self._timelines) > 16:
                self._timelines.popitem(last=False)
        return result

    @staticmethod
    def _read_step(merged: _Merged, step: int, chosen: set[int]) -> dict[str, Any]:
        lo, hi = merged.windows[step]
        margin = 0.02 * (hi - lo) + 1.0
        rows: dict[tuple[int, int], int] = {}
        spans: list[dict[str, Any]] = []
        flow_ends: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
        truncated = False

        def row_of(pid: int, tid: Any) -> int:
            key = (pid, int(tid) if isinstance(tid, int) or str(tid).isdigit() else 99)
            if key not in rows:
                rows[key] = len(rows)
            return rows[key]

        for event in _merged_events(merged.path):
            pid, ph = event.get("pid"), event.get("ph")
            if pid not in chosen:
                continue
            ts, dur = _number(event.get("ts")), _number(event.get("dur", 0.0))
            if ts is None or dur is None:
                continue
            if ph == "X" and _step_of(event) == step:
                if len(spans) >= MAX_TIMELINE_SPANS:
                    truncated = True
                    continue
                args = event.get("args") if isinstance(event.get("args"), dict) else {}
                spans.append(
                    {
                        "row": row_of(pid, event.get("tid", 0)),
                        "ts": round(ts - lo, 3),
                        "dur": round(dur, 3),
                        "name": str(event.get("name", "")),
                        "cat": str(event.get("cat", "")),
                        "args": {k: v for k, v in args.items() if k != "step"},
                    }
                )
            elif ph in ("s", "f") and isinstance(event.get("id"), int) and lo - margin <= ts <= hi + margin:
                event["ts"] = ts
                flow_ends[event["id"]][ph] = event
        flows = []
        for ends in flow_ends.values():
            if "s" in ends and "f" in ends:
                start, finish = ends["s"], ends["f"]
                flows.append(
                    {
                        "cat": str(start.get("cat", "")),
                        "from": row_of(start["pid"], start.get("tid", 0)),
                        "from_ts": round(float(start["ts"]) - lo, 3),
                        "to": row_of(finish["pid"], finish.get("tid", 0)),
                        "to_ts": round(float(finish["ts"]) - lo, 3),
                    }
                )
        order = sorted(rows, key=lambda k: (k[0], k[1]))
        renumber = {rows[k]: i for i, k in enumerate(order)}
        for span in spans:
            span["row"] = renumber[span["row"]]
        for flow in flows:
            flow["from"], flow["to"] = renumber[flow["from"]], renumber[flow["to"]]
        return {
            "duration_us": round(hi - lo, 3),
            "rows": [{"rank": pid, "tid": tid} for pid, tid in order],
            "ranks": {str(r): merged.ranks.get(r, {}) for r in sorted(chosen)},
            "threads": merged.threads,
            "spans": spans,
            "flows": flows,
            "truncated": truncated,
            "clock_skew_p95_us": ((merged.summary.get("residual_skew_us") or {}).get("after") or {}).get("p95"),
        }
