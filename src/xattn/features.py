r"""Randomized mappings of the exponential kernel and their stabilized statistics.

The positive randomized mapping (Choromanski et al., ICLR 2021) is

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

This module also holds the explicit (unstabilized) feature maps of RFA / Performer
(:func:`random_features`: positive, hyperbolic and trigonometric) and the sample matrices
they use (:func:`sample_omega`: iid Gaussian or block-orthogonal rows).

**The namespace argument.** The estimators and the other public helpers
(:func:`xattn.lara_weights`, :func:`xattn.balance_heuristic`, :mod:`xattn.diagnostics`)
infer the Array API namespace from their arrays. The functions of this module are the
building blocks the estimators call, piece by piece, on arrays they have already checked:
they take the namespace ``xp`` as their first argument instead of inferring it, and
:func:`sample_omega`, which makes an array from nothing, takes it as the keyword ``xp=``.
"""

from __future__ import annotations

import math
from typing import Any

from xattn._core.array import Array, host_namespace
from xattn._core.delegation import qr
from xattn._core.draws import add_host_kind
from xattn._core.options import check_bool, check_choice, check_positive_int
from xattn._core.primitives import finite_shift, merge_maxima, nonzero_divisor
from xattn.random import HostGenerator, as_generator

__all__ = [
    "FEATURE_MAPS",
    "SAMPLE_NORMS",
    "log_positive_features",
    "merge_key_statistics",
    "positive_key_statistics",
    "random_features",
    "sample_omega",
    "weighted_readout",
]

FEATURE_MAPS = ("positive", "hyperbolic", "trigonometric")
"""The randomized mappings of :func:`random_features` and :func:`xattn.rfa`."""

SAMPLE_NORMS = ("chi", "sqrt_dim")
"""Row norms of orthogonal samples: an independent chi(D) draw, or exactly sqrt(D)."""



