r"""The exact part of windowed RFA: a block of queries against its band and sink keys.

Query :math:`n` takes exactly the keys :math:`n - w \le m \le n + w` (causal: :math:`n - w
\le m \le n`) and the :math:`K` sink keys, each once. The block's queries are cut into
chunks of :math:`C` positions, :math:`C` the smallest power of two :math:`\ge \max(w, 16)`
(the last chunk padded; a sequence in one block takes equal chunks a little longer
instead, :func:`xattn._estimators.window.window_layout`), carried on a batch
axis: every key of a chunk's band lies in the chunk itself or its neighbours
(:math:`C \ge w`), so the band is a fixed number of (C x C) products, whatever the
block's length:

.. math::

    s^{(d)}_{c} = Q_c K_{c + d}^\top + \beta^{(d)}, \qquad d \in \{-1, 0\}
    \text{ (causal) or } \{-1, 0, 1\},

with :math:`\beta^{(d)}_{ij} = 0` where key :math:`j` of chunk :math:`c + d` is in the
band of query :math:`i` of chunk :math:`c`, :math:`-\infty` elsewhere (the same for every
chunk). When the block is the whole sequence, the chunks of every batch element and head
lie one after another in one flat axis, so that :math:`K_{c + d}` is the same array
shifted by :math:`d` chunks (a view, nothing copied); the pairs that the shift makes across
two sequences (and the chunks without a neighbour) get a weight of 0 through a shift of
:math:`+\infty` for their rows. A block inside a longer sequence gathers the
:math:`C + 2w` keys around each chunk (:math:`C + w` causal) by a fixed number of shifted,
reshaped views. Each query also scores the sinks. The scores are summed under one
shift per query (no gradient: it cancels in the ratio). Memory and work are
:math:`O(B (C + 2w + K))` for :math:`B` queries, never :math:`O(B^2)`, and the number of
array operations does not depend on :math:`B`.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from xattn._core.array import Array, chunked_like, compute_dtype, reshapes_freely
from xattn._core.delegation import (
    matmul_add,
    neighbour_scores,
    neighbour_sums,
    stop_gradient,
)
from xattn._core.primitives import (
    common_shift,
    finite_entries,
    join,
    pad_rows,
    value_columns,
)
from xattn._estimators.rf_scan import Partial

__all__ = ["BAND_CHUNK_MIN", "KeyRows", "band_width", "exact_partial"]


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


def _common_lead(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The leading dims that ``shapes`` broadcast to (shapes checked to broadcast)."""
    ndim = max(len(shape) for shape in shapes)
    padded = [(1,) * (ndim - len(shape)) + tuple(shape) for shape in shapes]
    return tuple(next((size for size in sizes if size != 1), 1)
                 for sizes in zip(*padded, strict=True))


class _Band:
    """The band of a block that is the whole sequence, on one flat axis of ``chunks``
    chunks (batch elements and heads one after another): its row maxima, then its sums
    under a shift.

    ``scores`` holds, for each of ``neighbours`` (0 first), the scores ``(chunks - |d|,
    size, size)`` of the chunks ``c`` against the chunk ``c + d``
    (:func:`~xattn._core.delegation.neighbour_scores`), ``values`` the keys' values with
    the column of ones ``(chunks, size, Dv + 1)``.
    """

    def __init__(self, xp: Any, neighbours: tuple[int, ...], scores: tuple[Array, ...],
                 values: Array, lead: tuple[int, ...], size: int, count: int) -> None:
        self.xp, self.neighbours, self.scores, self.values = xp, neighbours, scores, values
        self.lead, self.size = lead, size
        self.rows, self.chunks = count * size, math.prod(lead) * count

    def _flat(self, rows: Array) -> Array:
        """``rows`` (..., count * size, F) on the flat axis of chunks: (chunks, size, F)."""
        xp = self.xp
        full = xp.broadcast_to(rows, (*self.lead, rows.shape[-2], rows.shape[-1]))
        return xp.reshape(full, (self.chunks, self.size, rows.shape[-1]))

    def maximum(self) -> Array:
        """The largest band score of each query, ``(..., count * size, 1)``, ``-inf``
        where none (held constant by autograd: a shift, which cancels)."""
        xp = self.xp
        largest = None
        for neighbour, scores in zip(self.neighbours, self.scores, strict=True):
            piece_max = stop_gradient(xp.max(scores, axis=-1, keepdims=True))
            if neighbour:  # (chunks - 1, size, 1): none for the chunk without a neighbour
                before, after = max(0, -neighbour) * self.size, max(0, neighbour) * self.size
                piece_max = xp.reshape(pad_rows(xp, xp.reshape(piece_max, (-1, 1)), before,
                                                after, -math.inf), (self.chunks, self.size, 1))
            largest = piece_max if largest is None else xp.maximum(largest, piece_max)
        assert largest is not None
        return xp.reshape(largest, (*self.lead, self.rows, 1))

    def sums(self, offset: Array, sums: Array | None) -> Array:
        """``sums`` (``(..., count * size, Dv + 1)`` or None) plus the band's sums of
        :math:`e^{s - \\text{offset}} [v, 1]`."""
        xp = self.xp
        flat_offset = self._flat(offset)
        weights = tuple(
            xp.exp(scores - (flat_offset[max(0, -neighbour):self.chunks - max(0, neighbour), ...]
                             if neighbour else flat_offset))
            for neighbour, scores in zip(self.neighbours, self.scores, strict=True))
        flat_sums = neighbour_sums(weights, self.values, self.neighbours,
                                   None if sums is None else self._flat(sums))
        return xp.reshape(flat_sums, (*self.lead, self.rows, flat_sums.shape[-1]))


