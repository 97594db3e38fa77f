"""Empirical bias/variance/MSE over draws, the uniform baseline and the closed-form kernel MSE."""

from __future__ import annotations

import numpy as np
import pytest

import xattn
from xattn.diagnostics import (
    check_attention_inputs,
    draw_seeds,
    estimator_error,
    kernel_mse_positive,
    structured_attention_inputs,
    uniform_attention,
)

import reference


def make_qkv(rng, batch=(2,), num_queries=12, num_keys=10, head_dim=6, value_dim=5):
    q = rng.normal(size=(*batch, num_queries, head_dim))
    k = rng.normal(size=(*batch, num_keys, head_dim))
    v = rng.normal(size=(*batch, num_keys, value_dim))
    return q, k, v


def test_exact_softmax_has_zero_error(backend, rng):
    arrays = tuple(map(backend.asarray, make_qkv(rng)))
    error = estimator_error(xattn.softmax_attention, *arrays, draws=2, rng_keyword=None)
    assert (error.bias_squared, error.variance, error.mse, error.relative_error) == (0, 0, 0, 0)
    assert error.draws == 2 and error.seeds is None


def test_constant_offset_is_pure_bias(backend, rng):
    arrays = tuple(map(backend.asarray, make_qkv(rng)))

    def shifted(q, k, v, *, rng):
        return xattn.softmax_attention(q, k, v) + 0.25

    error = estimator_error(shifted, *arrays, draws=3, seed=4)
    assert error.bias_squared == pytest.approx(0.0625, rel=1e-10)
    assert error.variance == pytest.approx(0.0, abs=1e-14)
    assert error.mse == pytest.approx(0.0625, rel=1e-10)
    assert error.seeds == range(4, 7)
    assert error.as_dict()["seeds"] == {"first": 4, "last": 6}


def test_matches_float64_reference_of_the_same_draws(backend, rng):
    """Seeded noise: the running (Welford) sums equal the textbook formulas on stored draws."""
    q, k, v = make_qkv(rng)
    exact = reference.softmax_attention(q, k, v)
    seen_seeds = []

    def noisy(q, k, v, *, rng, amplitude):
        seen_seeds.append(rng)
        noise = np.random.default_rng(rng).normal(size=exact.shape) + 0.3
        return xattn.softmax_attention(q, k, v) + backend.asarray(amplitude * noise)

    error = estimator_error(noisy, *map(backend.asarray, (q, k, v)), draws=5, seed=11,
                            amplitude=0.1)
    assert seen_seeds == [11, 12, 13, 14, 15] == list(draw_seeds(11, 5))
    outputs = np.stack([exact + 0.1 * (np.random.default_rng(s).normal(size=exact.shape) + 0.3)
                        for s in range(11, 16)])
    mean = outputs.mean(axis=0)
    expected_bias2 = np.mean((mean - exact) ** 2)
    expected_variance = np.mean(outputs.var(axis=0))
    expected_mse = np.mean((outputs - exact) ** 2)
    assert error.bias_squared == pytest.approx(expected_bias2, rel=1e-9)
    assert error.variance == pytest.approx(expected_variance, rel=1e-9)
    assert error.mse == pytest.approx(expected_mse, rel=1e-9)
    assert error.relative_error == pytest.approx(np.sqrt(expected_mse / np.mean(exact**2)),
                                                 rel=1e-9)


def test_int_seed_gives_the_same_figures_on_every_backend(backend, rng):
    q, k, v = make_qkv(rng)
    on_numpy = estimator_error(xattn.rfa, q, k, v, draws=3, seed=2, num_features=8)
    on_backend = estimator_error(xattn.rfa, *map(backend.asarray, (q, k, v)), draws=3, seed=2,
                                 num_features=8)
    assert on_numpy.mse > 0
    for field in ("bias_squared", "variance", "mse", "relative_error"):
        assert getattr(on_backend, field) == pytest.approx(getattr(on_numpy, field), rel=1e-8)


