"""Causal LARA (``lara(causal=True)``) on every backend: no look-ahead (outputs and, on
torch and JAX, gradients), a float64 brute-force reference of the same formula on every
prefix with masks, and its relation to non-causal LARA and to causal RFA."""

from __future__ import annotations

import numpy as np
import pytest

import xattn

from test_lara import reference_lara, run_lara

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

NUM_SAMPLES = 4


def causal_inputs(rng, batch=(2,), length=19, head_dim=5, value_dim=3):
    q = rng.normal(size=(*batch, length, head_dim))
    k = rng.normal(size=(*batch, length, head_dim))
    v = rng.normal(size=(*batch, length, value_dim))
    means = 0.6 * rng.normal(size=(NUM_SAMPLES, head_dim))
    return q, k, v, means


@pytest.mark.parametrize("weighting", ["balance", "query_proposal"])
@pytest.mark.parametrize("defensive", [0, 1])
def test_matches_the_formula_on_every_prefix(backend, rng, weighting, defensive):
    """Row n equals the float64 reference of eq. 28 over the keys m <= n (the same samples:
    an int seed draws ``default_rng(seed).standard_normal((*batch, C, D))``), with a key
    mask and a query mask."""
    xp = backend.ns
    q, k, v, means = causal_inputs(rng)
    key_mask = rng.random((2, q.shape[-2])) < 0.7
    key_mask[:, 0] = True
    query_mask = rng.random((2, q.shape[-2])) < 0.85
    options = dict(num_samples=NUM_SAMPLES, weighting=weighting, defensive=defensive)
    out = run_lara(backend, *map(backend.asarray, (q, k, v)),
                   proposal_means=backend.asarray(means), key_mask=backend.asarray(key_mask),
                   query_mask=backend.asarray(query_mask), causal=True, rng=7, **options)
    expected = np.stack([
        reference_lara(q[:, :n + 1], k[:, :n + 1], v[:, :n + 1], proposal_means=means,
                       key_mask=key_mask[:, :n + 1], query_mask=query_mask[:, :n + 1],
                       seed=7, **options)[:, n]
        for n in range(q.shape[-2])], axis=1)
    backend.check(out, expected, dtype=xp.float64, rtol=1e-10)


@pytest.mark.parametrize("position", [0, 7, 18])
def test_later_inputs_change_nothing_before(backend, rng, position):
    """Changing q, k and v after ``position`` (sampling on, an int seed) leaves rows
    0..position unchanged; the standard proposals with all C defensive are causal too."""
    q, k, v, means = causal_inputs(rng)
    changed = [x.copy() for x in (q, k, v)]
    for x in changed:
        x[:, position + 1:] = 3.0 * rng.normal(size=x[:, position + 1:].shape)
    for options in (dict(proposal_means=backend.asarray(means), weighting="query_proposal"),
                    dict(defensive=NUM_SAMPLES, weighting="balance")):
        out = backend.to_numpy(run_lara(backend, *map(backend.asarray, (q, k, v)),
                                        num_samples=NUM_SAMPLES, causal=True, rng=3, **options))
        out_changed = backend.to_numpy(run_lara(backend, *map(backend.asarray, changed),
                                                num_samples=NUM_SAMPLES, causal=True, rng=3,
                                                **options))
        np.testing.assert_array_equal(out_changed[:, :position + 1], out[:, :position + 1])


def test_gradient_of_a_row_with_respect_to_later_inputs_is_zero_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v, means = (torch.tensor(x, requires_grad=True)
                      for x in causal_inputs(rng, batch=(), length=9))
    out = xattn.lara(q, k, v, num_samples=NUM_SAMPLES, proposal_means=means,
                     weighting="query_proposal", causal=True,
                     rng=torch.Generator().manual_seed(1))
    position = 4
    out[position].sum().backward()
    for x in (q, k, v):
        assert torch.all(x.grad[position + 1:] == 0)
        assert torch.any(x.grad[:position + 1] != 0)
    assert torch.any(means.grad != 0)


def test_gradient_of_a_row_with_respect_to_later_inputs_is_zero_jax():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    q, k, v, means = (jnp.asarray(x) for x in causal_inputs(rng, batch=(), length=9))
    position = 4

    def row(q, k, v, means):
        out = xattn.lara(q, k, v, num_samples=NUM_SAMPLES, proposal_means=means,
                         weighting="query_proposal", causal=True, rng=jax.random.key(1))
        return jnp.sum(out[position])

    # compiled: one program (eager JAX compiles every operation of the call on its own)
    gradients = jax.jit(jax.grad(row, argnums=(0, 1, 2, 3)))(q, k, v, means)
    for gradient in gradients[:3]:
        assert np.all(np.asarray(gradient)[position + 1:] == 0)
        assert np.any(np.asarray(gradient)[:position + 1] != 0)
    assert np.any(np.asarray(gradients[3]) != 0)


