"""The numerical primitives below every estimator: the online-softmax merge and its
convention for empty parts, the divisor that keeps empty rows at zero, joining pieces."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from xattn._core.primitives import join, merge_maxima, nonzero_divisor


def parts_of(logits, values, cuts):
    """(max, sum of exp(x - max) v) of each part of ``logits`` cut at ``cuts`` along the
    last axis; an empty part is (-inf, 0), the convention of merge_maxima."""
    bounds = [0, *cuts, logits.shape[-1]]
    parts = []
    for start, stop in itertools.pairwise(bounds):
        piece, piece_values = logits[..., start:stop], values[..., start:stop, :]
        if stop == start:
            parts.append((np.full((*logits.shape[:-1], 1), -np.inf),
                          np.zeros((*logits.shape[:-1], values.shape[-1]))))
            continue
        top = np.max(piece, axis=-1, keepdims=True)
        shifted = np.where(np.isfinite(top), top, 0.0)
        parts.append((top, np.exp(piece - shifted) @ piece_values))
    return parts


@pytest.mark.parametrize("cuts", [(), (3,), (0, 5), (2, 2, 7), (9,), (1, 4, 6, 8)])
def test_merge_maxima_equals_one_pass_over_the_union(backend, rng, cuts):
    """Merging the parts of any partition (empty parts included, masked entries -inf)
    gives the one-pass log-sum-exp statistics of the whole set, in float64 to 1e-12."""
    xp = backend.ns
    logits = rng.normal(size=(3, 9)) * 20
    logits[1, :] = -np.inf  # a row with every entry masked
    logits[2, 4:] = -np.inf
    values = rng.normal(size=(3, 9, 2))
    parts = parts_of(logits, values, cuts)
    merged = merge_maxima(xp, *(backend.asarray(top, dtype=xp.float64) for top, _ in parts))
    sums = sum(backend.to_numpy(factor) * part_sums
               for factor, (_, part_sums) in zip(merged.factors, parts, strict=True))
    expected_max = np.max(logits, axis=-1, keepdims=True)
    expected_shift = np.where(np.isfinite(expected_max), expected_max, 0.0)
    np.testing.assert_array_equal(backend.to_numpy(merged.maximum), expected_max)
    np.testing.assert_array_equal(backend.to_numpy(merged.shift), expected_shift)
    np.testing.assert_allclose(sums, np.exp(logits - expected_shift) @ values, rtol=1e-12,
                               atol=0)
    for factor in merged.factors:  # in [0, 1], 0 exactly for an empty part
        factor = backend.to_numpy(factor)
        assert np.all((factor >= 0) & (factor <= 1))
    assert np.all(np.isfinite(sums))


def test_merge_of_empty_parts_stays_empty(backend):
    """Only empty parts: the maximum stays -inf (still empty), the shift 0, factors 0."""
    xp = backend.ns
    empty = backend.asarray(np.full((2, 1), -np.inf), dtype=xp.float64)
    merged = merge_maxima(xp, empty, empty)
    assert np.all(backend.to_numpy(merged.maximum) == -np.inf)
    assert np.all(backend.to_numpy(merged.shift) == 0)
    assert all(np.all(backend.to_numpy(factor) == 0) for factor in merged.factors)


def test_nonzero_divisor_keeps_empty_rows_at_zero(backend):
    xp = backend.ns
    totals = backend.asarray(np.array([[0.0], [2.0], [0.5]]), dtype=xp.float64)
    sums = backend.asarray(np.array([[0.0, 0.0], [4.0, 2.0], [0.5, 0.0]]), dtype=xp.float64)
    np.testing.assert_array_equal(backend.to_numpy(sums / nonzero_divisor(xp, totals)),
                                  [[0.0, 0.0], [2.0, 1.0], [1.0, 0.0]])


def test_join_returns_one_piece_as_it_is(backend, rng):
    xp = backend.ns
    pieces = [backend.asarray(rng.normal(size=(2, size, 3)), dtype=xp.float64)
              for size in (1, 4, 2)]
    assert join(xp, pieces[:1], axis=-2) is pieces[0]
    np.testing.assert_array_equal(backend.to_numpy(join(xp, pieces, axis=-2)),
                                  np.concatenate([backend.to_numpy(p) for p in pieces], -2))
