"""Multi-query associative recall (MQAR; Arora et al., 2023, "Zoology"), single-position form.

A sequence of ``length`` positions holds ``num_pairs`` key-value pairs, then queries for
keys among them; the model must output, at each query position, the value paired with that
key earlier in the sequence. Retrieval is exactly what attention approximations differ in.

In this form each key and its value share **one** position: the first ``num_pairs``
positions each carry a key id (drawn without replacement from ``num_keys``) and a value id
(drawn with replacement from ``num_values``), fed to the model as two token fields whose
embeddings are summed. ``num_queries`` of the keys (distinct, in random order) are then
queried at random positions after the pairs, each query position carrying the key id and
the query marker (:func:`query_value_field`) in the value field; every other position is
blank. The target at a query position is the paired value; other positions have the
target -1 (ignored).

Why this form (measured with softmax attention, the ``xattn train`` model, 16 pairs):
with key and value at separate positions (Zoology's two-token form) the model must first
learn an induction circuit and stayed near chance for 3,000 steps. In the single-position
form at length 64 it solves the task in about 150 steps, but at length 256 the one
informative position of a query holds about 1/256 of the attention mass at
initialization, and with independently initialized query and key projections softmax
stayed at chance for 1,500 steps in 2 of 3 seeds (also with every free position a
query). ``xattn train`` therefore starts the key projection equal to the query projection
(see :class:`xattn.training.loop.ModelConfig`). With it and a peak learning rate of
3e-3, softmax solved the task (100 % test accuracy from about step 180) in 2 of the 3
seeds of the full 600-step run; the third stayed at chance. With 1e-3, the setting of
``xattn train``, softmax solved it in each of seeds 0-4 (99.8-100 %, from step 180 to
480; 32 pairs at 3e-3 did not rescue the seed that failed).
"""

from __future__ import annotations

import numpy as np

__all__ = ["IGNORE", "generate", "query_value_field", "vocabulary_sizes"]

IGNORE = -1  # target of positions that are not queries


def vocabulary_sizes(num_keys: int, num_values: int) -> tuple[int, int]:
    """Sizes of the two token fields: keys plus a blank id; values plus the query marker
    (``num_values``) and a blank id (``num_values + 1``)."""
    return num_keys + 1, num_values + 2


def query_value_field(num_values: int) -> int:
    """The value-field id that marks a query position."""
    return num_values


def generate(count: int, seed: int | np.random.Generator, *, length: int = 256,
             num_pairs: int = 16, num_queries: int | None = None, num_keys: int = 64,
             num_values: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``count`` MQAR sequences and their per-position targets.

    Parameters
    ----------
    count : int
        Number of sequences.
    seed : int or numpy.random.Generator
        Source of the draws (the same seed gives the same sequences).
    length : int
        Positions per sequence; at least ``num_pairs + num_queries``.
    num_pairs : int
        Key-value pairs, at positions ``0 .. num_pairs - 1``.
    num_queries : int, optional
        Queried keys per sequence, at most ``num_pairs`` (default ``num_pairs``).
    num_keys, num_values : int
        Key and value vocabularies; ``num_keys >= num_pairs``.

    Returns
    -------
    tokens : ndarray of int32, shape (count, length, 2)
        Field 0: key id (``num_keys`` = blank); field 1: value id (``num_values`` = query
        marker, ``num_values + 1`` = blank).
    targets : ndarray of int64, shape (count, length)
        The paired value at query positions, :data:`IGNORE` elsewhere.
    """
    num_queries = num_pairs if num_queries is None else num_queries
    if not 1 <= num_queries <= num_pairs <= num_keys:
        raise ValueError(f"need 1 <= num_queries ({num_queries}) <= num_pairs ({num_pairs}) "
                         f"<= num_keys ({num_keys})")
    if length < num_pairs + num_queries:
        raise ValueError(f"length ({length}) must be at least num_pairs + num_queries "
                         f"({num_pairs + num_queries})")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    rows = np.arange(count)[:, None]
    # keys without replacement: the first num_pairs of a random permutation per sequence
    keys = np.argsort(rng.random((count, num_keys)), axis=1)[:, :num_pairs]
    values = rng.integers(0, num_values, size=(count, num_pairs))
    # which pairs are queried (distinct, random order) and where (distinct positions)
    queried = np.argsort(rng.random((count, num_pairs)), axis=1)[:, :num_queries]
    free = length - num_pairs
    positions = num_pairs + np.argsort(rng.random((count, free)), axis=1)[:, :num_queries]

    tokens = np.empty((count, length, 2), dtype=np.int32)
    tokens[..., 0] = num_keys
    tokens[..., 1] = num_values + 1
    tokens[:, :num_pairs, 0] = keys
    tokens[:, :num_pairs, 1] = values
    tokens[rows, positions, 0] = keys[rows, queried]
    tokens[rows, positions, 1] = query_value_field(num_values)
    targets = np.full((count, length), IGNORE, dtype=np.int64)
    targets[rows, positions] = values[rows, queried]
    return tokens, targets