def _whole_sequence_band(xp: Any, band: KeyRows, queries: Array, size: int, count: int,
                         window: int, first_key: int, causal: bool, finite: bool) -> _Band:
    r"""The band of a block that is the whole sequence, by (C x C) products of the
    chunks with their neighbours on one flat axis of chunks (module docstring).

    ``queries`` ``(..., count * size, D)``, scaled, finite, padded with zero rows; the
    keys of ``band`` are as many as the block's queries (before the padding)."""
    k, v, key_mask = band
    device = array_api_compat.device(k)
    lead = _common_lead(queries.shape[:-2], k.shape[:-2], v.shape[:-2],
                        () if key_mask is None else key_mask.shape[:-1])
    num_keys, length = k.shape[-2], count * size
    keys = pad_rows(xp, finite_entries(xp, k, finite), 0, length - num_keys, 0.0)
    values = pad_rows(xp, value_columns(xp, v, finite), 0, length - num_keys, 0.0)
    chunks = math.prod(lead) * count

    def flat(rows: Array) -> Array:
        rows = xp.broadcast_to(rows, (*lead, *rows.shape[-2:]))
        return xp.reshape(rows, (chunks, size, rows.shape[-1]))

    valid = None  # (chunks, 1, size): the rows of the keys that are keys and take part
    if first_key > 0 or num_keys < length or key_mask is not None:
        positions = xp.arange(length, device=device)
        valid = (positions >= first_key) & (positions < num_keys)
        if key_mask is not None:
            valid = valid & pad_rows(xp, key_mask[..., None], 0, length - num_keys, False)[..., 0]
        valid = xp.reshape(xp.broadcast_to(valid, (*lead, length)), (chunks, 1, size))
    rows = xp.arange(size, device=device)[:, None]
    columns = xp.arange(size, device=device)[None, :]
    # one chunk: its own products only (it has no neighbour)
    neighbours = (0,) if count == 1 else (0, -1) if causal else (0, -1, 1)
    in_bands, biases = [], []
    for neighbour in neighbours:
        relative = neighbour * size + columns - rows  # key position - query position
        in_band = (relative >= -window) & (relative <= (0 if causal else window))
        # every pair in the band (from Python ints: relative spans d * size -+ (size - 1))
        whole = (neighbour * size - size + 1 >= -window
                 and neighbour * size + size - 1 <= (0 if causal else window))
        biases.append(None if valid is not None or whole else xp.where(
            in_band, xp.asarray(0.0, dtype=queries.dtype, device=device),
            xp.asarray(-xp.inf, dtype=queries.dtype, device=device)))
        in_bands.append(in_band)
    scores = neighbour_scores(flat(queries), flat(keys), neighbours, tuple(biases), count)
    if valid is not None:  # the band, and the keys that take part
        scores = tuple(
            xp.where(in_band & valid[max(0, neighbour):chunks - max(0, -neighbour), ...],
                     piece, -xp.inf)
            for neighbour, piece, in_band in zip(neighbours, scores, in_bands, strict=True))
    return _Band(xp, neighbours, scores, flat(values), lead, size, count)


