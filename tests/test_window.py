"""xattn.rfa(..., window=, sinks=): an exact band and sink keys, random features for the rest.

Every backend is compared against the explicit float64 kernel matrix (exact
e^{q.k} inside the band and on the sinks, phi(q).phi(k) elsewhere); statistical tests
(unbiasedness) run on NumPy, where the samples come from an int seed.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

import xattn
from xattn import TrigonometricDenominatorWarning
from xattn.features import random_features, sample_omega

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

MAPS = ("positive", "hyperbolic", "trigonometric")
# The hyperbolic map is the positive map with the samples +-w (xattn._estimators.rfa): the
# same lines of xattn. On JAX and Dask (thin) a test of every map runs the hyperbolic one
# for both, and the trigonometric map, whose lines are its own.
HYPERBOLIC_AND_TRIGONOMETRIC = ("hyperbolic", "trigonometric")


def exact_set(num_queries, num_keys, window, sinks):
    """Boolean (N, M): the keys computed exactly, |n - m| <= window (window >= 1) or m < sinks."""
    n, m = np.arange(num_queries)[:, None], np.arange(num_keys)[None, :]
    band = (np.abs(n - m) <= window) if window else np.zeros((num_queries, num_keys), bool)
    return band | (m < sinks)


def explicit_windowed_rfa(q, k, v, omega, feature_map, window, sinks, *, scale=None,
                          key_mask=None, causal=False):
    """The kernel matrix written out in float64: e^{q^.k^} on the exact set, the random-
    feature estimate phi(q^).phi(k^) elsewhere, zero where not allowed; y = K v / K 1."""
    q, k, v, omega = (np.asarray(a, dtype=np.float64) for a in (q, k, v, omega))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    q_hat, k_hat = np.sqrt(scale) * q, np.sqrt(scale) * k
    estimate = random_features(np, q_hat, omega, feature_map) @ np.swapaxes(
        random_features(np, k_hat, omega, feature_map), -1, -2)
    exact = np.exp(q_hat @ np.swapaxes(k_hat, -1, -2))
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    kernel = np.where(exact_set(num_queries, num_keys, window, sinks), exact, estimate)
    allowed = np.ones((num_queries, num_keys), dtype=bool)
    if causal:
        allowed &= np.arange(num_queries)[:, None] >= np.arange(num_keys)[None, :]
    if key_mask is not None:
        allowed = allowed & np.asarray(key_mask)[..., None, :]
    kernel = np.where(allowed, kernel, 0.0)
    denominator = kernel.sum(-1, keepdims=True)
    return (kernel @ v) / np.where(allowed.any(-1, keepdims=True), denominator, 1.0)


def make_qkv(rng, batch=(2, 3), num_queries=13, num_keys=11, head_dim=8, value_dim=3,
             spread=0.5):
    q = spread * rng.normal(size=(*batch, num_queries, head_dim))
    k = spread * rng.normal(size=(*batch, num_keys, head_dim))
    v = rng.normal(size=(*batch, num_keys, value_dim))
    return q, k, v


def omega_for(seed, num_features=16, head_dim=8):
    return sample_omega(seed, num_features, head_dim, xp=np, dtype=np.float64)


def attend(backend, q, k, v, **kwargs):
    """``xattn.rfa`` on the backend; on JAX under :func:`jax.jit` (arrays traced, the
    other keywords static), which checks that the windowed paths trace."""
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


def quiet(call, *args, **kwargs):
    """Run ``call`` ignoring the trigonometric guard's warning (small S can clamp a row)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        return call(*args, **kwargs)


# the explicit formula: masks, causal, N != M, every map, band and sinks -----------------

CONFIGURATIONS = [(1, 0), (0, 3), (2, 1), (6, 2)]  # (window, sinks)


