r"""Randomized mappings of the exponential kernel and their stabilized statistics.

The positive randomized mapping (DESIGN §3) is

.. math:: \xi(x, \omega) = \exp(\omega \cdot x - \lVert x \rVert^2 / 2),
   \qquad \mathbb{E}_{\omega \sim N(0, I)}[\xi(x, \omega)\, \xi(y, \omega)] = \exp(x \cdot y).

Estimators that use it (RFA, LARA) work with its logarithm and two stabilizers, one per
side, that cancel exactly in the ratio of numerator and denominator:

* key side: :func:`positive_key_statistics` gives, per sample ``s``,
  :math:`K_s = \max_m a_{ms}`, :math:`A'_s = \sum_m e^{a_{ms} - K_s} v_m` and
  :math:`b'_s = \sum_m e^{a_{ms} - K_s}` with :math:`a_{ms} = \omega_s \cdot \hat k_m -
  \lVert \hat k_m \rVert^2 / 2`;
* query side: :func:`weighted_readout` takes logits :math:`c_{ns}` (for RFA,
  :math:`\omega_s \cdot \hat q_n + K_s`), subtracts :math:`Q_n = \max_s c_{ns}` and forms
  :math:`y_n = \sum_s e^{c_{ns} - Q_n} A'_s / \sum_s e^{c_{ns} - Q_n} b'_s`.

No epsilon enters an exponent, so the result equals the unstabilized formula exactly
(up to rounding) wherever that one is finite.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "log_positive_features",
    "positive_key_statistics",
    "weighted_readout",
]

Array = Any


def log_positive_features(xp: Any, x: Array, omega: Array) -> Array:
    r"""Logarithm of the positive randomized mapping, :math:`\omega_s \cdot x - \lVert x \rVert^2/2`.

    Parameters
    ----------
    xp : namespace
        Array API namespace of ``x`` and ``omega``.
    x : array, shape (..., L, D)
        Points (already scaled, :math:`\hat q` or :math:`\hat k`).
    omega : array, shape (..., S, D)
        Samples :math:`\omega_s` as rows; leading dims broadcast against ``x``.

    Returns
    -------
    array, shape (..., L, S)
    """
    half_sq_norm = 0.5 * xp.sum(x * x, axis=-1, keepdims=True)
    return x @ xp.matrix_transpose(omega) - half_sq_norm


def positive_key_statistics(
    xp: Any, k_hat: Array, v: Array, omega: Array, key_mask: Array | None = None
) -> tuple[Array, Array, Array]:
    r"""Stabilized key-side sums of the positive mapping (DESIGN §3, RFA).

    .. math::

        a_{ms} = \omega_s \cdot \hat k_m - \lVert \hat k_m \rVert^2 / 2, \quad
        K_s = \max_m a_{ms}, \quad
        A'_s = \sum_m e^{a_{ms} - K_s} v_m, \quad b'_s = \sum_m e^{a_{ms} - K_s}

    over the keys allowed by ``key_mask``. A sample with no allowed key gets
    :math:`K_s = 0`, :math:`A'_s = 0`, :math:`b'_s = 0`.

    Parameters
    ----------
    xp : namespace
    k_hat : array, shape (..., M, D)
        Scaled keys :math:`\hat k = \sqrt{s}\, k`.
    v : array, shape (..., M, Dv)
        Values.
    omega : array, shape (..., S, D)
        Samples as rows (shared ``(S, D)`` or per batch ``(..., S, D)``).
    key_mask : bool array, shape (..., M), optional
        True where the key takes part.

    Returns
    -------
    key_max : array, shape (..., S)
        :math:`K_s`.
    numerator : array, shape (..., S, Dv)
        :math:`A'_s`.
    denominator : array, shape (..., S)
        :math:`b'_s`.
    """
    logits = log_positive_features(xp, k_hat, omega)  # (..., M, S)
    if key_mask is not None:
        logits = xp.where(key_mask[..., :, None], logits, -xp.inf)
    key_max = xp.max(logits, axis=-2)  # (..., S)
    key_max = xp.where(key_max == -xp.inf, xp.zeros_like(key_max), key_max)
    weights = xp.exp(logits - key_max[..., None, :])  # masked keys: exp(-inf) = 0
    numerator = xp.matrix_transpose(weights) @ v
    denominator = xp.sum(weights, axis=-2)
    return key_max, numerator, denominator


def weighted_readout(
    xp: Any,
    logits: Array,
    numerator: Array,
    denominator: Array,
    coefficients: Array | None = None,
) -> Array:
    r"""Query-side ratio :math:`\sum_s u_{ns} A'_s / \sum_s u_{ns} b'_s`, stabilized.

    .. math::

        Q_n = \max_s c_{ns}, \quad u_{ns} = \alpha_{ns}\, e^{c_{ns} - Q_n}, \quad
        y_n = \frac{\sum_s u_{ns} A'_s}{\sum_s u_{ns} b'_s}

    The shift :math:`Q_n` cancels between numerator and denominator. Rows whose
    denominator is zero (no allowed key) are returned as zeros, never NaN.

    Parameters
    ----------
    xp : namespace
    logits : array, shape (..., N, S)
        :math:`c_{ns}` (must be finite).
    numerator : array, shape (..., S, Dv)
        :math:`A'_s` from :func:`positive_key_statistics`.
    denominator : array, shape (..., S)
        :math:`b'_s`.
    coefficients : array, shape (..., N, S), optional
        Non-negative :math:`\alpha_{ns}` (LARA's importance weights); 1 if omitted.

    Returns
    -------
    array, shape (..., N, Dv)
    """
    query_max = xp.max(logits, axis=-1, keepdims=True)
    weights = xp.exp(logits - query_max)
    if coefficients is not None:
        weights = coefficients * weights
    out_numerator = weights @ numerator
    out_denominator = weights @ denominator[..., None]
    safe = xp.where(out_denominator > 0, out_denominator, xp.ones_like(out_denominator))
    return out_numerator / safe
