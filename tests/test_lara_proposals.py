"""LARA's caller-supplied proposal means (``proposal_means=``) and defensive proposals
(``defensive=``): against the float64 reference of eq. 28 on every backend, the special
cases that reduce to RFA, gradients to the means, the weight bound, and misuse errors."""

from __future__ import annotations

import numpy as np
import pytest

import xattn
from xattn import WEIGHTINGS, balance_heuristic

from test_lara import make_qkv, reference_lara, run_lara

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("defensive", [0, 2])
def test_supplied_means_match_reference(backend, rng, weighting, defensive):
    """Means with a leading dim of 1 (broadcast over the batch), masks on both sides."""
    xp = backend.ns
    q, k, v = make_qkv(rng, batch=(2,), num_queries=12, num_keys=10)
    means = 0.5 * rng.normal(size=(1, 4, q.shape[-1]))
    key_mask = rng.random((2, 10)) < 0.7
    query_mask = rng.random((2, 12)) < 0.8
    options = dict(num_samples=4, weighting=weighting, defensive=defensive)
    out = run_lara(backend, *map(backend.asarray, (q, k, v)),
                   proposal_means=backend.asarray(means), key_mask=backend.asarray(key_mask),
                   query_mask=backend.asarray(query_mask), rng=5, **options)
    expected = reference_lara(q, k, v, proposal_means=means, key_mask=key_mask,
                              query_mask=query_mask, seed=5, **options)
    backend.check(out, expected, dtype=xp.float64, rtol=1e-10)


@pytest.mark.parametrize("defensive", [1, 3])
def test_defensive_segment_proposals_match_reference(backend, rng, defensive):
    xp = backend.ns
    q, k, v = make_qkv(rng, batch=(), num_queries=11, num_keys=9)
    out = run_lara(backend, *map(backend.asarray, (q, k, v)), num_samples=3,
                   defensive=defensive, rng=2)
    expected = reference_lara(q, k, v, num_samples=3, defensive=defensive, seed=2)
    backend.check(out, expected, dtype=xp.float64, rtol=1e-10)


@pytest.mark.parametrize("variant", ["zero means", "all defensive"])
def test_standard_proposals_under_balance_equal_rfa_with_the_same_samples(backend, rng,
                                                                        variant):
    """Every proposal N(0, I): the balance weights are 1/C and the density ratios 1, so
    LARA is RFA with the samples omega_c = eps_c (an int seed draws
    ``default_rng(seed).standard_normal((C, D))``)."""
    xp = backend.ns
    q, k, v = make_qkv(rng, batch=(), num_queries=11, num_keys=13)
    num_samples, seed = 5, 11
    options = (dict(proposal_means=backend.asarray(np.zeros((num_samples, q.shape[-1]))))
               if variant == "zero means" else dict(defensive=num_samples))
    out = run_lara(backend, *map(backend.asarray, (q, k, v)), num_samples=num_samples,
                   weighting="balance", rng=seed, **options)
    omega = np.random.default_rng(seed).standard_normal((num_samples, q.shape[-1]))
    expected = xattn.rfa(q, k, v, feature_map="positive", omega=omega)
    backend.check(out, expected, dtype=xp.float64, rtol=1e-10)


def test_defensive_bounds_the_weights(rng):
    """With K of the C proposals N(0, I), alpha_c N(w; 0, I) / q_c(w) under the balance
    heuristic is N(w; 0, I) / sum_c' q_c'(w) <= 1/K, even at a sample far from all."""
    num_samples, defensive, dim = 6, 2, 4
    means = 3.0 * rng.normal(size=(num_samples, dim))
    means[num_samples - defensive:] = 0.0
    points = means + rng.normal(size=(num_samples, dim))
    points[0] = 40.0  # far from every proposal
    alpha = np.diagonal(balance_heuristic(points, means))
    log_ratio = 0.5 * (np.sum((points - means) ** 2, axis=-1) - np.sum(points ** 2, axis=-1))
    weights = alpha * np.exp(log_ratio)
    assert np.all(weights <= 1.0 / defensive + 1e-12), weights
    means[num_samples - defensive:] = 1.0  # no defensive proposal: no bound
    alpha = np.diagonal(balance_heuristic(points, means))
    log_ratio = 0.5 * (np.sum((points - means) ** 2, axis=-1) - np.sum(points ** 2, axis=-1))
    assert np.max(alpha * np.exp(log_ratio)) > 10.0 / defensive


def test_gradients_reach_the_proposal_means_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = (torch.as_tensor(x) for x in make_qkv(rng, batch=(), num_queries=7, num_keys=6))
    means = torch.tensor(0.3 * rng.normal(size=(3, q.shape[-1])), requires_grad=True)
    for weighting in WEIGHTINGS:
        assert torch.autograd.gradcheck(
            lambda means, weighting=weighting: xattn.lara(
                q, k, v, num_samples=3, proposal_means=means, defensive=1,
                weighting=weighting, rng=torch.Generator().manual_seed(4)), (means,))


def test_gradients_reach_the_proposal_means_jax(jax_x64):
    jax = pytest.importorskip("jax")
    from jax.test_util import check_grads

    rng = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(x) for x in make_qkv(rng, batch=(), num_queries=7,
                                                       num_keys=6))
    means = jax.numpy.asarray(0.3 * rng.normal(size=(3, q.shape[-1])))
    for weighting in WEIGHTINGS:
        def loss(means, weighting=weighting):
            # check_grads also evaluates at NumPy points: back to JAX
            return xattn.lara(q, k, v, num_samples=3, proposal_means=jax.numpy.asarray(means),
                              defensive=1,
                              weighting=weighting, rng=jax.random.key(4))
        check_grads(jax.jit(loss), (means,), order=1, modes=["rev"])


@pytest.mark.parametrize("options,error,message", [
    (dict(proposal_means=np.zeros((3, 6))), ValueError, r"proposal_means must have shape"),
    (dict(proposal_means=np.zeros((3, 4, 6))), ValueError, r"must broadcast against"),
    (dict(proposal_means=np.zeros((4, 6), dtype=int)), TypeError, r"real floating"),
    (dict(proposal_means=np.zeros((4, 6)), proposal="standard"), ValueError,
     r"proposal_means replaces proposal='standard'; leave it out"),
    (dict(defensive=5), ValueError, r"defensive must be at most C = 4"),
    (dict(defensive=-1), ValueError, r"defensive must be >= 0"),
    (dict(defensive=1.0), TypeError, r"defensive must be an int"),
])
def test_misuse_names_the_option(rng, options, error, message):
    q, k, v = make_qkv(rng)
    with pytest.raises(error, match=message):
        xattn.lara(q, k, v, num_samples=4, rng=0, **options)
