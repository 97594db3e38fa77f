"""LARA's parts (Zheng et al., 2022, *Linear Complexity Randomized Self-attention
Mechanism*, section 4): the C proposals (their means from segments of the queries and
keys, or given), one sample from each, and the pass over a piece of queries that weighs
the samples by multiple importance (eqs. 13 and 14). :func:`xattn.lara`
(:mod:`xattn._estimators.lara`) streams the queries through :func:`query_pass`."""

from __future__ import annotations

from typing import Any

from xattn._core.array import Array
from xattn._core.delegation import matmul_add, stop_gradient
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import (
    RowPieces,
    finite_entries,
    masked_softmax,
)
from xattn._estimators.importance import (
    WEIGHT_FLOOR,
    QuerySoftmax,
    importance_weights,
    own_proposal_weights,
)
from xattn._estimators.lara_causal import (
    query_proposal_affinity,
)
from xattn._estimators.rf_groups import (
    positive_key_sums,
    positive_readout,
    rows_of,
)
from xattn._estimators.rf_scan import stream_bounds
from xattn._estimators.segments import segment_means
from xattn.random import as_generator

__all__ = ["HALF_SUMS_RANGE", "build_proposals", "draw_samples", "query_pass",
           "query_pass_half"]

#: How far below the largest a sample's offset K_c + l_c scales its key sums in the half
#: path (:func:`query_pass_half`): e^-40 = 4e-18, so that a row's largest term, times
#: the weight floor, stays above 1e-26, far above bfloat16's smallest normal number
#: (1.2e-38); a larger gap goes into the query logits.
HALF_SUMS_RANGE = 40.0


def _proposal_means(xp: Any, proposal: str, query_landmarks: Array, key_landmarks: Array,
                    key_segment_sizes: Array, k: Array, root_scale: float,
                    key_mask: Array | None) -> Array:
    r""":math:`\mu_c` (..., C, D) for each proposal family (Appendix G.3.1)."""
    if proposal == "standard":  # mu_c = 0: LARA reduces to RFA
        return xp.zeros_like(query_landmarks)
    if proposal == "segment":  # eq. 34
        return query_landmarks + key_landmarks
    if proposal == "key_attention":  # eq. 33: q~_c + sum_m softmax_m(q~_c . k_m) k_m, O(CM)
        allowed = None if key_mask is None else key_mask[..., None, :]
        if k.dtype != query_landmarks.dtype:  # half keys: this proposal in float32
            k = xp.astype(k, query_landmarks.dtype)
        # with k^_m = sqrt(s) k_m, folded into the (C, D) landmarks and the (C, D) result
        attention = masked_softmax(xp, (root_scale * query_landmarks) @ xp.matrix_transpose(k),
                                    allowed, axis=-1)
        return query_landmarks + root_scale * (attention @ k)
    # "landmark_attention", eq. 35: q~_c + sum_c' softmax_c'(k~_c . k~_c') k~_c', O(C^2)
    nonempty = (key_segment_sizes > 0)[..., None, :]  # empty key segments take no part
    attention = masked_softmax(xp, key_landmarks @ xp.matrix_transpose(key_landmarks),
                                nonempty, axis=-1)
    return query_landmarks + attention @ key_landmarks

