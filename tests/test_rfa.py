"""RFA / Performer FAVOR+ (xattn.rfa) against the explicit float64 formula, on every backend."""

from __future__ import annotations

import functools
import tracemalloc
import warnings

import numpy as np
import pytest

import xattn
from xattn import TrigonometricDenominatorWarning
from xattn.features import sample_omega

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

MAPS = ("positive", "hyperbolic", "trigonometric")
# The hyperbolic map is the positive map with the samples +-w (xattn._estimators.rfa): the
# same lines of xattn. On JAX and Dask (thin) a test of every map runs the hyperbolic one
# for both, and the trigonometric map, whose lines are its own.
HYPERBOLIC_AND_TRIGONOMETRIC = ("hyperbolic", "trigonometric")


def explicit_rfa(q, k, v, omega, feature_map, *, scale=None, key_mask=None, causal=False):
    """phi(Q) (phi(K)^T V) / phi(Q) (phi(K)^T 1) written out in float64 NumPy, with the
    kernel matrix phi(q_n).phi(k_m) restricted to the allowed keys (mask, causal m <= n).
    A query without allowed keys gets a zero row."""
    q, k, v, omega = (np.asarray(a, dtype=np.float64) for a in (q, k, v, omega))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    q_hat, k_hat = np.sqrt(scale) * q, np.sqrt(scale) * k

    def features(x):
        projections = x @ omega.T
        half_sq_norm = 0.5 * np.sum(x * x, axis=-1, keepdims=True)
        if feature_map == "positive":
            return np.exp(projections - half_sq_norm)
        if feature_map == "hyperbolic":
            return np.concatenate([np.exp(projections - half_sq_norm),
                                   np.exp(-projections - half_sq_norm)], axis=-1) / np.sqrt(2)
        return np.exp(half_sq_norm) * np.concatenate([np.sin(projections),
                                                      np.cos(projections)], axis=-1)

    kernel = features(q_hat) @ np.swapaxes(features(k_hat), -1, -2) / omega.shape[0]
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    allowed = np.ones((num_queries, num_keys), dtype=bool)
    if causal:
        allowed &= np.arange(num_queries)[:, None] >= np.arange(num_keys)[None, :]
    if key_mask is not None:
        allowed = allowed & np.asarray(key_mask)[..., None, :]
    kernel = np.where(allowed, kernel, 0.0)
    denominator = kernel.sum(-1, keepdims=True)
    return (kernel @ v) / np.where(allowed.any(-1, keepdims=True), denominator, 1.0)


def make_qkv(rng, batch=(2, 3), num_queries=9, num_keys=11, head_dim=8, value_dim=5,
             spread=1.0):
    q = spread * rng.normal(size=(*batch, num_queries, head_dim))
    k = spread * rng.normal(size=(*batch, num_keys, head_dim))
    v = rng.normal(size=(*batch, num_keys, value_dim))
    return q, k, v


def omega_for(rng, num_features=16, head_dim=8):
    return sample_omega(int(rng.integers(2**31)), num_features, head_dim, xp=np,
                        dtype=np.float64)


def attend(backend, q, k, v, **kwargs):
    """``xattn.rfa`` on the backend; on JAX compiled with :func:`jax.jit` (arrays traced,
    other keywords static), which also checks that every code path traces. Eager JAX
    compiles each small op separately, which is slow; eager JAX is covered by the seed,
    generator, half-precision and warning tests."""
    if not backend.name.startswith("jax"):
        return xattn.rfa(q, k, v, **kwargs)

    arrays = {name: value for name, value in kwargs.items() if hasattr(value, "shape")}
    static = tuple(sorted((name, value) for name, value in kwargs.items()
                          if name not in arrays))
    return _jitted_rfa(static)(q, k, v, arrays)


@functools.cache
def _jitted_rfa(static):
    import jax

    return jax.jit(lambda q, k, v, arrays: xattn.rfa(q, k, v, **arrays, **dict(static)))


def spread_for(feature_map):
    # trigonometric: small scores keep the estimated normalizer well away from zero
    return 0.3 if feature_map == "trigonometric" else 1.0


# 1 and 5: the explicit formula, with and without masks, causal and not -------------------

