r"""The feature maps of the causal scan: :class:`PositiveMap` (FAVOR+,
:math:`\exp(\omega^\top \hat x - \lVert \hat x\rVert^2/2)` with a running maximum that
keeps every exponent at most 0) and :class:`TrigonometricMap` (:math:`[\sin, \cos]` of
:math:`\omega^\top \hat x`, scaled by :math:`\exp(\lVert \hat x\rVert^2/2)` shifted by its
maximum). Each implements :class:`~xattn._estimators.rf_scan.FeatureMap`, what
:func:`~xattn._estimators.rf_scan.scan_partials` and :mod:`xattn._estimators.window` use."""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from xattn._core.array import Array
from xattn._core.delegation import (
    cumulative_max,
    ignore_invalid,
    squared_norms,
    stop_gradient,
)
from xattn._core.primitives import (
    common_shift,
    finite_shift,
    key_logits_in_range,
    merge_maxima,
)
from xattn._estimators.chunks import PAIR_BLOCK, exclusive_prefix
from xattn._estimators.rf_scan import Partial, State

__all__ = ["PositiveMap", "TrigonometricMap"]


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

def _as(xp: Any, x: Array, dtype: Any) -> Array:
    """``x`` in ``dtype`` (no operation when it has it)."""
    return x if x.dtype == dtype else xp.astype(x, dtype)

def _lower_triangle(xp: Any, size: int, device: Any, *, strict: bool) -> Array:
    """Boolean (size, size): True where column <= row (< row if ``strict``)."""
    rows = xp.arange(size, device=device)[:, None]
    columns = xp.arange(size, device=device)[None, :]
    return rows > columns if strict else rows >= columns

