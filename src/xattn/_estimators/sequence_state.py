r"""The fixed-size states that the devices of one causal sequence exchange.

:mod:`xattn._estimators.sequence` splits a causal sequence across devices; this module
packs what one piece tells the others into a single array (:func:`piece_payload`), unpacks
the gathered payloads (:func:`unpack`) and merges those of the pieces before a device into
the :class:`~xattn._core.state.RFAState` before its piece (:func:`merged_state`).
"""

from __future__ import annotations

import math
from typing import Any

from xattn._core.array import Array
from xattn._core.delegation import stop_gradient
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import common_shift, finite_entries, finite_shift, quarantine
from xattn._core.state import RFAState
from xattn._estimators.rf_scan import FeatureMap, State, state_over_keys

__all__ = ["Layout", "merged_state", "piece_payload", "unpack"]


class Layout:
    """The arrays packed into one payload: names, trailing shapes, the leading dims."""

    def __init__(self, batch: tuple[int, ...]) -> None:
        self.batch = batch
        self.entries: list[tuple[str, tuple[int, ...]]] = []


def _tokens(xp: Any, inputs: AttentionInputs, valid: Array, start: int,
            stop: int) -> tuple[Array, Array, Array]:
    """The keys and values of positions ``start .. stop - 1`` of the piece at the leading
    dims of ``valid`` (*batch, L), non-finite entries and masked tokens 0, and their
    validity: the few rows that a payload carries (a copy of these rows only)."""
    valid = valid[..., start:stop]
    batch, count = tuple(valid.shape[:-1]), stop - start
    keys, values = (xp.broadcast_to(finite_entries(xp, x[..., start:stop, :]),
                                    (*batch, count, x.shape[-1]))
                    for x in (inputs.k, inputs.v))
    return (xp.where(valid[..., None], keys, 0.0), xp.where(valid[..., None], values, 0.0),
            valid)


def piece_payload(xp: Any, inputs: AttentionInputs, features: State, empty: RFAState,
                  valid: Array, summed: Array) -> tuple[Array, Layout]:
    """What this device's piece tells the others, packed into one array (*batch, T) of
    the compute dtype, T independent of the piece's length: the feature state of its keys
    (``features``: without the halo and the sinks), its maximum NaN if a key or value is
    not finite; the halo (the last ``w`` keys, values, validity ``summed``: valid and not
    a sink); the first ``K`` tokens (the sinks, of the first piece; validity ``valid``)."""
    window, sinks = empty.window, empty.sinks
    batch = tuple(empty.sink_keys.shape[:-2])
    length = inputs.num_queries
    _, bad_keys = quarantine(inputs, causal=True)
    bad = xp.any(bad_keys, axis=-1) if bad_keys.shape[-1] else xp.zeros(
        bad_keys.shape[:-1], dtype=xp.bool, device=inputs.device)
    bad = xp.broadcast_to(bad, batch)
    maximum = features[0]
    flag = _expand(xp, bad, maximum.ndim)
    items: list[tuple[str, Array]] = [("feature_max", xp.where(flag, xp.nan, maximum))]
    # the sums carry the maximum's gradient (a factor e^{m - m} = 1 whose derivative is
    # theirs times dm): the merge takes the maxima without gradient (merged_state), and
    # its backward pass needs no stacked sums of the pieces
    shift = finite_shift(xp, maximum)
    carry = xp.exp(shift - stop_gradient(shift))
    items += [(f"feature_{i}", _expand(xp, carry, x.ndim) * x)
              for i, x in enumerate(features[1:], start=1)]
    if window:  # the last w positions (every piece holds at least w)
        halo = _tokens(xp, inputs, summed, length - window, length)
        items += [("halo_keys", halo[0]), ("halo_values", halo[1]), ("halo_valid", halo[2])]
    if sinks:
        head = _tokens(xp, inputs, valid, 0, min(sinks, length))
        items += [("head_keys", head[0]), ("head_values", head[1]), ("head_valid", head[2])]
    layout = Layout(batch)
    flat = []
    for name, x in items:
        layout.entries.append((name, tuple(x.shape[len(batch):])))
        x = xp.astype(x, inputs.compute_dtype) if x.dtype == xp.bool else x
        flat.append(xp.reshape(x, (*batch, -1)))
    return xp.concat(flat, axis=-1), layout


def unpack(xp: Any, gathered: Array, layout: Layout) -> dict[str, Array]:
    """The payloads of every device (size, *batch, T) as named arrays (size, *batch, ...)."""
    out, offset = {}, 0
    leading = tuple(gathered.shape[:-1])
    for name, shape in layout.entries:
        count = math.prod(shape)
        out[name] = xp.reshape(gathered[..., offset:offset + count], (*leading, *shape))
        offset += count
    return out


