"""torch's single-pass forms of :mod:`xattn._core.delegation` (custom autograd functions
whose backward writes fewer arrays) against the portable Array API forms: the same
values, first derivatives and second derivatives (``create_graph``), in float64; the
forms taken under ``torch.compile``; and Dask's one-task form of ``nan_to_num``."""

from __future__ import annotations

import numpy as np
import pytest

from xattn._core.delegation import (
    nan_to_num,
    neighbour_scores,
    neighbour_sums,
    ratio_to_last_column,
    squared_norms,
)

torch = pytest.importorskip("torch")


def _sums(rng: np.random.Generator) -> torch.Tensor:
    """(2, 5, 4) read-out sums: numerators, then a positive denominator column, with one
    row without keys (all zero) whose ratio is 0 and whose denominator is below the
    floor (no gradient passes the clamp there)."""
    sums = rng.normal(size=(2, 5, 4))
    sums[..., -1] = rng.uniform(0.5, 2.0, size=(2, 5))
    sums[1, 2] = 0.0
    return torch.asarray(sums, dtype=torch.float64).requires_grad_()


def test_ratio_to_last_column_values_and_derivatives_equal_the_portable_form(rng):
    sums = _sums(rng)
    floor = 1e-300

    def portable(x: torch.Tensor) -> torch.Tensor:
        return x[..., :-1] / torch.clamp(x[..., -1:], min=floor)

    out = ratio_to_last_column(sums, floor)
    assert type(out.grad_fn).__name__ == "RatioToLastColumnBackward"  # the custom form
    np.testing.assert_array_equal(out.detach().numpy(), portable(sums).detach().numpy())
    assert not out[1, 2].detach().any()  # a row without keys reads 0
    weights = torch.asarray(rng.normal(size=out.shape), dtype=torch.float64)
    (grad,) = torch.autograd.grad((weights * out).sum(), sums)
    (expected,) = torch.autograd.grad((weights * portable(sums)).sum(), sums)
    np.testing.assert_allclose(grad.numpy(), expected.numpy(), rtol=1e-14, atol=0)
    assert not grad[1, 2, -1]  # the clamped denominator passes no gradient
    # second derivatives away from the clamp's kink (finite differences cannot cross it)
    keyed = sums.detach()[0].clone().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x: ratio_to_last_column(x, floor), (keyed,))


def test_nan_to_num_derivatives_are_zero_at_the_replaced_entries(rng):
    x = torch.asarray(rng.normal(size=(3, 4)), dtype=torch.float64)
    x[0, 1], x[2, 3] = float("nan"), float("inf")
    x.requires_grad_()
    out = nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    assert type(out.grad_fn).__name__ == "NanToNumBackward"  # the custom form
    (grad,) = torch.autograd.grad((out * out).sum(), x)
    expected = 2 * torch.nan_to_num(x.detach(), nan=0.0, posinf=0.0)
    np.testing.assert_array_equal(grad.numpy(), expected.numpy())
    finite = torch.asarray(rng.normal(size=(3, 4)), dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradgradcheck(
        lambda y: nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0) ** 2, (finite,))


def _dense_neighbour_sums(queries, keys, values, neighbours, biases, period, base):
    """float64 NumPy: ``base + sum_d exp(q_c . k_{c+d} + bias_d) v_{c+d}`` over the
    neighbours ``c + d`` of chunk ``c`` in the same sequence of ``period`` chunks, one
    chunk at a time (no slices, no shift)."""
    queries, keys, values = (np.asarray(x.detach(), dtype=np.float64)
                             for x in (queries, keys, values))
    out = base.detach().numpy().copy()
    for chunk in range(queries.shape[0]):
        for neighbour, bias in zip(neighbours, biases, strict=True):
            other = chunk + neighbour
            if not 0 <= other < queries.shape[0] or other // period != chunk // period:
                continue
            scores = queries[chunk] @ keys[other].T
            if bias is not None:
                scores = scores + np.asarray(bias)
            out[chunk] += np.exp(scores) @ values[other]
    return out


def test_nan_to_num_on_dask_is_one_layer_of_one_task_per_chunk():
    """Dask: NumPy's values in every chunk (a NaN and both infinities, in three chunks),
    lazily, with one new graph layer (the portable ``where`` form built six)."""
    da = pytest.importorskip("dask.array")
    values = np.arange(24.0).reshape(4, 6)
    values[0, 1], values[2, 4], values[3, 0] = np.nan, np.inf, -np.inf
    x = da.from_array(values, chunks=(2, 3))
    out = nan_to_num(x, nan=0.5, posinf=7.0, neginf=-7.0)
    assert len(out.dask.layers) == len(x.dask.layers) + 1
    assert out.chunks == x.chunks and out.dtype == x.dtype
    np.testing.assert_array_equal(out.compute(),
                                  np.nan_to_num(values, nan=0.5, posinf=7.0, neginf=-7.0))


