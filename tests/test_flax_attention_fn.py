"""xattn.flax.attention_fn: xattn's estimators as the attention_fn= of nnx.MultiHeadAttention.

References: Flax's own default (``flax.nnx.dot_product_attention``) for softmax, and the
estimators called directly (per head, with the same features / in the same mode) for the
others. Tolerances: float32, 1e-5 (absolute, on outputs of order 1).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import xattn

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
xflax = pytest.importorskip("xattn.flax")
jnp = jax.numpy

IN_FEATURES, NUM_HEADS, HEAD_DIM = 16, 4, 4
BATCH, LENGTH = 2, 8
ATOL = 1e-5
SMALL = {"softmax": {}, "rfa": {"num_features": 8}, "ra": {"num_samples": 2},
         "lara": {"num_samples": 2}}


def inputs(shape=(BATCH, LENGTH, IN_FEATURES), seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype=jnp.float32)


def heads(seed):
    """q, k, v in Flax's per-head layout (batch, length, heads, head_dim)."""
    return tuple(inputs((BATCH, LENGTH, NUM_HEADS, HEAD_DIM), seed=seed + i) for i in range(3))


def layer(attention_fn=None, seed=0, **kwargs):
    """nnx.MultiHeadAttention with ``attention_fn`` (Flax's default when None); the same
    seed gives the same projections."""
    extra = {} if attention_fn is None else {"attention_fn": attention_fn}
    return nnx.MultiHeadAttention(NUM_HEADS, IN_FEATURES, decode=False, rngs=nnx.Rngs(seed),
                                  **extra, **kwargs)


def make_fn(estimator, seed=0, **kwargs):
    return xflax.attention_fn(estimator, rngs=nnx.Rngs(seed), **{**SMALL[estimator], **kwargs})


def per_head(x):
    return jnp.swapaxes(x, -3, -2)


def key_padding(lengths=(LENGTH, 5)):
    return (jnp.arange(LENGTH) < jnp.asarray(lengths)[:, None])[:, None, None, :]


def test_signature_is_that_of_flax_attention_fn():
    fn = xflax.attention_fn("softmax")
    expected = inspect.signature(nnx.dot_product_attention).parameters
    assert list(inspect.signature(fn).parameters) == list(expected)
    assert next(iter(inspect.signature(xflax.AttentionFunction).parameters)) == "estimator"
    assert {"attention_fn", "AttentionFunction"} <= set(xflax.__all__)


# -- softmax: equal to Flax's default ----------------------------------------------------------

def _padding_and_causal():
    valid = jnp.arange(LENGTH) < jnp.asarray([LENGTH, 5])[:, None]
    return nnx.combine_masks(nnx.make_attention_mask(valid, valid),
                             nnx.make_causal_mask(valid), dtype=jnp.bool_)


MASK_CASES = {
    "none": (None, False),
    "key padding": (key_padding(), False),
    "is_causal": (None, True),
    "key padding, is_causal": (key_padding(), True),
    "causal mask": (nnx.make_causal_mask(jnp.ones((BATCH, LENGTH))), False),  # float32
    "padding and causal mask": (_padding_and_causal(), False),
    "query and key padding": (nnx.make_attention_mask(*(jnp.arange(LENGTH) < 6,) * 2), False),
}


@pytest.mark.parametrize("case", MASK_CASES)
def test_softmax_equals_flax_default(case):
    mask, is_causal = MASK_CASES[case]
    x = inputs()
    ours = layer(xflax.attention_fn("softmax"))(x, mask=mask, is_causal=is_causal)
    flax = layer()(x, mask=mask, is_causal=is_causal)
    rows = np.ones((BATCH, LENGTH), dtype=bool)  # queries that attend to some key
    if mask is not None and mask.shape[-2] > 1:
        rows = np.asarray(jnp.any(mask.astype(bool), axis=(-3, -1)))
        rows = np.broadcast_to(rows, (BATCH, LENGTH))
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(ours[rows], flax[rows], atol=ATOL, rtol=0)
    # a query without keys gets a zero row (the out projection's bias is zero-initialized)
    np.testing.assert_array_equal(np.asarray(ours)[~rows], 0.0)


