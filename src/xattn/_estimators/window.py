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
with offset :math:`w + 1`), never totals minus band terms. The exact part of a block of
:math:`B` queries is chunked (:func:`exact_partial`): the queries are cut into chunks of
:math:`C` positions, :math:`C` the smallest power of two :math:`\ge \max(w, 16)` (the
last chunk padded), carried on a batch axis, and each chunk scores only the
:math:`C + 2w` keys around it (:math:`C + w` causal), gathered by a fixed number of
shifted, reshaped views of the block's keys; every query also scores the :math:`K` sinks.
Memory and work are :math:`O(B (C + 2w + K))`, never :math:`O(B^2)` or an ``N x M``
mask, and the number of array operations does not depend on :math:`B`. The exact and
the random-feature parts are combined with one shift per query, the largest log-term of
either, without an epsilon. A state's prefill and steps (:mod:`xattn._estimators.decode`) compute
their band and sink slots by the same :func:`exact_partial`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import array_api_compat

from xattn._core.array import Array, chunked_like
from xattn._core.delegation import matmul_add
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import (
    RowPieces,
    finite_entries,
    finite_inputs,
    finite_shift,
    join,
    pad_rows,
    value_columns,
)
from xattn._estimators.rf_scan import (
    FeatureMap,
    Partial,
    combine_partials,
    finish_partial,
    scan_partials,
    state_over_keys,
)

__all__ = ["BAND_CHUNK_MIN", "KeyRows", "band_width", "exact_partial", "windowed_rfa"]


#: The smallest number of queries in a chunk of the band (a power of two): the chunk size
#: is the smallest power of two at least ``max(window, BAND_CHUNK_MIN)``.
BAND_CHUNK_MIN = 16


def band_width(window: int, sinks: int) -> int:
    """Exact keys per query of the band and sinks, as computed (the chunk, ``2w`` keys
    around it and the ``K`` sinks): what a block's working memory holds per query."""
    if not window:
        return sinks
    return (1 << (max(window, BAND_CHUNK_MIN) - 1).bit_length()) + 2 * window + sinks


