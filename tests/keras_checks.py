"""Checks of :class:`xattn.keras.MultiHeadAttention` on one Keras backend.

Keras chooses its backend once, when it is first imported (``KERAS_BACKEND``), so
``tests/test_keras_layer.py`` runs this script in a subprocess per backend::

    KERAS_BACKEND=jax PYTHONPATH=src python tests/keras_checks.py [name ...]

runs the functions ``check_<name>`` (default: all).

Each ``check_*`` function asserts against an exact reference (Keras's own
``MultiHeadAttention``, or xattn's estimators on the NumPy copies of the projections in
float64) and prints ``ok <name>``; any failure raises and ends the script with a
traceback. Not collected by pytest (the file name does not start with ``test_``).
"""

from __future__ import annotations

import doctest
import os
import sys
import tempfile

import keras
import numpy as np

import xattn
import xattn.keras
from xattn._integrations.keras_layer import check_backend

BACKEND = keras.backend.backend()
RNG = np.random.default_rng(0)
BATCH, LENGTH, FEATURES, HEADS, HEAD_DIM = 2, 7, 12, 3, 4
FLOAT32_TOL = 1e-5  # float32 computation against the float64 / Keras reference


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)


def inputs(length=LENGTH, features=FEATURES, batch=BATCH):
    return RNG.standard_normal((batch, length, features)).astype("float32")


def copy_projections(target, source):
    """Copy the four projections of ``source`` (ours or Keras's) into ``target``."""
    for name in ("query_dense", "key_dense", "value_dense", "output_dense"):
        getattr(target, name).set_weights(getattr(source, name).get_weights())


def thin_on_jax(cases):
    """``(estimator, options)`` pairs, on the JAX backend without RA's: its layer code
    (the seeds, the training flag, the config) is LARA's, run on both, and RA runs on
    the torch backend; eager JAX compiles each estimator's operations anew (2 to 3 s)."""
    return [(name, options) for name, options in cases if BACKEND != "jax" or name != "ra"]


