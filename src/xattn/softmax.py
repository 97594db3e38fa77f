"""Exact softmax attention, the reference every estimator is measured against."""

from __future__ import annotations

from typing import Any

from xattn._array import check_positive_int, prepare_attention, sequence_positions

__all__ = ["causal_allowed", "finite_shift", "masked_softmax", "softmax_attention"]

Array = Any


def finite_shift(xp: Any, maxima: Array) -> Array:
    """The stabilizing shift of a log-sum-exp: ``maxima`` with ``-inf`` replaced by 0.

    A maximum is ``-inf`` when every entry it covers is masked; shifting by 0 then keeps
    ``exp(logit - shift)`` at ``exp(-inf) = 0`` for those entries instead of NaN.
    """
    return xp.where(maxima == -xp.inf, xp.zeros_like(maxima), maxima)


def masked_softmax(xp: Any, logits: Array, allowed: Array | None = None, *, axis: int = -1,
                   scale: float = 1.0) -> Array:
    """``scale`` times the softmax of ``logits`` along ``axis`` over the ``allowed`` entries.

    Entries where ``allowed`` is False get weight 0; a slice with no allowed entry gets
    all zeros (never NaN). ``scale`` is folded into the normalization (one pass fewer
    than scaling afterwards).
    """
    if allowed is not None:
        logits = xp.where(allowed, logits, xp.full_like(logits, -xp.inf))
    top = finite_shift(xp, xp.max(logits, axis=axis, keepdims=True))
    weights = xp.exp(logits - top)  # entries not allowed: exp(-inf) = 0
    total = xp.sum(weights, axis=axis, keepdims=True)
    return weights * (scale / xp.where(total > 0, total, xp.ones_like(total)))


def causal_allowed(xp: Any, query_positions: Array, key_start: int, key_stop: int,
                   device: Any) -> Array:
    """Boolean ``(N, key_stop - key_start)``: True where key ``m <= n`` (query ``n``).

    ``query_positions`` holds ``0 .. N - 1`` (:func:`xattn._array.sequence_positions`).
    Causal attention in xattn is aligned top-left, as in PyTorch's
    ``scaled_dot_product_attention(is_causal=True)``: query ``n`` sees keys ``0..n``.
    """
    keys = xp.arange(key_start, key_stop, device=device)
    return query_positions[:, None] >= xp.astype(keys, query_positions.dtype)[None, :]


def softmax_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float | None = None,
    key_mask: Array | None = None,
    causal: bool = False,
    chunk_size: int = 1024,
    check_finite: bool = False,
) -> Array:
    r"""Exact softmax attention, numerically stable and chunked over keys.

    .. math::

        y_n = \sum_m \frac{\exp(s\, q_n \cdot k_m)}{\sum_{m'} \exp(s\, q_n \cdot k_{m'})} v_m

    over the allowed keys ``m`` (``key_mask`` and, if ``causal``, ``m <= n``), with
    score scale ``s``. Keys are processed ``chunk_size`` at a time with a running
    maximum and running normalizer (online softmax), so memory is
    ``O(N * chunk_size + (N + M) * D)`` per batch-head instead of ``O(N * M)``.

    Parameters
    ----------
    q : array, shape (..., N, D)
        Queries. Real floating dtype; half precision is computed in float32.
    k : array, shape (..., M, D)
        Keys.
    v : array, shape (..., M, Dv)
        Values.
    scale : float, optional
        Score scale; ``None`` means ``1/sqrt(D)``.
    key_mask : bool array, shape broadcastable to (..., M), optional
        True where the key takes part. A query whose keys are all masked gets a zero row.
    causal : bool
        If True, query ``n`` attends keys ``m <= n`` only (top-left aligned, as in
        PyTorch's ``is_causal``).
    chunk_size : int
        Number of keys processed at a time.
    check_finite : bool
        If True, raise ``ValueError`` when q, k or v hold NaN or infinity (this reads the
        values: not under :func:`jax.jit`, and it computes lazy Dask inputs). Default
        False: unchecked, and NaN propagates to the output rows that depend on it (see
        :func:`xattn._array.prepare_attention`).

    Returns
    -------
    array, shape (..., N, Dv)
        In the namespace, device and dtype of the inputs; leading dims broadcast.

    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 7, 4)), rng.normal(size=(2, 7, 3))
    >>> xattn.softmax_attention(q, k, v).shape
    (2, 5, 3)
    """
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask,
                               check_finite=check_finite)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    xp, q, k, v = inputs.xp, inputs.q, inputs.k, inputs.v
    num_queries, num_keys = inputs.num_queries, inputs.num_keys
    device = inputs.device
    batch = inputs.batch_shape

    q_scaled = q * inputs.scale
    # the running state is derived from q (not created with xp.zeros) so that it is laid
    # out like the queries: chunked along N on Dask, sharded like q on JAX
    query_zeros = xp.broadcast_to(xp.zeros_like(q_scaled[..., :1]), (*batch, num_queries, 1))
    running_max = query_zeros - xp.inf
    normalizer = query_zeros
    numerator = xp.broadcast_to(query_zeros, (*batch, num_queries, v.shape[-1]))
    # under causal masking, keys past the last query are never seen
    key_stop = min(num_keys, num_queries) if causal else num_keys
    query_positions = sequence_positions(q, axis=-2) if causal else None  # chunked like q
    for start in range(0, key_stop, chunk_size):
        stop = min(start + chunk_size, key_stop)
        scores = q_scaled @ xp.matrix_transpose(k[..., start:stop, :])
        allowed = None
        if inputs.key_mask is not None:
            allowed = inputs.key_mask[..., None, start:stop]
        if causal:
            in_past = causal_allowed(xp, query_positions, start, stop, device)
            allowed = in_past if allowed is None else (allowed & in_past)
        if allowed is not None:
            scores = xp.where(allowed, scores, -xp.inf)
        new_max = xp.maximum(running_max, xp.max(scores, axis=-1, keepdims=True))
        # rows with no allowed key so far keep max = -inf; shift them by 0 instead
        shift = finite_shift(xp, new_max)
        weights = xp.exp(scores - shift)  # masked scores: exp(-inf) = 0
        rescale = xp.exp(running_max - shift)  # 0 while nothing was allowed
        normalizer = normalizer * rescale + xp.sum(weights, axis=-1, keepdims=True)
        numerator = numerator * rescale + weights @ v[..., start:stop, :]
        running_max = new_max
    safe_normalizer = xp.where(normalizer > 0, normalizer, xp.ones_like(normalizer))
    return inputs.finish(numerator / safe_normalizer)
