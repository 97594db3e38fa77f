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
* inside a block, the chunkwise-parallel form of :mod:`xattn._estimators.chunks`: chunks of
  :data:`~xattn._estimators.chunks.PAIR_BLOCK` positions carried as an axis, the state before each
  chunk (the carried state and the earlier chunks) an exclusive prefix over the chunk
  axis (:func:`~xattn._estimators.chunks.exclusive_prefix`), and a query and a key of the same
  chunk paired **exactly**: :math:`\log \kappa_{nm} = \operatorname{LSE}_s (\omega_s
  \cdot \hat q_n + a_{ms})` (:func:`~xattn._estimators.chunks.pair_kernel`), all summed with one
  shift per query, the largest term of its row.

Every query therefore gets its sums with the shift of its own dominant term: the result
equals the non-causal formula applied to its prefix, up to rounding, whatever the size
of the scores (the dominant term is computed as :math:`e^0 = 1`, so no row can underflow
to zero), and no stabilizer of a query depends on a key it does not attend.

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

from xattn._core.array import (
    Array,
    cumulative_max,
    nan_to_num,
    one_chunk_along,
    stop_gradient,
    stream_bounds,
)
from xattn._core.primitives import (
    RowBlocks,
    finite_entries,
    finite_shift,
    merge_maxima,
    pad_rows,
    value_columns,
)
from xattn._estimators.chunks import DIRECT_PAIRS, PAIR_BLOCK, exclusive_prefix, pair_kernel

__all__ = ["PAIR_BLOCK", "FeatureMap", "PositiveMap", "TrigonometricMap", "block_positions",
           "combine_partials", "finish_partial", "scan_partials", "state_over_keys"]

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
              state: State | None) -> tuple[Partial, State]:
        """A block of aligned queries and keys (key ``i`` allowed for query ``j`` iff
        ``i <= j``) after the keys of ``state`` (None: no key before the block); returns
        its partial and the new state."""
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
    if not guard:  # a row with keys has a denominator >= 1 (its largest term is e^0 b' and
        # b' >= 1 likewise), a row without has 0 / 0: the floor makes it 0 / tiny = 0
        tiny = xp.finfo(denominator.dtype).smallest_normal
        return numerator / xp.clip(denominator, min=tiny), None
    floor = math.sqrt(xp.finfo(denominator.dtype).eps) * weight
    has_keys = weight > 0
    invalid = has_keys & (denominator <= floor)
    safe = xp.where(denominator > floor, denominator,
                    xp.where(has_keys, floor, 1.0))
    return numerator / safe, invalid


def _broadcast_lead(xp: Any, x: Array, lead: tuple[int, ...], trailing: int) -> Array:
    """``x`` broadcast to the leading shape ``lead`` of a carried state before its last
    ``trailing`` axes (no operation when it has that shape)."""
    target = (*lead, *x.shape[x.ndim - trailing:])
    return x if tuple(x.shape) == target else xp.broadcast_to(x, target)