def _sink_scores(xp: Any, sinks: KeyRows, queries: Array, first_position: int | Array | None,
                 finite: bool = False,
                 in_band: tuple[int, int, bool] | None = None) -> tuple[Array, Array]:
    """Scores ``(..., R, K)`` of the ``R`` rows of ``queries`` against the sink keys
    (``-inf`` where not valid, or, unless ``first_position`` is None, where the slot
    ``s`` comes after the row's position ``first_position + i``: an int or a 0-d integer
    array; with ``in_band = (start, w, causal)``, also where slot ``s`` is in the band of
    row ``i``, at position ``start + i``), and the sinks' values with their column of ones
    ``(..., K, Dv + 1)``."""
    k, v, valid = sinks
    device = array_api_compat.device(k)
    scores = queries @ xp.matrix_transpose(finite_entries(xp, k, finite))
    rows = queries.shape[-2]
    slots = xp.arange(k.shape[-2], device=device)[None, :]
    allowed = None
    if first_position is not None:
        if isinstance(first_position, int):
            positions = xp.arange(first_position, first_position + rows, device=device)
        else:  # a position known only as an array (a state's, under jax.jit)
            positions = first_position + xp.arange(rows, device=device)
        allowed = xp.astype(slots, positions.dtype) <= positions[:, None]
    if in_band is not None:  # the band takes these (module docstring)
        start, window, causal = in_band
        positions = xp.arange(start, start + rows, device=device)[:, None]
        outside = (slots < positions - window) | (slots > positions + (0 if causal else window))
        allowed = outside if allowed is None else (allowed & outside)
    if valid is not None:
        sink_valid = valid[..., None, :]
        allowed = sink_valid if allowed is None else (allowed & sink_valid)
    if allowed is not None:
        scores = xp.where(allowed, scores, -xp.inf)
    return scores, value_columns(xp, v, finite)


