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
from typing import Any, NamedTuple

from xattn._core.array import (
    Array,
    AttentionInputs,
    default_working_memory,
    prepare_attention,
    sequence_positions,
    take_rows,
)
from xattn._core.options import check_bool, check_noise_scale, check_positive_int
from xattn._core.primitives import (
    finite_inputs,
    finite_shift,
    join,
    mark_tainted,
    nonzero_divisor,
    quarantine,
)
from xattn._core.state import RAState, check_state_call
from xattn._estimators.decode import extend_cache
from xattn.random import as_generator

__all__ = ["ra"]


def _allowed_keys(xp: Any, key_mask: Array | None, query_positions: Array | None,
                  key_positions: Array) -> Array | None:
    """Boolean ``(..., R, M)`` (or None: every key): may the query of row r attend key m.

    ``query_positions`` (R,) holds the position of each row's query under causal masking
    (None: not causal). Top-left aligned, as in softmax_attention: query n sees m <= n.
    ``key_positions`` is chunked like the keys on Dask (no unchunked arange of M).
    """
    allowed = None if key_mask is None else key_mask[..., None, :]
    if query_positions is not None:
        in_past = query_positions[:, None] >= key_positions[None, :]
        allowed = in_past if allowed is None else (allowed & in_past)
    return allowed


class _Keys(NamedTuple):
    """The key side of RA, shared by every query: the scaled keys and values."""

    xp: Any
    root_scale: float
    k_hat: Array  # (..., M, D)
    k_hat_t: Array  # (..., D, M)
    k_hat_t_extended: Array  # (..., D + 1, M): the columns [k^_m, -|k^_m|^2 / 2]
    v: Array  # (..., M, Dv)
    key_positions: Array  # (M,), chunked like the keys on Dask
    key_mask: Array | None
    batch: tuple[int, ...]
    stacked_keys: Array | None  # (prod(batch) M, D): every batch entry's keys; not Dask
    key_offsets: Array | None  # (*batch, 1, 1): the row of each entry's key 0 in them
    block_sums: Array | None  # the upper-triangular ones of _cumulative_sum


def _softmax_terms(keys: _Keys, logits: Array, allowed: Array | None) -> tuple[Array, Array]:
    """Unnormalized softmax weights ``exp(logits - max)`` over the allowed entries of the
    last axis, and their sums (..., 1). The caller divides only what it needs (a product
    with the weights, or the thresholds of the inverse CDF): one pass over (..., R, M)
    fewer than normalizing the weights. A row without allowed entries (only under a
    ``key_mask``: a causal row always sees key 0) has all-zero weights and sum 0."""
    xp = keys.xp
    if allowed is not None:
        logits = xp.where(allowed, logits, -xp.inf)
    top = xp.max(logits, axis=-1, keepdims=True)
    weights = xp.exp(logits - (top if keys.key_mask is None else finite_shift(xp, top)))
    return weights, xp.sum(weights, axis=-1, keepdims=True)


