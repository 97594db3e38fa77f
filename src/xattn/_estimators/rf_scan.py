r"""Random-feature sums over a prefix (or suffix) of the keys, in blocks of chunks.

Causal RFA needs, for every query :math:`n`, the random-feature sums over the keys
:math:`m \le n`; the windowed RFA of :mod:`xattn._estimators.window` needs them over
:math:`m \le n - o` and :math:`m \ge n + o` (keys outside a band of half-width
:math:`o - 1`). This module computes them over blocks of positions, each block as long as
a working-memory budget allows (:func:`block_positions`: the whole sequence when it
fits, so that a call is a fixed number of array operations):

* a **carried state** holds the statistics of the keys of earlier blocks with a running
  maximum per random feature that is rescaled as it grows (online softmax per feature):
  :math:`K_s = \max_m a_{ms}`, :math:`A'_s = \sum_m e^{a_{ms} - K_s} [v_m, 1]` for the
  positive map, :math:`a_{ms} = \omega_s \cdot \hat k_m - \lVert \hat k_m \rVert^2/2`;
* inside a block, the chunkwise-parallel form of :mod:`xattn._estimators.chunks`: chunks
  of :data:`~xattn._estimators.chunks.PAIR_BLOCK` positions carried as an axis, the state
  before each chunk (the carried state and the earlier chunks) an exclusive prefix over
  the chunk axis (:func:`~xattn._estimators.chunks.exclusive_prefix`), and a query and a
  key of the same chunk paired **exactly**, :math:`\kappa_{nm} = \sum_s e^{\omega_s
  \cdot \hat q_n + a_{ms}}`, with one shift per query and one per key (rank one:
  :meth:`~xattn._estimators.feature_maps.PositiveMap.block`).

Every query gets its sums with the shift :math:`\alpha_n + \mu_n`, its largest query
logit plus the largest key shift it attends: the result equals the non-causal formula
applied to its prefix, up to rounding, while the spread of a row's terms fits the
dtype's exponent range (typical scores up to about 100 in float32 and :math:`10^4` in
float64; beyond, a row's largest terms can underflow), and no stabilizer of a query
depends on a key it does not attend.

Results are *partials* ``(shift, sums, weight)``: ``sums[..., :Dv]`` and
``sums[..., Dv]`` are numerator and denominator times :math:`e^{-\text{shift}}`, and
``weight`` bounds the absolute denominator (equal to it for positive maps). Partials of
disjoint key sets add up after rescaling to a common shift (:func:`combine_partials`).

The output is assembled block by block in :class:`~xattn._core.primitives.RowPieces`:
written into the result as the blocks are made where arrays can be written in place
(NumPy, CuPy), concatenated once at the end elsewhere.

NaN and infinity: the estimators read their inputs through
:func:`~xattn._core.primitives.finite_entries` (non-finite entries as 0) and mark the rows
that a non-finite key, value or query reaches with NaN at the end
(:func:`~xattn._core.primitives.quarantine`), so no NaN from the inputs enters this scan, nor
its backward pass. A key logit is never NaN or ``+inf`` (:meth:`PositiveMap.keys`), and
masked entries are selected away with ``where`` before any exponential, never multiplied
by zero.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any, Protocol

import array_api_compat

from xattn._core.array import Array, one_chunk_along, stream_bounds
from xattn._core.delegation import ratio_to_last_column
from xattn._core.primitives import (
    RowBlocks,
    RowPieces,
    finite_entries,
    merge_maxima,
    pad_rows,
    value_columns,
)
from xattn._estimators.chunks import PAIR_BLOCK, chunk_layout

__all__ = [
    "PAIR_BLOCK",
    "FeatureMap",
    "block_positions",
    "causal_scan",
    "combine_partials",
    "finish_partial",
    "returned_state",
    "scan_partials",
    "state_over_keys",
]

Partial = tuple[Array, Array, Array]
"""``(shift, sums, weight)`` of a block of queries over a set of keys (module docstring)."""

State = tuple[Array, ...]
"""The statistics of a set of keys that a feature map carries from block to block."""


class FeatureMap(Protocol):
    """What :func:`scan_partials`, :func:`state_over_keys` and
    :mod:`xattn._estimators.window` use of a feature map (:class:`PositiveMap`,
    :class:`TrigonometricMap`)."""

    key_fills: tuple[float, ...]
    """Per array returned by :meth:`keys`, the fill of the rows of padding keys."""
    pair_block: int
    """The longest chunk of :meth:`block` (:func:`~xattn._estimators.chunks.chunk_layout`)."""
    multiple: int
    """The largest power of two up to :attr:`pair_block`: the chunk of a block padded
    to whole chunks beforehand (:func:`~xattn._estimators.chunks.padded_length`)."""

    def queries(self, q_hat: Array) -> Array:
        """The queries' side of the features, (..., B, F)."""
        ...

    def query_constant(self, q_hat: Array) -> Array:
        """log of the per-query factor left out of :meth:`queries`, (..., B, 1)."""
        ...

    def keys(self, k_hat: Array, valid: Array | None) -> tuple[Array, ...]:
        """The keys' side of the features; ``valid`` False drops a key."""
        ...

    def empty_state(self, batch_shape: tuple[int, ...], width: int, dtype: Any,
                    device: Any) -> State:
        """The state of no keys."""
        ...

    def key_state(self, keys: tuple[Array, ...], values: Array) -> State:
        """The state of a set of keys (all of them for every query)."""
        ...

    def merge_states(self, first: State, second: State) -> State:
        """The state of the union of two disjoint sets of keys."""
        ...

    def readout(self, queries: Array, state: State) -> Partial:
        """Every query against all keys of ``state``."""
        ...

    def block(self, queries: Array, keys: tuple[Array, ...], values: Array,
              state: State | None, *, chunk: int,
              keep_state: bool = True) -> tuple[Partial, State | None]:
        """A block of aligned queries and keys (key ``i`` allowed for query ``j`` iff
        ``i <= j``) after the keys of ``state`` (None: no key before the block), in
        chunks of ``chunk`` positions; returns its partial and
        the new state (None may be returned without ``keep_state``: no later block or
        caller reads it)."""
        ...