def raises(error, match, function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except error as caught:
        assert match in str(caught), f"{match!r} not in the message {caught}"
        return
    raise AssertionError(f"{function} did not raise {error.__name__} ({match!r})")


# -- exactness -----------------------------------------------------------------------------

def check_softmax_equals_keras():
    """estimator="softmax" equals keras.layers.MultiHeadAttention with the same weights,
    with padding (explicit and Keras masks), causal masking, a separate key and
    output_shape (value_dim: see check_evaluation_is_deterministic; Keras's own layer
    fails with value_dim != key_dim on JAX)."""
    query, value, key = inputs(), inputs(length=9, features=5), inputs(length=9, features=6)
    padding = np.ones((BATCH, 9), dtype=bool)
    padding[1, 5:] = False
    attention_mask = np.broadcast_to(padding[:, None, :], (BATCH, LENGTH, 9))
    sizes = {"num_heads": HEADS, "key_dim": HEAD_DIM, "output_shape": 8}
    theirs = keras.layers.MultiHeadAttention(**sizes)
    ours = xattn.keras.MultiHeadAttention(**sizes, estimator="softmax")
    theirs(query, value, key)
    ours(query, value, key)
    copy_projections(ours, theirs)
    for mask in (None, attention_mask):
        expected, got = (numpy(layer(query, value, key, attention_mask=mask))
                         for layer in (theirs, ours))
        np.testing.assert_allclose(got, expected, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)

    # self-attention: causal, causal with padding, Keras masks from an Embedding
    tokens = RNG.integers(1, 20, size=(BATCH, LENGTH))
    tokens[1, 4:] = 0  # padding (the query mask too)
    embedding = keras.layers.Embedding(20, FEATURES, mask_zero=True)
    self_sizes = {"num_heads": HEADS, "key_dim": HEAD_DIM}
    theirs = keras.layers.MultiHeadAttention(**self_sizes)
    ours = xattn.keras.MultiHeadAttention.from_config(
        {**theirs.get_config(), "estimator": "softmax"})  # a Keras configuration loads
    x = inputs()
    theirs(x, x)
    ours(x, x)
    copy_projections(ours, theirs)
    padding = np.ones((BATCH, LENGTH), dtype=bool)
    padding[0, 5:] = False
    for causal in (False, True):
        for mask in (None, np.broadcast_to(padding[:, None, :], (BATCH, LENGTH, LENGTH))):
            expected, got = (numpy(layer(x, x, attention_mask=mask, use_causal_mask=causal))
                             for layer in (theirs, ours))
            np.testing.assert_allclose(got, expected, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)
        embedded = embedding(tokens)
        # ours first: Keras's layer deletes the masks of its inputs (ours restores them)
        got, expected = (numpy(layer(embedded, embedded, use_causal_mask=causal))
                         for layer in (ours, theirs))
        valid = tokens != 0  # Keras leaves the outputs of padded queries unspecified
        np.testing.assert_allclose(got[valid], expected[valid], rtol=FLOAT32_TOL,
                                   atol=FLOAT32_TOL)
    # an explicit causal mask is accepted with use_causal_mask=True (it changes nothing)
    causal_mask = np.tril(np.ones((LENGTH, LENGTH), dtype=bool))[None] & padding[:, None, :]
    expected = numpy(theirs(x, x, attention_mask=causal_mask))
    got = numpy(ours(x, x, attention_mask=causal_mask, use_causal_mask=True))
    np.testing.assert_allclose(got, expected, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)


def reference_output(layer, x, estimator, **options):
    """The layer's evaluation output from the NumPy copies of its projections, by xattn's
    estimators in float64 (RFA with the layer's features, RA biased deterministic, LARA
    deterministic)."""
    q, k, v = (np.transpose(numpy(dense(x)), (0, 2, 1, 3))
               for dense in (layer.query_dense, layer.key_dense, layer.value_dense))
    if estimator == "rfa":
        heads = xattn.rfa(q, k, v, omega=numpy(layer.features), **options)
    elif estimator == "ra":
        heads = xattn.ra(q, k, v, biased=True, deterministic=True, **options)
    else:
        heads = xattn.lara(q, k, v, deterministic=True, **options)
    kernel, bias = (numpy(w) for w in layer.output_dense.weights)
    return np.einsum("bhtd,hde->bte", heads, kernel) + bias


def check_evaluation_is_deterministic():
    """Evaluation mode (training None or False) is deterministic and equals xattn's
    estimator on the projections; training mode draws (RFA: redraws on schedule)."""
    x = inputs()
    cases = {"rfa": {"num_features": 16}, "ra": {"num_samples": 2},
             "lara": {"num_samples": 3}}
    for estimator, options in thin_on_jax(cases.items()):
        layer = xattn.keras.MultiHeadAttention(HEADS, HEAD_DIM, estimator=estimator,
                                               redraw_interval=1 if estimator == "rfa"
                                               else 1000, seed=1, **options)
        first = numpy(layer(x, x))
        np.testing.assert_array_equal(numpy(layer(x, x, training=False)), first)
        np.testing.assert_allclose(first, reference_output(layer, x, estimator, **options),
                                   rtol=FLOAT32_TOL, atol=FLOAT32_TOL)
        draws = [numpy(layer(x, x, training=True)) for _ in range(2)]
        assert not np.allclose(draws[0], draws[1]), estimator
        if estimator == "rfa":  # redrawn at each training call (redraw_interval=1)
            assert int(numpy(layer.steps_since_redraw)) == 1
            assert not np.allclose(numpy(layer(x, x)), first)
            np.testing.assert_allclose(numpy(layer(x, x)), reference_output(
                layer, x, estimator), rtol=FLOAT32_TOL, atol=FLOAT32_TOL)
        else:
            np.testing.assert_array_equal(numpy(layer(x, x)), first)

    # features kept: training mode is RFA with the same features, so the same output
    layer = xattn.keras.MultiHeadAttention(HEADS, HEAD_DIM, estimator="rfa",
                                           redraw_interval=None, seed=2)
    evaluation = numpy(layer(x, x))
    features = numpy(layer.features)
    np.testing.assert_allclose(numpy(layer(x, x, training=True)), evaluation,
                               rtol=FLOAT32_TOL, atol=FLOAT32_TOL)
    np.testing.assert_array_equal(numpy(layer.features), features)
    assert layer.features.shape == (xattn.default_num_features(HEAD_DIM), HEAD_DIM)


# -- training ------------------------------------------------------------------------------

def tiny_model(estimator, **options):
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(16, FEATURES, mask_zero=True)(tokens)
    x = xattn.keras.MultiHeadAttention(2, HEAD_DIM, estimator=estimator, seed=3,
                                       name="attention", **options)(
        x, x, use_causal_mask=estimator != "lara")
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(1)(x))


