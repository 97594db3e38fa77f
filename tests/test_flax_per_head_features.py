"""xattn.flax.MultiHeadAttention with per-head RFA samples: ``features`` of shape
``(num_heads, S, head_dim)`` (fitted samples, say) give head h the samples ``features[h]``,
in evaluation and training calls, gradients and decoding; redraws keep one matrix per head;
the state round-trips; another shape is refused naming ``features``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import xattn

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
xflax = pytest.importorskip("xattn.flax")
jnp = jax.numpy

IN_FEATURES, NUM_HEADS, NUM_FEATURES = 16, 4, 8
HEAD_DIM = IN_FEATURES // NUM_HEADS

#: name -> (is_causal, the layer's options that are also rfa's)
CASES = {
    "plain": (False, {}),
    "causal": (True, {}),
    "causal_window_sinks": (True, dict(window=2, sinks=1)),
}


def make_layer(seed=0, **options):
    return xflax.MultiHeadAttention(NUM_HEADS, IN_FEATURES, estimator="rfa",
                                    num_features=NUM_FEATURES, rngs=nnx.Rngs(seed), **options)


def inputs(shape=(2, 12, IN_FEATURES), seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype=jnp.float32)


def per_head_omega(seed=3, heads=NUM_HEADS):
    """Fitted-like samples: one (S, head_dim) matrix per head, not a draw of the layer's."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(1.3 * rng.normal(size=(heads, NUM_FEATURES, HEAD_DIM)),
                       dtype=jnp.float32)


def with_features(layer, omega):
    layer.features = xflax.FeatureState(omega)
    return layer


def reference(layer, x, omega, causal, options):
    """The layer's output computed head by head: ``xattn.rfa`` on head h's projected
    queries, keys and values with head h's ``(S, head_dim)`` samples, then ``out``."""
    q, k, v = (jnp.swapaxes(projection(x), -3, -2)
               for projection in (layer.query, layer.key, layer.value))
    heads = jnp.stack([xattn.rfa(q[:, h], k[:, h], v[:, h], omega=omega[h], causal=causal,
                                 **options) for h in range(NUM_HEADS)], axis=1)
    return layer.out(jnp.swapaxes(heads, -3, -2))


def assert_close(actual, expected, tolerance=1e-6):
    """Equal to ``tolerance`` relative to the largest entry of ``expected``."""
    expected = np.asarray(expected)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize("case", CASES)
def test_per_head_features_give_each_head_its_samples(case):
    """Evaluation mode: the layer with (num_heads, S, head_dim) features is each head's
    rfa with its own matrix (float32, to 1e-6), eagerly and under nnx.jit; one head's
    matrix shared by all heads gives another output."""
    causal, options = CASES[case]
    omega = per_head_omega()
    layer = with_features(make_layer(**options), omega)
    layer.eval()
    x = inputs()
    expected = reference(layer, x, omega, causal, options)
    assert_close(layer(x, is_causal=causal), expected)
    call = nnx.jit(lambda model, x: model(x, is_causal=causal))
    assert_close(call(layer, x), expected)
    assert layer.features.shape == (NUM_HEADS, NUM_FEATURES, HEAD_DIM)  # used as they are
    np.testing.assert_array_equal(layer.features[...], omega)
    shared = with_features(make_layer(**options), omega[0])
    shared.eval()
    assert not np.allclose(shared(x, is_causal=causal), expected, atol=1e-4)


@pytest.mark.parametrize("case", ["plain", "causal_window_sinks"])
def test_gradients_of_the_parameters_are_the_per_head_ones(case):
    """The gradients with respect to every nnx.Param of the layer equal those of the
    head-by-head computation; the features (not parameters) get none."""
    causal, options = CASES[case]
    omega = per_head_omega()
    layer = with_features(make_layer(**options), omega)
    layer.eval()
    x = inputs()
    target = inputs((2, 12, IN_FEATURES), seed=5)

    def loss(model):
        return jnp.mean((model(x, is_causal=causal) - target) ** 2)

    def reference_loss(model):
        return jnp.mean((reference(model, x, omega, causal, options) - target) ** 2)

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param))(layer)
    expected = nnx.grad(reference_loss, argnums=nnx.DiffState(0, nnx.Param))(layer)
    flat, flat_expected = nnx.to_flat_state(grads), nnx.to_flat_state(expected)
    assert [path for path, _ in flat] == [path for path, _ in flat_expected]
    assert {path[0] for path, _ in flat} == {"query", "key", "value", "out"}
    for (path, grad), (_, grad_expected) in zip(flat, flat_expected, strict=True):
        assert float(jnp.max(jnp.abs(grad[...]))) > 0, path
        assert_close(grad[...], grad_expected[...])


def assert_independent_heads(features, before):
    features = np.asarray(features)
    assert features.shape == (NUM_HEADS, NUM_FEATURES, HEAD_DIM)
    assert features.dtype == np.float32
    for h in range(NUM_HEADS):
        assert not np.allclose(features[h], before[h]), h
        for other in range(h):  # one draw per head, not one matrix shared by the heads
            assert not np.allclose(features[h], features[other]), (h, other)