def combine_partials(xp: Any, partials: list[Partial]) -> Partial:
    """Sum the partials of disjoint key sets, rescaled to their common (largest) shift."""
    if len(partials) == 1:
        return partials[0]
    shift, _, factors = merge_maxima(xp, *(partial[0] for partial in partials))
    sums = weight = None
    for factor, (_, part_sums, part_weight) in zip(factors, partials, strict=True):
        sums = factor * part_sums if sums is None else sums + factor * part_sums
        weight = factor * part_weight if weight is None else weight + factor * part_weight
    return shift, sums, weight


def finish_partial(xp: Any, partial: Partial, *, guard: bool) -> tuple[Array, Array | None]:
    """``numerator / denominator`` of a partial; a row without keys gets zeros.

    With ``guard`` (trigonometric map) the denominator is floored at ``sqrt(eps)`` times
    the weight (the bound on its absolute value); returns the output and the rows that
    were clamped (None without ``guard``).
    """
    _, sums, weight = partial
    if not guard:  # a row with keys has a denominator >= 1 (its largest term is e^0 b' and
        # b' >= 1 likewise), a row without has 0 / 0: the floor makes it 0 / tiny = 0
        return ratio_to_last_column(sums, xp.finfo(sums.dtype).smallest_normal), None
    numerator, denominator = sums[..., :-1], sums[..., -1:]
    floor = math.sqrt(xp.finfo(denominator.dtype).eps) * weight
    has_keys = weight > 0
    invalid = has_keys & (denominator <= floor)
    safe = xp.where(denominator > floor, denominator,
                    xp.where(has_keys, floor, 1.0))
    return numerator / safe, invalid


