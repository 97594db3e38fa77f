"""Non-finite keys and values: they reach exactly the rows that attend them.

The contract, for every estimator, causal or not, whole or in pieces: NaN or infinity in
key or value ``m`` makes NaN the output rows that attend key ``m`` (every row without
``causal``, rows at positions ``>= m`` with it) and no other row; a key left out by
``key_mask`` reaches no row; and the **gradients** of a loss on rows that do not attend
key ``m`` are finite, with a zero gradient for the rows left out of the loss. The
estimators compute on inputs whose non-finite rows are zeroed and write the NaN with
``where`` at the end (``xattn._core.primitives.quarantine``).
"""

from __future__ import annotations

import warnings

import array_api_compat
import numpy as np
import pytest

import xattn
from xattn import TrigonometricDenominatorWarning

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

NUM_TOKENS, BAD_POSITION, LOSS_ROWS = 40, 30, 10
HEAD_DIM, VALUE_DIM, NUM_FEATURES = 8, 3, 16

PROPOSAL_MEANS = 0.3 * np.random.default_rng(5).normal(size=(8, HEAD_DIM))

def lara_means(xp, q, options):
    """The proposal means of a new sequence (a state holds its own: not given again,
    which Dask could only compare by computing)."""
    if options.get("state") is not None:
        return None
    return xp.asarray(PROPOSAL_MEANS, dtype=q.dtype, device=array_api_compat.device(q))


# name -> function of (q, k, v, xp, **options)
CAUSAL_CASES = {
    "softmax": lambda q, k, v, xp, **o: xattn.softmax_attention(q, k, v, **o),
    "softmax-xattn": lambda q, k, v, xp, **o: xattn.softmax_attention(
        q, k, v, implementation="xattn", **o),
    "ra": lambda q, k, v, xp, **o: xattn.ra(q, k, v, num_samples=2, rng=0, **o),
    "rfa-positive": lambda q, k, v, xp, **o: xattn.rfa(
        q, k, v, num_features=NUM_FEATURES, rng=0, **o),
    "rfa-hyperbolic": lambda q, k, v, xp, **o: xattn.rfa(
        q, k, v, num_features=NUM_FEATURES, rng=0, feature_map="hyperbolic", **o),
    "rfa-trigonometric": lambda q, k, v, xp, **o: xattn.rfa(
        q, k, v, num_features=NUM_FEATURES, rng=0, feature_map="trigonometric", **o),
    "rfa-window-sinks": lambda q, k, v, xp, **o: xattn.rfa(
        q, k, v, num_features=NUM_FEATURES, rng=0, window=8, sinks=1, **o),
    "lara-balance": lambda q, k, v, xp, **o: xattn.lara(
        q, k, v, num_samples=8, rng=0, weighting="balance",
        proposal_means=lara_means(xp, q, o), **o),
    "lara-query-proposal": lambda q, k, v, xp, **o: xattn.lara(
        q, k, v, num_samples=8, rng=0, weighting="query_proposal",
        proposal_means=lara_means(xp, q, o), **o),
}


#: The cases run on JAX and Dask (thin): all but the positive map, whose lines the
#: hyperbolic map runs (the positive map with the samples +-w, xattn._estimators.rfa)
COSTLY_CASES = tuple(name for name in CAUSAL_CASES if name != "rfa-positive")


def inputs(backend, which=None, bad=np.nan, seed=0):
    """q, k, v (1, N, ·) as backend arrays, entry 2 of ``which`` ("key"/"value") at
    ``BAD_POSITION`` set to ``bad``."""
    draw = np.random.default_rng(seed)
    q, k = (0.5 * draw.normal(size=(1, NUM_TOKENS, HEAD_DIM)) for _ in range(2))
    v = draw.normal(size=(1, NUM_TOKENS, VALUE_DIM))
    if which is not None:
        (k if which == "key" else v)[0, BAD_POSITION, 2] = bad
    return q, k, v


