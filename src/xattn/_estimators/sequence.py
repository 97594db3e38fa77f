r"""One causal sequence across devices: fixed-size states exchanged, never the tokens.

With ``sequence_parallel=`` (:func:`xattn.rfa`, :func:`xattn.lara`, causal) device
:math:`r` of :math:`P` holds the contiguous piece :math:`r` of the sequence, the
positions :math:`p_r \dots p_r + L_r - 1`. The chunkwise scan already links its chunks
by a fixed-size state only (:class:`~xattn._core.state.RFAState`: running maxima and
stabilized sums, :math:`S (D_v + 2)` numbers per head), so the pieces need to exchange
only such states (LASP: W. Sun et al., "Linear Attention Sequence Parallelism", 2024,
https://arxiv.org/abs/2404.02882). Each device

1. computes the state of its own piece's keys (:func:`piece_payload`): the random-feature
   sums of the keys that a later piece reads through the state (with ``window=w``, all
   but the piece's last :math:`w` keys, which it keeps as the *halo*; the first piece's
   ``sinks`` left out and kept as they are), with a NaN maximum when a key or value of
   the piece is not finite;
2. all-gathers these, packed in one array of fixed size (:math:`S (D_v + 2)` per head, plus
   :math:`w (D + D_v + 1)` for the halo and :math:`K (D + D_v + 1)` for the sinks),
   whatever the sequence length (:mod:`xattn._integrations.sequence_parallel`);
3. merges the states of the pieces before it, an exclusive prefix over the devices with
   the online-softmax (maximum, sums) merge of the chunks
   (:func:`~xattn._core.primitives.merge_maxima`): pieces :math:`j < r - 1` whole (their
   halo's keys have left the window by :math:`p_r`), piece :math:`r - 1` without its
   halo, which becomes the window buffer; the first piece's sink tokens; the position
   :math:`p_r`. Selections by masks on the device index, so one program serves every
   device (a traced index under ``jax.shard_map``);
4. continues that state over its own piece (:func:`~xattn._estimators.decode.continue_rfa`,
   what ``state=`` does on one device).

The state after the whole sequence is the same merge over all pieces, on every device.
Gradients flow back through the gathered states by the collective's own transpose (a
reduce-scatter under JAX, an all-reduce in torch), so outputs and gradients are those of
one device's call up to rounding, and a NaN reaches exactly the rows that attend it.
"""

from __future__ import annotations

import math
from typing import Any

from xattn._core.array import Array
from xattn._core.delegation import stop_gradient
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import finite_shift, quarantine
from xattn._core.state import RFAState
from xattn._estimators.decode import _new_tokens, continue_rfa
from xattn._estimators.rf_scan import FeatureMap, State, state_over_keys

__all__ = ["Layout", "check_parallel_call", "continue_sequence", "merged_state",
           "piece_payload", "unpack"]


def check_parallel_call(estimator: str, sequence_parallel: Any, *, causal: bool,
                        state: Any) -> bool:
    """Whether the call splits its sequence across devices; ``ValueError`` for
    ``sequence_parallel`` without ``causal=True`` or with ``state=``."""
    if sequence_parallel is None:
        return False
    if not causal:
        raise ValueError(
            f"{estimator}(sequence_parallel=...) splits a causal sequence across devices and "
            "needs causal=True; without causal, shard the sequence axis under jax.jit "
            "(GSPMD reduces the key statistics across devices by itself)")
    if state is not None:
        raise ValueError(f"{estimator}(sequence_parallel=...) starts a sequence: state= is not "
                         "supported with it (continue on one device with the returned state)")
    return True