def test_equals_the_last_row_of_non_causal_lara_on_each_prefix(rng):
    """The query_proposal and balance weightings use only q_n and the proposals, so causal
    LARA's row n is non-causal LARA's last row on the prefix 0..n (same samples)."""
    q, k, v, means = causal_inputs(rng, length=12)
    for weighting in ("balance", "query_proposal"):
        options = dict(num_samples=NUM_SAMPLES, proposal_means=means, weighting=weighting,
                       rng=5)
        out = xattn.lara(q, k, v, causal=True, **options)
        for n in range(NUM_SAMPLES - 1, q.shape[-2]):  # non-causal needs C <= N
            prefix = xattn.lara(q[:, :n + 1], k[:, :n + 1], v[:, :n + 1], **options)
            np.testing.assert_allclose(out[:, n], prefix[:, n], rtol=1e-12, atol=1e-14)


def test_standard_balance_equals_causal_rfa_with_the_same_samples(rng):
    q, k, v, _ = causal_inputs(rng, batch=(), length=30)
    out = xattn.lara(q, k, v, num_samples=NUM_SAMPLES, proposal="standard",
                     weighting="balance", causal=True, rng=11)
    omega = np.random.default_rng(11).standard_normal((NUM_SAMPLES, q.shape[-1]))
    expected = xattn.rfa(q, k, v, omega=omega, causal=True)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)


def test_more_proposals_than_tokens(rng):
    """Without segments, C may exceed N (one token at a time)."""
    q, k, v, _ = causal_inputs(rng, batch=(), length=2)
    out = xattn.lara(q, k, v, num_samples=8, proposal="standard", weighting="balance",
                     causal=True, rng=0)
    assert out.shape == (2, 3) and np.all(np.isfinite(out))


@pytest.mark.parametrize("pieces", [(19,), (1, 18), (5, 1, 1, 12), (7, 0, 12)])
def test_pieces_with_the_state_equal_one_call(backend, rng, pieces):
    """A sequence given in pieces (``return_state=True``, then ``state=``) has the outputs
    of one causal call on all of it (the same samples: the first piece draws them), with a
    key mask; one token at a time has C > N."""
    xp = backend.ns
    q, k, v, means = causal_inputs(rng)
    key_mask = rng.random((2, q.shape[-2])) < 0.8
    options = dict(num_samples=NUM_SAMPLES, proposal_means=backend.asarray(means),
                   weighting="query_proposal", defensive=1, causal=True)
    whole = xattn.lara(*map(backend.asarray, (q, k, v)), key_mask=backend.asarray(key_mask),
                       rng=9, **options)
    outputs, state, start = [], None, 0
    for length in pieces:
        part = [backend.asarray(x[:, start:start + length]) for x in (q, k, v)]
        mask = backend.asarray(key_mask[:, start:start + length])
        if state is None:
            out, state = xattn.lara(*part, key_mask=mask, rng=9, return_state=True, **options)
        else:
            out, state = xattn.lara(*part, key_mask=mask, state=state, return_state=True,
                                    **options)
        assert isinstance(state, xattn.LARAState)
        outputs.append(backend.to_numpy(out))
        start += length
    backend.check(backend.asarray(np.concatenate(outputs, axis=1)), backend.to_numpy(whole),
                  dtype=xp.float64, rtol=1e-10)
    assert int(state.features.position) == q.shape[-2]


def test_state_misuse_names_it(rng):
    q, k, v, means = causal_inputs(rng, batch=(), length=6)
    options = dict(proposal_means=means, weighting="balance", causal=True, rng=0)
    _, state = xattn.lara(q, k, v, num_samples=NUM_SAMPLES, return_state=True, **options)
    with pytest.raises(ValueError, match=r"num_samples=3 differs from the state's C = 4"):
        xattn.lara(q, k, v, num_samples=3, state=state, **options)
    with pytest.raises(ValueError, match=r"state= continues a causal sequence"):
        xattn.lara(q, k, v, num_samples=NUM_SAMPLES, state=state, proposal_means=means)
    _, rfa_state = xattn.rfa(q, k, v, num_features=4, causal=True, return_state=True, rng=0)
    with pytest.raises(TypeError, match=r"state must be an xattn.LARAState"):
        xattn.lara(q, k, v, num_samples=NUM_SAMPLES, state=rfa_state, **options)


def test_a_continued_call_takes_c_from_the_state(rng):
    """``lara(state=)`` needs no ``num_samples`` (it required it before, although the
    state holds C), as ``rfa(state=)`` needs no ``num_features``; without a state it is
    still required."""
    q, k, v, means = causal_inputs(rng, batch=(), length=6)
    options = dict(proposal_means=means, weighting="balance", causal=True, rng=0)
    whole = xattn.lara(q, k, v, num_samples=NUM_SAMPLES, **options)
    _, state = xattn.lara(q[:4], k[:4], v[:4], num_samples=NUM_SAMPLES, return_state=True,
                          **options)
    rest = xattn.lara(q[4:], k[4:], v[4:], state=state, causal=True)
    np.testing.assert_allclose(rest, whole[4:], rtol=1e-10)
    with pytest.raises(TypeError, match=r"lara\(\) needs num_samples"):
        xattn.lara(q, k, v, **options)
