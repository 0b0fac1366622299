"""The commands of ``lightning-megatron`` and the arguments of those that are not Trainer commands.

Why here and not next to the code they run: those modules live in packages whose import loads torch and
megatron-core (seconds), and ``--help`` or a usage error must answer at once. This module imports nothing
heavy; :func:`parse` returns the parsed arguments and the runner (``"module:function"``) that
``lightning_megatron.cli`` imports only then. Each command's own ``main(argv)`` (e.g.
``lightning_megatron.data.preprocess.main``) parses with the same parser, so both ways agree.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional, Union

from lightning_megatron.cli_parser import CommandParser

__all__ = ["COMMANDS", "PROG", "TRAINER_COMMANDS", "parse", "parser"]

PROG = "lightning-megatron"

TRAINER_COMMANDS = ("fit", "validate", "test", "predict")
"""LightningCLI's commands: a Trainer from ``--config`` YAML and ``--trainer.*``/``--model.*``/``--data.*``."""

COMMANDS: dict[str, str] = {
    "fit": "train a model: --config RECIPE.yaml, with --trainer.*, --model.*, --data.* overrides",
    "validate": "run one pass over the validation data (--ckpt_path CHECKPOINT)",
    "test": "run one pass over the test data (--ckpt_path CHECKPOINT)",
    "predict": "run the model over the predict data (--ckpt_path CHECKPOINT)",
    "preprocess": "tokenize a jsonl corpus into megatron-core's indexed dataset (.bin/.idx)",
    "sample": "continue prompts with the model of a checkpoint",
    "scan": "MegaScan traces: merge the per-rank files, name the slow ranks, draw a step",
    "scope": "MegaScope: serve a model to the web UI, or sweep perturbations over it",
    "dpp": "MegaDPP: simulate the dynamic pipeline schedule's policies (no GPU needed)",
}
"""Every command, with the line the top-level help shows for it."""

# command → the function that runs it, given the parsed arguments ("module:function", imported only then)
RUNNERS = {
    "preprocess": "lightning_megatron.data.preprocess:run",
    "sample": "lightning_megatron.models.sampling:run",
    "scan": "lightning_megatron.scan.cli:run",
    "scope": "lightning_megatron.scope.cli:run",
    "dpp": "lightning_megatron.pipeline.dpp.cli:run",
}


def _command(name: str, description: str) -> CommandParser:
    return CommandParser(prog=f"{PROG} {name}", description=description)


# -- preprocess ---------------------------------------------------------------------------------------------------


def _preprocess() -> CommandParser:
    parser = _command(
        "preprocess",
        'Tokenize a jsonl corpus (one {"text": ...} document per line) into megatron-core\'s .bin/.idx dataset,\n'
        "the data_path of the GPT data module.\n\n"
        "  lightning-megatron preprocess --input corpus.jsonl.gz --output-prefix data/corpus \\\n"
        "      --tokenizer train:8192 --append-eod --workers 8",
    )
    parser.add_argument("--input", required=True, help="jsonl file, optionally gzip-compressed (.gz)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json, a directory, vocab.json/merges.txt, a sentencepiece .model, "
        "or train:<vocab_size> to train a byte-level BPE on the input (saved as PREFIX-tokenizer.json)",
    )
    parser.add_argument("--json-key", default="text", help="field holding the document text")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document id")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--chunk-size", type=int, default=64, help="documents per task sent to a worker")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


# -- sample -------------------------------------------------------------------------------------------------------


def _sample() -> CommandParser:
    parser = _command(
        "sample",
        "Continue prompts with the model of a checkpoint, in one process (a checkpoint loads at any layout).\n\n"
        '  lightning-megatron sample runs/gpt-tiny-cpu/checkpoints/last.ckpt --prompt "And God said"',
    )
    parser.add_argument("checkpoint", help="a checkpoint directory written by 'lightning-megatron fit'")
    parser.add_argument("--prompt", action="append", help='text to continue (repeatable; default: "And")')
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 for greedy decoding")
    parser.add_argument("--top-k", type=int, default=50, help="keep the k most likely tokens; 0 for no top-k filter")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 for no filter")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling (same seed, same text)")
    parser.add_argument("--tokenizer", help="override the tokenizer recorded in the run's config.yaml")
    return parser