def continue_sequence(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, state: RFAState,
                      sequence_parallel: Any, *, estimator: str, block_size: int,
                      chunk_size: int, guard: bool) -> tuple[Array, Array | None, RFAState]:
    """:func:`~xattn._estimators.decode.continue_rfa` of ``state`` over the inputs, or, with
    ``sequence_parallel`` (``state`` then empty), over this device's piece of a sequence
    split across devices (module docstring). Returns the output, the clamped rows and the
    state after the whole sequence."""
    if sequence_parallel is None:
        return continue_rfa(xp, inputs, mapping, state, block_size=block_size,
                            chunk_size=chunk_size, guard=guard)
    from xattn._integrations.sequence_parallel import resolve_group

    group = resolve_group(sequence_parallel, inputs.q, inputs.num_queries, estimator)
    window, sinks = state.window, state.sinks
    short = min(group.lengths)
    if window and short < window:
        raise ValueError(f"{estimator}(sequence_parallel=..., window={window}): every piece of "
                         f"the sequence must hold at least window positions, but the "
                         f"{group.described} holds pieces of lengths {list(group.lengths)}")
    if sinks and group.lengths[0] < sinks:
        raise ValueError(f"{estimator}(sequence_parallel=..., sinks={sinks}): the first piece "
                         f"must hold the sink tokens, but it has {group.lengths[0]} positions")
    device = inputs.device
    index = xp.arange(group.size, device=device)
    lengths = xp.asarray(group.lengths, dtype=state.position.dtype, device=device)

    def position(upto: Any) -> Array:  # the first position after the pieces before upto
        return xp.sum(xp.where(index < upto, lengths, xp.zeros_like(lengths)))

    payload, layout = piece_payload(xp, inputs, mapping, state, position(group.rank),
                                    chunk_size=chunk_size)
    gathered = unpack(xp, group.gather(payload), layout)
    halo_states = None
    if window:  # the halos' own states, for the pieces whose halo left the window
        halo_states = state_over_keys(
            xp, mapping, gathered["halo_keys"], gathered["halo_values"],
            root_scale=math.sqrt(inputs.scale), key_mask=gathered["halo_valid"] > 0.5,
            first_key=0, start=0, stop=window, chunk_size=window,
            batch_shape=(group.size, *layout.batch))

    def prefix(upto: Any) -> RFAState:
        return merged_state(xp, mapping, state, gathered, halo_states, index=index,
                            upto=upto, position=position(upto))

    out, invalid, _ = continue_rfa(xp, inputs, mapping, prefix(group.rank),
                                   block_size=block_size, chunk_size=chunk_size, guard=guard)
    return out, invalid, prefix(group.size)


class Layout:
    """The arrays packed into one payload: names, trailing shapes, the leading dims."""

    def __init__(self, batch: tuple[int, ...]) -> None:
        self.batch = batch
        self.entries: list[tuple[str, tuple[int, ...]]] = []


def piece_payload(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, empty: RFAState,
                  start: Array, *, chunk_size: int) -> tuple[Array, Layout]:
    """What this device's piece (positions ``start ..``) tells the others, packed into one
    array (*batch, T) of the compute dtype, T independent of the piece's length: the
    feature state of its keys (without the halo and the sinks), its maximum NaN if a key
    or value is not finite; the halo (last ``w`` keys, values, validity); the first ``K``
    tokens (the sinks, of the first piece)."""
    window, sinks = empty.window, empty.sinks
    batch = tuple(empty.sink_keys.shape[:-2])
    length = inputs.num_queries
    keys, values, valid = _new_tokens(xp, inputs, batch, finite=True)
    positions = start + xp.arange(length, device=inputs.device)
    summed = valid & (positions >= sinks)  # sink tokens never enter the sums
    features = state_over_keys(xp, mapping, keys, values, root_scale=math.sqrt(inputs.scale),
                               key_mask=summed, first_key=0, start=0,
                               stop=max(length - window, 0), chunk_size=chunk_size,
                               batch_shape=batch)
    _, bad_keys = quarantine(inputs, causal=True)
    bad = xp.any(bad_keys, axis=-1) if bad_keys.shape[-1] else xp.zeros(
        bad_keys.shape[:-1], dtype=xp.bool, device=inputs.device)
    bad = xp.broadcast_to(bad, batch)
    maximum = features[0]
    flag = xp.reshape(bad, (*batch, *(1,) * (maximum.ndim - len(batch))))
    items: list[tuple[str, Array]] = [("feature_max", xp.where(flag, xp.nan, maximum))]
    items += [(f"feature_{i}", x) for i, x in enumerate(features[1:], start=1)]
    if window:  # the last w positions (invalid slots first when the piece is shorter)
        items += [("halo_keys", xp.concat([empty.window_keys, keys], axis=-2)[..., -window:, :]),
                  ("halo_values",
                   xp.concat([empty.window_values, values], axis=-2)[..., -window:, :]),
                  ("halo_valid", xp.concat([empty.window_valid, summed], axis=-1)[..., -window:])]
    if sinks:
        items += [("head_keys", keys[..., :sinks, :]), ("head_values", values[..., :sinks, :]),
                  ("head_valid", valid[..., :sinks])]
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


