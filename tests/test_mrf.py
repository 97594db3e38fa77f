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
    the seed's eq. 3 evaluated literally in float64 (small, well-scaled inputs only).
    ``omega`` (d, n) is shared by every position; (T - 1, d, n) gives potential t its own
    omega[t - 1], and then M_t = sum_x phi_t(e_t(x)) phi_{t+1}(e_t(x))^T."""
    embeddings, omega = (np.asarray(a, dtype=np.float64) for a in (embeddings, omega))
    num_steps = embeddings.shape[-3]
    if omega.ndim == 2:
        omega = np.broadcast_to(omega, (num_steps - 1, *omega.shape))

    def features(t, edge):  # phi_edge(e_t(x)), (..., |X|, d)
        e = embeddings[..., t, :, :]
        return np.exp(e @ omega[edge - 1].T - 0.5 * np.sum(e**2, -1, keepdims=True)) / np.sqrt(
            omega.shape[-2])

    message = features(0, 1).sum(-2)
    for t in range(1, num_steps - 1):
        matrix = np.swapaxes(features(t, t), -1, -2) @ features(t, t + 1)
        message = (message[..., None, :] @ matrix)[..., 0, :]
    return np.log(np.sum(message * features(num_steps - 1, num_steps - 1).sum(-2), axis=-1))


def per_edge_omega(seed, num_steps, num_features, embed_dim, orthogonal=True):
    """The T - 1 matrices samples="per_edge" draws from an int seed: one generator, the
    potentials in order."""
    generator = xattn.random.as_generator(seed)
    return np.stack([xattn.features.sample_omega(generator, num_features, embed_dim, xp=np,
                                                 dtype=np.float64, orthogonal=orthogonal)
                     for _ in range(num_steps - 1)])


def make_embeddings(rng, batch=(2,), num_steps=4, num_states=3, embed_dim=5, spread=0.5):
    return spread * rng.normal(size=(*batch, num_steps, num_states, embed_dim))


@pytest.mark.thin(num_steps=(3,))
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


@pytest.mark.thin(num_steps=(9,))
@pytest.mark.parametrize("samples", ["per_edge", "shared"])
@pytest.mark.parametrize("num_steps", [2, 3, 4, 7, 9])
def test_sequential_and_parallel_agree_with_reference(backend, rng, num_steps, samples):
    """Both evaluation orders of the same estimate (same int seed, hence the same omega on
    every backend) agree with each other and with the literal eq. 3 to float64 rounding;
    T covers no middle matrix (2), one (3) and odd/even counts for the pairwise reduction."""
    xp = backend.ns
    embeddings = make_embeddings(rng, batch=(2, 3), num_steps=num_steps)
    if samples == "shared":
        omega = xattn.features.sample_omega(5, 16, 5, xp=np, dtype=np.float64)
    else:
        omega = per_edge_omega(5, num_steps, 16, 5)
    expected = reference_log_partition_rf(embeddings, omega)
    for method in ("sequential", "parallel"):
        out = log_partition_rf(backend.asarray(embeddings), num_features=16, rng=5, method=method,
                               samples=samples)
        backend.check(out, expected, dtype=xp.float64)


def test_two_positions_per_edge_equals_shared(backend, rng):
    """T = 2 has one potential: both schemes draw the same single matrix from a seed."""
    embeddings = backend.asarray(make_embeddings(rng, num_steps=2))
    per_edge = log_partition_rf(embeddings, num_features=8, rng=4, samples="per_edge")
    shared = log_partition_rf(embeddings, num_features=8, rng=4, samples="shared")
    backend.check(per_edge, backend.to_numpy(shared), dtype=backend.ns.float64, rtol=1e-12)


def test_float32_follows_float64(backend, rng):
    xp = backend.ns
    embeddings = make_embeddings(rng, num_steps=5)
    for samples, omega in (("shared", rng.normal(size=(32, 5))),
                           ("per_edge", rng.normal(size=(4, 32, 5)))):
        expected = reference_log_partition_rf(embeddings, omega)
        for method in ("sequential", "parallel"):
            out = log_partition_rf(backend.asarray(embeddings, dtype=xp.float32),
                                   omega=backend.asarray(omega, dtype=xp.float32), method=method,
                                   samples=samples)
            backend.check(out, expected, dtype=xp.float32)


def test_large_embeddings_stay_finite(backend, rng):
    """Feature values up to e^{±60}: the log-space messages and the per-matrix log-scales
    keep log Z finite where the literal products would overflow in float32."""
    xp = backend.ns
    embeddings = make_embeddings(rng, batch=(), num_steps=6, num_states=4, spread=3.0)
    omega = backend.asarray(rng.normal(size=(5, 64, 5)))  # one (d, n) per potential
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
    estimates = log_partition_rf(backend.asarray(embeddings), omega=backend.asarray(omega),
                                 samples="shared")
    ratio = np.exp(backend.to_numpy(estimates) - brute_force_log_partition(embeddings))
    assert ratio.shape == (400,)
    standard_error = ratio.std(ddof=1) / np.sqrt(ratio.size)
    assert standard_error > 0
    assert abs(ratio.mean() - 1.0) < 5 * standard_error


def orthogonal_omega(gen, shape, num_features, embed_dim):
    """Block-orthogonal rows with chi norms (as sample_omega draws them), for a batch of
    independent matrices of shape (*shape, d, n), in one vectorized NumPy draw."""
    blocks = -(-num_features // embed_dim)
    gaussian = gen.normal(size=(*shape, blocks, embed_dim, embed_dim))
    q, r = np.linalg.qr(gaussian)
    q = q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]
    rows = np.swapaxes(q, -1, -2).reshape(*shape, blocks * embed_dim, embed_dim)
    rows = rows[..., :num_features, :]
    norms = np.linalg.norm(gen.normal(size=(*shape, num_features, embed_dim)), axis=-1)
    return rows * norms[..., None]


def test_per_edge_unbiased_in_z():
    """Per edge, Z_rf is a sum over paths of products of independent unbiased factors, so
    E[Z_rf] = Z for every T. R = 10000 independent draws (a batch of per-edge omega,
    block-orthogonal as the default draws them) on a chain of T = 4 with d = 8 features:
    the mean of Z_rf / Z must be within 4 standard errors of 1. The ratio is skewed; its
    standardized deviation stayed within +-2.4 over 20 random chains with R = 20000
    (measured). The test has power: the standard error is 0.013 here, and shared features
    (the first matrix of each draw for every potential) fail it by far, with a mean ratio
    of 1.9 (8 standard errors; their O(1/d) bias at small d)."""
    gen = np.random.default_rng(20240601)
    embeddings = make_embeddings(gen, batch=(), num_steps=4, num_states=3, embed_dim=4)
    omega = orthogonal_omega(gen, (10_000, 3), 8, 4)  # (R, T - 1, d, n)
    exact = brute_force_log_partition(embeddings)

    def z_score(estimates):
        ratio = np.exp(estimates - exact)
        assert ratio.shape == (10_000,)
        standard_error = ratio.std(ddof=1) / np.sqrt(ratio.size)
        assert 0 < standard_error < 0.2
        return (ratio.mean() - 1.0) / standard_error, standard_error

    z_per_edge, standard_error = z_score(log_partition_rf(embeddings, omega=omega))
    assert standard_error < 0.06
    assert abs(z_per_edge) < 4
    z_shared, _ = z_score(log_partition_rf(embeddings, omega=omega[:, 0], samples="shared"))
    assert z_shared > 4


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
        estimates = log_partition_rf(backend.asarray(embeddings), omega=backend.asarray(omega),
                                     samples="shared")
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
     ({"omega": np.zeros((4, 3))}, ValueError, r"omega must have shape \(\.\.\., T - 1, d, n\)"),
     ({"omega": np.zeros((4, 3)), "samples": "shared"}, ValueError,
      r"omega must have shape \(\.\.\., d, n\) with n = 5"),
     ({"omega": np.zeros((4, 5))}, ValueError, r"for samples='per_edge'"),
     ({"omega": np.zeros((2, 4, 5))}, ValueError,
      r"T - 1 = 3 \(one matrix per potential\).*samples='shared'"),
     ({"omega": np.zeros((4, 5)), "num_features": 3, "samples": "shared"}, ValueError,
      "disagrees with omega"),
     ({"omega": np.zeros((3, 4, 5)), "num_features": 3}, ValueError, "disagrees with omega"),
     ({"num_features": 4, "samples": "independent"}, ValueError, "samples must be one of")],
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