def regression_task(count=64):
    """Targets that need attention: the mean of the token ids of each padded sequence."""
    tokens = RNG.integers(1, 16, size=(count, 8))
    lengths = RNG.integers(3, 9, size=count)
    tokens[np.arange(8)[None, :] >= lengths[:, None]] = 0
    target = tokens.sum(axis=1, keepdims=True) / lengths[:, None] / 8.0
    return tokens.astype("int32"), target.astype("float32")


def check_fit():
    """model.fit (compiled on JAX) decreases the loss with each estimator; RFA's features
    are redrawn inside fit; evaluation after fit is deterministic."""
    keras.utils.set_random_seed(0)
    tokens, target = regression_task()
    for estimator, options in (("rfa", {"num_features": 8, "redraw_interval": 2}),
                               ("ra", {"num_samples": 1}), ("lara", {"num_samples": 2})):
        model = tiny_model(estimator, **options)
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
        attention = model.get_layer("attention")
        before = numpy(attention.features) if estimator == "rfa" else None
        history = model.fit(tokens, target, batch_size=16, epochs=4, verbose=0)
        losses = history.history["loss"]
        assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], (estimator,
                                                                              losses)
        if estimator == "rfa":  # 16 training steps, a redraw every 2
            assert not np.allclose(numpy(attention.features), before)
            assert int(numpy(attention.steps_since_redraw)) in (1, 2)
        predictions = [model.predict(tokens, verbose=0) for _ in range(2)]
        np.testing.assert_array_equal(predictions[0], predictions[1])


def check_compiled_attention_mask():
    """An explicit attention_mask in a model: predict (compiled on JAX) gives the eager
    call's output for a padding mask; a general mask raises where its values can be read
    (eager torch) and is taken as its key padding (keys attended by any query) under
    jit (JAX), as documented."""
    layer = xattn.keras.MultiHeadAttention(HEADS, HEAD_DIM, estimator="rfa", seed=7)
    x_input = keras.Input((LENGTH, FEATURES))
    mask_input = keras.Input((LENGTH, LENGTH), dtype="bool")
    model = keras.Model([x_input, mask_input],
                        layer(x_input, x_input, attention_mask=mask_input))
    x = inputs()
    padding = np.ones((BATCH, LENGTH), dtype=bool)
    padding[1, 3:] = False
    mask = np.broadcast_to(padding[:, None, :], (BATCH, LENGTH, LENGTH)).copy()
    eager = numpy(layer(x, x, attention_mask=mask))
    compiled = model.predict([x, mask], verbose=0)
    np.testing.assert_allclose(compiled, eager, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)
    hidden = mask.copy()
    hidden[1] = False  # every key of sequence 1 masked: zero attention, the output bias
    bias = numpy(layer.output_dense.weights[1])
    np.testing.assert_array_equal(numpy(layer(x, x, attention_mask=hidden))[1],
                                  np.broadcast_to(bias, (LENGTH, FEATURES)))
    general = mask.copy()
    general[0, 0, 1] = False  # key 1 hidden from query 0 only: not a key padding mask
    if BACKEND == "jax":
        np.testing.assert_allclose(model.predict([x, general], verbose=0), eager,
                                   rtol=FLOAT32_TOL, atol=FLOAT32_TOL)
    else:
        raises(ValueError, "not a key padding mask", model.predict, [x, general], verbose=0)


# -- serialization -------------------------------------------------------------------------

