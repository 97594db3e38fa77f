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

**One token** (:func:`xattn._estimators.step.step_rfa`, the decode step of generation):
the same state update written for :math:`L = 1` as a short, fixed sequence of array
operations, with no branch on array values and no pass over the window or the state
beyond its fixed size.

**Key-value caches** (:func:`extend_cache`): softmax attention and RA attend the cached
keys and the new ones, query :math:`P + j` the keys :math:`m \le P + j`; the estimators
run their own loops with that offset.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypeVar

from xattn._core.array import Array
from xattn._core.delegation import append_column, nonfinite_probe
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import (
    RowPieces,
    finite_entries,
    mark_tainted,
    quarantine,
)
from xattn._core.state import RFAState, _KeyValueCache, check_state_inputs, empty_cache
from xattn._estimators.rf_scan import (
    FeatureMap,
    State,
    combine_partials,
    finish_partial,
    returned_state,
    scan_partials,
    state_over_keys,
)
from xattn._estimators.step import step_rfa
from xattn._estimators.window import exact_partial

__all__ = ["append_token", "continue_rfa", "extend_cache"]

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


def continue_rfa(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, state: RFAState, *,
                 block_size: int, chunk_size: int,
                 guard: bool) -> tuple[Array, Array | None, RFAState]:
    """Causal RFA of ``L`` new tokens after the ``P`` of ``state`` (module docstring).

    Returns the output (..., L, Dv), the clamped rows (trigonometric ``guard``, else None)
    and the state after the new tokens.
    """
    if inputs.num_queries == 1:  # generation's decode step
        return step_rfa(xp, inputs, mapping, state, guard=guard)
    window, sinks = state.window, state.sinks
    batch = tuple(state.sink_keys.shape[:-2])
    # a non-finite key or value taints every later row: the state carries it as a NaN
    # maximum, and the sums are computed without it (xattn._core.primitives.quarantine)
    # (the decode step keeps a tainted key in the window or a sink slot, all NaN, until
    # it joins the sums: xattn._estimators.step)
    seen_before = xp.any(xp.isnan(xp.reshape(state.feature_max, (*batch, -1))), axis=-1)
    for buffer in (state.window_keys, state.sink_keys):
        if buffer.shape[-2]:
            seen_before = seen_before | xp.any(xp.isnan(buffer), axis=(-2, -1))
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
    returned: list[State] = []
    partials = scan_partials(xp, mapping, inputs.q, extended_keys, extended_values,
                             root_scale=root_scale, key_mask=extended_valid, first_key=0,
                             offset=offset, reverse=False, block_size=block_size,
                             chunk_size=chunk_size, batch_shape=batch,
                             initial=state.feature_state, returned=returned)
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
    features = returned_state(partials, returned)
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
    probe = nonfinite_probe(xp.concat([_to_batch(xp, x, tuple(inputs.batch_shape))
                                       for x in (k, v)], axis=-1))
    if inputs.key_mask is None:  # the validity grows by a True column (one operation)
        valid = append_column(cache.valid, True)
    else:
        mask = xp.broadcast_to(inputs.key_mask, (*batch, 1))
        valid = xp.concat([cache.valid, mask], axis=-1)
        probe = xp.where(mask[..., None], probe, 0.0)
        k, v = xp.where(mask[..., None], k, 0.0), xp.where(mask[..., None], v, 0.0)

    cache = type(cache)(xp.concat([cache.keys, _to_batch(xp, k + probe, batch)], axis=-2),
                        xp.concat([cache.values, _to_batch(xp, v, batch)], axis=-2), valid)
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
