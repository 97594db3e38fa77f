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
    pad_rows,
)
from xattn._estimators.rf_scan import FeatureMap, finish_partial, state_over_keys

__all__ = ["FLOAT16_CHUNK", "half_readout_sums", "lara_group_rows", "positive_key_sums",
           "positive_readout", "positive_rfa", "project", "rfa_group_rows", "rows_of",
           "trigonometric_rfa"]

def rows_of(x: Array, start: int, stop: int) -> Array:
    """Rows ``start:stop`` (axis -2) of ``x``; ``x`` itself when they are all of them (no
    view: one group is a fixed number of array operations)."""
    return x if (start, stop) == (0, x.shape[-2]) else x[..., start:stop, :]


def project(xp: Any, x: Array, matrix: Array, addend: Array, work: Any) -> Array:
    r"""``x @ matrix + addend`` in ``work``, an exponent's argument: one
    :func:`~xattn._core.delegation.matmul_add` when ``x`` has that dtype; half-precision
    ``x`` and ``matrix``: their product (float32 accumulation, its result rounded to the
    half format, a relative :math:`2^{-11}` for ``float16``), then the float32 addend
    added in float32 (a float32 logit such as :math:`-\lVert \hat k_m \rVert^2/2`
    rounded to the half format would cost its absolute size times the unit roundoff)."""
    if x.dtype == work:
        return matmul_add(x, matrix, addend)
    return xp.astype(x @ matrix, work) + addend


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

    Half-precision keys (``omega_t`` in their format): the projections are a half
    product, the logits :math:`a_{ms}`, their maxima :math:`K_s` and the sums float32,
    and the weights :math:`e^{a_{ms} - K_s} \in [0, 1]` multiply the values in the half
    format (:func:`_key_sums`). The shift is per sample, as in float32: a weight that
    underflows the half format is negligible beside its sample's largest, 1, whatever
    the spread of the logits (a shift shared by the samples would not be: ``float16``
    holds :math:`e^{-17}` at the least).
    """
    k, v, key_mask, half_scale = inputs.k, inputs.v, inputs.key_mask, 0.5 * inputs.scale
    work = inputs.compute_dtype
    sums = None
    for start, stop in stream_bounds(k, -2, rows):
        keys = finite_entries(xp, rows_of(k, start, stop))  # non-finite rows: marked NaN
        # a_ms (a key whose squared norm overflows: the dtype's floor, still attended;
        # NumPy computes the overflow quietly)
        with ignore_invalid(xp):
            minus_half_sq_norm = -half_scale * squared_norms(keys, dtype=work)
            logits = key_logits_in_range(xp, project(xp, keys, omega_t, minus_half_sq_norm,
                                                     work))
        if key_mask is not None:
            logits = xp.where(key_mask[..., start:stop, None], logits, -xp.inf)
        part = _key_sums(xp, logits, finite_entries(xp, rows_of(v, start, stop)),
                         masked=key_mask is not None)
        sums = part if sums is None else _merge_key_sums(xp, sums, part)
    assert sums is not None  # M >= 1: at least one group
    return sums


def _key_sums(xp: Any, logits: Array, values: Array, *,
              masked: bool) -> tuple[Array, Array]:
    r""":math:`K_s` (..., 1, S) and :math:`[A'_s, b'_s]` (..., S, Dv + 1) of one group of
    keys from their logits :math:`a_{ms}` (``-inf`` for a masked key; :math:`K_s = 0`
    for a sample without keys). Half-precision ``values``: the weights rounded to their
    format for the product, the sums float32; ``float16`` keys in products of
    :data:`FLOAT16_CHUNK` (a product's sums at most that many times the largest value,
    below 65504), each with its own :math:`K_s`, merged in float32."""
    length = logits.shape[-2]
    chunk = (FLOAT16_CHUNK if values.dtype == getattr(xp, "float16", None)
             and length > FLOAT16_CHUNK else length)
    if chunk < length:  # (..., J, R, S) and (..., J, R, Dv)
        count, padding = -(-length // chunk), -length % chunk
        logits, values = (xp.reshape(x, (*x.shape[:-2], count, chunk, x.shape[-1]))
                          for x in (pad_rows(xp, logits, 0, padding, -math.inf),
                                    pad_rows(xp, values, 0, padding, 0.0)))
    # K_s is a stabilizer (no gradient): it cancels between the sums and the read-out;
    # -inf for a sample without keys (only with ``masked``: a chunk holds a key)
    raw_max = stop_gradient(xp.max(logits, axis=-2, keepdims=True))
    key_max = finite_shift(xp, raw_max) if masked else raw_max
    weights = xp.exp(logits - key_max)  # e^{a_ms - K_s}, masked keys 0
    if weights.dtype != values.dtype:  # half values: the weights in [0, 1] rounded
        weights = xp.astype(weights, values.dtype)
    # [A'_s, b'_s]: the values' product and the weights' sum, joined at (S, Dv + 1)
    # (no column of ones appended to the (M, Dv) values)
    weighted_values = xp.matrix_transpose(weights) @ values
    if weighted_values.dtype != key_max.dtype:
        weighted_values = xp.astype(weighted_values, key_max.dtype)
    total = xp.sum(weights, axis=-2, keepdims=True, dtype=key_max.dtype)
    sums = xp.concat([weighted_values, xp.matrix_transpose(total)], axis=-1)
    if chunk == length:
        return key_max, sums
    # the chunks' sums at their largest K_s (a chunk without keys: 0)
    group_max = xp.max(raw_max, axis=-3)  # (..., 1, S)
    factors = xp.exp(raw_max - finite_shift(xp, group_max)[..., None, :, :])
    return (finite_shift(xp, group_max),
            xp.sum(xp.matrix_transpose(factors) * sums, axis=-3))


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
    if coefficients is not None and logits.dtype != sums.dtype:
        # half sums: the weights' logarithms join the float32 logits, so that each u_ns
        # in [0, 1] is rounded once (a product of two half numbers may underflow)
        logits = logits + xp.log(coefficients if coefficients.dtype == logits.dtype
                                 else xp.astype(coefficients, logits.dtype))
        coefficients = None
    weights = xp.exp(logits - stop_gradient(xp.max(logits, axis=-1, keepdims=True)))
    if weights.dtype != sums.dtype:  # half sums: the weights in [0, 1] in their format
        weights = xp.astype(weights, sums.dtype)
    if coefficients is not None:
        weights = coefficients * weights
    row = weights @ sums
    # a denominator with keys is >= the weight floor, above the smallest normal number;
    # without keys 0 / tiny = 0
    return ratio_to_last_column(row, xp.finfo(row.dtype).smallest_normal)


def positive_rfa(xp: Any, inputs: Any, omega: Array, rows: int) -> Array:
    r"""Non-causal positive-map RFA, keys and queries in groups of ``rows``.

    Half-precision inputs: the features and the matrix products in their format, the
    logits, maxima and the sums across key groups in float32 (:func:`positive_key_sums`);
    the sums are scaled and rounded to the half format (:func:`half_readout_sums`) for
    the queries' product, and a query's weights :math:`e^{c_{ns} - Q_n} \in [0, 1]`,
    from float32 logits, are rounded to it."""
    dtype, work = inputs.q.dtype, inputs.compute_dtype
    omega_t = xp.matrix_transpose(math.sqrt(inputs.scale) * omega)  # q . sqrt(s) w = q^ . w
    if dtype != work:
        omega_t = xp.astype(omega_t, dtype)
    key_max, sums = positive_key_sums(xp, inputs, omega_t, rows)
    if dtype != work:
        sums = half_readout_sums(xp, sums, dtype)
    out = RowPieces(inputs.num_queries)
    for start, stop in stream_bounds(inputs.q, -2, rows):
        queries = finite_entries(xp, rows_of(inputs.q, start, stop))
        out.put(start, positive_readout(xp, project(xp, queries, omega_t, key_max, work), sums))
    return out.result()


#: Keys per product of non-causal RFA on float16 inputs: a product's sums are float16
#: numbers (largest 65504), at most this many times the largest value (bfloat16 has
#: float32's range: one product)
FLOAT16_CHUNK = 1024


def half_readout_sums(xp: Any, sums: Array, dtype: Any) -> Array:
    """The float32 sums ``[A', b']`` (..., S, Dv + 1) of :func:`positive_key_sums` in the
    half format ``dtype`` for the queries' product: divided by their largest denominator,
    so at most 1 (denominators, each at least 1 / M) and the values' size (numerators);
    the read-out's ratio does not depend on a common factor (0 without keys)."""
    largest = xp.max(sums[..., -1:], axis=-2, keepdims=True)
    return xp.astype(sums / clip_below(largest, xp.finfo(largest.dtype).smallest_normal),
                     dtype)


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