def exact_partial(xp: Any, queries: Array, start: int, *, window: int, causal: bool,
                  band: KeyRows | None, first_key: int = 0, sinks: KeyRows | None = None,
                  sink_position: int | Array | None = None, sinks_in_band: bool = False,
                  finite: bool = False, base: Partial | None = None,
                  band_chunk: int | None = None) -> Partial | None:
    r"""Exact sums of a block of queries over their band keys and the sink keys.

    Query ``i`` of the block, at position :math:`n = \text{start} + i` of the sequence of
    ``band``, takes the keys :math:`n - w \le m \le n + w` (``causal``: :math:`n - w \le m
    \le n`) with :math:`m \ge` ``first_key`` that are valid, and every valid sink key
    (slot :math:`s \le` ``sink_position + i`` unless ``sink_position`` is None). A key is
    counted once as long as the band never reads the sinks (``first_key``, or the sinks
    invalid in ``band``'s validity, as a state's extended sequence has them), or the sinks
    are the first keys of ``band``'s sequence and ``sinks_in_band`` leaves each to the
    band where the band reaches it.

    The block is cut into chunks of ``size`` queries (:func:`_band_chunks`, the last one
    padded) carried on a batch axis (module docstring): a block that is the whole
    sequence (``start`` 0, as many keys as queries; not on Dask) by products of each chunk with its
    neighbours (:func:`_whole_sequence_band`), another by the ``size + 2w`` keys (causal
    ``size + w``) around each chunk (:func:`_band_scores`). Every query scores the sinks
    (:func:`_sink_scores`). All are masked to ``-inf`` before the exponential and summed
    under one shift per query. Memory and work ``O(B (size + 2w + K))`` for ``B``
    queries; the number of array operations does not depend on ``B``. Every shape comes
    from Python ints (positions known only as arrays enter through ``sink_position``).

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
    sinks_in_band : bool
        The sinks are the keys ``0 .. K - 1`` of ``band``'s sequence, and a query's band
        takes those it reaches (``first_key`` 0), its sinks the others.
    finite : bool
        The keys and values of ``band`` and ``sinks`` hold no NaN or infinity and are
        read as they are (else non-finite entries as 0).
    base : Partial, optional
        The same queries' partial over other keys (the random features'), whose sums
        ``exact_partial`` adds to its own, rescaled to the common shift: the products of
        the band and the sinks are added in place of a separate merge
        (:func:`~xattn._estimators.rf_scan.combine_partials`). Its weight must be its
        denominator (not the trigonometric map's bound).
    band_chunk : int, optional
        Queries per chunk of the band, at least the smallest :func:`_band_chunks` takes
        (None: :func:`_band_chunks`'s power of two): a length cut into equal chunks
        (:func:`xattn._estimators.window.window_layout`).

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
    if band is not None and band_chunk is not None:
        size, count = band_chunk, -(-length // band_chunk)
    padded = pad_rows(xp, queries, 0, size * count - length, 0.0)
    whole = scored = None
    if (band is not None and start == 0 and band[0].shape[-2] == length
            and reshapes_freely(queries)):
        whole = _whole_sequence_band(xp, band, padded, size, count, window, first_key, causal,
                                     finite)
    elif band is not None:
        scored = _band_scores(xp, band, padded, start, start + length, size, count, window,
                              first_key, causal, finite)
    sink = (_sink_scores(xp, sinks, padded, sink_position, finite,
                         (start, window, causal) if sinks_in_band and band is not None else None)
            if sinks is not None else None)
    # half-precision queries: the band's scores, weights and products in their dtype, the
    # shifts and sums in float32 (the sinks' few scores in float32 too)
    work = compute_dtype(xp, queries.dtype)
    half = work != queries.dtype
    if half and sink is not None:
        sink = (xp.astype(sink[0], work), xp.astype(sink[1], work))
    maxima = []
    if whole is not None:
        maxima.append(whole.maximum())
    if scored is not None:
        band_max = stop_gradient(xp.max(scored[0], axis=-1, keepdims=True))
        maxima.append(xp.reshape(band_max, (*band_max.shape[:-3], size * count, 1)))
    if sink is not None:
        maxima.append(stop_gradient(xp.max(sink[0], axis=-1, keepdims=True)))
    if not maxima:
        return base
    maxima = [xp.astype(maximum, work) for maximum in maxima] if half else maxima
    padding = size * count - length
    if base is not None:  # its rows padded like the queries' (-inf: no key there)
        maxima.append(pad_rows(xp, base[0], 0, padding, -math.inf))
    shift, offset = common_shift(xp, *maxima)
    band_offset = offset
    if half:  # one shift for the whole row: the one the band's weights take, rounded
        band_offset = xp.astype(offset, queries.dtype)
        offset = xp.astype(band_offset, work)
    sums = None
    if base is not None:  # e^{base shift - shift} times its sums (0 where it has no key)
        sums = xp.exp(maxima[-1] - offset) * pad_rows(xp, base[1], 0, padding, 0.0)
    if whole is not None:  # added to the others' sums by the product (half: added after)
        band_sums = whole.sums(band_offset, None if half else sums)
        sums = band_sums if sums is None or not half else sums + band_sums
    if scored is not None:
        chunk_offset = xp.reshape(band_offset, (*offset.shape[:-2], count, size, 1))
        weights = xp.exp(scored[0] - chunk_offset)
        if sums is None or half:
            chunk_sums = weights @ scored[1]  # (..., count, size, Dv + 1)
        else:  # added to the base's sums by the product
            chunk_sums = matmul_add(weights, scored[1], xp.reshape(
                sums, (*sums.shape[:-2], count, size, sums.shape[-1])))
        band_sums = xp.reshape(chunk_sums, (*chunk_sums.shape[:-3], size * count,
                                            chunk_sums.shape[-1]))
        sums = band_sums if sums is None or not half else sums + band_sums
    if sums is not None and sums.dtype != work:  # a band alone, in half precision
        sums = xp.astype(sums, work)
    if sink is not None:
        sink_weights = xp.exp(sink[0] - offset)
        sums = sink_weights @ sink[1] if sums is None else matmul_add(sink_weights, sink[1],
                                                                       sums)
    assert sums is not None
    # Dask: the rows in the chunks of the block's queries, like the other partials
    shift = chunked_like(shift[..., :length, :], queries, -2)
    sums = chunked_like(sums[..., :length, :], queries, -2)
    return shift, sums, sums[..., -1:]