def build_proposals(inputs: AttentionInputs, proposal: str, num_samples: int,
               grid: tuple[int, int] | None, pools: tuple[int, int] | None,
               root_scale: float, supplied_means: Array | None) -> tuple[Array, Array]:
    r"""The landmarks :math:`\tilde q_c` and the proposal means :math:`\mu_c`, (..., C, D).

    Landmarks are the means of C segments of the allowed queries and keys (Appendix
    G.3.1): contiguous runs, or the bins of 2-D adaptive average pooling on an image grid
    (Appendix H), of the scaled inputs :math:`\hat q, \hat k`. ``supplied_means`` (the
    caller's, in the compute dtype) replace the means of the proposal family. Half inputs
    give means in their format (summed in float32 by the libraries), used in the compute
    dtype.
    """
    xp, device, work = inputs.xp, inputs.device, inputs.compute_dtype
    query_landmarks, _ = segment_means(xp, inputs.q, inputs.query_mask, num_samples, device,
                                       grid=grid, pools=pools)
    if query_landmarks.dtype != work:
        query_landmarks = xp.astype(query_landmarks, work)
    query_landmarks = root_scale * query_landmarks  # q~_c, the means of q^
    if supplied_means is not None:
        return query_landmarks, supplied_means
    key_landmarks, key_segment_sizes = segment_means(xp, inputs.k, inputs.key_mask,
                                                     num_samples, device, grid=grid,
                                                     pools=pools)
    if key_landmarks.dtype != work:
        key_landmarks = xp.astype(key_landmarks, work)
    key_landmarks = root_scale * key_landmarks  # k~_c, the means of k^
    proposal_means = _proposal_means(xp, proposal, query_landmarks, key_landmarks,
                                     key_segment_sizes, inputs.k, root_scale, inputs.key_mask)
    return query_landmarks, proposal_means

def draw_samples(inputs: AttentionInputs, proposal_means: Array, num_samples: int, *,
             deterministic: bool, noise_scale: float, rng: Any) -> Array:
    r"""One sample per proposal, :math:`\omega_c = \mu_c + \sigma \epsilon_c`
    (deterministic: :math:`\omega_c = \mu_c`), (*batch, C, D); the weights stay those of
    :math:`N(\mu_c, I)` whatever :math:`\sigma` = ``noise_scale``."""
    xp = inputs.xp
    sample_shape = (*inputs.batch_shape, num_samples, inputs.q.shape[-1])
    if deterministic:
        omega = proposal_means
    else:
        noise = as_generator(rng).normal(xp, sample_shape, dtype=inputs.compute_dtype,
                                         device=inputs.device)
        omega = proposal_means + (noise if noise_scale == 1.0 else noise_scale * noise)
    return xp.broadcast_to(omega, sample_shape)

def query_pass(inputs: AttentionInputs, query_landmarks: Array, proposal_means: Array,
                omega: Array, *, weighting: str, beta: float, root_scale: float,
                rows: int) -> Array:
    r"""The estimator of eq. 28: the key statistics, then the queries, in groups of
    ``rows`` (one group when all fit).

    Per group of queries: the logits :math:`e_{nc} = \omega_c \cdot \hat q_n + K_c -
    \tfrac12\lVert\omega_c\rVert^2 + \tfrac12\lVert\omega_c - \mu_c\rVert^2` (the last
    two terms are :math:`\log N(\omega_c; 0, I) - \log q_c(\omega_c)`), the weights
    :math:`\alpha_{nc}` and the ratio :math:`\sum_c u_{nc} A'_c / \sum_c u_{nc} b'_c`.
    The query affinities of the decoupled and coupled weightings need a softmax over all
    queries, so a first pass (:class:`~xattn._estimators.importance.QuerySoftmax`) walks the
    groups before this one. Its (N, C) exponentials are kept for the second pass when
    there is one group; with several they are recomputed, in one product of the queries
    with the stacked :math:`[\tilde q; \omega]`, so that working memory stays
    independent of N.
    """
    xp, q, query_mask = inputs.xp, inputs.q, inputs.query_mask
    num_samples = omega.shape[-2]
    # what multiplies q or k carries sqrt(s): q . (sqrt(s) omega_c) = q^ . omega_c
    projection_t = xp.matrix_transpose(root_scale * omega)
    key_max, sums = positive_key_sums(xp, inputs, projection_t, rows)
    # w_c: the balance heuristic of proposal c at its own sample omega_c (eq. 36)
    log_density_ratio, own_weight = own_proposal_weights(xp, omega, proposal_means)
    logit_offset = key_max + log_density_ratio  # (..., 1, C)

    groups = stream_bounds(q, -2, rows)
    affinities = None
    recompute = False
    if weighting not in ("balance", "query_proposal"):  # r_nc = softmax_n of q^_n . q~_c
        # and q . (sqrt(s) q~_c) = q^ . q~_c
        scaled_landmarks = root_scale * query_landmarks
        recompute = len(groups) > 1
        affinities = QuerySoftmax(xp, q, scaled_landmarks, query_mask, groups,
                                  keep_exponentials=not recompute)
        if recompute:  # the second pass: one GEMM of q against the stacked [q~; omega]
            landmarks_t = xp.broadcast_to(xp.matrix_transpose(scaled_landmarks),
                                          projection_t.shape)
            projection_t = xp.concat([landmarks_t, projection_t], axis=-1)
    out = RowPieces(inputs.num_queries)
    for index, (start, stop) in enumerate(groups):
        queries = finite_entries(xp, rows_of(q, start, stop))  # rows marked NaN by lara
        scores = None
        if recompute:  # s_nc, then the logits of omega
            logits = queries @ projection_t
            scores, logits = logits[..., :num_samples], logits[..., num_samples:]
            logits = logits + logit_offset
        else:  # one pass for the product and the offset (torch: baddbmm)
            logits = matmul_add(queries, projection_t, logit_offset)
        affinity = None if affinities is None else affinities.piece(index, scores)
        if weighting == "query_proposal":  # r_nc = softmax_c of q^_n . mu_c, then eq. 38
            affinity = (query_proposal_affinity(xp, root_scale * queries,
                                                proposal_means), 1.0)
        weights = importance_weights(xp, own_weight, affinity,
                                     "decoupled" if weighting == "query_proposal" else weighting,
                                     beta, as_row=True)  # alpha_nc
        rows_out = positive_readout(xp, logits, sums, coefficients=weights)
        if query_mask is not None:
            rows_out = xp.where(query_mask[..., start:stop, None], rows_out, 0.0)
        out.put(start, rows_out)
    return out.result()