@pytest.mark.parametrize("spoilt_draw", [1, 2])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_outputs_give_non_finite_figures_without_warnings(backend, rng, value,
                                                                     spoilt_draw):
    """One draw with an inf (or NaN) output element: the figures are not finite, and the
    running sums raise no floating-point warning (inf - inf in later draws)."""
    import warnings

    arrays = tuple(map(backend.asarray, make_qkv(rng)))
    marker = backend.asarray(np.where(np.arange(5) == 2, value, 0.0))  # one column spoilt
    calls = []

    def spoilt(q, k, v, *, rng):
        calls.append(rng)
        out = xattn.softmax_attention(q, k, v)
        if len(calls) >= spoilt_draw:  # from this draw on
            out = out + marker
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        error = estimator_error(spoilt, *arrays, draws=3, seed=0)
    assert not np.isfinite(error.mse) and not np.isfinite(error.relative_error)


def test_generator_draws_continue_one_stream(rng):
    q, k, v = make_qkv(rng)
    error = estimator_error(xattn.rfa, q, k, v, draws=4, rng=xattn.random.default_rng(0),
                            num_features=4)
    assert error.seeds is None
    assert error.variance > 0  # the draws differ: the generator advances between calls


def test_options_reach_the_exact_reference(rng):
    q, k, v = make_qkv(rng, num_queries=8, num_keys=8)
    key_mask = np.arange(8) < 5
    error = estimator_error(xattn.softmax_attention, q, k, v, draws=1, rng_keyword=None,
                            key_mask=key_mask, causal=True, scale=0.3)
    assert error.mse == 0.0



@pytest.mark.parametrize("mask_seed", range(4))
def test_query_mask_scores_only_the_valid_rows(backend, rng, mask_seed):
    """With a query_mask, the figures are those of the valid rows alone, whatever the
    estimator puts in the masked rows (zeros as LARA, huge values, NaN)."""
    q, k, v = make_qkv(rng)
    mask_rng = np.random.default_rng(mask_seed)
    query_mask = mask_rng.random((2, 12)) < 0.5
    query_mask[:, mask_rng.integers(12)] = True  # at least one valid row per batch
    exact = reference.softmax_attention(q, k, v)
    garbage = {0: 0.0, 1: 1e6, 2: np.nan, 3: -3.0}[mask_seed]

    def masked_noisy(q, k, v, *, rng, query_mask):
        noise = 0.1 * np.random.default_rng(rng).normal(size=exact.shape) + 0.05
        out = np.where(backend.to_numpy(query_mask)[..., None], exact + noise, garbage)
        return backend.asarray(out)

    error = estimator_error(masked_noisy, *map(backend.asarray, (q, k, v)), draws=4, seed=3,
                            query_mask=backend.asarray(query_mask))
    valid = np.broadcast_to(query_mask[..., None], exact.shape)
    outputs = np.stack([exact + 0.1 * np.random.default_rng(s).normal(size=exact.shape) + 0.05
                        for s in (3, 4, 5, 6)])[:, valid]
    reference_rows = exact[valid]
    assert error.bias_squared == pytest.approx(
        np.mean((outputs.mean(axis=0) - reference_rows) ** 2), rel=1e-9)
    assert error.variance == pytest.approx(np.mean(outputs.var(axis=0)), rel=1e-9)
    expected_mse = np.mean((outputs - reference_rows) ** 2)
    assert error.mse == pytest.approx(expected_mse, rel=1e-9)
    assert error.relative_error == pytest.approx(
        np.sqrt(expected_mse / np.mean(reference_rows**2)), rel=1e-9)


@pytest.mark.thin(mask_seed=(0,))  # JAX, Dask: one mask (the others: the same lines)
@pytest.mark.parametrize("mask_seed", range(3))
def test_lara_query_mask_error_equals_the_error_on_the_valid_queries(backend, rng, mask_seed):
    """LARA with masked queries equals LARA on the valid queries alone (segments are
    built over the valid queries), so the errors must agree."""
    q, k, v = make_qkv(rng)
    query_mask = np.random.default_rng(mask_seed).random(12) < 0.6
    query_mask[0] = True
    masked = estimator_error(xattn.lara, *map(backend.asarray, (q, k, v)), draws=3, seed=1,
                             num_samples=3, query_mask=backend.asarray(query_mask))
    valid_only = estimator_error(xattn.lara, *map(backend.asarray, (q[:, query_mask], k, v)),
                                 draws=3, seed=1, num_samples=3)
    for field in ("bias_squared", "variance", "mse", "relative_error"):
        assert getattr(masked, field) == pytest.approx(getattr(valid_only, field), rel=1e-6)