@pytest.mark.thin(masked=(True,))
@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_explicit_formula(backend, rng, feature_map, causal, masked):
    xp = backend.ns
    q, k, v = make_qkv(rng, num_queries=10, num_keys=10, spread=spread_for(feature_map))
    omega = omega_for(rng)
    key_mask = None
    if masked:
        key_mask = rng.random((2, 1, 10)) < 0.6
        key_mask[:, :, 0] = True
        key_mask[1, 0, :] = False  # a whole batch row without keys: zero outputs
    out = attend(backend, *map(backend.asarray, (q, k, v)), omega=backend.asarray(omega),
                 feature_map=feature_map, causal=causal, block_size=5,
                 key_mask=None if key_mask is None else backend.asarray(key_mask))
    expected = explicit_rfa(q, k, v, omega, feature_map, key_mask=key_mask, causal=causal)
    if masked:
        assert np.all(expected[1, 0] == 0.0)
    backend.check(out, expected, dtype=xp.float64)


@pytest.mark.thin(feature_map=HYPERBOLIC_AND_TRIGONOMETRIC)
@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("num_queries,num_keys", [(6, 11), (11, 6)])
def test_cross_attention_causal_and_not(backend, rng, feature_map, num_queries, num_keys):
    xp = backend.ns
    q, k, v = make_qkv(rng, num_queries=num_queries, num_keys=num_keys,
                       spread=spread_for(feature_map))
    omega = omega_for(rng)
    for causal in (False, True):
        out = attend(backend, *map(backend.asarray, (q, k, v)), omega=backend.asarray(omega),
                     feature_map=feature_map, causal=causal, block_size=4, scale=0.5)
        expected = explicit_rfa(q, k, v, omega, feature_map, causal=causal, scale=0.5)
        backend.check(out, expected, dtype=xp.float64)


@pytest.mark.parametrize("feature_map", MAPS)
def test_float32_and_broadcast_leading_dims(backend, rng, feature_map):
    xp = backend.ns
    spread = spread_for(feature_map)
    q = spread * rng.normal(size=(2, 1, 6, 4))
    k = spread * rng.normal(size=(1, 3, 7, 4))
    v = rng.normal(size=(7, 2))
    omega = omega_for(rng, num_features=8, head_dim=4)
    for causal in (False, True):
        out = attend(backend, *(backend.asarray(a, dtype=xp.float32) for a in (q, k, v)),
                     omega=backend.asarray(omega, dtype=xp.float32), feature_map=feature_map,
                     causal=causal, block_size=4)
        assert tuple(out.shape) == (2, 3, 6, 2)
        backend.check(out, explicit_rfa(q, k, v, omega, feature_map, causal=causal),
                 dtype=xp.float32, rtol=1e-4)


def test_half_precision_returns_input_dtype(backend, rng):
    xp = backend.ns
    if backend.name in ("array_api_strict", "dask") or backend.name.startswith("cupy"):
        pytest.skip(f"{backend.name}: half precision matmul is not offered")
    q, k, v = make_qkv(rng, batch=(2,), head_dim=4)
    omega = omega_for(rng, num_features=8, head_dim=4)
    for dtype in (xp.float16, getattr(xp, "bfloat16", None)):
        if dtype is None:
            continue
        arrays = [backend.asarray(a, dtype=dtype) for a in (q, k, v)]
        out = xattn.rfa(*arrays, omega=backend.asarray(omega))
        rounded = [backend.to_numpy(a) for a in arrays]  # the inputs as the estimator sees them
        backend.check(out, explicit_rfa(*rounded, omega, "positive"), dtype=dtype, rtol=2e-2)


# 4: large scores stay finite in float32 -------------------------------------------------

@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
@pytest.mark.parametrize("causal", [False, True])
def test_scores_of_80_stay_finite_in_float32(backend, rng, feature_map, causal):
    xp = backend.ns
    head_dim = 8
    direction = rng.normal(size=head_dim)
    direction /= np.linalg.norm(direction)
    q = np.sqrt(80.0) * (direction + 0.05 * rng.normal(size=(2, 9, head_dim)))
    k = np.sqrt(80.0) * (direction + 0.05 * rng.normal(size=(2, 9, head_dim)))
    v = rng.normal(size=(2, 9, 3))
    q_dot_k = q @ np.swapaxes(k, -1, -2)
    assert q_dot_k.max() > 80.0  # scale=1: q_hat.k_hat reaches 80
    omega = omega_for(rng, num_features=32, head_dim=head_dim)
    out = attend(backend, *(backend.asarray(a, dtype=xp.float32) for a in (q, k, v)),
                 omega=backend.asarray(omega, dtype=xp.float32), feature_map=feature_map,
                 scale=1.0, causal=causal, block_size=4)
    result = backend.to_numpy(out)
    assert np.all(np.isfinite(result))
    # the unstabilized formula overflows here (e^{|w||q|} ~ e^{100}); the float64 reference
    # of the same estimator is still finite, and float32 agrees with it
    expected = xattn.rfa(q, k, v, omega=omega, feature_map=feature_map, scale=1.0,
                         causal=causal, block_size=4)  # NumPy float64
    np.testing.assert_allclose(result, expected, rtol=1e-3, atol=1e-3 * np.abs(v).max())


