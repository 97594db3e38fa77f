"""The chunkwise-parallel causal scan (``xattn._estimators.chunks``, ``xattn._estimators.rf_scan``).

Each piece against a float64 NumPy reference written here the slow, obvious way: the
exclusive prefix of (maximum, sums) pairs by a sequential loop, and causal ``rfa`` by
the non-causal formula applied to every prefix. Then the same result whatever the block
(16 positions, the budget's, or one chunk per block), with leading dimensions that
broadcast, and earlier rows bit-identical whatever a later key.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import xattn
from xattn._estimators import chunks as _chunks

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)


def sequential_prefix(carried, part_max, part_sums):
    """The state before each part and after all, by a loop (online softmax per feature)."""
    maximum, sums = carried
    before_max, before_sums = [], []
    for j in range(part_max.shape[-1]):
        before_max.append(maximum)
        before_sums.append(sums)
        merged = np.maximum(maximum, part_max[..., j])
        shift = np.where(merged == -np.inf, 0.0, merged)
        sums = (np.exp(maximum - shift)[..., None] * sums
                + np.exp(part_max[..., j] - shift)[..., None] * part_sums[..., j, :])
        maximum = merged
    return np.stack(before_max, -1), np.stack(before_sums, -2), (maximum, sums)


@pytest.mark.thin(num_parts=(7, 65, 4097))
@pytest.mark.parametrize("num_parts", [1, 7, 8, 9, 64, 65, 300, 4097])
@pytest.mark.parametrize("with_carried", [False, True])
def test_exclusive_prefix_equals_the_sequential_merge(backend, rng, num_parts, with_carried):
    xp = backend.ns
    features, width = 3, 2
    part_max = 5 * rng.normal(size=(2, features, num_parts))
    part_max[0, 1, : num_parts // 2] = -np.inf  # a feature without keys in the first half
    part_sums = rng.random(size=(2, features, num_parts, width))
    part_sums[part_max == -np.inf] = 0.0
    carried = ((rng.normal(size=(2, features)), rng.random(size=(2, features, width)))
               if with_carried else
               (np.full((2, features), -np.inf), np.zeros((2, features, width))))
    expected_max, expected_sums, (after_max, after_sums) = sequential_prefix(
        carried, part_max, part_sums)
    # compare sums in a common frame: each state's sums times e^{its maximum}
    got_max, got_sums, (got_after_max, got_after_sums) = _chunks.exclusive_prefix(
        xp, tuple(backend.asarray(x) for x in carried) if with_carried else None,
        backend.asarray(part_max), backend.asarray(part_sums))

    def absolute(maximum, sums):
        maximum = backend.to_numpy(maximum) if not isinstance(maximum, np.ndarray) else maximum
        sums = backend.to_numpy(sums) if not isinstance(sums, np.ndarray) else sums
        return np.where(maximum == -np.inf, 0.0, np.exp(maximum))[..., None] * sums

    np.testing.assert_allclose(absolute(got_max, got_sums),
                               absolute(expected_max, expected_sums), rtol=1e-10, atol=1e-300)
    np.testing.assert_allclose(absolute(got_after_max, got_after_sums),
                               absolute(after_max, after_sums), rtol=1e-10)
    # every weight is at most 1: each state's maximum is the largest of the parts it holds
    np.testing.assert_array_equal(backend.to_numpy(got_max), expected_max)


@pytest.mark.parametrize("largest", [64, 40, 1])
def test_chunk_layout_pads_fewer_positions_than_chunks(largest):
    """Every length to 5,000: equal chunks of at most ``largest``, as many as the prefix
    groups without padding, padded by fewer positions than chunks (so at most 1 + count /
    length times the length), laid out again the same once padded; a multiple of 64 whose
    chunks the prefix groups is whole chunks of 64 (the layout before ragged lengths)."""
    for length in range(1, 5001):
        chunk, count = _chunks.chunk_layout(length, largest)
        assert chunk <= largest and _chunks.prefix_parts(count) == count, length
        assert 0 <= chunk * count - length < count, length
        assert _chunks.chunk_layout(chunk * count, largest) == (chunk, count), length
        if largest == 64 and length % 64 == 0:
            assert _chunks.padded_length(length, 64) != length or chunk == 64, length
    assert _chunks.chunk_layout(70, 64) == (35, 2)


@pytest.mark.thin(dtype_name=("float32",), feature_map=("positive",))
@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_a_large_later_key_leaves_earlier_rows_bit_identical(backend, rng, feature_map,
                                                             dtype_name):
    """The rank-one stabilizer takes each query's shift from the keys at or before it:
    a key and value at position m with the largest key logits of the sequence (the key
    along a sample, so that its logit is near its bound) and a value of 1e30 leave every
    row before m bit-identical, in the middle of a chunk of 64 (m = 100), at its first
    position (m = 128) and with the sequence in blocks of 64 positions."""
    xp = backend.ns
    dtype = getattr(xp, dtype_name)
    length, dim = 150, 8
    q, k, v = (0.7 * rng.normal(size=(2, length, dim)) for _ in range(3))
    omega = rng.normal(size=(16, dim))
    for position in (100, 128):
        changed_k, changed_v = k.copy(), v.copy()
        changed_k[:, position] = omega[3] * dim ** 0.25  # k_hat = omega_3: its largest logit
        changed_v[:, position] = 1e30
        # JAX and Dask: the whole-sequence block (the blocks of 64 run the same lines)
        for options in backend.thin((dict(), dict(block_size=64)), kept=(dict(),),
                                    on=("jax", "dask")):
            outs = [backend.to_numpy(xattn.rfa(
                *(backend.asarray(x, dtype=dtype) for x in (q, keys, values)),
                omega=backend.asarray(omega, dtype=dtype), causal=True,
                feature_map=feature_map, **options))
                for keys, values in ((k, v), (changed_k, changed_v))]
            np.testing.assert_array_equal(outs[1][:, :position], outs[0][:, :position])
            assert not np.array_equal(outs[1][:, position], outs[0][:, position])


def prefix_reference(q, k, v, omega, feature_map, key_mask):
    """Causal RFA as the non-causal formula on every prefix."""
    rows = []
    for n in range(q.shape[-2]):
        mask = None if key_mask is None else key_mask[..., : n + 1]
        rows.append(xattn.rfa(q[..., n:n + 1, :], k[..., : n + 1, :], v[..., : n + 1, :],
                              omega=omega, feature_map=feature_map, key_mask=mask)[..., 0, :])
    return np.stack(rows, axis=-2)


# JAX, Dask: 17 rows, two blocks of 16 and seventeen of one (130 compiled and built a
# program of every block: seconds each, the same lines)
@pytest.mark.thin(length=(17,))
@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic", "trigonometric"])
@pytest.mark.parametrize("length", [1, 5, 16, 17, 130])
@pytest.mark.filterwarnings("ignore::xattn.TrigonometricDenominatorWarning")
def test_causal_rfa_is_the_formula_on_every_prefix_whatever_the_block(
        backend, rng, feature_map, length):
    xp = backend.ns
    q, k, v = (0.7 * rng.normal(size=(2, length, 8)) for _ in range(3))
    omega = rng.normal(size=(32, 8))
    key_mask = rng.random((2, length)) > 0.2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = prefix_reference(q, k, v, omega, feature_map, key_mask)
    scale = np.abs(expected).max()
    for options in (dict(block_size=16), dict(), dict(working_memory=1)):
        out = xattn.rfa(*(backend.asarray(x) for x in (q, k, v)), omega=backend.asarray(omega),
                        causal=True, feature_map=feature_map,
                        key_mask=backend.asarray(key_mask), **options)
        # rows whose trigonometric denominator is clamped are large: a relative bound
        backend.check(out, expected, dtype=xp.float64, atol=1e-10 * scale)


LEAD_SHAPES = [((2, 1), (1, 3), (1, 3)), ((1, 1), (1, 1), (1, 3)),
               ((2, 1), (1, 1), (1, 1)), ((1, 3), (2, 1), (2, 3))]


@pytest.mark.thin(shapes=(LEAD_SHAPES[3],))
@pytest.mark.parametrize("shapes", LEAD_SHAPES)
@pytest.mark.parametrize("feature_map", ["positive", "trigonometric"])
@pytest.mark.parametrize(("causal", "window"), [(True, 0), (True, 3), (False, 3)])
@pytest.mark.filterwarnings("ignore::xattn.TrigonometricDenominatorWarning")
def test_leading_dimensions_broadcast_in_the_first_block(backend, rng, shapes, feature_map,
                                                         causal, window):
    """The first block merges no carried state, so its statistics keep the keys' and
    values' own leading shapes: the same result as inputs broadcast beforehand."""
    xp = backend.ns
    query_lead, key_lead, value_lead = shapes
    q = rng.normal(size=(*query_lead, 37, 4))
    k = rng.normal(size=(*key_lead, 37, 4))
    v = rng.normal(size=(*value_lead, 37, 3))
    omega = rng.normal(size=(8, 4))
    full = np.broadcast_shapes(query_lead, key_lead, value_lead)
    options = dict(causal=causal, feature_map=feature_map, window=window,
                   sinks=1 if window else 0)
    expected = xattn.rfa(*(np.broadcast_to(x, full + x.shape[-2:]) for x in (q, k, v)),
                         omega=omega, block_size=16, **options)
    out = xattn.rfa(*(backend.asarray(x) for x in (q, k, v)), omega=backend.asarray(omega),
                    **options)
    backend.check(out, expected, dtype=xp.float64, atol=1e-10 * np.abs(expected).max())
