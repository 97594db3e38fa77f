"""``softmax_attention(implementation=...)``: the frameworks' fused kernels (torch SDPA,
``jax.nn.dot_product_attention``) and the portable loop, on every backend, against the
float64 NumPy reference: masks, fully masked rows, gradients, half precision, N != M."""

from __future__ import annotations

import array_api_compat
import numpy as np
import pytest

import xattn

import reference

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)


def has_native(backend, dtype, head_dim, value_dim, *, automatic=False):
    """Whether the backend's library has a fused kernel for these inputs (``automatic``:
    and the automatic choice takes it: not on JAX's CPU backend, where it is slower)."""
    if backend.name.startswith("torch"):
        return True
    return (backend.name.startswith("jax") and dtype == backend.ns.float32
            and head_dim == value_dim and not (automatic and backend.name == "jax"))


def inputs(rng, num_queries, num_keys, head_dim=8, value_dim=8):
    q = rng.normal(size=(2, 3, num_queries, head_dim))
    k = rng.normal(size=(2, 1, num_keys, head_dim))
    v = rng.normal(size=(2, 1, num_keys, value_dim))
    key_mask = rng.random((2, 1, num_keys)) < 0.6
    key_mask[1, 0, :] = False  # batch 1: no key at all
    key_mask[0, 0, 0] = False  # batch 0, causal: the first query has no key
    return q, k, v, key_mask


MASKS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.thin(dtype_name=("float32",), num_queries=(6,))
@pytest.mark.parametrize("implementation", [None, "native", "xattn"])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("num_queries,num_keys", [(9, 9), (6, 11), (11, 6)])
@pytest.mark.parametrize("use_mask,causal", MASKS)
def test_every_implementation_matches_the_reference(backend, rng, implementation, dtype_name,
                                                    num_queries, num_keys, use_mask, causal):
    """Each path agrees with the float64 formula (1e-12 in float64, 1e-5 in float32) on
    every mask combination; a query without an allowed key gets a zero row. Where the
    library has no fused kernel, "native" is a ValueError naming the argument."""
    xp = backend.ns
    dtype = getattr(xp, dtype_name)
    q, k, v, key_mask = inputs(rng, num_queries, num_keys)
    options = {"causal": causal, "key_mask": backend.asarray(key_mask) if use_mask else None,
               "implementation": implementation}
    arrays = [backend.asarray(a, dtype=dtype) for a in (q, k, v)]
    if implementation == "native" and not has_native(backend, dtype, 8, 8):
        with pytest.raises(ValueError, match="implementation='native'"):
            xattn.softmax_attention(*arrays, **options)
        return
    out = xattn.softmax_attention(*arrays, **options)
    expected = reference.softmax_attention(q, k, v, causal=causal,
                                           key_mask=key_mask if use_mask else None)
    backend.check(out, expected, dtype=dtype)
    if use_mask:
        assert np.all(backend.to_numpy(out)[1] == 0.0)


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_automatic_choice_is_the_native_kernel_where_there_is_one(backend, rng, dtype_name):
    """None gives exactly the "native" result where the automatic choice takes the fused
    kernel (torch; float32 JAX with Dv = D on a GPU) and exactly the portable result
    elsewhere (Dv != D, JAX on its CPU backend)."""
    xp = backend.ns
    dtype = getattr(xp, dtype_name)
    for value_dim in (8, 5):
        q, k, v, key_mask = inputs(rng, 7, 9, value_dim=value_dim)
        arrays = [backend.asarray(a, dtype=dtype) for a in (q, k, v)]
        mask = backend.asarray(key_mask)
        chosen = ("native" if has_native(backend, dtype, 8, value_dim, automatic=True)
                  else "xattn")
        automatic = xattn.softmax_attention(*arrays, key_mask=mask, causal=True)
        explicit = xattn.softmax_attention(*arrays, key_mask=mask, causal=True,
                                           implementation=chosen)
        np.testing.assert_array_equal(backend.to_numpy(automatic), backend.to_numpy(explicit))