def _band_chunks(window: int, length: int) -> tuple[int, int]:
    """The chunk size and the number of chunks of a block of ``length`` queries.

    Parameters
    ----------
    window : int
        The band's half-width ``w``.
    length : int
        The number of queries of the block.

    Returns
    -------
    (int, int)
        ``(size, count)``: the smallest power of two ``size >= max(window, 16)`` and
        ``count = ceil(length / size)`` (the last chunk padded), or ``(length, 1)`` for a
        block no longer than that.
    """
    size = 1 << (max(window, BAND_CHUNK_MIN) - 1).bit_length()
    if length <= size:
        return length, 1
    return size, -(-length // size)


def _unfold(xp: Any, rows: Array, size: int, count: int, width: int) -> Array:
    """The overlapping windows ``rows[..., c * size : c * size + width, :]``, one per chunk.

    Parameters
    ----------
    xp : namespace
        The Array API namespace.
    rows : array
        ``(..., L, F)`` with ``L >= (count + ceil(width / size) - 1) * size`` (``L >=
        width`` when ``count`` is 1).
    size, count : int
        The step between windows and their number.
    width : int
        The length of a window.

    Returns
    -------
    array
        ``(..., count, width, F)``. Built from ``ceil(width / size)`` shifted views of
        ``rows`` reshaped to ``(..., count, size, F)``, joined along the window and
        trimmed to ``width``: the number of operations does not depend on ``count``.
    """
    lead, features = rows.shape[:-2], rows.shape[-1]
    if count == 1:
        return xp.reshape(rows[..., :width, :], (*lead, 1, width, features))
    views = [xp.reshape(rows[..., step * size:(step + count) * size, :],
                        (*lead, count, size, features))
             for step in range(-(-width // size))]
    return join(xp, views, -2)[..., :width, :]


KeyRows = tuple[Array, Array, Array | None]
"""Keys ``(..., M, D)``, values ``(..., M, Dv)`` and their validity ``(..., M)`` (None:
every key valid), as :func:`exact_partial` reads them (non-finite entries as 0)."""


def _band_scores(xp: Any, band: KeyRows, queries: Array, start: int, stop: int, size: int,
                 count: int, window: int, first_key: int, causal: bool,
                 finite: bool = False) -> tuple[Array, Array] | None:
    r"""Scores and values of the band keys of queries ``start:stop``, chunk by chunk.

    Parameters
    ----------
    xp : namespace
        The Array API namespace.
    band : (array, array, array or None)
        The keys, values and validity of the sequence the band reads (:data:`KeyRows`).
    queries : array
        ``(..., count * size, D)``: the block's queries, scaled, finite, padded with zero
        rows after ``stop``.
    start, stop : int
        The block's queries, at positions ``start .. stop - 1`` of the keys' sequence.
    size, count : int
        The chunks of the block (:func:`_band_chunks`).
    window : int
        ``w``.
    first_key : int
        The keys before it are not in the band (the sinks, which :func:`_sink_scores`
        takes).
    causal : bool
        Whether the band stops at the query (:math:`n - w \le m \le n`).

    Returns
    -------
    (array, array) or None
        The scores ``(..., count, size, W)``, ``-inf`` where the key is not in the query's
        band, not a key (padding), before ``first_key`` or not valid, and the values with
        their column of ones ``(..., count, W, Dv + 1)``; column ``j`` of chunk ``c`` is
        the key ``start - w + c * size + j``, ``W = size + w`` (causal) or ``size + 2w``.
        None when no key can be in the band.
    """
    k, v, key_mask = band
    device = array_api_compat.device(k)
    reach = window if causal else 2 * window  # a query's band: columns row .. row + reach
    width = size + reach
    first = start - window  # the key position of column 0 of chunk 0
    span = width if count == 1 else (count - 1 - (-width // size)) * size
    # the keys read: none before first_key, none after the last query's band
    low = max(first, first_key)
    high = min(first + span, k.shape[-2], stop if causal else stop + window)
    if low >= high:
        return None
    before, after = low - first, first + span - high
    keys, values = k[..., low:high, :], v[..., low:high, :]
    keys = pad_rows(xp, finite_entries(xp, keys, finite), before, after, 0.0)
    values = pad_rows(xp, value_columns(xp, values, finite), before, after, 0.0)
    chunk_queries = xp.reshape(queries, (*queries.shape[:-2], count, size, queries.shape[-1]))
    scores = chunk_queries @ xp.matrix_transpose(_unfold(xp, keys, size, count, width))
    rows = xp.arange(size, device=device)[:, None]
    columns = xp.arange(width, device=device)[None, :]
    allowed = (columns >= rows) & (columns <= rows + reach)  # (size, W): in the band
    if before or after:  # padding read: only the columns that are keys
        offsets = xp.arange(count, device=device)[:, None] * size + columns  # from `first`
        is_key = (offsets >= before) & (offsets < span - after)  # (count, W)
        allowed = allowed & is_key[:, None, :]
    if key_mask is not None:
        mask = pad_rows(xp, key_mask[..., low:high, None], before, after, False)
        allowed = allowed & _unfold(xp, mask, size, count, width)[..., None, :, 0]
    scores = xp.where(allowed, scores, -xp.inf)
    return scores, _unfold(xp, values, size, count, width)


def _sink_scores(xp: Any, sinks: KeyRows, queries: Array, first_position: int | Array | None,
                 finite: bool = False) -> tuple[Array, Array]:
    """Scores ``(..., R, K)`` of the ``R`` rows of ``queries`` against the sink keys
    (``-inf`` where not valid, or, unless ``first_position`` is None, where the slot
    ``s`` comes after the row's position ``first_position + i``: an int or a 0-d integer
    array), and the sinks' values with their column of ones ``(..., K, Dv + 1)``."""
    k, v, valid = sinks
    device = array_api_compat.device(k)
    scores = queries @ xp.matrix_transpose(finite_entries(xp, k, finite))
    allowed = None
    if first_position is not None:
        rows = queries.shape[-2]
        if isinstance(first_position, int):
            positions = xp.arange(first_position, first_position + rows, device=device)
        else:  # a position known only as an array (a state's, under jax.jit)
            positions = first_position + xp.arange(rows, device=device)
        slots = xp.arange(k.shape[-2], dtype=positions.dtype, device=device)
        allowed = slots[None, :] <= positions[:, None]
    if valid is not None:
        sink_valid = valid[..., None, :]
        allowed = sink_valid if allowed is None else (allowed & sink_valid)
    if allowed is not None:
        scores = xp.where(allowed, scores, -xp.inf)
    return scores, value_columns(xp, v, finite)


def exact_partial(xp: Any, queries: Array, start: int, *, window: int, causal: bool,
                  band: KeyRows | None, first_key: int = 0, sinks: KeyRows | None = None,
                  sink_position: int | Array | None = None, finite: bool = False,
                  base: Partial | None = None) -> Partial | None:
    r"""Exact sums of a block of queries over their band keys and the sink keys.

    Query ``i`` of the block, at position :math:`n = \text{start} + i` of the sequence of
    ``band``, takes the keys :math:`n - w \le m \le n + w` (``causal``: :math:`n - w \le m
    \le n`) with :math:`m \ge` ``first_key`` that are valid, and every valid sink key
    (slot :math:`s \le` ``sink_position + i`` unless ``sink_position`` is None). A key is
    counted once as long as the band never reads the sinks (``first_key``, or the sinks
    invalid in ``band``'s validity, as a state's extended sequence has them).

    The block is cut into chunks of ``size`` queries (:func:`_band_chunks`, the last one
    padded) carried on a batch axis; each chunk scores the ``size + 2w`` keys (causal
    ``size + w``) around it (:func:`_band_scores`), and every query the sinks
    (:func:`_sink_scores`). Both are masked to ``-inf`` before the exponential and summed
    under one shift per query. Memory and work ``O(B (size + 2w + K))`` for ``B`` queries;
    the number of array operations does not depend on ``B``. Every shape comes from
    Python ints (positions known only as arrays enter through ``sink_position``).

    Parameters
    ----------
    xp : namespace
        The Array API namespace.
    queries : array
        ``(..., B, D)``: the block's queries, scaled and finite.
    start : int
        The position of the first query in ``band``'s sequence.
    window : int
        ``w``; 0: no band.
    causal : bool
        Whether a query takes only the band keys ``m <= n``.
    band : (array, array, array or None) or None
        The keys, values and validity of the sequence (:data:`KeyRows`), read as far as
        the block's band reaches; None: no band.
    first_key : int
        The band's first key (the sinks before it).
    sinks : (array, array, array or None) or None
        The sink keys, values and validity (:data:`KeyRows`, ``M = K``).
    sink_position : int or array or None
        The position of the first query, against which the sink slots count (slot
        ``s`` is the key at position ``s``); None: every query takes every sink.
    finite : bool
        The keys and values of ``band`` and ``sinks`` hold no NaN or infinity and are
        read as they are (else non-finite entries as 0).
    base : Partial, optional
        The same queries' partial over other keys (the random features'), whose sums
        ``exact_partial`` adds to its own, rescaled to the common shift: the products of
        the band and the sinks are added in place of a separate merge
        (:func:`~xattn._estimators.rf_scan.combine_partials`). Its weight must be its
        denominator (not the trigonometric map's bound).

    Returns
    -------
    Partial or None
        ``(shift (..., B, 1), sums (..., B, Dv + 1), weight (..., B, 1))``: the largest
        allowed score (``-inf`` where none), the sums of :math:`e^{s - \text{shift}} [v,
        1]` and the denominator again; None when no key can take part. On Dask the rows
        keep the chunks of ``queries``.
    """
    length = queries.shape[-2]
    if not window:
        band = None
    size, count = _band_chunks(window, length) if band is not None else (length, 1)
    padded = pad_rows(xp, queries, 0, size * count - length, 0.0)
    scored = (_band_scores(xp, band, padded, start, start + length, size, count, window,
                           first_key, causal, finite) if band is not None else None)
    sink = (_sink_scores(xp, sinks, padded, sink_position, finite) if sinks is not None
            else None)
    maxima = []
    if scored is not None:
        band_max = xp.max(scored[0], axis=-1, keepdims=True)  # (..., count, size, 1)
        maxima.append(xp.reshape(band_max, (*band_max.shape[:-3], size * count, 1)))
    if sink is not None:
        maxima.append(xp.max(sink[0], axis=-1, keepdims=True))
    if not maxima:
        return base
    padding = size * count - length
    if base is not None:  # its rows padded like the queries' (-inf: no key there)
        maxima.append(pad_rows(xp, base[0], 0, padding, -math.inf))
    shift = maxima[0]
    for maximum in maxima[1:]:
        shift = xp.maximum(shift, maximum)
    offset = finite_shift(xp, shift)
    sums = None
    if base is not None:  # e^{base shift - shift} times its sums (0 where it has no key)
        sums = xp.exp(maxima[-1] - offset) * pad_rows(xp, base[1], 0, padding, 0.0)
    if scored is not None:
        chunk_offset = xp.reshape(offset, (*offset.shape[:-2], count, size, 1))
        weights = xp.exp(scored[0] - chunk_offset)
        if sums is None:
            chunk_sums = weights @ scored[1]  # (..., count, size, Dv + 1)
        else:  # added to the base's sums by the product
            chunk_sums = matmul_add(weights, scored[1], xp.reshape(
                sums, (*sums.shape[:-2], count, size, sums.shape[-1])))
        sums = xp.reshape(chunk_sums, (*chunk_sums.shape[:-3], size * count,
                                       chunk_sums.shape[-1]))
    if sink is not None:
        sink_weights = xp.exp(sink[0] - offset)
        sums = sink_weights @ sink[1] if sums is None else matmul_add(sink_weights, sink[1],
                                                                       sums)
    assert sums is not None
    # Dask: the rows in the chunks of the block's queries, like the other partials
    shift = chunked_like(shift[..., :length, :], queries, -2)
    sums = chunked_like(sums[..., :length, :], queries, -2)
    return shift, sums, sums[..., -1:]


def _exact_partial(xp: Any, inputs: AttentionInputs, start: int, stop: int, window: int,
                   sinks: int, causal: bool, finite: bool = False,
                   base: Partial | None = None) -> Partial | None:
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
    base : Partial, optional
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
    return exact_partial(xp, queries, start, window=window, causal=causal,
                         band=(k, v, key_mask) if window else None, first_key=sinks,
                         sinks=sink_rows, sink_position=start if causal else None,
                         finite=finite, base=base)


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
    num_queries = inputs.q.shape[-2]
    blocks = [(start, min(start + block_size, num_queries))
              for start in range(0, num_queries, block_size)]
    # one block holds the whole sequence anyway: the inputs are read as finite once, not
    # by each of the scans and the band (several blocks: each reads its own rows)
    finite = len(blocks) == 1
    root_scale = math.sqrt(inputs.scale)
    if finite:  # and scaled once: q^ and k^, so that q^ . k^ = s q . k (scale 1 below)
        inputs = finite_inputs(inputs)
        inputs = dataclasses.replace(inputs, q=root_scale * inputs.q, k=root_scale * inputs.k,
                                     scale=1.0)
        root_scale = 1.0
    q, k, v = inputs.q, inputs.k, inputs.v
    num_keys = k.shape[-2]
    out = RowPieces(num_queries)
    suffix = None  # shift, denominator and weight of the partials over the keys after the band
    if window and not causal:  # the keys m >= n + w + 1, from the last block back
        suffix = RowPieces(num_queries)
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
                                finite=finite)
    state = None
    if not window and not causal:  # sinks only: every key m >= K, for every query
        state = state_over_keys(xp, mapping, k, v, root_scale=root_scale,
                                key_mask=inputs.key_mask, first_key=sinks,
                                start=min(sinks, num_keys), stop=num_keys,
                                chunk_size=chunk_size, batch_shape=inputs.batch_shape,
                                finite=finite)
    clamped = RowPieces(num_queries) if guard else None
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
            exact = _exact_partial(xp, inputs, start, stop, window, sinks, causal, finite)
            combined = combine_partials(xp, partials if exact is None else [*partials, exact])
        else:  # the exact sums added to the random features' by the band's products
            combined = _exact_partial(xp, inputs, start, stop, window, sinks, causal, finite,
                                      base=combine_partials(xp, partials))
        assert combined is not None  # a random part at least
        rows, invalid = finish_partial(xp, combined, guard=guard)
        out.put(start, rows)
        if clamped is not None:
            clamped.put(start, invalid)
    return out.result(), None if clamped is None else clamped.result()
