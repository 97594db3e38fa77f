"""The 8x8 handwritten digits shipped with scikit-learn, as sequences of pixel tokens.

The data are scikit-learn's bundled ``load_digits`` set: 1,797 images of 8x8 pixels with
intensities 0-16, the test part of the UCI "Optical Recognition of Handwritten Digits" data
set (E. Alpaydin and C. Kaynak, 1998;
https://archive.ics.uci.edu/ml/datasets/Optical+Recognition+of+Handwritten+Digits),
licensed under Creative Commons Attribution 4.0 (CC BY 4.0). They are vendored here unchanged as
``digits.npz`` (arrays ``pixels`` (1797, 8, 8) uint8 and ``labels`` (1797,) uint8), so
nothing is downloaded and scikit-learn is not needed.

Each image becomes a sequence of 64 tokens, the pixel intensities in row-major order (a
vocabulary of 17), on the 8x8 raster ``GRID``, so 2-D image segments (LARA with
``grid=(8, 8)``) and 1-D segments of the same sequence can be compared. The split is fixed:
a seeded permutation puts 360 images (20 %) in the test set.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import numpy as np

__all__ = ["GRID", "NUM_IMAGES", "NUM_LEVELS", "TEST_SIZE", "TRAIN_SIZE", "load", "split"]

GRID = (8, 8)
NUM_LEVELS = 17  # pixel intensities 0..16
NUM_IMAGES = 1797
TEST_SIZE = 360
TRAIN_SIZE = NUM_IMAGES - TEST_SIZE
_SPLIT_SEED = 0


@cache
def load() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 images as tokens (1797, 64) int32 (row-major pixels) and labels (1797,)."""
    with resources.files(__package__).joinpath("digits.npz").open("rb") as file, \
            np.load(file) as data:
        pixels, labels = data["pixels"], data["labels"]
    return pixels.reshape(len(pixels), -1).astype(np.int32), labels.astype(np.int64)


def split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The fixed (train, test) split: ((tokens, labels), (tokens, labels)), 1,437 and 360."""
    tokens, labels = load()
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(labels))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return (tokens[train], labels[train]), (tokens[test], labels[test])