def test_half_precision_keeps_its_dtype(backend, rng):
    """Half inputs are computed in float32 on both paths and returned in their dtype."""
    half = backend.half_dtype()
    q, k, v, key_mask = inputs(rng, 9, 9)
    arrays = [backend.asarray(a, dtype=half) for a in (q, k, v)]
    expected = reference.softmax_attention(*(backend.to_numpy(a) for a in arrays),
                                           causal=True, key_mask=key_mask)
    for implementation in (None, "xattn"):
        out = xattn.softmax_attention(*arrays, causal=True, key_mask=backend.asarray(key_mask),
                                      implementation=implementation)
        backend.check(out, expected, dtype=half)


def test_torch_gradients_are_finite_with_fully_masked_rows(rng):
    """The gradient through a call in which some queries have no allowed key is finite on
    the native path and equal to the portable path's (float64)."""
    torch = pytest.importorskip("torch")
    q, k, v, key_mask = inputs(rng, 6, 6)
    weights = torch.as_tensor(rng.normal(size=(2, 3, 6, 8)))

    def gradients(implementation):
        leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
        out = xattn.softmax_attention(*leaves, causal=True, key_mask=torch.as_tensor(key_mask),
                                      implementation=implementation)
        (out * weights).sum().backward()
        return [leaf.grad.numpy() for leaf in leaves]

    for native, portable in zip(gradients("native"), gradients("xattn"), strict=True):
        assert np.all(np.isfinite(native))
        np.testing.assert_allclose(native, portable, rtol=1e-10, atol=1e-12)


def test_jax_gradients_are_finite_with_fully_masked_rows(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, key_mask = inputs(rng, 6, 6)
    weights = jnp.asarray(rng.normal(size=(2, 3, 6, 8)), dtype=jnp.float32)

    def loss(q, k, v, implementation):
        out = xattn.softmax_attention(q, k, v, causal=True, key_mask=jnp.asarray(key_mask),
                                      implementation=implementation)
        return jnp.sum(out * weights)

    arrays = [jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v)]
    # compiled (one program each; eagerly JAX compiled each operation on its own, 9 s)
    gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    native = gradients(*arrays, "native")
    portable = gradients(*arrays, "xattn")
    for grad_native, grad_portable in zip(native, portable, strict=True):
        assert bool(jnp.all(jnp.isfinite(grad_native)))
        np.testing.assert_allclose(np.asarray(grad_native), np.asarray(grad_portable),
                                   rtol=1e-4, atol=1e-5)


def test_native_is_refused_by_name_where_there_is_none():
    q = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match="implementation='native'"):
        xattn.softmax_attention(q, q, q, implementation="native")
    with pytest.raises(ValueError, match="implementation must be one of"):
        xattn.softmax_attention(q, q, q, implementation="flash")
    with pytest.raises(TypeError, match="implementation must be a str"):
        xattn.softmax_attention(q, q, q, implementation=1)
    assert array_api_compat.is_numpy_array(
        xattn.softmax_attention(q, q, q, implementation="xattn"))


def test_half_precision_reaches_the_kernel_in_its_own_dtype(monkeypatch):
    """bfloat16 inputs reach torch SDPA as bfloat16 (its FlashAttention and cuDNN kernels
    run only in half precision; found on an H200, where the float32 upcast left bfloat16
    calls as slow as float32 ones), and the result is bfloat16."""
    torch = pytest.importorskip("torch")
    seen = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **options):
        seen.append((q.dtype, k.dtype, v.dtype))
        return kernel(q, k, v, **options)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    q, k, v, _ = inputs(np.random.default_rng(0), 5, 7)
    q, k, v = (torch.as_tensor(x, dtype=torch.bfloat16) for x in (q, k, v))
    out = xattn.softmax_attention(q, k, v, implementation="native")
    assert seen == [(torch.bfloat16,) * 3]
    assert out.dtype == torch.bfloat16
    expected = reference.softmax_attention(*(x.float().numpy().astype(np.float64)
                                             for x in (q, k, v)))
    np.testing.assert_allclose(out.float().numpy(), expected, rtol=0, atol=3e-2)
