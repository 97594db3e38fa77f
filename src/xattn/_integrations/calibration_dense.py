r"""The outputs of :func:`xattn.rfa` in a dense form, for the fit of
:func:`xattn.calibrate_omega` on short sequences.

For query :math:`n` the keys split into the exact set :math:`E_n` (the band
:math:`|n - m| \le w` and the sinks :math:`m < K`, as in
:mod:`xattn._estimators.window`) and the rest :math:`R_n`; with the positive features
:math:`\hat\kappa(\hat q, \hat k) = \frac1S \sum_s e^{\omega_s \cdot \hat q - \lVert \hat q
\rVert^2/2} e^{\omega_s \cdot \hat k - \lVert \hat k \rVert^2/2}`,

.. math::

    y_n = \sum_m \operatorname{softmax}_m(\ell_{nm})\, v_m, \qquad
    \ell_{nm} = \begin{cases} \hat q_n \cdot \hat k_m & m \in E_n \\
                \log \hat\kappa(\hat q_n, \hat k_m) & m \in R_n \end{cases}

over the allowed keys: the same outputs as ``rfa``'s linear-cost evaluation, formed as an
``(N, M)`` array of logits, which for a few hundred positions is several times faster to
differentiate than the scan and band machinery that keeps ``rfa`` linear (the fit's
inner loop). :math:`\log \hat\kappa` is evaluated stably: with :math:`c_n = \max_s
\omega_s \cdot \hat q_n` and :math:`d_m = \max_s (\omega_s \cdot \hat k_m - \lVert \hat
k_m \rVert^2/2)`, :math:`\log\hat\kappa = c_n + d_m - \lVert \hat q_n \rVert^2/2 - \log
S + \log \sum_s e^{\omega_s \cdot \hat q_n - c_n} e^{\omega_s \cdot \hat k_m - \lVert
\hat k_m\rVert^2/2 - d_m}`. The hyperbolic map is the positive one with the samples
:math:`\omega` and :math:`-\omega`. The trigonometric map's estimate can be negative
and has no logarithm: its fit calls ``rfa`` itself.
"""

from __future__ import annotations

import math
from typing import Any

from array_api_compat import device as array_device

from xattn._core.array import array_namespace

__all__ = ["DENSE_FEATURE_MAPS", "DENSE_MAX_PAIRS", "dense_rfa"]

#: The feature maps that have a dense form.
DENSE_FEATURE_MAPS = ("positive", "hyperbolic")
#: Query-key pairs per sequence up to which the fit uses the dense form.
DENSE_MAX_PAIRS = 512 * 512


def dense_rfa(q: Any, k: Any, v: Any, omega: Any, *, key_mask: Any, feature_map: str,
              window: int | None, sinks: int | None, causal: bool, scale: float) -> Any:
    """``rfa(q, k, v, omega=omega, ...)`` formed densely (see the module)."""
    xp = array_namespace(q)
    if feature_map == "hyperbolic":
        omega = xp.concat([omega, -omega], axis=-2)
    root = math.sqrt(scale)
    q, k = q * root, k * root
    n, m = q.shape[-2], k.shape[-2]
    device = array_device(q)
    omega_t = xp.matrix_transpose(omega)
    query_logits = q @ omega_t  # (..., N, S)
    key_logits = k @ omega_t - xp.sum(k * k, axis=-1, keepdims=True) / 2  # (..., M, S)
    c = xp.max(query_logits, axis=-1, keepdims=True)
    d = xp.max(key_logits, axis=-1, keepdims=True)
    products = xp.exp(query_logits - c) @ xp.matrix_transpose(xp.exp(key_logits - d))
    tiny = xp.finfo(q.dtype).smallest_normal
    features = (c - xp.sum(q * q, axis=-1, keepdims=True) / 2 + xp.matrix_transpose(d)
                - math.log(omega.shape[-2]) + xp.log(xp.maximum(products, tiny)))
    rows = xp.arange(n, device=device)[:, None]
    cols = xp.arange(m, device=device)[None, :]
    logits = features
    if window or sinks:  # the exact band and sinks
        in_exact = xp.zeros((n, m), dtype=xp.bool, device=device)
        if window:
            in_exact = in_exact | (xp.abs(rows - cols) <= window)
        if sinks:
            in_exact = in_exact | (cols < sinks)
        logits = xp.where(in_exact, q @ xp.matrix_transpose(k), features)
    allowed = None
    if causal:
        allowed = cols <= rows
    if key_mask is not None:
        allowed = key_mask[..., None, :] if allowed is None else allowed & key_mask[..., None, :]
    if allowed is not None:  # masked logits -inf: their weights are 0, and so their gradients
        logits = xp.where(allowed, logits, -math.inf)
    shift = xp.max(logits, axis=-1, keepdims=True)
    shift = xp.where(xp.isfinite(shift), shift, xp.zeros_like(shift))
    weights = xp.exp(logits - shift)
    total = xp.sum(weights, axis=-1, keepdims=True)
    return (weights @ v) / xp.where(total > 0, total, xp.ones_like(total))