def call(backend, name, q, k, v, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        return CAUSAL_CASES[name](*(backend.asarray(x) for x in (q, k, v)), backend.ns,
                                  **options)


@pytest.mark.thin(which=("key",), bad=(-np.inf,), name=COSTLY_CASES)
@pytest.mark.parametrize("name", CAUSAL_CASES)
@pytest.mark.parametrize("which,bad", [("key", np.nan), ("value", np.nan), ("value", np.inf),
                                       ("key", -np.inf)])
def test_a_later_nonfinite_key_or_value_reaches_only_the_rows_that_attend_it(
        backend, name, which, bad):
    """Causal: rows >= m NaN, rows < m bit-identical to the clean call; the same rows in
    pieces (prefill up to m, then the rest) as in one call."""
    clean = backend.to_numpy(call(backend, name, *inputs(backend), causal=True))
    q, k, v = inputs(backend, which, bad)
    out = backend.to_numpy(call(backend, name, q, k, v, causal=True))
    assert np.all(np.isnan(out[:, BAD_POSITION:])), name
    np.testing.assert_array_equal(out[:, :BAD_POSITION], clean[:, :BAD_POSITION])
    # in pieces: the state carries the NaN to every later row, and only there
    first, state = call(backend, name, q[:, :BAD_POSITION + 2], k[:, :BAD_POSITION + 2],
                        v[:, :BAD_POSITION + 2], causal=True, return_state=True)
    rest = call(backend, name, q[:, BAD_POSITION + 2:], k[:, BAD_POSITION + 2:],
                v[:, BAD_POSITION + 2:], causal=True, state=state)
    pieces = np.concatenate([backend.to_numpy(first), backend.to_numpy(rest)], axis=1)
    assert np.all(np.isnan(pieces[:, BAD_POSITION:])), name
    if name != "ra":  # RA draws its samples per call: pieces differ from one call
        np.testing.assert_allclose(pieces[:, :BAD_POSITION], clean[:, :BAD_POSITION],
                                   rtol=1e-9, atol=1e-12)
    assert np.all(np.isfinite(pieces[:, :BAD_POSITION]))


@pytest.mark.thin(name=COSTLY_CASES)
@pytest.mark.parametrize("name", CAUSAL_CASES)
def test_a_nonfinite_key_makes_every_row_nan_without_causal(backend, name):
    out = backend.to_numpy(call(backend, name, *inputs(backend, "value", np.nan)))
    assert np.all(np.isnan(out))


@pytest.mark.thin(name=COSTLY_CASES)
@pytest.mark.parametrize("name", CAUSAL_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_a_masked_nonfinite_key_reaches_no_row(backend, name, causal):
    """A NaN key and a NaN value that ``key_mask`` leaves out: the output of the same
    call with finite numbers there, on the whole call and on the state's path."""
    q, k, v = inputs(backend)
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[0, 5], bad_v[0, BAD_POSITION] = np.nan, np.inf
    mask = np.ones((1, NUM_TOKENS), bool)
    mask[0, [5, BAD_POSITION]] = False
    key_mask = backend.asarray(mask)
    expected = backend.to_numpy(call(backend, name, q, k, v, causal=causal, key_mask=key_mask))
    out = backend.to_numpy(call(backend, name, q, bad_k, bad_v, causal=causal,
                                key_mask=key_mask))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    if causal:
        stateful, _ = call(backend, name, q, bad_k, bad_v, causal=True, key_mask=key_mask,
                           return_state=True)
        np.testing.assert_allclose(backend.to_numpy(stateful), expected, rtol=1e-9,
                                   atol=1e-12)


_JAX_GRADIENTS: dict = {}  # the compiled gradient of the test running


def gradients(backend, function, arrays, rows):
    """The gradients of ``sum(function(q, k, v)[:, rows])`` with respect to q, k, v, as
    float64 NumPy arrays (torch autograd or jax.grad)."""
    if backend.name.startswith("torch"):
        tensors = [backend.asarray(a).requires_grad_(True) for a in arrays]
        function(*tensors)[:, rows].sum().backward()
        return [backend.to_numpy(t.grad) for t in tensors]
    import jax

    # compiled once per function and rows (eager JAX compiles every operation of the call
    # on its own): the clean and the corrupted inputs run the same program
    key = (function, rows.start, rows.stop)
    if key not in _JAX_GRADIENTS:
        _JAX_GRADIENTS.clear()
        _JAX_GRADIENTS[key] = jax.jit(jax.grad(lambda *a: function(*a)[:, rows].sum(),
                                               argnums=(0, 1, 2)))
    grads = _JAX_GRADIENTS[key](*(backend.asarray(a) for a in arrays))
    return [backend.to_numpy(g) for g in grads]


@pytest.mark.thin(which=("key",), name=COSTLY_CASES)
@pytest.mark.parametrize("name", CAUSAL_CASES)
@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("stateful", [False, True])
def test_gradients_of_earlier_rows_are_untouched_by_a_later_nan(backend, name, which,
                                                                stateful):
    """A loss on rows 0-9 with NaN at key or value 30: the gradients equal those of the
    clean inputs (finite; zero for q's rows 10-39), on the plain call and on the prefill
    of a state."""
    if not backend.name.startswith(("torch", "jax")):
        pytest.skip(f"{backend.name} has no automatic differentiation")
    xp = backend.ns

    def function(q, k, v):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
            result = CAUSAL_CASES[name](q, k, v, xp, causal=True, return_state=stateful)
        return result[0] if stateful else result

    rows = slice(0, LOSS_ROWS)
    clean = gradients(backend, function, inputs(backend), rows)
    corrupted = gradients(backend, function, inputs(backend, which, np.nan), rows)
    for label, got, expected in zip("qkv", corrupted, clean, strict=True):
        assert np.all(np.isfinite(got)), (name, label)
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12, err_msg=label)
    assert np.all(corrupted[0][:, LOSS_ROWS:] == 0)


#: The cases of a key whose squared norm overflows float32 (the trigonometric map is left
#: out: its estimate for one key of norm 1e19 is noise of the size of exp(|k|^2 / 2) in any
#: dtype, a property of the map, not of its arithmetic)
HUGE_KEY_CASES = [name for name in CAUSAL_CASES if name != "rfa-trigonometric"]


@pytest.mark.thin(factor=(3e37,), name=("rfa-positive", "lara-balance"))
@pytest.mark.parametrize("factor", [1e19, 3e37])
@pytest.mark.parametrize("name", HUGE_KEY_CASES)
def test_a_finite_key_whose_squared_norm_overflows_is_still_attended(backend, name, factor):
    """A float32 key scaled by 1e19 (its squared norm overflows) or 3e37 (its products
    with the samples too) is finite: a row that attends only it gives its value, causal
    or not, whole or in a decoding step (float64 and softmax do), and every row is
    finite. Before, the causal row was 0 and the non-causal one NaN."""
    q, k, v = (x.astype(np.float32) for x in inputs(backend))
    k[0, 0] *= factor
    value = v[0, 0]

    causal = backend.to_numpy(call(backend, name, q, k, v, causal=True))
    assert np.all(np.isfinite(causal))
    np.testing.assert_allclose(causal[0, 0], value, rtol=1e-5, atol=1e-6)

    only_first = np.zeros((1, NUM_TOKENS), dtype=bool)
    only_first[0, 0] = True
    masked = backend.to_numpy(call(backend, name, q, k, v,
                                   key_mask=backend.asarray(only_first)))
    np.testing.assert_allclose(masked[0], np.broadcast_to(value, masked[0].shape),
                               rtol=1e-5, atol=1e-6)

    # a decoding step whose new key is the only one allowed
    _, state = call(backend, name, q[:, 1:4], k[:, 1:4], v[:, 1:4], causal=True,
                    key_mask=backend.asarray(np.zeros((1, 3), dtype=bool)), return_state=True)
    step = backend.to_numpy(call(backend, name, q[:, :1], k[:, :1], v[:, :1], causal=True,
                                 key_mask=backend.asarray(only_first[:, :1]), state=state))
    np.testing.assert_allclose(step[0, 0], value, rtol=1e-5, atol=1e-6)