def test_declared_masks_under_jit_and_grouped_query_attention():
    """Under nnx.jit a full mask's structure is declared; num_kv_heads < num_heads (GQA)."""
    x, mask = inputs(), _padding_and_causal()
    ours = layer(xflax.attention_fn("softmax", mask_structure="causal"), num_kv_heads=2)
    flax = layer(num_kv_heads=2)
    out = nnx.jit(lambda model, x, mask: model(x, mask=mask))(ours, x, mask)
    np.testing.assert_allclose(out[0], flax(x, mask=mask)[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out[1, :5], flax(x, mask=mask)[1, :5], atol=ATOL, rtol=0)
    padding = nnx.make_attention_mask(*(jnp.arange(LENGTH) < 6,) * 2)
    declared = layer(xflax.attention_fn("softmax", mask_structure="padding"))
    out = nnx.jit(lambda model, x, mask: model(x, mask=mask))(declared, x, padding)
    np.testing.assert_allclose(out[:, :6], layer()(x, mask=padding)[:, :6], atol=ATOL, rtol=0)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")  # Flax's own sow
def test_weights_bias_and_dropout_go_to_flax_for_softmax():
    q, k, v = heads(0)
    fn, key = xflax.attention_fn("softmax"), jax.random.key(3)
    bias = inputs((BATCH, NUM_HEADS, LENGTH, LENGTH), seed=9)
    for kwargs in ({"bias": bias}, {"dropout_rate": 0.5, "dropout_rng": key},
                   {"bias": bias, "dropout_rate": 0.5, "dropout_rng": key,
                    "broadcast_dropout": False}):
        np.testing.assert_array_equal(fn(q, k, v, **kwargs),
                                      nnx.dot_product_attention(q, k, v, **kwargs))
    ours, flax = layer(xflax.attention_fn("softmax")), layer()
    np.testing.assert_allclose(ours(inputs(), sow_weights=True), flax(inputs()), atol=ATOL)
    weights = nnx.pop(ours, nnx.Intermediate)["attention_weights"]
    assert jax.tree.leaves(weights)[0].shape == (BATCH, NUM_HEADS, LENGTH, LENGTH)


def test_dtype_is_the_compute_dtype():
    q, k, v = heads(0)
    fn = xflax.attention_fn("softmax")
    half = fn(q, k, v, dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(half.astype(jnp.float32), fn(q, k, v), atol=3e-2)
    assert layer(fn, dtype=jnp.bfloat16)(inputs()).dtype == jnp.bfloat16


# -- evaluation mode: the estimators' deterministic forms ------------------------------------

@pytest.mark.parametrize("masked", [False, True])
def test_rfa_evaluation_equals_rfa_with_the_features(masked):
    q, k, v = heads(0)
    fn = make_fn("rfa", deterministic=True)
    mask = key_padding() if masked else None
    omega = fn.features(HEAD_DIM)
    assert omega.shape == (8, HEAD_DIM)
    key_mask = None if mask is None else mask[:, :, 0, :]
    expected = jax.jit(lambda q, k, v: xattn.rfa(q, k, v, omega=omega, key_mask=key_mask,
                                                 causal=masked))(*map(per_head, (q, k, v)))
    call = jax.jit(lambda q, k, v: fn(q, k, v, mask=mask, is_causal=masked))  # draws nothing
    out = call(q, k, v)
    np.testing.assert_allclose(out, per_head(expected), atol=ATOL, rtol=0)
    np.testing.assert_array_equal(out, call(q, k, v))
    np.testing.assert_array_equal(omega, fn.features(HEAD_DIM))


def test_ra_and_lara_evaluation_are_their_deterministic_forms():
    q, k, v = (per_head(x) for x in heads(0))
    expected = {"ra": xattn.ra(q, k, v, biased=True, deterministic=True, num_samples=2),
                "lara": xattn.lara(q, k, v, deterministic=True, num_samples=2)}
    for estimator, reference in expected.items():
        fn = xflax.attention_fn(estimator, deterministic=True, **SMALL[estimator])  # no rngs
        out = jax.jit(fn)(*map(per_head, (q, k, v)))  # draws nothing: no state to carry
        np.testing.assert_allclose(out, per_head(reference), atol=ATOL, rtol=0)


# -- training mode: draws from the stream, under nnx.jit ----------------------------------------

@pytest.mark.parametrize("estimator", ["rfa", "ra", "lara"])
def test_training_draws_differ_per_step_and_evaluation_is_fixed(estimator):
    model = layer(make_fn(estimator))
    twin = layer(make_fn(estimator))  # the same seeds: the same draws
    step = nnx.jit(lambda model, x: model(x))
    x = inputs()
    first, second = step(model, x), step(model, x)
    assert not np.allclose(first, second)
    np.testing.assert_array_equal(first, step(twin, x))
    model.eval()  # reaches the attention function, a submodule of the layer
    assert model.attention_fn.deterministic is True
    np.testing.assert_array_equal(step(model, x), step(model, x))
    viewed = nnx.view(model, deterministic=False)
    assert viewed.attention_fn.deterministic is False and model.attention_fn.deterministic


def test_a_key_as_dropout_rng_works_under_jax_jit():
    q, k, v = heads(0)
    fn = xflax.attention_fn("ra", num_samples=2)  # no rngs: the caller gives keys
    call = jax.jit(lambda q, k, v, key: fn(q, k, v, dropout_rng=key))
    same = call(q, k, v, jax.random.key(1))
    np.testing.assert_array_equal(same, call(q, k, v, jax.random.key(1)))
    assert not np.allclose(same, call(q, k, v, jax.random.key(2)))


@pytest.mark.parametrize("estimator", ["softmax", "rfa", "ra", "lara"])
def test_gradients_flow(estimator):
    model = layer(make_fn(estimator))
    x = inputs()
    loss = lambda model: jnp.mean(model(x, is_causal=estimator != "lara") ** 2)  # noqa: E731
    grads = nnx.jit(nnx.grad(loss))(model)
    for name in ("query", "key", "value", "out"):
        kernel = np.asarray(grads[name]["kernel"][...])
        assert np.all(np.isfinite(kernel)) and np.any(kernel != 0), name


# -- decode: Flax's cache with a key mask ---------------------------------------------------------

@pytest.mark.parametrize("estimator", ["softmax", "rfa"])
def test_decode_equals_one_causal_call(estimator):
    model = layer(make_fn(estimator))
    model.eval()
    x = inputs()
    whole = nnx.jit(lambda model, x: model(x, is_causal=True))(model, x)
    model.init_cache(x.shape, dtype=jnp.float32)
    step = nnx.jit(lambda model, token: model(token, decode=True))
    pieces = [step(model, x[:, t:t + 1]) for t in range(LENGTH)]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), whole, atol=ATOL, rtol=0)


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("estimator", "kwargs", "error", "match"), [
    ("flash", {}, ValueError, "estimator"),
    ("rfa", {"rngs": nnx.Rngs(0), "window_size": 3}, TypeError, "window_size"),
    ("rfa", {"rngs": nnx.Rngs(0), "feature_map": "cosine"}, ValueError, "feature_map"),
    ("rfa", {}, ValueError, "rngs"),
    ("ra", {"rngs": 0}, TypeError, "rngs"),
    ("lara", {"proposal": "learned"}, ValueError, "proposal='learned'"),
    ("softmax", {"mask_structure": "causal_padding"}, ValueError, "mask_structure"),
    ("softmax", {"deterministic": 1}, TypeError, "deterministic"),
])
def test_factory_errors_name_the_option(estimator, kwargs, error, match):
    with pytest.raises(error, match=match):
        xflax.attention_fn(estimator, **kwargs)