def _where(xp: Any, keep: Array, state: State) -> State:
    """``state`` where ``keep`` (broadcast from the left), else the state of no keys."""
    return tuple(xp.where(xp.reshape(keep, (*keep.shape, *(1,) * (x.ndim - keep.ndim))), x,
                          -xp.inf if i == 0 else 0.0) for i, x in enumerate(state))


def _merge_stacked(xp: Any, stacked: State) -> State:
    r"""The state of the union of the key sets stacked along the first axis: one
    online-softmax merge of all of them, :math:`m = \max_j m_j`, :math:`S = \sum_j
    e^{m_j - m} S_j` (whatever the number of sets, a fixed number of operations)."""
    maxima = stacked[0]
    maximum = stop_gradient(xp.max(maxima, axis=0))  # the result does not depend on it
    factors = xp.exp(maxima - finite_shift(xp, maximum)[None, ...])  # 0 for empty sets
    merged = [maximum]
    for x in stacked[1:]:  # the factor of a maximum (..., F) scales the rows (..., F, E)
        factor = xp.reshape(factors, (*factors.shape, *(1,) * (x.ndim - factors.ndim)))
        merged.append(xp.sum(factor * x, axis=0))
    return tuple(merged)


def merged_state(xp: Any, mapping: FeatureMap, empty: RFAState, gathered: dict[str, Array],
                 halo_states: State | None, *, index: Array, upto: Any,
                 position: Array) -> RFAState:
    """The state after the pieces ``j < upto`` (an exclusive prefix over the devices for
    ``upto`` = this device's index; the whole sequence for ``upto`` = their number)."""
    before, full, previous = index < upto, index < upto - 1, index == upto - 1
    count = index.shape[0]
    batch = tuple(empty.sink_keys.shape[:-2])
    maxima = gathered["feature_max"]
    tainted = xp.isnan(maxima)  # a piece with a non-finite key: every later row is NaN
    pieces: State = (xp.where(tainted, -xp.inf, maxima),
                     *(gathered[name] for name in sorted(gathered)
                       if name.startswith("feature_") and name != "feature_max"))
    if halo_states is not None:  # the halo's keys have left the window of piece upto
        pieces = mapping.merge_states(pieces, _where(xp, full, halo_states))
    total = _merge_stacked(xp, _where(xp, before, pieces))
    seen = xp.any(xp.reshape(tainted, (count, *batch, -1)), axis=-1)  # (P, *batch)
    seen = xp.any(seen & xp.reshape(before, (count, *(1,) * len(batch))), axis=0)
    flag = xp.reshape(seen, (*batch, *(1,) * (total[0].ndim - len(batch))))
    window_buffers = [empty.window_keys, empty.window_values, empty.window_valid]
    if empty.window:  # the halo of piece upto - 1
        pick = xp.reshape(previous, (count, *(1,) * len(batch)))
        keys, values = gathered["halo_keys"], gathered["halo_values"]
        window_buffers = [
            xp.sum(xp.where(pick[..., None, None], keys, 0.0), axis=0),
            xp.sum(xp.where(pick[..., None, None], values, 0.0), axis=0),
            xp.any(pick[..., None] & (gathered["halo_valid"] > 0.5), axis=0)]
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
