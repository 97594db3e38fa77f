"""Exact softmax attention, the reference every estimator is measured against."""

from __future__ import annotations

from typing import Any

from xattn._core.array import Array, sequence_positions, stream_bounds
from xattn._core.delegation import has_native_attention, native_attention
from xattn._core.docstrings import EXAMPLE_INPUTS, document_estimator
from xattn._core.inputs import AttentionInputs, prepare_attention
from xattn._core.options import (
    DEFAULT_CHUNK_SIZE,
    IMPLEMENTATIONS,
    check_bool,
    check_choice,
    check_positive_int,
)
from xattn._core.primitives import (
    causal_allowed,
    finite_entries,
    finite_inputs,
    join,
    mark_tainted,
    merge_maxima,
    nonzero_divisor,
    quarantine,
)
from xattn._core.state import SoftmaxState, check_state_call
from xattn._estimators.decode import append_token, extend_cache

__all__ = ["softmax_attention"]




@document_estimator(SoftmaxState, examples=EXAMPLE_INPUTS)
def softmax_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    key_mask: Array | None = None,
    causal: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    check_finite: bool = False,
    implementation: str | None = None,
    state: SoftmaxState | None = None,
    return_state: bool = False,
) -> Any:
    r"""Exact softmax attention, numerically stable and chunked over keys.

    .. math::

        y_n = \sum_m \frac{\exp(s\, q_n \cdot k_m)}{\sum_{m'} \exp(s\, q_n \cdot k_{m'})} v_m

    over the allowed keys ``m`` (``key_mask`` and, if ``causal``, ``m <= n``), with
    score scale ``s``. Queries are processed in tiles of ``chunk_size`` and, for each
    tile, keys ``chunk_size`` at a time with a running maximum and running normalizer
    (online softmax), so the working memory besides inputs and output is
    ``O(chunk_size^2 + chunk_size * Dv)`` per batch-head instead of ``O(N * M)``. In
    causal mode a tile stops at its last query's key. Dask arrays are tiled by Dask
    itself (their query chunks; keys in ``chunk_size`` steps), and the result keeps the
    chunks of ``q``.

    Parameters
    ----------
    {{qkv}}
    scale : float, optional
        Score scale; ``None`` means ``1/sqrt(D)``.
    key_mask : bool array, shape broadcastable to (..., M), optional
        True where the key takes part. A query whose keys are all masked gets a zero row.
    causal : bool
        If True, query ``n`` attends keys ``m <= n`` only (top-left aligned, as in
        PyTorch's ``is_causal``).
    chunk_size : int
        Number of queries per tile and of keys processed at a time (default 1024). The
        result does not depend on it beyond rounding.
    check_finite : bool
        Raise ``ValueError`` on NaN or infinity in q, k or v (default False: unchecked, and
        NaN propagates); see :ref:`non-finite-inputs`.
    implementation : {None, "native", "xattn"}
        ``"native"``: the array library's fused kernel,
        :func:`torch.nn.functional.scaled_dot_product_attention` for torch tensors and
        ``jax.nn.dot_product_attention`` for float32 JAX arrays with ``Dv = D`` (it
        forms float32 logits); ``ValueError`` where there is none. ``"xattn"``: the
        portable tiled loop above. ``None`` (default): the native kernel where there is
        one, else the portable loop; on JAX's CPU backend the portable loop, which
        measured about twice as fast as XLA's kernel there. Both keep the same contract
        (masks, top-left causal masking, zero rows for queries without allowed keys, with
        finite gradients; half precision computed in float32) and agree to rounding.
        ``chunk_size`` applies to the portable loop. A call with ``state=`` and more than
        one query runs the portable loop (the kernels align their causal masks top-left).
    state : SoftmaxState, optional
        A key-value cache (``causal=True``) to continue: q, k and v are the ``L`` tokens
        after the ``P`` cached ones (``N = M = L``, 0 allowed); query ``P + j`` attends the
        cached keys and the new keys up to its own. The leading dims, ``D``, ``Dv`` and the
        compute dtype must be the cache's.
    return_state : bool
        Return ``(out, state)``, the :class:`~xattn.SoftmaxState` grown by these tokens
        (``causal=True``; ``N = M``). A sequence given in pieces then gets the outputs of
        one causal call on all of it, up to rounding.

    {{returns}}

    See Also
    --------
    xattn.rfa : Random feature attention: linear cost, a biased estimate.
    xattn.ra : Randomized attention: an unbiased estimate, quadratic cost.
    xattn.lara : Linear randomized attention: linear cost, input-dependent proposals.

    References
    ----------
    .. [1] A. Vaswani, N. Shazeer, N. Parmar, J. Uszkoreit, L. Jones, A. N. Gomez,
       Ł. Kaiser, I. Polosukhin, "Attention Is All You Need", NeurIPS 2017.
       https://arxiv.org/abs/1706.03762
    .. [2] M. Milakov, N. Gimelshein, "Online normalizer calculation for softmax", 2018.
       https://arxiv.org/abs/1805.02867

    The stable evaluation is derived in :doc:`/theory/05_stabilization`; all papers are in
    the :doc:`/bibliography`.

    {{examples}}
    >>> xattn.softmax_attention(q, k, v).shape
    (2, 5, 3)

    Generation with a key-value cache (:class:`~xattn.SoftmaxState`):

    >>> out, cache = xattn.softmax_attention(q, q, v[:, :5], causal=True, return_state=True)
    >>> out_t, cache = xattn.softmax_attention(q[:, :1], k[:, :1], v[:, :1], causal=True,
    ...                                        state=cache, return_state=True)
    >>> cache.keys.shape
    (2, 6, 4)
    """
    causal = check_bool(causal, "causal")
    stateful = check_state_call(state, return_state, causal, SoftmaxState)
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask,
                               check_finite=check_finite, continuing=stateful)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    if implementation is not None:
        check_choice(implementation, "implementation", IMPLEMENTATIONS)
    offset = 0  # the position of the first query: keys before it are in the cache
    if (stateful and state is not None and state.position and inputs.num_queries == 1
            and implementation != "xattn"
            and has_native_attention(inputs, automatic=implementation is None)):
        # a decoding step: the token appended, one call of the fused kernel
        extended, state = append_token(inputs, state)
        out = inputs.finish(native_attention(extended, False,
                                             every_query_has_a_key=inputs.key_mask is None))
        return (out, state) if return_state else out
    if stateful:  # attend the cached keys and the new ones (xattn._estimators.decode)
        inputs, state, offset = extend_cache(inputs, state, SoftmaxState)
    if inputs.is_empty:
        return (inputs.empty_result(), state) if return_state else inputs.empty_result()
    # non-finite rows reach exactly the rows that attend them, outputs and gradients
    tainted, _ = quarantine(inputs, causal=causal, offset=offset)
    out = None
    # the kernels' causal masks are top-left: with a cache, one query (which sees every key)
    if implementation != "xattn" and (offset == 0 or inputs.num_queries == 1):
        out = native_attention(finite_inputs(inputs), causal and offset == 0,
                               automatic=implementation is None)
        if out is None and implementation == "native":
            raise ValueError(
                "implementation='native': no fused attention kernel for these inputs (torch "
                "tensors, and float32 JAX arrays with Dv = D, have one); use "
                "implementation=None or 'xattn'")
    xp = inputs.xp
    if out is None:
        out = join(xp, [_attend_tile(inputs, start, stop, causal, chunk_size, offset)
                        for start, stop in stream_bounds(inputs.q, -2, chunk_size)], axis=-2)
    out = inputs.finish(mark_tainted(xp, out, tainted))
    return (out, state) if return_state else out


