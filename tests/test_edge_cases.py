"""Degenerate sizes for every estimator: N = 1, M = 1, D = 1, N != M, C = N for LARA,
empty leading dims, N = 0 (an empty result) and M = 0 (a clear error)."""

from __future__ import annotations

import numpy as np
import pytest

import xattn

import reference

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

ESTIMATORS = {
    "softmax": lambda q, k, v, **kw: xattn.softmax_attention(q, k, v, **kw),
    "softmax-causal": lambda q, k, v, **kw: xattn.softmax_attention(q, k, v, causal=True, **kw),
    "rfa-positive": lambda q, k, v, **kw: xattn.rfa(q, k, v, rng=0, **kw),
    "rfa-hyperbolic-causal": lambda q, k, v, **kw: xattn.rfa(
        q, k, v, rng=0, feature_map="hyperbolic", causal=True, block_size=2, **kw),
    # small scores (scale 0.05) keep the trigonometric normalizer estimate positive
    "rfa-trigonometric-causal": lambda q, k, v, **kw: xattn.rfa(
        q, k, v, rng=0, num_features=32, feature_map="trigonometric", scale=0.05,
        causal=True, block_size=2, **kw),
    "ra": lambda q, k, v, **kw: xattn.ra(q, k, v, num_samples=2, rng=0, chunk_size=2, **kw),
    "ra-biased-causal": lambda q, k, v, **kw: xattn.ra(q, k, v, biased=True, causal=True,
                                                       rng=0, **kw),
    "lara": lambda q, k, v, **kw: xattn.lara(q, k, v, num_samples=1, rng=0, **kw),
    "lara-landmark": lambda q, k, v, **kw: xattn.lara(
        q, k, v, num_samples=1, proposal="landmark_attention", deterministic=True, **kw),
}
CAUSAL = {name for name in ESTIMATORS if name.endswith("causal")}

# (batch, N, M, D, Dv)
SHAPES = {
    "N=1,D=1": ((2,), 1, 5, 1, 2),
    "M=1,Dv=1": ((2,), 4, 1, 3, 1),
    "N=M=1": ((), 1, 1, 3, 2),
    "N<M": ((3,), 2, 7, 2, 2),
    "N>M": ((3,), 7, 2, 2, 2),
}

JAX_SHAPES = ("N=1,D=1", "M=1,Dv=1")


def make_inputs(batch, num_queries, num_keys, head_dim, value_dim, seed=0):
    data = np.random.default_rng(seed)
    return (data.normal(size=(*batch, num_queries, head_dim)),
            data.normal(size=(*batch, num_keys, head_dim)),
            data.normal(size=(*batch, num_keys, value_dim)))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_degenerate_sizes(backend, name, shape):
    """Right shape, dtype and namespace; every row a convex combination of the allowed
    values (within their range); with one allowed key, exactly that value; softmax equals
    the float64 reference."""
    xp = backend.ns
    if backend.name == "jax" and shape not in JAX_SHAPES:
        pytest.skip("eager JAX compiles every operation per shape: two shapes on JAX")
    batch, num_queries, num_keys, _, value_dim = SHAPES[shape]
    q, k, v = make_inputs(*SHAPES[shape])
    out = ESTIMATORS[name](*map(backend.asarray, (q, k, v)))
    expected_shape = (*batch, num_queries, value_dim)
    assert backend.is_native(out) and out.dtype == xp.float64
    host = backend.to_numpy(out)
    assert host.shape == expected_shape and np.all(np.isfinite(host))
    causal = name in CAUSAL
    for n in range(num_queries):
        allowed = v[..., : n + 1, :] if causal else v  # top-left causal: keys m <= n
        if causal and n >= num_keys:
            allowed = v
        low, high = allowed.min(axis=-2), allowed.max(axis=-2)
        slack = 1e-9 * (1.0 + np.max(high - low))
        assert np.all(host[..., n, :] >= low - slack) and np.all(host[..., n, :] <= high + slack)
    if num_keys == 1 or causal:  # one allowed key (query 0 under causal masking)
        np.testing.assert_allclose(host[..., 0, :], v[..., 0, :], rtol=1e-9, atol=1e-9)
    if name.startswith("softmax"):
        backend.check(out, reference.softmax_attention(q, k, v, causal=causal), dtype=xp.float64)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_empty_leading_dims(backend, name):
    xp = backend.ns
    q, k, v = make_inputs((0, 2), 3, 4, 2, 2)
    out = ESTIMATORS[name](*map(backend.asarray, (q, k, v)))
    assert tuple(out.shape) == (0, 2, 3, 2) and out.dtype == xp.float64


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_no_queries_give_an_empty_result(backend, name):
    xp = backend.ns
    q, k, v = make_inputs((2,), 0, 4, 3, 2)
    out = ESTIMATORS[name](*map(backend.asarray, (q, k, v)))
    assert backend.is_native(out) and out.dtype == xp.float64
    assert tuple(out.shape) == (2, 0, 2)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_no_keys_is_an_error(backend, name):
    q, k, v = make_inputs((2,), 3, 0, 3, 2)
    with pytest.raises(ValueError, match=r"k must hold at least one key \(M >= 1\)"):
        ESTIMATORS[name](*map(backend.asarray, (q, k, v)))


@pytest.mark.parametrize("proposal", ["segment", "key_attention", "landmark_attention",
                                      "standard"])
def test_lara_with_one_proposal_per_query(backend, proposal):
    """C = N: every query is its own segment. Finite, in the value range, and with
    ``weighting="balance"`` and the deterministic segment proposal exactly as with the
    segments reversed (the segment symmetry of tests/test_properties.py at its extreme)."""
    q, k, v = make_inputs((2,), 6, 6, 3, 2)
    out = xattn.lara(*map(backend.asarray, (q, k, v)), num_samples=6, proposal=proposal, rng=0)
    host = backend.to_numpy(out)
    assert host.shape == (2, 6, 2) and np.all(np.isfinite(host))
    low, high = v.min(axis=-2, keepdims=True), v.max(axis=-2, keepdims=True)
    assert np.all(host >= low - 1e-9) and np.all(host <= high + 1e-9)
    options = {"num_samples": 6, "proposal": proposal, "deterministic": True}
    forward = backend.to_numpy(xattn.lara(*map(backend.asarray, (q, k, v)), **options))
    backward = backend.to_numpy(xattn.lara(*(backend.asarray(a[:, ::-1].copy()) for a in (q, k, v)),
                                      **options))
    np.testing.assert_allclose(backward[:, ::-1], forward, rtol=1e-9, atol=1e-9)


def test_lara_more_proposals_than_keys(backend):
    """C > M: key segments without keys get a zero mean; still finite, in range."""
    q, k, v = make_inputs((2,), 6, 2, 3, 2)
    host = backend.to_numpy(xattn.lara(*map(backend.asarray, (q, k, v)), num_samples=5, rng=0))
    assert host.shape == (2, 6, 2) and np.all(np.isfinite(host))
    low, high = v.min(axis=-2, keepdims=True), v.max(axis=-2, keepdims=True)
    assert np.all(host >= low - 1e-9) and np.all(host <= high + 1e-9)