def _call(estimator="rfa", **kwargs):
    return lambda: make_fn(estimator)(*heads(0), **kwargs)


CALL_ERRORS = {
    "bias with rfa": (_call(bias=jnp.zeros((LENGTH, LENGTH))), ValueError, "bias"),
    "dropout with lara": (_call("lara", dropout_rate=0.1), ValueError, "dropout_rate"),
    "sow_weights with ra": (lambda: layer(make_fn("ra"))(inputs(), sow_weights=True),
                            ValueError, "sow_weights"),
    "dropout without key": (_call("softmax", dropout_rate=0.1), ValueError, "dropout_rng"),
    "dropout_rate out of range": (_call(dropout_rate=1.5), ValueError, "dropout_rate"),
    "is_causal not a bool": (_call(is_causal=1), TypeError, "is_causal"),
    "no key in training": (lambda: xflax.attention_fn("lara")(*heads(0)), ValueError,
                           "rngs=nnx.Rngs"),
    "arbitrary mask": (_call(mask=jnp.asarray(np.random.default_rng(0).random(
        (LENGTH, LENGTH)) < 0.5)), ValueError, "neither a padding mask"),
    "declared padding, causal mask": (
        lambda: xflax.attention_fn("softmax", mask_structure="padding")(
            *heads(0), mask=nnx.make_causal_mask(jnp.ones(LENGTH))), ValueError,
        "mask_structure='padding'"),
    "mask of the wrong shape": (_call(mask=jnp.ones((1, 1, 3), dtype=bool)), ValueError,
                                "broadcastable"),
    "complex mask": (_call(mask=jnp.ones(LENGTH, dtype=jnp.complex64)), TypeError, "mask"),
    "head dims differ": (lambda: make_fn("rfa")(*heads(0)[:2], heads(0)[2][:, :4]),
                         ValueError, "length and heads"),
    "heads not a multiple": (lambda: make_fn("softmax")(
        heads(0)[0], *(x[..., :3, :] for x in heads(0)[1:])), ValueError, "multiple"),
    "flat arrays": (lambda: make_fn("softmax")(*(x[0, 0] for x in heads(0))), ValueError,
                    "num_heads"),
}


@pytest.mark.parametrize("case", CALL_ERRORS)
def test_call_errors_name_the_argument(case):
    call, error, match = CALL_ERRORS[case]
    with pytest.raises(error, match=match):
        call()


def test_full_mask_under_jit_needs_a_declared_structure():
    model = layer(xflax.attention_fn("softmax"))
    mask = nnx.make_causal_mask(jnp.ones((BATCH, LENGTH)))
    with pytest.raises(ValueError, match="mask_structure='causal'"):
        nnx.jit(lambda model, x, mask: model(x, mask=mask))(model, inputs(), mask)
    # a key mask needs no declaration under jit
    out = nnx.jit(lambda model, x, mask: model(x, mask=mask))(model, inputs(), key_padding())
    np.testing.assert_allclose(out, layer()(inputs(), mask=key_padding()), atol=ATOL, rtol=0)