# -- scan ---------------------------------------------------------------------------------------------------------


def _scan() -> CommandParser:
    from lightning_megatron.scan.cli import parser  # the scan package imports no torch

    return parser()


# -- scope --------------------------------------------------------------------------------------------------------

_SCOPE_SITES = ("system", "calculation", "storage")
# scope.perturb.KINDS and scope.sweep.ROUTER_SITE (a test keeps them equal)
_SCOPE_KINDS = ("gaussian", "uniform", "bitflip", "zero", "stuck", "disable")
_ROUTER_SITE = "moe.hook_router_logits"


def _layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="a checkpoint directory written by 'lightning-megatron fit'")
    parser.add_argument("--hf", help="a local Hugging Face GPT-2, Llama or Mixtral directory instead of a checkpoint")
    parser.add_argument("--tokenizer", help="override the tokenizer recorded in the run's config.yaml")
    parser.add_argument("--devices", type=int, default=1, help="processes (GPUs, or CPU processes)")
    parser.add_argument(
        "--accelerator", default="auto", choices=["auto", "cpu", "gpu"], help="where the model runs (auto: GPUs if any)"
    )
    parser.add_argument("--precision", help="override the run's precision, e.g. bf16-mixed (default: the run's)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    parser.add_argument(
        "--virtual-pipeline-model-parallel-size", type=int, help="model chunks per pipeline stage (default: 1)"
    )
    parser.add_argument("--sequence-parallel", action="store_true", help="split activations over the TP ranks")
    parser.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="expert-parallel ranks (mixture-of-experts models)"
    )
    parser.add_argument(
        "--layer-spec",
        choices=["local", "sdpa"],
        help="attention implementation (default: the run's; checkpoints load with either)",
    )


def _scope() -> CommandParser:
    parser = _command(
        "scope",
        "MegaScope: serve a model to the web UI (probes, perturbations, live generation), or measure the\n"
        "validation loss under a grid of seeded perturbations.\n\n"
        "  lightning-megatron scope serve runs/gpt-tiny-cpu/checkpoints/last.ckpt\n"
        "  lightning-megatron scope sweep runs/gpt-tiny-cpu/checkpoints/last.ckpt --layers 0 1 \\\n"
        "      --kinds gaussian bitflip --strengths 1e-3 1e-2 -o runs/sweep\n"
        "  lightning-megatron scope sweep runs/moe/checkpoints/last.ckpt --experts all --kinds disable",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,sweep}")
    serve = commands.add_parser(
        "serve",
        help="serve a model to the MegaScope web UI",
        description="Serve a model to the MegaScope web UI. Prints a URL with a one-time token (LM_SCOPE_TOKEN\n"
        "sets it: never a command-line argument, which other users could read in ps). Listens on 127.0.0.1\n"
        "unless --host says otherwise. With --devices N the other ranks follow the serving rank.",
    )
    _layout_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=5000, help="port to listen on; 0 picks a free one")
    serve.add_argument("--allowed-host", action="append", help="another Host name the page may be opened under")
    sweep = commands.add_parser(
        "sweep",
        help="validation-loss change under a seeded perturbation grid",
        description="Measure the validation loss (and optionally the gradient norm) of a checkpoint's model under\n"
        "each cell of a grid of seeded perturbations: layers x sites x kinds x strengths. Writes a table,\n"
        "a CSV and a heat map. With --experts (mixture-of-experts models) the cells are per expert of the\n"
        f"router's logits ({_ROUTER_SITE}): --kinds disable turns one expert of one layer off per cell\n"
        "(no strength), noise kinds perturb that expert's logit alone at each strength.",
    )
    _layout_arguments(sweep)
    sweep.add_argument(
        "--layers", type=int, nargs="+", help="layers to perturb (default: every layer; with --experts every MoE layer)"
    )
    sweep.add_argument(
        "--sites",
        nargs="+",
        metavar="SITE",
        help=f"site groups ({', '.join(_SCOPE_SITES)}) or per-layer sites such as hook_resid_post "
        f"(default: {' '.join(_SCOPE_SITES)}; with --experts {_ROUTER_SITE}, the only site that takes experts)",
    )
    sweep.add_argument(
        "--kinds",
        nargs="+",
        default=["gaussian"],
        choices=_SCOPE_KINDS,
        metavar="KIND",
        help=f"perturbation kinds ({', '.join(_SCOPE_KINDS)}; disable needs --experts)",
    )
    sweep.add_argument(
        "--experts",
        nargs="+",
        metavar="EXPERT",
        help="mixture-of-experts models: a cell per expert of the router's logits, expert indices (0 1 2 3) "
        "or all (default: cells are not per expert)",
    )
    sweep.add_argument("--strengths", type=float, nargs="+", default=[1e-2, 1e-1], help="perturbation strengths")
    sweep.add_argument("--seed", type=int, default=0, help="seed of every perturbation")
    sweep.add_argument("--batches", type=int, default=4, help="validation batches per cell")
    sweep.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward pass")
    sweep.add_argument("--grad-norm", action="store_true", help="also the gradient norm of the first batch")
    sweep.add_argument("-o", "--output", default="megascope-sweep", help="directory of the table, CSV and heat map")
    return parser


