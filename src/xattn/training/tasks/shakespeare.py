"""Tiny Shakespeare, character level: the causal language-modelling task of ``xattn train``.

The text is a concatenation of works of William Shakespeare (public domain), 1,115,394
bytes, as distributed in Andrej Karpathy's char-rnn repository
(https://github.com/karpathy/char-rnn, ``data/tinyshakespeare/input.txt``) and used by
nanoGPT's ``shakespeare_char`` example (https://github.com/karpathy/nanoGPT). It is
vendored here unchanged, gzip-compressed, as ``tinyshakespeare.txt.gz`` (sha256 of the
decompressed text: :data:`SHA256`), so nothing is downloaded.

As in nanoGPT's ``data/shakespeare_char/prepare.py``: the vocabulary is the sorted set of
the text's 65 characters (token id = rank), the first 90 % of the characters are the
training split and the last 10 % the validation split.
"""

from __future__ import annotations

import gzip
from functools import cache
from importlib import resources

import numpy as np

__all__ = ["MAX_CONTEXT", "NUM_CHARACTERS", "SHA256", "TRAIN_FRACTION", "VALIDATION_SIZE",
           "VOCABULARY_SIZE", "decode", "encode", "load_text", "split", "vocabulary"]

SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
NUM_CHARACTERS = 1_115_394
VOCABULARY_SIZE = 65
TRAIN_FRACTION = 0.9
#: Characters of the validation split (the last 10 %).
VALIDATION_SIZE = NUM_CHARACTERS - int(NUM_CHARACTERS * TRAIN_FRACTION)
#: Longest context: a window of inputs and, one character later, its targets must fit in
#: the validation split (``--length`` beyond it is refused before any work).
MAX_CONTEXT = VALIDATION_SIZE - 1


@cache
def load_text() -> str:
    """The whole text (1,115,394 characters, all ASCII)."""
    with resources.files(__package__).joinpath("tinyshakespeare.txt.gz").open("rb") as file:
        return gzip.decompress(file.read()).decode("utf-8")


@cache
def vocabulary() -> str:
    """The 65 symbols in sorted order: the character of token id ``i`` is ``[i]``."""
    return "".join(sorted(set(load_text())))


def encode(text: str) -> np.ndarray:
    """Token ids (uint8) of ``text``.

    Raises
    ------
    ValueError
        A character outside the vocabulary.
    """
    table = np.full(128, -1, dtype=np.int16)
    symbols = vocabulary()
    table[[ord(char) for char in symbols]] = np.arange(len(symbols))
    codes = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    ids = table[np.minimum(codes, 127)]
    if codes.size and (codes.max() > 127 or ids.min() < 0):
        unknown = sorted({char for char in text if char not in symbols})
        raise ValueError(f"characters outside the tiny Shakespeare vocabulary: {unknown}")
    return ids.astype(np.uint8)


def decode(ids: np.ndarray | list[int]) -> str:
    """The text of token ids."""
    symbols = vocabulary()
    return "".join(symbols[int(i)] for i in ids)


@cache
def split() -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token ids: the first 90 % of the text and the last 10 %
    (1,003,854 and 111,540 characters), uint8."""
    ids = encode(load_text())
    cut = int(len(ids) * TRAIN_FRACTION)
    return ids[:cut], ids[cut:]