# 5: no look-ahead -------------------------------------------------------------------------

@pytest.mark.thin(feature_map=HYPERBOLIC_AND_TRIGONOMETRIC)
@pytest.mark.parametrize("feature_map", MAPS)
def test_causal_no_look_ahead(backend, rng, feature_map):
    spread = spread_for(feature_map)
    num_tokens, cut = 12, 6  # positions 0..5 kept; block_size 4 splits block 4..7
    q, k, v = make_qkv(rng, batch=(2,), num_queries=num_tokens, num_keys=num_tokens,
                       spread=spread)
    omega = backend.asarray(omega_for(rng))

    def run(q, k, v):
        return backend.to_numpy(attend(backend, *map(backend.asarray, (q, k, v)), omega=omega,
                                  feature_map=feature_map, causal=True, block_size=4))

    base = run(q, k, v)[..., : cut + 1, :]
    changed_q, changed_k, changed_v = q.copy(), k.copy(), v.copy()
    changed_q[..., cut + 1:, :] = 5.0 * rng.normal(size=changed_q[..., cut + 1:, :].shape)
    changed_k[..., cut + 1:, :] = 5.0 * rng.normal(size=changed_k[..., cut + 1:, :].shape)
    changed_k[..., cut + 1, :] = 30.0 * spread  # an outlier key right after n, same block
    changed_v[..., cut + 1:, :] = 1e3
    appended = [np.concatenate([a, 4.0 * rng.normal(size=(2, 9, a.shape[-1]))], axis=-2)
                for a in (q, k, v)]
    for variant in ((changed_q, changed_k, changed_v), appended):
        with warnings.catch_warnings():
            # the wild tokens after n may drive a trigonometric normalizer after n below
            # zero (a clamped row, warned about); rows <= n are what is checked here
            warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
            out = run(*variant)[..., : cut + 1, :]
        np.testing.assert_allclose(out, base, rtol=1e-9, atol=1e-9 * np.abs(base).max())


@pytest.mark.thin(block_size=(5, 64))
@pytest.mark.parametrize("block_size", [1, 2, 5, 64])
def test_causal_block_size_does_not_change_result(backend, rng, block_size):
    xp = backend.ns
    q, k, v = make_qkv(rng)
    omega = omega_for(rng)
    out = attend(backend, *map(backend.asarray, (q, k, v)), omega=backend.asarray(omega),
                 causal=True,
                 block_size=block_size)
    backend.check(out, explicit_rfa(q, k, v, omega, "positive", causal=True), dtype=xp.float64)


# causal rows are the non-causal formula on their prefix, over the range of scores ---------

# The typical |q.k| swept: the causal scan's stabilizer is one shift per query and one per
# key (rank one), exact while the spread of a row's logits stays inside the dtype's
# exponent range. Measured over the sweep below: every row within the tolerance up to 100
# in float32 and 1e4 in float64; at 300 (float32) a few rows lose their largest terms, and
# from 1e3 (float32) and 3e4 (float64) rows underflow to zero. The scan whose underflow
# this guards against gave zero rows from |score| ~ 80 (float32) and ~ 400 (float64).
PREFIX_MAGNITUDES = {"float64": (1.0, 30.0, 1e3, 1e4), "float32": (1.0, 30.0, 100.0)}

def prefix_rfa(q, k, v, omega, feature_map, key_mask=None, **kwargs):
    """Row n: the non-causal ``xattn.rfa`` (NumPy) of query n over the keys 0..n (those
    of them ``key_mask`` allows)."""
    rows = []
    for n in range(q.shape[-2]):
        mask = {} if key_mask is None else {"key_mask": key_mask[..., :n + 1]}
        rows.append(xattn.rfa(q[..., n:n + 1, :], k[..., :n + 1, :], v[..., :n + 1, :],
                              omega=omega, feature_map=feature_map, **mask, **kwargs))
    return np.concatenate(rows, axis=-2)


