"""How ``lightning-megatron`` ends on a user's mistake: one line ``lightning-megatron COMMAND: error: ...`` on
stderr, exit status 2.

A mistake is an exception that :func:`is_user_error` accepts: a setting the strategy cannot run with
(``MegatronConfigError``: layouts that do not divide the world, ...), one Lightning rejects
(``MisconfigurationException``), a command line or configuration the parser rejects (argparse's and
jsonargparse's ``ArgumentError``), malformed input (YAML, JSON, a corpus line: ``PreprocessError``), and a file or
directory that is not there, unless it should be inside the installation (that is a broken install, not a
mistake). The messages name the thing and the fix; the line is that message. Anything else is a bug, here or
below, and keeps its traceback. ``LIGHTNING_MEGATRON_DEBUG=1``, or ``--debug`` anywhere on the command line,
shows the traceback of mistakes too. A usage error (:class:`~lightning_megatron.cli_parser.UsageError`) names
the subcommand it belongs to (``lightning-megatron scope serve: error: ...``). Telling a mistake from a bug
imports nothing heavy, so a usage error is reported before torch would have loaded.

Several processes: the checks run on every rank with the same inputs, so all ranks fail alike. Rank 0 prints
the line (and the command stops the ranks it launched); the others exit with the same status, quietly, after a
grace period in which rank 0 normally ends them. A rank still alive after it had a mistake of its own: it
prints the line with its rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import yaml

__all__ = ["DEBUG_ENV", "EXIT_STATUS", "describe", "is_user_error", "reporting_user_errors", "split_debug_flag"]

DEBUG_ENV = "LIGHTNING_MEGATRON_DEBUG"
DEBUG_FLAG = "--debug"
EXIT_STATUS = 2
PEER_GRACE_S = 20.0
"""How long a rank other than 0 waits, after a mistake, for rank 0 to report it and end the job."""

_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def split_debug_flag(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug``, and whether tracebacks were asked for (the flag or the environment)."""
    args = [arg for arg in argv if arg != DEBUG_FLAG]
    return args, len(args) != len(argv) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _installed(filename: Optional[str]) -> bool:
    """Whether ``filename`` lies inside Python's installation or this package (where files are never the user's)."""
    if not filename:
        return False
    path = Path(os.fsdecode(filename)).resolve()
    roots = {sys.prefix, sys.base_prefix, sysconfig.get_paths()["purelib"], str(Path(__file__).parent)}
    return any(path.is_relative_to(Path(root).resolve()) for root in roots)


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is a mistake in what the user gave (see the module docstring) rather than a bug."""
    from lightning_megatron.errors import MegatronConfigError

    if isinstance(err, _PATH_ERRORS):
        return not _installed(err.filename)
    user_errors: list[type] = [
        MegatronConfigError,
        argparse.ArgumentError,  # jsonargparse's ArgumentError is argparse's
        yaml.YAMLError,
        json.JSONDecodeError,
    ]
    # Classes of modules that are not loaded cannot have raised: look them up without importing (torch).
    lightning = sys.modules.get("lightning.fabric.utilities.exceptions")
    if lightning is not None:
        user_errors.append(lightning.MisconfigurationException)
    preprocess = sys.modules.get("lightning_megatron.data.preprocess")
    if preprocess is not None:
        user_errors.append(preprocess.PreprocessError)
    return isinstance(err, tuple(user_errors))


def describe(err: BaseException, command: str = "lightning-megatron") -> str:
    """The one line (without ``COMMAND: error:``) that reports ``err``: its message, whitespace collapsed."""
    if isinstance(err, _PATH_ERRORS) and err.filename is not None and str(err).startswith("[Errno"):
        text = f"{os.fsdecode(err.filename)}: {err.strerror.lower() if err.strerror else 'not found'}"
    elif isinstance(err, yaml.YAMLError):
        text = f"malformed YAML: {err}"
    elif isinstance(err, json.JSONDecodeError):
        text = f"malformed JSON: {err}"
    elif isinstance(err, argparse.ArgumentError):
        text = f"{err} (see '{getattr(err, 'prog', command)} --help')"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def _rank() -> int:
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")  # not loaded: no ranks were started
    return int(getattr(getattr(rank_zero, "rank_zero_only", None), "rank", 0) or 0)


@contextmanager
def reporting_user_errors(
    command: str, *, debug: bool, stop_others: Callable[[], bool] = lambda: False
) -> Iterator[None]:
    """Turn a mistake raised inside into the one-line report and ``SystemExit(2)``; bugs pass through.

    ``stop_others`` stops the rank processes this one launched and says whether there were any; then this
    process leaves at once (``os._exit``) after its report or traceback, since Lightning's launcher kills it, with a
    message of its own, when it notices its children gone."""
    try:
        yield
    except Exception as err:
        mistake = not debug and is_user_error(err)
        if mistake:
            message = describe(err, command)
            rank = _rank()
            if rank != 0:
                time.sleep(PEER_GRACE_S)  # rank 0 has the same mistake: it reports it and stops this process
                message = f"[rank {rank}] {message}"
            prefix = getattr(err, "prog", command)  # a usage error names its subcommand
            print(f"{prefix}: error: {message}", file=sys.stderr, flush=True)
        if stop_others():
            if not mistake:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_STATUS if mistake else 1)
        if not mistake:
            raise
        raise SystemExit(EXIT_STATUS) from None