def log_positive_features(xp: Any, x: Array, omega: Array) -> Array:
    r"""Log of the positive randomized mapping, :math:`\omega_s \cdot x - \lVert x \rVert^2/2`.

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
    xp: Any, k_hat: Array, v: Array, omega: Array, key_mask: Array | None = None, *,
    chunk_size: int | None = None,
) -> tuple[Array, Array, Array]:
    r"""Stabilized key-side sums of the positive mapping (RFA, stabilized form).

    .. math::

        a_{ms} = \omega_s \cdot \hat k_m - \lVert \hat k_m \rVert^2 / 2, \quad
        K_s = \max_m a_{ms}, \quad
        A'_s = \sum_m e^{a_{ms} - K_s} v_m, \quad b'_s = \sum_m e^{a_{ms} - K_s}

    over the keys allowed by ``key_mask``. A sample with no allowed key gets
    :math:`K_s = 0`, :math:`A'_s = 0`, :math:`b'_s = 0`.

    With ``chunk_size``, the keys are walked ``chunk_size`` at a time and the statistics
    of each chunk are folded into running ones by :func:`merge_key_statistics` (a running
    per-sample maximum, rescaled as it grows: the online-softmax trick per random
    feature), so the working memory is ``O(chunk_size * S + S * Dv)`` per batch element
    instead of ``O(M * S)``. The result is the same up to rounding.

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
    chunk_size : int, optional
        Keys per chunk; ``None`` (default) takes all keys at once.

    Returns
    -------
    key_max : array, shape (..., S)
        :math:`K_s`.
    numerator : array, shape (..., S, Dv)
        :math:`A'_s`.
    denominator : array, shape (..., S)
        :math:`b'_s`.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.features import positive_key_statistics
    >>> rng = np.random.default_rng(0)
    >>> k_hat, v = rng.normal(size=(50, 4)), rng.normal(size=(50, 3))
    >>> omega = rng.normal(size=(8, 4))
    >>> whole = positive_key_statistics(np, k_hat, v, omega)
    >>> chunked = positive_key_statistics(np, k_hat, v, omega, chunk_size=16)
    >>> all(np.allclose(a, b) for a, b in zip(whole, chunked))
    True
    """
    if chunk_size is not None:  # checked whatever the number of keys
        chunk_size = check_positive_int(chunk_size, "chunk_size")
    num_keys = k_hat.shape[-2]
    if chunk_size is None or chunk_size >= num_keys:
        return _key_statistics(xp, k_hat, v, omega, key_mask)
    statistics = None
    for start in range(0, num_keys, chunk_size):
        stop = min(start + chunk_size, num_keys)
        chunk_mask = None if key_mask is None else key_mask[..., start:stop]
        chunk = _key_statistics(xp, k_hat[..., start:stop, :], v[..., start:stop, :], omega,
                                chunk_mask)
        statistics = chunk if statistics is None else merge_key_statistics(xp, statistics,
                                                                           chunk)
    assert statistics is not None  # chunk_size < num_keys: the loop ran at least once
    return statistics


def _key_statistics(xp: Any, k_hat: Array, v: Array, omega: Array,
                    key_mask: Array | None) -> tuple[Array, Array, Array]:
    """:func:`positive_key_statistics` of all keys at once."""
    logits = log_positive_features(xp, k_hat, omega)  # (..., M, S)
    if key_mask is not None:
        logits = xp.where(key_mask[..., :, None], logits, -xp.inf)
    key_max = xp.max(logits, axis=-2)  # (..., S)
    key_max = finite_shift(xp, key_max)
    weights = xp.exp(logits - key_max[..., None, :])  # masked keys: exp(-inf) = 0
    numerator = xp.matrix_transpose(weights) @ v
    denominator = xp.sum(weights, axis=-2)
    return key_max, numerator, denominator


def merge_key_statistics(
    xp: Any, first: tuple[Array, Array, Array], second: tuple[Array, Array, Array]
) -> tuple[Array, Array, Array]:
    r"""The key statistics of two disjoint sets of keys, combined.

    Each argument is a ``(key_max, numerator, denominator)`` triple of
    :func:`positive_key_statistics`. Per sample, the larger maximum becomes the shift and
    the other set's sums are rescaled to it,

    .. math::

        K_s = \max(K^{(1)}_s, K^{(2)}_s), \quad
        A'_s = e^{K^{(1)}_s - K_s} A'^{(1)}_s + e^{K^{(2)}_s - K_s} A'^{(2)}_s

    (and :math:`b'_s` likewise), so no term overflows and the dominant one is exact.
    A sample without keys in one set (:math:`b'_s = 0`) takes the other set's values;
    NaN in either set propagates.

    Parameters
    ----------
    xp : namespace
    first, second : tuple of arrays
        ``(key_max (..., S), numerator (..., S, Dv), denominator (..., S))``.

    Returns
    -------
    tuple of arrays
        The statistics of the union, in the same format.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.features import merge_key_statistics, positive_key_statistics
    >>> rng = np.random.default_rng(0)
    >>> k_hat, v = rng.normal(size=(10, 4)), rng.normal(size=(10, 2))
    >>> omega = rng.normal(size=(6, 4))
    >>> head = positive_key_statistics(np, k_hat[:3], v[:3], omega)
    >>> tail = positive_key_statistics(np, k_hat[3:], v[3:], omega)
    >>> merged = merge_key_statistics(np, head, tail)
    >>> whole = positive_key_statistics(np, k_hat, v, omega)
    >>> all(np.allclose(a, b) for a, b in zip(merged, whole))
    True
    """
    first_max, first_numerator, first_denominator = first
    second_max, second_numerator, second_denominator = second
    # an empty set's K_s = 0 is only a placeholder: in the merge, empty is -inf
    first_max = xp.where(first_denominator == 0, -xp.inf, first_max)
    second_max = xp.where(second_denominator == 0, -xp.inf, second_max)
    _, key_max, (first_rescale, second_rescale) = merge_maxima(xp, first_max, second_max)
    numerator = (first_rescale[..., None] * first_numerator
                 + second_rescale[..., None] * second_numerator)
    denominator = first_rescale * first_denominator + second_rescale * second_denominator
    return key_max, numerator, denominator  # K_s: the finite shift (0 for an empty set)


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
    safe = nonzero_divisor(xp, out_denominator)
    return out_numerator / safe


def sample_omega(
    rng: Any,
    num_features: int,
    dim: int,
    *,
    xp: Any,
    dtype: Any,
    device: Any = None,
    orthogonal: bool = True,
    norm: str = "chi",
) -> Array:
    r"""Draw an ``(S, D)`` matrix of random-feature samples :math:`\omega_s` (as rows).

    * ``orthogonal=False``: iid rows :math:`\omega_s \sim N(0, I_D)`.
    * ``orthogonal=True`` (Performer's ORF): :math:`\lceil S/D \rceil` blocks of
      ``D`` rows, each block the orthogonal factor of the QR decomposition of a ``D x D``
      standard Gaussian matrix (signs fixed by :math:`\operatorname{sign} R_{ii}`, so the
      block is Haar-distributed), stacked and cut to ``S`` rows. Rows within a block are
      exactly orthogonal. Each row is then rescaled to ``norm``:

      - ``"chi"`` (default): the norm of an independent :math:`N(0, I_D)` vector, so every
        row is marginally :math:`N(0, I_D)` and kernel estimates stay unbiased;
      - ``"sqrt_dim"``: exactly :math:`\sqrt{D}` (lower variance, slightly biased).

    Parameters
    ----------
    rng : None, int, xattn.random.Generator or native generator
        Anything :func:`xattn.random.as_generator` accepts. An int seed draws on the host,
        and takes the QR there in float64, so it gives the same matrix on every backend
        (up to the rounding to ``dtype``), at the cost of one small host computation and
        one transfer per call: pass the result as ``omega=`` to draw once.
    num_features : int
        Number of samples ``S`` (>= 1).
    dim : int
        Dimension ``D`` (>= 1).
    xp : namespace
        Array API namespace of the result.
    dtype : dtype
        Real floating dtype of the result (use float32 or float64; QR needs them).
    device : device, optional
        Device of the result.
    orthogonal : bool
        Block-orthogonal rows (default) or iid rows.
    norm : {"chi", "sqrt_dim"}
        Row norms of orthogonal samples (ignored when ``orthogonal=False``).

    Returns
    -------
    array, shape (S, D)

    References
    ----------
    K. Choromanski et al., "Rethinking Attention with Performers", ICLR 2021, §2.4.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.features import sample_omega
    >>> omega = sample_omega(0, 6, 4, xp=np, dtype=np.float64)
    >>> omega.shape
    (6, 4)
    >>> unit = omega[:4] / np.linalg.norm(omega[:4], axis=1, keepdims=True)
    >>> bool(np.allclose(unit @ unit.T, np.eye(4)))
    True
    """
    num_features = check_positive_int(num_features, "num_features")
    dim = check_positive_int(dim, "dim")
    orthogonal = check_bool(orthogonal, "orthogonal")
    check_choice(norm, "norm", SAMPLE_NORMS)
    generator = as_generator(rng)
    if not orthogonal:
        return generator.normal(xp, (num_features, dim), dtype=dtype, device=device)
    host = host_namespace()
    if (isinstance(generator, HostGenerator) and generator.on_host(xp)
            and not (xp is host and dtype == host.float64)):
        # a seed draws on the host: the QR there too, in float64 (one small LAPACK call,
        # not a device's batched QR, about 1 ms on a GPU), then one transfer
        request = (_ORTHOGONAL, num_features, dim, SAMPLE_NORMS.index(norm))
        return generator.draw(xp, request, dtype=dtype, device=device)

    num_blocks = math.ceil(num_features / dim)
    gaussian = generator.normal(xp, (num_blocks, dim, dim), dtype=dtype, device=device)
    q_factor, r_factor = qr(xp, gaussian)
    r_diagonal = xp.linalg.diagonal(r_factor)  # (blocks, D)
    # columns of Q * sign(diag R) form a Haar-distributed orthogonal matrix; take them as rows
    haar_orthogonal = xp.where(r_diagonal[..., None, :] < 0, -q_factor, q_factor)
    directions = xp.matrix_transpose(haar_orthogonal)
    directions = xp.reshape(directions, (num_blocks * dim, dim))[:num_features, :]
    if norm == "sqrt_dim":
        return directions * math.sqrt(dim)
    chi_vectors = generator.normal(xp, (num_features, dim), dtype=dtype, device=device)
    return directions * xp.linalg.vector_norm(chi_vectors, axis=-1, keepdims=True)


_ORTHOGONAL = 2
"""The kind of a request for orthogonal samples, ``(_ORTHOGONAL, S, D, norm)`` (norm: the
index in :data:`SAMPLE_NORMS`): drawn on the host whole, QR included."""


def _host_orthogonal(generator: Any, params: tuple[int, ...]) -> Any:
    num_features, dim, norm = params
    return sample_omega(HostGenerator(generator), num_features, dim, xp=host_namespace(),
                        dtype=host_namespace().float64, norm=SAMPLE_NORMS[norm])


add_host_kind(_ORTHOGONAL, _host_orthogonal, lambda params: tuple(params[:2]))


def random_features(xp: Any, x: Array, omega: Array, feature_map: str = "positive") -> Array:
    r"""Explicit random features :math:`\phi(x)`, with :math:`\phi(x) \cdot \phi(y)
    \approx \exp(x \cdot y)`.

    With samples :math:`\omega_1, \dots, \omega_S` (rows of ``omega``):

    * ``"positive"``: :math:`\phi(x) = S^{-1/2} [\xi(x, \omega_s)]_s`,
      :math:`\xi(x, \omega) = e^{\omega \cdot x - \lVert x \rVert^2/2}`, ``S`` features;
    * ``"hyperbolic"``: :math:`\phi(x) = S^{-1/2}\, 2^{-1/2} e^{-\lVert x \rVert^2/2}
      [e^{\omega_s \cdot x}, e^{-\omega_s \cdot x}]_s`, ``2S`` features (samples
      :math:`\pm\omega_s`);
    * ``"trigonometric"``: :math:`\phi(x) = S^{-1/2} e^{\lVert x \rVert^2/2}
      [\sin \omega_s \cdot x, \cos \omega_s \cdot x]_s`, ``2S`` features (may be negative).

    For :math:`\omega_s \sim N(0, I)` the estimate :math:`\phi(x) \cdot \phi(y)` is unbiased
    for :math:`\exp(x \cdot y)` under every map. These are the plain formulas (they
    overflow for large inputs); :func:`xattn.rfa` evaluates attention in a stabilized form.

    Parameters
    ----------
    xp : namespace
    x : array, shape (..., L, D)
    omega : array, shape (S, D)
    feature_map : {"positive", "hyperbolic", "trigonometric"}

    Returns
    -------
    array, shape (..., L, S) or (..., L, 2S)
        Features ordered ``[all s for +omega (or sin), all s for -omega (or cos)]``.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.features import random_features
    >>> omega = np.random.default_rng(0).normal(size=(4096, 2))
    >>> x, y = np.array([[0.3, -0.2]]), np.array([[0.1, 0.4]])
    >>> phi_x, phi_y = random_features(np, x, omega), random_features(np, y, omega)
    >>> phi_x.shape
    (1, 4096)
    >>> estimate, exact = (phi_x @ phi_y.T)[0, 0], np.exp(x @ y.T)[0, 0]
    >>> bool(abs(estimate - exact) < 0.1)
    True
    """
    check_choice(feature_map, "feature_map", FEATURE_MAPS)
    num_samples = omega.shape[-2]
    projections = x @ xp.matrix_transpose(omega)  # (..., L, S)
    half_sq_norm = 0.5 * xp.sum(x * x, axis=-1, keepdims=True)
    normalizer = 1.0 / math.sqrt(num_samples)
    if feature_map == "positive":
        return normalizer * xp.exp(projections - half_sq_norm)
    if feature_map == "hyperbolic":
        normalizer = normalizer / math.sqrt(2.0)
        return normalizer * xp.concat(
            [xp.exp(projections - half_sq_norm), xp.exp(-projections - half_sq_norm)], axis=-1
        )
    return normalizer * xp.exp(half_sq_norm) * xp.concat(
        [xp.sin(projections), xp.cos(projections)], axis=-1
    )