def query_pass_half(inputs: AttentionInputs, query_landmarks: Array | None,
                    proposal_means: Array, omega: Array, *, weighting: str, beta: float,
                    root_scale: float, rows: int) -> Array:
    r""":func:`query_pass` for half-precision q, k and v: the matrix products, the
    features and the importance weights in their format; the key logits, their maxima,
    the sums across key groups and the softmax totals over queries in float32.

    The key statistics are those of the float32 path, each sample shifted by its own
    maximum :math:`K_c` (:func:`~xattn._estimators.rf_groups.positive_key_sums`: the
    products :math:`\hat k_m \cdot \omega_c` and :math:`\sum_m e^{a_{mc} - K_c} v_m` of
    half operands, the logits :math:`a_{mc}` and the sums in float32): :math:`b'_c \ge
    1`, :math:`|A'_c|` at most the values' size times the number of keys. A sample's
    offset :math:`o_c = K_c + \ell_c`, with :math:`\ell_c = \log N(\omega_c; 0, I) -
    \log q_c(\omega_c)`, less the largest (which cancels in the ratio), is split in two:
    down to ``-HALF_SUMS_RANGE`` it scales the float32 sums (with ``"balance"`` the
    weight :math:`\alpha_c = w_c` too), which are then rounded to the half format once
    (:math:`A''_c, b''_c`);
    what lies further below joins the query logits :math:`p_{nc} = \omega_c \cdot \hat
    q_n` in the same half product (0 for every sample but those far below the others).
    The offsets spread widely where a segment holds a large query or key (LARA's means
    are those of the segments), and one shift for every sample (RFA's rank-one :math:`B`)
    would let that sample's sums, or all the others', underflow; here a sample that
    dominates a row is read against its own sums. A query's features :math:`\phi_{nc} =
    e^{p_{nc} - \max_c p_{nc}}` and weights :math:`\alpha_{nc}` are in the half format,
    the weights from the half affinities of
    :class:`~xattn._estimators.importance.QuerySoftmax`, whose totals :math:`Z_c` are
    float32: :math:`y_n = \sum_c \alpha_{nc} \phi_{nc} A''_c / \sum_c \alpha_{nc}
    \phi_{nc} b''_c`, as :func:`query_pass` up to rounding.
    """
    xp, q, query_mask = inputs.xp, inputs.q, inputs.query_mask
    dtype, work = q.dtype, inputs.compute_dtype
    num_samples = omega.shape[-2]
    projection_t = xp.astype(xp.matrix_transpose(root_scale * omega), dtype)
    key_max, sums = positive_key_sums(xp, inputs, projection_t, rows)  # float32
    log_density_ratio, own_weight = own_proposal_weights(xp, omega, proposal_means)
    # o_c = K_c + l_c against the largest (it cancels): down to -HALF_SUMS_RANGE it scales
    # the float32 sums, what lies below (a sample far below the others) joins the logits
    offset = key_max + log_density_ratio  # (..., 1, C), float32
    offset = offset - stop_gradient(xp.max(offset, axis=-1, keepdims=True))
    in_sums = xp.clip(offset, min=-HALF_SUMS_RANGE)
    in_logits = xp.astype(offset - in_sums, dtype)  # 0 but for such samples
    scale = xp.exp(in_sums)
    floor = WEIGHT_FLOOR  # bfloat16 holds it (float16 inputs are computed in float32)
    if weighting == "balance":  # alpha_c = w_c, the same for every query
        scale = scale * importance_weights(xp, own_weight, None, weighting, beta,
                                           as_row=True, floor=floor)
    sums = xp.astype(xp.matrix_transpose(scale) * sums, dtype)
    own_weight = xp.astype(own_weight, dtype)

    groups = stream_bounds(q, -2, rows)
    affinities = None
    recompute = False
    if weighting in ("decoupled", "coupled"):  # r_nc = softmax_n of q^_n . q~_c
        assert query_landmarks is not None  # segments: the landmarks
        scaled_landmarks = xp.astype(root_scale * query_landmarks, dtype)
        recompute = len(groups) > 1
        affinities = QuerySoftmax(xp, q, scaled_landmarks, query_mask, groups,
                                  keep_exponentials=not recompute, total_dtype=work)
        if recompute:  # the second pass: one product of q and the stacked [q~; omega]
            landmarks_t = xp.broadcast_to(xp.matrix_transpose(scaled_landmarks),
                                          projection_t.shape)
            projection_t = xp.concat([landmarks_t, projection_t], axis=-1)
    means_t = None
    if weighting == "query_proposal":  # q . (sqrt(s) mu_c) = q^ . mu_c
        means_t = xp.astype(xp.matrix_transpose(root_scale * proposal_means), dtype)
    out = RowPieces(inputs.num_queries)
    for index, (start, stop) in enumerate(groups):
        queries = finite_entries(xp, rows_of(q, start, stop))  # rows marked NaN by lara
        scores = None
        if recompute:  # s_nc, then p_nc
            logits = queries @ projection_t
            scores, logits = logits[..., :num_samples], logits[..., num_samples:] + in_logits
        else:  # p_nc plus the offsets left out of the sums (torch: one baddbmm)
            logits = matmul_add(queries, projection_t, in_logits)
        weights = None  # "balance": in the sums
        if weighting != "balance":
            affinity = None if affinities is None else affinities.piece(index, scores)
            if means_t is not None:  # r_nc = softmax_c of q^_n . mu_c: C terms a row
                proposal_scores = queries @ means_t
                exponential = xp.exp(proposal_scores - stop_gradient(
                    xp.max(proposal_scores, axis=-1, keepdims=True)))
                total = xp.sum(exponential, axis=-1, keepdims=True, dtype=work)
                affinity = (exponential * xp.astype(1.0 / total, dtype), 1.0)
            weights = importance_weights(
                xp, own_weight, affinity,
                "decoupled" if weighting == "query_proposal" else weighting, beta,
                as_row=True, floor=floor)  # alpha_nc
            if weights.dtype != dtype:  # "coupled": its formula in float32
                weights = xp.astype(weights, dtype)
        rows_out = positive_readout(xp, logits, sums, coefficients=weights)
        if query_mask is not None:
            rows_out = xp.where(query_mask[..., start:stop, None], rows_out, 0.0)
        out.put(start, rows_out)
    return out.result()