# Rounding of the causal path against the non-causal formula on each prefix, relative to
# the largest output: observed up to 8.3e-6 in float32 (70 eps; torch and JAX, hyperbolic
# map, |score| ~ 1e3) and 3e-14 in float64 (135 eps) over 8 seeds, with and without a key
# mask; 512 eps leaves a margin of about 4.
PREFIX_ROUNDING_EPS = 512


@pytest.mark.parametrize("masked", [False, True], ids=["all-keys", "key_mask"])
@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
@pytest.mark.thin(dtype_name=("float32",), feature_map=("hyperbolic",))
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_causal_equals_noncausal_formula_on_each_prefix(backend, feature_map, dtype_name,
                                                        masked):
    """A sweep of score magnitudes (:data:`PREFIX_MAGNITUDES`; the non-causal path takes
    any scores whose log-domain terms are finite) and seeds, with and without a key mask:
    the causal
    result equals the non-causal formula on each prefix within the estimator's own
    rounding, and no row with an allowed key is zero (the causal path once underflowed to
    zero rows from |score| ~ 80 in float32 and ~ 400 in float64); a row without one is."""
    xp = backend.ns
    dtype, host_dtype = getattr(xp, dtype_name), np.dtype(dtype_name)
    tolerance = PREFIX_ROUNDING_EPS * np.finfo(host_dtype).eps
    num_tokens, head_dim, num_features = 24, 8, 16
    # the typical |q.k| (scale = 1); Dask computes with NumPy: the smallest and largest
    magnitudes = PREFIX_MAGNITUDES[dtype_name]
    for magnitude in backend.thin(magnitudes, kept=magnitudes[::len(magnitudes) - 1],
                                  on=("dask",)):
        for seed in backend.thin(range(2), kept=(0,), on=("dask",)):
            draw = np.random.default_rng(seed)
            spread = np.sqrt(magnitude / np.sqrt(head_dim))
            q, k = (spread * draw.normal(size=(2, num_tokens, head_dim)) for _ in range(2))
            v = draw.normal(size=(2, num_tokens, 3))
            omega = sample_omega(seed, num_features, head_dim, xp=np, dtype=np.float64)
            # the inputs as the backend holds them, so that only the computation differs
            q, k, v, omega = (a.astype(host_dtype).astype(np.float64) for a in (q, k, v, omega))
            key_mask, mask = None, {}
            if masked:  # batch 0: the first keys masked (rows 0-2 have none); batch 1: random
                key_mask = np.ones((2, num_tokens), dtype=bool)
                key_mask[0, :3] = False
                key_mask[1] = draw.random(num_tokens) < 0.5
                mask = {"key_mask": backend.asarray(key_mask)}
            out = attend(backend, *(backend.asarray(a, dtype=dtype) for a in (q, k, v)),
                         omega=backend.asarray(omega, dtype=dtype), feature_map=feature_map,
                         scale=1.0, causal=True, block_size=8, **mask)
            expected = prefix_rfa(q, k, v, omega, feature_map, key_mask=key_mask, scale=1.0)
            has_key = (np.ones((2, num_tokens), dtype=bool) if key_mask is None
                       else np.cumsum(key_mask, axis=-1) > 0)
            rows_zero = np.all(backend.to_numpy(out) == 0, axis=-1)
            assert not np.any(rows_zero & has_key), (magnitude, seed, np.argwhere(rows_zero))
            assert np.all(rows_zero[~has_key])
            backend.check(out, expected, dtype=dtype, rtol=tolerance,
                          atol=tolerance * np.abs(expected).max())


def check_nonfinite_reaches_its_rows(backend, rng, num_tokens, block_sizes, corruptions,
                                     feature_map="positive"):
    """For each block size and each ``(array, position, value)`` of ``corruptions`` (entry
    2 of key or value ``position`` of batch row 1 set to ``value``): causal rows >= the
    position are NaN, earlier rows and the other batch row unchanged. Returns
    ``run(causal, corrupt, block_size)``, the NumPy output with one corruption (or none)."""
    q, k, v = make_qkv(rng, batch=(2,), num_queries=num_tokens, num_keys=num_tokens,
                       spread=spread_for(feature_map))
    omega = backend.asarray(omega_for(rng))

    def run(causal=True, corrupt=None, block_size=block_sizes[0]):
        bad_k, bad_v = k.copy(), v.copy()
        if corrupt is not None:
            which, position, bad = corrupt
            (bad_k if which == "key" else bad_v)[1, position, 2] = bad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
            out = attend(backend, *map(backend.asarray, (q, bad_k, bad_v)), omega=omega,
                         feature_map=feature_map, causal=causal, block_size=block_size)
        return backend.to_numpy(out)

    for block_size in block_sizes:
        clean = run(block_size=block_size)
        for corrupt in corruptions:
            position = corrupt[1]
            out = run(corrupt=corrupt, block_size=block_size)
            assert np.all(np.isnan(out[1, position:])), (block_size, corrupt)
            np.testing.assert_allclose(out[1, :position], clean[1, :position], rtol=1e-12)
            np.testing.assert_allclose(out[0], clean[0], rtol=1e-12)  # another batch row
    return run


