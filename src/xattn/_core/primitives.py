"""Numerical primitives shared by every estimator: stable shifts, the online-softmax merge,
masked softmax, causal masks, two small idioms (a divisor that keeps empty rows at 0,
joining pieces), the quarantine of non-finite rows and the assembly of a result by rows.

This module sits below the estimators (softmax, rfa, ra, lara, mrf, features) and imports
only :mod:`xattn._core.array`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import array_api_compat
import array_api_extra as xpx

from xattn._core.array import (
    Array,
    chunked_like,
    sequence_positions,
    split_rows,
    written_in_place,
)
from xattn._core.delegation import append_ones_column, nan_to_num, nonfinite_rows
from xattn._core.inputs import AttentionInputs

__all__ = [
    "MergedMaxima",
    "RowBlocks",
    "RowPieces",
    "causal_allowed",
    "common_shift",
    "finite_entries",
    "finite_inputs",
    "finite_shift",
    "group_rows",
    "join",
    "key_logits_in_range",
    "logsumexp",
    "mark_tainted",
    "masked_softmax",
    "merge_maxima",
    "nonzero_divisor",
    "pad_rows",
    "quarantine",
    "value_columns",
]


def finite_shift(xp: Any, maxima: Array) -> Array:
    """The stabilizing shift of a log-sum-exp: ``maxima`` with ``-inf`` replaced by 0.

    A maximum is ``-inf`` when every entry it covers is masked; shifting by 0 then keeps
    ``exp(logit - shift)`` at ``exp(-inf) = 0`` for those entries instead of NaN.
    """
    return nan_to_num(maxima, nan=math.nan, posinf=math.inf, neginf=0.0)


def key_logits_in_range(xp: Any, logits: Array) -> Array:
    r"""Random-feature key logits :math:`a_{ms} = \omega_s \cdot \hat k_m - \lVert \hat
    k_m \rVert^2/2` with every non-finite entry replaced by the floor ``-max / 4`` of
    their dtype (``max`` its largest finite number).

    A finite key's logit is at most :math:`\lVert \omega_s \rVert^2/2`; it is non-finite
    only when the key's squared norm (or its product with a sample) overflows, e.g. a
    float32 key of norm 1e19, whose true logit lies below the dtype's range. At the floor
    the key stays a key: alone in a row it gives its value, beside any key of ordinary
    norm it weighs nothing (:math:`e^{-\max/4}` relative), as in float64 and exact
    softmax; several such keys alone in a row weigh alike. The floor leaves room for
    the sums and differences of logits and shifts that the estimators form. NaN
    inputs never get here (they are read as 0 and their rows marked NaN at the end).
    """
    floor = -xp.finfo(logits.dtype).max / 4
    return nan_to_num(logits, nan=floor, posinf=floor, neginf=floor)


class MergedMaxima(NamedTuple):
    """What :func:`merge_maxima` returns (see there)."""

    maximum: Array
    r""":math:`m = \max_i m_i`; ``-inf`` where every part is empty."""
    shift: Array
    r""":math:`\hat m`: ``maximum`` with ``-inf`` replaced by 0 (:func:`finite_shift`), the
    shift that exponentials of the merged set subtract."""
    factors: tuple[Array, ...]
    r""":math:`e^{m_i - \hat m}` per part: 0 for an empty part, at most 1."""


def common_shift(xp: Any, *maxima: Array) -> tuple[Array, Array]:
    r"""The merged maximum :math:`m = \max_i m_i` of parts (``-inf`` where every part is
    empty) and the shift :math:`\hat m` that exponentials of the merged set subtract
    (:math:`m`, 0 where every part is empty: :func:`finite_shift`): the first half of
    :func:`merge_maxima`, for a merge whose factors are made where they are used (a
    running maximum joined by new logits, a band's shift over its parts)."""
    maximum = maxima[0]
    for part_maximum in maxima[1:]:
        maximum = xp.maximum(maximum, part_maximum)
    return maximum, finite_shift(xp, maximum)


def merge_maxima(xp: Any, *maxima: Array) -> MergedMaxima:
    r"""The online-softmax merge: rescale partial sums of exponentials to a common shift.

    A part :math:`i` of a set of logits :math:`x` is kept as its maximum :math:`m_i` and
    sums :math:`S_i = \sum_{x \in i} e^{x - m_i} w_x` (of weights, values, features...).
    The convention for an **empty part** (every entry masked, or no entry yet) is
    :math:`m_i = -\infty` with sums 0. Disjoint parts merge as

    .. math:: m = \max_i m_i, \qquad S = \sum_i e^{m_i - \hat m} S_i,

    with :math:`\hat m` = :math:`m`, or 0 where every part is empty, so no
    :math:`-\infty - (-\infty)` arises and empty parts get factor :math:`e^{-\infty} = 0`.
    The merged part keeps the convention: its maximum is :math:`-\infty` when all parts
    were empty, and its sums are then 0. New exponentials joining the merged part
    subtract ``shift`` (:math:`\hat m`). This is the recurrence of online softmax
    (Milakov & Gimelshein, 2018) and of FlashAttention's running statistics.

    Parameters
    ----------
    xp : namespace
        The arrays' Array API namespace.
    *maxima : array
        The parts' maxima :math:`m_i` (broadcastable to one shape; ``-inf`` = empty).

    Returns
    -------
    MergedMaxima
        ``(maximum, shift, factors)``: :math:`m`, :math:`\hat m` and the factors
        :math:`e^{m_i - \hat m}`, one per part, by which each part's sums are multiplied.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn._core.primitives import merge_maxima
    >>> x = np.array([0.5, 3.0, -1.0, 2.0])
    >>> first, second = x[:2], x[2:]
    >>> merged = merge_maxima(np, first.max(), second.max(), -np.inf)
    >>> total = (merged.factors[0] * np.exp(first - first.max()).sum()
    ...          + merged.factors[1] * np.exp(second - second.max()).sum())
    >>> bool(np.isclose(total, np.exp(x - merged.shift).sum())), merged.factors[2]
    (True, np.float64(0.0))
    """
    maximum, shift = common_shift(xp, *maxima)
    return MergedMaxima(maximum, shift,
                        tuple(xp.exp(part_maximum - shift) for part_maximum in maxima))


def nonzero_divisor(xp: Any, total: Array) -> Array:
    """``total`` where it is positive, else 1: the divisor of a normalization in which a
    row with nothing to normalize (total 0: every entry masked) stays at 0, not NaN."""
    return xp.where(total > 0, total, 1.0)


def join(xp: Any, pieces: Sequence[Array], axis: int) -> Array:
    """The pieces concatenated along ``axis``; a single piece is returned as it is (no
    copy)."""
    return pieces[0] if len(pieces) == 1 else xp.concat(list(pieces), axis=axis)


def masked_softmax(xp: Any, logits: Array, allowed: Array | None = None, *, axis: int = -1,
                   scale: float = 1.0) -> Array:
    """``scale`` times the softmax of ``logits`` along ``axis`` over the ``allowed`` entries.

    Entries where ``allowed`` is False get weight 0; a slice with no allowed entry gets
    all zeros (never NaN). ``scale`` is folded into the normalization (one pass fewer
    than scaling afterwards).
    """
    if allowed is not None:
        logits = xp.where(allowed, logits, xp.full_like(logits, -xp.inf))
    top = finite_shift(xp, xp.max(logits, axis=axis, keepdims=True))
    weights = xp.exp(logits - top)  # entries not allowed: exp(-inf) = 0
    total = xp.sum(weights, axis=axis, keepdims=True)
    return weights * (scale / nonzero_divisor(xp, total))


def causal_allowed(xp: Any, query_positions: Array, key_start: int, key_stop: int,
                   device: Any) -> Array:
    """Boolean ``(N, key_stop - key_start)``: True where key ``m <= n`` (query ``n``).

    ``query_positions`` holds ``0 .. N - 1`` (:func:`xattn._core.array.sequence_positions`).
    Causal attention in xattn is aligned top-left, as in PyTorch's
    ``scaled_dot_product_attention(is_causal=True)``: query ``n`` sees keys ``0..n``.
    """
    keys = xp.arange(key_start, key_stop, device=device)
    return query_positions[:, None] >= xp.astype(keys, query_positions.dtype)[None, :]


def logsumexp(xp: Any, x: Array, axis: int) -> Array:
    """:math:`\\log \\sum \\exp` of ``x`` over ``axis`` with a finite max shift.

    A slice whose entries are all ``-inf`` gives ``-inf`` and one holding ``+inf`` gives
    ``+inf`` (never NaN from the shift itself).
    """
    shift = xp.max(x, axis=axis, keepdims=True)
    shift = xp.where(xp.isfinite(shift), shift, 0.0)
    total = xp.sum(xp.exp(x - shift), axis=axis, keepdims=True)
    return xp.squeeze(xp.log(total) + shift, axis=axis)


class RowPieces:
    """The rows (axis -2) of a result, put a block of rows at a time.

    A block may be put again (the same rows), replacing what was there; :meth:`get`
    returns what a block holds. On NumPy and CuPy the blocks are written into one result
    allocated at the first block (:func:`array_api_extra.at`), so the result is held once
    and :meth:`result` copies nothing; elsewhere they are kept as they are and joined by
    one concatenation in :meth:`result`, which holds the result twice for that moment.
    A result of one block is that block, on every library.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._blocks: dict[int, Array] = {}
        self._result: Array | None = None

    def put(self, start: int, rows: Array) -> None:
        """Rows ``start : start + rows.shape[-2]`` of the result (a block of the layout
        that every put uses)."""
        stop = start + rows.shape[-2]
        if self._result is None:
            if stop - start == self.num_rows or not written_in_place(rows):
                self._blocks[start] = rows  # replaces (and releases) an earlier put
                return
            xp = array_api_compat.array_namespace(rows)
            self._result = xp.empty((*rows.shape[:-2], self.num_rows, rows.shape[-1]),
                                    dtype=rows.dtype, device=array_api_compat.device(rows))
        index = (..., slice(start, stop), slice(None))
        self._result = xpx.at(self._result, index).set(rows, copy=False)

    def get(self, start: int, stop: int) -> Array:
        """What rows ``start:stop`` hold (a view on NumPy: read it before putting them
        again)."""
        if self._result is not None:
            return self._result[..., start:stop, :]
        return self._blocks[start]

    def result(self) -> Array:
        """All rows, in order."""
        if self._result is not None:
            return self._result
        blocks = [self._blocks[start] for start in sorted(self._blocks)]
        self._blocks = {}
        if len(blocks) == 1:
            return blocks[0]
        return array_api_compat.array_namespace(blocks[0]).concat(blocks, axis=-2)


class RowBlocks:
    """Rows of ``x`` (..., L, F) read from pieces of ``size`` rows split once
    (:func:`~xattn._core.array.split_rows`): a block loop that reads rows this way makes one
    operation of the splitting for autograd instead of one full-size gradient per block."""

    def __init__(self, xp: Any, x: Array, size: int) -> None:
        self.xp, self.size = xp, size
        self.pieces = split_rows(x, size)

    def get(self, start: int, stop: int) -> Array:
        """Rows ``start:stop`` (``0 <= start < stop <= L``)."""
        size, parts = self.size, []
        for index in range(start // size, (stop - 1) // size + 1):
            piece, offset = self.pieces[index], index * size
            low, high = max(start - offset, 0), min(stop - offset, piece.shape[-2])
            parts.append(piece if (low, high) == (0, piece.shape[-2])
                         else piece[..., low:high, :])
        return join(self.xp, parts, -2)


def pad_rows(xp: Any, x: Array, before: int, after: int, fill: float) -> Array:
    """``x`` with ``before`` and ``after`` rows of ``fill`` around its axis -2:
    :func:`array_api_extra.pad` (the library's own pad on torch, NumPy, CuPy and JAX: one
    operation, which ``torch.compile`` fuses with the operation that makes ``x``, where a
    concatenation with a filled array is a kernel for the fill and one for the copy); on
    Dask a concatenation (its pad would build one block along the padded axis)."""
    if before == 0 and after == 0:
        return x
    if not array_api_compat.is_dask_array(x):
        widths = [(0, 0)] * (x.ndim - 2) + [(before, after), (0, 0)]
        return xpx.pad(x, widths, constant_values=fill, xp=xp)
    device = array_api_compat.device(x)
    pieces = []
    if before:
        pieces.append(xp.full((*x.shape[:-2], before, x.shape[-1]), fill, dtype=x.dtype,
                              device=device))
    pieces.append(x)
    if after:
        pieces.append(xp.full((*x.shape[:-2], after, x.shape[-1]), fill, dtype=x.dtype,
                              device=device))
    return xp.concat(pieces, axis=-2)


def group_rows(*, length: int, batch_size: int, row_numbers: int, itemsize: int,
               working_memory: int, chunk_size: int | None = None) -> int:
    """Rows per group of a non-causal pass over keys or queries under a working-memory
    budget: as many as ``working_memory`` bytes hold at ``row_numbers`` numbers per row
    and batch element (at least one), all ``length`` rows when they fit (one group: a
    fixed number of array operations at any length), at most ``chunk_size`` if given."""
    per_row = max(batch_size, 1) * max(row_numbers, 1) * itemsize
    rows = max(1, working_memory // per_row)
    if chunk_size is not None:
        rows = min(rows, chunk_size)
    return max(1, min(rows, length))


def finite_entries(xp: Any, x: Array, finite: bool = False, rows_after: int = 0) -> Array:
    """``x`` with its NaN and infinite entries replaced by 0, by ``where`` (no product with
    a NaN, in the backward pass either): how an estimator reads a piece of its inputs,
    whose non-finite rows :func:`quarantine` has located. ``finite``: ``x`` is read from
    :func:`finite_inputs` already, and returned as it is (no second pass). ``rows_after``
    rows of zeros are appended (axis -2), in the same pass where the library allows
    (:func:`~xattn._core.delegation.nan_to_num`): a block padded to whole chunks."""
    if finite:
        return pad_rows(xp, x, 0, rows_after, 0.0)
    return nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, rows_after=rows_after)


def value_columns(xp: Any, v: Array, finite: bool = False, rows_after: int = 0) -> Array:
    """Values with a column of ones appended (the denominator), non-finite entries 0
    (``finite``: as :func:`finite_entries`;
    :func:`~xattn._core.delegation.append_ones_column`: one operation where the library
    pads), and ``rows_after`` rows of ones appended (axis -2; the values of padding keys,
    which take no part)."""
    return append_ones_column(finite_entries(xp, v, finite), rows_after)


def quarantine(inputs: AttentionInputs, *, causal: bool, offset: int = 0,
               shared_queries: bool = False) -> tuple[Array, Array]:
    r"""Locate the non-finite rows of the inputs and the output rows they reach.

    A key :math:`m` whose key or value row holds NaN or infinity reaches exactly the
    query rows that attend it: every row without ``causal``, the rows at positions
    :math:`\ge m` with it (query ``i`` at position ``offset + i``, key ``j`` at ``j``,
    top-left), and none where ``key_mask`` leaves it out. A non-finite query row reaches
    its own row (every row with ``shared_queries``: LARA's segment means average the
    queries). The estimator reads its inputs through :func:`finite_entries` (a piece at a
    time: no copy of a whole input) and :func:`mark_tainted` writes NaN into the reached
    rows with ``where`` at the end. No NaN enters the computation, so none reaches an
    output or a **gradient** of a row that does not attend it (a zero weight times NaN is
    NaN, in the backward pass too).

    Returns ``tainted``, boolean (..., N or 1, 1), and the keys that reach some row,
    boolean (..., M). Memory: O(N + M) booleans.
    """
    xp = inputs.xp

    bad_queries = nonfinite_rows(inputs.q)
    bad_keys = nonfinite_rows(inputs.k, inputs.v)  # (..., M)
    if inputs.key_mask is not None:
        bad_keys = bad_keys & inputs.key_mask
    if inputs.query_mask is not None:
        bad_queries = bad_queries & inputs.query_mask
    if shared_queries:
        bad_queries = xp.any(bad_queries, axis=-1, keepdims=True)
    num_queries, num_keys = inputs.num_queries, inputs.num_keys
    if num_keys == 0:
        tainted = bad_queries
    elif not causal:
        tainted = bad_queries | xp.any(bad_keys, axis=-1, keepdims=True)
    else:  # the keys m <= offset + i: query i is reached from the first bad key on
        device = array_api_compat.device(bad_keys)
        key_positions = sequence_positions(bad_keys, axis=-1)  # Dask: chunked like the keys
        past_every_query = max(num_keys, offset + num_queries)  # no bad key: none reached
        first_bad = xp.min(xp.where(bad_keys, key_positions,
                                    xp.asarray(past_every_query, dtype=key_positions.dtype,
                                               device=device)), axis=-1, keepdims=True)
        query_positions = (sequence_positions(bad_queries, axis=-1)
                           if bad_queries.shape[-1] == num_queries
                           else xp.arange(num_queries, device=device))
        tainted = bad_queries | (query_positions >= first_bad - offset)
    return tainted[..., None], bad_keys


def finite_inputs(inputs: AttentionInputs, rows_after: int = 0) -> AttentionInputs:
    """The inputs with :func:`finite_entries` applied to q, k and v whole (for the
    estimators that hand them to a fused kernel or hold them anyway: a copy of each), and
    ``rows_after`` positions of zeros appended to q, k and v in the same copy (the masks
    padded with False: padding queries and keys take no part)."""
    xp = inputs.xp
    masks = {}
    for name in ("key_mask", "query_mask"):
        mask = getattr(inputs, name)
        if mask is not None and rows_after:
            mask = xp.concat([mask, xp.zeros((*mask.shape[:-1], rows_after), dtype=xp.bool,
                                             device=array_api_compat.device(mask))], axis=-1)
        masks[name] = mask
    return dataclasses.replace(inputs, q=finite_entries(xp, inputs.q, rows_after=rows_after),
                               k=finite_entries(xp, inputs.k, rows_after=rows_after),
                               v=finite_entries(xp, inputs.v, rows_after=rows_after), **masks)


def mark_tainted(xp: Any, out: Array, tainted: Array) -> Array:
    """``out`` with NaN in the rows of ``tainted`` (:func:`quarantine`): by ``where``, or
    written into ``out`` where results are assembled in place (NumPy, CuPy: no second
    copy of the output)."""
    writeable = getattr(getattr(out, "flags", None), "writeable", True)
    if written_in_place(out) and writeable and tuple(out.shape[:-1]) == tuple(
            xp.broadcast_shapes(out.shape[:-1], tainted.shape[:-1])):
        out[xp.broadcast_to(tainted, out.shape)] = xp.nan
        return out
    nan = xp.asarray(xp.nan, dtype=out.dtype, device=array_api_compat.device(out))
    return xp.where(chunked_like(tainted, out, axis=-2), nan, out)
