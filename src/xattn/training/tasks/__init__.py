"""Training tasks of ``xattn train``, generated or shipped inside the package (nothing is
downloaded): ``mqar`` (multi-query associative recall), ``listops`` (the Long Range Arena's
ListOps), ``digits`` (scikit-learn's 8x8 handwritten digits, vendored) and ``shakespeare``
(tiny Shakespeare, character-level causal language modelling, vendored: its data and
training loop are its own, see :mod:`xattn.training.tasks.shakespeare` and
:mod:`xattn.training.lm`).

Every task gives NumPy arrays: ``tokens`` (n, L, F) int32 with F token fields whose
embeddings the model sums, ``mask`` (n, L) bool (True = a real token) or None, and
``targets``: (n,) class labels, or (n, L) per-position labels with -1 where nothing is
predicted (``per_token``). The data do not depend on the run's seed: every estimator and
seed trains on the same training set and is tested on the same held-out test set, as on a
fixed benchmark; the seed changes the initialization, the batch order and the attention's
random samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from xattn.training.tasks import digits, listops, mqar, shakespeare

__all__ = ["CLASSIFICATION_TASKS", "LISTOPS_MIN_LENGTH", "SHAKESPEARE_LENGTH", "TASKS",
           "Dataset", "Task", "get_task"]

TASKS = ("mqar", "listops", "digits", "shakespeare")
#: The tasks of the LRA classifier (``xattn train``'s default); ``shakespeare`` trains a
#: causal language model instead and runs alone.
CLASSIFICATION_TASKS = ("mqar", "listops", "digits")
#: Context of ``shakespeare`` by default (nanoGPT's CPU configuration's block size).
SHAKESPEARE_LENGTH = 64

#: MQAR's fixed sizes (see :mod:`xattn.training.tasks.mqar`).
MQAR_PAIRS, MQAR_KEYS, MQAR_VALUES = 16, 64, 64
#: Shortest ListOps length accepted (an expression of a few nested operators).
LISTOPS_MIN_LENGTH = 32
#: Data seeds of the generated tasks (fixed: the run's seed does not change the data).
_TRAIN_SEED, _TEST_SEED = 1, 2


@dataclass(frozen=True)
class Dataset:
    """Arrays of one split; see the module docstring."""

    tokens: np.ndarray
    targets: np.ndarray
    mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def take(self, index: np.ndarray) -> Dataset:
        return Dataset(self.tokens[index], self.targets[index],
                       None if self.mask is None else self.mask[index])


@dataclass(frozen=True)
class Task:
    """A training task: sizes the model needs and how its data are made."""

    name: str
    length: int
    vocabulary_sizes: tuple[int, ...]
    num_classes: int
    per_token: bool = False
    grid: tuple[int, int] | None = None
    positional: bool = True  # False: the order of the positions carries no information
    description: str = ""
    fixed_sizes: tuple[int, int] | None = None  # (train, test) of a shipped split
    causal: bool = False  # a causal language model (shakespeare), trained by train_lm

    def datasets(self, train_size: int, test_size: int) -> tuple[Dataset, Dataset]:
        """The (train, test) splits; the generated tasks give ``train_size`` and
        ``test_size`` examples, a shipped task (``digits``) its ``fixed_sizes``."""
        return _datasets(self.name, self.length, train_size, test_size)


def get_task(name: str, length: int | None = None) -> Task:
    """The task ``name`` at sequence length ``length`` (default: the task's own).

    Raises
    ------
    ValueError
        Unknown task, or a length the task cannot use (too short; ``digits`` has 64).
    """
    if name == "mqar":
        length = 256 if length is None else length
        needed = 2 * MQAR_PAIRS
        if length < needed:
            raise ValueError(f"--length {length} is too short for mqar: it needs at least "
                             f"{needed} ({MQAR_PAIRS} key-value pairs and {MQAR_PAIRS} "
                             "queries)")
        return Task("mqar", length, mqar.vocabulary_sizes(MQAR_KEYS, MQAR_VALUES),
                    MQAR_VALUES, per_token=True, positional=False,
                    description=f"{MQAR_PAIRS} key-value pairs (one position each, keys "
                    f"from {MQAR_KEYS}, values from {MQAR_VALUES}), {MQAR_PAIRS} queries, "
                    "blanks elsewhere")
    if name == "listops":
        length = 512 if length is None else length
        if length < LISTOPS_MIN_LENGTH:
            raise ValueError(f"--length {length} is too short for listops: it needs at "
                             f"least {LISTOPS_MIN_LENGTH}")
        return Task("listops", length, (listops.VOCABULARY_SIZE,), 10,
                    description=f"expressions of {length // 4} to {length} tokens, depth <= "
                    "10, <= 10 arguments")
    if name == "digits":
        size = digits.GRID[0] * digits.GRID[1]
        if length is not None and length != size:
            raise ValueError(f"--length {length} does not fit digits: its images are "
                             f"{digits.GRID[0]}x{digits.GRID[1]} = {size} tokens")
        return Task("digits", size, (digits.NUM_LEVELS,), 10, grid=digits.GRID,
                    description="8x8 images, pixel intensities 0-16 as tokens, row-major",
                    fixed_sizes=(digits.TRAIN_SIZE, digits.TEST_SIZE))
    if name == "shakespeare":
        length = SHAKESPEARE_LENGTH if length is None else length
        if length < 2:
            raise ValueError(f"--length {length} is too short for shakespeare: it needs at "
                             "least 2 characters of context")
        if length > shakespeare.MAX_CONTEXT:
            raise ValueError(f"--length {length} is too long for shakespeare: a window and "
                             "its next character must fit in the validation split "
                             f"({shakespeare.VALIDATION_SIZE:,} characters), so at most "
                             f"{shakespeare.MAX_CONTEXT:,}")
        return Task("shakespeare", length, (shakespeare.VOCABULARY_SIZE,),
                    shakespeare.VOCABULARY_SIZE, per_token=True, causal=True,
                    description=f"tiny Shakespeare, {shakespeare.VOCABULARY_SIZE} characters, "
                    f"context {length}, first 90 % train, last 10 % validation")
    raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")


@cache
def _datasets(name: str, length: int, train_size: int,
              test_size: int) -> tuple[Dataset, Dataset]:
    if name == "mqar":
        options = {"length": length, "num_pairs": MQAR_PAIRS, "num_keys": MQAR_KEYS,
                   "num_values": MQAR_VALUES}
        return (Dataset(*mqar.generate(train_size, _TRAIN_SEED, **options)),
                Dataset(*mqar.generate(test_size, _TEST_SEED, **options)))
    if name == "listops":
        splits = []
        for size, seed in ((train_size, _TRAIN_SEED), (test_size, _TEST_SEED)):
            tokens, labels = listops.generate(size, seed, max_length=length)
            splits.append(Dataset(tokens[..., None], labels, tokens != listops.PAD))
        return splits[0], splits[1]
    (train_x, train_y), (test_x, test_y) = digits.split()
    return Dataset(train_x[..., None], train_y), Dataset(test_x[..., None], test_y)
