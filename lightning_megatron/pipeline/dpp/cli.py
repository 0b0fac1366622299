"""``lightning-megatron dpp ...``: MegaDPP's tools that need no GPU.

``lightning-megatron dpp simulate``: simulate pipeline steps under every scheduling policy, over many seeds of
link delays and compute noise, and print the median step time and the speed-up over megatron-core's order::

    lightning-megatron dpp simulate --pipeline 2 --chunks 2 --microbatches 8 --forward 1 --backward 2 \\
        --delay exponential --delay-mean 2 --delay-links 1-0 --extra 0,2,4 --seeds 40 \\
        [--policies static,adaptive] [--config scenario.yaml] [--json out.json] [--timeline out.png]

A ``--config`` YAML file holds :class:`~lightning_megatron.pipeline.dpp.simulate.Scenario` fields (the flags
override it). ``--timeline`` draws one seed's step (``--seed``) as a per-rank Gantt chart per policy (needs
matplotlib). Exit code: 0; 1 when a policy deadlocked (a bug: the memory rule forbids it); 2 for bad settings.
The arguments are defined in :mod:`lightning_megatron.cli_commands` (``--help`` answers without importing torch).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional, Union

from lightning_megatron.errors import MegatronConfigError

__all__ = ["main", "plot_timeline", "run"]


# Flag -> Scenario field, for the flags that set one (None: not given, the config file's or the default value).
_FIELDS = {
    "pipeline": "pipeline",
    "chunks": "chunks",
    "microbatches": "microbatches",
    "forward": "forward_s",
    "backward": "backward_s",
    "slow_ranks": "slow_ranks",
    "jitter": "compute_jitter",
    "transfer": "transfer_s",
    "delay": "delay_kind",
    "delay_mean": "delay_mean_s",
    "delay_probability": "delay_probability",
    "delay_links": "delay_links",
    "grace_fraction": "grace_fraction",
    "seed": "seed",
}


def _scenario(args: argparse.Namespace):
    from lightning_megatron.pipeline.dpp.simulate import Scenario

    values: dict[str, Any] = {}
    if args.config is not None:
        import yaml

        with open(args.config) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise MegatronConfigError(f"--config {args.config}: expected a mapping of Scenario fields")
        values.update(loaded)
    for flag, name in _FIELDS.items():
        if getattr(args, flag) is not None:
            values[name] = getattr(args, flag)
    return Scenario.from_mapping(values)


def _finite(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None  # JSON has no infinity: a deadlocked median is null


def _simulate_cli(args: argparse.Namespace) -> int:
    import dataclasses

    from lightning_megatron.pipeline.dpp.policy import POLICIES
    from lightning_megatron.pipeline.dpp.simulate import compare, format_table, simulate

    scenario = _scenario(args)
    policies = args.policies or POLICIES
    if args.seeds < 1:
        raise MegatronConfigError(f"--seeds {args.seeds}: simulate at least one seed")
    if args.timeline is not None:
        _require_matplotlib()
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    rows = compare(scenario, policies=policies, extra=args.extra, seeds=args.seeds, progress=progress)
    print(_describe(scenario, args.seeds))
    print(format_table(rows))
    deadlocks = sum(r.deadlocks for r in rows)
    if deadlocks:
        print(f"\n{deadlocks} deadlocked runs: a bug in the policies' memory rule; please report it", file=sys.stderr)
    if args.json is not None:
        out = {
            "scenario": scenario.to_dict(),
            "seeds": list(range(scenario.seed, scenario.seed + args.seeds)),
            "policies": list(policies),
            "extra": list(args.extra),
            "baseline": "static at extra_activations=0 (megatron-core's order)",
            "rows": [
                {k: _finite(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(r).items()} for r in rows
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.timeline is not None:
        extra = max(args.extra) if args.timeline_extra is None else args.timeline_extra
        results = [simulate(scenario.replace(extra_activations=extra), p, timeline=True) for p in policies]
        plot_timeline(results, args.timeline, title=_describe(scenario, 1))
        print(f"wrote {args.timeline} (seed {scenario.seed}, extra {extra})")
    return 1 if deadlocks else 0


def _describe(scenario, seeds: int) -> str:
    s = scenario
    delay = "clean links" if s.delay_kind == "none" and s.delay is None else f"{s.delay_kind} delays"
    if s.delay_kind != "none":
        delay += f" (mean {s.delay_mean_s:g} s"
        delay += f", p={s.delay_probability:g})" if s.delay_kind == "spike" else ")"
    if s.delay_links is not None:
        delay += " on " + ", ".join(f"{a}->{b}" for a, b in s.delay_links)
    parts = [
        f"PP{s.pipeline} x VPP{s.chunks}, {s.microbatches} microbatches",
        f"F={s.forward_s} B={s.backward_s}",
        delay,
    ]
    if s.slow_ranks:
        parts.append("slow " + ", ".join(f"rank {r} x{f:g}" for r, f in s.slow_ranks.items()))
    if s.compute_jitter:
        parts.append(f"jitter {s.compute_jitter:g}")
    if s.transfer_s:
        parts.append(f"transfer {s.transfer_s:g} s")
    return "; ".join(parts) + (f"; {seeds} seeds from {s.seed}" if seeds > 1 else f"; seed {s.seed}")


# -- the timeline picture ----------------------------------------------------------------------------------------


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the environment
        raise MegatronConfigError("--timeline needs matplotlib: pip install 'lightning-megatron[plot]'") from None


def plot_timeline(results: list, output: Union[str, Path], *, title: Optional[str] = None) -> Path:
    """Draw each :class:`~lightning_megatron.pipeline.dpp.simulate.SimulationResult` (run with ``timeline=True``)
    as a per-rank Gantt chart, one panel per result: forwards blue, backwards orange, darker for later chunks,
    the microbatch number on each task. Returns ``output``."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not results or any(r.timeline is None for r in results):
        raise ValueError("plot_timeline needs results simulated with timeline=True")
    output = Path(output)
    ranks = len(results[0].timeline)
    chunks = 1 + max((s.task.chunk for r in results for spans in r.timeline for s in spans), default=0)
    cmaps = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges")}

    def colour(phase: str, chunk: int):
        return cmaps[phase](0.45 + 0.4 * (chunk / (chunks - 1) if chunks > 1 else 0.0))

    horizon = max(max((s.end for spans in r.timeline for s in spans), default=0.0) for r in results) or 1.0
    fig, axes = plt.subplots(
        len(results), 1, figsize=(14, 0.5 + (0.45 * ranks + 0.6) * len(results)), sharex=True, squeeze=False
    )
    for ax, result in zip(axes[:, 0], results):
        for rank, spans in enumerate(result.timeline):
            for span in spans:
                width = span.end - span.start
                ax.barh(
                    rank,
                    width,
                    left=span.start,
                    height=0.8,
                    color=colour(span.task.phase, span.task.chunk),
                    edgecolor="white",
                    linewidth=0.5,
                )
                if width > horizon / 120:
                    ax.text(
                        span.start + width / 2,
                        rank,
                        str(span.task.microbatch),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black",
                    )
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.invert_yaxis()
        step = f"{result.step_s:.2f} s" if not result.deadlock else "DEADLOCK"
        ax.set_title(f"{result.policy} (extra {result.extra_activations}): step {step}", fontsize=9, loc="left")
        ax.set_xlim(0, horizon * 1.01)
    axes[-1, 0].set_xlabel("time (s)")
    handles = [
        Patch(color=colour(p, c), label=f"{'forward' if p == 'F' else 'backward'} chunk {c}")
        for p in ("F", "B")
        for c in range(chunks)
    ]
    fig.legend(handles=handles, loc="upper right", ncol=2 * chunks, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


# -- entry point -------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``dpp`` subcommand (``simulate``); its exit status."""
    return _simulate_cli(args)  # a MegatronConfigError is reported by lightning_megatron.cli_errors


def main(argv: Optional[list[str]] = None) -> int:
    from lightning_megatron.cli_commands import parse

    return run(parse("dpp", argv))
