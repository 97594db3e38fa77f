r"""RA's parts (Zheng et al., 2022, *Linear Complexity Randomized Self-attention
Mechanism*, eqs. 5 and 29): the key side that every query shares, the draws made up front,
the per-query Gaussian mixture :math:`\pi_n` over the keys, its samples
:math:`\omega_{ns}` by inverse CDF, and the estimates :math:`f_n(\omega_{ns})`.
:func:`xattn.ra` (:mod:`xattn._estimators.ra`) runs them over groups of rows."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from xattn._core.array import Array, sequence_positions, take_rows
from xattn._core.delegation import ignore_invalid
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import finite_shift, key_logits_in_range, nonzero_divisor

__all__ = ["Keys", "Mixture", "build_mixture", "draw_randomness", "key_side",
           "proposal_samples", "sample_estimates"]


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

class Keys(NamedTuple):
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

def _softmax_terms(keys: Keys, logits: Array, allowed: Array | None) -> tuple[Array, Array]:
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

    With ``upper`` (an upper-triangular (b, b) matrix of ones, :func:`key_side`), blocks
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

def _normalized(keys: Keys, sums: Array, totals: Array) -> Array:
    """``sums / totals``, with 0 where the total is 0 (a row without allowed keys)."""
    return sums / (totals if keys.key_mask is None else nonzero_divisor(keys.xp, totals))

def _gather_keys(keys: Keys, component: Array) -> Array:
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

def key_side(inputs: AttentionInputs, *, biased: bool) -> Keys:
    r""":math:`\hat k = \sqrt{s}\,k`, and the columns :math:`[\hat k_m, -\lVert \hat k_m
    \rVert^2/2]`, so that :math:`[\omega, 1]` times them is :math:`\omega \cdot \hat k_m -
    \lVert \hat k_m \rVert^2/2` in the matrix product itself (no separate pass over the
    (..., rows, M) logits); unbiased RA: the keys stacked for the gather of :math:`\hat
    k_z` and, for 64 keys or more, the block sums of :func:`_cumulative_sum` (not Dask)."""
    xp, batch = inputs.xp, inputs.batch_shape
    root_scale = math.sqrt(inputs.scale)
    k_hat = inputs.k * root_scale
    k_hat_t = xp.matrix_transpose(k_hat)
    with ignore_invalid(xp):  # NumPy: an overflowing norm is inf, quietly
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
    return Keys(xp, root_scale, k_hat, k_hat_t,
                 xp.concat([k_hat_t, -key_half_sq_norm], axis=-2), inputs.v,
                 sequence_positions(inputs.k, axis=-2), inputs.key_mask, batch,
                 stacked_keys, key_offsets, block_sums)

def draw_randomness(inputs: AttentionInputs, generator: Any, num_draws: int, *,
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

class Mixture(NamedTuple):
    """The mixture of a group of queries (eq. 29): its unnormalized weights' sums; biased
    RA keeps the mixture mean, unbiased RA the cumulative weights (for the inverse CDF)."""

    allowed: Array | None  # (..., B, M), None: every key
    total: Array  # (..., B, 1)
    mean: Array | None  # (..., B, D), biased
    cumulative: Array | None  # (..., B, M), unbiased: total * CDF

def build_mixture(keys: Keys, q_group: Array, query_positions: Array | None, *,
             biased: bool) -> Mixture:
    r"""Mixture weights :math:`\pi_{nm} = \mathrm{softmax}_m(\hat q_n \cdot \hat k_m)` over
    the allowed keys (eq. 29), kept as :math:`e^{\hat q_n \cdot \hat k_m - \max}` and their
    sum; biased RA: the mean :math:`\hat q_n + \sum_m \pi_{nm} \hat k_m` (eq. 31)."""
    xp = keys.xp
    allowed = _allowed_keys(xp, keys.key_mask, query_positions, keys.key_positions)
    terms, total = _softmax_terms(keys, q_group @ keys.k_hat_t, allowed)
    if biased:  # one Gaussian at the mixture mean: q_n + sum_m pi_nm k_m   (eq. 31)
        return Mixture(allowed, total, q_group + _normalized(keys, terms @ keys.k_hat, total),
                        None)
    # total * CDF, (..., B, M)
    return Mixture(allowed, total, None, _cumulative_sum(xp, terms, keys.block_sums))

def proposal_samples(keys: Keys, q_group: Array, mixture: Mixture, uniforms: Array | None,
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
            # (the last key's position, an array: a clip to a symbolic length would
            # reach math.isnan under torch.compile)
            component = xp.minimum(component, keys.key_positions[-1])
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

def sample_estimates(keys: Keys, omega: Array, mixture: Mixture,
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
    # a key whose squared norm overflows: the dtype's floor, still attended
    with ignore_invalid(xp):
        logits = key_logits_in_range(xp, omega_extended @ keys.k_hat_t_extended)
    key_terms, key_total = _softmax_terms(keys, logits, row_allowed)  # (..., B G, M), (.., 1)
    return _normalized(keys, key_terms @ keys.v, key_total)  # (..., B G, Dv)