def check_serialization():
    """get_config / from_config, and a .keras save/load round trip, give identical
    evaluation outputs (RFA's features and LARA's learned means are weights)."""
    x = inputs()
    for estimator, options in thin_on_jax([
            ("rfa", {"num_features": 8, "window": 1, "sinks": 1}),
            ("lara", {"proposal": "learned", "num_samples": 3}),
            ("ra", {"num_samples": 2, "noise_scale": 0.5})]):
        layer = xattn.keras.MultiHeadAttention(HEADS, HEAD_DIM, estimator=estimator,
                                               output_shape=(2, 3), seed=4, **options)
        expected = numpy(layer(x, x, use_causal_mask=True))
        config = layer.get_config()
        assert {**options, "estimator": estimator}.items() <= config.items(), config
        clone = xattn.keras.MultiHeadAttention.from_config(config)
        clone(x, x)
        assert clone.get_config() == config
        clone.set_weights(layer.get_weights())
        np.testing.assert_array_equal(numpy(clone(x, x, use_causal_mask=True)), expected)

        inputs_ = keras.Input((LENGTH, FEATURES))
        model = keras.Model(inputs_, layer(inputs_, inputs_, use_causal_mask=True))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
        restored = loaded.layers[-1]
        assert type(restored) is xattn.keras.MultiHeadAttention
        assert restored.get_config() == config
        np.testing.assert_array_equal(numpy(loaded(x)), expected)
        for mine, theirs in zip(layer.weights, restored.weights, strict=True):
            np.testing.assert_array_equal(numpy(theirs), numpy(mine))


# -- mixed precision -----------------------------------------------------------------------

def mixed_precision_policies():
    policies = ["mixed_bfloat16"]
    if BACKEND == "torch":  # float16 matmuls on the CPU: torch has them
        policies.append("mixed_float16")
    return policies


def check_mixed_precision():
    """Under a mixed policy the output is in the compute dtype, the variables stay
    float32, and the output is finite and close to the float32 layer's.

    Tolerance: the inputs, the projected q, k, v, the attention output and the final
    projection are each rounded to the compute dtype once (unit roundoff u = 2**-8 for
    bfloat16, 2**-11 for float16); each rounding moves the output by at most about u
    times the norm of what flows through the following linear maps, which here (unit
    inputs, Glorot kernels, convex attention weights) stays below a few times the
    output's scale. The RFA exponentials add ``|omega| |q_hat|`` u to the logits' error.
    We allow 16 u times the largest output magnitude (a 4 x margin over these four
    roundings, 4 u)."""
    x = inputs()
    for policy in mixed_precision_policies():
        unit_roundoff = 2.0 ** -8 if policy == "mixed_bfloat16" else 2.0 ** -11
        for estimator in ("softmax", "rfa", "lara"):
            reference = xattn.keras.MultiHeadAttention(HEADS, HEAD_DIM, estimator=estimator,
                                                       seed=5)
            expected = numpy(reference(x, x, use_causal_mask=estimator != "lara"))
            keras.mixed_precision.set_global_policy(policy)
            try:
                layer = xattn.keras.MultiHeadAttention(HEADS, HEAD_DIM, estimator=estimator,
                                                       seed=6)
                layer(x, x)
                layer.set_weights(reference.get_weights())
                out = layer(x, x, use_causal_mask=estimator != "lara")
                training = layer(x, x, training=True)
            finally:
                keras.mixed_precision.set_global_policy("float32")
            compute = policy.removeprefix("mixed_")
            assert keras.backend.standardize_dtype(out.dtype) == compute, out.dtype
            assert keras.backend.standardize_dtype(training.dtype) == compute
            assert all(keras.backend.standardize_dtype(w.dtype) in ("float32", "int32")
                       for w in layer.weights)
            got = numpy(out)
            assert np.all(np.isfinite(got)) and np.all(np.isfinite(numpy(training)))
            tolerance = 16 * unit_roundoff * np.abs(expected).max()
            error = np.abs(got - expected).max()
            assert error <= tolerance, (policy, estimator, error, tolerance)
            print(f"   {policy} {estimator}: max error {error:.2e} <= {tolerance:.2e}")