def _check_scope(parser: CommandParser, args: argparse.Namespace) -> None:
    if (args.checkpoint is None) == (args.hf is None):
        sub = parser._chosen_subparser()
        sub.error("give either a checkpoint directory or --hf DIR")
    if args.command == "sweep":
        _check_sweep(parser, args)


def _check_sweep(parser: CommandParser, args: argparse.Namespace) -> None:
    """``--experts`` into ``"all"`` or indices, the sites it implies, and the combinations the sweep would
    refuse only after loading the model (seconds to minutes), refused here at once."""
    experts = args.experts
    if experts is not None:
        if experts == ["all"]:
            args.experts = "all"
        elif all(e.isdigit() for e in experts):
            args.experts = [int(e) for e in experts]
        else:
            parser._chosen_subparser().error(
                f"--experts takes expert indices (0 1 2 3) or all, not {' '.join(experts)}"
            )
    if args.sites is None:
        args.sites = [_ROUTER_SITE] if experts is not None else list(_SCOPE_SITES)
    elif experts is not None and any(site != _ROUTER_SITE for site in args.sites):
        others = [site for site in args.sites if site != _ROUTER_SITE]
        parser._chosen_subparser().error(
            f"--experts perturbs the router's logits ({_ROUTER_SITE}); sites {' '.join(others)} have no experts: "
            f"drop --sites or give --sites {_ROUTER_SITE}"
        )
    if "disable" in args.kinds and experts is None:
        parser._chosen_subparser().error("--kinds disable needs --experts (indices such as 0 1, or all)")


# -- dpp ----------------------------------------------------------------------------------------------------------

_DELAY_KINDS = ("none", "constant", "exponential", "uniform", "spike")  # dpp.scenario.DELAY_KINDS (a test checks)