def _broadcast_concat(xp: Any, arrays: list[Array], axis: int) -> Array:
    """``arrays`` joined along ``axis`` (-1 or -2), their other axes broadcast first."""
    ndim = max(x.ndim for x in arrays)
    shape = [1] * ndim
    for x in arrays:
        for place, size in enumerate(x.shape, start=ndim - x.ndim):
            shape[place] = max(shape[place], size)
    joined = []
    for x in arrays:
        target = list(shape)
        target[axis] = x.shape[axis]
        joined.append(x if tuple(x.shape) == tuple(target) else xp.broadcast_to(x, tuple(target)))
    return xp.concat(joined, axis=axis)


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
        r"""The key logits :math:`a_{ms}`, ``-inf`` for a dropped key. A key whose squared
        norm overflows gets ``-inf`` too (the limit of :math:`\omega_s \cdot \hat k_m -
        \lVert \hat k_m \rVert^2/2`), never ``inf - inf``: no logit is ever NaN or
        ``+inf`` (:math:`a_{ms} \le \lVert \omega_s \rVert^2/2`)."""
        xp = self.xp
        half_sq_norm = 0.5 * xp.sum(k_hat * k_hat, axis=-1, keepdims=True)
        # a_ms; an overflowing norm makes it finite - inf = -inf or inf - inf = NaN: -inf
        logits = nan_to_num(k_hat @ self.omega_t - half_sq_norm, nan=-math.inf,
                            posinf=math.inf, neginf=-math.inf)
        return (logits if valid is None else xp.where(valid[..., None], logits, -xp.inf),)

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
              state: State | None) -> tuple[Partial, State]:
        r"""One block: key ``i`` of the block is allowed for query ``j`` iff ``i <= j``.

        The chunkwise-parallel form (:mod:`xattn._estimators.chunks`): the B positions are J = B / b
        chunks of b = :attr:`multiple` positions carried as an axis. (1) Each chunk j
        gets its statistics :math:`K^j_s, A^j_s` from one product for all chunks. (2)
        The state before each chunk (the carried state and the chunks before it) and the
        state after the block come from :func:`~xattn._estimators.chunks.exclusive_prefix`, with
        the features in front so that each merge is one matrix product per feature. (3)
        Each query reads the state before its chunk and takes the exact pairs of its own
        chunk (:func:`~xattn._estimators.chunks.pair_kernel`), all with one shift, its largest term
        :math:`\max_s (p_{ns} + \max(P_{js}, \max_{m \le n} a_{ms}))`: over the keys
        it attends only.
        """
        xp = self.xp
        (logits,) = keys
        chunk = self.multiple
        length, num_samples, width = queries.shape[-2], queries.shape[-1], values.shape[-1]
        num_chunks = length // chunk
        p = xp.reshape(queries, (*queries.shape[:-2], num_chunks, chunk, num_samples))
        a = xp.reshape(logits, (*logits.shape[:-2], num_chunks, chunk, num_samples))
        values = xp.reshape(values, (*values.shape[:-2], num_chunks, chunk, width))
        # the stabilizers are constants (no gradient): from detached logits, so that
        # autograd records none of their operations
        fixed_a = stop_gradient(a)

        # (1) each chunk's statistics: K^j_s (..., J, S), A^j_s (..., J, S, E)
        chunk_max = xp.max(fixed_a, axis=-2)
        chunk_sums = (xp.matrix_transpose(xp.exp(a - finite_shift(xp, chunk_max)[..., None, :]))
                      @ values)

        # (2) the states before the chunks and after the block (features in front; the
        # carried state, when there is one, has the full batch shape)
        lead = state[0].shape[:-1] if state is not None else chunk_sums.shape[:-3]
        before_max, before_sums, new_state = exclusive_prefix(
            xp, state, _broadcast_lead(xp, xp.matrix_transpose(chunk_max), lead, 2),
            _broadcast_lead(xp, xp.moveaxis(chunk_sums, -2, -3), lead, 3))
        before_max = xp.matrix_transpose(before_max)[..., :, None, :]  # (..., J, 1, S)

        # (3) one shift per query: its largest term, over the state and the pairs m <= n
        bound = xp.maximum(before_max, cumulative_max(fixed_a, axis=-2))
        shift = xp.max(stop_gradient(p) + bound, axis=-1, keepdims=True)  # (..., J, b, 1)
        shifted = p - finite_shift(xp, shift)
        # the state before the chunk and the chunk's own pairs, read out by one product
        weights = _broadcast_concat(xp, [xp.exp(shifted + before_max), pair_kernel(xp, shifted, a)],
                               axis=-1)  # (..., J, b, S + b)
        sums = weights @ _broadcast_concat(xp, [xp.moveaxis(before_sums, -3, -2), values], axis=-2)
        sums = xp.reshape(sums, (*sums.shape[:-3], length, width))
        shift = _broadcast_lead(xp, xp.reshape(shift, (*shift.shape[:-3], length, 1)),
                                sums.shape[:-2], 2)  # the partial's parts shaped alike
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

    def __init__(self, xp: Any, omega: Array, pair_block: int = PAIR_BLOCK) -> None:
        self.xp = xp
        self.omega_t = xp.matrix_transpose(omega)
        self.num_samples = omega.shape[0]
        self.multiple = 1 << (pair_block.bit_length() - 1)  # a power of two, <= pair_block

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
              state: State | None) -> tuple[Partial, State]:
        r"""One block (key ``i`` allowed for query ``j`` iff ``i <= j``), in chunks of
        :attr:`multiple` positions carried as an axis, as :meth:`PositiveMap.block`: each
        chunk's sums :math:`\sum_m w_m \phi(\hat k_m) [v_m, 1]` and :math:`\sum_m w_m`
        shifted by its largest :math:`\log w_m`, the state before each chunk by
        :func:`~xattn._estimators.chunks.exclusive_prefix` (one shared maximum: a single feature
        whose sums are the flattened :math:`2S \times E` sums and the weight), and the
        pairs of each chunk exactly, shifted by each query's running maximum."""
        xp = self.xp
        features, half_sq_norm = keys
        chunk = self.multiple
        length, num_features, width = queries.shape[-2], queries.shape[-1], values.shape[-1]
        num_chunks, flat = length // chunk, num_features * width
        q_features = xp.reshape(queries, (*queries.shape[:-2], num_chunks, chunk, num_features))
        k_features = xp.reshape(features, (*features.shape[:-2], num_chunks, chunk,
                                           num_features))
        log_weights = xp.reshape(half_sq_norm, (*half_sq_norm.shape[:-2], num_chunks, chunk, 1))
        values = xp.reshape(values, (*values.shape[:-2], num_chunks, chunk, width))
        fixed_log_weights = stop_gradient(log_weights)

        # each chunk's statistics, flattened into one feature: (..., J) and (..., J, 2S E + 1)
        chunk_max = xp.max(fixed_log_weights, axis=-2)  # (..., J, 1)
        weights = xp.exp(log_weights - finite_shift(xp, chunk_max)[..., None, :])
        chunk_sums = xp.matrix_transpose(k_features) @ (weights * values)  # (..., J, 2S, E)
        chunk_sums = _broadcast_concat(xp, [xp.reshape(chunk_sums, (*chunk_sums.shape[:-2], flat)),
                                       xp.sum(weights, axis=-2)], axis=-1)
        carried = None
        lead = chunk_sums.shape[:-2]
        if state is not None:  # the carried state, with the full batch shape
            norm_max, state_sums, state_weight = state
            lead = norm_max.shape[:-2]
            carried = (xp.reshape(norm_max, (*lead, 1)),
                       xp.concat([xp.reshape(state_sums, (*lead, 1, flat)),
                                  xp.reshape(state_weight, (*lead, 1, 1))], axis=-1))
        before_max, before_sums, (after_max, after_sums) = exclusive_prefix(
            xp, carried, _broadcast_lead(xp, xp.matrix_transpose(chunk_max), lead, 2),
            _broadcast_lead(xp, chunk_sums[..., None, :, :], lead, 3))
        before_max = xp.reshape(before_max, (*lead, num_chunks, 1, 1))
        before_sums = xp.reshape(before_sums, (*lead, num_chunks, flat + 1))
        before_weight = before_sums[..., flat:][..., None]  # (..., J, 1, 1)
        before_sums = xp.reshape(before_sums[..., :flat], (*lead, num_chunks, num_features,
                                                           width))

        # each query: the state before its chunk and the keys m <= n of its chunk
        row_max = xp.maximum(before_max, cumulative_max(fixed_log_weights, axis=-2))
        row_shift = finite_shift(xp, row_max)  # (..., J, b, 1)
        state_factor = xp.exp(before_max - row_shift)  # 0 before the first key
        allowed = _lower_triangle(xp, chunk, array_api_compat.device(queries), strict=False)
        pair_weights = xp.exp(xp.where(allowed, xp.matrix_transpose(log_weights) - row_shift,
                                       -xp.inf))  # w_m for allowed keys, else 0; (..., J, b, b)
        kernel = (q_features @ xp.matrix_transpose(k_features)) * pair_weights
        sums = state_factor * (q_features @ before_sums) + kernel @ values
        weight = state_factor * before_weight + xp.sum(pair_weights, axis=-1, keepdims=True)
        new_state = (xp.reshape(after_max, (*lead, 1, 1)),
                     xp.reshape(after_sums[..., 0, :flat], (*lead, num_features, width)),
                     xp.reshape(after_sums[..., 0, flat:], (*lead, 1, 1)))
        sums = xp.reshape(sums, (*sums.shape[:-3], length, width))
        row_max, weight = (  # the partial's parts shaped alike
            _broadcast_lead(xp, xp.reshape(x, (*x.shape[:-3], length, 1)), sums.shape[:-2], 2)
            for x in (row_max, weight))
        return (row_max, sums, weight), new_state


