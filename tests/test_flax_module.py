"""xattn.flax.MultiHeadAttention: an nnx layer shaped after flax.nnx.MultiHeadAttention."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import xattn
from layer_cases import (
    BAD_GRID_OPTIONS,
    BAD_OPTION_CASES,
    ESTIMATORS,
    PASS_THROUGH_CASES,
    SMALL_OPTIONS,
    bool_options,
    constructor_bool_cases,
    direct_error,
    estimator_call,
)
from xattn._integrations import layers as _layers

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
xflax = pytest.importorskip("xattn.flax")
jnp = jax.numpy

IN_FEATURES, NUM_HEADS = 16, 4


def make_layer(estimator, seed=0, **kwargs):
    options = {**SMALL_OPTIONS[estimator], **kwargs}
    return xflax.MultiHeadAttention(NUM_HEADS, IN_FEATURES, estimator=estimator,
                                    rngs=nnx.Rngs(seed), **options)


def inputs(shape=(2, 12, IN_FEATURES), seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype=jnp.float32)


@pytest.mark.gpu  # on JAX's default device: the GPU on a machine where JAX has one
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_forward_backward_and_one_optimisation_step(estimator):
    """Shape, dtype and gradients of every parameter; then one jitted optax SGD step on the
    training-mode loss lowers the (deterministic) evaluation loss of a regression task."""
    layer = make_layer(estimator, out_features=8, redraw_interval=1)
    x, memory = inputs(seed=4), inputs((2, 9, IN_FEATURES), seed=2)  # cross attention
    target = jnp.tanh(x @ inputs((IN_FEATURES, 8), seed=6))
    optimizer = nnx.Optimizer(layer, optax.sgd(0.05), wrt=nnx.Param)

    def loss_fn(model, deterministic):
        out = model(x, memory, deterministic=deterministic)
        return jnp.mean((out - target) ** 2), out

    @nnx.jit
    def train_step(model, optimizer):
        (_, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, False)
        optimizer.update(model, grads)
        return out, grads

    eval_loss = nnx.jit(lambda model: loss_fn(model, True)[0])
    before = float(eval_loss(layer))
    out, grads = train_step(layer, optimizer)
    after = float(eval_loss(layer))

    assert out.shape == (2, 12, 8) and out.dtype == jnp.float32
    flat = dict(nnx.to_flat_state(nnx.state(grads, nnx.Param)))
    assert set(flat) == {(name, part) for name in ("query", "key", "value", "out")
                         for part in ("kernel", "bias")}
    for path, gradient in flat.items():
        assert bool(jnp.all(jnp.isfinite(gradient[...]))), path
        if path != ("key", "bias"):  # softmax weights ignore a bias shared by all keys
            assert float(jnp.abs(gradient[...]).sum()) > 0, path
    assert after < before


@pytest.mark.parametrize("implementation", [None, "native", "xattn"])
def test_softmax_equals_flax_multi_head_attention(implementation):
    """Through jax.nn.dot_product_attention ("native") and xattn's portable loop."""
    reference = nnx.MultiHeadAttention(NUM_HEADS, IN_FEATURES, qkv_features=8, out_features=6,
                                       decode=False, rngs=nnx.Rngs(0))
    layer = xflax.MultiHeadAttention(NUM_HEADS, IN_FEATURES, qkv_features=8, out_features=6,
                                     estimator="softmax", implementation=implementation,
                                     rngs=nnx.Rngs(1))
    nnx.update(layer, nnx.state(reference, nnx.Param))
    x = inputs()
    np.testing.assert_allclose(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    assert layer(x[0]).shape == (12, 6)  # no batch dims
    key_mask = jnp.asarray(np.arange(12) < np.array([[12], [7]]))[:, None, None, :]
    np.testing.assert_allclose(layer(x, mask=key_mask), reference(x, mask=key_mask),
                               rtol=1e-5, atol=1e-5)
    causal = nnx.make_causal_mask(jnp.ones((2, 12)))
    np.testing.assert_allclose(layer(x, is_causal=True), reference(x, mask=causal),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_state_round_trip_reproduces_eval_output(estimator):
    layer = make_layer(estimator, redraw_interval=1)
    x = inputs()
    for _ in range(3 if estimator == "rfa" else 1):  # training calls redraw rfa features
        layer(x)
    layer.eval()
    expected = layer(x)

    graphdef, state = nnx.split(layer)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), expected)
    other = make_layer(estimator, seed=7, redraw_interval=1)
    other.eval()
    assert not np.allclose(other(x), expected)
    nnx.update(other, state)
    np.testing.assert_array_equal(other(x), expected)
    if estimator == "rfa":
        features = nnx.state(layer, xflax.FeatureState)
        assert {path[0] for path, _ in nnx.to_flat_state(features)} == {
            "features", "steps_since_redraw"}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_eval_outputs_identical_and_training_random(estimator):
    layer = make_layer(estimator, redraw_interval=1)
    x = inputs()
    first, second = layer(x), layer(x)
    if estimator == "softmax":
        np.testing.assert_array_equal(first, second)
    else:  # training draws fresh samples (rfa: redrawn at every call here)
        assert not np.allclose(first, second)
    layer.eval()
    outputs = [layer(x) for _ in range(3)]
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_array_equal(outputs[0], outputs[2])
    layer.train()  # the per-call flag overrides the attribute
    np.testing.assert_array_equal(layer(x, deterministic=True), outputs[0])