# JAX, Dask: the positive map (the general one, trigonometric, takes the same band and
# sinks there in test_block_size_does_not_change_the_result)
@pytest.mark.thin(feature_map=("positive",))
@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_explicit_kernel_matrix(backend, rng, feature_map, causal):
    """Band only, sinks only, both, a band wider than a block; N > M without a mask and
    N < M with one (including a batch row whose keys are all masked)."""
    xp = backend.ns
    spread = 0.3 if feature_map == "trigonometric" else 0.5
    omega = omega_for(1)
    # on JAX and Dask the masked N < M case, the one with more to get wrong (the same
    # lines of xattn for both shapes; the unmasked windowed calls compile and build
    # graphs in the block-size, one-hot and large-score tests below)
    for (num_queries, num_keys), masked in backend.thin((((13, 11), False), ((9, 14), True)),
                                                        kept=(((9, 14), True),)):
        q, k, v = make_qkv(rng, num_queries=num_queries, num_keys=num_keys, spread=spread)
        key_mask = None
        if masked:
            key_mask = rng.random((2, 1, num_keys)) < 0.7
            key_mask[1, 0, :] = False  # a batch row without keys: zero outputs
        arrays = [backend.asarray(a) for a in (q, k, v)]
        # on JAX (each configuration compiles anew) and Dask (a new graph): the two that
        # take every path (band, sinks inside and outside the band, both scans)
        for window, sinks in backend.thin(CONFIGURATIONS, kept=CONFIGURATIONS[2:]):
            out = quiet(attend, backend, *arrays, omega=backend.asarray(omega),
                        feature_map=feature_map, window=window, sinks=sinks, causal=causal,
                        block_size=4,
                        key_mask=None if key_mask is None else backend.asarray(key_mask))
            expected = explicit_windowed_rfa(q, k, v, omega, feature_map, window, sinks,
                                             key_mask=key_mask, causal=causal)
            backend.check(out, expected, dtype=xp.float64)


# JAX and Dask: the trigonometric map (its own lines); the positive maps' float32 windowed
# calls run there in test_scores_of_80_stay_finite_in_float32
@pytest.mark.thin(feature_map=("trigonometric",))
@pytest.mark.parametrize("feature_map", MAPS)
def test_float32_scale_and_broadcast_leading_dims(backend, rng, feature_map):
    xp = backend.ns
    spread = 0.3 if feature_map == "trigonometric" else 0.5
    q = spread * rng.normal(size=(2, 1, 10, 4))
    k = spread * rng.normal(size=(1, 3, 10, 4))
    v = rng.normal(size=(10, 2))
    omega = omega_for(2, num_features=8, head_dim=4)
    for causal in (False, True):
        out = quiet(attend, backend, *(backend.asarray(a, dtype=xp.float32) for a in (q, k, v)),
                    omega=backend.asarray(omega, dtype=xp.float32), feature_map=feature_map,
                    window=2, sinks=1, causal=causal, block_size=3, scale=0.7)
        assert tuple(out.shape) == (2, 3, 10, 2)
        expected = explicit_windowed_rfa(q, k, v, omega, feature_map, 2, 1, scale=0.7,
                                         causal=causal)
        backend.check(out, expected, dtype=xp.float32, rtol=1e-4)


# JAX, Dask: blocks of 3 (several, a band across blocks); one block is the default of
# the other tests
@pytest.mark.thin(block_size=(3,))
@pytest.mark.parametrize("block_size", [1, 3, 5, 64])
@pytest.mark.parametrize("feature_map", ["positive", "trigonometric"])
def test_block_size_does_not_change_the_result(backend, rng, block_size, feature_map):
    xp = backend.ns
    q, k, v = make_qkv(rng, batch=(2,), num_queries=12, num_keys=12, spread=0.3)
    omega = omega_for(3)
    for causal in (False, True):
        out = quiet(attend, backend, *map(backend.asarray, (q, k, v)),
                    omega=backend.asarray(omega), feature_map=feature_map, window=2, sinks=1,
                    causal=causal, block_size=block_size)
        expected = explicit_windowed_rfa(q, k, v, omega, feature_map, 2, 1, causal=causal)
        backend.check(out, expected, dtype=xp.float64)


# the limits: everything exact, and nothing exact ------------------------------------------

@pytest.mark.thin(feature_map=HYPERBOLIC_AND_TRIGONOMETRIC)
@pytest.mark.parametrize("feature_map", MAPS)
def test_band_or_sinks_covering_every_key_is_exact_attention(backend, rng, feature_map):
    xp = backend.ns
    q, k, v = make_qkv(rng, num_queries=10, num_keys=7, spread=1.0)
    arrays = [backend.asarray(a) for a in (q, k, v)]
    for causal in (False, True):
        exact = xattn.softmax_attention(q, k, v, causal=causal)
        # on JAX and Dask: the band alone, and the sinks alone, covering every key
        for window, sinks in backend.thin([(10, 0), (50, 3), (0, 7), (2, 7)],
                                          kept=[(10, 0), (0, 7)]):
            out = attend(backend, *arrays, num_features=4, rng=0, feature_map=feature_map,
                         window=window, sinks=sinks, causal=causal, block_size=4)
            backend.check(out, exact, dtype=xp.float64)