# 640 tokens: blocks of 64 (one chunk each, the state carried from block to block) and of
# 640 (10 chunks of 64: the exclusive prefix in two groups of 8, the second padded;
# xattn._estimators.chunks)
LONG_CAUSAL_TOKENS, LONG_CAUSAL_BLOCKS = 640, (64, 640)


def long_blocks(backend):
    """The block sizes a backend walks: JAX compiles the ten blocks of 64 as one long
    program, and Dask computes them with NumPy, whose run walks them too; both take the
    whole-sequence block, which takes every path."""
    return LONG_CAUSAL_BLOCKS[1:] if backend.name in ("jax", "dask") else LONG_CAUSAL_BLOCKS


@functools.cache
def long_prefix_case(feature_map, dtype_name, magnitude):
    """q, k, v, omega (float64 holding ``dtype_name``'s values), a random key mask and
    the non-causal formula on each of the 640 prefixes (NumPy): one per worker for all
    backends, not one per test (640 calls of ``xattn.rfa`` each)."""
    host_dtype, head_dim = np.dtype(dtype_name), 8
    draw = np.random.default_rng(7)
    spread = np.sqrt(magnitude / np.sqrt(head_dim))
    q, k = (spread * draw.normal(size=(1, LONG_CAUSAL_TOKENS, head_dim)) for _ in range(2))
    v = draw.normal(size=(1, LONG_CAUSAL_TOKENS, 3))
    omega = sample_omega(3, 16, head_dim, xp=np, dtype=np.float64)
    q, k, v, omega = (a.astype(host_dtype).astype(np.float64) for a in (q, k, v, omega))
    key_mask = draw.random((1, LONG_CAUSAL_TOKENS)) < 0.7
    key_mask[0, :2] = False  # rows 0 and 1 have no key
    expected = prefix_rfa(q, k, v, omega, feature_map, key_mask=key_mask, scale=1.0)
    return q, k, v, omega, key_mask, expected


@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
@pytest.mark.thin(dtype_name=("float32",), feature_map=("positive",))
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_causal_factorized_pairs_and_grouped_states_equal_each_prefix(backend, feature_map,
                                                                      dtype_name):
    """As above for the paths that only longer blocks take: a block of several chunks,
    and the states before more than 8 chunks merged in groups. Scores over
    :data:`PREFIX_MAGNITUDES`, a random key mask: each row equals the non-causal formula
    on its prefix, and no row with a key is zero."""
    xp = backend.ns
    dtype, host_dtype = getattr(xp, dtype_name), np.dtype(dtype_name)
    tolerance = PREFIX_ROUNDING_EPS * np.finfo(host_dtype).eps
    for magnitude in PREFIX_MAGNITUDES[dtype_name][::2]:
        q, k, v, omega, key_mask, expected = long_prefix_case(feature_map, dtype_name,
                                                              magnitude)
        has_key = np.cumsum(key_mask, axis=-1) > 0
        # JAX compiles the ten blocks of 16 as one long program: its whole-sequence block
        # takes both paths (the other backends walk the blocks too)
        for block_size in long_blocks(backend):
            out = attend(backend, *(backend.asarray(a, dtype=dtype) for a in (q, k, v)),
                         omega=backend.asarray(omega, dtype=dtype), feature_map=feature_map,
                         scale=1.0, causal=True, block_size=block_size,
                         key_mask=backend.asarray(key_mask))
            rows_zero = np.all(backend.to_numpy(out) == 0, axis=-1)
            assert not np.any(rows_zero & has_key), (magnitude, block_size)
            assert np.all(rows_zero[~has_key])
            backend.check(out, expected, dtype=dtype, rtol=tolerance,
                          atol=tolerance * np.abs(expected).max())