def block_positions(*, length: int, batch_size: int, num_features: int, width: int,
                    itemsize: int, working_memory: int, band: int = 0) -> int:
    r"""Positions per block of :func:`scan_partials` under a working-memory budget.

    The intermediates of a block of B positions, per batch-head, are about
    :math:`(12 + 2 \cdot \text{DIRECT\_PAIRS}) F + 5 F E / b + 4 E + 2 b + 3 \cdot
    \text{band}` numbers per position, F features (2S for the trigonometric and hyperbolic
    maps), E = Dv + 1 value columns, b = :data:`PAIR_BLOCK`, ``band`` the exact keys per
    query of a window (the working set of :mod:`xattn._estimators.chunks`, measured on NumPy). The
    block is as long as ``working_memory`` bytes allow (a multiple of b, at least one
    chunk), whatever the length, so the working set does not depend on it. Below the
    budget the whole sequence is one block: a fixed number of array operations at any
    length.
    """
    per_position = ((12 + 2 * DIRECT_PAIRS) * num_features + 5 * num_features * width
                    // PAIR_BLOCK + 4 * width + 2 * PAIR_BLOCK + 3 * band)
    per_position *= max(batch_size, 1) * itemsize
    largest = max(PAIR_BLOCK, working_memory // per_position // PAIR_BLOCK * PAIR_BLOCK)
    return min(largest, -(-max(length, 1) // PAIR_BLOCK) * PAIR_BLOCK)


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
    what it needs of them, :func:`xattn._estimators.window.windowed_rfa`). ``initial``
    (forward only) is the state of keys before all of ``k``, every query's (a sequence continued,
    :mod:`xattn._estimators.decode`); the generator returns the state after the last block.

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
                yield mapping.readout(queries, carried())
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
        return carried()

    return run()
