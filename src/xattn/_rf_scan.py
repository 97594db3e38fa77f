r"""Random-feature sums over a prefix (or suffix) of the keys, walked in blocks.

Causal RFA needs, for every query :math:`n`, the random-feature sums over the keys
:math:`m \le n`; the windowed RFA of :mod:`xattn._window` needs them over
:math:`m \le n - o` and :math:`m \ge n + o` (keys outside a band of half-width
:math:`o - 1`). This module computes them in one pass over blocks of positions:

* a **carried state** holds the statistics of the keys of earlier blocks with a running
  maximum per random feature that is rescaled as it grows (online softmax per feature):
  :math:`K_s = \max_m a_{ms}`, :math:`A'_s = \sum_m e^{a_{ms} - K_s} [v_m, 1]` for the
  positive map, :math:`a_{ms} = \omega_s \cdot \hat k_m - \lVert \hat k_m \rVert^2/2`;
* inside a block, for the positive map, the keys are split into sub-blocks of
  :data:`PAIR_BLOCK` positions: the carried state and the keys of earlier sub-blocks are
  folded into the state before each sub-block (the same statistics, one per sub-block,
  from one matrix product per sample; in groups of :data:`SUB_GROUP` sub-blocks when a
  block has more, :func:`_prefix_states`), and a query and a key of the same sub-block
  are paired **exactly**: :math:`\log \kappa_{nm} = \operatorname{LSE}_s (\omega_s
  \cdot \hat q_n + a_{ms})` (computed by halving the sub-block, :func:`_pair_kernel`),
  all summed with one shift per query, the largest term of its row.

Every query therefore gets its sums with the shift of its own dominant term: the result
equals the non-causal formula applied to its prefix, up to rounding, whatever the size
of the scores (the dominant term is computed as :math:`e^0 = 1`, so no row can underflow
to zero), and no stabilizer of a query depends on a key it does not attend.

Results are *partials* ``(shift, sums, weight)``: ``sums[..., :Dv]`` and
``sums[..., Dv]`` are numerator and denominator times :math:`e^{-\text{shift}}`, and
``weight`` bounds the absolute denominator (equal to it for positive maps). Partials of
disjoint key sets add up after rescaling to a common shift (:func:`combine_partials`).

The output is assembled block by block in :class:`~xattn._primitives.RowPieces`:
written into the result as the blocks are made where arrays can be written in place
(NumPy, CuPy), concatenated once at the end elsewhere.

NaN and infinity: the estimators read their inputs through
:func:`~xattn._primitives.finite_entries` (non-finite entries as 0) and mark the rows
that a non-finite key, value or query reaches with NaN at the end
(:func:`~xattn._primitives.quarantine`), so no NaN from the inputs enters this scan, nor
its backward pass. A logit that is NaN all the same (an overflow, ``inf - inf``) still
reaches only the rows that attend its key: masked entries are selected away with
``where``, never multiplied by zero.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Generator
from typing import Any, Protocol

import array_api_compat

from xattn._array import Array, one_chunk_along, split_rows, stop_gradient, stream_bounds, take
from xattn._primitives import (
    RowBlocks,
    finite_entries,
    finite_shift,
    merge_maxima,
    nonzero_divisor,
    pad_rows,
    running_max,
    value_columns,
)
from xattn.features import log_positive_features

__all__ = ["FACTORED_GROUP", "PAIR_BLOCK", "SUB_GROUP", "FeatureMap", "PositiveMap",
           "TrigonometricMap", "combine_partials", "finish_partial", "scan_partials",
           "state_over_keys"]

PAIR_BLOCK = 16
"""Positions per sub-block whose query-key pairs are computed exactly (positive maps):
their cost per query grows with it, that of the states before the sub-blocks shrinks."""

FACTORED_GROUP = 8
"""From this size of half-group on, :func:`_pair_kernel` factorizes the cross pairs."""

SUB_GROUP = 8
"""Sub-blocks per group of the states before the sub-blocks (:func:`_prefix_states`)."""

Partial = tuple[Array, Array, Array]
"""``(shift, sums, weight)`` of a block of queries over a set of keys (module docstring)."""

State = tuple[Array, ...]
"""The statistics of a set of keys that a feature map carries from block to block."""


class FeatureMap(Protocol):
    """What :func:`scan_partials`, :func:`state_over_keys` and :mod:`xattn._window` use of
    a feature map (:class:`PositiveMap`, :class:`TrigonometricMap`)."""

    key_fills: tuple[float, ...]
    """Per array returned by :meth:`keys`, the fill of the rows of padding keys."""
    multiple: int
    """Blocks handed to :meth:`block` have a multiple of this many positions."""

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
              state: State) -> tuple[Partial, State]:
        """A block of aligned queries and keys (key ``i`` allowed for query ``j`` iff
        ``i <= j``) after the keys of ``state``; returns its partial and the new state."""
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
    numerator, denominator = sums[..., :-1], sums[..., -1:]
    if not guard:
        return numerator / nonzero_divisor(xp, denominator), None
    floor = math.sqrt(xp.finfo(denominator.dtype).eps) * weight
    has_keys = weight > 0
    invalid = has_keys & (denominator <= floor)
    safe = xp.where(denominator > floor, denominator,
                    xp.where(has_keys, floor, 1.0))
    return numerator / safe, invalid


def _lower_triangle(xp: Any, size: int, device: Any, *, strict: bool) -> Array:
    """Boolean (size, size): True where column <= row (< row if ``strict``)."""
    rows = xp.arange(size, device=device)[:, None]
    columns = xp.arange(size, device=device)[None, :]
    return rows > columns if strict else rows >= columns


def _key_validity(xp: Any, key_mask: Array | None, first_key: int, start: int, stop: int,
                 device: Any) -> Array | None:
    """Boolean (..., stop - start): keys that take part (``key_mask``, and ``m >= first_key``)."""
    valid = None
    if first_key > start:
        valid = xp.arange(start, stop, device=device) >= first_key
    if key_mask is not None:
        chunk = key_mask[..., start:stop]
        valid = chunk if valid is None else (chunk & valid)
    return valid


def _pair_kernel(xp: Any, queries: Array, keys: Array) -> Array:
    r"""The exact kernel of the pairs of a sub-block: (..., b, b), entry ``(n, m)``
    :math:`\sum_s e^{x_{ns} + y_{ms}}` for ``m <= n`` and 0 above the diagonal.

    ``queries`` :math:`x` and ``keys`` :math:`y` are (..., b, S), b a power of two, with
    :math:`x_{ns} + y_{ms} \le 0` for every ``m <= n`` (the queries are shifted by their
    rows' largest terms). The pairs are computed by halving: the diagonal, then for
    groups of 2, 4, ..., b positions the dense block of the second half's queries
    against the first half's keys. Every pair m <= n is computed once, no pair above the
    diagonal is (whose exponential may overflow), and one gather puts them in place.

    Halves of :data:`FACTORED_GROUP` positions or more are factorized through
    :math:`c_s = \max_m y_{ms}` over the first half's keys, which every query of the
    second half attends: :math:`e^{x_{ns} + y_{ms}} = e^{x_{ns} + c_s} e^{y_{ms} - c_s}`,
    one matrix product. Both factors are at most 1 (:math:`x_{ns} + c_s \le 0` by the
    condition above), so a factor that underflows leaves a product that underflows
    anyway, and the exponents, both non-positive, add up to the exact one without
    cancellation: the entries are those of the direct sum up to rounding.
    """
    size = queries.shape[-2]
    pieces = [xp.sum(xp.exp(queries + keys), axis=-1)]  # the diagonal, (..., b)
    group = 1
    while group < size:  # the second halves of groups of 2 * group against the first
        halves = size // (2 * group)
        second = xp.reshape(queries, (*queries.shape[:-2], halves, 2, group, queries.shape[-1]))
        first = xp.reshape(keys, (*keys.shape[:-2], halves, 2, group, keys.shape[-1]))
        if group < FACTORED_GROUP:
            cross = xp.sum(xp.exp(second[..., 1, :, None, :] + first[..., 0, None, :, :]),
                           axis=-1)
        else:
            first_keys = first[..., 0, :, :]  # (..., halves, group, S)
            key_max = xp.max(stop_gradient(first_keys), axis=-2, keepdims=True)
            cross = (xp.exp(second[..., 1, :, :] + key_max)
                     @ xp.matrix_transpose(xp.exp(first_keys - finite_shift(xp, key_max))))
        pieces.append(xp.reshape(cross, (*cross.shape[:-3], halves * group * group)))
        group *= 2
    pieces.append(xp.zeros_like(pieces[0][..., :1]))  # above the diagonal
    kernel = take(one_chunk_along(xp.concat(pieces, axis=-1), -1), _pair_places(size), axis=-1)
    kernel = xp.reshape(kernel, (*kernel.shape[:-1], size, size))
    return one_chunk_along(one_chunk_along(kernel, -1), -2)  # Dask: one chunk per sub-block


@functools.cache
def _pair_places(size: int) -> list[int]:
    """For each entry ``(n, m)`` of a (size, size) kernel, row-major, its place in the
    pieces of :func:`_pair_kernel`: the diagonal, the levels, then a zero."""
    offsets, place, group = {}, size, 1
    while group < size:
        offsets[group], place, group = place, place + size * group // 2, group * 2
    places = []
    for row in range(size):
        for column in range(size):
            if column > row:
                places.append(place)  # the zero, after the last level
            elif column == row:
                places.append(row)
            else:
                group = 1 << ((row ^ column).bit_length() - 1)  # the halves they differ in
                places.append(offsets[group] + (row // (2 * group)) * group * group
                              + (row % group) * group + column % group)
    return places


def _merge_parts(xp: Any, part_max: Array, part_sums: Array, rows: int) -> tuple[Array, Array]:
    """The statistics of the parts ``c <= j`` for ``j < rows``: parts along the last axis of
    ``part_max`` (..., P) and axis -2 of ``part_sums`` (..., P, E); returns (..., rows) and
    (..., rows, E), by :func:`~xattn._primitives.merge_maxima`'s rule through a
    lower-triangular selection (one matrix product per leading index)."""
    device = array_api_compat.device(part_max)
    taken = (xp.arange(part_max.shape[-1], device=device)[None, :]
             <= xp.arange(rows, device=device)[:, None])  # [j, c]
    taken_max = xp.where(taken, part_max[..., None, :], -xp.inf)  # (..., rows, P)
    merged_max = xp.max(taken_max, axis=-1)
    return merged_max, xp.exp(taken_max - finite_shift(xp, merged_max)[..., None]) @ part_sums


def _prefix_states(xp: Any, state: State, sub_max: Array, clean_max: Array,
                   sub_sums: Array) -> tuple[Array, Array, State]:
    r"""The states before each of J sub-blocks (the carried ``state`` and the sub-blocks
    before it) and the state after all of them.

    ``sub_max`` (..., S, J) holds the sub-blocks' maxima :math:`K^i_s`, NaN for a sub-block
    with a NaN key, ``clean_max`` the same without the NaN, ``sub_sums`` (..., S, J, E)
    their sums :math:`A^i_s`. Returns the maxima (..., S, J) and sums (..., S, J, E) before
    each sub-block, and the state after the last one.

    Up to :data:`SUB_GROUP` sub-blocks, the J + 1 parts (the carried state, then the
    sub-blocks) are merged in one selection of J + 1 rows. More are taken in groups of
    ``SUB_GROUP``: the groups' statistics, the states before each group (one selection
    over the groups), then within each group the states before its sub-blocks, so that
    the selections stay small (their cost grows with the square of their parts).
    """
    state_max, state_sums = state
    carried_max, carried_sums = state_max[..., None], state_sums[..., None, :]
    num_sub = sub_max.shape[-1]
    if num_sub <= SUB_GROUP:
        merged_max, merged_sums = _merge_parts(
            xp, xp.concat([carried_max, sub_max], axis=-1),
            xp.concat([carried_sums, sub_sums], axis=-2), num_sub + 1)
        before_sums, after_sums = split_rows(merged_sums, num_sub)
        return (merged_max[..., :num_sub], before_sums,
                (merged_max[..., num_sub], after_sums[..., 0, :]))
    num_groups = -(-num_sub // SUB_GROUP)
    padding = num_groups * SUB_GROUP - num_sub  # empty sub-blocks: no keys

    def grouped(x: Array, fill: float, axis: int) -> Array:
        if padding:
            shape = list(x.shape)
            shape[axis] = padding
            x = one_chunk_along(xp.concat(
                [x, xp.full(tuple(shape), fill, dtype=x.dtype,
                            device=array_api_compat.device(x))], axis=axis), axis)
        shape, axis = list(x.shape), axis % x.ndim
        shape[axis:axis + 1] = [num_groups, SUB_GROUP]
        return xp.reshape(x, tuple(shape))

    sub_max, clean_max = grouped(sub_max, -math.inf, -1), grouped(clean_max, -math.inf, -1)
    sub_sums = grouped(sub_sums, 0.0, -2)  # (..., S, G, g, E)
    # the groups' statistics: a group with a NaN key has a NaN maximum (max propagates it)
    group_clean = stop_gradient(xp.max(clean_max, axis=-1))  # (..., S, G)
    group_weights = xp.exp(clean_max - finite_shift(xp, group_clean)[..., None])
    group_sums = (group_weights[..., None, :] @ sub_sums)[..., 0, :]  # (..., S, G, E)
    group_max = xp.max(sub_max, axis=-1)
    # the states before each group (rows g < G) and after the last (row G)
    merged_max, merged_sums = _merge_parts(
        xp, xp.concat([carried_max, group_max], axis=-1),
        xp.concat([carried_sums, group_sums], axis=-2), num_groups + 1)
    before_sums, after_sums = split_rows(merged_sums, num_groups)
    new_state = (merged_max[..., num_groups], after_sums[..., 0, :])
    # within each group, the state before each sub-block: parts c = 0 (the state before
    # the group) and c = i + 1 (its sub-block i)
    prefix_max, prefix_sums = _merge_parts(
        xp, xp.concat([merged_max[..., :num_groups, None], sub_max], axis=-1),
        xp.concat([before_sums[..., None, :], sub_sums], axis=-2), SUB_GROUP)
    prefix_max = xp.reshape(prefix_max, (*prefix_max.shape[:-2], num_groups * SUB_GROUP))
    prefix_sums = xp.reshape(prefix_sums, (*prefix_sums.shape[:-3], num_groups * SUB_GROUP,
                                           prefix_sums.shape[-1]))
    return prefix_max[..., :num_sub], prefix_sums[..., :num_sub, :], new_state


class PositiveMap:
    r"""Positive (and hyperbolic: samples :math:`\pm\omega`) features in the log domain.

    Queries are represented by :math:`p_{ns} = \omega_s \cdot \hat q_n`, keys by their
    masked logits :math:`a_{ms}`; the state is ``(K (..., S), A' (..., S, E))`` with a raw
    maximum (``-inf`` while no key was seen).
    """

    key_fills: tuple[float, ...] = (-math.inf,)

    def __init__(self, xp: Any, omega: Array, pair_block: int = PAIR_BLOCK) -> None:
        self.xp = xp
        self.omega = omega
        self.omega_t = xp.matrix_transpose(omega)
        self.num_samples = omega.shape[0]
        self.multiple = 1 << (pair_block.bit_length() - 1)  # a power of two, <= pair_block

    def queries(self, q_hat: Array) -> Array:
        return q_hat @ self.omega_t  # p_ns, (..., B, S)

    def query_constant(self, q_hat: Array) -> Array:
        """log of the factors left out of ``queries``: -|q_n|^2/2 - log S (the 1/S mean)."""
        xp = self.xp
        return -0.5 * xp.sum(q_hat * q_hat, axis=-1, keepdims=True) - math.log(self.num_samples)

    def keys(self, k_hat: Array, valid: Array | None) -> tuple[Array, ...]:
        xp = self.xp
        logits = log_positive_features(xp, k_hat, self.omega)  # a_ms
        if valid is not None:
            logits = xp.where(valid[..., None], logits, -xp.inf)
        return (logits,)

    def empty_state(self, batch_shape: tuple[int, ...], width: int, dtype: Any,
                    device: Any) -> State:
        xp = self.xp
        return (xp.full((*batch_shape, self.num_samples), -xp.inf, dtype=dtype, device=device),
                xp.zeros((*batch_shape, self.num_samples, width), dtype=dtype, device=device))

    def key_state(self, keys: tuple[Array, ...], values: Array) -> State:
        """The state of a set of keys: K_s and A'_s over all of them."""
        xp = self.xp
        (logits,) = keys
        key_max = stop_gradient(xp.max(logits, axis=-2))  # raw: -inf for a sample without keys
        weights = xp.exp(logits - finite_shift(xp, key_max)[..., None, :])
        return key_max, xp.matrix_transpose(weights) @ values

    def merge_states(self, first: State, second: State) -> State:
        key_max, _, (first_factor, second_factor) = merge_maxima(self.xp, first[0], second[0])
        return key_max, (first_factor[..., None] * first[1] + second_factor[..., None] * second[1])

    def readout(self, queries: Array, state: State) -> Partial:
        """Every query against all keys of ``state``: Q_n = max_s (p_ns + K_s)."""
        xp = self.xp
        key_max, sums = state
        logits = queries + key_max[..., None, :]  # -inf for samples without keys
        shift = stop_gradient(xp.max(logits, axis=-1, keepdims=True))
        out = xp.exp(logits - finite_shift(xp, shift)) @ sums
        return shift, out, out[..., -1:]

    def block(self, queries: Array, keys: tuple[Array, ...], values: Array,
              state: State) -> tuple[Partial, State]:
        """One block: key ``i`` of the block is allowed for query ``j`` iff ``i <= j``.

        Design: the B positions are J = B / b sub-blocks of b = ``PAIR_BLOCK``, so the
        intermediates carry a sub-block axis J besides the positions b and samples S.
        (1) Each sub-block i gets its statistics :math:`K^i_s, A^i_s`. (2) The state
        before each sub-block j (the carried state and the sub-blocks i < j) is made for
        all j at once, and the state after the block with them (:func:`_prefix_states`:
        the parts are merged by :func:`~xattn._primitives.merge_maxima`'s rule through
        lower-triangular selections, with S in front so that the sum over the parts is
        one matrix product per sample). (3) Each query reads the state before its
        sub-block and takes the exact pairs of its own sub-block (:func:`_pair_kernel`),
        all with one shift, its largest term.
        """
        xp = self.xp
        (logits,) = keys
        pair_block = self.multiple
        length, num_samples, width = queries.shape[-2], queries.shape[-1], values.shape[-1]
        num_sub = length // pair_block
        device = array_api_compat.device(queries)
        dtype = queries.dtype
        nan = xp.asarray(xp.nan, dtype=dtype, device=device)
        p = xp.reshape(queries, (*queries.shape[:-2], num_sub, pair_block, num_samples))
        a = xp.reshape(logits, (*logits.shape[:-2], num_sub, pair_block, num_samples))
        values = xp.reshape(values, (*values.shape[:-2], num_sub, pair_block, width))
        state_max = state[0]  # K (..., S); the state is (K, A' (..., S, E))

        # (1) statistics of each sub-block i: K^i_s (..., J, S) and A^i_s (..., J, S, E).
        # A key with a NaN logit (a NaN key or value) is left out of A^i and of the pairs
        # (logits -inf) and poisons K^i instead, hence every later state and row, but never
        # an earlier one (no zero weight ever multiplies a NaN). The logits are never
        # +inf, so a row's sum is NaN iff one of its logits is.
        key_nan = xp.isnan(xp.sum(stop_gradient(a), axis=-1))  # (..., J, b)
        clean_a = xp.where(key_nan[..., None], -xp.inf, a)
        # the stabilizers are constants (no gradient): computed from detached logits, so
        # that autograd records none of their operations
        clean_logits = stop_gradient(clean_a)
        sub_max = xp.max(clean_logits, axis=-2)
        sub_weights = xp.exp(clean_a - finite_shift(xp, sub_max)[..., None, :])
        sub_sums = xp.matrix_transpose(sub_weights) @ values
        clean_max, sub_max = sub_max, xp.where(xp.any(key_nan, axis=-1)[..., None], nan, sub_max)

        # (2) the states before the sub-blocks and after the block (S in front, so that
        # each merge of parts is one matrix product per sample)
        lead = state_max.shape[:-1]  # the carried state has the full batch shape
        prefix_max, prefix_sums, new_state = _prefix_states(
            xp, state, xp.broadcast_to(xp.matrix_transpose(sub_max), (*lead, num_samples, num_sub)),
            xp.broadcast_to(xp.matrix_transpose(clean_max), (*lead, num_samples, num_sub)),
            xp.broadcast_to(xp.moveaxis(sub_sums, -2, -3), (*lead, num_samples, num_sub, width)))
        prefix_max = xp.matrix_transpose(prefix_max)  # (..., J, S)

        # (3) one shift per query n: its largest term, from the prefix state or a pair
        # m <= n, max_s (p_ns + max_{m <= n} a_ms) (a running maximum; its last column
        # marks the rows at or after a NaN key of the sub-block, made NaN through their
        # logits: the running maximum of a NaN need not be NaN, XLA's may drop it)
        running = running_max(xp, xp.concat(
            [clean_logits, xp.astype(key_nan, dtype)[..., None]], axis=-1))
        shift = xp.max(stop_gradient(p) + xp.maximum(prefix_max[..., :, None, :],
                                                     running[..., :-1]),
                       axis=-1, keepdims=True)
        poison = xp.where(running[..., -1:] > 0, nan, 0.0)  # (..., J, b, 1)
        shifted = p - finite_shift(xp, shift) + poison  # (..., J, b, S)
        # the prefix state and the exact pairs of each query, read out
        sums = (xp.exp(shifted + prefix_max[..., :, None, :]) @ xp.moveaxis(prefix_sums, -3, -2)
                + _pair_kernel(xp, shifted, clean_a) @ values)
        lead = sums.shape[:-3]
        sums = xp.reshape(sums, (*lead, length, width))
        shift = xp.reshape(shift, (*shift.shape[:-3], length, 1))
        return (shift, sums, sums[..., -1:]), new_state


class TrigonometricMap:
    r"""Trigonometric features :math:`[\sin \omega_s \cdot x, \cos \omega_s \cdot x]`.

    The norm factors are kept apart: the query's :math:`e^{\lVert \hat q_n \rVert^2/2}`
    is a per-query constant, the keys' :math:`w_m = e^{\lVert \hat k_m \rVert^2/2}` are
    shifted by their running maximum. The state is ``(max (..., 1, 1), A' (..., 2S, E),
    W (..., 1, 1))`` with :math:`A' = \sum_m w_m \phi(\hat k_m) [v_m, 1]` and
    :math:`W = \sum_m w_m`, which bounds the absolute denominator.
    """

    key_fills: tuple[float, ...] = (0.0, -math.inf)
    multiple: int = 1

    def __init__(self, xp: Any, omega: Array) -> None:
        self.xp = xp
        self.omega_t = xp.matrix_transpose(omega)
        self.num_samples = omega.shape[0]

    def _features(self, x: Array) -> Array:
        projections = x @ self.omega_t
        return self.xp.concat([self.xp.sin(projections), self.xp.cos(projections)], axis=-1)

    def queries(self, q_hat: Array) -> Array:
        return self._features(q_hat) / self.num_samples  # the 1/S of the mean

    def query_constant(self, q_hat: Array) -> Array:
        return 0.5 * self.xp.sum(q_hat * q_hat, axis=-1, keepdims=True)

    def keys(self, k_hat: Array, valid: Array | None) -> tuple[Array, ...]:
        xp = self.xp
        features = self._features(k_hat)
        features = xp.where(xp.isfinite(features), features, xp.zeros_like(features))
        half_sq_norm = 0.5 * xp.sum(k_hat * k_hat, axis=-1, keepdims=True)
        if valid is not None:
            half_sq_norm = xp.where(valid[..., None], half_sq_norm, -xp.inf)
        return features, half_sq_norm

    def empty_state(self, batch_shape: tuple[int, ...], width: int, dtype: Any,
                    device: Any) -> State:
        xp = self.xp
        return (xp.full((*batch_shape, 1, 1), -xp.inf, dtype=dtype, device=device),
                xp.zeros((*batch_shape, 2 * self.num_samples, width), dtype=dtype,
                         device=device),
                xp.zeros((*batch_shape, 1, 1), dtype=dtype, device=device))

    def key_state(self, keys: tuple[Array, ...], values: Array) -> State:
        xp = self.xp
        features, half_sq_norm = keys
        norm_max = xp.max(half_sq_norm, axis=-2, keepdims=True)  # (..., 1, 1), raw
        weights = xp.exp(half_sq_norm - finite_shift(xp, norm_max))  # w_m, (..., L, 1)
        return (norm_max, xp.matrix_transpose(features) @ (weights * values),
                xp.sum(weights, axis=-2, keepdims=True))

    def merge_states(self, first: State, second: State) -> State:
        norm_max, _, (first_factor, second_factor) = merge_maxima(self.xp, first[0], second[0])
        return (norm_max, first_factor * first[1] + second_factor * second[1],
                first_factor * first[2] + second_factor * second[2])

    def readout(self, queries: Array, state: State) -> Partial:
        xp = self.xp
        norm_max, sums, weight = state
        out = queries @ sums
        rows = (*out.shape[:-1], 1)
        return xp.broadcast_to(norm_max, rows), out, xp.broadcast_to(weight, rows)

    def block(self, queries: Array, keys: tuple[Array, ...], values: Array,
              state: State) -> tuple[Partial, State]:
        xp = self.xp
        features, half_sq_norm = keys
        norm_max, state_sums, state_weight = state
        device = array_api_compat.device(queries)
        allowed = _lower_triangle(xp, queries.shape[-2], device, strict=False)
        pair_norms = xp.where(allowed, xp.matrix_transpose(half_sq_norm), -xp.inf)  # (.., B, B)
        # online softmax over the state's keys and the block's allowed ones
        row_max, row_safe, (state_factor, _) = merge_maxima(
            xp, norm_max, xp.max(pair_norms, axis=-1, keepdims=True))  # factor 0: no key yet
        pair_weights = xp.exp(pair_norms - row_safe)  # w_m for allowed keys, else 0
        kernel = (queries @ xp.matrix_transpose(features)) * pair_weights
        sums = state_factor * (queries @ state_sums) + kernel @ values
        weight = state_factor * state_weight + xp.sum(pair_weights, axis=-1, keepdims=True)
        new_state = self.merge_states(state, self.key_state(keys, values))
        return (row_max, sums, weight), new_state


def _key_inputs(xp: Any, mapping: FeatureMap, k: RowBlocks, v: RowBlocks, root_scale: float,
                key_mask: Array | None, first_key: int, start: int,
                stop: int) -> tuple[tuple[Array, ...], Array]:
    """The mapped keys ``start:stop`` and their value columns."""
    values, keys = value_columns(xp, v.get(start, stop)), finite_entries(xp, k.get(start, stop))
    device = array_api_compat.device(keys)
    valid = _key_validity(xp, key_mask, first_key, start, stop, device)
    return mapping.keys(root_scale * keys, valid), values


def state_over_keys(xp: Any, mapping: FeatureMap, k: Array, v: Array, *, root_scale: float,
                    key_mask: Array | None, first_key: int, start: int, stop: int,
                    chunk_size: int, batch_shape: tuple[int, ...]) -> State:
    """The state of the keys ``start:stop`` (all of them for every query), streamed."""
    state = mapping.empty_state(batch_shape, v.shape[-1] + 1, k.dtype,
                                array_api_compat.device(k))
    if start >= stop:
        return state
    key_rows, value_rows = RowBlocks(xp, k, chunk_size), RowBlocks(xp, v, chunk_size)
    for chunk_start, chunk_stop in stream_bounds(k[..., start:stop, :], -2, chunk_size):
        keys, values = _key_inputs(xp, mapping, key_rows, value_rows, root_scale, key_mask,
                                   first_key, start + chunk_start, start + chunk_stop)
        state = mapping.merge_states(state, mapping.key_state(keys, values))
    return state


def scan_partials(xp: Any, mapping: FeatureMap, q: Array, k: Array, v: Array, *, root_scale: float,
                  key_mask: Array | None, first_key: int, offset: int, reverse: bool,
                  block_size: int, chunk_size: int, batch_shape: tuple[int, ...],
                  initial: State | None = None) -> Generator[Partial, None, State]:
    """Partials of the queries over their prefix (or suffix) keys, block by block.

    Query ``n`` takes the keys ``m <= n - offset`` (``reverse=False``) or ``m >= n +
    offset`` (``reverse=True``) that are valid (``key_mask``, ``m >= first_key``). The
    blocks ``[start, start + block_size)`` are yielded as they are computed: from the
    first with ``reverse=False``, from the last with ``reverse=True`` (the caller keeps
    what it needs of them, :func:`xattn._window.windowed_rfa`). ``initial`` (forward only)
    is the state of keys before all of ``k``, every query's (a sequence continued,
    :mod:`xattn._decode`); the generator returns the state after the last block.

    Design: a generator, so that a caller walks the blocks in lock-step with its own
    work on the same positions: :func:`xattn._window.windowed_rfa` runs one scan for the
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
    state = (mapping.empty_state(batch_shape, width, q.dtype, device) if initial is None
             else initial)
    if reverse and num_queries + offset < num_keys:
        # keys after the last query's reach are in every query's suffix
        state = state_over_keys(xp, mapping, k, v, root_scale=root_scale, key_mask=key_mask,
                                first_key=first_key, start=num_queries + offset,
                                stop=num_keys, chunk_size=chunk_size,
                                batch_shape=batch_shape)

    query_rows, key_rows, value_rows = (RowBlocks(xp, x, block_size) for x in (q, k, v))

    def run() -> Generator[Partial, None, State]:
        nonlocal state
        for start, stop in (reversed(blocks) if reverse else blocks):
            length = stop - start
            queries = mapping.queries(root_scale * finite_entries(xp, query_rows.get(start, stop)))
            # the block's keys, aligned so that key i is allowed for query j iff i <= j
            key_start, key_stop = ((start + offset, stop + offset) if reverse
                                   else (start - offset, stop - offset))
            low, high = max(key_start, 0), min(key_stop, num_keys)
            if low >= high:  # no key reaches this block: the carried state only
                yield mapping.readout(queries, state)
                continue
            keys, values = _key_inputs(xp, mapping, key_rows, value_rows, root_scale, key_mask,
                                       first_key, low, high)
            keys = tuple(pad_rows(xp, x, low - key_start, key_stop - high, fill)
                         for x, fill in zip(keys, mapping.key_fills, strict=True))
            values = pad_rows(xp, values, low - key_start, key_stop - high, 0.0)
            if reverse:
                queries, values = xp.flip(queries, axis=-2), xp.flip(values, axis=-2)
                keys = tuple(xp.flip(x, axis=-2) for x in keys)
            padding = -length % mapping.multiple
            if padding:
                queries = pad_rows(xp, queries, 0, padding, 0.0)
                values = pad_rows(xp, values, 0, padding, 0.0)
                keys = tuple(pad_rows(xp, x, 0, padding, fill)
                             for x, fill in zip(keys, mapping.key_fills, strict=True))
            # Dask: the block (padding included) in one chunk, so that splitting it into
            # sub-blocks needs no rechunking and its output keeps the block's chunks
            queries, values = one_chunk_along(queries, -2), one_chunk_along(values, -2)
            keys = tuple(one_chunk_along(x, -2) for x in keys)
            partial, state = mapping.block(queries, keys, values, state)
            if padding:
                shift, sums, weight = partial
                partial = (shift[..., :length, :], sums[..., :length, :],
                           weight[..., :length, :])
            if reverse:
                shift, sums, weight = partial
                partial = (xp.flip(shift, axis=-2), xp.flip(sums, axis=-2),
                           xp.flip(weight, axis=-2))
            yield partial
        return state

    return run()
