"""Argument types and the options the sub-commands share.

Options with a fixed set of names declare it as ``choices=``; for a comma list
(:func:`name_list`) the parser of :mod:`xattn.cli.parser` checks each item.
"""

from __future__ import annotations

import argparse
import math

from xattn.cli.common import DEFAULT_OUT
from xattn.cli.measure import BACKENDS, DEVICES
from xattn.cli.registry import ESTIMATOR_SPECS, SOFTMAX
from xattn.training.runs import MAX_SEED

__all__ = ["MAX_SEED", "add_common_options", "add_out_option", "add_progress_options",
           "estimator_names", "int_at_least", "int_list", "name_list", "nonnegative_float",
           "nonnegative_int", "positive_int", "seed", "seed_list"]



def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated ints >= 1, each once (a repeated value is kept
    at its first place, so that nothing is measured twice).

    Examples
    --------
    >>> from xattn.cli.options import int_list
    >>> int_list("4,4,8,4")
    [4, 8]
    """
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def name_list(text: str) -> list[str]:
    """An argparse type: comma-separated names (``choices=`` checks each)."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def estimator_names(text: str) -> list[str]:
    """An argparse type: the ``--estimators`` of ``compare`` and ``bench``, comma-separated,
    each once and without ``softmax``, the reference both commands measure anyway."""
    names = name_list(text)
    if SOFTMAX.name in names:
        raise argparse.ArgumentTypeError(f"{SOFTMAX.name} is the exact reference, measured "
                                         "always; name only the estimators among "
                                         f"{', '.join(ESTIMATOR_SPECS)}")
    for index, name in enumerate(names):
        if name in names[:index]:
            raise argparse.ArgumentTypeError(f"{name} is named twice")
    return names


def int_at_least(minimum: int, maximum: int | None = None, why: str = ""):
    """An argparse type: an int >= ``minimum`` (and <= ``maximum``, if given; ``why``
    says why in the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected an int <= {maximum}{why}, got "
                                             f"{text!r}")
        return value
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
seed = int_at_least(0, MAX_SEED, " (seeds are 32-bit unsigned ints)")


def seed_list(text: str) -> list[int]:
    """An argparse type: comma-separated seeds (each as :func:`seed`), each once.

    Examples
    --------
    >>> from xattn.cli.options import seed_list
    >>> seed_list("0,2,0")
    [0, 2]
    """
    values = [seed(item.strip()) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated seeds")
    return list(dict.fromkeys(values))


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_common_options(parser: argparse.ArgumentParser, default_estimators: str) -> None:
    """--backend, --device, --dtype, --estimators, --seed, --out, --(no-)progress of
    ``compare`` and ``bench``."""
    parser.add_argument("--backend", default="numpy", choices=BACKENDS, metavar="NAME",
                        help=f"array library: {', '.join(BACKENDS)} (default: numpy)")
    parser.add_argument("--device", default="cpu", choices=DEVICES, metavar="|".join(DEVICES),
                        help="device (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="dtype of the inputs (default: float32)")
    parser.add_argument("--estimators", type=estimator_names, choices=tuple(ESTIMATOR_SPECS),
                        metavar="LIST", default=estimator_names(default_estimators),
                        help="comma-separated estimators among "
                             f"{', '.join(ESTIMATOR_SPECS)} (default: {default_estimators})")
    parser.add_argument("--seed", type=seed, default=0,
                        help=f"seed of the random draws, 0 to {MAX_SEED} (default: 0)")
    add_out_option(parser)
    add_progress_options(parser, "the progress bar")


def add_out_option(parser: argparse.ArgumentParser) -> None:
    """--out DIR, by default :data:`~xattn.cli.common.DEFAULT_OUT`."""
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"output directory (default: {DEFAULT_OUT})")


def add_progress_options(parser: argparse.ArgumentParser, bars: str) -> None:
    """--progress and --no-progress (``args.progress``: True, False, or None for "on a
    terminal"); ``bars`` names what they show, in the help."""
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help=f"always show {bars} (default: on a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help=f"never show {bars}")