@pytest.mark.thin(feature_map=HYPERBOLIC_AND_TRIGONOMETRIC)
@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_no_window_and_no_sinks_is_plain_rfa_bit_for_bit(backend, rng, feature_map, causal):
    q, k, v = make_qkv(rng, spread=0.5)
    arrays = [backend.asarray(a) for a in (q, k, v)]
    options = dict(num_features=12, feature_map=feature_map, rng=7, causal=causal,
                   block_size=4)
    plain = backend.to_numpy(quiet(attend, backend, *arrays, **options))
    for window in (None, 0):
        out = quiet(attend, backend, *arrays, window=window, sinks=0, **options)
        np.testing.assert_array_equal(backend.to_numpy(out), plain)


# nothing counted twice: one-hot values expose each key's weight ------------------------------

@pytest.mark.thin(feature_map=HYPERBOLIC_AND_TRIGONOMETRIC)
@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_each_key_exact_inside_the_band_and_random_outside(backend, rng, feature_map, causal):
    """With v = I (one-hot values) output (n, m) is kappa_nm / sum_m kappa_nm, so
    out[n, m] / out[n, n] is kappa_nm / e^{q_n.k_n} (the diagonal is always in the band).
    It must be exactly e^{q_n.k_m - q_n.k_n} on the band and the sinks (counted once) and
    the random-feature ratio everywhere else."""
    num_tokens, window, sinks = 12, 2, 2
    q, k, _ = make_qkv(rng, batch=(2,), num_queries=num_tokens, num_keys=num_tokens,
                       spread=0.4)
    one_hot = np.broadcast_to(np.eye(num_tokens), (2, num_tokens, num_tokens))
    omega = omega_for(5)
    out = backend.to_numpy(quiet(
        attend, backend, *map(backend.asarray, (q, k, one_hot)), omega=backend.asarray(omega),
        feature_map=feature_map, window=window, sinks=sinks, causal=causal, block_size=5,
        scale=1.0))
    ratio = out / np.diagonal(out, axis1=-2, axis2=-1)[..., :, None]
    scores = q @ np.swapaxes(k, -1, -2)
    exact_ratio = np.exp(scores - np.diagonal(scores, axis1=-2, axis2=-1)[..., :, None])
    features_q = random_features(np, q, omega, feature_map)
    features_k = random_features(np, k, omega, feature_map)
    random_ratio = (features_q @ np.swapaxes(features_k, -1, -2)) / np.exp(
        np.diagonal(scores, axis1=-2, axis2=-1))[..., :, None]
    exact = exact_set(num_tokens, num_tokens, window, sinks)
    allowed = np.tril(np.ones((num_tokens, num_tokens), bool)) if causal else True
    expected = np.where(allowed, np.where(exact, exact_ratio, random_ratio), 0.0)
    np.testing.assert_allclose(ratio, expected, rtol=1e-9, atol=1e-12)
    outside = ~exact & allowed
    assert np.all(np.abs(random_ratio - exact_ratio)[..., outside] > 1e-6)  # truly random


