r"""Randomized attention (RA): an unbiased Monte Carlo estimator of softmax attention.

Paper: Zheng et al., *Linear Complexity Randomized Self-attention Mechanism*, ICML 2022
§3.2, Proposition 3.2 and Appendix G.2 (Algorithm 1). With the
positive randomized mapping :math:`\xi(x, \omega) = \exp(\omega \cdot x - \lVert x
\rVert^2 / 2)`, softmax attention is an expectation over the Gaussian mixture (eqs. 5, 29)

.. math::

    p_n(\omega) = \sum_m \pi_{nm}\, N(\omega; \hat q_n + \hat k_m, I), \qquad
    \pi_{nm} = \operatorname{softmax}_m(\hat q_n \cdot \hat k_m),

of the function (eq. 6; :math:`\xi(\hat q_n, \omega)` cancels between the numerator and
the denominator)

.. math::

    f_n(\omega) = \sum_m \operatorname{softmax}_m\!\big(\omega \cdot \hat k_m
        - \lVert \hat k_m \rVert^2 / 2\big)\, v_m ,
    \qquad \mathbb{E}_{\omega \sim p_n}[f_n(\omega)] = \sum_m \pi_{nm} v_m .

Sampling :math:`\omega \sim p_n` is two steps: a component :math:`z \sim
\operatorname{Categorical}(\pi_n)` and :math:`\omega = \hat q_n + \hat k_z + \varepsilon`,
:math:`\varepsilon \sim N(0, I)` (eq. 30). The *biased* variant (the paper's practical form)
replaces the mixture by one Gaussian at its mean, :math:`\omega = \hat q_n + \sum_m
\pi_{nm} \hat k_m + \varepsilon` (eq. 31); its deterministic form (:math:`\varepsilon = 0`) is the
paper's evaluation mode.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from xattn._array import Array, check_bool, check_positive_int, prepare_attention
from xattn._primitives import causal_allowed, masked_softmax
from xattn.random import as_generator

__all__ = ["check_noise_scale", "ra"]


def check_noise_scale(noise_scale: Any) -> float:
    """Return ``noise_scale`` as a float if it is a finite real number >= 0, else raise."""
    if isinstance(noise_scale, bool) or not isinstance(noise_scale, numbers.Real):
        raise TypeError(f"noise_scale must be a real number >= 0, got "
                        f"{type(noise_scale).__name__} {noise_scale!r}")
    if not (math.isfinite(noise_scale) and noise_scale >= 0):
        raise ValueError(f"noise_scale must be a finite number >= 0, got {noise_scale}")
    return float(noise_scale)

def _allowed_keys(xp: Any, key_mask: Array | None, causal: bool, query_start: int,
                  query_stop: int, num_keys: int, device: Any) -> Array | None:
    """Boolean ``(..., B, M)`` (or None: every key): may query ``n`` attend key ``m``."""
    allowed = None
    if key_mask is not None:
        allowed = key_mask[..., None, :]
    if causal:  # top-left aligned, as in softmax_attention: query n sees keys m <= n
        queries = xp.arange(query_start, query_stop, device=device)
        in_past = causal_allowed(xp, queries, 0, num_keys, device)
        allowed = in_past if allowed is None else (allowed & in_past)
    return allowed


def ra(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_samples: int = 1,
    biased: bool = False,
    deterministic: bool = False,
    noise_scale: float = 1.0,
    scale: float | None = None,
    key_mask: Array | None = None,
    causal: bool = False,
    rng: Any = None,
    chunk_size: int = 128,
    check_finite: bool = False,
) -> Array:
    r"""Randomized attention (RA): unbiased (or biased) Monte Carlo softmax attention.

    For every query :math:`n` and each of its ``num_samples`` samples :math:`s`
    (paper Algorithm 1, eqs. 29-30, Prop. 3.2 / eq. 7):

    .. math::

        \pi_{nm} = \operatorname{softmax}_m(\hat q_n \cdot \hat k_m), \quad
        z_{ns} \sim \operatorname{Categorical}(\pi_n), \quad
        \omega_{ns} = \hat q_n + \hat k_{z_{ns}} + \varepsilon_{ns}, \quad
        \varepsilon_{ns} \sim N(0, I),

    .. math::

        y_n = \frac{1}{S} \sum_s \sum_m \operatorname{softmax}_m\!\big(
            \omega_{ns} \cdot \hat k_m - \lVert \hat k_m \rVert^2 / 2\big)\, v_m ,

    with :math:`\hat q = \sqrt{s}\, q`, :math:`\hat k = \sqrt{s}\, k` for the score scale
    :math:`s`. :math:`\mathbb{E}[y_n]` is exactly softmax attention. With
    ``biased=True``, :math:`\omega_{ns} = \hat q_n + \sum_m \pi_{nm} \hat k_m +
    \varepsilon_{ns}` (no categorical draw; biased but lower variance), and with
    ``deterministic=True`` as well, :math:`\varepsilon = 0` (the paper's evaluation mode;
    all samples coincide). Cost :math:`O(NMD\,S)` time, like exact attention.

    The component :math:`z_{ns}` is drawn by inverse CDF with one uniform per query and
    sample: :math:`z` is the number of cumulative probabilities
    :math:`\sum_{m' \le m} \pi_{nm'}` below :math:`u = 1 - U`, :math:`U \sim [0, 1)`,
    clipped to the last allowed key (rounding can leave the total just below 1).
    Queries are processed ``chunk_size`` at a time, so the largest intermediates are
    ``(..., chunk_size, num_samples, M)``; no ``N x M x D`` array is formed.

    **Gradients** with respect to ``q``, ``k`` and ``v`` flow through the continuous
    path: :math:`\pi` (biased form), :math:`\hat q_n + \hat k_z` for the drawn
    :math:`z`, and :math:`f_n(\omega)`. The discrete choice :math:`z` itself is not
    differentiated (it is a piecewise-constant function of the inputs), so the gradient
    is that of the estimate for fixed :math:`z` and :math:`\varepsilon`, not an unbiased
    gradient of softmax attention.

    Parameters
    ----------
    q : array, shape (..., N, D)
        Queries. Real floating dtype; half precision is computed in float32.
    k : array, shape (..., M, D)
        Keys.
    v : array, shape (..., M, Dv)
        Values.
    num_samples : int
        Samples :math:`S` per query (>= 1), averaged; the variance falls as ``1/S``.
    biased : bool
        Use the single-Gaussian proposal centred at the mixture mean (biased RA).
    deterministic : bool
        Drop the noise (:math:`\varepsilon = 0`). Requires ``biased=True``: the unbiased
        estimator has no deterministic form.
    noise_scale : float
        Standard deviation :math:`\sigma` >= 0 of the noise, :math:`\omega_{ns} =
        \mu_{ns} + \sigma\,\varepsilon_{ns}`, with :math:`f_n` unchanged (the
        unit-covariance form above). The default 1.0 is the paper's estimator, unbiased
        in the unbiased form; any other value makes it biased, trading bias for variance
        (:math:`\sigma \to 0` approaches the noise-free estimate, with ``biased=True``
        the deterministic mode). ``noise_scale=D**-0.25`` reproduces the authors'
        implementation, which divides q and k by :math:`D^{1/4}` but draws unit-variance
        noise. Measured figures: the theory page on LARA.
    scale : float, optional
        Score scale; ``None`` means ``1/sqrt(D)``.
    key_mask : bool array, shape broadcastable to (..., M), optional
        True where the key takes part. It restricts both :math:`\pi` and the softmax in
        :math:`f_n`. A query whose keys are all masked gets a zero row.
    causal : bool
        If True, query ``n`` attends keys ``m <= n`` only (top-left aligned), in both
        :math:`\pi` and :math:`f_n`.
    rng : None, int, xattn.random.Generator or native generator
        Randomness (see :func:`xattn.random.as_generator`). An int seed gives the same
        output on every backend; a JAX key works under :func:`jax.jit`. Draw order:
        uniforms of shape ``(*batch, N, S)`` (unbiased form only), then standard normals
        of shape ``(*batch, N, S, D)``. Unused (nothing is drawn) when deterministic.
    chunk_size : int
        Number of queries processed at a time.
    check_finite : bool
        Raise ``ValueError`` on NaN or infinity in q, k or v (default False: unchecked, and
        NaN propagates); see :ref:`non-finite-inputs`.

    Returns
    -------
    array, shape (..., N, Dv)
        In the namespace, device and dtype of the inputs; leading dims broadcast.

    Raises
    ------
    ValueError
        ``num_samples`` or ``chunk_size`` < 1, ``deterministic=True`` with
        ``biased=False``, or inputs/masks of the wrong shape.
    TypeError
        Non-bool flags, non-integer counts, wrong dtypes or mixed array libraries.

    See Also
    --------
    xattn.softmax_attention : The exact attention whose expectation ra matches.
    xattn.lara : Linear-cost variant with shared, input-dependent proposals.
    xattn.diagnostics.estimator_error : Bias, variance and MSE of an estimator over draws.

    References
    ----------
    .. [1] L. Zheng, C. Wang, L. Kong, "Linear Complexity Randomized Self-attention
       Mechanism", ICML 2022, §3.2 (randomized attention) and Proposition 3.2 (it is
       unbiased). https://arxiv.org/abs/2204.04667
    .. [2] A. B. Owen, "Monte Carlo theory, methods and examples", 2013, chapter 9
       (importance sampling). https://artowen.su.domains/mc/

    Derivation: :doc:`/theory/03_randomized_attention`; all papers:
    :doc:`/bibliography`.

    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 7, 4)), rng.normal(size=(2, 7, 3))
    >>> xattn.ra(q, k, v, num_samples=4, rng=0).shape
    (2, 5, 3)
    >>> y = xattn.ra(q, k, v, biased=True, deterministic=True)
    >>> y.shape, y.dtype
    ((2, 5, 3), dtype('float64'))
    """
    num_samples = check_positive_int(num_samples, "num_samples")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    biased = check_bool(biased, "biased")
    deterministic = check_bool(deterministic, "deterministic")
    causal = check_bool(causal, "causal")
    noise_scale = check_noise_scale(noise_scale)
    if deterministic and not biased:
        raise ValueError(
            "deterministic=True requires biased=True: unbiased RA draws a random mixture "
            "component per sample and has no deterministic form; use biased=True, "
            "deterministic=True for the paper's evaluation mode"
        )
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask,
                               check_finite=check_finite)
    xp, work, device = inputs.xp, inputs.compute_dtype, inputs.device
    num_queries, num_keys = inputs.num_queries, inputs.num_keys
    batch = inputs.batch_shape
    head_dim, value_dim = inputs.q.shape[-1], inputs.v.shape[-1]

    root_scale = math.sqrt(inputs.scale)
    q_hat, k_hat, v = inputs.q * root_scale, inputs.k * root_scale, inputs.v
    k_hat_t = xp.matrix_transpose(k_hat)  # (..., D, M)
    key_half_sq_norm = 0.5 * xp.sum(k_hat * k_hat, axis=-1)  # (..., M)
    key_index = xp.arange(num_keys, device=device)

    generator = None if deterministic else as_generator(rng)
    if inputs.is_empty:
        return inputs.empty_result()
    num_draws = 1 if deterministic else num_samples
    uniforms = None
    if not biased:  # one uniform per query and sample, turned into (0, 1]
        uniforms = 1.0 - generator.uniform(xp, (*batch, num_queries, num_draws), dtype=work,
                                           device=device)
    noise = None
    if not deterministic:
        noise = generator.normal(xp, (*batch, num_queries, num_draws, head_dim), dtype=work,
                                 device=device)
        if noise_scale != 1.0:  # omega = mu + sigma eps; f_n keeps the unit-covariance form
            noise = noise_scale * noise

    outputs = []
    for start in range(0, num_queries, chunk_size):
        stop = min(start + chunk_size, num_queries)
        q_chunk = q_hat[..., start:stop, :]  # (..., B, D)
        allowed = _allowed_keys(xp, inputs.key_mask, causal, start, stop, num_keys, device)
        # mixture weights pi_nm = softmax_m(q_n . k_m) over the allowed keys, (..., B, M)
        mixture_weights = masked_softmax(xp, q_chunk @ k_hat_t, allowed)

        if biased:  # one Gaussian at the mixture mean: q_n + sum_m pi_nm k_m   (eq. 31)
            proposal_means = (q_chunk + mixture_weights @ k_hat)[..., None, :]  # (..., B, 1, D)
        else:
            # z ~ Categorical(pi_n) by inverse CDF: count the cumulative weights below u
            cumulative = xp.cumulative_sum(mixture_weights, axis=-1)  # (..., B, M)
            below = cumulative[..., None, :] < uniforms[..., start:stop, :, None]
            component = xp.count_nonzero(below, axis=-1)  # (*batch, B, S)
            if allowed is None:
                component = xp.clip(component, max=num_keys - 1)
            else:  # clip to the last allowed key
                last_allowed = xp.max(xp.where(allowed, key_index, xp.zeros_like(key_index)),
                                      axis=-1)  # (..., B)
                component = xp.minimum(component, last_allowed[..., None])
            # k_z gathered by a one-hot matmul (Array API, differentiable in k)
            one_hot = xp.astype(component[..., None] == key_index, work)  # (*batch, B, S, M)
            proposal_means = q_chunk[..., None, :] + one_hot @ k_hat[..., None, :, :]  # eq. 30

        omega = proposal_means if noise is None else proposal_means + noise[..., start:stop, :, :]
        # f_n(omega) = sum_m softmax_m(omega . k_m - |k_m|^2 / 2) v_m   (eq. 6)
        logits = omega @ k_hat_t[..., None, :, :] - key_half_sq_norm[..., None, None, :]
        key_weights = masked_softmax(xp, logits,
                                      None if allowed is None else allowed[..., None, :])
        estimates = key_weights @ v[..., None, :, :]  # (*batch, B, S, Dv)
        outputs.append(xp.mean(estimates, axis=-2))

    if not outputs:  # N = 0: no chunk ran; the result is empty
        outputs = [xp.zeros((*batch, 0, value_dim), dtype=work, device=device)]
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)
    out = xp.broadcast_to(out, (*batch, num_queries, value_dim))
    return inputs.finish(out)
