"""``lightning-megatron scan ...``: work on MegaScan trace directories after (or without) training.

``lightning-megatron scan aggregate TRACE_DIR -o merged.json.gz``: one clock-aligned timeline;
``lightning-megatron scan detect TRACE_DIR [--json report.json]``: ranked slow-rank suspects;
``lightning-megatron scan plot TRACE -o timeline.png``: a still picture of a step;
``lightning-megatron scan bubbles TRACE_DIR [--links]``: pipeline bubbles apart from transfers, per stage.
"""

from __future__ import annotations

import argparse
from typing import Optional

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    from lightning_megatron.scan.analysis import aggregate, bubbles, detect, plot

    parser = argparse.ArgumentParser(prog="lightning-megatron scan", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    aggregate.register_cli(commands)
    detect.register_cli(commands)
    plot.register_cli(commands)
    bubbles.register_cli(commands)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
