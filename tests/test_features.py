"""Random-feature maps and sample matrices (xattn.features), on every backend.

Statistical tests use fixed seeds, and their tolerances follow from the estimator's
standard error (stated in each test).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from xattn.features import positive_key_statistics, random_features, sample_omega

MAPS = ("positive", "hyperbolic", "trigonometric")

# moderate points: |x|^2 = 0.275, |y|^2 = 0.25, x.y = 0.11, |x + y|^2 = 0.745, so the
# products xi(x, w) xi(y, w) have light enough tails that their variance (and the
# variance of the squared errors) is estimated well from 10^5 draws
X = np.array([[0.3, -0.2, 0.1, 0.25, -0.1, 0.2, 0.0, 0.15]])
Y = np.array([[0.2, 0.1, 0.3, 0.1, -0.2, -0.1, 0.2, 0.1]])


def per_sample_products(backend, x, y, omega, feature_map):
    """xi(x, w_s) . xi(y, w_s) for every sample s (the one-sample kernel estimates)."""
    xp = backend.ns
    num_samples = omega.shape[0]
    products = backend.to_numpy(random_features(xp, backend.asarray(x), omega, feature_map)
                           * random_features(xp, backend.asarray(y), omega, feature_map))[0]
    products = products * num_samples  # undo the 1/S normalization of phi
    if feature_map != "positive":  # [+w | -w] or [sin | cos] halves belong to one sample
        products = products[:num_samples] + products[num_samples:]
    return products


@pytest.mark.parametrize("orthogonal", [True, False])
def test_sample_shape_dtype_device(backend, orthogonal):
    xp = backend.ns
    omega = sample_omega(0, 11, 4, xp=xp, dtype=xp.float32, device=backend.device,
                         orthogonal=orthogonal)
    assert tuple(omega.shape) == (11, 4)
    assert omega.dtype == xp.float32
    assert np.all(np.isfinite(backend.to_numpy(omega)))


@pytest.mark.parametrize("norm", ["chi", "sqrt_dim"])
def test_orthogonal_rows_within_blocks_and_norms(backend, norm):
    xp = backend.ns
    dim, num_features = 5, 13  # blocks of rows 0-4, 5-9 and 10-12 (cut)
    omega = backend.to_numpy(sample_omega(3, num_features, dim, xp=xp, dtype=xp.float64,
                                     device=backend.device, norm=norm))
    norms = np.linalg.norm(omega, axis=1)
    for start in range(0, num_features, dim):
        block = omega[start:start + dim]
        unit = block / np.linalg.norm(block, axis=1, keepdims=True)
        np.testing.assert_allclose(unit @ unit.T, np.eye(len(block)), atol=1e-12)
    if norm == "sqrt_dim":
        np.testing.assert_allclose(norms, math.sqrt(dim), rtol=1e-12)
    else:  # chi(D) draws: not all equal (the sqrt_dim option would be)
        assert np.ptp(norms) > 0.1


def test_chi_norms_are_chi_distributed(backend):
    # E|w|^2 = D and Var|w|^2 = 2D for chi(D) norms: mean of n squared norms within 4 SE
    xp = backend.ns
    dim, num_features = 4, 20_000
    omega = backend.to_numpy(sample_omega(7, num_features, dim, xp=xp, dtype=xp.float64,
                                     device=backend.device))
    sq_norms = np.sum(omega**2, axis=1)
    standard_error = math.sqrt(2 * dim / num_features)
    assert abs(sq_norms.mean() - dim) < 4 * standard_error
    assert abs(sq_norms.var() - 2 * dim) < 4 * math.sqrt(
        (np.mean((sq_norms - dim) ** 4) - (2 * dim) ** 2) / num_features)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_int_seed_same_samples_on_every_backend(backend, orthogonal):
    xp = backend.ns
    expected = sample_omega(42, 9, 4, xp=np, dtype=np.float64, orthogonal=orthogonal)
    omega = sample_omega(42, 9, 4, xp=xp, dtype=xp.float64, device=backend.device,
                         orthogonal=orthogonal)
    backend.check(omega, expected, dtype=xp.float64, rtol=1e-12)


@pytest.mark.parametrize("feature_map", MAPS)
def test_kernel_estimator_unbiased(backend, feature_map):
    # mean of n = 200_000 one-sample estimates within 4 standard errors of exp(x.y)
    xp = backend.ns
    num_samples = 200_000
    omega = sample_omega(11, num_samples, X.shape[1], xp=xp, dtype=xp.float64,
                         device=backend.device, orthogonal=False)
    products = per_sample_products(backend, X, Y, omega, feature_map)
    standard_error = products.std() / math.sqrt(num_samples)
    assert abs(products.mean() - math.exp(float(X[0] @ Y[0]))) < 4 * standard_error


def test_orthogonal_kernel_estimator_unbiased(backend):
    # orthogonal blocks with chi norms keep every row N(0, I): still unbiased (4 SE)
    xp = backend.ns
    num_samples = 200_000
    omega = sample_omega(12, num_samples, X.shape[1], xp=xp, dtype=xp.float64,
                         device=backend.device)
    products = per_sample_products(backend, X, Y, omega, "positive")
    draws = products.reshape(-1, X.shape[1]).mean(axis=1)  # one estimate per block
    standard_error = draws.std() / math.sqrt(len(draws))
    assert abs(draws.mean() - math.exp(float(X[0] @ Y[0]))) < 4 * standard_error


def test_iid_positive_mse_matches_closed_form(backend):
    # MSE of the S-sample estimator = exp(2 x.y)(exp(|x+y|^2) - 1) / S (Performer, Lemma 2).
    # With 80_000 draws of S = 8 the empirical MSE has a relative standard error of
    # about 0.8% (checked below to be < 2.5%), so the 10% tolerance is >= 4 SE.
    xp = backend.ns
    num_features, num_draws = 8, 80_000
    omega = sample_omega(5, num_features * num_draws, X.shape[1], xp=xp,
                         dtype=xp.float64, device=backend.device, orthogonal=False)
    products = per_sample_products(backend, X, Y, omega, "positive")
    estimates = products.reshape(num_draws, num_features).mean(axis=1)
    kernel = math.exp(float(X[0] @ Y[0]))
    squared_errors = (estimates - kernel) ** 2
    mse = squared_errors.mean()
    closed_form = math.exp(2 * float(X[0] @ Y[0])) * math.expm1(float(np.sum((X + Y) ** 2)))
    closed_form /= num_features
    assert squared_errors.std() / math.sqrt(num_draws) < 0.025 * mse
    assert abs(mse - closed_form) < 0.10 * closed_form


def test_orthogonal_mse_below_iid_at_s_equals_d(backend):
    # S = D = 8, 40_000 draws each; the MSE gap (about 9 combined standard errors at
    # these points) must exceed 4 combined standard errors.
    xp = backend.ns
    dim, num_draws = 8, 40_000
    rng = np.random.default_rng(5)
    direction_x = rng.normal(size=dim)
    direction_y = direction_x + 0.3 * rng.normal(size=dim)
    x = 0.4 * direction_x / np.linalg.norm(direction_x)
    y = 0.4 * direction_y / np.linalg.norm(direction_y)
    kernel = math.exp(float(x @ y))
    squared_errors = {}
    for orthogonal, seed in ((True, 1), (False, 2)):
        omega = sample_omega(seed, dim * num_draws, dim, xp=xp, dtype=xp.float64,
                             device=backend.device, orthogonal=orthogonal)
        products = per_sample_products(backend, x[None, :], y[None, :], omega, "positive")
        estimates = products.reshape(num_draws, dim).mean(axis=1)  # one block per draw
        squared_errors[orthogonal] = (estimates - kernel) ** 2
    gap = squared_errors[False].mean() - squared_errors[True].mean()
    standard_error = math.hypot(squared_errors[False].std(),
                                squared_errors[True].std()) / math.sqrt(num_draws)
    assert gap > 4 * standard_error


def test_feature_shapes(backend, rng):
    xp = backend.ns
    omega = backend.asarray(rng.normal(size=(6, 3)))
    x = backend.asarray(rng.normal(size=(2, 5, 3)))
    assert tuple(random_features(xp, x, omega, "positive").shape) == (2, 5, 6)
    assert tuple(random_features(xp, x, omega, "hyperbolic").shape) == (2, 5, 12)
    assert tuple(random_features(xp, x, omega, "trigonometric").shape) == (2, 5, 12)


def test_bad_sample_arguments():
    with pytest.raises(ValueError, match="num_features"):
        sample_omega(0, 0, 4, xp=np, dtype=np.float64)
    with pytest.raises(ValueError, match="dim"):
        sample_omega(0, 4, 0, xp=np, dtype=np.float64)
    with pytest.raises(ValueError, match="norm"):
        sample_omega(0, 4, 4, xp=np, dtype=np.float64, norm="unit")
    with pytest.raises(ValueError, match="feature_map"):
        random_features(np, np.ones((1, 2)), np.ones((3, 2)), "cosine")


@pytest.mark.parametrize("chunk_size,error", [(0, ValueError), (2.5, TypeError),
                                              (True, TypeError)])
def test_bad_chunk_size_whatever_the_number_of_keys(chunk_size, error):
    """chunk_size is checked even when it would not split the keys (3 keys here)."""
    with pytest.raises(error, match="chunk_size must be"):
        positive_key_statistics(np, np.ones((3, 2)), np.ones((3, 2)), np.ones((4, 2)),
                                chunk_size=chunk_size)
