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
sums are prefix and suffix sums computed directly (:func:`xattn._estimators.rf_scan.scan_partials`
with offset :math:`w + 1`), never totals minus band terms. The exact part is computed
in chunks of queries (:mod:`xattn._estimators.band`) and its sums added to the random
features' under one shift per query, without an epsilon. A state's prefill and steps
(:mod:`xattn._estimators.decode`) compute their band and sink slots by the same
:func:`~xattn._estimators.band.exact_partial`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import array_api_compat

from xattn._core.array import Array
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import RowPieces, finite_entries, finite_inputs
from xattn._estimators.band import (
    BAND_CHUNK_MIN,
    KeyRows,
    _band_chunks,
    band_width,
    exact_partial,
)
from xattn._estimators.chunks import chunk_layout, padded_length, prefix_parts
from xattn._estimators.rf_scan import (
    FeatureMap,
    Partial,
    combine_partials,
    finish_partial,
    scan_partials,
    state_over_keys,
)

# the band's names, imported from here by the decoding steps and the tests
__all__ = ["BAND_CHUNK_MIN", "POSITION_COST", "KeyRows", "_band_chunks", "band_width",
           "exact_partial", "window_layout", "windowed_rfa"]

#: What a position costs besides the band's exact pairs, in pairs: the cost by which
#: :func:`window_layout` weighs band chunks a little longer than the least against
#: padding to whole chunks of it (bytes written by a forward plus backward at 64 features
#: and 64 dimensions, window 64: equal chunks of 75 for 150 positions, whole chunks of 64
#: for 190).
POSITION_COST = 300


def _exact_partial(xp: Any, inputs: AttentionInputs, start: int, stop: int, window: int,
                   sinks: int, causal: bool, finite: bool = False,
                   base: Partial | None = None,
                   band_chunk: int | None = None) -> Partial | None:
    r"""Exact sums of queries ``start:stop`` of ``inputs`` over their band and sink keys
    (:func:`exact_partial`).

    Query ``n`` takes the keys :math:`n - w \le m \le n + w` (causal: :math:`n - w \le m
    \le n`; none when ``window`` is 0) with :math:`m \ge K` and the sinks :math:`m < K`
    (causal: :math:`m \le n`), each once, those ``key_mask`` allows; non-finite entries
    read as 0. Memory and work ``O(B (size + 2w + K))`` for ``B`` queries.

    Parameters
    ----------
    xp : namespace
        The Array API namespace.
    inputs : AttentionInputs
        The attention inputs.
    start, stop : int
        The queries, at positions ``start .. stop - 1`` (``0 <= start < stop <= N``).
    window, sinks : int
        ``w`` and ``K``.
    causal : bool
        Whether a query takes only the keys ``m <= n``.
    finite : bool
        q, k and v hold no NaN or infinity (:func:`~xattn._core.primitives.finite_inputs`).
    base, band_chunk : optional
        As :func:`exact_partial`'s.

    Returns
    -------
    Partial or None
        As :func:`exact_partial`.
    """
    k, v, key_mask = inputs.k, inputs.v, inputs.key_mask
    queries = inputs.q[..., start:stop, :]
    queries = finite_entries(xp, queries, finite)
    if inputs.scale != 1.0:  # (1: the inputs scaled already, windowed_rfa)
        queries = inputs.scale * queries
    sink_rows = None
    if sinks:
        sink_rows = (k[..., :sinks, :], v[..., :sinks, :],
                     None if key_mask is None else key_mask[..., :sinks])
    # the sinks in a query's band are the band's: one product for the whole band
    return exact_partial(xp, queries, start, window=window, causal=causal,
                         band=(k, v, key_mask) if window else None, sinks=sink_rows,
                         sink_position=start if causal else None, sinks_in_band=True,
                         finite=finite, base=base, band_chunk=band_chunk)