def test_rfa_features_redrawn_every_interval_in_training_only():
    interval = 3
    layer = make_layer("rfa", redraw_interval=interval)
    x = inputs()
    initial = np.asarray(layer.features[...])
    assert initial.shape == (16, IN_FEATURES // NUM_HEADS)

    @nnx.jit
    def train_call(model, x):
        return model(x)

    for _ in range(interval):  # the first `interval` training calls share the features
        train_call(layer, x)
        np.testing.assert_array_equal(layer.features[...], initial)
    layer.eval()
    for _ in range(2 * interval):  # evaluation never redraws nor counts steps
        layer(x)
    np.testing.assert_array_equal(layer.features[...], initial)
    layer.train()
    train_call(layer, x)  # call interval + 1 redraws
    redrawn = np.asarray(layer.features[...])
    assert not np.array_equal(redrawn, initial)
    for _ in range(interval - 1):
        layer(x)
    np.testing.assert_array_equal(layer.features[...], redrawn)
    layer.redraw_features()
    assert not np.array_equal(layer.features[...], redrawn)

    fixed = make_layer("rfa", redraw_interval=None)
    fixed_initial = np.asarray(fixed.features[...])
    for _ in range(5):
        fixed(x)
    np.testing.assert_array_equal(fixed.features[...], fixed_initial)


@pytest.mark.parametrize("estimator", ["rfa", "ra", "lara"])
def test_randomness_from_the_rng_streams(estimator):
    """Same Rngs seed, same training outputs; an explicit call-time key is reproducible."""
    x = inputs()
    runs = [[make_layer(estimator, seed=3, redraw_interval=1) for _ in range(2)]]
    first, second = ([np.asarray(layer(x)) for _ in range(3)] for layer in runs[0])
    np.testing.assert_array_equal(np.stack(first), np.stack(second))
    layer = make_layer(estimator, seed=3, redraw_interval=1)
    by_key = layer(x, rngs=jax.random.key(5))
    if estimator == "rfa":  # the key redrew the features; the next call redraws again
        layer.eval()
        np.testing.assert_array_equal(layer(x), by_key)
    else:
        np.testing.assert_array_equal(layer(x, rngs=nnx.Rngs(attention=5)),
                                      layer(x, rngs=nnx.Rngs(attention=5)))


def test_bad_arguments():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match=r"qkv_features \(10\) must be divisible by num_heads"):
        xflax.MultiHeadAttention(4, 10, rngs=rngs)
    with pytest.raises(ValueError, match="estimator must be one of"):
        xflax.MultiHeadAttention(4, 16, estimator="performer", rngs=rngs)
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        xflax.MultiHeadAttention(0, 16, rngs=rngs)
    with pytest.raises(ValueError, match="redraw_interval must be >= 1"):
        xflax.MultiHeadAttention(4, 16, estimator="rfa", redraw_interval=0, rngs=rngs)
    with pytest.raises(TypeError, match="does not take the option"):
        xflax.MultiHeadAttention(4, 16, estimator="lara", rng=0, rngs=rngs)
    with pytest.raises(ValueError, match="weighting"):
        xflax.MultiHeadAttention(4, 16, estimator="lara", weighting="uniform", rngs=rngs)

    layer = make_layer("lara")
    x = inputs()
    with pytest.raises(ValueError, match=r"mask must be a key mask of shape \(batch\.\.\., 1 or 4"):
        layer(x, mask=nnx.make_causal_mask(jnp.ones((2, 12))))
    with pytest.raises(ValueError, match="mask must be a key mask"):
        layer(x, mask=jnp.ones((2, 1, 1, 5), dtype=bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        layer(x, mask=jnp.ones((2, 1, 1, 12)))
    segments_look_ahead = r"lara\(causal=True\): proposal='segment' looks ahead"
    with pytest.raises(ValueError, match=segments_look_ahead) as from_layer:
        layer(x, is_causal=True)
    with pytest.raises(ValueError) as from_function:  # the function's own error
        xattn.lara(*(np.ones((1, 4, 2)),) * 3, num_samples=2, causal=True)
    assert str(from_layer.value) == str(from_function.value)
    with pytest.raises(ValueError, match="inputs_q must have 16 features"):
        layer(x[..., :8])
    with pytest.raises(ValueError, match="inputs_k cannot be None"):
        layer(x, None, x)
    with pytest.raises(ValueError, match="redraw_features needs estimator='rfa'"):
        layer.redraw_features()


# --- bool options and flags: NumPy bools accepted, anything else a TypeError naming it ---


CONSTRUCTOR_BOOL_CASES = constructor_bool_cases(xflax.MultiHeadAttention.__init__)
CALL_BOOL_CASES = bool_options(xflax.MultiHeadAttention.__call__)


def leaf_data(leaf):
    """A state leaf as a NumPy array (a PRNG key as its key data)."""
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def test_bool_arguments_are_found():
    assert {"use_bias", "deterministic"} <= {name for _, name in CONSTRUCTOR_BOOL_CASES}
    assert ("rfa", "orthogonal") in CONSTRUCTOR_BOOL_CASES
    assert {"deterministic", "is_causal", "decode"} <= set(CALL_BOOL_CASES)


def with_cache(layer, x):
    """``layer`` with a cache for the sequences of ``x`` (so that ``decode=True`` runs)."""
    layer.init_cache(x.shape)
    return layer


@pytest.mark.parametrize("estimator,option", CONSTRUCTOR_BOOL_CASES)
def test_constructor_bool_options_take_numpy_bools(estimator, option):
    """np.True_ / np.False_ build the layer a Python bool builds (same state, same
    output); a str or an int is a TypeError naming the option, at construction."""
    x = inputs()
    for flag in (True, False):
        layers = [make_layer(estimator, **{option: value}) for value in (np.bool_(flag), flag)]
        states = [nnx.state(layer) for layer in layers]
        assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
        for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
            np.testing.assert_array_equal(*map(leaf_data, (a, b)))
        layers = [with_cache(layer, x) if option == "decode" else layer for layer in layers]
        np.testing.assert_array_equal(layers[0](x, deterministic=True),
                                      layers[1](x, deterministic=True))
    for bad in ("x", 1):
        with pytest.raises(TypeError, match=rf"{option} must be a bool, got "):
            make_layer(estimator, **{option: bad})


@pytest.mark.parametrize("option", CALL_BOOL_CASES)
@pytest.mark.parametrize("estimator", ["softmax", "rfa"])
def test_call_bool_flags_take_numpy_bools(estimator, option):
    """Each flag of the call gives the same output with np.True_ / np.False_ as with
    True / False (the same draws in training mode); a str or an int is a TypeError naming
    the flag, never taken as truthy (is_causal="x" is not causal)."""
    x = inputs()
    for flag in (True, False):
        outputs = [with_cache(make_layer(estimator), x)(x, rngs=nnx.Rngs(attention=3),
                                                         **{option: value})
                   for value in (np.bool_(flag), flag)]
        np.testing.assert_array_equal(outputs[0], outputs[1])
    layer = make_layer(estimator)
    for bad in ("x", 1):
        with pytest.raises(TypeError, match=rf"^{option} must be a bool, got "):
            layer(x, **{option: bad})


def test_feature_state_signature_is_the_variables():
    """FeatureState shows nnx.Variable's constructor arguments, not ``(*args, **kwargs)``
    of its metaclass."""
    signature = inspect.signature(xflax.FeatureState)
    assert next(iter(signature.parameters)) == "value"
    assert "args" not in signature.parameters
    assert list(signature.parameters) == list(
        inspect.signature(nnx.Variable.__init__).parameters)[1:]
    state = xflax.FeatureState(jnp.ones(3))
    np.testing.assert_array_equal(state[...], np.ones(3))


@pytest.mark.parametrize("estimator,option,value", BAD_OPTION_CASES)
def test_every_bad_option_value_fails_at_construction(estimator, option, value):
    """A value the estimator rejects is rejected at construction, with the estimator's
    exception type and a message naming the option."""
    with pytest.raises(direct_error(estimator, option, value), match=option):
        xflax.MultiHeadAttention(NUM_HEADS, IN_FEATURES, estimator=estimator,
                                 rngs=nnx.Rngs(0), **{option: value})


@pytest.mark.parametrize("estimator,options", [
    ("softmax", {}), ("rfa", {"num_features": 2048}), ("ra", {"num_samples": 512}),
    ("lara", {"num_samples": 512}), ("lara", {"grid": (64, 64), "num_samples": (2, 2)}),
])
def test_construction_probes_a_tiny_input_whatever_the_sample_count(monkeypatch, estimator,
                                                                     options):
    lengths = []
    real_attend = _layers.attend

    def spy(estimator, q, k, v, **kwargs):
        lengths.append((q.shape[-2], k.shape[-2]))
        return real_attend(estimator, q, k, v, **kwargs)

    monkeypatch.setattr(_layers, "attend", spy)
    xflax.MultiHeadAttention(NUM_HEADS, IN_FEATURES, estimator=estimator, rngs=nnx.Rngs(0),
                             **options)
    assert lengths and max(max(pair) for pair in lengths) <= 4


def _mask_cases():
    """Masks of the key-mask form (batch, heads, 1, kv_length) = (2, 4, 1, 12) with exactly
    one dim wrong, and the words the message must contain for that dim."""
    yield (2, 4, 1, 12), None
    yield (2, 1, 1, 12), None
    yield (1, 1, 12), None
    for heads in (2, 3, 5, 8):
        yield (2, heads, 1, 12), rf"head dim \(-3\) has {heads} entries .*num_heads=4"
    for queries in (2, 12):
        yield (2, 4, queries, 12), r"full \(q_length, kv_length\) mask"
    for keys in (1, 11, 13):
        yield (2, 4, 1, keys), "last dim must be the key length 12"
    yield (12,), r"mask must be a key mask of shape \(batch\.\.\., 1 or 4, 1, 12\), got"


@pytest.mark.parametrize("shape,message", list(_mask_cases()))
def test_mask_errors_name_the_wrong_dim(shape, message):
    layer = make_layer("softmax")
    x = inputs()
    mask = jnp.ones(shape, dtype=bool)
    if message is None:
        np.testing.assert_allclose(layer(x, mask=mask), layer(x), rtol=1e-6, atol=1e-6)
        return
    with pytest.raises(ValueError, match=message):
        layer(x, mask=mask)


@pytest.mark.parametrize("options,error,message", BAD_GRID_OPTIONS)
def test_bad_grid_options_fail_at_construction(options, error, message):
    with pytest.raises(error, match=message):
        xflax.MultiHeadAttention(NUM_HEADS, IN_FEATURES, estimator="lara", rngs=nnx.Rngs(0),
                                 **options)


def _image_transpose(x, grid):
    """(batch, H*W, E) tokens of an H x W image in row-major order -> the W x H image."""
    batch, _, features = x.shape
    return jnp.swapaxes(x.reshape(batch, *grid, features), 1, 2).reshape(batch, -1, features)


def test_lara_grid_reaches_the_estimator():
    """grid=(H, W): a 1 x W grid is 1-D LARA in both modes (same Rngs seed); a 2-D grid
    segments the image: its evaluation output is equivariant under transposing the image
    (grid and pools swapped), which 1-D segments of the token sequence are not."""
    x = inputs((2, 12, IN_FEATURES))
    one_row = make_layer("lara", seed=2, grid=(1, 12), num_samples=(1, 4))
    one_d = make_layer("lara", seed=2, num_samples=4)
    for deterministic in (False, False, True):
        np.testing.assert_allclose(one_row(x, deterministic=deterministic),
                                   one_d(x, deterministic=deterministic), rtol=1e-6, atol=1e-6)

    grid, pools = (3, 4), (2, 2)
    image = make_layer("lara", grid=grid, num_samples=pools, deterministic=True)
    transposed = make_layer("lara", grid=grid[::-1], num_samples=pools[::-1],
                            deterministic=True)
    sequence = make_layer("lara", num_samples=4, deterministic=True)
    out, x_t = image(x), _image_transpose(x, grid)
    np.testing.assert_allclose(transposed(x_t), _image_transpose(out, grid), rtol=1e-5,
                               atol=1e-6)
    out_1d = sequence(x)
    assert not np.allclose(out_1d, out, atol=1e-3)
    assert not np.allclose(sequence(x_t), _image_transpose(out_1d, grid), atol=1e-3)
    with pytest.raises(ValueError, match=r"grid \(H, W\) = \(3, 4\) needs query and key "
                                         r"sequences of H \* W = 12 tokens"):
        image(x[:, :10])


def test_class_signature_is_the_constructors():
    """inspect.signature (and Sphinx) show the constructor's arguments, not the
    ``(*args, **kwargs)`` of nnx.Module's metaclass, with readable defaults."""
    signature = inspect.signature(xflax.MultiHeadAttention)
    init = inspect.signature(xflax.MultiHeadAttention.__init__)
    assert list(signature.parameters) == list(init.parameters)[1:]
    assert list(signature.parameters)[:2] == ["num_heads", "in_features"]
    assert " at 0x" not in str(signature) and "<" not in str(signature)
    for name, parameter in signature.parameters.items():
        default = init.parameters[name].default
        if isinstance(default, str | int | bool | None):
            assert parameter.default == default, name


@pytest.mark.parametrize("estimator,options", PASS_THROUGH_CASES)
def test_layer_is_the_estimator_on_its_projections(estimator, options):
    """In both modes, with and without causal masking, the layer computes multi-head
    attention with the estimator and its options unchanged (noise_scale, grid, window,
    sinks, ...), drawing from the call's key."""
    layer = xflax.MultiHeadAttention(NUM_HEADS, IN_FEATURES, estimator=estimator,
                                     redraw_interval=None, rngs=nnx.Rngs(0), **options)
    x = inputs((2, 12, IN_FEATURES))
    q, k, v = (jnp.swapaxes(projection(x), -3, -2)
               for projection in (layer.query, layer.key, layer.value))
    for deterministic in (False, True):
        for causal in (False,) if estimator == "lara" else (False, True):
            key = jax.random.key(7)
            omega = layer.features[...] if estimator == "rfa" else None
            function, keywords = estimator_call(estimator, options, training=not deterministic,
                                                omega=omega, rng=key)
            keywords = {**keywords, "causal": True} if causal else keywords
            expected = layer.out(jnp.swapaxes(function(q, k, v, **keywords), -3, -2))
            out = layer(x, deterministic=deterministic, rngs=key, is_causal=causal)
            np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sinks", [12, 13, 1000])
def test_rfa_with_every_key_a_sink_is_exact_attention(sinks):
    """sinks >= the key length (capped there): every key is computed exactly, so the rfa
    layer equals the softmax layer with the same weights, in both modes and causal."""
    exact = make_layer("softmax")
    layer = make_layer("rfa", sinks=sinks)
    nnx.update(layer, nnx.state(exact, nnx.Param))
    x = inputs((2, 12, IN_FEATURES))
    for deterministic in (False, True):
        for causal in (False, True):
            np.testing.assert_allclose(layer(x, deterministic=deterministic, is_causal=causal),
                                       exact(x, is_causal=causal), rtol=1e-5, atol=1e-5)
