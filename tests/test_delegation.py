"""torch's single-pass forms of :mod:`xattn._core.delegation` (custom autograd functions
whose backward writes fewer arrays) against the portable Array API forms: the same
values, first derivatives and second derivatives (``create_graph``), in float64."""

from __future__ import annotations

import numpy as np
import pytest

from xattn._core.delegation import nan_to_num, ratio_to_last_column

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