# -- errors --------------------------------------------------------------------------------

def check_errors():
    """Bad arguments raise ValueError / TypeError naming the argument."""
    layer_class = xattn.keras.MultiHeadAttention
    x = inputs()
    raises(ValueError, "dropout must be 0", layer_class, 2, 4, dropout=0.1)
    raises(ValueError, "estimator must be one of", layer_class, 2, 4, estimator="exact")
    raises(TypeError, "does not take the option(s) ['num_features']", layer_class, 2, 4,
           estimator="lara", num_features=8)
    raises(TypeError, "num_heads must be an int", layer_class, 2.0, 4)
    raises(ValueError, "key_dim must be >= 1", layer_class, 2, 0)
    raises(TypeError, "use_bias must be a bool", layer_class, 2, 4, use_bias=1)
    raises(TypeError, "output_shape must be an int", layer_class, 2, 4, output_shape=2.0)
    raises(ValueError, "output_shape[1] must be >= 1", layer_class, 2, 4, output_shape=(2, 0))
    raises(TypeError, "seed must be an int >= 0", layer_class, 2, 4, seed="0")
    raises(ValueError, "sliding_window is not supported", layer_class, 2, 4, sliding_window=3)
    raises(ValueError, "attention_axes", layer_class, 2, 4, attention_axes=(1, 2))
    raises(ValueError, "use_gate=True is not supported", layer_class, 2, 4, use_gate=True)
    raises(ValueError, "Unrecognized keyword arguments", layer_class, 2, 4, num_featurez=8)
    raises(ValueError, "feature_map must be one of", layer_class, 2, 4, feature_map="relu")

    layer = layer_class(2, 4, estimator="softmax")
    raises(ValueError, "return_attention_scores=True is not supported", layer, x, x,
           return_attention_scores=True)
    raises(ValueError, "3-D (batch, length, features)", layer_class(2, 4), x[None], x[None])
    raises(ValueError, "value must be 3-D", layer, x, x[None])  # built already
    general = RNG.random((BATCH, LENGTH, LENGTH)) < 0.5
    raises(ValueError, "not a key padding mask", layer, x, x, attention_mask=general)
    causal = np.tril(np.ones((LENGTH, LENGTH), dtype=bool))
    raises(ValueError, "use_causal_mask=True instead of a causal attention_mask", layer, x,
           x, attention_mask=causal)
    raises(ValueError, "attention_mask must have shape", layer, x, x,
           attention_mask=np.ones((BATCH, LENGTH, LENGTH + 1), dtype=bool))
    raises(TypeError, "attention_mask must be boolean or integer", layer, x, x,
           attention_mask=np.zeros((BATCH, LENGTH, LENGTH), dtype="float32"))
    raises(TypeError, "use_causal_mask must be a bool", layer, x, x, use_causal_mask="yes")
    raises(ValueError, "causal", layer_class(2, 4, estimator="lara"), x, x,
           use_causal_mask=True)

    # The TensorFlow backend (not installed here): its name is refused, at construction
    raises(ValueError, "runs on the Keras backends 'jax', 'torch', not 'tensorflow'",
           check_backend, "tensorflow")
    original = keras.backend.backend
    keras.backend.backend = lambda: "tensorflow"
    try:
        raises(ValueError, "set KERAS_BACKEND=jax or KERAS_BACKEND=torch", layer_class, 2, 4)
    finally:
        keras.backend.backend = original
    assert check_backend() == BACKEND


def check_doctests():
    """The examples in the docstrings of xattn.keras."""
    failures, tried = doctest.testmod(xattn.keras, optionflags=doctest.ELLIPSIS
                                      | doctest.NORMALIZE_WHITESPACE)
    assert tried > 0 and failures == 0, (failures, tried)


CHECKS = {name.removeprefix("check_"): value for name, value in globals().items()
          if name.startswith("check_") and name != "check_backend"}


def main(names):
    for name in names or CHECKS:
        CHECKS[name]()
        print(f"ok {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