def test_query_mask_errors(rng):
    q, k, v = make_qkv(rng)
    with pytest.raises(ValueError, match="selects no query"):
        estimator_error(xattn.lara, q, k, v, draws=1, num_samples=2,
                        query_mask=np.zeros(12, dtype=bool))
    with pytest.raises(TypeError, match="query_mask must be a bool array"):
        estimator_error(lambda q, k, v, rng, query_mask: xattn.softmax_attention(q, k, v),
                        q, k, v, draws=1, query_mask=np.ones(12))


def test_structured_attention_inputs_are_deterministic_and_sharp():
    """Same arrays on every call; each query's attention concentrates on its cluster."""
    first = structured_attention_inputs(num_heads=2, length=64, head_dim=16, seed=3)
    second = structured_attention_inputs(num_heads=2, length=64, head_dim=16, seed=3)
    for a, b in zip(first, second, strict=True):
        assert a.shape == (2, 64, 16) and a.dtype == np.float64
        np.testing.assert_array_equal(a, b)
    q, k, _ = first
    scores = q @ np.swapaxes(k, -1, -2) / 4.0
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    # uniform attention would put 1/64 on each key; sharp attention puts most mass on few
    assert np.median(weights.max(axis=-1)) > 0.1

def test_bad_arguments():
    q = np.zeros((4, 3))
    with pytest.raises(ValueError, match="draws must be >= 1"):
        estimator_error(xattn.rfa, q, q, q, draws=0)
    with pytest.raises(TypeError, match="estimator must be callable"):
        estimator_error("rfa", q, q, q)
    with pytest.raises(ValueError, match="returned shape"):
        estimator_error(lambda q, k, v, rng: q[:2], q, q, q, draws=1)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        draw_seeds(-1, 2)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        draw_seeds(np.int64(-1), 2)
    with pytest.raises(ValueError, match="same D"):
        kernel_mse_positive(np.zeros(3), np.zeros(4), num_features=2)
    with pytest.raises(ValueError, match="num_features must be >= 1"):
        kernel_mse_positive(np.zeros(3), np.zeros(3), num_features=0)