class PositiveMap:
    r"""Positive (and hyperbolic: samples :math:`\pm\omega`) features in the log domain.

    Queries are represented by :math:`p_{ns} = \omega_s \cdot \hat q_n`, keys by their
    projections centred on their own largest, :math:`a_{ms} - \beta_m` (at most 0), and
    :math:`\beta_m = \max_s a_{ms}` (``-inf`` for a dropped key), where :math:`a_{ms} =
    \omega_s \cdot \hat k_m - \lVert \hat k_m\rVert^2/2` is the key logit; the state
    is ``(K (..., S), A' (..., S, E))`` with a raw maximum per feature (``-inf`` while no
    key was seen).
    """

    key_fills: tuple[float, ...] = (0.0, -math.inf)

    def __init__(self, xp: Any, omega: Array, pair_block: int = PAIR_BLOCK) -> None:
        self.xp = xp
        self.omega = omega
        self.num_samples = omega.shape[-2]  # omega (S, D) or (..., S, D), per head
        self.pair_block = pair_block  # the longest chunk of :meth:`block`
        self.multiple = 1 << (pair_block.bit_length() - 1)  # a power of two, <= pair_block
        self._omega_t: Array | None = None
        self._omega_t_half: Array | None = None

    @property
    def omega_t(self) -> Array:
        """The samples transposed, (..., D, S): made when first used (a decode step
        does not). A plain attribute, not ``functools.cached_property``, whose lock on
        Python 3.11 ``torch.compile(fullgraph=True)`` cannot trace."""
        if self._omega_t is None:
            self._omega_t = self.xp.matrix_transpose(self.omega)
        return self._omega_t

    def samples_for(self, x: Array) -> Array:
        """:attr:`omega_t` in the dtype of ``x``: half-precision queries and keys are
        multiplied in their own dtype (the product accumulates in float32)."""
        if x.dtype == self.omega_t.dtype:
            return self.omega_t
        if self._omega_t_half is None or self._omega_t_half.dtype != x.dtype:
            self._omega_t_half = self.xp.astype(self.omega_t, x.dtype)
        return self._omega_t_half

    def queries(self, q_hat: Array) -> Array:
        return q_hat @ self.samples_for(q_hat)  # p_ns, (..., B, S)

    @property
    def log_mean(self) -> float:
        """-log S: the log of the 1/S mean over the features (in :meth:`query_constant`)."""
        return -math.log(self.num_samples)

    def step_offset(self, q: Array, root_scale: float) -> Array | None:
        r"""What the logits of one query ``q`` (..., 1, D) add to :math:`\omega_s \cdot
        \hat q` (``q_hat`` is ``root_scale * q``) besides :meth:`query_constant`, as a row
        (..., S): the decode step's form. None: nothing (RFA's own map)."""
        return None

    def query_constant(self, q_hat: Array) -> Array:
        """log of the factors left out of ``queries``: -|q_n|^2/2 - log S (the 1/S mean)."""
        xp = self.xp
        return -0.5 * xp.sum(q_hat * q_hat, axis=-1, keepdims=True) - math.log(self.num_samples)

    def keys(self, k_hat: Array, valid: Array | None) -> tuple[Array, ...]:
        r"""The keys as ``(centred, key_max)``: :math:`a_{ms} - \beta_m` (..., B, S), at
        most 0, and :math:`\beta_m = \max_s a_{ms}` (..., B, 1), ``-inf`` for a dropped
        key. A key whose squared norm overflows gets the dtype's floor as
        :math:`\beta_m` (:func:`~xattn._core.primitives.key_logits_in_range`), and a
        projection that overflows is centred to 0 at its largest: such a key is still
        attended, and nothing is ever NaN or ``+inf`` (:math:`a_{ms} \le \lVert \omega_s
        \rVert^2/2`)."""
        xp = self.xp
        # beta_m in the samples' dtype (float32 for half-precision keys: an exponent's
        # argument), the centred projections in the keys' own
        work = self.omega.dtype
        with ignore_invalid(xp):  # NumPy: an overflowing norm or projection, quietly
            projections = k_hat @ self.samples_for(k_hat)
            largest = stop_gradient(xp.max(projections, axis=-1, keepdims=True))
            half_sq_norm = squared_norms(k_hat, dtype=work, factor=0.5)
            key_max = key_logits_in_range(xp, _as(xp, largest, work) - half_sq_norm)
            # a key whose projections overflow (inf - inf): every feature alike, 0
            centred = xp.where(xp.isfinite(largest), projections - largest, 0.0)
        return centred, (key_max if valid is None else xp.where(valid[..., None], key_max,
                                                                  -xp.inf))

    def empty_state(self, batch_shape: tuple[int, ...], width: int, dtype: Any,
                    device: Any) -> State:
        xp = self.xp
        return (xp.full((*batch_shape, self.num_samples), -xp.inf, dtype=dtype, device=device),
                xp.zeros((*batch_shape, self.num_samples, width), dtype=dtype, device=device))

    def key_state(self, keys: tuple[Array, ...], values: Array) -> State:
        """The state of a set of keys: K_s and A'_s over all of them."""
        xp = self.xp
        centred, key_max = keys
        logits = centred + key_max  # a_ms, -inf for a dropped key
        feature_max = stop_gradient(xp.max(logits, axis=-2))  # raw: -inf without keys
        weights = xp.exp(logits - finite_shift(xp, feature_max)[..., None, :])
        if values.dtype != weights.dtype:  # half-precision values: the state in float32
            values = xp.astype(values, weights.dtype)
        return feature_max, xp.matrix_transpose(weights) @ values

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
              state: State | None, *, chunk: int,
              keep_state: bool = True) -> tuple[Partial, State | None]:
        r"""One block: key ``m`` of the block is allowed for query ``n`` iff ``m <= n``.

        The chunkwise-parallel form (:mod:`xattn._estimators.chunks`) with a rank-one
        stabilizer: the B positions are J = B / b chunks of b = ``chunk`` positions
        (:func:`~xattn._estimators.chunks.chunk_layout`) carried as an axis. With
        :math:`\alpha_n = \max_s p_{ns}`, :math:`\beta_m = \max_s a_{ms}` and
        :math:`\mu_n = \max_{m \le n} \beta_m` (the running maximum over every key the
        query attends), every term factors into three, each at most 1 and none from a key
        after :math:`n`:

        .. math::

            e^{p_{ns} + a_{ms} - \alpha_n - \mu_n} = \phi_{ns}\, \psi_{ms}\,
            e^{\beta_m - \mu_n}, \quad \phi_{ns} = e^{p_{ns} - \alpha_n}, \quad
            \psi_{ms} = e^{a_{ms} - \beta_m}.

        (1) Each chunk's sums :math:`H^j = \sum_{m \in j} e^{\beta_m - M^j} \psi_m^\top
        [v_m, 1]` (S, E) with its largest :math:`M^j = \max_{m \in j} \beta_m`: one
        product for all chunks. (2) The state before each chunk and after the block: one
        exclusive prefix over the chunks (:func:`~xattn._estimators.chunks.exclusive_prefix`)
        of these (maximum, S E sums) pairs. (3) Each query: :math:`\phi_n` times the sums
        before its chunk, and the pairs of its own chunk as one (b, S) (S, b) product
        times the (b, b) factor :math:`e^{\beta_m - \mu_n}` for :math:`m \le n`, 0
        above. The features :math:`\phi, \psi` are computed once, the backward pass
        reuses them, and no (B, S) array is made only to be reduced.
        """
        xp = self.xp
        centred, key_max = keys
        length, num_samples, width = queries.shape[-2], queries.shape[-1], values.shape[-1]
        num_chunks, flat = length // chunk, num_samples * width
        device = array_api_compat.device(queries)

        def chunked(x: Array) -> Array:  # (..., B, F) as (..., J, b, F)
            return xp.reshape(x, (*x.shape[:-2], num_chunks, chunk, x.shape[-1]))

        # the features, each entry in [0, 1]: phi (..., J, b, S), psi (..., J, b, S), in
        # the inputs' dtype (half precision too: the products accumulate in float32); the
        # maxima, exponents' arguments and states in the samples' (float32 for half)
        features, work = queries.dtype, key_max.dtype
        query_max = stop_gradient(xp.max(queries, axis=-1, keepdims=True))  # alpha_n
        q_features = chunked(xp.exp(queries - query_max))
        k_features = chunked(xp.exp(centred))
        key_max, values = chunked(key_max), chunked(values)  # beta_m (..., J, b, 1)
        # the stabilizers are constants (no gradient): from the detached beta_m
        fixed_key_max = stop_gradient(key_max)

        # (1) each chunk's largest beta_m and sums H^j (..., J, S, E)
        chunk_max = xp.max(fixed_key_max, axis=-2)  # (..., J, 1), -inf without keys
        key_weights = _as(xp, xp.exp(key_max - finite_shift(xp, chunk_max)[..., None, :]),
                          features)
        chunk_sums = _as(xp, xp.matrix_transpose(k_features) @ (key_weights * values), work)

        # (2) the states before the chunks and after the block, one maximum per state:
        # the carried state's sums are brought to their largest maximum first
        lead = state[0].shape[:-1] if state is not None else chunk_sums.shape[:-3]
        carried = None
        if state is not None:
            feature_max, feature_sums = state
            state_max = xp.max(feature_max, axis=-1, keepdims=True)  # (..., 1)
            factor = xp.exp(feature_max - finite_shift(xp, state_max))[..., None]
            carried = (state_max, xp.reshape(factor * feature_sums, (*lead, 1, flat)))
        before_max, before_sums, (after_max, after_sums) = exclusive_prefix(
            xp, carried, _broadcast_lead(xp, xp.matrix_transpose(chunk_max), lead, 2),
            _broadcast_lead(xp, xp.reshape(chunk_sums, (*chunk_sums.shape[:-3], 1, num_chunks,
                                                        flat)), lead, 3))
        before_max = xp.reshape(before_max, (*lead, num_chunks, 1, 1))
        before_sums = _as(xp, xp.reshape(before_sums, (*lead, num_chunks, num_samples, width)),
                          features)

        # (3) each query: mu_n over the state and the keys m <= n of its chunk
        running_max, row_shift = common_shift(  # (..., J, b, 1)
            xp, stop_gradient(before_max), cumulative_max(fixed_key_max, axis=-2))
        allowed = _lower_triangle(xp, chunk, device, strict=False)
        pair_factor = xp.exp(xp.where(allowed, xp.matrix_transpose(key_max) - row_shift,
                                      -xp.inf))  # e^{beta_m - mu_n} for m <= n, else 0
        pair_weights = (q_features @ xp.matrix_transpose(k_features)) * _as(xp, pair_factor,
                                                                            features)
        state_factor = _as(xp, xp.exp(before_max - row_shift), features)
        sums = state_factor * (q_features @ before_sums) + pair_weights @ values
        sums = xp.reshape(sums, (*sums.shape[:-3], length, width))
        # -inf for a query without keys: its partial adds nothing to another one's
        shift = (xp.reshape(running_max, (*running_max.shape[:-3], length, 1))
                 + _as(xp, query_max, work))
        shift = _broadcast_lead(xp, shift, sums.shape[:-2], 2)  # the partial's parts alike
        if not keep_state:
            return (shift, sums, sums[..., -1:]), None

        # the state after the block, one maximum per feature: K_s = max_m a_ms, the key
        # logits a_ms = (a_ms - beta_m) + beta_m from the keys as they came (not chunked)
        feature_max, feature_shift = common_shift(
            xp, xp.max(stop_gradient(centred + keys[1]), axis=-2),
            *(() if state is None else (state[0],)))
        # e^{M - K_s} >= 1; a feature whose sums underflowed in the shared frame keeps 0
        log_factor = xp.reshape(after_max, (*lead, 1)) - feature_shift
        largest = math.log(xp.finfo(log_factor.dtype).max) - 1.0
        factor = xp.exp(xp.clip(log_factor, max=largest))
        factor = xp.where(log_factor <= largest, factor, xp.zeros_like(factor))[..., None]
        feature_sums = factor * xp.reshape(after_sums, (*lead, num_samples, width))
        return (shift, sums, sums[..., -1:]), (feature_max, feature_sums)


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
        self.num_samples = omega.shape[-2]  # omega (S, D) or (..., S, D), per head
        self.pair_block = pair_block  # the longest chunk of :meth:`block`
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
              state: State | None, *, chunk: int,
              keep_state: bool = True) -> tuple[Partial, State]:
        r"""One block (key ``i`` allowed for query ``j`` iff ``i <= j``), in chunks of
        ``chunk`` positions carried as an axis, as
        :meth:`PositiveMap.block`: each chunk's sums :math:`\sum_m w_m \phi(\hat k_m)
        [v_m, 1]` and :math:`\sum_m w_m` shifted by its largest :math:`\log w_m`, the
        state before each chunk by :func:`~xattn._estimators.chunks.exclusive_prefix`
        (one shared maximum: a single feature
        whose sums are the flattened :math:`2S \times E` sums and the weight), and the
        pairs of each chunk exactly, shifted by each query's running maximum."""
        xp = self.xp
        features, half_sq_norm = keys
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
        row_max, row_shift = common_shift(  # (..., J, b, 1)
            xp, before_max, cumulative_max(fixed_log_weights, axis=-2))
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
