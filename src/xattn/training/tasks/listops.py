"""ListOps (Nangia & Bowman, 2018) as generated for the Long Range Arena (Tay et al., 2021).

An expression is a nested list of operators on the digits 0-9::

    [MAX 2 9 [MIN 4 7 ] 0 ]   ->   9

with the operators ``MAX``, ``MIN``, ``MED`` (the median, rounded down to an int as
LRA's ``int(np.median(...))``) and ``SM`` (the sum modulo 10). The label is the value of
the expression, one of 10 classes. The generator follows LRA's ``listops.py``: a node is
an operator with 2 to ``max_args`` arguments with probability 1/4, otherwise a digit,
down to ``max_depth``; expressions whose length (in tokens) falls outside
``[min_length, max_length]`` are drawn again. Unlike LRA (lengths 500 to 2,000, a fixed
data set of 96,000 training expressions) the lengths here default to 128 to 512 tokens,
the root is always an operator (a bare digit would never reach the minimum length) and the
expressions are drawn from a seed, so training and test sets are generated, not
downloaded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "CLOSE",
    "OPERATORS",
    "OPERATOR_IDS",
    "PAD",
    "VOCABULARY_SIZE",
    "evaluate",
    "generate",
    "to_python",
]

OPERATORS = ("MAX", "MIN", "MED", "SM")
#: Token ids: 0-9 the digits, 10-13 the operators (an opening bracket with its operator),
#: 14 the closing bracket, 15 padding.
OPERATOR_IDS = {name: 10 + index for index, name in enumerate(OPERATORS)}
CLOSE = 14
PAD = 15
VOCABULARY_SIZE = 16
_VALUE_PROBABILITY = 0.75  # LRA: a node is a digit unless random() <= 0.25


def _median(values: Sequence[int]) -> int:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) // 2  # int(np.median): floor for >= 0


_APPLY: dict[int, Callable[[Sequence[int]], int]] = {
    OPERATOR_IDS["MAX"]: max,
    OPERATOR_IDS["MIN"]: min,
    OPERATOR_IDS["MED"]: _median,
    OPERATOR_IDS["SM"]: lambda values: sum(values) % 10,
}


def evaluate(tokens: Sequence[int]) -> int:
    """Value (0-9) of one expression given as token ids (padding ignored), with a stack.

    Raises
    ------
    ValueError
        The tokens are not one well-formed expression.
    """
    stack: list[list[int]] = [[]]  # each frame: [operator id, argument values...]
    for token in tokens:
        token = int(token)
        if token == PAD:
            continue
        if 0 <= token <= 9:
            stack[-1].append(token)
        elif token in _APPLY:
            stack.append([token])
        elif token == CLOSE:
            if len(stack) < 2 or len(stack[-1]) < 2:
                raise ValueError("']' closes no operator with arguments")
            operator, *arguments = stack.pop()
            stack[-1].append(_APPLY[operator](arguments))
        else:
            raise ValueError(f"unknown ListOps token id {token}")
    if len(stack) != 1 or len(stack[0]) != 1:
        raise ValueError("tokens are not exactly one complete expression")
    return stack[0][0]


def to_python(tokens: Sequence[int]) -> str:
    """The expression as Python source (``MAX(2, 9, MIN(4, 7))``), for checking
    :func:`evaluate` by Python's own evaluation."""
    parts: list[str] = []
    names = {value: key for key, value in OPERATOR_IDS.items()}
    previous = None
    for token in (int(token) for token in tokens if int(token) != PAD):
        needs_comma = previous is not None and previous != "open" and token != CLOSE
        if needs_comma:
            parts.append(", ")
        if token == CLOSE:
            parts.append(")")
            previous = "close"
        elif token in names:
            parts.append(f"{names[token]}(")
            previous = "open"
        else:
            parts.append(str(token))
            previous = "digit"
    return "".join(parts)


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int,
          tokens: list[int], budget: int) -> bool:
    """Append one random subtree to ``tokens``; False once it exceeds ``budget`` tokens."""
    if len(tokens) > budget:
        return False
    is_value = depth > 1 and (depth >= max_depth or rng.random() < _VALUE_PROBABILITY)
    if is_value:
        tokens.append(rng.randrange(10))
        return True
    tokens.append(OPERATOR_IDS[OPERATORS[rng.randrange(len(OPERATORS))]])
    for _ in range(rng.randint(2, max_args)):
        if not _tree(rng, depth + 1, max_depth, max_args, tokens, budget):
            return False
    tokens.append(CLOSE)
    return True


def generate(count: int, seed: int, *, max_length: int = 512, min_length: int | None = None,
             max_depth: int = 10, max_args: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random expressions, padded to ``max_length``, and their values.

    Parameters
    ----------
    count : int
        Number of expressions.
    seed : int
        Seed of the draws (the same seed gives the same expressions).
    max_length, min_length : int
        Accepted lengths in tokens (default ``min_length``: ``max_length // 4``, LRA's
        ratio).
    max_depth, max_args : int
        Nesting depth and arguments per operator, LRA's defaults.

    Returns
    -------
    tokens : ndarray of int32, shape (count, max_length)
        Token ids, padded with :data:`PAD` at the end.
    labels : ndarray of int64, shape (count,)
        The values of the expressions.
    """
    if min_length is None:
        min_length = max_length // 4
    rng = random.Random(int(np.random.SeedSequence(seed).generate_state(1)[0]))
    tokens = np.full((count, max_length), PAD, dtype=np.int32)
    labels = np.empty(count, dtype=np.int64)
    for row in range(count):
        while True:
            expression: list[int] = []
            if (_tree(rng, 1, max_depth, max_args, expression, max_length)
                    and min_length <= len(expression) <= max_length):
                break
        tokens[row, :len(expression)] = expression
        labels[row] = evaluate(expression)
    return tokens, labels
