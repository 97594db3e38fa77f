r"""Random-feature attention without ``causal`` in groups of keys and queries: non-causal
:func:`xattn.rfa` and the shared sums of non-causal :func:`xattn.lara`.

The keys and then the queries go in groups of as many rows as ``working_memory`` bytes
hold (:func:`xattn._core.primitives.group_rows`; :func:`rfa_group_rows` and
:func:`lara_group_rows` count the numbers a row holds). Below the budget the whole
sequence is one group: one product for the keys and one for the queries, a fixed number
of array operations at any length. Above it the key groups are merged by a running
maximum per sample (the online-softmax merge, :func:`xattn._core.primitives.merge_maxima`) and
the queries are read out a group at a time, so the working memory does not grow with
the sequence.

With samples :math:`\omega_s` and :math:`\hat q = \sqrt{s}\,q`, :math:`\hat k =
\sqrt{s}\,k` (Choromanski et al., ICLR 2021; the stabilized form of the theory page on
stabilization):

.. math::

    a_{ms} = \omega_s \cdot \hat k_m - \tfrac12\lVert \hat k_m \rVert^2, \quad
    K_s = \max_m a_{ms}, \quad A'_s = \sum_m e^{a_{ms} - K_s} v_m, \quad
    b'_s = \sum_m e^{a_{ms} - K_s},

    c_{ns} = \omega_s \cdot \hat q_n + K_s, \quad
    y_n = \frac{\sum_s \alpha_{ns} e^{c_{ns} - Q_n} A'_s}
               {\sum_s \alpha_{ns} e^{c_{ns} - Q_n} b'_s}, \quad Q_n = \max_s c_{ns},

with :math:`\alpha_{ns} = 1` for RFA and LARA's importance weights (eq. 28 of Zheng et
al., ICML 2022, whose logits add :math:`\log N(\omega_c; 0, I) - \log q_c(\omega_c)`).
"""

from __future__ import annotations

import math
from typing import Any

from xattn._core.array import Array, stream_bounds
from xattn._core.delegation import (
    clip_below,
    ignore_invalid,
    matmul_add,
    ratio_to_last_column,
    squared_norms,
    stop_gradient,
)
from xattn._core.primitives import (
    RowPieces,
    finite_entries,
    finite_shift,
    group_rows,
    key_logits_in_range,
    merge_maxima,
)
from xattn._estimators.rf_scan import FeatureMap, finish_partial, state_over_keys

__all__ = ["half_key_sums", "half_readout_sums", "lara_group_rows",
           "positive_key_sums", "positive_readout", "positive_rfa", "positive_rfa_half",
           "rfa_group_rows", "rows_of", "trigonometric_rfa"]

def rows_of(x: Array, start: int, stop: int) -> Array:
    """Rows ``start:stop`` (axis -2) of ``x``; ``x`` itself when they are all of them (no
    view: one group is a fixed number of array operations)."""
    return x if (start, stop) == (0, x.shape[-2]) else x[..., start:stop, :]


