"""``lightning-megatron scan ...``: work on MegaScan trace directories after (or without) training.

``lightning-megatron scan aggregate TRACE_DIR -o merged.json.gz``: one clock-aligned timeline;
``lightning-megatron scan detect TRACE_DIR [--json report.json]``: ranked slow-rank suspects;
``lightning-megatron scan plot TRACE -o timeline.png``: a still picture of a step;
``lightning-megatron scan bubbles TRACE_DIR [--links]``: pipeline bubbles apart from transfers, per stage.
"""

from __future__ import annotations

import argparse
from typing import Optional

__all__ = ["main", "parser", "run"]


def parser() -> argparse.ArgumentParser:
    """The ``scan`` command's parser (its modules read JSON only: building it imports no torch)."""
    from lightning_megatron.cli_parser import CommandParser
    from lightning_megatron.scan.analysis import aggregate, bubbles, detect, plot

    description = (
        "MegaScan: work on trace directories after (or without) training.\n\n"
        "  lightning-megatron scan aggregate TRACE_DIR -o merged.json.gz   one clock-aligned timeline\n"
        "  lightning-megatron scan detect TRACE_DIR [--json report.json]   ranked slow-rank suspects\n"
        "  lightning-megatron scan plot TRACE -o timeline.png              a still picture of a step\n"
        "  lightning-megatron scan bubbles TRACE_DIR [--links]              pipeline bubbles apart from transfers"
    )
    built = CommandParser(prog="lightning-megatron scan", description=description)
    commands = built.add_subparsers(dest="command", required=True, metavar="{aggregate,detect,plot,bubbles}")
    aggregate.register_cli(commands)
    detect.register_cli(commands)
    plot.register_cli(commands)
    bubbles.register_cli(commands)
    return built


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``scan`` subcommand; its exit status."""
    return int(args.func(args) or 0)


def main(argv: Optional[list[str]] = None) -> int:
    return run(parser().parse_args(argv))