def _times(text: str) -> Union[float, tuple[float, ...]]:
    """``1`` or ``1,1,1.2,1`` (one per pipeline rank)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds, or comma-separated seconds per rank") from None
    return values[0] if len(values) == 1 else values


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 0,2,4") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _links(text: str) -> tuple[tuple[int, int], ...]:
    """``1-0`` or ``1-0,2-3``: (src, dst) pipeline-rank links."""
    links = []
    for item in text.split(","):
        try:
            src, dst = item.split("-")
            links.append((int(src), int(dst)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: give links as SRC-DST, e.g. 1-0 or 0-1,1-2") from None
    return tuple(links)


def _slow(text: str) -> dict[int, float]:
    """``1:1.2`` or ``1:1.2,3:1.1``: rank 1 is 20% slower (rank 3: 10%)."""
    slow = {}
    for item in text.split(","):
        try:
            rank, factor = item.split(":")
            slow[int(rank)] = float(factor)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: give RANK:FACTOR, e.g. 1:1.2 for a rank 20% slower") from None
    return slow


def _dpp() -> CommandParser:
    parser = _command(
        "dpp",
        "MegaDPP's tools that need no GPU. simulate: pipeline steps under every scheduling policy, over many\n"
        "seeds of link delays and compute noise; prints the median step time and the speed-up over\n"
        "megatron-core's order. Exit status 1 when a policy deadlocked (a bug), 2 for bad settings.\n\n"
        "  lightning-megatron dpp simulate --pipeline 2 --chunks 2 --microbatches 8 --forward 1 --backward 2 \\\n"
        "      --delay exponential --delay-mean 2 --delay-links 1-0 --extra 0,2,4 --seeds 40",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{simulate}")
    p = commands.add_parser(
        "simulate",
        help="compare the scheduling policies in simulation",
        description="Simulate pipeline steps under MegaDPP's policies over many seeds of delays and noise.\n"
        "A --config YAML file holds the scenario's fields; the flags override it. --timeline draws one seed's\n"
        "step (--seed) as a per-rank Gantt chart per policy (needs matplotlib).",
    )
    p.add_argument("--config", type=Path, default=None, metavar="SCENARIO.yaml", help="scenario fields (YAML)")
    p.add_argument("--pipeline", type=int, help="pipeline ranks (default: 2)")
    p.add_argument("--chunks", type=int, help="model chunks per rank; 1 = plain 1F1B (default: 1)")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: 8)")
    p.add_argument("--forward", type=_times, metavar="S[,S...]", help="forward time of one chunk task (default: 1)")
    p.add_argument("--backward", type=_times, metavar="S[,S...]", help="backward time of one chunk task (default: 2)")
    p.add_argument("--slow-ranks", type=_slow, metavar="RANK:FACTOR[,...]", help="persistently slower ranks")
    p.add_argument("--jitter", type=float, metavar="CV", help="compute-time coefficient of variation (default: 0)")
    p.add_argument("--transfer", type=float, metavar="S", help="base time of one transfer (default: 0)")
    p.add_argument("--delay", choices=_DELAY_KINDS, help="link delay model (default: none)")
    p.add_argument("--delay-mean", type=float, metavar="S", help="the delay model's mean (spike: its size)")
    p.add_argument("--delay-probability", type=float, metavar="P", help="spike: fraction of messages delayed")
    p.add_argument("--delay-links", type=_links, metavar="SRC-DST[,...]", help="delayed links (default: all)")
    p.add_argument("--grace-fraction", type=float, metavar="F", help="adaptive policy's grace, in forward times")
    p.add_argument("--seed", type=int, help="first seed (default: 0); also the --timeline seed")
    p.add_argument("--seeds", type=int, default=20, help="seeds to simulate")
    p.add_argument("--extra", type=_ints, default=(0, 2, 4), metavar="N[,N...]", help="extra activations per rank")
    p.add_argument("--policies", type=_names, default=None, metavar="NAME[,...]", help="policies (default: all)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="also write the rows as JSON")
    p.add_argument("--timeline", type=Path, default=None, metavar="OUT.png", help="draw one seed's step per policy")
    p.add_argument("--timeline-extra", type=int, default=None, metavar="N", help="its extra (default: the largest)")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="progress bar (default: on a terminal)"
    )
    progress.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


# -- the table ----------------------------------------------------------------------------------------------------

_BUILDERS: dict[str, Callable[[], CommandParser]] = {
    "preprocess": _preprocess,
    "sample": _sample,
    "scan": _scan,
    "scope": _scope,
    "dpp": _dpp,
}
_CHECKS: dict[str, Callable[[CommandParser, argparse.Namespace], None]] = {"scope": _check_scope}


def parser(command: str) -> CommandParser:
    """The argument parser of ``command`` (one of :data:`RUNNERS`' keys)."""
    return _BUILDERS[command]()


def parse(command: str, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """``argv`` (the words after ``command``) parsed, or :class:`~lightning_megatron.cli_parser.UsageError`."""
    built = parser(command)
    args = built.parse_args(argv)
    check = _CHECKS.get(command)
    if check is not None:
        check(built, args)
    return args
