"""Half precision, large scores, and NaN/inf in the inputs, for every estimator."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import xattn
from conftest import _make_backend, selected_backends
from xattn import TrigonometricDenominatorWarning

import reference

ESTIMATORS = {
    "softmax": lambda q, k, v, **kw: xattn.softmax_attention(q, k, v, **kw),
    "rfa-positive": lambda q, k, v, **kw: xattn.rfa(q, k, v, num_features=32, rng=0, **kw),
    "rfa-hyperbolic": lambda q, k, v, **kw: xattn.rfa(q, k, v, num_features=32, rng=0,
                                                      feature_map="hyperbolic", **kw),
    "ra": lambda q, k, v, **kw: xattn.ra(q, k, v, num_samples=3, rng=0, **kw),
    "ra-deterministic": lambda q, k, v, **kw: xattn.ra(q, k, v, biased=True,
                                                       deterministic=True, **kw),
    "lara": lambda q, k, v, **kw: xattn.lara(q, k, v, num_samples=4, rng=0, **kw),
    "lara-deterministic": lambda q, k, v, **kw: xattn.lara(q, k, v, num_samples=4,
                                                           deterministic=True, **kw),
}
TRIGONOMETRIC = {
    "rfa-trigonometric": lambda q, k, v, **kw: xattn.rfa(q, k, v, num_features=32, rng=0,
                                                         feature_map="trigonometric", **kw),
}
ALL = {**ESTIMATORS, **TRIGONOMETRIC}
ROW_WISE = ["softmax", "rfa-positive", "rfa-hyperbolic", "rfa-trigonometric", "ra",
            "ra-deterministic"]

# unit roundoff of the half-precision formats (half the distance from 1 to the next number)
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
HALF_BACKENDS = [name for name in ("torch", "jax") if name in selected_backends()]


def make_inputs(seed=0, batch=(2,), num_queries=8, num_keys=12, head_dim=8, value_dim=3):
    data = np.random.default_rng(seed)
    return (data.normal(size=(*batch, num_queries, head_dim)),
            data.normal(size=(*batch, num_keys, head_dim)),
            data.normal(size=(*batch, num_keys, value_dim)))


def to_backend(backend, arrays, dtype):
    return tuple(backend.asarray(a, dtype=dtype) for a in arrays)


@pytest.fixture(params=HALF_BACKENDS)
def half_backend(request):
    return _make_backend(request.param)


# rfa with positive and hyperbolic features and non-causal lara multiply half inputs in
# their dtype (the tests at the end of this module); every other estimator computes them
# in float32
HALF_PRODUCTS = ("rfa-positive", "rfa-hyperbolic", "lara", "lara-deterministic")


# (JAX: bfloat16 only; float16 inputs are cast to float32 by the same lines)
@pytest.mark.thin(dtype_name=("bfloat16",))
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", [name for name in ALL if name not in HALF_PRODUCTS])
def test_half_precision_is_computed_in_float32(half_backend, name, dtype_name):
    """Half inputs are computed in float32 and rounded once at the end.

    So the result equals the float32 result on the *same* (half-rounded) inputs, rounded
    to the half format: within one unit roundoff u of it (fp16 u = 2^-11, bf16 u = 2^-8,
    relative, plus u times the largest output for results near zero).
    """
    backend, half = half_backend, getattr(half_backend.ns, dtype_name)
    u = UNIT_ROUNDOFF[dtype_name]
    half_inputs = to_backend(backend, make_inputs(), half)
    with warnings.catch_warnings():  # the trigonometric map may clamp: the same rows in both
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        out = ALL[name](*half_inputs)
        single_inputs = (backend.ns.astype(a, backend.ns.float32) for a in half_inputs)
        single = backend.to_numpy(ALL[name](*single_inputs))
    assert out.dtype == half, out.dtype
    out = backend.to_numpy(out)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, single, rtol=u, atol=u * np.max(np.abs(single)))


@pytest.mark.parametrize("name", HALF_PRODUCTS)
def test_float16_is_computed_in_float32_where_bfloat16_multiplies_in_its_dtype(half_backend,
                                                                              name):
    """The calls that multiply bfloat16 inputs in their dtype compute float16 inputs in
    float32 (float16's exponent range cannot hold their features at large scores: guide
    05): the result is the float32 result on the same rounded inputs, rounded once."""
    backend, half = half_backend, half_backend.ns.float16
    u = UNIT_ROUNDOFF["float16"]
    half_inputs = to_backend(backend, make_inputs(), half)
    out = ALL[name](*half_inputs)
    single = backend.to_numpy(ALL[name](*(backend.ns.astype(a, backend.ns.float32)
                                          for a in half_inputs)))
    assert out.dtype == half, out.dtype
    np.testing.assert_allclose(backend.to_numpy(out), single, rtol=u,
                               atol=u * np.max(np.abs(single)))


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_precision_softmax_is_close_to_the_float32_result(half_backend, dtype_name):
    """Against float32 on the unrounded inputs, with the bound from the input rounding.

    Rounding q and k to the half format (unit roundoff u) moves each score s q.k by at
    most delta = s sum_i |q_i k_i| (2u + u^2); a softmax moves by at most 2 max|delta| in
    total variation (first order; the factor 1.1 covers the second order), so the output
    by 2 max|delta| max|v|. Rounding v adds u max|v|, rounding the output u max|y|.
    """
    backend, half, u = half_backend, getattr(half_backend.ns, dtype_name), UNIT_ROUNDOFF[dtype_name]
    q, k, v = make_inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = backend.to_numpy(xattn.softmax_attention(*to_backend(backend, (q, k, v), half)))
    exact = reference.softmax_attention(q, k, v)
    delta = scale * np.max(np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)) * (2 * u + u * u)
    max_v = np.max(np.abs(v))
    bound = 1.1 * 2 * delta * max_v + u * max_v + u * np.max(np.abs(exact)) + 1e-5
    assert np.max(np.abs(out - exact)) <= bound


def large_score_inputs(num_tokens=16, head_dim=8, score=80.0, seed=1):
    """Self-attention inputs (q = k) whose scaled scores s q.k reach ``score`` (the
    diagonal) and no more: rows of norm sqrt(score / s)."""
    data = np.random.default_rng(seed)
    directions = data.normal(size=(num_tokens, head_dim))
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
    x = directions * math.sqrt(score * math.sqrt(head_dim))
    v = data.normal(size=(num_tokens, 3))
    return x, x, v


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_scores_up_to_80_stay_finite_in_float32(backend, name):
    xp = backend.ns
    q, k, v = large_score_inputs()
    scores = (q @ k.T) / math.sqrt(q.shape[-1])
    assert math.isclose(scores.max(), 80.0)
    out = ESTIMATORS[name](*to_backend(backend, (q, k, v), xp.float32))
    assert out.dtype == xp.float32
    out = backend.to_numpy(out)
    assert np.all(np.isfinite(out)), out
    # every estimator here has non-negative weights: the output stays in the value range
    slack = 1e-4 * (np.max(v) - np.min(v))
    assert np.all(out >= v.min(axis=0) - slack) and np.all(out <= v.max(axis=0) + slack)
    if name == "softmax":
        backend.check(xattn.softmax_attention(*to_backend(backend, (q, k, v), xp.float32)),
                 reference.softmax_attention(q, k, v), dtype=xp.float32, rtol=1e-4)


def test_trigonometric_map_warns_instead_of_returning_inf(backend):
    """One key, one sample omega with omega.(q^ - k^) = pi: the estimated normalizer is
    w cos(pi) = -w < 0 for key weight w = e^{|k^|^2/2} = e^40 (score 80 = |k^|^2). The row
    is clamped (finite) and a TrigonometricDenominatorWarning is emitted (on Dask the
    warning may be left out: reading the flags computes the lazy graph; the clamp applies)."""
    xp = backend.ns
    key_norm = math.sqrt(80.0)
    q = np.array([[key_norm + math.pi]])
    k = np.array([[key_norm]])
    v = np.array([[2.0]])
    omega = backend.asarray(np.array([[1.0]]), dtype=xp.float32)
    inputs = to_backend(backend, (q, k, v), xp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = xattn.rfa(*inputs, omega=omega, feature_map="trigonometric", scale=1.0)
    assert np.all(np.isfinite(backend.to_numpy(out)))
    warned = any(issubclass(w.category, TrigonometricDenominatorWarning) for w in caught)
    if backend.name != "dask":
        assert warned


def test_trigonometric_map_with_scores_up_to_80_is_finite(backend):
    xp = backend.ns
    q, k, v = large_score_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        out = TRIGONOMETRIC["rfa-trigonometric"](*to_backend(backend, (q, k, v), xp.float32))
    assert np.all(np.isfinite(backend.to_numpy(out)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", list(ALL))
def test_check_finite_names_the_array(backend, name, bad):
    q, k, v = make_inputs(num_queries=4, num_keys=5)
    for position, array in enumerate("qkv"):
        arrays = [q.copy(), k.copy(), v.copy()]
        arrays[position][1, 2, 0] = bad
        with pytest.raises(ValueError, match=rf"^{array} contains NaN or infinity"):
            ALL[name](*map(backend.asarray, arrays), check_finite=True)


@pytest.mark.parametrize("name", list(ALL))
def test_unchecked_nan_never_becomes_a_finite_number(backend, name):
    """check_finite=False (default): a NaN query row gives a NaN row (only that row for
    the row-wise estimators, whose other rows are unchanged; every row for LARA, whose
    segment means mix the queries); a NaN key or value coordinate reaches every row."""
    q, k, v = make_inputs(num_queries=4, num_keys=5)
    estimator = ALL[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        clean = backend.to_numpy(estimator(*map(backend.asarray, (q, k, v))))
        bad_q = q.copy()
        bad_q[1, 2, 0] = math.nan
        out = backend.to_numpy(estimator(*map(backend.asarray, (bad_q, k, v))))
        finite_rows = np.all(np.isfinite(out), axis=-1)
        if name in ROW_WISE:
            expected_rows = np.ones_like(finite_rows)
            expected_rows[1, 2] = False
            np.testing.assert_array_equal(finite_rows, expected_rows)
            np.testing.assert_allclose(out[expected_rows], clean[expected_rows], rtol=1e-10)
        else:
            assert not np.any(finite_rows[1])
        for position in (1, 2):  # k, v
            arrays = [q, k.copy(), v.copy()]
            arrays[position][1, 3, 0] = math.nan
            out = backend.to_numpy(estimator(*map(backend.asarray, arrays)))
            # a NaN key reaches every coordinate, a NaN value coordinate its own coordinate
            reached = out[1] if position == 1 else out[1, :, 0]
            assert not np.any(np.isfinite(reached)), (position, out[1])
            np.testing.assert_allclose(out[0], clean[0], rtol=1e-10)  # the other batch entry


# JAX: float16, the narrower range (bfloat16 on torch; the computation is float32's)
@pytest.mark.thin(dtype_name=("float16",))
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_scores_up_to_80_stay_finite_in_half_precision(half_backend, dtype_name):
    """The same inputs in half precision: finite, in the input dtype, within the value
    range up to the roundings between the values and the output, each at most u of its
    result: the values' own (v rounded to the format), the key sums' numerator and
    denominator (a path that multiplies half operands rounds its sums to the format), the
    read-out product's numerator and denominator, and their ratio: 6 u max|v| (measured:
    at most 2.2 u max|v| over seeds 1 to 8, bfloat16 lara)."""
    backend, half, u = half_backend, getattr(half_backend.ns, dtype_name), UNIT_ROUNDOFF[dtype_name]
    q, k, v = large_score_inputs()
    for name, estimator in ESTIMATORS.items():
        out = estimator(*to_backend(backend, (q, k, v), half))
        assert out.dtype == half, (name, out.dtype)
        host = backend.to_numpy(out)
        assert np.all(np.isfinite(host)), name
        slack = 6 * u * np.max(np.abs(v))
        assert np.all(host >= v.min(axis=0) - slack) and np.all(host <= v.max(axis=0) + slack)


# causal rfa multiplies half-precision inputs in their own dtype ------------------------

# Relative (Frobenius) error of causal rfa on half inputs against float64 on the same
# float64 inputs and samples, (2, 256, 16), S = 32: measured on torch and JAX 8.7e-3
# (bfloat16) and 1.0e-3 to 1.2e-3 (float16), the inputs' own rounding included, while
# the estimator's own error against exact softmax on these inputs is 0.8 to 1. The
# bounds are the targets of the half-precision scan, 3 and 8 times the measured errors.
HALF_SCAN_BOUND = {"bfloat16": 3e-2, "float16": 1e-2}


# (JAX: the hyperbolic map only, the positive map's lines with samples +-omega)
@pytest.mark.thin(feature_map=("hyperbolic",))
@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_causal_rfa_multiplies_half_inputs_in_their_dtype(half_backend, dtype_name,
                                                           feature_map):
    """bfloat16: features and products in the input dtype, maxima and states in float32
    (float16: computed in float32): the result is in the input dtype, finite, and within
    :data:`HALF_SCAN_BOUND` of the float64 result with the same samples; a large later
    key and value leave every earlier row bit-identical."""
    backend, half = half_backend, getattr(half_backend.ns, dtype_name)
    data = np.random.default_rng(0)
    q, k, v = (data.normal(size=(2, 256, 16)) for _ in range(3))
    omega = data.normal(size=(32, 16))
    options = dict(causal=True, feature_map=feature_map)
    expected = xattn.rfa(q, k, v, omega=omega, **options)
    out = xattn.rfa(*to_backend(backend, (q, k, v), half),
                    omega=backend.asarray(omega, dtype=backend.ns.float32), **options)
    assert out.dtype == half, out.dtype
    out = backend.to_numpy(out).astype(np.float64)
    assert np.all(np.isfinite(out))
    error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert error <= HALF_SCAN_BOUND[dtype_name], error

    position = 150  # inside the third chunk of 64
    changed_k, changed_v = k.copy(), v.copy()
    changed_k[:, position] = omega[3] * 16 ** 0.25  # k_hat = omega_3: its largest logit
    changed_v[:, position] = 1e4
    changed = backend.to_numpy(xattn.rfa(
        *to_backend(backend, (q, changed_k, changed_v), half),
        omega=backend.asarray(omega, dtype=backend.ns.float32), **options)).astype(np.float64)
    np.testing.assert_array_equal(changed[:, :position], out[:, :position])


@pytest.mark.thin(feature_map=("hyperbolic",))
@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_rfa_multiplies_half_inputs_in_their_dtype(half_backend, dtype_name, feature_map):
    """Non-causal rfa on half inputs: bfloat16 features and products in the input dtype,
    maxima and the sums across key groups in float32 (float16 computed in float32), 1,100
    keys, against float64 with the same samples within :data:`HALF_SCAN_BOUND` (measured
    on torch and JAX 1.1e-2 to 1.3e-2 bfloat16; the estimator's own error against softmax
    is far larger); a query whose keys are all masked reads a zero row."""
    backend, half = half_backend, getattr(half_backend.ns, dtype_name)
    data = np.random.default_rng(1)
    q = data.normal(size=(2, 96, 16))
    k, v = data.normal(size=(2, 1100, 16)), data.normal(size=(2, 1100, 16))
    omega = data.normal(size=(32, 16))
    key_mask = np.ones((2, 1100), dtype=bool)
    key_mask[0] = False  # no key for the first batch element's queries
    key_mask[1, :500] = False
    expected = xattn.rfa(q, k, v, omega=omega, feature_map=feature_map, key_mask=key_mask)
    out = xattn.rfa(*to_backend(backend, (q, k, v), half),
                    omega=backend.asarray(omega, dtype=backend.ns.float32),
                    feature_map=feature_map, key_mask=backend.asarray(key_mask))
    assert out.dtype == half, out.dtype
    out = backend.to_numpy(out).astype(np.float64)
    assert not out[0].any()  # the masked rows
    error = np.linalg.norm(out[1] - expected[1]) / np.linalg.norm(expected[1])
    assert error <= HALF_SCAN_BOUND[dtype_name], error


@pytest.mark.thin(weighting=("balance",))
@pytest.mark.parametrize("weighting", ["decoupled", "balance"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_lara_multiplies_half_inputs_in_their_dtype(half_backend, dtype_name, weighting):
    """Non-causal lara on half inputs: features, affinities, weights and products in the
    input dtype for bfloat16 (float16: computed in float32); maxima, the sums across key
    groups and the softmax totals over queries in float32. 1,100 keys, with a key mask and a
    query mask, against float64 with the same samples (the same int ``rng``) within
    :data:`HALF_SCAN_BOUND`: measured on torch and JAX 1.4e-2 to 1.5e-2 bfloat16, 1.3e-3
    to 1.4e-3 float16, against an estimator's own error of 1.85 here (C = 8 samples).
    The samples differ only by the rounding of the segment means to the half format. A
    query whose keys are all masked reads a zero row, and so does a masked query."""
    backend, half = half_backend, getattr(half_backend.ns, dtype_name)
    data = np.random.default_rng(1)
    q = data.normal(size=(2, 300, 16))
    k, v = data.normal(size=(2, 1100, 16)), data.normal(size=(2, 1100, 16))
    key_mask = np.ones((2, 1100), dtype=bool)
    key_mask[0] = False  # no key for the first batch element's queries
    key_mask[1, :500] = False
    query_mask = np.ones((2, 300), dtype=bool)
    query_mask[1, :7] = False
    options = dict(num_samples=8, rng=0, weighting=weighting)
    expected = xattn.lara(q, k, v, key_mask=key_mask, query_mask=query_mask, **options)
    out = xattn.lara(*to_backend(backend, (q, k, v), half), key_mask=backend.asarray(key_mask),
                     query_mask=backend.asarray(query_mask), **options)
    assert out.dtype == half, out.dtype
    out = backend.to_numpy(out).astype(np.float64)
    assert np.all(np.isfinite(out))
    assert not out[0].any() and not out[1, :7].any()  # the masked rows
    error = np.linalg.norm(out[1] - expected[1]) / np.linalg.norm(expected[1])
    assert error <= HALF_SCAN_BOUND[dtype_name], error


# float16 at large scores ----------------------------------------------------------------

LARGE_SCORE_CALLS = {
    "rfa-causal": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega, causal=True),
    "rfa-causal-window": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega, causal=True,
                                                          window=16, sinks=1),
    "rfa": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega),
    "rfa-hyperbolic": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega,
                                                       feature_map="hyperbolic"),
    "lara-decoupled": lambda q, k, v, omega: xattn.lara(q, k, v, num_samples=16, rng=0),
    "lara-balance": lambda q, k, v, omega: xattn.lara(q, k, v, num_samples=16, rng=0,
                                                      weighting="balance"),
}


@pytest.mark.thin(name=("rfa", "lara-decoupled"))
@pytest.mark.parametrize("name", list(LARGE_SCORE_CALLS))
def test_float16_keeps_its_accuracy_at_large_scores(half_backend, name):
    """float16 q and k at 4 times a standard normal (D = 32: scaled projections
    :math:`\\omega_s \\cdot \\hat q_n` up to about 60): within :data:`HALF_SCAN_BOUND` of
    the float64 result with the same samples (for ``lara``, the same draws on the
    float16-rounded inputs, so that the segment means match). Before, the features of a
    shift shared by the samples underflowed float16's range (:math:`e^{-17}`) and the
    decoupled weights were clipped at float16's 6e-8 instead of 1e-8: here 0.16 to 0.64
    on torch and JAX (the window call 2e-3: its exact band dominates). Now float16 inputs
    are computed in float32 and rounded once: the error is the output's rounding, about
    5e-4 (guide 05's table, ``benchmarks/accuracy/bench_half_scores.py``)."""
    backend, half = half_backend, half_backend.ns.float16
    data = np.random.default_rng(3)
    q, k = (4.0 * data.normal(size=(2, 128, 32)) for _ in range(2))
    v = data.normal(size=(2, 128, 32))
    omega = data.normal(size=(32, 32))
    rounded = [np.asarray(backend.to_numpy(backend.asarray(x, dtype=half)), dtype=np.float64)
               for x in (q, k, v)]
    expected = LARGE_SCORE_CALLS[name](*rounded, omega)
    out = LARGE_SCORE_CALLS[name](*to_backend(backend, (q, k, v), half),
                                  backend.asarray(omega, dtype=backend.ns.float32))
    assert out.dtype == half, out.dtype
    out = backend.to_numpy(out).astype(np.float64)
    error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert error <= HALF_SCAN_BOUND["float16"], error


def _one_large_row(which, norm):
    """(2, 3, 70, 32) q, k, v (seed 5) with row 10 of q (``which`` 0) or k (1) in batch
    entry 1, head 2 scaled to ``norm``."""
    data = np.random.default_rng(5)
    arrays = [data.normal(size=(2, 3, 70, 32)) for _ in range(3)]
    arrays[which][1, 2, 10] *= norm / np.linalg.norm(arrays[which][1, 2, 10])
    return arrays


@pytest.mark.thin(weighting=("decoupled",))
@pytest.mark.parametrize("weighting", ["decoupled", "balance"])
@pytest.mark.parametrize("norm", [300.0, 1e4])
@pytest.mark.parametrize("which", [0, 1], ids=["query", "key"])
def test_bfloat16_lara_with_one_large_query_or_key(half_backend, which, norm, weighting):
    """One query of norm 300 or one key of norm 1e4 in a head: the segment holding it
    gives a sample whose offset K_c + l_c lies hundreds to millions below the others'.
    Before, the half path shifted every sample's key sums by one maximum, so that sample's
    sums (or all the others') underflowed: that head's output was 0 (the key) or wrong by
    2.8 (the query), with NaN gradients. Each head within :data:`HALF_SCAN_BOUND` of the
    float32 call on the same rounded inputs (measured 9.5e-3 at most, torch and JAX)."""
    backend = half_backend
    half = backend.ns.bfloat16
    arrays = [backend.asarray(x, dtype=half) for x in _one_large_row(which, norm)]
    options = dict(num_samples=8, rng=3, weighting=weighting)
    out = backend.to_numpy(backend.ns.astype(xattn.lara(*arrays, **options),
                                             backend.ns.float32)).astype(np.float64)
    expected = backend.to_numpy(xattn.lara(*(backend.ns.astype(x, backend.ns.float32)
                                             for x in arrays), **options)).astype(np.float64)
    error = (np.linalg.norm(out - expected, axis=(-2, -1))
             / np.linalg.norm(expected, axis=(-2, -1)))
    assert np.all(error <= HALF_SCAN_BOUND["bfloat16"]), error


@pytest.mark.parametrize("which", [0, 1], ids=["query", "key"])
def test_bfloat16_lara_gradients_with_one_large_query_or_key(which):
    """The gradients of the same calls (torch): finite for a query or key of norm 300
    and 1e4 (before: NaN in every row of that head), and at norm 300 within 3e-2 of
    float32's on the same rounded inputs, per input (measured 1.8e-2 at most)."""
    torch = pytest.importorskip("torch")
    for norm in (300.0, 1e4):
        gradients = {}
        for dtype in (torch.bfloat16, torch.float32):
            leaves = [torch.asarray(x, dtype=torch.bfloat16).to(dtype).requires_grad_()
                      for x in _one_large_row(which, norm)]
            xattn.lara(*leaves, num_samples=8, rng=3).float().sum().backward()
            gradients[dtype] = [leaf.grad.double().numpy() for leaf in leaves]
        for half, single in zip(gradients[torch.bfloat16], gradients[torch.float32],
                                strict=True):
            assert np.all(np.isfinite(half)), norm
            if norm == 300.0:
                error = np.linalg.norm(half - single) / np.linalg.norm(single)
                assert error <= 3e-2, error
