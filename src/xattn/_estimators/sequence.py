r"""One causal sequence across devices: fixed-size states exchanged, never the tokens.

With ``sequence_parallel=`` (:func:`xattn.rfa`, :func:`xattn.lara`, causal) device
:math:`r` of :math:`P` holds the contiguous piece :math:`r` of the sequence, the
positions :math:`p_r \dots p_r + L_r - 1`. The chunkwise scan already links its chunks
by a fixed-size state only (:class:`~xattn._core.state.RFAState`: running maxima and
stabilized sums, :math:`S (D_v + 2)` numbers per head), so the pieces need to exchange
only such states (LASP: W. Sun et al., "Linear Attention Sequence Parallelism", 2024,
https://arxiv.org/abs/2404.02882). Each device

1. scans its own piece once, from no state (:func:`piece_scan`): per row the partial
   (shift, sums, weight, not yet normalized) of the piece's own keys that the row reads
   through the random features, and the state of the keys that a later piece reads
   through them (with ``window=w``, all but the piece's last :math:`w` keys, which it
   keeps as the *halo*; the first piece's ``sinks`` left out and kept as they are),
   with a NaN maximum when a key or value of the piece is not finite;
2. all-gathers these states, packed in one array of fixed size (:math:`S (D_v + 2)` per
   head, plus :math:`w (D + D_v + 1)` for the halo and :math:`K (D + D_v + 1)` for the
   sinks), whatever the sequence length (:mod:`xattn._estimators.sequence_state`,
   :mod:`xattn._core.collectives`);
3. merges the states of the pieces before it, an exclusive prefix over the devices with
   the online-softmax (maximum, sums) merge of the chunks
   (:func:`~xattn._core.primitives.merge_maxima`): pieces :math:`j < r - 1` whole (their
   halo's keys have left the window by :math:`p_r`), piece :math:`r - 1` without its
   halo, which becomes the window buffer; the first piece's sink tokens; the position
   :math:`p_r`. Selections by masks on the device index, so one program serves every
   device (a traced index under ``jax.shard_map``);
4. reads that state out for its rows and combines it with their partials of step 1
   (:func:`piece_rows`; the halo's keys, which only the rows :math:`j < w` read apart
   from the others, by a scan of :math:`w` rows), adds the exact band and sinks and
   normalizes: what :func:`~xattn._estimators.decode.continue_rfa` (``state=`` on one
   device) computes from the merged state, with one pass over the piece's keys in all.

The state after the whole sequence is the same merge over all pieces, on every device.
Gradients flow back through the gathered states by one all-reduce of their gradient
(under JAX the transpose of their cast to device-varying, in torch the gather's
backward), so outputs and gradients are those of one device's call up to rounding, and a
NaN reaches exactly the rows that attend it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from xattn._core.array import Array
from xattn._core.collectives import NOT_GIVEN, refuse_world_before_init, resolve_group
from xattn._core.inputs import AttentionInputs
from xattn._core.primitives import (
    RowPieces,
    finite_entries,
    finite_inputs,
    mark_tainted,
    quarantine,
)
from xattn._core.state import RFAState
from xattn._estimators import rf_scan
from xattn._estimators.decode import _new_tokens, _updated_sinks, continue_rfa
from xattn._estimators.rf_scan import FeatureMap, Partial, State
from xattn._estimators.sequence_state import merged_state, piece_payload, unpack
from xattn._estimators.window import exact_partial

__all__ = ["NOT_GIVEN", "check_parallel_call", "continue_sequence", "piece_rows",
           "piece_scan"]


def check_parallel_call(estimator: str, sequence_parallel: Any, *, causal: bool,
                        state: Any, q: Any) -> bool:
    """Whether the call splits its sequence across devices; ``ValueError`` for
    ``sequence_parallel`` without ``causal=True`` or with ``state=``, and for an explicit
    ``None`` with torch tensors while torch.distributed is not initialized (what
    ``torch.distributed.group.WORLD`` is then: :data:`~xattn._core.collectives.NOT_GIVEN`)."""
    if sequence_parallel is NOT_GIVEN or sequence_parallel is False:
        return False
    refuse_world_before_init(sequence_parallel, q, estimator)
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
    if sequence_parallel is None or sequence_parallel is NOT_GIVEN or sequence_parallel is False:
        return continue_rfa(xp, inputs, mapping, state, block_size=block_size,
                            chunk_size=chunk_size, guard=guard)
    group = resolve_group(sequence_parallel, inputs.q, inputs.num_queries, estimator)
    window, sinks = state.window, state.sinks
    short = min(group.lengths)
    if window and short < window:
        raise ValueError(f"{estimator}(sequence_parallel=..., window={window}): every piece of "
                         f"the sequence must hold at least window positions, but the "
                         f"{group.described} holds pieces of lengths {list(group.lengths)}")
    # refused on every rank alike (each has every piece's length), before any other
    # collective: an empty piece, or one shorter than the sinks, has no rows to exchange
    # in the sizes the others expect
    empty = [piece for piece, length in enumerate(group.lengths) if length == 0]
    if empty:
        raise ValueError(f"{estimator}(sequence_parallel=...): every piece of the sequence "
                         f"must hold at least one position, but piece(s) {empty} of the "
                         f"{group.described} are empty (lengths {list(group.lengths)})")
    too_short = [piece for piece, length in enumerate(group.lengths) if length < sinks]
    if too_short:
        raise ValueError(f"{estimator}(sequence_parallel=..., sinks={sinks}): every piece of "
                         f"the sequence must hold at least sinks positions, but piece(s) "
                         f"{too_short} of the {group.described} are shorter (lengths "
                         f"{list(group.lengths)})")
    device = inputs.device
    index = xp.arange(group.size, device=device)
    lengths = xp.asarray(group.lengths, dtype=state.position.dtype, device=device)

    def position(upto: Any) -> Array:  # the first position after the pieces before upto
        return xp.sum(xp.where(index < upto, lengths, xp.zeros_like(lengths)))

    batch = tuple(state.sink_keys.shape[:-2])
    valid = (xp.ones((*batch, inputs.num_keys), dtype=xp.bool, device=device)
             if inputs.key_mask is None else xp.broadcast_to(inputs.key_mask,
                                                             (*batch, inputs.num_keys)))
    positions = position(group.rank) + xp.arange(inputs.num_keys, device=device)
    summed = valid & (positions >= sinks)  # sink tokens never enter the sums
    # one block holds the piece: its inputs are read as finite once, and scaled once (q^ and
    # k^, q^ . k^ = s q . k), as on one device (xattn._estimators.window.windowed_rfa)
    finite = inputs.num_queries <= block_size
    read = inputs
    if finite:
        read = finite_inputs(inputs)
        root_scale = math.sqrt(inputs.scale)
        read = dataclasses.replace(read, q=root_scale * read.q, k=root_scale * read.k,
                                   scale=1.0)
    inner, features = piece_scan(xp, read, mapping, summed, window=window, batch=batch,
                                 block_size=block_size, chunk_size=chunk_size, finite=finite)
    payload, layout = piece_payload(xp, inputs, features, state, valid, summed)
    gathered = group.gather(payload)

    def prefix(payloads: Array, upto: Any) -> RFAState:
        return merged_state(xp, mapping, state, unpack(xp, payloads, layout), index=index,
                            upto=upto, position=position(upto),
                            root_scale=math.sqrt(inputs.scale))

    # this device's rows mix the payloads with its index: its gradient of them is summed
    # over the devices once (Group.varying); the state after the whole sequence is the
    # same on every device, made of the payloads only
    out, invalid = piece_rows(xp, inputs, read, mapping,
                              prefix(group.varying(gathered), group.rank), inner, summed,
                              block_size=block_size, chunk_size=chunk_size, guard=guard,
                              finite=finite)
    return out, invalid, prefix(gathered, group.size)


def piece_scan(xp: Any, inputs: AttentionInputs, mapping: FeatureMap, summed: Array, *,
               window: int, batch: tuple[int, ...], block_size: int, chunk_size: int,
               finite: bool = False) -> tuple[list[Partial], State]:
    r"""The one scan of this device's piece, from no state (step 1 of the module
    docstring): per block of rows the partial of the piece's own keys that row :math:`j`
    reads through the random features (:math:`m \le j - w - 1`; :math:`m \le j`
    without a window), and the state of the keys that a later piece reads through them
    (all but the last :math:`w`). ``summed``: the valid keys that are not sinks;
    ``finite``: q, k and v hold no NaN or infinity and are read as they are."""
    length = inputs.num_queries
    root_scale = math.sqrt(inputs.scale)
    returned: list[State] = []
    scan = rf_scan.scan_partials(
        xp, mapping, inputs.q, inputs.k, inputs.v, root_scale=root_scale, key_mask=summed,
        first_key=0, offset=window + 1 if window else 0, reverse=False,
        block_size=block_size, chunk_size=chunk_size, batch_shape=batch, finite=finite,
        returned=returned)
    inner = [next(scan) for _ in range(0, length, block_size)]
    features = rf_scan.returned_state(scan, returned)
    if window and length > window:  # the last key to leave the window (the scan stops before)
        features = mapping.merge_states(features, rf_scan.state_over_keys(
            xp, mapping, inputs.k, inputs.v, root_scale=root_scale, key_mask=summed,
            first_key=0, start=length - window - 1, stop=length - window,
            chunk_size=chunk_size, batch_shape=batch, finite=finite))
    return inner, features


def _rows(xp: Any, parts: list[Partial], batch: tuple[int, ...]) -> Partial:
    """The partials of consecutive rows as one partial (each at the leading dims ``batch``)."""
    if len(parts) == 1:
        return parts[0]
    return tuple(xp.concat([xp.broadcast_to(x[i], (*batch, *x[i].shape[-2:])) for x in parts],
                           axis=-2) for i in range(3))


def _shifted(partial: Partial, constant: Array) -> Partial:
    """``partial`` with the per-row ``constant`` added to its shift."""
    shift, sums, weight = partial
    return shift + constant, sums, weight


def piece_rows(xp: Any, inputs: AttentionInputs, read: AttentionInputs, mapping: FeatureMap,
               before: RFAState, inner: list[Partial], summed: Array, *, block_size: int,
               chunk_size: int, guard: bool, finite: bool = False) -> tuple[Array, Array | None]:
    r"""The output rows of this device's piece (step 4 of the module docstring) from the
    state ``before`` it and the partials ``inner`` of its own keys (:func:`piece_scan`):
    what :func:`~xattn._estimators.decode.continue_rfa` computes from ``before`` in one
    scan.

    Row :math:`j` reads through the random features the keys of ``before``, the halo's
    keys :math:`e \le j - 1` (``before``'s window buffer, positions :math:`p - w + e`)
    and its own keys :math:`m \le j - w - 1`: rows :math:`j < w` a scan of the halo
    from ``before`` (they read no key of their own), the others the readout of
    ``before`` with the whole halo merged, each combined with its own partial (the
    (maximum, sums) merge of :func:`~xattn._estimators.rf_scan.combine_partials`). The
    exact terms read the halo's keys :math:`e \ge j` (rows :math:`j < w`), the piece's
    own band and the sinks; the rows are normalized last. ``summed``: the piece's valid
    keys that are not sinks; ``read``: the inputs as :func:`piece_scan` read them (with
    ``finite``, read as finite and scaled once). Returns the output and the clamped rows
    (trigonometric ``guard``, else None).
    """
    window, sinks = before.window, before.sinks
    batch = tuple(before.sink_keys.shape[:-2])
    length = inputs.num_queries
    if length == 0:
        return dataclasses.replace(inputs, batch_shape=batch).empty_result(), None
    root_scale = math.sqrt(inputs.scale)
    # a piece before with a non-finite key or value taints every row (its NaN maximum);
    # the sums were computed without it (xattn._core.primitives.quarantine)
    seen_before = xp.any(xp.isnan(xp.reshape(before.feature_max, (*batch, -1))), axis=-1)
    tainted, _ = quarantine(inputs, causal=True)
    tainted = tainted | seen_before[..., None, None]
    known = before.feature_state
    known = (xp.where(xp.isnan(known[0]), -xp.inf, known[0]), *known[1:])
    sink_rows = None
    if sinks:  # the sink slots after this piece's first tokens (those at positions < K)
        count = min(sinks, length)
        keys, values, valid = _new_tokens(xp, dataclasses.replace(
            inputs, k=inputs.k[..., :count, :], v=inputs.v[..., :count, :],
            key_mask=None if inputs.key_mask is None else inputs.key_mask[..., :count]),
            batch, finite=True)
        positions = before.position + xp.arange(count, device=inputs.device)
        sink_keys, sink_values, sink_valid = _updated_sinks(xp, before, keys, values, valid,
                                                            positions, inputs.device)
        if read.scale != inputs.scale:  # scored by q^ (as the band): k^ = s^(1/2) k
            sink_keys = root_scale * sink_keys
        sink_rows = (sink_keys, sink_values, sink_valid)
    head: Partial | None = None
    halo = (before.window_keys, before.window_values, before.window_valid)
    if window:  # rows j < w: the halo's keys e <= j - 1 after those of before
        returned: list[State] = []
        scan = rf_scan.scan_partials(
            xp, mapping, inputs.q[..., :window, :], halo[0], halo[1], root_scale=root_scale,
            key_mask=halo[2], first_key=0, offset=1, reverse=False, block_size=block_size,
            chunk_size=chunk_size, batch_shape=batch, initial=known, returned=returned)
        head = _rows(xp, [next(scan) for _ in range(0, window, block_size)], batch)
        known = rf_scan.returned_state(scan, returned)
        known = mapping.merge_states(known, rf_scan.state_over_keys(  # the halo
            xp, mapping, halo[0], halo[1], root_scale=root_scale, key_mask=halo[2],
            first_key=0, start=window - 1, stop=window, chunk_size=chunk_size,
            batch_shape=batch))
    exact_terms = bool(window or sinks)  # the random part must estimate e^{q.k} itself
    out = RowPieces(length)
    clamped = RowPieces(length) if guard else None
    for start, own in zip(range(0, length, block_size), inner, strict=True):
        stop = min(start + block_size, length)
        queries = finite_entries(xp, read.q[..., start:stop, :], finite)
        q_hat = queries if finite else root_scale * queries  # q^ = s^(1/2) q
        constant = mapping.query_constant(q_hat) if exact_terms else None
        middle = min(max(window, start), stop)  # rows start .. middle - 1 are j < w
        parts: list[Partial] = []
        if head is not None and middle > start:
            part: Partial = tuple(x[..., start:middle, :] for x in head)
            if constant is not None:
                part = _shifted(part, constant[..., :middle - start, :])
            # the halo's keys e >= j, exactly: row j sits at e = j + w of the halo's sequence
            exact = exact_partial(xp, root_scale * q_hat[..., :middle - start, :],
                                  start + window, window=window, causal=True, band=halo,
                                  finite=True)
            parts.append(part if exact is None else rf_scan.combine_partials(xp, [part, exact]))
        if middle < stop:
            part = mapping.readout(mapping.queries(q_hat[..., middle - start:, :]), known)
            parts.append(part if constant is None
                         else _shifted(part, constant[..., middle - start:, :]))
        partials = [_rows(xp, parts, batch), own if constant is None else _shifted(own, constant)]
        if exact_terms:  # the piece's own band and the sinks (slot s <= position)
            exact = exact_partial(
                xp, read.scale * queries, start, window=window, causal=True,
                band=(read.k, read.v, summed) if window else None, finite=finite,
                sinks=sink_rows, sink_position=before.position + start)
            partials += [] if exact is None else [exact]
        rows, invalid = rf_scan.finish_partial(xp, rf_scan.combine_partials(xp, partials),
                                               guard=guard)
        out.put(start, rows)
        if clamped is not None:
            clamped.put(start, invalid)
    return (mark_tainted(xp, out.result(), tainted),
            None if clamped is None else clamped.result() & ~tainted)
