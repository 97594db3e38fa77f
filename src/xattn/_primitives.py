"""Numerical primitives shared by every estimator: stable shifts, masked softmax, causal masks.

This module sits below the estimators (softmax, rfa, ra, lara, mrf, features) and imports
only :mod:`xattn._array`.
"""

from __future__ import annotations

from typing import Any

from xattn._array import Array

__all__ = ["causal_allowed", "finite_shift", "logsumexp", "masked_softmax"]


def finite_shift(xp: Any, maxima: Array) -> Array:
    """The stabilizing shift of a log-sum-exp: ``maxima`` with ``-inf`` replaced by 0.

    A maximum is ``-inf`` when every entry it covers is masked; shifting by 0 then keeps
    ``exp(logit - shift)`` at ``exp(-inf) = 0`` for those entries instead of NaN.
    """
    return xp.where(maxima == -xp.inf, 0.0, maxima)


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
    return weights * (scale / xp.where(total > 0, total, 1.0))


def causal_allowed(xp: Any, query_positions: Array, key_start: int, key_stop: int,
                   device: Any) -> Array:
    """Boolean ``(N, key_stop - key_start)``: True where key ``m <= n`` (query ``n``).

    ``query_positions`` holds ``0 .. N - 1`` (:func:`xattn._array.sequence_positions`).
    Causal attention in xattn is aligned top-left, as in PyTorch's
    ``scaled_dot_product_attention(is_causal=True)``: query ``n`` sees keys ``0..n``.
    """
    keys = xp.arange(key_start, key_stop, device=device)
    return query_positions[:, None] >= xp.astype(keys, query_positions.dtype)[None, :]


def logsumexp(xp: Any, x: Array, axis: int) -> Array:
    """:math:`\\log \\sum \\exp` of ``x`` over ``axis`` with a finite max shift.

    A slice whose entries are all ``-inf`` gives ``-inf`` and one holding ``+inf`` gives
    ``+inf`` (never NaN from the shift itself).
    """
    shift = xp.max(x, axis=axis, keepdims=True)
    shift = xp.where(xp.isfinite(shift), shift, 0.0)
    total = xp.sum(xp.exp(x - shift), axis=axis, keepdims=True)
    return xp.squeeze(xp.log(total) + shift, axis=axis)
