r"""Continuing a causal sequence from a state: RFA's fixed-size step, the key-value caches.

**RFA** (:func:`continue_rfa`). After :math:`P` tokens the state (:class:`~xattn._core.state.
RFAState`) holds the random-feature sums of the keys :math:`R_P = \{K \le m \le P - 1 -
w\}` (every key seen when ``window`` and ``sinks`` are 0), the last :math:`w` keys and
the :math:`K` sink keys. The :math:`L` new tokens :math:`P + j` need, for query
:math:`n = P + j` (the exact set and the rest of :mod:`xattn._estimators.window`, causal):

* **random features** over :math:`K \le m \le n - w - 1`: the state's sums, then the keys
  of the *extended* sequence ``E`` = [the window buffer, the new keys] (positions
  :math:`P - w + e`) with :math:`e \le j - 1` (:math:`e \le j` when :math:`w = 0`). That
  is the blockwise prefix scan of :func:`xattn._estimators.rf_scan.scan_partials` over ``E`` with
  offset 1 (0), started from the state's sums (``initial``) and returning the new sums:
  a chunked prefill costs what one causal call costs, a single token
  :math:`O(S D_v)` besides its band, never a pass over the past;
* **exact** terms :math:`e^{\hat q_n \cdot \hat k_m}` over the band :math:`e \in [j, j +
  w]` of ``E`` and the sink slots :math:`s \le n`, by the code that computes a whole
  sequence's (:func:`xattn._estimators.window.exact_partial`: query :math:`j` at position :math:`j
  + w` of ``E``, causal, in chunks of queries): memory :math:`O(B (C + w + K))` for a
  block of :math:`B` queries and a number of operations that does not depend on
  :math:`B`.

Positions enter only as arrays (the state's ``position`` plus ``arange``): the window and
sink buffers keep their shapes and validity flags say which entries hold a key, so a step
traces once under :func:`jax.jit` and runs inside :func:`jax.lax.scan`. The keys that
leave the window (those of ``E`` before the last :math:`w`) join the sums; the sink
slots take the new tokens at positions :math:`< K`; masked keys never enter the state.

**One token** (:func:`step_rfa`, the decode step of generation): the same state update
written for :math:`L = 1` as a short, fixed sequence of array operations, with no branch
on array values and no pass over the window or the state beyond its fixed size.

**Key-value caches** (:func:`extend_cache`): softmax attention and RA attend the cached
keys and the new ones, query :math:`P + j` the keys :math:`m \le P + j`; the estimators
run their own loops with that offset.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from typing import Any, TypeVar

from xattn._core.array import Array
from xattn._core.delegation import append_ones_column, nonfinite_probe, stop_gradient
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import (
    RowPieces,
    finite_entries,
    finite_shift,
    mark_tainted,
    quarantine,
)
from xattn._core.state import RFAState, _KeyValueCache, check_state_inputs, empty_cache
from xattn._estimators.feature_maps import PositiveMap
from xattn._estimators.rf_scan import (
    FeatureMap,
    Partial,
    State,
    combine_partials,
    finish_partial,
    scan_partials,
    state_over_keys,
)
from xattn._estimators.window import exact_partial

__all__ = ["append_token", "continue_rfa", "extend_cache", "step_rfa"]

Cache = TypeVar("Cache", bound=_KeyValueCache)


def _new_tokens(xp: Any, inputs: AttentionInputs, batch: tuple[int, ...],
                finite: bool = False) -> tuple[Array, Array, Array]:
    """The new keys and values at the state's leading dims, zeroed where masked (a masked
    key never enters a state), and their validity (..., L)."""
    length = inputs.num_keys
    k = xp.broadcast_to(inputs.k, (*batch, length, inputs.k.shape[-1]))
    v = xp.broadcast_to(inputs.v, (*batch, length, inputs.v.shape[-1]))
    if finite:  # RFA's buffers: the non-finite tokens are marked in the state instead
        k, v = finite_entries(xp, k), finite_entries(xp, v)
    if inputs.key_mask is None:
        return k, v, xp.ones((*batch, length), dtype=xp.bool, device=inputs.device)
    valid = xp.broadcast_to(inputs.key_mask, (*batch, length))
    return (xp.where(valid[..., None], k, 0.0), xp.where(valid[..., None], v, 0.0), valid)


def _updated_sinks(xp: Any, state: RFAState, keys: Array, values: Array, valid: Array,
                   positions: Array, device: Any) -> tuple[Array, Array, Array]:
    """The sink slots after the new tokens: slot ``s`` takes the token at position ``s``
    if it is among them (only the first ``K`` new tokens can be)."""
    sinks, count = state.sinks, min(state.sinks, keys.shape[-2])
    if count == 0:
        return state.sink_keys, state.sink_values, state.sink_valid
    slots = xp.arange(sinks, device=device)
    lands = xp.astype(slots, positions.dtype)[:, None] == positions[None, :count]  # (K, c)
    taken = xp.any(lands, axis=-1)  # (K,)

    def gather(x: Array) -> Array:  # (K, c) @ (..., c, F): x is finite (finite_entries),
        # so the one-hot product picks each token exactly, without a (K, c, F) array
        return xp.astype(lands, x.dtype) @ x[..., :count, :]

    return (xp.where(taken[:, None], gather(keys), state.sink_keys),
            xp.where(taken[:, None], gather(values), state.sink_values),
            xp.where(taken, xp.any(lands & valid[..., None, :count], axis=-1), state.sink_valid))


def _returned(partials: Generator[Partial, None, State]) -> State:
    """The state that a finished :func:`~xattn._estimators.rf_scan.scan_partials` returns."""
    try:
        next(partials)
    except StopIteration as finished:
        return finished.value
    raise AssertionError("scan_partials yielded more blocks than asked for")


def continue_rfa(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, state: RFAState, *,
                 block_size: int, chunk_size: int,
                 guard: bool) -> tuple[Array, Array | None, RFAState]:
    """Causal RFA of ``L`` new tokens after the ``P`` of ``state`` (module docstring).

    Returns the output (..., L, Dv), the clamped rows (trigonometric ``guard``, else None)
    and the state after the new tokens.
    """
    check_state_inputs(state, inputs)
    if inputs.num_queries == 1:  # generation's decode step
        return step_rfa(xp, inputs, mapping, state, guard=guard)
    window, sinks = state.window, state.sinks
    batch = tuple(state.sink_keys.shape[:-2])
    # a non-finite key or value taints every later row: the state carries it as a NaN
    # maximum, and the sums are computed without it (xattn._core.primitives.quarantine)
    seen_before = xp.any(xp.isnan(xp.reshape(state.feature_max, (*batch, -1))), axis=-1)
    state = dataclasses.replace(state, feature_max=xp.where(
        xp.isnan(state.feature_max), -xp.inf, state.feature_max))
    tainted, bad_keys = quarantine(inputs, causal=True)
    tainted = tainted | seen_before[..., None, None]
    seen = seen_before | xp.any(bad_keys, axis=-1) if bad_keys.shape[-1] else seen_before
    length = inputs.num_queries
    root_scale = math.sqrt(inputs.scale)
    keys, values, valid = _new_tokens(xp, inputs, batch, finite=True)
    positions = state.position + xp.arange(length, device=inputs.device)  # P + j
    sink_keys, sink_values, sink_valid = _updated_sinks(xp, state, keys, values, valid,
                                                        positions, inputs.device)
    # the extended sequence E: the window buffer, then the new keys (sinks left out)
    extended_keys = xp.concat([state.window_keys, keys], axis=-2)
    extended_values = xp.concat([state.window_values, values], axis=-2)
    extended_valid = xp.concat([state.window_valid, valid & (positions >= sinks)], axis=-1)
    offset = 1 if window else 0  # query j's random keys: e <= j - 1 (w >= 1), e <= j (w = 0)
    partials = scan_partials(xp, mapping, inputs.q, extended_keys, extended_values,
                             root_scale=root_scale, key_mask=extended_valid, first_key=0,
                             offset=offset, reverse=False, block_size=block_size,
                             chunk_size=chunk_size, batch_shape=batch,
                             initial=state.feature_state)
    out = RowPieces(length)
    clamped = RowPieces(length) if guard else None
    for start in range(0, length, block_size):
        stop = min(start + block_size, length)
        partial = next(partials)
        if window or sinks:  # with exact terms: the random part must estimate e^{q.k} itself
            shift, sums, weight = partial
            queries = finite_entries(xp, inputs.q[..., start:stop, :])
            constant = mapping.query_constant(root_scale * queries)
            # query j sits at e = j + w of E: its band e - w .. e, chunked (as in window);
            # the sinks only in their slots (E's validity leaves positions < K out)
            exact = exact_partial(
                xp, inputs.scale * queries, start + window, window=window, causal=True,
                band=(extended_keys, extended_values, extended_valid) if window else None,
                sinks=(sink_keys, sink_values, sink_valid) if sinks else None,
                sink_position=state.position + start)
            random_part = (shift + constant, sums, weight)
            partial = (random_part if exact is None
                       else combine_partials(xp, [random_part, exact]))
        rows, invalid = finish_partial(xp, partial, guard=guard)
        out.put(start, rows)
        if clamped is not None:
            clamped.put(start, invalid)
    features = _returned(partials)
    if window and length:  # the last key to leave the window (the scan stops before it)
        features = mapping.merge_states(features, state_over_keys(
            xp, mapping, extended_keys, extended_values, root_scale=root_scale,
            key_mask=extended_valid, first_key=0, start=length - 1, stop=length,
            chunk_size=chunk_size, batch_shape=batch))
    flag = xp.reshape(seen, (*seen.shape, *(1,) * (features[0].ndim - seen.ndim)))
    new_state = dataclasses.replace(
        state, feature_max=xp.where(flag, xp.nan, features[0]), feature_sums=features[1],
        feature_weight=features[2] if len(features) == 3 else None,
        position=state.position + length,
        window_keys=extended_keys[..., length:, :], window_values=extended_values[..., length:, :],
        window_valid=extended_valid[..., length:], sink_keys=sink_keys, sink_values=sink_values,
        sink_valid=sink_valid)
    if length == 0:
        return dataclasses.replace(inputs, batch_shape=batch).empty_result(), None, new_state
    return (mark_tainted(xp, out.result(), tainted),
            None if clamped is None else clamped.result() & ~tainted, new_state)


def _to_batch(xp: Any, x: Array, batch: tuple[int, ...]) -> Array:
    """``x`` (..., L, F) broadcast to the leading dims ``batch`` (no operation if it has them)."""
    return x if tuple(x.shape[:-2]) == batch else xp.broadcast_to(x, (*batch, *x.shape[-2:]))


def _nonfinite_probe(xp: Any, *rows: Array) -> Array:
    """(..., 1, 1): 0 where every entry of the rows (..., 1, ·) is finite, NaN where one is
    not (:func:`~xattn._core.delegation.nonfinite_probe` of the rows side by side)."""
    return nonfinite_probe(xp.concat(rows, axis=-1) if len(rows) > 1 else rows[0])


def step_rfa(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, state: RFAState, *,
             guard: bool) -> tuple[Array, Array | None, RFAState]:
    r"""Causal RFA of one new token :math:`n = P` after the :math:`P` of ``state``: what
    :func:`continue_rfa` computes, as a fixed sequence of array operations.

    With ``window`` :math:`w \ge 1`, query :math:`n` reads the state's sums (keys
    :math:`K \le m \le n - w - 1`) and, exactly, the band ``E`` = [the window buffer,
    the new key] (positions :math:`n - w, \dots, n`) and the sink slots; then the oldest
    key of ``E`` joins the sums and ``E`` without it is the new buffer. With :math:`w =
    0` the new key joins the sums first (query :math:`n` attends :math:`m \le n`). A
    non-finite key or value taints this row and the state (its maximum becomes NaN, so
    every later row is NaN); a non-finite query taints its own row.
    """
    window, sinks = state.window, state.sinks
    root_scale = math.sqrt(inputs.scale)
    q, k, v = inputs.q, inputs.k, inputs.v  # (..., 1, D), (..., 1, D), (..., 1, Dv)
    # (..., 1, 1): NaN when the new token is not finite
    key_probe = _nonfinite_probe(xp, *(_to_batch(xp, x, tuple(inputs.batch_shape)) for x in (k, v)))
    valid = None
    if inputs.key_mask is not None:  # a masked token never enters the state
        valid = inputs.key_mask  # (..., 1)
        key_probe = xp.where(valid[..., None], key_probe, 0.0)
        k, v = xp.where(valid[..., None], k, 0.0), xp.where(valid[..., None], v, 0.0)
    row_probe = key_probe + _nonfinite_probe(xp, q)
    # the state keeps finite entries (a non-finite token is in its maximum, as NaN); the
    # query is read as it is: a non-finite one makes only its own row NaN, as its probe
    k, v = finite_entries(xp, k), finite_entries(xp, v)
    position = state.position
    features = state.feature_state

    def joined(key: Array, value: Array, key_valid: Array | None) -> tuple[Array, ...]:
        """The sums after one key (..., 1, ·) joins them (``key_valid`` False: it does not);
        for the positive maps the online-softmax merge of one logit per feature."""
        logits = mapping.keys(root_scale * key, key_valid)
        value = append_ones_column(value)  # [v, 1] (v is finite here)
        if not isinstance(mapping, PositiveMap):
            return mapping.merge_states(features, mapping.key_state(logits, value))
        key_max, sums = features
        logits = logits[0][..., 0, :]  # a_s of the key, (..., F)
        new_max = xp.maximum(key_max, stop_gradient(logits))
        shift = finite_shift(xp, new_max)
        return new_max, (xp.exp(key_max - shift)[..., None] * sums
                         + xp.exp(logits - shift)[..., None] * value)

    sink_keys, sink_values, sink_valid = state.sink_keys, state.sink_values, state.sink_valid
    if sinks:  # slot s takes the token at position s
        lands = xp.arange(sinks, dtype=position.dtype, device=inputs.device) == position
        sink_keys = xp.where(lands[:, None], k, sink_keys)
        sink_values = xp.where(lands[:, None], v, sink_values)
        sink_valid = xp.where(lands, True if valid is None else valid, sink_valid)
    # the new key's place outside the sinks: positions >= K (and not masked)
    new_valid = position >= sinks if sinks else valid
    if sinks and valid is not None:
        new_valid = new_valid & valid
    queries = mapping.queries(root_scale * q)
    if window:
        batch = tuple(state.window_keys.shape[:-2])
        band_keys = xp.concat([state.window_keys, _to_batch(xp, k, batch)], axis=-2)
        band_values = xp.concat([state.window_values, _to_batch(xp, v, batch)], axis=-2)
        band_valid = xp.concat([state.window_valid, xp.broadcast_to(
            xp.asarray(True, device=inputs.device) if new_valid is None else new_valid,
            (*batch, 1))], axis=-1)
        read = features  # keys <= n - w - 1
        features = joined(band_keys[..., :1, :], band_values[..., :1, :], band_valid[..., :1])
    else:
        features = joined(k, v, None if new_valid is None else
                          xp.broadcast_to(new_valid, (*k.shape[:-2], 1)))
        read = features  # keys <= n
    invalid = None  # the clamped rows (trigonometric map)
    if not (window or sinks):
        if isinstance(mapping, PositiveMap):
            out = _positive_row(xp, queries + read[0][..., None, :], read[1])
        else:
            out, invalid = finish_partial(xp, mapping.readout(queries, read), guard=guard)
    else:  # exact terms e^{q.k} over the band and the sinks
        keys = xp.concat([band_keys, sink_keys], axis=-2) if window and sinks else (
            band_keys if window else sink_keys)
        values = xp.concat([band_values, sink_values], axis=-2) if window and sinks else (
            band_values if window else sink_values)
        allowed = xp.concat([band_valid, sink_valid], axis=-1) if window and sinks else (
            band_valid if window else sink_valid)
        # one query: its scores as an elementwise product and a sum (no batched product)
        scores = xp.where(allowed, xp.sum((inputs.scale * q) * keys, axis=-1),
                          -xp.inf)[..., None, :]  # (..., 1, w + 1 + K)
        constant = mapping.query_constant(root_scale * q)
        if isinstance(mapping, PositiveMap):  # features and exact keys in one readout
            logits = xp.concat([queries + read[0][..., None, :] + constant, scores], axis=-1)
            out = _positive_row(xp, logits, xp.concat([read[1], append_ones_column(values)],
                                                      axis=-2))
        else:
            random_part = mapping.readout(queries, read)
            shift = stop_gradient(xp.max(scores, axis=-1, keepdims=True))
            exact_sums = xp.exp(scores - finite_shift(xp, shift)) @ append_ones_column(values)
            out, invalid = finish_partial(xp, combine_partials(
                xp, [(random_part[0] + constant, *random_part[1:]),
                     (shift, exact_sums, exact_sums[..., -1:])]), guard=guard)
    # the state's maximum (..., F) or (..., 1, 1) carries the taint
    tainted_max = features[0] + (key_probe if features[0].ndim == key_probe.ndim
                                 else key_probe[..., 0])
    new_state = dataclasses.replace(
        state, feature_max=tainted_max, feature_sums=features[1],
        feature_weight=features[2] if len(features) == 3 else None, position=position + 1,
        window_keys=band_keys[..., 1:, :] if window else state.window_keys,
        window_values=band_values[..., 1:, :] if window else state.window_values,
        window_valid=band_valid[..., 1:] if window else state.window_valid,
        sink_keys=sink_keys, sink_values=sink_values, sink_valid=sink_valid)
    return out + row_probe, invalid, new_state


def _positive_row(xp: Any, logits: Array, sums: Array) -> Array:
    r"""One query's row from its logits (..., 1, F) over the columns of ``sums`` (..., F,
    Dv + 1), the last one the denominator: :math:`\sum_f e^{c_f - c^*} A_f / \sum_f
    e^{c_f - c^*} b_f` with :math:`c^* = \max_f c_f`, the products as one elementwise
    product and one sum (a single row: a matrix product would add the views of a batched
    product); 0 for a row without keys."""
    shift = stop_gradient(xp.max(logits, axis=-1, keepdims=True))
    weights = xp.exp(logits - finite_shift(xp, shift))
    row = xp.sum(xp.matrix_transpose(weights) * sums, axis=-2, keepdims=True)
    return finish_partial(xp, (None, row, None), guard=False)[0]


def append_token(inputs: AttentionInputs, cache: Cache) -> tuple[AttentionInputs, Cache]:
    """The decoding step of a key-value cache (one new token): the inputs of the query
    against the cached keys and the new one, and the cache with the token appended, in a
    few operations. A non-finite new key or value is stored as a key row of NaN, so that
    this query and every later one that attends it is NaN by the kernel itself (a
    non-finite query makes its own row NaN there too); a masked token is stored as zeros.
    """
    check_state_inputs(cache, inputs)
    xp = inputs.xp
    batch = tuple(cache.keys.shape[:-2])
    k, v = inputs.k, inputs.v
    # (..., 1, 1): NaN for a non-finite token
    probe = _nonfinite_probe(xp, *(_to_batch(xp, x, tuple(inputs.batch_shape)) for x in (k, v)))
    if inputs.key_mask is None:
        valid = xp.ones((*batch, 1), dtype=xp.bool, device=inputs.device)
    else:
        valid = xp.broadcast_to(inputs.key_mask, (*batch, 1))
        probe = xp.where(valid[..., None], probe, 0.0)
        k, v = xp.where(valid[..., None], k, 0.0), xp.where(valid[..., None], v, 0.0)

    cache = type(cache)(xp.concat([cache.keys, _to_batch(xp, k + probe, batch)], axis=-2),
                        xp.concat([cache.values, _to_batch(xp, v, batch)], axis=-2),
                        xp.concat([cache.valid, valid], axis=-1))
    return dataclasses.replace(inputs, k=cache.keys, v=cache.values, key_mask=cache.valid,
                               batch_shape=batch), cache


def extend_cache(inputs: AttentionInputs, cache: Cache | None,
                 cache_type: type) -> tuple[AttentionInputs, Cache, Any]:
    """The inputs of a call that continues ``cache`` (None: an empty ``cache_type``, the
    first call), checked against them: the queries are the new ones, the keys and values
    the cached and the new ones (``key_mask`` their validity); the cache after the new
    tokens; and the position of the first new query (``cache.position`` before them), by
    which the caller offsets its causal mask."""
    cache = empty_cache(cache_type, inputs) if cache is None else cache
    check_state_inputs(cache, inputs)
    offset = cache.position
    xp = inputs.xp
    batch = tuple(cache.keys.shape[:-2])
    keys, values, valid = _new_tokens(xp, inputs, batch)
    cache = type(cache)(xp.concat([cache.keys, keys], axis=-2),
                        xp.concat([cache.values, values], axis=-2),
                        xp.concat([cache.valid, valid], axis=-1))
    # a prefill keeps the call's own mask (None: the kernels' causal path, no (N, M) mask)
    extended = dataclasses.replace(inputs, k=cache.keys, v=cache.values,
                                   key_mask=inputs.key_mask if offset == 0 else cache.valid,
                                   batch_shape=batch)
    return extended, cache, offset