def positive_key_sums(xp: Any, inputs: Any, omega_t: Array, rows: int) -> tuple[Array, Array]:
    r"""RFA's stabilized key statistics of every key, :math:`K_s` (..., 1, S) and
    :math:`[A'_s, b'_s]` (..., S, Dv + 1) (the module docstring; :math:`b'_s` is the last
    column, the sum of the weights), in
    groups of ``rows`` keys merged by a running maximum per sample (one group when all
    fit).

    ``omega_t`` is :math:`(\sqrt{s}\,\omega)^\top`, (D, S) or (..., D, S), so that
    :math:`a_{ms} = k_m \cdot \sqrt{s}\,\omega_s - \tfrac{s}{2}\lVert k_m \rVert^2 =
    \omega_s \cdot \hat k_m - \lVert \hat k_m \rVert^2/2` without forming
    :math:`\hat k` (a product plus the column of norms, one pass on torch:
    :func:`~xattn._core.delegation.matmul_add`). With ``key_mask`` a sample
    without allowed keys, which happens only when every key is masked, has :math:`K_s =
    0` and sums 0; otherwise :math:`b'_s \ge 1` (its largest term is :math:`e^0`).

    Half-precision keys (``omega_t`` in their format): the products in that format, the
    logits :math:`a_{ms}`, their maxima and the sums in the compute dtype (float32), the
    weights :math:`e^{a_{ms} - K_s}` rounded to the values' format for their product.
    """
    k, v, key_mask, half_scale = inputs.k, inputs.v, inputs.key_mask, 0.5 * inputs.scale
    work = inputs.compute_dtype
    sums = None
    for start, stop in stream_bounds(k, -2, rows):
        keys = finite_entries(xp, rows_of(k, start, stop))  # non-finite rows: marked NaN
        # a_ms (a key whose squared norm overflows: the dtype's floor, still attended;
        # NumPy computes the overflow quietly)
        with ignore_invalid(xp):
            minus_half_sq_norm = squared_norms(keys, dtype=work, factor=-half_scale)
            if keys.dtype == work:
                logits = matmul_add(keys, omega_t, minus_half_sq_norm)
            else:  # half keys: their product rounded, the sum in the compute dtype
                logits = keys @ omega_t + minus_half_sq_norm
            logits = key_logits_in_range(xp, logits)
        # K_s is a stabilizer (no gradient): it cancels between the sums and the read-out
        if key_mask is not None:
            logits = xp.where(key_mask[..., start:stop, None], logits, -xp.inf)
            key_max = finite_shift(xp, stop_gradient(xp.max(logits, axis=-2, keepdims=True)))
        else:  # K_s = max_m a_ms is finite: at least one key
            key_max = stop_gradient(xp.max(logits, axis=-2, keepdims=True))
        weights = xp.exp(logits - key_max)  # e^{a_ms - K_s}, masked keys 0
        # [A'_s, b'_s]: the values' product and the weights' sum, joined at (S, Dv + 1)
        # (no column of ones appended to the (M, Dv) values)
        values = finite_entries(xp, rows_of(v, start, stop))
        weighted_values = xp.matrix_transpose(
            weights if values.dtype == work else xp.astype(weights, values.dtype)) @ values
        if weighted_values.dtype != work:
            weighted_values = xp.astype(weighted_values, work)
        part = (key_max, xp.concat(
            [weighted_values, xp.matrix_transpose(xp.sum(weights, axis=-2, keepdims=True))],
            axis=-1))
        sums = part if sums is None else _merge_key_sums(xp, sums, part)
    assert sums is not None  # M >= 1: at least one group
    return sums


def _merge_key_sums(xp: Any, first: tuple[Array, Array],
                    second: tuple[Array, Array]) -> tuple[Array, Array]:
    """The key statistics of two disjoint groups of keys (as
    :func:`xattn.features.merge_key_statistics`; sums of an empty group are 0)."""
    maxima = (xp.where(xp.matrix_transpose(part[1][..., -1:]) == 0, -xp.inf, part[0])
              for part in (first, second))
    _, key_max, (first_factor, second_factor) = merge_maxima(xp, *maxima)
    return key_max, (xp.matrix_transpose(first_factor) * first[1]
                     + xp.matrix_transpose(second_factor) * second[1])


def positive_readout(xp: Any, logits: Array, sums: Array,
                     coefficients: Array | None = None) -> Array:
    r""":math:`y_n = \sum_s u_{ns} A'_s / \sum_s u_{ns} b'_s`, :math:`u_{ns} = \alpha_{ns}
    e^{c_{ns} - Q_n}`, :math:`Q_n = \max_s c_{ns}` (the shift cancels), for the logits
    :math:`c_{ns}` (..., B, S) of a group of queries and the sums :math:`[A'_s, b'_s]` of
    :func:`positive_key_sums` (one product gives numerator and denominator);
    :math:`\alpha_{ns}` = ``coefficients`` (LARA's positive weights), 1 if None. A query
    without allowed keys (every sum 0) reads 0."""
    weights = xp.exp(logits - stop_gradient(xp.max(logits, axis=-1, keepdims=True)))
    if coefficients is not None:
        weights = coefficients * weights
    row = weights @ sums
    # a denominator with keys is >= the weight floor, above the smallest normal number;
    # without keys 0 / tiny = 0
    return ratio_to_last_column(row, xp.finfo(row.dtype).smallest_normal)


def positive_rfa(xp: Any, inputs: Any, omega: Array, rows: int) -> Array:
    """Non-causal positive-map RFA, keys and queries in groups of ``rows``."""
    omega_t = xp.matrix_transpose(math.sqrt(inputs.scale) * omega)  # q . sqrt(s) w = q^ . w
    key_max, sums = positive_key_sums(xp, inputs, omega_t, rows)
    out = RowPieces(inputs.num_queries)
    for start, stop in stream_bounds(inputs.q, -2, rows):
        queries = finite_entries(xp, rows_of(inputs.q, start, stop))
        out.put(start, positive_readout(xp, matmul_add(queries, omega_t, key_max), sums))
    return out.result()