CORRUPTIONS_IN_LONG_BLOCKS = (("key", 3, np.nan), ("value", 40, np.inf), ("key", 300, -np.inf),
                              ("value", 600, np.nan))


def test_nonfinite_key_reaches_exactly_its_rows_in_long_blocks(backend, rng):
    """NaN or infinity in a key or value m, in the first or second half of the first
    chunk, in a later chunk of the first group of 8 chunks or in the second group:
    causal rows >= m are NaN, rows < m unchanged, with blocks of 64 and of 640
    positions (see above)."""
    check_nonfinite_reaches_its_rows(
        backend, rng, LONG_CAUSAL_TOKENS, long_blocks(backend),
        backend.thin(CORRUPTIONS_IN_LONG_BLOCKS, kept=CORRUPTIONS_IN_LONG_BLOCKS[2:],
                     on=("dask",)))  # Dask, in NumPy: a later group of chunks, both halves


@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
def test_causal_large_scores_give_no_zero_rows_issue_example(backend, feature_map):
    """The reported case: float32, |score| up to ~ 300, values of ones: every row is 1."""
    xp = backend.ns
    draw = np.random.default_rng(0)
    q = (6 * draw.normal(size=(1, 96, 64))).astype(np.float32)
    k = (6 * draw.normal(size=(1, 96, 64))).astype(np.float32)
    v = np.ones((1, 96, 2), np.float32)
    out = attend(backend, *(backend.asarray(a) for a in (q, k, v)), num_features=64, rng=1,
                 causal=True, feature_map=feature_map)
    backend.check(out, np.ones((1, 96, 2)), dtype=xp.float32)


@pytest.mark.thin(feature_map=HYPERBOLIC_AND_TRIGONOMETRIC)
@pytest.mark.parametrize("feature_map", MAPS)
def test_nonfinite_key_or_value_reaches_exactly_the_rows_that_attend_it(backend, rng,
                                                                       feature_map):
    """NaN or +-inf in key (or value) m: causal rows >= m are NaN and rows < m are
    unchanged, for every block size (one position per block, several positions inside a
    block); without causal every row is NaN."""
    # a block per position walks 12 blocks: on JAX and Dask (each block costly) the
    # blocks of several positions, whose lines the NumPy, strict and torch runs share
    blocks = (5, 64) if backend.name in ("jax", "dask") else (1, 5, 64)
    corruptions = (("key", 0, np.nan), ("value", 4, np.inf), ("key", 8, -np.inf),
                   ("value", 11, np.nan))
    run = check_nonfinite_reaches_its_rows(
        backend, rng, 12, blocks,
        # Dask computes with NumPy: a value and a key, in the first and second block
        backend.thin(corruptions, kept=corruptions[1:3], on=("dask",)),
        feature_map=feature_map)
    assert np.all(np.isnan(run(causal=False, corrupt=("value", 11, np.nan))[1]))


# streaming: chunk sizes change nothing, working memory does not grow with N ---------------

