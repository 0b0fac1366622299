"""The argument parser of every ``lightning-megatron`` command: plain-text help with defaults, and usage errors
that name the closest valid word.

Why a parser class of our own: argparse prints the usage and ``prog: error: ...`` and exits on a usage error,
while every other mistake of ``lightning-megatron`` ends in one line ``lightning-megatron CMD: error: ...``
(:mod:`lightning_megatron.cli_errors`). :class:`CommandParser` raises :class:`UsageError` instead, so a usage
error reads like every other error, and a misspelled option, command or choice is answered with "did you mean".
Imports nothing heavy: ``--help`` and usage errors must not wait for torch.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Optional

__all__ = ["CommandParser", "HelpFormatter", "UsageError", "did_you_mean", "suggest_for"]


class UsageError(argparse.ArgumentError):
    """A command line the parser rejects; ``prog`` is the (sub)command it belongs to, e.g.
    ``lightning-megatron scope serve``. An ``argparse.ArgumentError``, so it is a user's mistake for
    :func:`lightning_megatron.cli_errors.is_user_error`."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(None, message)
        self.prog = prog


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the candidate closest to ``word`` (difflib's ratio ≥ 0.6), else ``""``."""
    matches = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean {matches[0]!r}?" if matches else ""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written (they hold examples), and each option's default after its help, unless the
    help already states it or there is no default worth showing (``None``, ``False``, a required argument)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = default is not None and default is not False and default != argparse.SUPPRESS and not action.required
        if shown and "default" not in text and (action.option_strings or action.nargs in ("?", "*")):
            value = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            text += f" (default: {value})" if text else f"default: {value}"
        return text.replace("%", "%%")


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<choices>.*)\)")


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that raises :class:`UsageError` (with a suggestion) instead of exiting, and
    formats help with :class:`HelpFormatter`. Subparsers made by ``add_subparsers`` are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)  # for the suggestion of a usage error
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:  # type: ignore[override]  (raises instead of exiting)
        handled = sys.exc_info()[1]
        if isinstance(handled, UsageError):  # a subcommand's, which argparse reports again at each level above
            raise handled
        parser = self._chosen_subparser()
        raise UsageError(parser.prog, message + suggest_for(message, parser))

    def _chosen_subparser(self) -> argparse.ArgumentParser:
        """The deepest subcommand that ``argv`` names (argparse reports unknown options at the top level)."""
        parser: argparse.ArgumentParser = self
        for word in self._argv:
            choices = _subcommands(parser)
            if word in choices:
                parser = choices[word]
        return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def suggest_for(message: str, parser: argparse.ArgumentParser) -> str:
    """A "did you mean" for argparse's ``message`` about ``parser``: an unrecognized option or an invalid
    choice; ``""`` when there is nothing close."""
    found = _INVALID_CHOICE.search(message)
    if found:
        return did_you_mean(found["word"], re.findall(r"'([^']*)'", found["choices"]))
    if message.startswith("unrecognized arguments: "):
        options = list(parser._option_string_actions)
        for word in message.split(": ", 1)[1].split():
            if word.startswith("-"):
                hint = did_you_mean(word.split("=", 1)[0], options)
                if hint:
                    return hint
    return ""