def half_key_sums(xp: Any, inputs: Any, omega_t: Array, rows: int) -> tuple[Array, Array]:
    r"""The key statistics of half-precision keys with a rank-one stabilizer, in groups of
    ``rows`` keys: ``(B (..., 1, 1), [A, b] (..., S, Dv + 1))`` in float32.

    With :math:`p_{ms} = \omega_s \cdot \hat k_m` (``omega_t`` carries
    :math:`\sqrt{s}`), :math:`\beta_m = \max_s p_{ms} - \lVert \hat k_m
    \rVert^2/2` and
    :math:`B = \max_m \beta_m`, every key term factors as :math:`e^{a_{ms}} = e^B\,
    \psi_{ms}\, w_m` with the feature :math:`\psi_{ms} = e^{p_{ms} - \max_s p_{ms}}` and
    the weight :math:`w_m = e^{\beta_m - B}`, both in [0, 1]: :math:`A_s = \sum_m
    \psi_{ms} w_m v_m` and :math:`b_s = \sum_m \psi_{ms} w_m` are two products of half
    operands (accumulated in float32 by the libraries that multiply half matrices fast),
    the logits' maxima and the exponents of the weights in float32. Groups merge by their
    :math:`B` (:func:`~xattn._core.primitives.merge_maxima`); :math:`e^B` and the query
    constant cancel in the read-out's ratio."""
    k, v, key_mask, half_scale = inputs.k, inputs.v, inputs.key_mask, 0.5 * inputs.scale
    work = inputs.compute_dtype
    merged = None
    for start, stop in stream_bounds(k, -2, rows):
        keys = finite_entries(xp, rows_of(k, start, stop))
        with ignore_invalid(xp):  # an overflowing norm or projection (the floor below)
            projections = keys @ omega_t  # p_ms, half
            largest = stop_gradient(xp.max(projections, axis=-1, keepdims=True))
            key_max = key_logits_in_range(xp, xp.astype(largest, work)
                                          - squared_norms(keys, dtype=work, factor=half_scale))
            centred = xp.where(xp.isfinite(largest), projections - largest, 0.0)
        if key_mask is not None:
            key_max = xp.where(key_mask[..., start:stop, None], key_max, -xp.inf)
        values = finite_entries(xp, rows_of(v, start, stop))
        # bfloat16 (float16 inputs are computed in float32): one product of the group's
        # keys, its sums in float32
        group_max = stop_gradient(xp.max(key_max, axis=-2, keepdims=True))  # B, -inf: none
        key_weights = xp.astype(xp.exp(key_max - finite_shift(xp, group_max)), keys.dtype)
        features_t = xp.matrix_transpose(xp.exp(centred))  # psi^T (..., S, R)
        part = (group_max, xp.astype(xp.concat([features_t @ (key_weights * values),
                                                features_t @ key_weights], axis=-1), work))
        if merged is None:
            merged = part
        else:
            maximum, _, (first, second) = merge_maxima(xp, merged[0], part[0])
            merged = (maximum, first * merged[1] + second * part[1])
    assert merged is not None  # M >= 1: at least one group
    return merged




def half_readout_sums(xp: Any, sums: Array, dtype: Any) -> Array:
    """The float32 sums ``[A, b]`` (..., S, Dv + 1) of :func:`half_key_sums` in the half
    format ``dtype`` for the queries' product: divided by their largest denominator, so at
    most 1 (denominators) and the values' size (numerators); the read-out's ratio does not
    depend on a common factor (0 without keys), so none of its gradient passes through
    that factor (where the factor is tiny, its derivative's square of it underflowed and
    made every gradient NaN)."""
    largest = stop_gradient(xp.max(sums[..., -1:], axis=-2, keepdims=True))
    return xp.astype(sums / clip_below(largest, xp.finfo(largest.dtype).smallest_normal),
                     dtype)