# unbiased kernel sums (positive map) ------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,sinks", [(1, 0), (2, 1)])
def test_numerator_and_denominator_are_unbiased(causal, window, sinks):
    """Z-test over 600 draws of iid samples (S = 8): the kernel sums sum_m kappa_nm [v_m, 1]
    of every query, read from the output through the exact diagonal term, have the mean
    sum_m e^{q.k} [v_m, 1] (4 standard errors per entry; 40 entries, so a false alarm has
    probability < 40 * 6.3e-5)."""
    rng = np.random.default_rng(11)
    num_tokens, head_dim, draws = 8, 4, 600
    q, k, v = make_qkv(rng, batch=(), num_queries=num_tokens, num_keys=num_tokens,
                       head_dim=head_dim, value_dim=4, spread=0.5)
    one_hot = np.eye(num_tokens)
    scores = q @ k.T  # scale = 1
    diagonal_kernel = np.exp(np.diagonal(scores))
    estimates = []
    for draw in range(draws):
        out = xattn.rfa(q, k, one_hot, num_features=8, orthogonal=False, rng=draw, scale=1.0,
                        window=window, sinks=sinks, causal=causal, block_size=3)
        kernel = out * (diagonal_kernel / np.diagonal(out))[:, None]  # kappa_nm
        estimates.append(np.concatenate([kernel @ v, kernel.sum(-1, keepdims=True)], -1))
    estimates = np.stack(estimates)
    exact_kernel = np.exp(scores)
    if causal:
        exact_kernel = np.tril(exact_kernel)
    expected = np.concatenate([exact_kernel @ v, exact_kernel.sum(-1, keepdims=True)], -1)
    standard_error = estimates.std(axis=0, ddof=1) / np.sqrt(draws)
    z = (estimates.mean(axis=0) - expected) / np.maximum(standard_error, 1e-300)
    allowed = np.tril(np.ones((num_tokens, num_tokens), bool)) if causal else True
    random_rows = np.any(~exact_set(num_tokens, num_tokens, window, sinks) & allowed, axis=-1)
    assert random_rows.sum() >= num_tokens // 2  # rows whose keys are all exact: no noise
    np.testing.assert_allclose(estimates.mean(axis=0)[~random_rows], expected[~random_rows],
                               rtol=1e-10)
    assert np.all(np.abs(z[random_rows]) < 4.0), np.abs(z).max()


# stability, gradients, lazy backends ----------------------------------------------------

@pytest.mark.thin(feature_map=("hyperbolic",))
@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
@pytest.mark.parametrize("causal", [False, True])
def test_scores_of_80_stay_finite_in_float32(backend, rng, feature_map, causal):
    """One shift per query for the exact and the random part, no epsilon: scores of 80
    (e^80 overflows float32 unstabilized) agree with the float64 result."""
    xp = backend.ns
    head_dim = 8
    direction = rng.normal(size=head_dim)
    direction /= np.linalg.norm(direction)
    q = np.sqrt(80.0) * (direction + 0.05 * rng.normal(size=(2, 12, head_dim)))
    k = np.sqrt(80.0) * (direction + 0.05 * rng.normal(size=(2, 12, head_dim)))
    v = rng.normal(size=(2, 12, 3))
    omega = omega_for(6, num_features=32, head_dim=head_dim)
    options = dict(feature_map=feature_map, scale=1.0, causal=causal, window=2, sinks=1,
                   block_size=4)
    out = attend(backend, *(backend.asarray(a, dtype=xp.float32) for a in (q, k, v)),
                 omega=backend.asarray(omega, dtype=xp.float32), **options)
    result = backend.to_numpy(out)
    assert np.all(np.isfinite(result))
    expected = xattn.rfa(q, k, v, omega=omega, **options)  # NumPy float64
    np.testing.assert_allclose(result, expected, rtol=1e-3, atol=1e-3 * np.abs(v).max())


# a causal sequence in one block whose length is not a multiple of the band's chunk: the
# band and the scan in equal chunks (xattn._estimators.window.window_layout: 70 positions
# with a window of 64 are one band chunk of 70, 150 are two of 75; a window of 20 takes
# chunks of 32 or a little more), several batch-heads
RAGGED = [(40, 64, 1), (70, 64, 1), (100, 64, 0), (150, 64, 1), (201, 64, 2), (70, 16, 0),
          (150, 20, 2), (201, 16, 1)]


@pytest.mark.thin(case=(RAGGED[3],))
@pytest.mark.parametrize("case", RAGGED)
def test_ragged_causal_lengths_match_the_kernel_matrix(backend, rng, case):
    length, window, sinks = case
    xp = backend.ns
    q, k, v = make_qkv(rng, batch=(2, 2), num_queries=length, num_keys=length)
    omega = omega_for(5)
    out = attend(backend, *(backend.asarray(a) for a in (q, k, v)),
                 omega=backend.asarray(omega), window=window, sinks=sinks, causal=True)
    expected = explicit_windowed_rfa(q, k, v, omega, "positive", window, sinks, causal=True)
    backend.check(out, expected, dtype=xp.float64)


# one block padded to a layout longer than the budget's multiple of 64 (window 16 at 1,091
# positions: 1,156 against a block of 1,152; window 128 at 1,028: 1,152 against 1,088),
# not causal with its padding keys masked: the same as blocks of 100 positions, which
# are laid out block by block
@pytest.mark.thin(case=((1091, 16, True),))
@pytest.mark.parametrize("case", [(1091, 16, True), (1028, 128, True), (1100, 64, False),
                                  (150, 64, False), (70, 16, False), (1091, 16, False)])