@pytest.mark.parametrize("seed", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_draw_seeds_takes_python_and_numpy_integers(seed):
    seeds = draw_seeds(seed, np.int64(4))
    assert list(seeds) == [3, 4, 5, 6]
    assert all(type(value) is int for value in seeds)  # plain ints, JSON-ready
    q = np.zeros((3, 2))
    error = estimator_error(lambda q, k, v, rng: q, q, q, q, draws=2, seed=seed)
    assert error.seeds == range(3, 5) and error.as_dict()["seeds"] == {"first": 3, "last": 4}


@pytest.mark.parametrize("seed", [3.0, "3", None, True, np.True_, np.float64(3.0),
                                  np.array([3])])
def test_draw_seeds_rejects_a_non_integer_seed_with_a_type_error(seed):
    with pytest.raises(TypeError, match="seed must be a non-negative int"):
        draw_seeds(seed, 2)


def test_many_draws_hold_no_sequence_of_every_seed(rng):
    """Ten million draws: the seeds are a range (constant size), estimator_error walks it
    without listing it (a list of them would take hundreds of MiB), and the JSON-ready
    dict summarizes it (first, last)."""
    import sys
    import tracemalloc

    many = 10**7
    seeds = draw_seeds(5, many)
    assert len(seeds) == many and seeds[0] == 5 and seeds[-1] == 5 + many - 1
    assert sys.getsizeof(seeds) < 1000

    q, k, v = make_qkv(rng, num_queries=2, num_keys=2, head_dim=2, value_dim=1)
    calls = []

    class Stop(Exception):
        pass

    def estimator(q, k, v, *, rng):
        calls.append(rng)
        if len(calls) == 3:
            raise Stop
        return xattn.softmax_attention(q, k, v)

    with pytest.raises(Stop):  # warm-up: first-call caches are not what is measured
        estimator_error(estimator, q, k, v, draws=3, seed=5)
    calls.clear()
    tracemalloc.start()
    try:
        with pytest.raises(Stop):  # the third draw stops the run; its start costs nothing
            estimator_error(estimator, q, k, v, draws=many, seed=5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert calls == [5, 6, 7]
    assert peak < 2**20  # a list of the seeds would take hundreds of MiB

    summary = estimator_error(lambda q, k, v, rng: xattn.softmax_attention(q, k, v), q, k, v,
                              draws=3, seed=5).as_dict()
    assert summary["seeds"] == {"first": 5, "last": 7} and summary["draws"] == 3
    no_seeds = estimator_error(xattn.softmax_attention, q, k, v, draws=2, rng_keyword=None)
    assert no_seeds.as_dict()["seeds"] is None


def test_uniform_attention(backend, rng):
    xp = backend.ns
    q, k, v = make_qkv(rng)
    key_mask = rng.random((2, 10)) < 0.5
    key_mask[1] = False  # batch 1 has no key: zero rows
    out = uniform_attention(*map(backend.asarray, (q, k, v)), key_mask=backend.asarray(key_mask))
    weights = key_mask[..., None].astype(float)
    mean = (weights * v).sum(axis=-2, keepdims=True) / np.maximum(weights.sum(axis=-2,
                                                                            keepdims=True), 1)
    expected = np.broadcast_to(mean, (2, 12, 5))
    assert np.all(expected[1] == 0)
    backend.check(out, expected, dtype=xp.float64)
    backend.check(uniform_attention(*map(backend.asarray, (q, k, v))),
             np.broadcast_to(v.mean(axis=-2, keepdims=True), (2, 12, 5)), dtype=xp.float64)


def test_check_attention_inputs_refuses_what_the_estimators_refuse(backend, rng):
    q, k, v = map(backend.asarray, make_qkv(rng))
    assert check_attention_inputs(q, k, v, key_mask=backend.asarray(np.ones((2, 10), bool))) \
        is None
    for name, kwargs in [("key_mask", {"key_mask": backend.asarray(np.ones((2, 3), bool))}),
                         ("query_mask", {"query_mask": backend.asarray(np.ones((2, 5), bool))})]:
        with pytest.raises(ValueError, match=name):
            check_attention_inputs(q, k, v, **kwargs)
        with pytest.raises(ValueError, match=name):
            xattn.lara(q, k, v, num_samples=2, rng=0, **kwargs)
    with pytest.raises(ValueError, match="same last dim"):
        check_attention_inputs(q, k[..., :3], v)


def test_kernel_mse_formula(backend, rng):
    xp = backend.ns
    x = 0.4 * rng.normal(size=(3, 5))
    y = 0.4 * rng.normal(size=(3, 5))
    expected = np.exp(2 * np.sum(x * y, -1)) * (np.exp(np.sum((x + y) ** 2, -1)) - 1) / 16
    out = kernel_mse_positive(backend.asarray(x), backend.asarray(y), num_features=16)
    backend.check(out, expected, dtype=xp.float64)


def test_kernel_mse_matches_monte_carlo(rng):
    """Empirical MSE of the S-sample positive-feature estimate over R repetitions.

    The tolerance is 4 standard errors of the mean of the R squared errors.
    """
    x = np.array([0.3, -0.2, 0.5, 0.1])
    y = np.array([0.2, 0.4, 0.1, -0.3])
    num_features, repetitions = 8, 40_000
    omega = np.random.default_rng(3).normal(size=(repetitions, num_features, 4))
    features = np.exp(omega @ x - x @ x / 2) * np.exp(omega @ y - y @ y / 2)
    squared_errors = (features.mean(axis=1) - np.exp(x @ y)) ** 2
    standard_error = squared_errors.std(ddof=1) / np.sqrt(repetitions)
    closed_form = float(kernel_mse_positive(x, y, num_features=num_features))
    assert abs(squared_errors.mean() - closed_form) < 4 * standard_error
    assert standard_error < 0.05 * closed_form  # the test has the power to see a wrong formula