def test_redraws_keep_one_matrix_per_head():
    """redraw_features and the training-mode redraw (eager and under nnx.jit) draw
    num_heads independent matrices; evaluation mode keeps the features."""
    omega = per_head_omega()
    layer = with_features(make_layer(redraw_interval=None), omega)
    layer.redraw_features(jax.random.key(11))
    assert_independent_heads(layer.features[...], omega)
    assert int(layer.steps_since_redraw[...]) == 0

    layer = with_features(make_layer(redraw_interval=1), omega)
    x = inputs()
    layer.eval()
    layer(x)
    np.testing.assert_array_equal(layer.features[...], omega)
    layer.train()
    layer(x)  # the first training call uses the features it has
    np.testing.assert_array_equal(layer.features[...], omega)
    layer(x)  # the second redraws them
    eager = np.asarray(layer.features[...])
    assert_independent_heads(eager, omega)
    nnx.jit(lambda model, x: model(x))(layer, x)
    assert_independent_heads(layer.features[...], eager)


@pytest.mark.parametrize("chunked", [False, True])
def test_decoding_with_per_head_features_is_the_causal_call(chunked):
    """init_cache keeps the per-head features; a prompt then single tokens (or chunks),
    under nnx.jit, give the outputs of one causal call with window and sinks."""
    omega = per_head_omega()
    layer = with_features(make_layer(window=2, sinks=1), omega)
    layer.eval()
    x = inputs()
    expected = layer(x, is_causal=True)
    assert_close(expected, reference(layer, x, omega, True, dict(window=2, sinks=1)))
    layer.init_cache(x.shape)
    assert layer.cache.get_value().omega.shape == (NUM_HEADS, NUM_FEATURES, HEAD_DIM)
    step = nnx.jit(lambda model, tokens: model(tokens, decode=True))
    bounds = [0, 5, 8, 12] if chunked else [0, 5, *range(6, 13)]
    pieces = [step(layer, x[:, start:stop]) for start, stop in itertools.pairwise(bounds)]
    assert_close(jnp.concatenate(pieces, axis=1), expected, tolerance=1e-5)
    assert int(layer.cache_index[...]) == 12


def test_state_round_trips_keep_per_head_features():
    """nnx.split / nnx.merge and nnx.state / nnx.update into a layer with shared features
    carry the (num_heads, S, head_dim) features and reproduce the output."""
    omega = per_head_omega()
    layer = with_features(make_layer(), omega)
    layer.eval()
    x = inputs()
    expected = layer(x, is_causal=True)
    graphdef, state = nnx.split(layer)
    merged = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(merged.features[...], omega)
    np.testing.assert_array_equal(merged(x, is_causal=True), expected)
    other = make_layer(seed=7)
    other.eval()
    assert other.features.shape == (NUM_FEATURES, HEAD_DIM)
    nnx.update(other, nnx.state(layer))
    assert isinstance(other.features, xflax.FeatureState)
    np.testing.assert_array_equal(other.features[...], omega)
    np.testing.assert_array_equal(other(x, is_causal=True), expected)
    other.features.set_value(omega[::-1])  # Flax's way to put a value of another shape too
    assert not np.allclose(other(x, is_causal=True), expected)


BAD_SHAPES = [
    (3, NUM_FEATURES, HEAD_DIM),  # 3 heads, the layer has 4
    (NUM_FEATURES, HEAD_DIM + 1),  # not head_dim
    (NUM_HEADS, NUM_FEATURES, HEAD_DIM + 1),
    (2, NUM_HEADS, NUM_FEATURES, HEAD_DIM),  # would broadcast against the batch
    (HEAD_DIM,),
]


@pytest.mark.parametrize("shape", BAD_SHAPES)
def test_features_of_another_shape_are_refused_naming_features(shape):
    """Evaluation and training calls, redraw_features and init_cache raise a ValueError
    that names ``features`` and the shapes it may have."""
    x = inputs()
    message = (r"features must have shape \(S, head_dim\) = \(S, 4\) or, one matrix per "
               r"head, \(num_heads, S, head_dim\) = \(4, S, 4\)")
    for attempt in (lambda layer: layer(x, deterministic=True),
                    lambda layer: layer(x, deterministic=False),
                    lambda layer: layer.redraw_features(),
                    lambda layer: layer.init_cache(x.shape)):
        layer = with_features(make_layer(redraw_interval=1), jnp.ones(shape, jnp.float32))
        with pytest.raises(ValueError, match=message):
            attempt(layer)


def test_features_not_a_variable_are_refused():
    """A plain array assigned to ``features`` (not state of the module) is refused with
    the way to assign the samples."""
    layer = make_layer()
    layer.features = per_head_omega()
    with pytest.raises(TypeError, match=r"features must be a xattn\.flax\.FeatureState"):
        layer(inputs(), deterministic=True)
    with pytest.raises(TypeError, match=r"layer\.features = xattn\.flax\.FeatureState"):
        layer.redraw_features()
