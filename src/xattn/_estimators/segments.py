r"""Segments of a sequence or of an image grid and their means (LARA's landmarks).

LARA (Zheng et al., ICML 2022, Appendix G.3.1) builds one proposal per segment from the
segment means :math:`\tilde q_c`, :math:`\tilde k_c` of the scaled queries and keys:

- **1-D** (sequences): C contiguous runs of the allowed positions, with sizes differing by
  at most one (the first ``count % C`` runs get one more entry). The runs are taken over
  the *allowed* positions only, so padding with masked entries changes nothing.
- **2-D** (images, ``grid=(H, W)``, row-major tokens): the ``c_h x c_w`` bins of 2-D
  adaptive average pooling ("2D average pooling (the same as segments)", Appendix H).
  Bin (i, j) covers the rows :math:`\lfloor iH/c_h \rfloor \dots \lceil (i+1)H/c_h
  \rceil - 1` and the columns :math:`\lfloor jW/c_w \rfloor \dots \lceil (j+1)W/c_w
  \rceil - 1`, exactly the bins of PyTorch's ``adaptive_avg_pool2d``; neighbouring bins
  overlap by one row (column) when ``c_h`` does not divide ``H``. Segment c = i c_w + j
  (row-major). A masked token belongs to no segment: the bins stay where they are and
  the mean is over their allowed tokens.

A segment without an allowed entry has a zero mean (and size 0), never NaN.
"""

from __future__ import annotations

from typing import Any

from xattn._core.array import Array, index_sizes, one_chunk_along, split_rows_at
from xattn._core.primitives import join, nonzero_divisor

__all__ = ["adaptive_bins", "segment_means"]