def _key_validity(xp: Any, key_mask: Array | None, first_key: int, start: int, stop: int,
                 device: Any, rows_after: int = 0) -> Array | None:
    """Boolean (..., stop - start + rows_after): keys that take part (``key_mask``, and
    ``m >= first_key``; none of the ``rows_after`` padding rows after ``stop``)."""
    valid = None
    if first_key > start or rows_after:
        positions = xp.arange(start, stop + rows_after, device=device)
        valid = (positions >= first_key) & (positions < stop)
    if key_mask is not None:
        chunk = key_mask[..., start:stop]
        if rows_after:
            chunk = xp.concat([chunk, xp.zeros((*chunk.shape[:-1], rows_after), dtype=xp.bool,
                                               device=device)], axis=-1)
        valid = chunk if valid is None else (chunk & valid)
    return valid


def block_positions(*, length: int, batch_size: int, num_features: int, width: int,
                    itemsize: int, working_memory: int, band: int = 0) -> int:
    r"""Positions per block of :func:`scan_partials` under a working-memory budget.

    The intermediates of a block of B positions, per batch-head, are about :math:`6 F + 4
    b + 4 E + 3 F E / b + 3 \cdot \text{band}` numbers per position, F features (2S for
    the trigonometric and hyperbolic maps), E = Dv + 1 value columns, b =
    :data:`PAIR_BLOCK`, ``band`` the exact keys per query of a window (the features of
    queries and keys, the (b, b) pairs of each chunk, the states before the chunks). The
    block is as long as ``working_memory`` bytes allow (a multiple of b, at least one
    chunk), whatever the length, so the working set does not depend on it. Below the
    budget the whole sequence is one block: a fixed number of array operations at any
    length.
    """
    per_position = (6 * num_features + 4 * PAIR_BLOCK + 4 * width
                    + 3 * num_features * width // PAIR_BLOCK + 3 * band)
    per_position *= max(batch_size, 1) * itemsize
    largest = max(PAIR_BLOCK, working_memory // per_position // PAIR_BLOCK * PAIR_BLOCK)
    return min(largest, -(-max(length, 1) // PAIR_BLOCK) * PAIR_BLOCK)


def _key_inputs(xp: Any, mapping: FeatureMap, k: RowBlocks, v: RowBlocks, root_scale: float,
                key_mask: Array | None, first_key: int, start: int, stop: int,
                finite: bool = False, rows_after: int = 0) -> tuple[tuple[Array, ...], Array]:
    """The mapped keys ``start:stop`` and their value columns (``finite``: k and v have
    no NaN or infinity, :func:`~xattn._core.primitives.finite_inputs`, read as they are),
    with ``rows_after`` padding keys after them that take no part (appended to the rows of
    k and v as they are read: no padded copy of the mapped keys)."""
    keys = finite_entries(xp, k.get(start, stop), finite, rows_after)
    values = value_columns(xp, v.get(start, stop), finite, rows_after)
    device = array_api_compat.device(keys)
    valid = _key_validity(xp, key_mask, first_key, start, stop, device, rows_after)
    return mapping.keys(keys if root_scale == 1.0 else root_scale * keys, valid), values


def state_over_keys(xp: Any, mapping: FeatureMap, k: Array, v: Array, *, root_scale: float,
                    key_mask: Array | None, first_key: int, start: int, stop: int,
                    chunk_size: int, batch_shape: tuple[int, ...],
                    finite: bool = False) -> State:
    """The state of the keys ``start:stop`` (all of them for every query), streamed
    (``finite``: as :func:`_key_inputs`)."""
    state = mapping.empty_state(batch_shape, v.shape[-1] + 1, k.dtype,
                                array_api_compat.device(k))
    if start >= stop:
        return state
    key_rows, value_rows = RowBlocks(xp, k, chunk_size), RowBlocks(xp, v, chunk_size)
    for chunk_start, chunk_stop in stream_bounds(k[..., start:stop, :], -2, chunk_size):
        keys, values = _key_inputs(xp, mapping, key_rows, value_rows, root_scale, key_mask,
                                   first_key, start + chunk_start, start + chunk_stop, finite)
        state = mapping.merge_states(state, mapping.key_state(keys, values))
    return state


def scan_partials(xp: Any, mapping: FeatureMap, q: Array, k: Array, v: Array, *, root_scale: float,
                  key_mask: Array | None, first_key: int, offset: int, reverse: bool,
                  block_size: int, chunk_size: int, batch_shape: tuple[int, ...],
                  initial: State | None = None, keep_state: bool = True,
                  finite: bool = False, returned: list[State] | None = None,
                  chunk: int | None = None) -> Generator[Partial, None, None]:
    """Partials of the queries over their prefix (or suffix) keys, block by block.

    Query ``n`` takes the keys ``m <= n - offset`` (``reverse=False``) or ``m >= n +
    offset`` (``reverse=True``) that are valid (``key_mask``, ``m >= first_key``). The
    blocks ``[start, start + block_size)`` are yielded as they are computed: from the
    first with ``reverse=False``, from the last with ``reverse=True`` (the caller keeps
    what it needs of them, :func:`xattn._estimators.window.windowed_rfa`). ``initial``
    (forward only) is the state of keys before all of ``k``, every query's (a sequence continued,
    :mod:`xattn._estimators.decode`); with ``keep_state`` the state after the last block is
    appended to ``returned`` once the last block has been read (:func:`returned_state`; not
    the generator's return value, which ``torch.compile`` loses).
    With ``finite`` q, k and v hold no NaN or infinity
    (:func:`~xattn._core.primitives.finite_inputs`) and are read as they are. ``chunk``:
    the positions per chunk of every block, whose length it divides (None: each block's
    :func:`~xattn._estimators.chunks.chunk_layout`).

    Design: a generator, so that a caller walks the blocks in lock-step with its own
    work on the same positions: :func:`xattn._estimators.window.windowed_rfa` runs one scan for the
    keys before the band and one (``reverse=True``) for those after it, and combines
    each block's partial with the exact band of the same queries as it comes, so no
    (N, ...) array of partials is held.
    """
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    device = array_api_compat.device(q)
    width = v.shape[-1] + 1
    blocks = [(start, min(start + block_size, num_queries))
              for start in range(0, num_queries, block_size)]
    state = initial  # None: no key yet (the first block merges no carried state)

    def carried() -> State:
        return (mapping.empty_state(batch_shape, width, q.dtype, device) if state is None
                else state)

    if reverse and num_queries + offset < num_keys:
        # keys after the last query's reach are in every query's suffix
        state = state_over_keys(xp, mapping, k, v, root_scale=root_scale, key_mask=key_mask,
                                first_key=first_key, start=num_queries + offset,
                                stop=num_keys, chunk_size=chunk_size,
                                batch_shape=batch_shape)

    query_rows, key_rows, value_rows = (RowBlocks(xp, x, block_size) for x in (q, k, v))

    def run() -> Generator[Partial, None, None]:
        nonlocal state
        for start, stop in (reversed(blocks) if reverse else blocks):
            length = stop - start
            # the block in equal chunks of at most pair_block positions, as many as the
            # prefix over them groups without padding (chunks.chunk_layout), padded by
            # fewer positions than chunks: forward, as its rows are read (the padding
            # after them); reversed, after they are flipped
            block_chunk, count = ((chunk, -(-length // chunk)) if chunk is not None
                                  else chunk_layout(length, mapping.pair_block))
            padding = block_chunk * count - length
            appended = 0 if reverse else padding
            queries = finite_entries(xp, query_rows.get(start, stop), finite, appended)
            queries = mapping.queries(queries if root_scale == 1.0 else root_scale * queries)
            # the block's keys, aligned so that key i is allowed for query j iff i <= j
            key_start, key_stop = ((start + offset, stop + offset) if reverse
                                   else (start - offset, stop - offset))
            low, high = max(key_start, 0), min(key_stop, num_keys)
            if low >= high:  # no key reaches this block: the carried state only
                readout = mapping.readout(queries, carried())
                yield readout if not appended else tuple(x[..., :length, :] for x in readout)
                continue
            # keys past the last one: appended as they are read (forward) or padded
            beyond = key_stop - high
            keys, values = _key_inputs(xp, mapping, key_rows, value_rows, root_scale, key_mask,
                                       first_key, low, high, finite,
                                       0 if reverse else beyond + padding)
            after = beyond if reverse else 0
            keys = tuple(pad_rows(xp, x, low - key_start, after, fill)
                         for x, fill in zip(keys, mapping.key_fills, strict=True))
            values = pad_rows(xp, values, low - key_start, after, 0.0)
            if reverse:
                queries, values = xp.flip(queries, axis=-2), xp.flip(values, axis=-2)
                keys = tuple(xp.flip(x, axis=-2) for x in keys)
            if padding and reverse:
                queries = pad_rows(xp, queries, 0, padding, 0.0)
                values = pad_rows(xp, values, 0, padding, 0.0)
                keys = tuple(pad_rows(xp, x, 0, padding, fill)
                             for x, fill in zip(keys, mapping.key_fills, strict=True))
            # Dask: the block (padding included) in one chunk, so that splitting it into
            # sub-blocks needs no rechunking and its output keeps the block's chunks
            queries, values = one_chunk_along(queries, -2), one_chunk_along(values, -2)
            keys = tuple(one_chunk_along(x, -2) for x in keys)
            last = start == (blocks[0][0] if reverse else blocks[-1][0])
            partial, state = mapping.block(queries, keys, values, state,
                                           keep_state=keep_state or not last,
                                           chunk=block_chunk)
            if padding:
                shift, sums, weight = partial
                partial = (shift[..., :length, :], sums[..., :length, :],
                           weight[..., :length, :])
            if reverse:
                shift, sums, weight = partial
                partial = (xp.flip(shift, axis=-2), xp.flip(sums, axis=-2),
                           xp.flip(weight, axis=-2))
            yield partial
        if returned is not None and keep_state:
            returned.append(carried())

    return run()


def returned_state(partials: Generator[Partial, None, None], returned: list[State]) -> State:
    """The state that :func:`scan_partials` (with ``keep_state``) puts in ``returned`` when
    its last block has been read."""
    for _ in partials:
        raise AssertionError("scan_partials yielded more blocks than asked for")
    return returned[-1]


def causal_scan(xp: Any, inputs: Any, mapping: FeatureMap, block_size: int, chunk_size: int,
                guard: bool) -> tuple[Array, Array | None]:
    """Causal attention by ``mapping``'s features over blocks of positions
    (:func:`xattn._estimators.rf_scan.scan_partials`): RFA's, and causal LARA's."""
    num_queries = inputs.q.shape[-2]
    out = RowPieces(num_queries)
    clamped = RowPieces(num_queries) if guard else None
    partials = scan_partials(xp, mapping, inputs.q, inputs.k, inputs.v,
                             root_scale=math.sqrt(inputs.scale), key_mask=inputs.key_mask,
                             first_key=0, offset=0, reverse=False, block_size=block_size,
                             chunk_size=chunk_size, batch_shape=inputs.batch_shape,
                             keep_state=False)
    for start, partial in zip(range(0, num_queries, block_size), partials, strict=True):
        rows, invalid = finish_partial(xp, partial, guard=guard)
        out.put(start, rows)
        if clamped is not None:
            clamped.put(start, invalid)
    return out.result(), None if clamped is None else clamped.result()
