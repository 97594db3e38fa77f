"""Linear-chain MRF partition functions: exact vs enumeration, random features vs exact."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import xattn
from xattn.mrf import log_partition, log_partition_rf


def brute_force_log_partition(embeddings):
    """log sum over all |X|^T paths of prod_t exp(e_{t-1}(x_{t-1}) . e_t(x_t)), float64."""
    embeddings = np.asarray(embeddings, dtype=np.float64)
    num_steps, num_states = embeddings.shape[-3:-1]
    path_log_weights = []
    for path in itertools.product(range(num_states), repeat=num_steps):
        path_log_weights.append(sum(
            np.sum(embeddings[..., t - 1, path[t - 1], :] * embeddings[..., t, path[t], :],
                   axis=-1)
            for t in range(1, num_steps)
        ))
    path_log_weights = np.stack(path_log_weights, axis=-1)
    top = path_log_weights.max(axis=-1)
    return top + np.log(np.exp(path_log_weights - top[..., None]).sum(axis=-1))


def reference_log_partition_rf(embeddings, omega):
    """log(beta_0^T M_1 ... M_{T-2} gamma) with phi(e) = exp(omega e - |e|^2/2)/sqrt(d),
    the seed's eq. 3 evaluated literally in float64 (small, well-scaled inputs only)."""
    embeddings, omega = (np.asarray(a, dtype=np.float64) for a in (embeddings, omega))
    features = np.exp(embeddings @ omega.T - 0.5 * np.sum(embeddings**2, -1, keepdims=True))
    features /= np.sqrt(omega.shape[0])  # (..., T, |X|, d)
    message = features[..., 0, :, :].sum(-2)
    for t in range(1, embeddings.shape[-3] - 1):
        matrix = np.swapaxes(features[..., t, :, :], -1, -2) @ features[..., t, :, :]
        message = (message[..., None, :] @ matrix)[..., 0, :]
    return np.log(np.sum(message * features[..., -1, :, :].sum(-2), axis=-1))


def make_embeddings(rng, batch=(2,), num_steps=4, num_states=3, embed_dim=5, spread=0.5):
    return spread * rng.normal(size=(*batch, num_steps, num_states, embed_dim))


@pytest.mark.parametrize("num_steps", [2, 3, 5])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_exact_matches_enumeration(backend, rng, num_steps, dtype_name):
    xp = backend.ns
    embeddings = make_embeddings(rng, batch=(2, 3), num_steps=num_steps)
    dtype = getattr(xp, dtype_name)
    out = log_partition(backend.asarray(embeddings, dtype=dtype))
    backend.check(out, brute_force_log_partition(embeddings), dtype=dtype)


def test_exact_large_potentials_stay_finite(backend, rng):
    # potentials up to e^{±900}: the naive product overflows, the log-space pass does not
    xp = backend.ns
    embeddings = make_embeddings(rng, batch=(), num_steps=3, num_states=3, spread=10.0)
    out = log_partition(backend.asarray(embeddings))
    backend.check(out, brute_force_log_partition(embeddings), dtype=xp.float64)


def test_sequence_of_positions_equals_stacked(backend, rng):
    xp = backend.ns
    embeddings = make_embeddings(rng, num_steps=4)
    steps = [backend.asarray(embeddings[..., t, :, :]) for t in range(4)]
    backend.check(log_partition(steps), brute_force_log_partition(embeddings), dtype=xp.float64)
    expected = log_partition_rf(embeddings, num_features=7, rng=3)
    backend.check(log_partition_rf(steps, num_features=7, rng=3), expected, dtype=xp.float64)


@pytest.mark.parametrize("num_steps", [2, 3, 4, 6, 7, 9])
def test_sequential_and_parallel_agree_with_reference(backend, rng, num_steps):
    """Both evaluation orders of the same estimate (same int seed, hence the same omega on
    every backend) agree with each other and with the literal eq. 3 to float64 rounding;
    T covers no middle matrix (2), one (3) and odd/even counts for the pairwise reduction."""
    xp = backend.ns
    embeddings = make_embeddings(rng, batch=(2, 3), num_steps=num_steps)
    omega = xattn.features.sample_omega(5, 16, 5, xp=np, dtype=np.float64)
    expected = reference_log_partition_rf(embeddings, omega)
    for method in ("sequential", "parallel"):
        out = log_partition_rf(backend.asarray(embeddings), num_features=16, rng=5, method=method)
        backend.check(out, expected, dtype=xp.float64)


