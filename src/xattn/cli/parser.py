"""The argument parser of the ``xattn`` command and its entry point :func:`main`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import xattn
from xattn.cli import bench, compare, train
from xattn.cli.common import EXIT_USAGE, CommandError

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

# Each sub-command module exposes add_parser(subparsers) and run(args).
SUBCOMMANDS = (compare, bench, train)


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line on stderr (exit code 2), and an option's
    ``choices=`` are checked item by item for a comma list (``type=name_list``) and
    refused as ``unknown backend 'x'; choose from ...``."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    # argparse has no public hook for either: overriding its choice check is the one way
    # (the sub-command, a positional, keeps argparse's own check and wording)
    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if not action.option_strings or action.choices is None:
            return super()._check_value(action, value)
        choices = list(action.choices)
        for item in value if isinstance(value, list) else [value]:
            if item not in choices:
                noun = action.dest.removesuffix("s")  # estimators -> estimator
                raise argparse.ArgumentError(action, f"unknown {noun} {item!r}; choose from "
                                                     f"{', '.join(choices)}")
        return None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``xattn`` command (one sub-parser per sub-command)."""
    parser = _Parser(prog="xattn", description="Randomized attention estimators: accuracy "
                     "(compare) and speed (bench) against exact softmax attention.")
    parser.add_argument("--version", action="version", version=f"xattn {xattn.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in SUBCOMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xattn`` console script; returns the exit code.

    Input problems (unreadable or invalid ``--input`` files, unknown backends or
    estimators, unavailable devices) print one line on stderr and return 2.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default: ``sys.argv[1:]``), e.g. ``["compare", "--draws", "8"]``.

    Returns
    -------
    int
        0 on success, 2 for bad input or arguments.

    Examples
    --------
    >>> from xattn.cli import main
    >>> main(["--version"])
    xattn ...
    0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else EXIT_USAGE
    try:
        return args.run(args)
    except CommandError as error:
        print(f"xattn {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
