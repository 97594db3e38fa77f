r"""Windowed RFA: an exact local band and attention sinks, random features for the rest.

For query :math:`n` the keys split into an exact set :math:`E_n` and the rest
:math:`R_n`:

.. math::

    E_n = \{m : |n - m| \le w\} \cup \{m : m < K\}, \qquad
    y_n = \frac{\sum_{m \in E_n} e^{\hat q_n \cdot \hat k_m} v_m
                + \sum_{m \in R_n} \hat\kappa(\hat q_n, \hat k_m) v_m}
               {\sum_{m \in E_n} e^{\hat q_n \cdot \hat k_m}
                + \sum_{m \in R_n} \hat\kappa(\hat q_n, \hat k_m)}

with :math:`w` = ``window``, :math:`K` = ``sinks`` and :math:`\hat\kappa` the
random-feature estimate of :math:`e^{\hat q \cdot \hat k}` (an unbiased one for the
positive, hyperbolic and trigonometric maps), restricted to allowed keys (``key_mask``;
``causal``: :math:`m \le n`, so the band becomes :math:`n - w \le m \le n`). This is the
sparse + low-rank split of Scatterbrain (Chen et al., NeurIPS 2021) with the attention
sinks of Xiao et al. (2023).

Nothing is counted twice and nothing is subtracted: :math:`R_n` is the union of the keys
:math:`m \le n - w - 1` and :math:`m \ge n + w + 1` (:math:`m \ge K`), whose random-feature
sums are prefix and suffix sums computed directly (:func:`xattn._rf_scan.scan_partials`
with offset :math:`w + 1`), never totals minus band terms. The band is computed in blocks
of queries against the keys within :math:`w` of the block (memory
``O(block_size * (block_size + 2w + K))``, never an ``N x M`` mask). The exact and the
random-feature parts are combined with one shift per query, the largest log-term of
either, without an epsilon.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from xattn._array import Array, AttentionInputs
from xattn._primitives import RowPieces, finite_entries, finite_shift, join, value_columns
from xattn._rf_scan import (
    FeatureMap,
    Partial,
    combine_partials,
    finish_partial,
    scan_partials,
    state_over_keys,
)

__all__ = ["windowed_rfa"]


def _exact_partial(xp: Any, inputs: AttentionInputs, start: int, stop: int, window: int,
                   sinks: int, causal: bool) -> Partial | None:
    """Exact sums of queries ``start:stop`` over their band and sink keys (None if none)."""
    k, v, key_mask = inputs.k, inputs.v, inputs.key_mask
    num_keys = k.shape[-2]
    device = array_api_compat.device(k)
    if window:
        low, high = max(0, start - window), min(num_keys, (stop if causal else stop + window))
        low = min(low, high)
    else:
        low = high = min(sinks, num_keys)
    # the band slice holds every band key of the block; sink keys outside it come apart
    ranges = [(0, min(sinks, low)), (low, high)]
    if not causal:
        ranges.append((max(high, low), sinks))
    ranges = [(a, b) for a, b in ranges if a < b]
    if not ranges:
        return None
    keys = finite_entries(xp, join(xp, [k[..., a:b, :] for a, b in ranges], -2))
    values = value_columns(xp, join(xp, [v[..., a:b, :] for a, b in ranges], -2))
    positions = join(xp, [xp.arange(a, b, device=device) for a, b in ranges], -1)
    queries = finite_entries(xp, inputs.q[..., start:stop, :])
    scores = (inputs.scale * queries) @ xp.matrix_transpose(keys)
    queries = xp.arange(start, stop, device=device)[:, None]
    allowed = positions[None, :] < sinks
    if window:
        distance = queries - positions[None, :]
        in_band = (distance <= window) & (distance >= -window)
        allowed = allowed | in_band
    if causal:
        allowed = allowed & (positions[None, :] <= queries)
    if key_mask is not None:
        allowed = allowed & join(xp, [key_mask[..., a:b] for a, b in ranges], -1)[..., None, :]
    scores = xp.where(allowed, scores, -xp.inf)
    shift = xp.max(scores, axis=-1, keepdims=True)
    sums = xp.exp(scores - finite_shift(xp, shift)) @ values
    return shift, sums, sums[..., -1:]


def windowed_rfa(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, *, window: int,
                 sinks: int, causal: bool, block_size: int, chunk_size: int,
                 guard: bool) -> tuple[Array, Array | None]:
    """RFA with the band ``|n - m| <= window`` and the keys ``m < sinks`` exact.

    ``mapping`` is a feature map of :mod:`xattn._rf_scan`. Returns the output (..., N, Dv)
    and, with ``guard``, the rows whose denominators were clamped.

    Without ``causal`` the keys after the band, ``m >= n + w + 1``, are summed by a pass
    from the last block back before the forward pass: the numerators of that pass wait in
    the output's own rows (:class:`xattn._primitives.RowPieces`), its shifts, denominators
    and weights in three columns beside them, and each block of the forward pass
    replaces its rows with the finished output. Memory is the output, those three numbers
    per query and a working set per block (the result of every block is joined as
    :class:`~xattn._primitives.RowPieces` does).
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    root_scale = math.sqrt(inputs.scale)
    blocks = [(start, min(start + block_size, num_queries))
              for start in range(0, num_queries, block_size)]
    out = RowPieces(num_queries)
    suffix = None  # shift, denominator and weight of the partials over the keys after the band
    if window and not causal:  # the keys m >= n + w + 1, from the last block back
        suffix = RowPieces(num_queries)
        backward = scan_partials(xp, mapping, q, k, v, root_scale=root_scale,
                                 key_mask=inputs.key_mask, first_key=sinks,
                                 offset=window + 1, reverse=True, block_size=block_size,
                                 chunk_size=chunk_size, batch_shape=inputs.batch_shape)
        for (start, _), (shift, sums, weight) in zip(reversed(blocks), backward, strict=True):
            out.put(start, sums[..., :-1])
            suffix.put(start, xp.concat([shift, sums[..., -1:], weight], axis=-1))
    forward = None
    if window or causal:  # the keys m <= n - (w + 1) (m <= n without a band, causal)
        forward = scan_partials(xp, mapping, q, k, v, root_scale=root_scale,
                                key_mask=inputs.key_mask, first_key=sinks,
                                offset=window + 1 if window else 0, reverse=False,
                                block_size=block_size, chunk_size=chunk_size,
                                batch_shape=inputs.batch_shape)
    state = None
    if not window and not causal:  # sinks only: every key m >= K, for every query
        state = state_over_keys(xp, mapping, k, v, root_scale=root_scale,
                                key_mask=inputs.key_mask, first_key=sinks,
                                start=min(sinks, num_keys), stop=num_keys,
                                chunk_size=chunk_size, batch_shape=inputs.batch_shape)
    clamped = RowPieces(num_queries) if guard else None
    for start, stop in blocks:
        q_hat = root_scale * finite_entries(xp, q[..., start:stop, :])
        constant = mapping.query_constant(q_hat)  # makes the estimate e^{q.k} itself
        random_parts: list[Partial] = []
        if forward is not None:
            random_parts.append(next(forward))
        if suffix is not None:  # read before the block's rows are replaced below
            columns = suffix.get(start, stop)
            sums = xp.concat([out.get(start, stop), columns[..., 1:2]], axis=-1)
            random_parts.append((columns[..., :1], sums, columns[..., 2:]))
        if state is not None:
            random_parts.append(mapping.readout(mapping.queries(q_hat), state))
        partials = [(shift + constant, sums, weight) for shift, sums, weight in random_parts]
        exact = _exact_partial(xp, inputs, start, stop, window, sinks, causal)
        if exact is not None:
            partials.append(exact)
        rows, invalid = finish_partial(xp, combine_partials(xp, partials), guard=guard)
        out.put(start, rows)
        if clamped is not None:
            clamped.put(start, invalid)
    return out.result(), None if clamped is None else clamped.result()
