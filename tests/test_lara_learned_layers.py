"""The layers' ``estimator="lara", proposal="learned"``: the proposal means are a
parameter (torch ``nn.Parameter``, Flax ``nnx.Param``) that gradients reach, and the
layers' causal mode runs causal LARA without look-ahead."""

from __future__ import annotations

import numpy as np
import pytest

from xattn._integrations.layers import learned_proposal_means


def test_initial_means_are_standard_normal_draws():
    means = learned_proposal_means(0, 3, 5, 4)
    assert means.shape == (3, 5, 4) and means.dtype == np.float32
    np.testing.assert_array_equal(means, np.random.default_rng(0).standard_normal(
        (3, 5, 4)).astype(np.float32))


def test_torch_layer():
    torch = pytest.importorskip("torch")
    import xattn.torch as xt

    layer = xt.MultiheadAttention(16, 4, estimator="lara", proposal="learned", num_samples=6,
                                  batch_first=True, generator=torch.Generator().manual_seed(0))
    assert dict(layer.named_parameters())["proposal_means"].shape == (4, 6, 4)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    future = torch.ones(10, 10, dtype=torch.bool).triu(1)
    out, _ = layer(x, x, x, is_causal=True, attn_mask=future)
    out.sum().backward()
    assert torch.any(layer.proposal_means.grad != 0)
    layer.eval()
    with torch.no_grad():
        before, _ = layer(x, x, x, is_causal=True, attn_mask=future)
        changed = x.clone()
        changed[:, 7:] += 1.0
        after, _ = layer(changed, changed, changed, is_causal=True, attn_mask=future)
    torch.testing.assert_close(after[:, :7], before[:, :7], rtol=0, atol=0)
    assert not torch.equal(after[:, 7:], before[:, 7:])
    for options, message in [(dict(weighting="decoupled"), r"proposal='learned' takes "
                                                           r"weighting in"),
                             (dict(grid=(2, 3)), r"proposal='learned' takes no grid")]:
        with pytest.raises(ValueError, match=message):
            xt.MultiheadAttention(16, 4, estimator="lara", proposal="learned", **options)


def test_flax_layer():
    jax = pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    import xattn.flax as xf

    jnp = jax.numpy
    layer = xf.MultiHeadAttention(4, 16, estimator="lara", proposal="learned", num_samples=6,
                                  rngs=nnx.Rngs(0))
    assert isinstance(layer.proposal_means, nnx.Param)
    assert layer.proposal_means[...].shape == (4, 6, 4)
    x = jax.random.normal(jax.random.key(0), (2, 10, 16), dtype=jnp.float32)

    def loss(module):
        return jnp.sum(module(x, is_causal=True, deterministic=False, rngs=nnx.Rngs(1)))

    # compiled: one program (eager JAX compiles each operation of the backward on its own)
    gradients = nnx.jit(nnx.grad(loss))(layer)
    assert np.any(np.asarray(gradients.proposal_means[...]) != 0)
    before = layer(x, is_causal=True, deterministic=True)
    after = layer(x.at[:, 7:].add(1.0), is_causal=True, deterministic=True)
    np.testing.assert_array_equal(np.asarray(after[:, :7]), np.asarray(before[:, :7]))
    jitted = nnx.jit(lambda module, x: module(x, is_causal=True, deterministic=True))
    np.testing.assert_allclose(np.asarray(jitted(layer, x)), np.asarray(before), rtol=1e-5,
                               atol=1e-6)