def positive_rfa_half(xp: Any, inputs: Any, omega: Array, rows: int) -> Array:
    r"""Non-causal positive-map RFA of half-precision inputs: features and products in
    the input dtype, maxima and the sums across key groups in float32.

    The keys by :func:`half_key_sums`; a query reads them as :math:`y_n = \sum_s
    \phi_{ns} A_s / \sum_s \phi_{ns} b_s` with :math:`\phi_{ns} = e^{p_{ns} - \max_s
    p_{ns}}`, :math:`p_{ns} = \omega_s \cdot \hat q_n`: one product of half features
    and the half-rounded sums (the shifts, :math:`e^B` and :math:`e^{-\lVert \hat q_n
    \rVert^2/2}/S` cancel between numerator and denominator)."""
    dtype = inputs.q.dtype
    omega_t = xp.astype(xp.matrix_transpose(math.sqrt(inputs.scale) * omega), dtype)
    _, sums = half_key_sums(xp, inputs, omega_t, rows)
    sums = half_readout_sums(xp, sums, dtype)
    # a row without keys (every key masked) reads 0 / floor = 0 (the half format's
    # smallest normal number: XLA flushes subnormals to 0)
    floor = xp.finfo(dtype).smallest_normal
    out = RowPieces(inputs.num_queries)
    for start, stop in stream_bounds(inputs.q, -2, rows):
        projections = finite_entries(xp, rows_of(inputs.q, start, stop)) @ omega_t  # p_ns
        features = xp.exp(projections - stop_gradient(xp.max(projections, axis=-1,
                                                             keepdims=True)))
        out.put(start, ratio_to_last_column(features @ sums, floor))
    return out.result()


def trigonometric_rfa(xp: Any, inputs: Any, mapping: FeatureMap,
                      rows: int) -> tuple[Array, Array]:
    """Non-causal trigonometric RFA, in groups of ``rows``: the output and the clamped
    rows."""
    root_scale = math.sqrt(inputs.scale)
    state = state_over_keys(xp, mapping, inputs.k, inputs.v, root_scale=root_scale,
                            key_mask=inputs.key_mask, first_key=0, start=0,
                            stop=inputs.num_keys, chunk_size=rows,
                            batch_shape=inputs.batch_shape)
    out, clamped = RowPieces(inputs.num_queries), RowPieces(inputs.num_queries)
    for start, stop in stream_bounds(inputs.q, -2, rows):
        queries = mapping.queries(root_scale * finite_entries(xp, rows_of(inputs.q, start,
                                                                          stop)))
        rows_out, invalid = finish_partial(xp, mapping.readout(queries, state), guard=True)
        out.put(start, rows_out)
        clamped.put(start, invalid)
    return out.result(), clamped.result()


#: Numbers per row and proposal that a group of non-causal LARA holds at once (the
#: logits, weights and affinities of a query, with their temporaries), besides a row of
#: q or k and two of v or the output: one group, and several (where the affinities are
#: recomputed from the 2C-wide logits of [q~; omega]). Measured on NumPy, float32, D = Dv
#: = 64: 4.1 C + D + 2 Dv per row with one group (C = 64, decoupled), 5.6 C + D + 2 Dv
#: (C = 256); 8.5 C + D + 2 Dv with groups (C = 16, D = Dv = 32).
LARA_ROW_NUMBERS, LARA_GROUPS_ROW_NUMBERS = 5, 9


def rfa_group_rows(inputs: Any, num_features: int, itemsize: int, working_memory: int,
                   chunk_size: int | None) -> int:
    """Rows per group of non-causal RFA with F = ``num_features`` features: F-wide logits,
    weights and their temporaries, a row of q or k, of v and of the output. Measured on
    NumPy, float32, D = Dv = 64: 2.3 to 3.3 F + D + Dv per row with one group (the
    positive, hyperbolic and trigonometric maps at S = 64 and 256), 4.1 F + D + Dv with
    groups and their merges (S = 256)."""
    return group_rows(length=max(inputs.num_queries, inputs.num_keys),
                      batch_size=math.prod(inputs.batch_shape),
                      row_numbers=5 * num_features + inputs.q.shape[-1]
                      + inputs.v.shape[-1] + 2, itemsize=itemsize,
                      working_memory=working_memory, chunk_size=chunk_size)


def lara_group_rows(inputs: Any, num_samples: int, working_memory: int,
                    chunk_size: int | None) -> int:
    """Rows per group of non-causal LARA with C = ``num_samples`` proposals
    (:data:`LARA_ROW_NUMBERS`)."""
    length = max(inputs.num_queries, inputs.num_keys)
    sizes = dict(length=length, batch_size=math.prod(inputs.batch_shape),
                 itemsize=inputs.xp.finfo(inputs.compute_dtype).bits // 8,
                 working_memory=working_memory, chunk_size=chunk_size)
    row_width = inputs.q.shape[-1] + 2 * inputs.v.shape[-1]
    rows = group_rows(row_numbers=LARA_ROW_NUMBERS * num_samples + row_width, **sizes)
    if rows < length:  # groups: the affinities are recomputed from 2C-wide logits
        rows = group_rows(row_numbers=LARA_GROUPS_ROW_NUMBERS * num_samples + row_width,
                          **sizes)
    return rows