def _cumulative_sum(xp: Any, x: Array, upper: Array | None) -> Array:
    """Inclusive cumulative sum along the last axis.

    With ``upper`` (an upper-triangular (b, b) matrix of ones, :func:`_key_side`), blocks
    of b entries are summed by one matrix product with it and then offset by the running
    block totals: the same sums up to rounding, and on NumPy about 1.6 times faster than a
    sequential ``cumulative_sum`` over the (..., B, M) weights.
    """
    if upper is None:
        return xp.cumulative_sum(x, axis=-1)
    length, block = x.shape[-1], upper.shape[0]
    full = length - length % block
    sums = xp.reshape(x[..., :full], (*x.shape[:-1], full // block, block)) @ upper
    block_totals = sums[..., -1]  # (..., M // block)
    running = xp.cumulative_sum(block_totals, axis=-1)
    head = xp.reshape(sums + (running - block_totals)[..., None], (*x.shape[:-1], full))
    if full == length:
        return head
    tail = xp.cumulative_sum(x[..., full:], axis=-1) + running[..., -1:]
    return xp.concat([head, tail], axis=-1)


def _normalized(keys: _Keys, sums: Array, totals: Array) -> Array:
    """``sums / totals``, with 0 where the total is 0 (a row without allowed keys)."""
    return sums / (totals if keys.key_mask is None else nonzero_divisor(keys.xp, totals))


def _gather_keys(keys: _Keys, component: Array) -> Array:
    """``k_hat[..., z, :]`` for the components ``z`` (..., B, G): (..., B, G, D).

    One gather from the keys of all batch entries stacked (differentiable in k on torch
    and JAX, O(B G D)); on Dask a one-hot matrix, built against the key positions (chunked
    like the keys), selects them in one matrix product, O(B G M D)."""
    xp, head_dim = keys.xp, keys.k_hat.shape[-1]
    if keys.stacked_keys is not None:
        assert keys.key_offsets is not None
        rows = take_rows(keys.stacked_keys, xp.reshape(component + keys.key_offsets, (-1,)))
        return xp.reshape(rows, (*component.shape, head_dim))
    # not xpx.one_hot: it compares with an unchunked arange(M), one Dask block of all keys
    rows = xp.reshape(component, (*component.shape[:-2], -1))  # (..., B G)
    one_hot = xp.astype(rows[..., None] == keys.key_positions, keys.k_hat.dtype)
    return xp.reshape(one_hot @ keys.k_hat, (*component.shape, head_dim))


def _key_side(inputs: AttentionInputs, *, biased: bool) -> _Keys:
    r""":math:`\hat k = \sqrt{s}\,k`, and the columns :math:`[\hat k_m, -\lVert \hat k_m
    \rVert^2/2]`, so that :math:`[\omega, 1]` times them is :math:`\omega \cdot \hat k_m -
    \lVert \hat k_m \rVert^2/2` in the matrix product itself (no separate pass over the
    (..., rows, M) logits); unbiased RA: the keys stacked for the gather of :math:`\hat
    k_z` and, for 64 keys or more, the block sums of :func:`_cumulative_sum` (not Dask)."""
    xp, batch = inputs.xp, inputs.batch_shape
    root_scale = math.sqrt(inputs.scale)
    k_hat = inputs.k * root_scale
    k_hat_t = xp.matrix_transpose(k_hat)
    key_half_sq_norm = 0.5 * xp.sum(k_hat * k_hat, axis=-1)[..., None, :]  # (..., 1, M)
    stacked_keys = key_offsets = block_sums = None
    num_keys = k_hat.shape[-2]
    if not biased and hasattr(xp, "take_along_axis"):  # the namespace gathers (not Dask)
        stacked_keys = xp.reshape(xp.broadcast_to(k_hat, (*batch, *k_hat.shape[-2:])),
                                  (-1, k_hat.shape[-1]))
        entries = xp.arange(math.prod(batch), device=inputs.device) * num_keys
        key_offsets = xp.reshape(entries, (*batch, 1, 1))
        if num_keys >= 64:  # blocks of 32 for _cumulative_sum
            positions = xp.arange(32, device=inputs.device)
            block_sums = xp.astype(positions[:, None] <= positions[None, :], k_hat.dtype)
    return _Keys(xp, root_scale, k_hat, k_hat_t,
                 xp.concat([k_hat_t, -key_half_sq_norm], axis=-2), inputs.v,
                 sequence_positions(inputs.k, axis=-2), inputs.key_mask, batch,
                 stacked_keys, key_offsets, block_sums)


def _draw_randomness(inputs: AttentionInputs, generator: Any, num_draws: int, *,
                     biased: bool, noise_scale: float) -> tuple[Array | None, Array | None]:
    r"""Every random number of the call, drawn up front: one uniform in (0, 1] per query
    and sample for the mixture component (unbiased RA), (*batch, N, S), and the noise
    :math:`\sigma \epsilon`, (*batch, N, S, D) (None when deterministic)."""
    xp, work, device = inputs.xp, inputs.compute_dtype, inputs.device
    shape = (*inputs.batch_shape, inputs.num_queries, num_draws)
    uniforms = noise = None
    if not biased:  # one uniform per query and sample, turned into (0, 1]
        assert generator is not None  # deterministic requires biased (checked above)
        uniforms = 1.0 - generator.uniform(xp, shape, dtype=work, device=device)
    if generator is not None:
        noise = generator.normal(xp, (*shape, inputs.q.shape[-1]), dtype=work, device=device)
        if noise_scale != 1.0:  # omega = mu + sigma eps; f_n keeps the unit-covariance form
            noise = noise_scale * noise
    return uniforms, noise


class _Mixture(NamedTuple):
    """The mixture of a group of queries (eq. 29): its unnormalized weights' sums; biased
    RA keeps the mixture mean, unbiased RA the cumulative weights (for the inverse CDF)."""

    allowed: Array | None  # (..., B, M), None: every key
    total: Array  # (..., B, 1)
    mean: Array | None  # (..., B, D), biased
    cumulative: Array | None  # (..., B, M), unbiased: total * CDF


def _mixture(keys: _Keys, q_group: Array, query_positions: Array | None, *,
             biased: bool) -> _Mixture:
    r"""Mixture weights :math:`\pi_{nm} = \mathrm{softmax}_m(\hat q_n \cdot \hat k_m)` over
    the allowed keys (eq. 29), kept as :math:`e^{\hat q_n \cdot \hat k_m - \max}` and their
    sum; biased RA: the mean :math:`\hat q_n + \sum_m \pi_{nm} \hat k_m` (eq. 31)."""
    xp = keys.xp
    allowed = _allowed_keys(xp, keys.key_mask, query_positions, keys.key_positions)
    terms, total = _softmax_terms(keys, q_group @ keys.k_hat_t, allowed)
    if biased:  # one Gaussian at the mixture mean: q_n + sum_m pi_nm k_m   (eq. 31)
        return _Mixture(allowed, total, q_group + _normalized(keys, terms @ keys.k_hat, total),
                        None)
    # total * CDF, (..., B, M)
    return _Mixture(allowed, total, None, _cumulative_sum(xp, terms, keys.block_sums))


def _proposal_samples(keys: _Keys, q_group: Array, mixture: _Mixture, uniforms: Array | None,
                      noise: Array | None) -> Array:
    r"""The samples :math:`\omega_{ns}` of a group of B queries and G samples each,
    (..., B G, D), query-major. Unbiased (eq. 30): :math:`\omega = \hat q_n + \hat k_z +
    \epsilon` with :math:`z \sim \pi_n` by inverse CDF; biased: :math:`\omega` = the
    mixture mean :math:`+ \epsilon`; deterministic: no noise."""
    xp = keys.xp
    if mixture.mean is not None:
        proposal = mixture.mean[..., None, :]  # (..., B, 1, D): every sample's mean
    else:
        # z_ns ~ Categorical(pi_n) by inverse CDF: the cumulative weights below u
        # (both sides times the total: no division of the (..., B, M) weights)
        assert uniforms is not None and mixture.cumulative is not None  # unbiased
        threshold = uniforms * mixture.total  # (..., B, G)
        component = xp.count_nonzero(mixture.cumulative[..., None, :] < threshold[..., None],
                                     axis=-1)  # (..., B, G)
        # clipped to the last allowed key (rounding can leave the CDF just below u)
        if mixture.allowed is None:
            component = xp.clip(component, max=keys.k_hat.shape[-2] - 1)
        else:  # the last allowed key of each query, (..., B, 1)
            last_key = xp.max(xp.where(mixture.allowed, keys.key_positions, 0), axis=-1)
            component = xp.minimum(component, last_key[..., None])
        # omega_ns = q_n + k_z + eps   (eq. 30)
        proposal = q_group[..., None, :] + _gather_keys(keys, component)  # (..., B, G, D)
    omega = proposal if noise is None else proposal + noise  # (..., B, G, D)
    size, group, head_dim = omega.shape[-3:]
    if tuple(omega.shape[:-3]) != keys.batch:  # the leading dims of v too
        omega = xp.broadcast_to(omega, (*keys.batch, size, group, head_dim))
    return xp.reshape(omega, (*keys.batch, size * group, head_dim))  # one GEMM below


def _sample_estimates(keys: _Keys, omega: Array, mixture: _Mixture,
                      query_positions: Array | None) -> Array:
    r""":math:`f_n(\omega) = \sum_m \mathrm{softmax}_m(\omega \cdot \hat k_m - \lVert
    \hat k_m \rVert^2/2)\, v_m` (eq. 6; :math:`\xi(\hat q_n, \omega)` cancels) for each
    (query, sample) row of ``omega``, (..., B G, Dv), over the keys the query may see."""
    xp = keys.xp
    size = mixture.total.shape[-2]
    group = omega.shape[-2] // size
    row_allowed = mixture.allowed  # one sample per query: the rows are the queries
    if query_positions is not None and group > 1:  # each (query, sample) row's position
        row_positions = xp.reshape(xp.broadcast_to(query_positions[:, None], (size, group)),
                                   (size * group,))
        row_allowed = _allowed_keys(xp, keys.key_mask, row_positions, keys.key_positions)
    omega_extended = xp.concat([omega, xp.ones_like(omega[..., :1])], axis=-1)
    key_terms, key_total = _softmax_terms(keys, omega_extended @ keys.k_hat_t_extended,
                                          row_allowed)  # (..., B G, M), (..., B G, 1)
    return _normalized(keys, key_terms @ keys.v, key_total)  # (..., B G, Dv)


# numbers of the compute dtype a step holds per (query, sample) row and key at once (logits,
# masked and shifted, weights, cumulative weights), besides booleans (masks, inverse CDF)
_NUMBERS_PER_PAIR = 6


def _rows_per_step(inputs: AttentionInputs, num_keys: int, working_memory: int) -> int:
    """The (query, sample) rows of one step whose (..., rows, M) intermediates fit
    ``working_memory`` bytes (at least one)."""
    itemsize = inputs.xp.finfo(inputs.compute_dtype).bits // 8
    per_row = math.prod(inputs.batch_shape) * num_keys * (_NUMBERS_PER_PAIR * itemsize + 2)
    return max(1, working_memory // max(per_row, 1))


def _part(x: Array | None, axis: int, start: int, stop: int) -> Array | None:
    """``x[start:stop]`` along the (negative) ``axis``; ``x`` itself if that is all of it."""
    if x is None or (start == 0 and stop == x.shape[axis]):
        return x
    return x[(..., slice(start, stop), *(slice(None),) * (-1 - axis))]


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
    chunk_size: int | None = None,
    check_finite: bool = False,
    state: RAState | None = None,
    return_state: bool = False,
    working_memory: int | None = None,
) -> Any:
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

    **Cost.** The work is organized in steps of R (query, sample) rows: ``max(1, R //
    S)`` queries with all their samples (or, when ``S > R``, one query with R of its
    samples). R is as large as ``working_memory`` allows (1 GiB on a GPU, 64 MiB on a CPU;
    about six numbers and two booleans per row and key), or ``chunk_size``. A step is a
    fixed number of array operations over all its rows, whatever R: the mixture weights,
    their cumulative sums, the inverse CDF of every sample, one gather of the drawn keys
    :math:`\hat k_z` (a one-hot product on Dask) and the estimate's two matrix products
    (:math:`\omega \cdot \hat k_m` and the read-out of v). While all of a call's ``N S``
    rows fit (``(1, 2, N, 64)`` float32 with S = 1 up to N = 4,096 on a GPU, 1,024 on a
    CPU) a call is one step: a fixed number of operations (kernel launches on a GPU) at
    any length; beyond, the steps, and the operations, grow with ``N S M``. Memory beyond
    the draws (``(..., N, S, D)`` normals) is at most ``working_memory``, whatever N or S.
    The result does not depend on R beyond rounding.

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
        estimator has no deterministic form. (The layers' evaluation mode, Flax's
        ``deterministic=True`` or torch's ``eval()``, calls ``ra`` with ``biased=True,
        deterministic=True``.)
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
    chunk_size : int, optional
        Number of (query, sample) rows evaluated per step (see **Cost**); None (the
        default): as many as ``working_memory`` allows, all of them when they fit (a step
        holds ``(..., chunk_size, M)`` intermediates, which grow with M).
    check_finite : bool
        Raise ``ValueError`` on NaN or infinity in q, k or v (default False: unchecked, and
        NaN propagates); see :ref:`non-finite-inputs`.
    state : RAState, optional
        A key-value cache (``causal=True``) to continue: q, k and v are the ``L`` tokens
        after the ``P`` cached ones (``N = M = L``, 0 allowed); query ``P + j`` attends the
        cached keys and the new ones up to its own, in :math:`\pi` and :math:`f_n`. The
        call draws for its own queries from ``rng`` (the draw order above, with ``L``
        queries), so each estimate is that of one causal call over all ``P + L`` tokens
        with the same draws for that query, and stays unbiased. Deterministic mode has no
        draws: pieces equal one call up to rounding.
    return_state : bool
        Return ``(out, state)``, the :class:`~xattn.RAState` grown by these tokens
        (``causal=True``; ``N = M``).
    working_memory : int, optional
        Bytes of intermediates a step of (query, sample) rows may hold; sets
        ``chunk_size``. None: 1 GiB on a GPU, 64 MiB on a CPU
        (:func:`xattn.default_working_memory`).

    Returns
    -------
    array, shape (..., N, Dv), or (array, RAState)
        In the namespace, device and dtype of the inputs; leading dims broadcast. With
        ``return_state``, the pair ``(out, state)``.

    Raises
    ------
    ValueError
        ``num_samples``, ``chunk_size`` or ``working_memory`` < 1, ``deterministic=True``
        with ``biased=False``, inputs/masks of the wrong shape, ``state`` or
        ``return_state`` without ``causal``, a state of other heads.
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
    if chunk_size is not None:
        chunk_size = check_positive_int(chunk_size, "chunk_size")
    if working_memory is not None:
        working_memory = check_positive_int(working_memory, "working_memory")
    biased = check_bool(biased, "biased")
    deterministic = check_bool(deterministic, "deterministic")
    causal = check_bool(causal, "causal")
    stateful = check_state_call(state, return_state, causal, RAState)
    noise_scale = check_noise_scale(noise_scale)
    if deterministic and not biased:
        raise ValueError(
            "deterministic=True requires biased=True: unbiased RA draws a random mixture "
            "component per sample and has no deterministic form; use biased=True, "
            "deterministic=True for the paper's evaluation mode"
        )
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask,
                               check_finite=check_finite, continuing=stateful)
    offset = 0  # the position of the first query: keys before it are in the cache
    if stateful:  # attend the cached keys and the new ones (xattn._estimators.decode)
        inputs, state, offset = extend_cache(inputs, state, RAState)
    # non-finite rows reach exactly the rows that attend them, outputs and gradients
    tainted, _ = quarantine(inputs, causal=causal, offset=offset)
    inputs = finite_inputs(inputs)  # RA holds the scaled keys whole anyway
    generator = None if deterministic else as_generator(rng)
    if inputs.is_empty:
        return (inputs.empty_result(), state) if return_state else inputs.empty_result()
    if working_memory is None:
        working_memory = default_working_memory(inputs.q)
    xp, keys = inputs.xp, _key_side(inputs, biased=biased)
    num_draws = 1 if deterministic else num_samples  # deterministic: the samples coincide
    uniforms, noise = _draw_randomness(inputs, generator, num_draws, biased=biased,
                                       noise_scale=noise_scale)
    q_hat = inputs.q * keys.root_scale

    # steps of (query, sample) rows: whole queries with all their samples, or samples of
    # one query; as many as working_memory allows unless chunk_size says
    rows_per_step = chunk_size or _rows_per_step(inputs, keys.k_hat.shape[-2], working_memory)
    queries_per_step = max(1, rows_per_step // num_draws)
    samples_per_step = min(num_draws, rows_per_step)
    outputs = []
    for start in range(0, inputs.num_queries, queries_per_step):
        stop = min(start + queries_per_step, inputs.num_queries)
        q_group = _part(q_hat, -2, start, stop)  # (..., B, D)
        query_positions = (xp.arange(start + offset, stop + offset, device=inputs.device)
                           if causal else None)
        mixture = _mixture(keys, q_group, query_positions, biased=biased)
        group_uniforms = _part(uniforms, -2, start, stop)  # (..., B, S)
        group_noise = _part(noise, -3, start, stop)  # (..., B, S, D)
        total = None  # sum over the samples of f_n(omega_ns), (..., B, Dv)
        for sample_start in range(0, num_draws, samples_per_step):
            sample_stop = min(sample_start + samples_per_step, num_draws)
            omega = _proposal_samples(keys, q_group, mixture,
                                      _part(group_uniforms, -1, sample_start, sample_stop),
                                      _part(group_noise, -2, sample_start, sample_stop))
            estimates = _sample_estimates(keys, omega, mixture, query_positions)
            group = sample_stop - sample_start
            if group > 1:  # (..., B G, Dv) -> summed over the group's samples, (..., B, Dv)
                estimates = xp.sum(xp.reshape(estimates, (*keys.batch, stop - start, group,
                                                          estimates.shape[-1])), axis=-2)
            total = estimates if total is None else total + estimates
        assert total is not None  # num_draws >= 1: the sample loop ran
        outputs.append(total if num_draws == 1 else total / num_draws)  # mean over samples

    out = mark_tainted(xp, join(xp, outputs, axis=-2), tainted)
    out = inputs.finish(out)
    return (out, state) if return_state else out