def test_one_ragged_block_equals_blocks_of_100(backend, rng, case):
    length, window, causal = case
    xp = backend.ns
    q, k, v = make_qkv(rng, batch=(2,), num_queries=length, num_keys=length)
    arrays = [backend.asarray(a) for a in (q, k, v)]
    options = dict(omega=backend.asarray(omega_for(7)), window=window, sinks=1, causal=causal)
    whole = attend(backend, *arrays, **options)
    blocks = attend(backend, *arrays, **options, block_size=100)
    backend.check(whole, backend.to_numpy(blocks), dtype=xp.float64)


@pytest.mark.parametrize("case", RAGGED[1:5])
def test_ragged_causal_gradients_match_the_kernel_matrix(case):
    """torch float64: the gradients of q, k and v against autograd through the explicit
    kernel matrix (positive features written out), at the ragged layouts above."""
    torch = pytest.importorskip("torch")
    length, window, sinks = case
    q, k, v = make_qkv(np.random.default_rng(length), batch=(2, 2), num_queries=length,
                       num_keys=length)
    omega = torch.as_tensor(omega_for(6))
    ours = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    theirs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    cotangent = torch.as_tensor(np.random.default_rng(0).normal(size=(2, 2, length, 3)))
    out = xattn.rfa(*ours, omega=omega, window=window, sinks=sinks, causal=True)
    (out * cotangent).sum().backward()

    q_hat, k_hat = (x / 8 ** 0.25 for x in theirs[:2])

    def features(x):  # exp(x . w - |x|^2 / 2) / sqrt(S)
        return torch.exp(x @ omega.T - 0.5 * (x * x).sum(-1, keepdim=True)) / 4.0

    positions = torch.arange(length)
    offset = positions[:, None] - positions[None, :]
    exact = (offset <= window) | (positions[None, :] < sinks)
    kernel = torch.where(exact, torch.exp(q_hat @ k_hat.transpose(-1, -2)),
                         features(q_hat) @ features(k_hat).transpose(-1, -2))
    kernel = torch.where(offset >= 0, kernel, 0.0)
    expected = (kernel @ theirs[2]) / kernel.sum(-1, keepdim=True)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
    (expected * cotangent).sum().backward()
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_gradients(causal):
    torch = pytest.importorskip("torch")
    # one batch row (rows are independent): half the finite differences of two
    q, k, v = make_qkv(np.random.default_rng(3), batch=(1,), num_queries=7, num_keys=7,
                       head_dim=3, value_dim=2)
    omega = torch.as_tensor(omega_for(4, num_features=4, head_dim=3))
    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]

    def function(q, k, v):
        return xattn.rfa(q, k, v, omega=omega, window=1, sinks=1, causal=causal, block_size=3)

    assert torch.autograd.gradcheck(function, tensors)


def test_dask_stays_lazy_and_chunked_like_the_queries():
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, batch=(2,), num_queries=40, num_keys=40)
    omega = omega_for(9)
    expected = xattn.rfa(q, k, v, omega=omega, window=3, sinks=2, block_size=10)
    chunked = [da.from_array(a, chunks=(2, 10, a.shape[-1])) for a in (q, k, v)]
    out = xattn.rfa(*chunked, omega=da.from_array(omega), window=3, sinks=2, block_size=10)
    assert isinstance(out, da.Array)
    assert out.chunks[-2] == (10, 10, 10, 10)
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, rtol=1e-10)


# bad input ----------------------------------------------------------------------------------

def test_bad_window_and_sinks(rng):
    q, k, v = make_qkv(rng, batch=(2,))
    with pytest.raises(ValueError, match="window must be >= 0, got -1"):
        xattn.rfa(q, k, v, window=-1)
    with pytest.raises(ValueError, match="sinks must be >= 0, got -2"):
        xattn.rfa(q, k, v, sinks=-2)
    with pytest.raises(ValueError, match=r"sinks must be <= M = 11 \(the number of keys\)"):
        xattn.rfa(q, k, v, sinks=12)
    with pytest.raises(TypeError, match="window must be an int"):
        xattn.rfa(q, k, v, window=2.5)
    with pytest.raises(TypeError, match="sinks must be an int"):
        xattn.rfa(q, k, v, sinks=True)
    assert xattn.rfa(q, k, v, window=np.int64(2), sinks=np.int32(1), rng=0).shape == (2, 13, 3)