def _expand(xp: Any, x: Array, ndim: int) -> Array:
    """``x`` with trailing axes of length 1 up to ``ndim`` axes (broadcast from the left)."""
    return xp.reshape(x, (*x.shape, *(1,) * (ndim - x.ndim)))


def _merge_stacked(xp: Any, *stacks: State) -> State:
    r"""The state of the union of the key sets stacked along the first axis of each of
    ``stacks``: one online-softmax merge of all of them, :math:`m = \max_j m_j`, :math:`S
    = \sum_j e^{m_j - m} S_j` (a set left out has :math:`m_j = -\infty`: factor 0). The
    terms are added one set at a time, so that no stacked product of the factors and
    the sums is held (one term per device: a few hundred operations at most)."""
    maximum, shift = common_shift(xp, *(stop_gradient(xp.max(stack[0], axis=0))
                                        for stack in stacks))  # the result depends on neither
    shift = shift[None, ...]
    merged = [maximum]
    for i in range(1, len(stacks[0])):
        terms = []
        for stack in stacks:
            factors = xp.exp(stack[0] - shift)
            # the factor of a maximum (..., F) scales the rows (..., F, E)
            terms += [_expand(xp, factors[j], stack[i].ndim - 1) * stack[i][j]
                      for j in range(factors.shape[0])]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        merged.append(total)
    return tuple(merged)


def merged_state(xp: Any, mapping: FeatureMap, empty: RFAState, gathered: dict[str, Array],
                 *, index: Array, upto: Any, position: Array,
                 root_scale: float) -> RFAState:
    """The state after the pieces ``j < upto`` (an exclusive prefix over the devices for
    ``upto`` = this device's index; the whole sequence for ``upto`` = their number):
    the pieces ``j < upto`` without their halos, the halos of the pieces ``j < upto - 1``
    (their keys have left the window of piece ``upto``), the halo of piece ``upto - 1``
    as the window buffer, the first piece's sinks, the position."""
    before, previous = index < upto, index == upto - 1
    count = index.shape[0]
    batch = tuple(empty.sink_keys.shape[:-2])
    maxima = gathered["feature_max"]
    tainted = xp.isnan(maxima)  # a piece with a non-finite key: every later row is NaN
    # a piece left out gets the maximum -inf of no keys (its factor in the merge is 0);
    # the maxima without gradient: the sums carry it (piece_payload)
    left_out = tainted | ~_expand(xp, before, maxima.ndim)
    stacks: list[State] = [(stop_gradient(xp.where(left_out, -xp.inf, maxima)),
                            *(gathered[name] for name in sorted(gathered)
                              if name.startswith("feature_") and name != "feature_max"))]
    window_buffers = [empty.window_keys, empty.window_values, empty.window_valid]
    if empty.window:
        keys, values = gathered["halo_keys"], gathered["halo_values"]
        valid = gathered["halo_valid"] > 0.5
        # the halos whose keys left the window: their keys, masked, in one stacked state
        gone = valid & _expand(xp, index < upto - 1, valid.ndim)
        stacks.append(state_over_keys(
            xp, mapping, keys, values, root_scale=root_scale, key_mask=gone, first_key=0,
            start=0, stop=empty.window, chunk_size=empty.window,
            batch_shape=(count, *batch), finite=True))
        pick = _expand(xp, previous, keys.ndim)  # the halo of piece upto - 1
        window_buffers = [xp.sum(xp.where(pick, keys, 0.0), axis=0),
                          xp.sum(xp.where(pick, values, 0.0), axis=0),
                          xp.any(_expand(xp, previous, valid.ndim) & valid, axis=0)]
    total = _merge_stacked(xp, *stacks)
    seen = xp.any(xp.reshape(tainted, (count, *batch, -1)), axis=-1)  # (P, *batch)
    seen = xp.any(seen & _expand(xp, before, len(batch) + 1), axis=0)
    flag = _expand(xp, seen, total[0].ndim)
    sink_buffers = [empty.sink_keys, empty.sink_values, empty.sink_valid]
    if empty.sinks:  # the first piece's tokens, once it is before upto
        sink_buffers = [gathered["head_keys"][0], gathered["head_values"][0],
                        (gathered["head_valid"][0] > 0.5) & before[0]]
    return RFAState(empty.omega, xp.where(flag, xp.nan, total[0]), total[1],
                    total[2] if len(total) == 3 else None, position,
                    window_keys=window_buffers[0], window_values=window_buffers[1],
                    window_valid=window_buffers[2], sink_keys=sink_buffers[0],
                    sink_values=sink_buffers[1], sink_valid=sink_buffers[2],
                    feature_map=empty.feature_map, scale=empty.scale)
