"""The RNG adapter: portable int seeds, native generators, JAX keys under jit."""

from __future__ import annotations

import numpy as np
import pytest

import xattn
from xattn.random import Generator, as_generator, default_rng


@pytest.mark.parametrize("draw", ["normal", "uniform"])
def test_int_seed_gives_identical_draws_on_every_backend(backend, draw):
    xp = backend.ns
    host = getattr(np.random.default_rng(7), "standard_normal" if draw == "normal" else "random")(
        (4, 5))
    values = getattr(as_generator(7), draw)(xp, (4, 5), dtype=xp.float64, device=backend.device)
    backend.check(values, host, dtype=xp.float64, rtol=0, atol=0)  # exact in float64
    values32 = getattr(default_rng(7), draw)(xp, (4, 5), dtype=xp.float32, device=backend.device)
    backend.check(values32, host.astype(np.float32).astype(np.float64), dtype=xp.float32,
             rtol=0, atol=0)  # equal up to the rounding of the cast


def test_successive_draws_differ_and_stream_is_reproducible(backend):
    xp = backend.ns
    first = as_generator(3)
    a = backend.to_numpy(first.normal(xp, (6,), dtype=xp.float64, device=backend.device))
    b = backend.to_numpy(first.normal(xp, (6,), dtype=xp.float64, device=backend.device))
    assert not np.array_equal(a, b)
    again = as_generator(3)
    np.testing.assert_array_equal(
        backend.to_numpy(again.normal(xp, (6,), dtype=xp.float64, device=backend.device)), a)


def test_native_generator_reproduces_with_its_own_seed(backend):
    xp = backend.ns
    like = backend.asarray(np.zeros(1))
    draws = [
        backend.to_numpy(default_rng(11, like=like).normal(xp, (3, 4), dtype=xp.float64,
                                                      device=backend.device))
        for _ in range(2)
    ]
    np.testing.assert_array_equal(draws[0], draws[1])
    other = default_rng(12, like=like).normal(xp, (3, 4), dtype=xp.float64, device=backend.device)
    assert not np.array_equal(backend.to_numpy(other), draws[0])
    uniform = backend.to_numpy(default_rng(11, like=like).uniform(xp, (1000,), dtype=xp.float32,
                                                             device=backend.device))
    assert uniform.min() >= 0.0 and uniform.max() < 1.0


def test_native_generators_are_recognized():
    assert type(as_generator(np.random.default_rng(0))).__name__ == "HostGenerator"
    torch = pytest.importorskip("torch")
    assert type(as_generator(torch.Generator().manual_seed(0))).__name__ == "TorchGenerator"
    jax = pytest.importorskip("jax")
    assert type(as_generator(jax.random.key(0))).__name__ == "JaxGenerator"
    assert type(as_generator(jax.random.PRNGKey(0))).__name__ == "JaxGenerator"
    da = pytest.importorskip("dask.array")
    assert type(as_generator(da.random.default_rng(0))).__name__ == "DaskGenerator"
    rng = default_rng(0)
    assert as_generator(rng) is rng and isinstance(rng, Generator)


def test_torch_generator_draws_on_its_device():
    torch = pytest.importorskip("torch")
    import array_api_compat

    xp = array_api_compat.array_namespace(torch.empty(0))
    values = as_generator(torch.Generator().manual_seed(5)).normal(xp, (2, 3), dtype=xp.float32,
                                                                  device=torch.device("cpu"))
    expected = torch.randn((2, 3), generator=torch.Generator().manual_seed(5))
    assert torch.equal(values, expected)


def test_jax_key_is_split_per_draw_and_works_under_jit():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def draw(key):
        rng = as_generator(key)
        return rng.normal(jnp, (3,), dtype=jnp.float32), rng.uniform(jnp, (3,), dtype=jnp.float32)

    key = jax.random.key(0)
    eager = draw(key)
    jitted = jax.jit(draw)(key)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(eager[0]), np.asarray(draw(jax.random.key(1))[0]))
    # two draws from one adapter use different subkeys
    assert not np.allclose(np.asarray(eager[0]), np.asarray(eager[1]))


def test_generator_of_another_library_is_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="rng is a torch generator but the arrays come from"):
        as_generator(torch.Generator()).normal(np, (2,), dtype=np.float64)


@pytest.mark.parametrize("bad", ["seed", 1.5, True, object()])
def test_bad_rng_values(bad):
    with pytest.raises(TypeError, match="rng must be None, an int seed"):
        as_generator(bad)


def test_negative_seed_and_bad_like():
    with pytest.raises(ValueError, match="non-negative"):
        as_generator(-1)
    with pytest.raises(TypeError, match="like must be"):
        default_rng(0, like=[1.0])
    with pytest.raises(TypeError, match="seed must be an int"):
        default_rng("0")


def test_public_entry_point():
    assert xattn.random.default_rng is default_rng