def test_float32_follows_float64(backend, rng):
    xp = backend.ns
    embeddings = make_embeddings(rng, num_steps=5)
    omega = rng.normal(size=(32, 5))
    expected = reference_log_partition_rf(embeddings, omega)
    for method in ("sequential", "parallel"):
        out = log_partition_rf(backend.asarray(embeddings, dtype=xp.float32),
                               omega=backend.asarray(omega, dtype=xp.float32), method=method)
        backend.check(out, expected, dtype=xp.float32)


def test_large_embeddings_stay_finite(backend, rng):
    """Feature values up to e^{±60}: the log-space messages and the per-matrix log-scales
    keep log Z finite where the literal products would overflow in float32."""
    xp = backend.ns
    embeddings = make_embeddings(rng, batch=(), num_steps=6, num_states=4, spread=3.0)
    omega = backend.asarray(rng.normal(size=(64, 5)))
    sequential = log_partition_rf(backend.asarray(embeddings), omega=omega)
    parallel = log_partition_rf(backend.asarray(embeddings), omega=omega, method="parallel")
    expected = backend.to_numpy(sequential)
    assert np.all(np.isfinite(expected))
    backend.check(parallel, expected, dtype=xp.float64)


def test_two_positions_unbiased_in_z(backend, rng):
    """For T = 2 the estimate of Z is a mean over d iid rows of an unbiased kernel estimate,
    so E[Z_rf / Z] = 1. 400 independent omega (a batch of shape (400, d, n)) give the
    sample mean of Z_rf / Z and its standard error; the ratio is skewed (a sum of
    exponentials), so allow |mean - 1| < 5 SE (the standardized deviation had standard
    deviation 1.06 and maximum 4.4 over 200 random chains)."""
    embeddings = make_embeddings(rng, batch=(), num_steps=2, num_states=4, spread=0.4)
    omega = rng.normal(size=(400, 8, 5))
    estimates = log_partition_rf(backend.asarray(embeddings), omega=backend.asarray(omega))
    ratio = np.exp(backend.to_numpy(estimates) - brute_force_log_partition(embeddings))
    assert ratio.shape == (400,)
    standard_error = ratio.std(ddof=1) / np.sqrt(ratio.size)
    assert standard_error > 0
    assert abs(ratio.mean() - 1.0) < 5 * standard_error


def test_error_in_log_z_shrinks_with_num_features(backend, rng):
    """The error of log Z_rf is a/sqrt(d) + O(1/d) (fluctuation, then the bias of the shared
    features and of the log), so the mean absolute error over replicates should drop by
    about sqrt(256/16) = 4 from d = 16 to d = 256 (3.4 is the median ratio measured over 100
    random chains of this size: the O(1/d) terms still matter at d = 16, and the ratio
    varies from chain to chain between ~2.1 and ~5). With R = 200 replicates each mean
    absolute error is known to ~7%, i.e. the ratio to ~10%. Assert a ratio > 2: half the
    theoretical gain, and far from the ratio 1 of no improvement."""
    embeddings = make_embeddings(rng, batch=(), num_steps=5, num_states=4, spread=0.4)
    exact = brute_force_log_partition(embeddings)
    mean_abs_error = {}
    for num_features in (16, 256):
        omega = rng.normal(size=(200, num_features, 5))  # 200 independent replicates
        estimates = log_partition_rf(backend.asarray(embeddings), omega=backend.asarray(omega))
        mean_abs_error[num_features] = np.mean(np.abs(backend.to_numpy(estimates) - exact))
    assert mean_abs_error[256] < mean_abs_error[16] / 2.0


def test_seeds_reproduce_and_differ(backend, rng):
    embeddings = backend.asarray(make_embeddings(rng))
    first = backend.to_numpy(log_partition_rf(embeddings, num_features=8, rng=1))
    again = backend.to_numpy(log_partition_rf(embeddings, num_features=8, rng=1))
    other = backend.to_numpy(log_partition_rf(embeddings, num_features=8, rng=2))
    iid = backend.to_numpy(log_partition_rf(embeddings, num_features=8, rng=1, orthogonal=False))
    np.testing.assert_array_equal(first, again)
    assert np.all(first != other)
    assert np.all(first != iid)