def window_layout(window: int, length: int, pair_block: int, multiple: int,
                  causal: bool = True) -> tuple[int, int, int]:
    """``(padded, scan_chunk, band_chunk)``: the length that a sequence of ``length``
    positions with the band ``window`` (``causal`` or not) is padded to, once, the chunk of the
    random features' scan (:func:`~xattn._estimators.rf_scan.scan_partials`) and that of
    the band (:func:`exact_partial`), both dividing it.

    The band's chunks are at least the smallest power of two ``size >= max(w, 16)``
    (:func:`~xattn._estimators.band._band_chunks`: a query's band then spans its chunk and
    the one before) and the scan's at most ``pair_block``
    (:func:`~xattn._estimators.chunks.chunk_layout`). Of the layouts in equal band chunks
    of ``size`` to ``2 size`` positions (as many as ``length`` needs, a few fewer, or one
    more) whose scan chunks divide the padded length too (or are whole band chunks), the
    one with the least
    :data:`POSITION_COST` plus band pairs per position times the padded length: 70
    positions with a window of 64 are one band chunk of 70 and two scan chunks of 35,
    not two chunks of 64 each. When none fits, whole chunks of ``size`` and of
    ``multiple`` (the largest power of two up to ``pair_block``).
    """
    size, count = _band_chunks(window, length)
    best: tuple[float, int, int, int] | None = None  # (cost, padded, scan and band chunk)
    for band_count in range(max(1, length // size - 2), count + 1):
        band_chunk = max(size, -(-length // band_count))
        padded = band_count * band_chunk
        if band_chunk >= 2 * size:
            continue
        scan_chunk, scan_count = chunk_layout(padded, pair_block)
        per = multiple // size  # else scan chunks of whole band chunks
        if scan_chunk * scan_count != padded and per and band_count % per == 0:
            scan_chunk, scan_count = per * band_chunk, band_count // per
        if scan_chunk * scan_count != padded or prefix_parts(scan_count) != scan_count:
            continue
        # pairs per position: the chunk's own, the chunk before (all but the first) and,
        # not causal, the chunk after (all but the last)
        neighbours = 2 if causal else 3
        pairs = band_chunk * (neighbours * band_count - neighbours + 1) / band_count
        cost = padded * (POSITION_COST + pairs)
        if best is None or cost < best[0]:  # a loop: torch.compile traces no min of a list
            best = (cost, padded, scan_chunk, band_chunk)
    if best is None:
        return padded_length(length, multiple, size), multiple, size
    return best[1:]


def windowed_rfa(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, *, window: int,
                 sinks: int, causal: bool, block_size: int, chunk_size: int,
                 guard: bool) -> tuple[Array, Array | None]:
    """RFA with the band ``|n - m| <= window`` and the keys ``m < sinks`` exact.

    ``mapping`` is a feature map of :mod:`xattn._estimators.rf_scan`. Returns the output
    (..., N, Dv) and, with ``guard``, the rows whose denominators were clamped.

    Without ``causal`` the keys after the band, ``m >= n + w + 1``, are summed by a pass
    from the last block back before the forward pass: the numerators of that pass wait in
    the output's own rows (:class:`xattn._core.primitives.RowPieces`), its shifts, denominators
    and weights in three columns beside them, and each block of the forward pass
    replaces its rows with the finished output. Memory is the output, those three numbers
    per query and a working set per block (the result of every block is joined as
    :class:`~xattn._core.primitives.RowPieces` does).
    """
    num_queries = length = inputs.q.shape[-2]
    blocks = [(start, min(start + block_size, num_queries))
              for start in range(0, num_queries, block_size)]
    # one block holds the whole sequence anyway: the inputs are read as finite once, not
    # by each of the scans and the band (several blocks: each reads its own rows)
    finite = len(blocks) == 1
    root_scale = math.sqrt(inputs.scale)
    scan_chunk = band_chunk = None  # each block's own (scan_partials, exact_partial)
    if finite:  # and scaled once: q^ and k^, so that q^ . k^ = s q . k (scale 1 below)
        padding = 0
        if (causal or window) and inputs.k.shape[-2] == num_queries:
            # padded once, in that copy, to whole chunks of the scan and of the band
            # (causal: no later key reaches a query, so the padding keys are attended by
            # none; else they are masked out)
            if window:
                length, scan_chunk, band_chunk = window_layout(
                    window, num_queries, mapping.pair_block, mapping.multiple, causal)
            else:
                scan_chunk, count = chunk_layout(num_queries, mapping.pair_block)
                length = scan_chunk * count
            padding = length - num_queries
            blocks = [(0, length)]
            block_size = length  # the scans' one block too (the padding can pass the
            # budget's multiple of 64 positions)
            if padding and not causal and inputs.key_mask is None:
                inputs = dataclasses.replace(inputs, key_mask=xp.ones(
                    num_queries, dtype=xp.bool, device=array_api_compat.device(inputs.q)))
        inputs = finite_inputs(inputs, padding)
        inputs = dataclasses.replace(inputs, q=root_scale * inputs.q, k=root_scale * inputs.k,
                                     scale=1.0)
        root_scale = 1.0
    q, k, v = inputs.q, inputs.k, inputs.v
    num_keys = k.shape[-2]
    out = RowPieces(length)
    suffix = None  # shift, denominator and weight of the partials over the keys after the band
    if window and not causal:  # the keys m >= n + w + 1, from the last block back
        suffix = RowPieces(length)
        backward = scan_partials(xp, mapping, q, k, v, root_scale=root_scale,
                                 key_mask=inputs.key_mask, first_key=sinks,
                                 offset=window + 1, reverse=True, block_size=block_size,
                                 chunk_size=chunk_size, batch_shape=inputs.batch_shape,
                                 keep_state=False, finite=finite)
        for (start, _), (shift, sums, weight) in zip(reversed(blocks), backward, strict=True):
            out.put(start, sums[..., :-1])
            suffix.put(start, xp.concat([shift, sums[..., -1:], weight], axis=-1))
    forward = None
    if window or causal:  # the keys m <= n - (w + 1) (m <= n without a band, causal)
        forward = scan_partials(xp, mapping, q, k, v, root_scale=root_scale,
                                key_mask=inputs.key_mask, first_key=sinks,
                                offset=window + 1 if window else 0, reverse=False,
                                block_size=block_size, chunk_size=chunk_size,
                                batch_shape=inputs.batch_shape, keep_state=False,
                                finite=finite, chunk=scan_chunk)
    state = None
    if not window and not causal:  # sinks only: every key m >= K, for every query
        state = state_over_keys(xp, mapping, k, v, root_scale=root_scale,
                                key_mask=inputs.key_mask, first_key=sinks,
                                start=min(sinks, num_keys), stop=num_keys,
                                chunk_size=chunk_size, batch_shape=inputs.batch_shape,
                                finite=finite)
    clamped = RowPieces(length) if guard else None
    for start, stop in blocks:
        queries = q[..., start:stop, :]
        q_hat = queries if finite else root_scale * finite_entries(xp, queries)
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
        combined: Partial | None
        if guard:  # the trigonometric map's weight bounds its denominator: merged apart
            exact = _exact_partial(xp, inputs, start, stop, window, sinks, causal, finite,
                                   band_chunk=band_chunk)
            combined = combine_partials(xp, partials if exact is None else [*partials, exact])
        else:  # the exact sums added to the random features' by the band's products
            combined = _exact_partial(xp, inputs, start, stop, window, sinks, causal, finite,
                                      base=combine_partials(xp, partials),
                                      band_chunk=band_chunk)
        assert combined is not None  # a random part at least
        rows, invalid = finish_partial(xp, combined, guard=guard)
        out.put(start, rows)
        if clamped is not None:
            clamped.put(start, invalid)
    if length == num_queries:
        return out.result(), None if clamped is None else clamped.result()
    return (out.result()[..., :num_queries, :],
            None if clamped is None else clamped.result()[..., :num_queries, :])