def adaptive_bins(length: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the ``parts`` bins of adaptive average pooling over ``length``.

    Bin i is ``floor(i * length / parts) .. ceil((i + 1) * length / parts)``, as in
    PyTorch's ``adaptive_avg_pool1d`` / ``adaptive_avg_pool2d``.

    Examples
    --------
    >>> from xattn._estimators.segments import adaptive_bins
    >>> adaptive_bins(7, 3)
    [(0, 3), (2, 5), (4, 7)]
    """
    return [((i * length) // parts, -((-(i + 1) * length) // parts)) for i in range(parts)]


def _grid_membership(xp: Any, grid: tuple[int, int], pools: tuple[int, int], *, dtype: Any,
                     device: Any) -> Array:
    """Float (C, H * W) indicator of the adaptive-pooling bins, segment c = i * c_w + j."""
    (height, width), (pool_h, pool_w) = grid, pools

    def bin_indicator(length: int, parts: int) -> Array:  # (parts, length)
        bounds = adaptive_bins(length, parts)
        starts = xp.asarray([start for start, _ in bounds], device=device)[:, None]
        stops = xp.asarray([stop for _, stop in bounds], device=device)[:, None]
        positions = xp.astype(xp.arange(length, device=device), starts.dtype)[None, :]
        return xp.astype((positions >= starts) & (positions < stops), dtype)

    rows, columns = bin_indicator(height, pool_h), bin_indicator(width, pool_w)
    membership = rows[:, None, :, None] * columns[None, :, None, :]  # (c_h, c_w, H, W)
    return xp.reshape(membership, (pool_h * pool_w, height * width))


def _segment_membership(xp: Any, mask: Array, length: int, num_segments: int,
                        *, dtype: Any, device: Any) -> Array:
    """Float (..., C, L) indicator: entry l is allowed and lies in 1-D segment c.

    Segments are contiguous runs of the *allowed* entries (ranked in order), with sizes
    differing by at most one (the first ``count % C`` segments get one more,
    as :func:`xattn._core.array.index_sizes`). Built from integer array arithmetic (a
    cumulative sum of the mask), with no Python control flow on values.
    """
    allowed = xp.astype(mask, xp.int32)
    rank = xp.cumulative_sum(allowed, axis=-1) - allowed  # position among allowed entries
    count = xp.sum(allowed, axis=-1, keepdims=True)
    base = count // num_segments
    extra = count % num_segments
    in_long_segments = extra * (base + 1)  # the first `extra` segments have base + 1 entries
    segment = xp.where(
        rank < in_long_segments,
        rank // (base + 1),
        extra + (rank - in_long_segments) // xp.maximum(base, 1),
    )
    segment_ids = xp.arange(num_segments, device=device)
    member = (segment[..., None, :] == xp.astype(segment_ids, segment.dtype)[:, None]) & (
        allowed[..., None, :] > 0)
    return xp.astype(member, dtype)


def _contiguous_segment_means(xp: Any, x: Array, num_segments: int,
                              device: Any) -> tuple[Array, Array]:
    """Means (..., C, D) of C contiguous 1-D segments of all L rows of x, and sizes (C,).

    Without a mask the segments are static slices (sizes from
    :func:`xattn._core.array.index_sizes`), so two reshapes give the means in O(L D).
    Segments left empty when C > L get a zero mean.
    """
    length, dim, batch = x.shape[-2], x.shape[-1], x.shape[:-2]
    # // and %, not divmod: torch.compile traces no divmod of a symbolic length
    base, extra = length // num_segments, length % num_segments
    in_long_segments = extra * (base + 1)
    # the rows of the long and of the short segments, by one split (a slice's backward
    # writes a gradient of all of x, one for each)
    if extra and base:
        long_rows, short_rows = split_rows_at(x, [in_long_segments])
    else:
        long_rows = short_rows = x  # one kind of segment: all the rows
    means = []
    if extra:  # the first `extra` segments have base + 1 rows
        means.append(xp.mean(xp.reshape(long_rows, (*batch, extra, base + 1, dim)), axis=-2))
    if base:
        means.append(xp.mean(xp.reshape(short_rows, (*batch, num_segments - extra, base, dim)),
                             axis=-2))
    else:
        means.append(xp.zeros((*batch, num_segments - extra, dim), dtype=x.dtype,
                              device=device))
    sizes = xp.asarray(index_sizes(length, num_segments), dtype=x.dtype, device=device)
    segment_means = join(xp, means, axis=-2)
    # Dask: the reshapes leave one chunk per segment; keep the C means in one chunk
    return one_chunk_along(segment_means, -2), sizes


def segment_means(xp: Any, x: Array, mask: Array | None, num_segments: int, device: Any, *,
                  grid: tuple[int, int] | None = None,
                  pools: tuple[int, int] | None = None) -> tuple[Array, Array]:
    """Segment means (..., C, D) of the allowed rows of x, and the segment sizes.

    1-D (``grid=None``): C contiguous runs of the allowed rows; without a mask by static
    slices in O(L D), with a mask through the (..., C, L) membership matrix, O(L C D).
    2-D (``grid=(H, W)``, ``pools=(c_h, c_w)``): the adaptive-pooling bins, through the
    static (C, L) bin indicator, O(L C D); a mask removes its tokens from the bins. The
    sizes have shape (C,) without a mask and (..., C) with one. A segment without members
    gets a zero mean.
    """
    if grid is None:
        if mask is None:
            return _contiguous_segment_means(xp, x, num_segments, device)
        membership = _segment_membership(xp, mask, x.shape[-2], num_segments, dtype=x.dtype,
                                         device=device)
        sizes = xp.sum(membership, axis=-1)
        safe_sizes = nonzero_divisor(xp, sizes)
        return (membership @ x) / safe_sizes[..., None], sizes
    assert pools is not None  # check_segments returns grid and pools together
    membership = _grid_membership(xp, grid, pools, dtype=x.dtype, device=device)  # (C, L)
    if mask is None:
        sizes = xp.sum(membership, axis=-1)  # (C,): (bin height) * (bin width), never 0
        return one_chunk_along((membership @ x) / sizes[:, None], -2), sizes
    allowed = xp.astype(mask, x.dtype)[..., :, None]  # (..., L, 1)
    sizes = (membership @ allowed)[..., 0]  # (..., C) allowed tokens per bin
    safe_sizes = nonzero_divisor(xp, sizes)
    totals = membership @ xp.where(mask[..., :, None], x, 0.0)  # masked tokens: no part
    return one_chunk_along(totals / safe_sizes[..., None], -2), sizes