def _attend_tile(inputs: AttentionInputs, query_start: int, query_stop: int, causal: bool,
                 chunk_size: int, offset: int = 0) -> Array:
    """Softmax attention of the queries ``query_start:query_stop``, keys in chunks; with
    ``causal``, query ``i`` sits at position ``offset + i`` (after a cache)."""
    xp, k, v = inputs.xp, inputs.k, inputs.v
    q_scaled = finite_entries(xp, inputs.q[..., query_start:query_stop, :]) * inputs.scale
    num_queries = query_stop - query_start
    batch = inputs.batch_shape
    # the running state is derived from q (not created with xp.zeros) so that it is laid
    # out like the queries: chunked along N on Dask, sharded like q on JAX
    query_zeros = xp.broadcast_to(xp.zeros_like(q_scaled[..., :1]), (*batch, num_queries, 1))
    running_max = query_zeros - xp.inf
    normalizer = query_zeros
    numerator = xp.broadcast_to(query_zeros, (*batch, num_queries, v.shape[-1]))
    # under causal masking, keys past the tile's last query are never seen
    key_stop = min(inputs.num_keys, query_stop + offset) if causal else inputs.num_keys
    query_positions = None
    if causal:  # chunked like q on Dask
        query_positions = sequence_positions(q_scaled, axis=-2) + (query_start + offset)
    for start in range(0, key_stop, chunk_size):
        stop = min(start + chunk_size, key_stop)
        scores = q_scaled @ xp.matrix_transpose(finite_entries(xp, k[..., start:stop, :]))
        allowed = None
        if inputs.key_mask is not None:
            allowed = inputs.key_mask[..., None, start:stop]
        if causal:
            in_past = causal_allowed(xp, query_positions, start, stop, inputs.device)
            allowed = in_past if allowed is None else (allowed & in_past)
        if allowed is not None:
            scores = xp.where(allowed, scores, -xp.inf)
        # online softmax: the keys so far and this chunk's, at their common shift
        running_max, shift, (rescale, _) = merge_maxima(
            xp, running_max, xp.max(scores, axis=-1, keepdims=True))
        weights = xp.exp(scores - shift)  # masked scores: exp(-inf) = 0
        normalizer = normalizer * rescale + xp.sum(weights, axis=-1, keepdims=True)
        numerator = numerator * rescale + weights @ finite_entries(xp, v[..., start:stop, :])
    return numerator / nonzero_divisor(xp, normalizer)
