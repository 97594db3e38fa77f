"""Exact softmax attention against the float64 NumPy formula, on every backend."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import xattn

import reference

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)


def make_qkv(rng, batch=(2, 3), num_queries=9, num_keys=11, head_dim=8, value_dim=5):
    q = rng.normal(size=(*batch, num_queries, head_dim))
    k = rng.normal(size=(*batch, num_keys, head_dim))
    v = rng.normal(size=(*batch, num_keys, value_dim))
    return q, k, v


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_matches_naive_formula(backend, rng, dtype_name):
    xp = backend.ns
    q, k, v = make_qkv(rng)
    dtype = getattr(xp, dtype_name)
    out = xattn.softmax_attention(*(backend.asarray(a, dtype=dtype) for a in (q, k, v)))
    backend.check(out, reference.softmax_attention(q, k, v), dtype=dtype)


def test_scale(backend, rng):
    xp = backend.ns
    q, k, v = make_qkv(rng)
    out = xattn.softmax_attention(*map(backend.asarray, (q, k, v)), scale=0.7)
    backend.check(out, reference.softmax_attention(q, k, v, scale=0.7), dtype=xp.float64)


@pytest.mark.parametrize("num_queries,num_keys", [(9, 9), (6, 11), (11, 6)])
def test_causal(backend, rng, num_queries, num_keys):
    xp = backend.ns
    q, k, v = make_qkv(rng, num_queries=num_queries, num_keys=num_keys)
    out = xattn.softmax_attention(*map(backend.asarray, (q, k, v)), causal=True, chunk_size=4)
    backend.check(out, reference.softmax_attention(q, k, v, causal=True), dtype=xp.float64)


def test_key_mask_and_all_masked_row(backend, rng):
    xp = backend.ns
    q, k, v = make_qkv(rng)
    key_mask = rng.random((2, 1, 11)) < 0.6
    key_mask[1, 0, :] = False  # every query of batch 1 has no key: zero rows, not NaN
    out = xattn.softmax_attention(*map(backend.asarray, (q, k, v)),
                                  key_mask=backend.asarray(key_mask),
                                  chunk_size=3)
    expected = reference.softmax_attention(q, k, v, key_mask=key_mask)
    assert np.all(expected[1] == 0.0)
    backend.check(out, expected, dtype=xp.float64)


def test_causal_with_key_mask_first_key_masked(backend, rng):
    xp = backend.ns
    q, k, v = make_qkv(rng, num_queries=7, num_keys=7)
    key_mask = np.ones(7, dtype=bool)
    key_mask[0] = False  # query 0 sees no key under causal masking
    out = xattn.softmax_attention(*map(backend.asarray, (q, k, v)),
                                  key_mask=backend.asarray(key_mask),
                                  causal=True, chunk_size=2)
    expected = reference.softmax_attention(q, k, v, key_mask=key_mask, causal=True)
    assert np.all(expected[..., 0, :] == 0.0)
    backend.check(out, expected, dtype=xp.float64)


@pytest.mark.thin(chunk_size=(3,))
@pytest.mark.parametrize("chunk_size", [1, 3, 11, 64])
def test_chunked_equals_unchunked(backend, rng, chunk_size):
    """Queries in tiles and keys in chunks of chunk_size: the same result, with masks and
    causal (a tile stops at its last query's key)."""
    xp = backend.ns
    q, k, v = make_qkv(rng, num_queries=13)
    key_mask = rng.random((2, 1, 11)) < 0.7
    arrays = tuple(map(backend.asarray, (q, k, v)))
    whole = backend.to_numpy(xattn.softmax_attention(*arrays, chunk_size=10_000))
    out = xattn.softmax_attention(*arrays, chunk_size=chunk_size)
    backend.check(out, whole, dtype=xp.float64)
    for causal in (False, True):
        out = xattn.softmax_attention(*arrays, chunk_size=chunk_size, causal=causal,
                                      key_mask=backend.asarray(key_mask))
        expected = reference.softmax_attention(q, k, v, key_mask=key_mask, causal=causal)
        backend.check(out, expected, dtype=xp.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_working_memory_is_bounded(causal):
    """N = M = 16384, D = Dv = 64, float32 on NumPy: the call allocates at most 64 MiB
    (tracemalloc; inputs excluded). The N x M scores alone would take 1 GiB and N x chunk
    scores 64 MiB; query tiles keep them at chunk x chunk. The output is 4 MiB."""
    draw = np.random.default_rng(0)
    q, k, v = (draw.normal(size=(1, 16384, 64)).astype(np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        out = xattn.softmax_attention(q, k, v, causal=causal)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (1, 16384, 64)
    assert peak <= 64 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_leading_dims_broadcast(backend, rng):
    xp = backend.ns
    q = rng.normal(size=(2, 1, 6, 4))
    k = rng.normal(size=(1, 3, 7, 4))
    v = rng.normal(size=(7, 2))
    out = xattn.softmax_attention(*map(backend.asarray, (q, k, v)))
    assert tuple(out.shape) == (2, 3, 6, 2)
    backend.check(out, reference.softmax_attention(q, k, v), dtype=xp.float64)


def test_large_scores_stay_finite(backend, rng):
    xp = backend.ns
    q, k, v = make_qkv(rng, batch=())
    q, k = 40 * q / np.linalg.norm(q, axis=-1, keepdims=True), 40 * k / np.linalg.norm(
        k, axis=-1, keepdims=True)
    out = xattn.softmax_attention(*(backend.asarray(a, dtype=xp.float32) for a in (q, k, v)),
                                  scale=1.0, chunk_size=4)
    backend.check(out, reference.softmax_attention(q, k, v, scale=1.0), dtype=xp.float32, rtol=1e-3)


def test_half_precision_returns_input_dtype(backend, rng):
    half = backend.half_dtype()
    q, k, v = make_qkv(rng, batch=())
    out = xattn.softmax_attention(*(backend.asarray(a, dtype=half) for a in (q, k, v)))
    backend.check(out, reference.softmax_attention(q, k, v), dtype=half, rtol=3e-2)


def test_gradients_torch_match_finite_differences(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(a, requires_grad=True) for a in make_qkv(rng, batch=(), num_queries=3,
                                                                      num_keys=4, head_dim=3,
                                                                      value_dim=2))
    key_mask = torch.tensor([True, False, True, True])

    def loss(q, k, v):
        return xattn.softmax_attention(q, k, v, key_mask=key_mask, causal=True,
                                       chunk_size=2).square().sum()

    assert torch.autograd.gradcheck(loss, (q, k, v))


def test_gradients_jax_match_finite_differences(rng, jax_x64):
    jax = pytest.importorskip("jax")
    from jax.test_util import check_grads

    q, k, v = (jax.numpy.asarray(a) for a in make_qkv(rng, batch=(), num_queries=3, num_keys=4,
                                                     head_dim=3, value_dim=2))
    key_mask = jax.numpy.asarray([True, False, True, True])

    def loss(q, k, v):
        # check_grads evaluates finite differences with NumPy arrays: bring them into JAX
        q, k, v = (jax.numpy.asarray(a) for a in (q, k, v))
        out = xattn.softmax_attention(q, k, v, key_mask=key_mask, causal=True, chunk_size=2)
        return (out**2).sum()

    # compiled, as the suite's other JAX gradient checks: eagerly, JAX compiled each
    # operation of the forward and backward passes on its own (16 s); the gradients are
    # those of the same traced operations
    check_grads(jax.jit(loss), (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
    assert all(bool(jax.numpy.all(jax.numpy.isfinite(g)))
               for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))


def test_jit(rng):
    jax = pytest.importorskip("jax")
    q, k, v = make_qkv(rng, batch=(2,))
    out = jax.jit(lambda q, k, v: xattn.softmax_attention(q, k, v, causal=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), reference.softmax_attention(q, k, v, causal=True),
                               rtol=1e-5, atol=1e-5)
