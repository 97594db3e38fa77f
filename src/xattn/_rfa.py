r"""Random feature attention (RFA / Performer FAVOR+).

With samples :math:`\omega_1, \dots, \omega_S` (rows of ``omega``) and a randomized
mapping :math:`\xi` (Choromanski et al., ICLR 2021),

.. math::

    y_n = \frac{\sum_s \xi(\hat q_n, \omega_s) A_s}{\sum_s \xi(\hat q_n, \omega_s) b_s},
    \qquad A_s = \sum_m \xi(\hat k_m, \omega_s) v_m, \quad b_s = \sum_m \xi(\hat k_m, \omega_s),

which costs :math:`O((N + M) S D)` instead of softmax attention's :math:`O(N M D)`.
The positive and hyperbolic maps are evaluated in the log domain with one stabilizer per
side that cancels exactly (:func:`xattn.features.positive_key_statistics` and
:func:`xattn.features.weighted_readout`); the trigonometric map, which can be negative, is
evaluated with the key norms shifted by their maximum and a guarded denominator.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from xattn._array import (
    Array,
    array_namespace,
    check_bool,
    check_choice,
    check_positive_int,
    concrete_count,
    device_of,
    prepare_attention,
)
from xattn._primitives import causal_allowed, finite_shift
from xattn.features import (
    FEATURE_MAPS,
    SAMPLE_NORMS,
    log_positive_features,
    positive_key_statistics,
    sample_omega,
    weighted_readout,
)

__all__ = ["TrigonometricDenominatorWarning", "default_num_features", "rfa"]



class TrigonometricDenominatorWarning(RuntimeWarning):
    """The trigonometric estimate of a softmax normalizer vanished or was negative.

    Emitted by :func:`rfa` with ``feature_map="trigonometric"`` when, for some query, the
    estimated denominator :math:`\\hat Z_n` is not above ``sqrt(eps) * W_n`` (``W_n`` the
    total key weight, the largest value :math:`|\\hat Z_n|` can take). Those rows are
    computed with the denominator clamped to that floor: finite, but not trustworthy.
    Use more features, the positive map, or smaller scores.

    Examples
    --------
    >>> import warnings
    >>> import numpy as np
    >>> import xattn
    >>> q = k = 3.0 * np.eye(4)[None, :, :]
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     out = xattn.rfa(q, k, np.ones((1, 4, 1)), num_features=2,
    ...                     feature_map="trigonometric", rng=0)
    >>> bool(np.all(np.isfinite(out)))
    True
    >>> issubclass(xattn.TrigonometricDenominatorWarning, RuntimeWarning)
    True
    """


def default_num_features(head_dim: int) -> int:
    """Performer's default number of samples, ``max(D, int(D ln D))``.

    Parameters
    ----------
    head_dim : int
        The head dimension ``D`` of the queries and keys.

    Returns
    -------
    int
        The number of random features ``S`` used when ``num_features=None``.

    Examples
    --------
    >>> import xattn
    >>> xattn.default_num_features(64)
    266
    """
    return max(head_dim, int(head_dim * math.log(head_dim)))


def rfa(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_features: int | None = None,
    feature_map: str = "positive",
    orthogonal: bool = True,
    omega: Array | None = None,
    scale: float | None = None,
    key_mask: Array | None = None,
    causal: bool = False,
    rng: Any = None,
    block_size: int = 128,
    sample_norm: str = "chi",
    check_finite: bool = False,
) -> Array:
    r"""Random feature attention (RFA / Performer FAVOR+), a linear-cost estimate of
    softmax attention.

    .. math::

        y_n = \frac{\sum_s \xi(\hat q_n, \omega_s)
                    \sum_m \xi(\hat k_m, \omega_s) v_m}
                   {\sum_s \xi(\hat q_n, \omega_s) \sum_m \xi(\hat k_m, \omega_s)}
        = \frac{\phi(\hat q_n)^\top (\phi(\hat K)^\top V)}{\phi(\hat q_n)^\top
          (\phi(\hat K)^\top 1)}

    over the allowed keys ``m`` (``key_mask``, and ``m <= n`` if ``causal``), with
    :math:`\hat q = \sqrt{s}\, q`, :math:`\hat k = \sqrt{s}\, k` and the maps of
    :func:`xattn.features.random_features`:

    * ``"positive"`` (FAVOR+): :math:`\xi(x, \omega) = e^{\omega \cdot x - \lVert x
      \rVert^2/2}`. Evaluated in the log domain: :math:`a_{ms} = \omega_s \cdot \hat k_m -
      \lVert \hat k_m \rVert^2/2`, :math:`K_s = \max_m a_{ms}`, :math:`c_{ns} = \omega_s
      \cdot \hat q_n + K_s`, :math:`Q_n = \max_s c_{ns}`; both shifts cancel exactly and no
      epsilon enters an exponent (see the stabilization theory page), so scores of 80 and more
      stay finite in float32.
    * ``"hyperbolic"``: the samples :math:`\omega_s` and :math:`-\omega_s` (``2S``
      features); its :math:`2^{-1/2}` factor cancels, the rest is the positive map.
    * ``"trigonometric"``: :math:`\xi(x, \omega) = e^{\lVert x \rVert^2/2} [\sin \omega
      \cdot x, \cos \omega \cdot x]` (``2S`` features). The query factor cancels; key
      weights :math:`e^{\lVert \hat k_m \rVert^2/2}` are shifted by their maximum. These
      features can be negative, so the estimated normalizer :math:`\hat Z_n =
      \sum_m w_m \frac1S \sum_s \cos(\omega_s \cdot (\hat q_n - \hat k_m))` can vanish or
      be negative. **Guard:** where :math:`\hat Z_n \le \sqrt{\epsilon}\, W_n` (``W_n =
      sum_m w_m`` bounds :math:`|\hat Z_n|`, :math:`\epsilon` the compute dtype's
      machine epsilon) the denominator is clamped to that floor, so the output is finite,
      and a :class:`TrigonometricDenominatorWarning` is emitted whenever the values can be
      read (not inside :func:`jax.jit` or for lazy Dask arrays, where only the clamp
      applies). Never inf.

    Causal mode processes the positions in blocks of ``block_size``: inside a block the
    kernel matrix :math:`\phi(\hat q_n) \cdot \phi(\hat k_m)` of the block (``m <= n``)
    is formed with a per-query and a per-key shift and combined in log scale; across
    blocks a carried ``(S, Dv)`` state :math:`A'_s, b'_s` with its running maximum
    :math:`K_s` is rescaled as the maximum grows (like online softmax). Memory is
    ``O(S Dv + block_size (S + block_size))`` per batch-head besides inputs and output, and
    every stabilizer a query uses depends only on keys at or before it: outputs at
    positions ``<= n`` do not depend on tokens after ``n``.

    Parameters
    ----------
    q : array, shape (..., N, D)
        Queries. Real floating dtype; half precision is computed in float32.
    k : array, shape (..., M, D)
        Keys.
    v : array, shape (..., M, Dv)
        Values.
    num_features : int, optional
        Number of samples ``S`` (>= 1). Default: ``omega.shape[0]`` if ``omega`` is given,
        else ``max(D, int(D ln D))``.
    feature_map : {"positive", "hyperbolic", "trigonometric"}
        The randomized mapping.
    orthogonal : bool
        Draw block-orthogonal samples (default) or iid Gaussian ones (see
        :func:`xattn.features.sample_omega`). Ignored when ``omega`` is given.
    omega : array, shape (S, D), optional
        Explicit samples as rows, in the namespace of ``q``: fixes the features (for
        evaluation, or a caller's redraw schedule). ``rng`` is then unused.
    scale : float, optional
        Score scale; ``None`` means ``1/sqrt(D)``.
    key_mask : bool array, shape broadcastable to (..., M), optional
        True where the key takes part; masked keys leave numerator *and* denominator. A
        query without allowed keys gets a zero row.
    causal : bool
        If True, query ``n`` attends keys ``m <= n`` only (top-left aligned).
    rng : None, int, xattn.random.Generator or native generator
        Source of the samples. An int seed gives the same samples, hence the same output,
        on every backend; a JAX key works under :func:`jax.jit`.
    block_size : int
        Positions per block in causal mode.
    sample_norm : {"chi", "sqrt_dim"}
        Row norms of orthogonal samples (see :func:`xattn.features.sample_omega`).
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
        ``num_features`` < 1, ``omega`` not of shape ``(S, D)``, unknown ``feature_map``
        or ``sample_norm``, and the input errors of :func:`xattn.softmax_attention`.
    TypeError
        Non-integer ``num_features`` or ``block_size``, non-bool ``causal`` or
        ``orthogonal``, ``omega`` from another library or not floating.

    Warns
    -----
    TrigonometricDenominatorWarning
        Trigonometric map only: some estimated normalizer is not positive (see above).

    See Also
    --------
    xattn.softmax_attention : The exact attention that rfa estimates.
    xattn.lara : Input-dependent proposals and query-specific weights, also linear cost.
    xattn.features.sample_omega : The (orthogonal) sample matrix ``omega``.
    xattn.features.random_features : The feature maps on their own.
    xattn.default_num_features : The default number of features.

    References
    ----------
    .. [1] K. Choromanski, V. Likhosherstov, D. Dohan, X. Song, A. Gane, T. Sarlos,
       P. Hawkins, J. Davis, A. Mohiuddin, L. Kaiser, D. Belanger, L. Colwell,
       A. Weller, "Rethinking Attention with Performers", ICLR 2021 (FAVOR+: positive
       and hyperbolic features, orthogonal samples). https://arxiv.org/abs/2009.14794
    .. [2] H. Peng, N. Pappas, D. Yogatama, R. Schwartz, N. A. Smith, L. Kong, "Random
       Feature Attention", ICLR 2021. https://arxiv.org/abs/2103.02143
    .. [3] A. Rahimi, B. Recht, "Random Features for Large-Scale Kernel Machines",
       NIPS 2007 (the trigonometric map).
    .. [4] L. Zheng, C. Wang, L. Kong, "Linear Complexity Randomized Self-attention
       Mechanism", ICML 2022, §3.1 (RFA as self-normalized importance sampling).
       https://arxiv.org/abs/2204.04667

    Derivations: :doc:`/theory/01_random_features`,
    :doc:`/theory/02_rfa_importance_sampling`, :doc:`/theory/05_stabilization`; all
    papers: :doc:`/bibliography`.

    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> rng = np.random.default_rng(0)
    >>> q, k = 0.5 * rng.normal(size=(2, 5, 8)), 0.5 * rng.normal(size=(2, 7, 8))
    >>> v = rng.normal(size=(2, 7, 3))
    >>> out = xattn.rfa(q, k, v, num_features=256, rng=0)
    >>> out.shape
    (2, 5, 3)
    >>> exact = xattn.softmax_attention(q, k, v)
    >>> bool(np.abs(out - exact).max() < 0.1)
    True
    >>> xattn.rfa(q, k, v, num_features=64, rng=0, causal=True).shape
    (2, 5, 3)
    """
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask,
                               check_finite=check_finite)
    check_choice(feature_map, "feature_map", FEATURE_MAPS)
    check_choice(sample_norm, "sample_norm", SAMPLE_NORMS)
    causal = check_bool(causal, "causal")
    orthogonal = check_bool(orthogonal, "orthogonal")
    block_size = check_positive_int(block_size, "block_size")
    if num_features is not None:
        num_features = check_positive_int(num_features, "num_features")
    xp, work, device = inputs.xp, inputs.compute_dtype, inputs.device
    head_dim = inputs.q.shape[-1]

    if omega is None:
        if num_features is None:
            num_features = default_num_features(head_dim)
        omega = sample_omega(rng, num_features, head_dim, xp=xp, dtype=work, device=device,
                             orthogonal=orthogonal, norm=sample_norm)
    else:
        omega = _check_omega(xp, q, omega, num_features, head_dim, work)

    root_scale = math.sqrt(inputs.scale)
    q_hat, k_hat, v = root_scale * inputs.q, root_scale * inputs.k, inputs.v
    key_mask = inputs.key_mask

    if inputs.num_queries == 0 or 0 in inputs.batch_shape:
        # an empty result: the causal loops have no block for N = 0, and Dask cannot create
        # their zero-size states (da.zeros((0, 2, S, Dv)) divides by zero); built from the
        # inputs (not xp.zeros) for the same reason
        empty = inputs.q[..., :1] @ v[..., :1, :]  # (..., N, Dv), size 0
        return inputs.finish(xp.broadcast_to(empty, (*inputs.batch_shape, inputs.num_queries,
                                                     v.shape[-1])))
    if feature_map == "trigonometric":
        if causal:
            out, invalid = _causal_trigonometric(xp, q_hat, k_hat, v, omega, key_mask,
                                                 inputs.batch_shape, block_size)
        else:
            out, invalid = _trigonometric(xp, q_hat, k_hat, v, omega, key_mask)
        _warn_if_any(xp, invalid)
        return inputs.finish(out)

    if feature_map == "hyperbolic":
        # xi(x, w) = 2^{-1/2} [xi+(x, w), xi+(x, -w)]: the positive map with samples +-w;
        # the 2^{-1/2} factor is common to numerator and denominator and cancels
        omega = xp.concat([omega, -omega], axis=0)
    if causal:
        out = _causal_positive(xp, q_hat, k_hat, v, omega, key_mask, inputs.batch_shape,
                               block_size)
    else:
        key_max, numerator, denominator = positive_key_statistics(xp, k_hat, v, omega,
                                                                  key_mask)
        logits = q_hat @ xp.matrix_transpose(omega) + key_max[..., None, :]  # c_ns
        out = weighted_readout(xp, logits, numerator, denominator)
    return inputs.finish(out)


def _check_omega(xp: Any, q: Array, omega: Any, num_features: int | None, head_dim: int,
                 work: Any) -> Array:
    array_namespace(q, omega, names=("q", "omega"))
    expected_rows = "S" if num_features is None else str(num_features)
    shape = tuple(omega.shape)
    if (len(shape) != 2 or shape[1] != head_dim or shape[0] < 1
            or (num_features is not None and shape[0] != num_features)):
        raise ValueError(
            f"omega must have shape (S, D) = ({expected_rows}, {head_dim}) (one sample per "
            f"row, D the last dim of q), got shape {shape}"
        )
    if not xp.isdtype(omega.dtype, "real floating"):
        raise TypeError(f"omega must have a real floating dtype, got {omega.dtype}")
    return omega if omega.dtype == work else xp.astype(omega, work)


def _block_allowed(xp: Any, query_start: int, query_stop: int, key_start: int, key_stop: int,
                   key_mask: Array | None, device: Any) -> Array:
    """Boolean (..., Bq, Bk): key m <= query n (and allowed by ``key_mask``)."""
    allowed = causal_allowed(xp, xp.arange(query_start, query_stop, device=device), key_start,
                             key_stop, device)
    if key_mask is not None:
        allowed = allowed & key_mask[..., None, key_start:key_stop]
    return allowed


def _causal_positive(xp: Any, q_hat: Array, k_hat: Array, v: Array, omega: Array,
                     key_mask: Array | None, batch_shape: tuple[int, ...],
                     block_size: int) -> Array:
    """Causal positive-map RFA over blocks of positions (stabilized causal form)."""
    num_queries, num_keys = q_hat.shape[-2], k_hat.shape[-2]
    num_samples, value_dim = omega.shape[0], v.shape[-1]
    work, device = q_hat.dtype, device_of(q_hat)
    omega_t = xp.matrix_transpose(omega)
    # carried state over keys of earlier blocks: K_s, A'_s, b'_s
    key_max = xp.full((*batch_shape, num_samples), -xp.inf, dtype=work, device=device)
    numerator_state = xp.zeros((*batch_shape, num_samples, value_dim), dtype=work, device=device)
    denominator_state = xp.zeros((*batch_shape, num_samples), dtype=work, device=device)
    outputs = []
    for start in range(0, num_queries, block_size):
        stop = min(start + block_size, num_queries)
        query_proj = q_hat[..., start:stop, :] @ omega_t  # omega_s . q_n, (..., Bq, S)
        query_shift = xp.max(query_proj, axis=-1, keepdims=True)  # beta_n
        # earlier blocks: c_ns = omega_s . q_n + K_s, stabilized by Q_n = max_s c_ns
        safe_key_max = finite_shift(xp, key_max)
        state_logits = query_proj + safe_key_max[..., None, :]
        state_shift = xp.max(state_logits, axis=-1, keepdims=True)
        state_weights = xp.exp(state_logits - state_shift)
        numerator = state_weights @ numerator_state
        denominator = state_weights @ denominator_state[..., None]
        key_stop = min(stop, num_keys)
        if start < key_stop:
            # this block: log kappa_nm = beta_n + alpha_m + log P_nm with per-query and
            # per-key shifts only, P_nm = sum_s e^{omega_s.q_n - beta_n} e^{a_ms - alpha_m}
            key_logits = log_positive_features(xp, k_hat[..., start:key_stop, :], omega)
            key_shift = xp.max(key_logits, axis=-1, keepdims=True)  # alpha_m
            pair_sums = xp.exp(query_proj - query_shift) @ xp.matrix_transpose(
                xp.exp(key_logits - key_shift))
            allowed = _block_allowed(xp, start, stop, start, key_stop, key_mask, device)
            allowed = allowed & (pair_sums > 0)
            safe_sums = xp.where(allowed, pair_sums, xp.ones_like(pair_sums))
            pair_logits = xp.where(allowed, xp.matrix_transpose(key_shift) + xp.log(safe_sums),
                                   -xp.inf)  # log kappa_nm - beta_n
            state_log = state_shift - query_shift  # log of the state's scale, minus beta_n
            row_shift = xp.maximum(state_log, xp.max(pair_logits, axis=-1, keepdims=True))
            pair_weights = xp.exp(pair_logits - row_shift)
            state_factor = xp.exp(state_log - row_shift)
            numerator = state_factor * numerator + pair_weights @ v[..., start:key_stop, :]
            denominator = state_factor * denominator + xp.sum(pair_weights, axis=-1,
                                                              keepdims=True)
            # fold this block's keys into the state, rescaling it as the running max grows
            if key_mask is not None:
                key_logits = xp.where(key_mask[..., start:key_stop, None], key_logits, -xp.inf)
            new_key_max = xp.maximum(key_max, xp.max(key_logits, axis=-2))
            shift = finite_shift(xp, new_key_max)
            rescale = xp.exp(key_max - shift)  # 0 while no key was allowed
            key_weights = xp.exp(key_logits - shift[..., None, :])
            numerator_state = (numerator_state * rescale[..., None]
                               + xp.matrix_transpose(key_weights) @ v[..., start:key_stop, :])
            denominator_state = denominator_state * rescale + xp.sum(key_weights, axis=-2)
            key_max = new_key_max
        safe = xp.where(denominator > 0, denominator, xp.ones_like(denominator))
        outputs.append(numerator / safe)
    return xp.concat(outputs, axis=-2)


def _trig_features(xp: Any, x: Array, omega: Array) -> Array:
    """``[sin omega_s.x, cos omega_s.x]``, shape (..., L, 2S) (norm factors kept apart)."""
    projections = x @ xp.matrix_transpose(omega)
    return xp.concat([xp.sin(projections), xp.cos(projections)], axis=-1)


def _half_sq_norms(xp: Any, k_hat: Array, key_mask: Array | None) -> Array:
    """:math:`\\lVert \\hat k_m \\rVert^2 / 2`, -inf for masked keys, shape (..., M)."""
    half_sq_norm = 0.5 * xp.sum(k_hat * k_hat, axis=-1)
    if key_mask is not None:
        half_sq_norm = xp.where(key_mask, half_sq_norm, -xp.inf)
    return half_sq_norm


def _guarded_ratio(xp: Any, numerator: Array, denominator: Array,
                   total_weight: Array) -> tuple[Array, Array]:
    """``numerator / denominator`` with the denominator floored at sqrt(eps) * W_n."""
    floor = math.sqrt(xp.finfo(denominator.dtype).eps) * total_weight
    has_keys = total_weight > 0
    invalid = has_keys & (denominator <= floor)
    safe = xp.where(denominator > floor, denominator,
                    xp.where(has_keys, floor, xp.ones_like(floor)))
    return numerator / safe, invalid


def _trigonometric(xp: Any, q_hat: Array, k_hat: Array, v: Array, omega: Array,
                   key_mask: Array | None) -> tuple[Array, Array]:
    """Non-causal trigonometric RFA: returns the output and the rows clamped by the guard."""
    num_samples = omega.shape[0]
    half_sq_norm = _half_sq_norms(xp, k_hat, key_mask)  # (..., M)
    norm_max = xp.max(half_sq_norm, axis=-1, keepdims=True)
    norm_max = finite_shift(xp, norm_max)
    key_weights = xp.exp(half_sq_norm - norm_max)[..., None]  # w_m, 0 if masked, (..., M, 1)
    key_features = xp.matrix_transpose(_trig_features(xp, k_hat, omega))  # (..., 2S, M)
    numerator = key_features @ (key_weights * v)  # (..., 2S, Dv)
    denominator = key_features @ key_weights  # (..., 2S, 1)
    query_features = _trig_features(xp, q_hat, omega) / num_samples  # e^{|q|^2/2} cancels
    total_weight = xp.sum(key_weights, axis=-2, keepdims=True)  # W, (..., 1, 1)
    return _guarded_ratio(xp, query_features @ numerator, query_features @ denominator,
                          total_weight)


def _causal_trigonometric(xp: Any, q_hat: Array, k_hat: Array, v: Array, omega: Array,
                          key_mask: Array | None, batch_shape: tuple[int, ...],
                          block_size: int) -> tuple[Array, Array]:
    """Causal trigonometric RFA over blocks, with a running max of the key norms."""
    num_queries, num_keys = q_hat.shape[-2], k_hat.shape[-2]
    num_samples, value_dim = omega.shape[0], v.shape[-1]
    work, device = q_hat.dtype, device_of(q_hat)
    half_sq_norm = _half_sq_norms(xp, k_hat, key_mask)  # (..., M)
    norm_max = xp.full((*batch_shape, 1, 1), -xp.inf, dtype=work, device=device)
    numerator_state = xp.zeros((*batch_shape, 2 * num_samples, value_dim), dtype=work,
                               device=device)
    denominator_state = xp.zeros((*batch_shape, 2 * num_samples, 1), dtype=work, device=device)
    weight_state = xp.zeros((*batch_shape, 1, 1), dtype=work, device=device)
    outputs, invalid_rows = [], []
    for start in range(0, num_queries, block_size):
        stop = min(start + block_size, num_queries)
        query_features = _trig_features(xp, q_hat[..., start:stop, :], omega) / num_samples
        numerator = query_features @ numerator_state
        denominator = query_features @ denominator_state
        total_weight = weight_state
        key_stop = min(stop, num_keys)
        if start < key_stop:
            key_features = _trig_features(xp, k_hat[..., start:key_stop, :], omega)
            block_norms = half_sq_norm[..., None, start:key_stop]  # (..., 1, Bk)
            allowed = _block_allowed(xp, start, stop, start, key_stop, None, device)
            pair_norms = xp.where(allowed, block_norms, -xp.inf)  # (..., Bq, Bk)
            row_max = xp.maximum(norm_max, xp.max(pair_norms, axis=-1, keepdims=True))
            row_max = finite_shift(xp, row_max)
            pair_weights = xp.exp(pair_norms - row_max)  # w_m for m <= n, else 0
            state_factor = xp.exp(norm_max - row_max)  # 0 while no key was allowed
            kernel = (query_features @ xp.matrix_transpose(key_features)) * pair_weights
            numerator = state_factor * numerator + kernel @ v[..., start:key_stop, :]
            denominator = state_factor * denominator + xp.sum(kernel, axis=-1, keepdims=True)
            total_weight = state_factor * weight_state + xp.sum(pair_weights, axis=-1,
                                                                keepdims=True)
            # fold this block's keys into the state
            new_max = xp.maximum(norm_max, xp.max(block_norms, axis=-1, keepdims=True))
            shift = finite_shift(xp, new_max)
            rescale = xp.exp(norm_max - shift)
            key_weights = xp.matrix_transpose(xp.exp(block_norms - shift))  # (..., Bk, 1)
            key_features_t = xp.matrix_transpose(key_features)
            numerator_state = (numerator_state * rescale
                               + key_features_t @ (key_weights * v[..., start:key_stop, :]))
            denominator_state = denominator_state * rescale + key_features_t @ key_weights
            weight_state = weight_state * rescale + xp.sum(key_weights, axis=-2, keepdims=True)
            norm_max = new_max
        out, invalid = _guarded_ratio(xp, numerator, denominator, total_weight)
        outputs.append(out)
        invalid_rows.append(xp.broadcast_to(invalid, (*out.shape[:-1], 1)))
    return xp.concat(outputs, axis=-2), xp.concat(invalid_rows, axis=-2)


def _warn_if_any(xp: Any, invalid: Array) -> None:
    """Warn about clamped trigonometric denominators when the flags can be read."""
    count = concrete_count(xp, invalid)  # None on lazy Dask or under jax.jit: clamp only
    if count:
        warnings.warn(
            f"rfa(feature_map='trigonometric'): the estimated normalizer of {count} "
            "query row(s) was not positive; their denominators were clamped to "
            "sqrt(eps) * (total key weight). Use more features or feature_map='positive'.",
            TrigonometricDenominatorWarning,
            stacklevel=3,
        )