@pytest.mark.parametrize("neighbours", [(0, -1), (0, -1, 1)])
def test_neighbour_products_equal_chunk_by_chunk_sums_with_derivatives(rng, neighbours):
    """The band's (chunk, neighbour) products: scores with their static band bias, and
    the sums of ``exp(score) [v]`` added to a base, equal the chunk-by-chunk sums; no pair
    crosses from one sequence (``period`` chunks) to the next; first and second
    derivatives equal finite differences (the custom backward adds rows in place)."""
    size, period = 3, 4
    chunks = 2 * period  # two sequences
    def tensor(*shape):
        return torch.asarray(rng.normal(size=shape) * 0.5,
                             dtype=torch.float64).requires_grad_()

    queries, keys, values, base = (tensor(chunks, size, 2), tensor(chunks, size, 2),
                                   tensor(chunks, size, 3), tensor(chunks, size, 3))
    band = torch.asarray(np.triu(np.full((size, size), -np.inf), 1), dtype=torch.float64)
    biases = (band, None, None)[:len(neighbours)]

    def sums(q, k, v, b):
        scores = neighbour_scores(q, k, neighbours, biases, period)
        return neighbour_sums(tuple(torch.exp(piece) for piece in scores), v, neighbours, b)

    out = sums(queries, keys, values, base)
    assert type(out.grad_fn).__name__ == "NeighbourSumsBackward"  # the custom forms
    expected = _dense_neighbour_sums(queries, keys, values, neighbours, biases, period, base)
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-13, atol=0)
    with torch.no_grad():  # the portable form, as every other library runs it
        np.testing.assert_allclose(sums(queries, keys, values, base).numpy(), expected,
                                   rtol=1e-13, atol=0)
    # a huge key at the end of the first sequence overflows its own pairs only
    huge = keys.detach().clone()
    huge[period - 1] = 1e308  # scores of +-inf, or NaN, in its own sequence
    with torch.no_grad():
        crossed = sums(queries, huge, values, base)
    np.testing.assert_array_equal(crossed[period:].numpy(), out[period:].detach().numpy())
    inputs = (queries, keys, values, base)
    assert torch.autograd.gradcheck(sums, inputs)
    assert torch.autograd.gradgradcheck(sums, inputs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("factor", [1.0, -0.0625])
def test_squared_norms_eager_and_compiled_equal_the_float64_sums(rng, dtype, factor):
    """``factor * sum(x**2)`` per row in ``dtype=float32``: torch eagerly (a norm, squared),
    under ``torch.compile`` (one reduction of ``factor * x**2``) and NumPy, against float64,
    values and (torch) gradients; a zero row's gradient is 0 on both torch paths."""
    x64 = rng.normal(size=(2, 3, 7, 16))
    x64[1, 2, 4] = 0.0
    x = torch.asarray(x64, dtype=getattr(torch, dtype))
    exact = factor * np.sum(np.asarray(x.double()) ** 2, axis=-1, keepdims=True)
    weights = torch.asarray(rng.normal(size=exact.shape), dtype=torch.float32)
    compiled = torch.compile(lambda rows: squared_norms(rows, dtype=torch.float32,
                                                        factor=factor),
                             backend="aot_eager", fullgraph=True)
    for form in (lambda rows: squared_norms(rows, dtype=torch.float32, factor=factor),
                 compiled):
        leaf = x.clone().requires_grad_()
        out = form(leaf)
        assert out.dtype == torch.float32 and out.shape == (2, 3, 7, 1)
        np.testing.assert_allclose(out.detach().numpy(), exact, rtol=1e-6, atol=1e-6)
        (grad,) = torch.autograd.grad((weights * out).sum(), leaf)
        expected = 2 * factor * np.asarray(x.double()) * weights.double().numpy()
        # the gradient is rounded to the input's dtype (bfloat16: 8 bits)
        rtol = 1e-6 if dtype == "float32" else 2 ** -7
        np.testing.assert_allclose(grad.double().numpy(), expected, rtol=rtol, atol=1e-6)
        assert not grad[1, 2, 4].any()
    np.testing.assert_allclose(squared_norms(x64, factor=factor), factor * np.sum(
        x64 ** 2, axis=-1, keepdims=True), rtol=1e-14)