@pytest.mark.thin(feature_map=HYPERBOLIC_AND_TRIGONOMETRIC)
@pytest.mark.parametrize("feature_map", MAPS)
def test_chunk_size_does_not_change_result(backend, rng, feature_map):
    """Keys in groups of at most chunk_size (running per-sample maximum, rescaled) and
    queries read out group by group: the explicit formula for every chunk size."""
    xp = backend.ns
    q, k, v = make_qkv(rng, num_queries=10, num_keys=13, spread=spread_for(feature_map))
    omega = omega_for(rng)
    key_mask = rng.random((2, 1, 13)) < 0.6
    key_mask[1, 0, :] = False  # a batch row without keys
    expected = explicit_rfa(q, k, v, omega, feature_map, key_mask=key_mask)
    # JAX (a compile per size) and Dask: several chunks with a shorter last one, and one
    for chunk_size in backend.thin((1, 4, 7, 1024), kept=(4, 1024)):
        out = attend(backend, *map(backend.asarray, (q, k, v)), omega=backend.asarray(omega),
                     feature_map=feature_map, key_mask=backend.asarray(key_mask),
                     chunk_size=chunk_size)
        backend.check(out, expected, dtype=xp.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_working_memory_is_bounded(causal):
    """N = 131072, S = 256, D = Dv = 64, float32 on NumPy: the call allocates at most
    96 MiB (tracemalloc; inputs excluded). The output is 32 MiB, held once (its groups are
    written into it on NumPy); the M x S key logits alone would be 128 MiB. Measured
    81.6 MiB (groups of 11,898 keys or queries, as many as the CPU's 64 MiB of working
    memory allow; 44.6 MiB with the chunks of 1,024 before) and causal 81.1 MiB (blocks
    as long as that budget allows, 38.5 MiB with the blocks of 128 positions before the
    chunkwise scan), first call of the process included; 75.1 (64.4) MiB when the
    chunks were concatenated."""
    draw = np.random.default_rng(0)
    q, k, v = (draw.normal(size=(1, 131072, 64)).astype(np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        out = xattn.rfa(q, k, v, num_features=256, rng=0, causal=causal)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (1, 131072, 64)
    assert peak <= 96 * 2**20, f"peak {peak / 2**20:.1f} MiB"


# 6: seeds, gradients, jit ------------------------------------------------------------------

@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.thin(orthogonal=(True,))
@pytest.mark.parametrize("orthogonal", [True, False])
def test_int_seed_same_output_on_every_backend(backend, rng, feature_map, orthogonal):
    xp = backend.ns
    q, k, v = make_qkv(rng, spread=spread_for(feature_map))
    kwargs = dict(num_features=12, feature_map=feature_map, orthogonal=orthogonal, rng=123)
    expected = xattn.rfa(q, k, v, **kwargs)  # NumPy
    out = attend(backend, *map(backend.asarray, (q, k, v)), **kwargs)
    backend.check(out, expected, dtype=xp.float64, rtol=1e-9)
    omega = sample_omega(123, 12, 8, xp=np, dtype=np.float64, orthogonal=orthogonal)
    np.testing.assert_allclose(expected, explicit_rfa(q, k, v, omega, feature_map), rtol=1e-10)


def test_native_generator_and_default_features(backend, rng):
    q, k, v = make_qkv(rng, batch=(2,))
    arrays = tuple(map(backend.asarray, (q, k, v)))
    generator = xattn.random.default_rng(0, like=arrays[0])
    out = xattn.rfa(*arrays, rng=generator)
    assert tuple(out.shape) == (2, 9, 5)
    assert np.all(np.isfinite(backend.to_numpy(out)))
    fresh = xattn.rfa(*arrays)  # rng=None: fresh entropy, default S = max(D, D ln D)
    assert np.all(np.isfinite(backend.to_numpy(fresh)))


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_torch_gradients(rng, feature_map, causal):
    torch = pytest.importorskip("torch")
    # one batch row (rows are independent): half the finite differences of two
    q, k, v = make_qkv(rng, batch=(1,), num_queries=5, num_keys=5, head_dim=3, value_dim=2,
                       spread=spread_for(feature_map))
    omega = torch.as_tensor(omega_for(rng, num_features=4, head_dim=3))
    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]

    def function(q, k, v):
        return xattn.rfa(q, k, v, omega=omega, feature_map=feature_map, causal=causal,
                         block_size=2)

    assert torch.autograd.gradcheck(function, tensors)


@pytest.mark.parametrize("feature_map,causal", [("positive", False), ("positive", True),
                                                ("hyperbolic", True), ("trigonometric", True)])
def test_jax_gradients_match_torch(rng, feature_map, causal, jax_x64):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    q, k, v = make_qkv(rng, batch=(2,), num_queries=5, num_keys=5, head_dim=3, value_dim=2,
                       spread=spread_for(feature_map))
    omega = omega_for(rng, num_features=4, head_dim=3)
    weights = rng.normal(size=(2, 5, 2))

    def jax_loss(q, k, v):
        out = xattn.rfa(q, k, v, omega=jax.numpy.asarray(omega), feature_map=feature_map,
                        causal=causal, block_size=2)
        return jax.numpy.sum(out * weights)

    jax_grads = jax.jit(jax.grad(jax_loss, argnums=(0, 1, 2)))(
        *map(jax.numpy.asarray, (q, k, v)))
    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = xattn.rfa(*tensors, omega=torch.as_tensor(omega), feature_map=feature_map,
                    causal=causal, block_size=2)
    (out * torch.as_tensor(weights)).sum().backward()
    for jax_grad, tensor in zip(jax_grads, tensors, strict=True):
        assert np.all(np.isfinite(np.asarray(jax_grad)))
        np.testing.assert_allclose(np.asarray(jax_grad), tensor.grad.numpy(), rtol=1e-9,
                                   atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_jax_jit_with_key(rng, causal, jax_x64):
    jax = pytest.importorskip("jax")
    q, k, v = map(jax.numpy.asarray, make_qkv(rng, batch=(2,)))

    @jax.jit
    def attend(q, k, v, key):
        return xattn.rfa(q, k, v, num_features=16, rng=key, causal=causal, block_size=5)

    key = jax.random.key(0)
    jitted = attend(q, k, v, key)
    # the same key draws the same samples outside jit: the NumPy result with them
    omega = np.asarray(sample_omega(key, 16, 8, xp=jax.numpy, dtype=jax.numpy.float64))
    expected = xattn.rfa(*map(np.asarray, (q, k, v)), omega=omega, causal=causal,
                         block_size=5)
    np.testing.assert_allclose(np.asarray(jitted), expected, rtol=1e-9)
    other = attend(q, k, v, jax.random.key(1))
    assert not np.allclose(np.asarray(other), np.asarray(jitted))


# trigonometric guard -------------------------------------------------------------------------

def negative_denominator_case():
    # one sample w = pi, one key at distance 1 from the query: cos(w (q - k)) = -1 < 0
    q = np.zeros((1, 2, 1))
    k = np.array([[[1.0], [1.0]]])
    v = np.array([[[1.0], [2.0]]])
    return q, k, v, np.array([[np.pi]])


def test_trigonometric_negative_denominator_warns_and_stays_finite(backend):
    q, k, v, omega = negative_denominator_case()
    for causal in (False, True):
        arguments = dict(omega=backend.asarray(omega), feature_map="trigonometric", scale=1.0,
                         causal=causal)
        if backend.name.startswith(("dask", "jax")):
            # lazy Dask (reading the flags would compute the graph twice) and JAX when the
            # harness compiles the call: only the clamp applies, a warning is optional
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
                out = xattn.rfa(*map(backend.asarray, (q, k, v)), **arguments)
        else:
            with pytest.warns(TrigonometricDenominatorWarning, match="not positive"):
                out = xattn.rfa(*map(backend.asarray, (q, k, v)), **arguments)
        assert np.all(np.isfinite(backend.to_numpy(out)))


def test_trigonometric_guard_under_jit_is_finite(jax_x64):
    jax = pytest.importorskip("jax")
    q, k, v, omega = map(jax.numpy.asarray, negative_denominator_case())
    attend = jax.jit(lambda q, k, v: xattn.rfa(q, k, v, omega=omega, scale=1.0,
                                               feature_map="trigonometric"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = attend(q, k, v)  # traced: values cannot be read, only the clamp applies
    assert np.all(np.isfinite(np.asarray(out)))


# 7: bad input -------------------------------------------------------------------------------

def test_bad_input(rng):
    q, k, v = make_qkv(rng, batch=(2,))
    with pytest.raises(ValueError, match="num_features"):
        xattn.rfa(q, k, v, num_features=0)
    with pytest.raises(TypeError, match="num_features"):
        xattn.rfa(q, k, v, num_features=2.5)
    with pytest.raises(ValueError, match=r"omega must have shape \(S, D\) = \(S, 8\)"):
        xattn.rfa(q, k, v, omega=np.ones((4, 7)))
    with pytest.raises(ValueError, match=r"omega must have shape \(S, D\) = \(5, 8\)"):
        xattn.rfa(q, k, v, omega=np.ones((4, 8)), num_features=5)
    with pytest.raises(ValueError, match=r"omega must have shape \(S, D\) or \(\.\.\., S, D\) "
                       r"with leading dims that broadcast against .* \(2,\)"):
        xattn.rfa(q, k, v, omega=np.ones((3, 4, 8)))  # (2, 4, 8): one matrix per batch
    with pytest.raises(ValueError, match="feature_map"):
        xattn.rfa(q, k, v, feature_map="cosine")
    with pytest.raises(ValueError, match="block_size"):
        xattn.rfa(q, k, v, causal=True, block_size=0)
    with pytest.raises(TypeError, match="causal"):
        xattn.rfa(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="sample_norm"):
        xattn.rfa(q, k, v, sample_norm="unit")


def test_omega_from_another_library(rng):
    torch = pytest.importorskip("torch")
    q, k, v = make_qkv(rng, batch=(2,))
    with pytest.raises(TypeError, match="omega"):
        xattn.rfa(q, k, v, omega=torch.ones(4, 8, dtype=torch.float64))