def test_numpy_generator_and_leading_dims():
    embeddings = np.zeros((2, 3, 4, 3, 2))  # every feature product averages to 1
    out = log_partition_rf(embeddings, num_features=5, rng=np.random.default_rng(0))
    assert out.shape == (2, 3)
    assert log_partition(embeddings).shape == (2, 3)
    np.testing.assert_allclose(log_partition(embeddings), 4 * np.log(3), rtol=1e-12)


def test_half_precision_returns_input_dtype():
    embeddings = make_embeddings(np.random.default_rng(0), num_steps=3)
    half = embeddings.astype(np.float16)
    out = log_partition(half)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, brute_force_log_partition(half), rtol=2e-3)
    assert log_partition_rf(half, num_features=4, rng=0).dtype == np.float16


@pytest.mark.parametrize(
    ("shape", "message"),
    [((3, 4), "rank >= 3"), ((1, 3, 4), "T >= 2"), ((2, 5, 1, 3, 4), "T >= 2"),
     ((3, 0, 4), "|X| >= 1")],
)
def test_bad_embedding_shapes(backend, shape, message):
    embeddings = backend.asarray(np.zeros(shape))
    with pytest.raises(ValueError, match=message):
        log_partition(embeddings)
    with pytest.raises(ValueError, match=message):
        log_partition_rf(embeddings, num_features=4, rng=0)


def test_bad_embedding_sequences_and_dtypes(backend):
    xp = backend.ns
    with pytest.raises(ValueError, match="one shape"):
        log_partition([backend.asarray(np.zeros((3, 4))), backend.asarray(np.zeros((2, 4)))])
    with pytest.raises(ValueError, match="T >= 2"):
        log_partition([backend.asarray(np.zeros((3, 4)))])
    with pytest.raises(TypeError, match="real floating"):
        log_partition(backend.asarray(np.zeros((2, 3, 4), dtype=np.int64), dtype=xp.int64))
    with pytest.raises(TypeError, match=r"embeddings\[0\] must be an array"):
        log_partition_rf(np.zeros((2, 3, 4)).tolist(), num_features=2)
    with pytest.raises(TypeError, match="embeddings must be an array"):
        log_partition(1.5)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [({"num_features": 0}, ValueError, "num_features must be >= 1"),
     ({"num_features": -3}, ValueError, "num_features must be >= 1"),
     ({"num_features": 2.5}, TypeError, "num_features must be an int"),
     ({}, TypeError, "num_features is required"),
     ({"num_features": 4, "method": "scan"}, ValueError, "method must be one of"),
     ({"omega": np.zeros((4, 3))}, ValueError, "omega must have shape"),
     ({"omega": np.zeros((4, 5)), "num_features": 3}, ValueError, "disagrees with omega")],
)
def test_bad_rf_arguments(backend, rng, kwargs, error, message):
    embeddings = backend.asarray(make_embeddings(rng))
    if "omega" in kwargs:
        kwargs = {**kwargs, "omega": backend.asarray(kwargs["omega"])}
    with pytest.raises(error, match=message):
        log_partition_rf(embeddings, **kwargs)


def test_public_name():
    assert xattn.mrf.log_partition is log_partition
    assert "mrf" in xattn.__all__


def test_jax_jit_with_key(rng):
    """No Python control flow on array values: both functions trace under jax.jit, drawing
    omega from a JAX key inside the compiled function."""
    jax = pytest.importorskip("jax")
    embeddings = make_embeddings(rng, batch=(), num_steps=5)
    compiled = jax.jit(lambda e, key: (
        log_partition(e),
        log_partition_rf(e, num_features=32, rng=key),
        log_partition_rf(e, num_features=32, rng=key, method="parallel"),
    ))
    exact, sequential, parallel = compiled(jax.numpy.asarray(embeddings, dtype="float32"),
                                           jax.random.key(0))
    np.testing.assert_allclose(float(exact), brute_force_log_partition(embeddings), rtol=2e-5)
    np.testing.assert_allclose(float(parallel), float(sequential), rtol=2e-5)
