"""Draw a merged MegaScan trace as a timeline image (PNG/SVG/PDF) for reports and READMEs.

    lightning-megatron scan plot TRACE_DIR_OR_MERGED -o timeline.png [--step 3] [--steps 1]

Perfetto UI and chrome://tracing are the tools for exploring a trace; this is the still picture of one or a
few steps that a person reads at a glance: a row per rank and stream (compute, communication, host), slices
coloured by what they are (forward, backward, pipeline transfer, collective, gradient sync, optimizer, data),
arrows from each pipeline send to its receive, and the step boundaries. A trace directory is merged first
(:func:`~lightning_megatron.scan.analysis.aggregate.aggregate`, into a temporary file), so the clocks are aligned.
Needs matplotlib (``pip install lightning-megatron[plot]``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["plot_timeline", "register_cli"]

# (label, colour) per slice kind; the order is the legend's.
STYLE = {
    "forward": ("forward", "#4C72B0"),
    "backward": ("backward", "#DD8452"),
    "layer": ("layer part", "#8172B3"),
    "p2p": ("pipeline send/recv", "#55A868"),
    "collective": ("collective", "#C44E52"),
    "grad_sync": ("gradient sync", "#937860"),
    "optimizer": ("optimizer", "#8C8C8C"),
    "data": ("data fetch", "#CCB974"),
    "sync": ("ranks' per-batch sync", "#64B5CD"),
}
STREAMS = {1: "compute", 2: "comm", 3: "host", 4: "layers"}


def _kind(event: dict[str, Any]) -> Optional[str]:
    cat = event.get("cat")
    if cat == "compute":
        return "backward" if str(event.get("name", "")).startswith("backward") else "forward"
    if cat == "compute.layer":
        return "layer"
    return cat if cat in STYLE else None


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def plot_timeline(
    trace: Union[str, Path],
    output: Union[str, Path],
    *,
    step: Optional[int] = None,
    steps: int = 1,
    title: Optional[str] = None,
    width: float = 14.0,
) -> Path:
    """Draw ``steps`` steps from ``step`` (default: the second traced step, past warm-up) of ``trace`` (a merged
    trace file, or a MegaScan trace directory to merge) into ``output``; returns ``output``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("scan plot needs matplotlib: pip install 'lightning-megatron[plot]'") from err

    trace, output = Path(trace), Path(output)
    if trace.is_dir():
        from lightning_megatron.scan.analysis.aggregate import aggregate

        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "merged.json"
            aggregate(trace, merged, progress=False)
            data = _load(merged)
    else:
        data = _load(trace)
    events = data["traceEvents"] if isinstance(data, dict) else data

    markers = sorted((e["args"]["step"], e["ts"]) for e in events if e.get("ph") == "i" and "step" in e.get("args", {}))
    if not markers:
        raise ValueError(f"{trace}: no iteration markers; is it a merged MegaScan trace?")
    numbers = [number for number, _ in markers]
    first = step if step is not None else numbers[min(1, len(numbers) - 1)]
    if first not in numbers:
        raise ValueError(f"step={first} is not in {trace}; traced steps: {numbers}")
    index = numbers.index(first)
    begin = markers[index][1]
    last = index + steps
    end = markers[last][1] if last < len(markers) else None
    if end is None:  # the last traced step: it ends where its slices end
        in_step = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("step") in numbers[index:]]
        end = max((e["ts"] + e.get("dur", 0.0) for e in in_step), default=begin + 1.0)

    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    slices: dict[tuple[int, int], dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("ph") != "X" or e.get("tid") not in STREAMS:
            continue
        kind = _kind(e)
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if kind is None or ts + dur < begin or ts > end:
            continue
        slices[(e["pid"], e["tid"])][kind].append(((ts - begin) / 1000.0, dur / 1000.0))
    rows = sorted(slices)
    if not rows:
        raise ValueError(f"{trace}: nothing recorded between steps {first} and {numbers[min(last, len(numbers)) - 1]}")
    row_of = {key: i for i, key in enumerate(rows)}

    fig, ax = plt.subplots(figsize=(width, 0.9 + 0.32 * len(rows)), dpi=110)
    for key, kinds in slices.items():
        y = row_of[key]
        for kind, spans in kinds.items():
            ax.broken_barh(spans, (y - 0.38, 0.76), facecolors=STYLE[kind][1], edgecolors="white", linewidth=0.3)

    # flows: a 's' event and an 'f' event share an id; draw the pipeline ones (collective flows would clutter)
    starts = {e["id"]: e for e in events if e.get("ph") == "s" and e.get("cat") == "p2p"}
    for e in events:
        if e.get("ph") != "f" or e.get("cat") != "p2p" or e.get("id") not in starts:
            continue
        s = starts[e["id"]]
        a, b = (s["pid"], s["tid"]), (e["pid"], e["tid"])
        if a in row_of and b in row_of and begin <= s["ts"] <= end:
            ax.annotate(
                "",
                xy=((e["ts"] - begin) / 1000.0, row_of[b]),
                xytext=((s["ts"] - begin) / 1000.0, row_of[a]),
                arrowprops={"arrowstyle": "->", "color": "#2F4F2F", "lw": 0.6, "alpha": 0.7},
            )
    for number, ts in markers[index : last + 1]:
        if ts <= end:
            ax.axvline((ts - begin) / 1000.0, color="black", lw=0.8, ls="--", alpha=0.6)
            ax.text((ts - begin) / 1000.0, -0.9, f" step {number}", fontsize=8, va="bottom")

    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{names.get(pid, f'rank {pid}').split(' · ')[0]} {STREAMS[tid]}" for pid, tid in rows])
    ax.set_ylim(len(rows) - 0.4, -1.0)
    ax.set_xlim(0, (end - begin) / 1000.0)
    ax.set_xlabel("ms (aligned to rank 0's clock)")
    ax.grid(axis="x", alpha=0.25)
    used = {kind for kinds in slices.values() for kind in kinds}
    handles = [Patch(color=colour, label=label) for kind, (label, colour) in STYLE.items() if kind in used]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(rows)), ncol=len(handles))
    ax.set_title(title or f"MegaScan: {trace.name}, step {first}" + (f"-{numbers[last - 1]}" if steps > 1 else ""))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output


def _run(args: argparse.Namespace) -> int:
    try:
        out = plot_timeline(args.trace, args.output, step=args.step, steps=args.steps, title=args.title)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"megascan plot: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def register_cli(subparsers: Any) -> None:
    """Add ``plot TRACE -o OUTPUT [--step N] [--steps K]`` to the ``scan`` command's subparsers."""
    parser = subparsers.add_parser("plot", help="draw a trace (directory or merged file) as a timeline image")
    parser.add_argument("trace", type=Path, help="a MegaScan trace directory or a merged trace (.json[.gz])")
    parser.add_argument("-o", "--output", type=Path, default=Path("timeline.png"), help="image file (.png/.svg/.pdf)")
    parser.add_argument("--step", type=int, help="first step to draw (default: the second traced step)")
    parser.add_argument("--steps", type=int, default=1, help="how many steps to draw")
    parser.add_argument("--title", help="the figure's title")
    parser.set_defaults(func=_run)
