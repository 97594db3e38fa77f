r"""The decode step of causal RFA: one new token from a state, as a short, fixed sequence
of array operations (no branch on array values, no host synchronisation, the same
operations at every position).

After :math:`P` tokens the state (:class:`~xattn.RFAState`) holds the stabilized
random-feature sums of the keys :math:`K \le m \le P - 1 - w` (every key seen when
``window`` :math:`w` and ``sinks`` :math:`K` are 0), the last :math:`w` keys and the
:math:`K` sink keys. Query :math:`n = P` reads

* the sums: with :math:`w \ge 1` those of the state (keys :math:`\le n - w - 1`), after
  which the oldest key of the window joins them; with :math:`w = 0` those after the new
  key joined (keys :math:`\le n`);
* exactly, :math:`e^{s\, q_n \cdot k_m}` over the band [the window, the new key] and the
  sink slots (slot :math:`i` takes the token at position :math:`i`).

**The positive maps** (:func:`positive_step`; hyperbolic: the samples :math:`\pm\omega`;
causal LARA: with its importance weights in the query logits) are written as elementwise
products and sums over the samples, with :math:`\hat\omega = \sqrt{s}\,\omega`:

.. math::

    a_s(k) = k \cdot (\hat\omega_s - \tfrac{s}{2} k)
           = \omega_s \cdot \hat k - \lVert \hat k \rVert^2 / 2, \qquad
    p_s(q) = q \cdot \hat\omega_s,

and a key joins the sums :math:`(K_s, A'_s)` by the online-softmax merge
:math:`K'_s = \max(K_s, a_s)`, :math:`A''_s = e^{K_s - K'_s} A'_s + e^{a_s - K'_s}
[v, 1]` (Choromanski et al., 2021, "Rethinking Attention with Performers", FAVOR+; the
stabilizer as in Milakov and Gimelshein, 2018, "Online normalizer calculation for
softmax"). The row is :math:`\sum_s e^{c_s - c^*} A_s / \sum_s e^{c_s - c^*} b_s` over the
logits :math:`c` of the features (:math:`p_s + K_s`, with the query's own constant
:math:`-\lVert \hat q \rVert^2/2 - \log S` when exact terms join them) and of the exact
keys (:math:`s\, q \cdot k_m`), :math:`c^*` their maximum.

**Non-finite inputs** reach the rows as one causal call's do, without a branch: the
token's probe :math:`\sum (k, v) \cdot 0` (NaN when an entry of the key or the value is
not finite) is added to the key, which the row attends and the state keeps: in its sums
(their maximum is then NaN) or, with a window or in a sink slot, as a key of NaN that
every later row attends until it joins the sums (a longer piece,
:func:`~xattn._estimators.decode.continue_rfa`, reads the taint there too). So this row
and every later one are NaN. Without ``key_mask`` the row's stabilizer is its largest
logit as it is: a non-finite query makes every logit :math:`\pm\infty` or NaN and the
row NaN (the new key is always attended, so the largest logit of a finite query is
finite and the denominator at least 1). With ``key_mask`` (a row may have no key:
output 0) the query is probed too and the stabilizer and the denominator are guarded.
A masked token never enters the state.

**The trigonometric map** (:func:`general_step`) takes the same path through the feature
map's own methods, with the floor of its denominator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from xattn._core.array import Array
from xattn._core.delegation import (
    append_ones_column,
    ignore_invalid,
    nonfinite_probe,
    stop_gradient,
)
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import common_shift, finite_entries, finite_shift
from xattn._core.state import RFAState
from xattn._estimators.feature_maps import PositiveMap
from xattn._estimators.rf_scan import FeatureMap, combine_partials, finish_partial

__all__ = ["general_step", "positive_step", "step_rfa"]


def step_rfa(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, state: RFAState, *,
             guard: bool) -> tuple[Array, Array | None, RFAState]:
    """Causal RFA of one new token after the tokens of ``state``: the output (..., 1, Dv),
    the clamped rows (trigonometric map with ``guard``, else None) and the new state."""
    with ignore_invalid(xp):  # NumPy: a non-finite token's inf - inf is NaN, quietly
        if isinstance(mapping, PositiveMap):
            return positive_step(xp, inputs, mapping, state)
        return general_step(xp, inputs, mapping, state, guard=guard)


def _to_batch(xp: Any, x: Array, batch: tuple[int, ...]) -> Array:
    """``x`` (..., L, F) broadcast to the leading dims ``batch`` (no operation if it has them)."""
    return x if tuple(x.shape[:-2]) == batch else xp.broadcast_to(x, (*batch, *x.shape[-2:]))


def _token(xp: Any, inputs: AttentionInputs, batch: tuple[int, ...]
           ) -> tuple[Array, Array, Array, Array | None]:
    """The query, key and value (..., 1, ·) at the state's leading dims ``batch``, the key
    carrying the token's non-finite probe (all NaN when an entry of the key or the value
    is not finite), and the key's validity (..., 1) (None: no ``key_mask``). A masked
    token is zeros and never NaN; with ``key_mask`` a non-finite query has NaN entries."""
    q, k, v = (_to_batch(xp, x, batch) for x in (inputs.q, inputs.k, inputs.v))
    probe = nonfinite_probe(xp.concat([k, v], axis=-1))  # (..., 1, 1): 0 or NaN
    valid = None
    if inputs.key_mask is not None:
        valid = xp.broadcast_to(inputs.key_mask, (*batch, 1))
        probe = xp.where(valid[..., None], probe, 0.0)
        k, v = xp.where(valid[..., None], k, 0.0), xp.where(valid[..., None], v, 0.0)
        q = q + q * 0.0  # NaN entries where q is not finite: the guarded row is NaN then
    return q, k + probe, v, valid


def _joined(xp: Any, key_max: Array, sums: Array, logits: Array,
            value_column: Array) -> tuple[Array, Array]:
    """The sums (..., F), (..., F, E) after one key with logits ``logits`` (..., F) and
    value ``value_column`` [v, 1] (..., 1, E) joins them: the online-softmax merge."""
    new_max, shift = common_shift(xp, key_max, stop_gradient(logits))  # -inf: no key yet
    return new_max, (xp.exp(key_max - shift)[..., None] * sums
                     + xp.exp(logits - shift)[..., None] * value_column)


def _row(xp: Any, logits: Array, sums: Array, *, guarded: bool) -> Array:
    r"""One query's output (..., 1, Dv) from its logits (..., F) over the rows of ``sums``
    (..., F, Dv + 1), the last column the denominator: :math:`\sum_f e^{c_f - c^*} A_f /
    \sum_f e^{c_f - c^*} b_f`, as an elementwise product and a sum (one row: a matrix
    product would add the views of a batched product). ``guarded``: a row without keys
    (every logit ``-inf``) gets 0, otherwise its largest logit is finite."""
    shift = stop_gradient(xp.max(logits, axis=-1, keepdims=True))
    if guarded:
        shift = finite_shift(xp, shift)
    row = xp.sum(xp.exp(logits - shift)[..., None] * sums, axis=-2, keepdims=True)
    if guarded:
        return finish_partial(xp, (None, row, None), guard=False)[0]
    return row[..., :-1] / row[..., -1:]


def positive_step(xp: Any, inputs: AttentionInputs, mapping: PositiveMap,
                  state: RFAState) -> tuple[Array, None, RFAState]:
    """:func:`step_rfa` of the positive maps (module docstring): (out, None, new state)."""
    window, sinks, scale = state.window, state.sinks, inputs.scale
    batch = tuple(state.sink_keys.shape[:-2])
    q, k, v, valid = _token(xp, inputs, batch)
    omega = math.sqrt(scale) * mapping.omega  # omega-hat (..., S, D)

    floor = -xp.finfo(q.dtype).max / 4  # key_logits_in_range's, for a finite key

    def logits_of(x: Array, samples: Array = omega) -> Array:
        # x . (omega-hat_s - s x / 2), (..., S)
        return xp.sum(x * (samples - (0.5 * scale) * x), axis=-1)

    def in_range(key_logits: Array) -> Array:
        # each term k_i (omega_i - s k_i / 2) is finite or -inf for a finite key (never
        # inf - inf): an overflowing norm is -inf, taken up to the floor; NaN (a tainted
        # key's probe) stays NaN
        return xp.clip(key_logits, min=floor)

    position = state.position
    sink_keys, sink_values, sink_valid = state.sink_keys, state.sink_values, state.sink_valid
    if sinks:  # slot i takes the token at position i
        lands = (position == 0) if sinks == 1 else (
            xp.arange(sinks, dtype=position.dtype, device=inputs.device) == position)
        slots = lands if sinks == 1 else lands[:, None]
        sink_keys = xp.where(slots, k, sink_keys)
        sink_values = xp.where(slots, v, sink_values)
        sink_valid = (sink_valid | lands if valid is None
                      else xp.where(lands, valid, sink_valid))
    # the new key outside the sinks: positions >= K, not masked (None: always)
    outside = position >= sinks if sinks else None
    if valid is not None:
        outside = valid if outside is None else outside & valid
    guarded = valid is not None
    if window or outside is not None:  # -inf logits for keys left out, one 0-d array
        neg_inf = xp.full((), -math.inf, dtype=state.feature_max.dtype, device=inputs.device)

    if window:  # the exact band [window, new key] and the sinks; the oldest key joins
        new_valid = (xp.broadcast_to(outside, (*batch, 1)) if outside is not None
                     else xp.ones((*batch, 1), dtype=xp.bool, device=inputs.device))
        keys = xp.concat([state.window_keys, k, sink_keys], axis=-2)
        values = xp.concat([state.window_values, v, sink_values], axis=-2)
        allowed = xp.concat([state.window_valid, new_valid, sink_valid], axis=-1)
        columns = append_ones_column(values)  # [v, 1] of the exact keys
        # the oldest key joins the sums (a tainted new key taints them when it joins:
        # until then the rows attend it exactly); its logits a_s and the query's
        # q . (omega-hat_s - s q / 2) by one stacked product
        # (..., 2, S); the samples (..., 1, S, D) beside the stacked axis (per-head omega)
        both = logits_of(xp.stack([keys[..., :1, :], q], axis=-3),
                         omega if omega.ndim == 2 else xp.expand_dims(omega, axis=-3))
        oldest, query_logits = in_range(both[..., 0, :]), both[..., 1, :]
        joined = _joined(xp, state.feature_max, state.feature_sums,
                         xp.where(allowed[..., :1], oldest, neg_inf), columns[..., :1, :])
        read = (state.feature_max, state.feature_sums)  # keys <= n - w - 1
    else:  # the new key joins first (query n attends m <= n); the sinks are exact
        logits = in_range(logits_of(k))
        if outside is not None:
            logits = xp.where(outside, logits, neg_inf)
        joined = read = _joined(xp, state.feature_max, state.feature_sums, logits,
                                append_ones_column(v))
        if sinks:
            keys, columns, allowed = sink_keys, append_ones_column(sink_values), sink_valid
    offset = mapping.step_offset(q, math.sqrt(scale))  # LARA's log weights, else None
    if window or sinks:  # the features with the query's constant, then the exact keys
        features = ((query_logits if window else logits_of(q)) + read[0]
                    + mapping.log_mean)
        scores = xp.where(allowed, xp.sum((scale * q) * keys, axis=-1), neg_inf)
        out = _row(xp, xp.concat([features if offset is None else features + offset,
                                  scores], axis=-1),
                   xp.concat([read[1], columns], axis=-2), guarded=guarded)
    else:
        features = xp.sum(q * omega, axis=-1) + read[0]
        out = _row(xp, features if offset is None else features + offset, read[1],
                   guarded=guarded)
    new_state = dataclasses.replace(
        state, feature_max=joined[0], feature_sums=joined[1], position=position + 1,
        window_keys=keys[..., 1:window + 1, :] if window else state.window_keys,
        window_values=values[..., 1:window + 1, :] if window else state.window_values,
        window_valid=allowed[..., 1:window + 1] if window else state.window_valid,
        sink_keys=sink_keys, sink_values=sink_values, sink_valid=sink_valid)
    return out, None, new_state


def general_step(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, state: RFAState, *,
                 guard: bool) -> tuple[Array, Array | None, RFAState]:
    r""":func:`step_rfa` through the feature map's own methods (the trigonometric map):
    the same state update and readout as :func:`positive_step`, the row finished with
    the floor of the trigonometric denominator (``guard``)."""
    window, sinks = state.window, state.sinks
    root_scale = math.sqrt(inputs.scale)
    batch = tuple(state.sink_keys.shape[:-2])
    q, k, v = (_to_batch(xp, x, batch) for x in (inputs.q, inputs.k, inputs.v))
    key_probe = nonfinite_probe(xp.concat([k, v], axis=-1))  # (..., 1, 1): 0 or NaN
    valid = None
    if inputs.key_mask is not None:  # a masked token never enters the state
        valid = xp.broadcast_to(inputs.key_mask, (*batch, 1))
        key_probe = xp.where(valid[..., None], key_probe, 0.0)
        k, v = xp.where(valid[..., None], k, 0.0), xp.where(valid[..., None], v, 0.0)
    row_probe = key_probe + nonfinite_probe(q)
    # the state keeps finite entries (a non-finite token is in its maximum, as NaN); the
    # query is read as it is: a non-finite one makes only its own row NaN, as its probe
    k, v = finite_entries(xp, k), finite_entries(xp, v)
    position = state.position
    features = state.feature_state

    def joined(key: Array, value: Array, key_valid: Array | None) -> tuple[Array, ...]:
        """The sums after one key (..., 1, ·) joins them (``key_valid`` False: it does not)."""
        logits = mapping.keys(root_scale * key, key_valid)
        return mapping.merge_states(features, mapping.key_state(logits,
                                                                append_ones_column(value)))

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
        band_keys = xp.concat([state.window_keys, k], axis=-2)
        band_values = xp.concat([state.window_values, v], axis=-2)
        band_valid = xp.concat([state.window_valid, xp.broadcast_to(
            xp.asarray(True, device=inputs.device) if new_valid is None else new_valid,
            (*batch, 1))], axis=-1)
        read = features  # keys <= n - w - 1
        features = joined(band_keys[..., :1, :], band_values[..., :1, :], band_valid[..., :1])
    else:
        features = joined(k, v, None if new_valid is None else
                          xp.broadcast_to(new_valid, (*batch, 1)))
        read = features  # keys <= n
    random_part = mapping.readout(queries, read)
    if window or sinks:  # exact terms e^{q.k} over the band and the sinks
        keys = xp.concat([band_keys, sink_keys], axis=-2) if window and sinks else (
            band_keys if window else sink_keys)
        values = xp.concat([band_values, sink_values], axis=-2) if window and sinks else (
            band_values if window else sink_values)
        allowed = xp.concat([band_valid, sink_valid], axis=-1) if window and sinks else (
            band_valid if window else sink_valid)
        # one query: its scores as an elementwise product and a sum (no batched product)
        scores = xp.where(allowed, xp.sum((inputs.scale * q) * keys, axis=-1),
                          -xp.inf)[..., None, :]  # (..., 1, w + 1 + K)
        shift = stop_gradient(xp.max(scores, axis=-1, keepdims=True))
        exact_sums = xp.exp(scores - finite_shift(xp, shift)) @ append_ones_column(values)
        random_part = combine_partials(xp, [
            (random_part[0] + mapping.query_constant(root_scale * q), *random_part[1:]),
            (shift, exact_sums, exact_sums[..., -1:])])
    out, invalid = finish_partial(xp, random_part, guard=guard)
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
