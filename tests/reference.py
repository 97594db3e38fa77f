"""Float64 NumPy references: the explicit formulas every backend is compared against."""

from __future__ import annotations

import numpy as np


def allowed_keys(num_queries, num_keys, key_mask=None, causal=False):
    """Boolean (..., N, M): True where query n may attend key m."""
    allowed = np.ones((num_queries, num_keys), dtype=bool)
    if causal:
        allowed &= np.arange(num_queries)[:, None] >= np.arange(num_keys)[None, :]
    if key_mask is not None:
        allowed = allowed & np.asarray(key_mask)[..., None, :]
    return allowed


def softmax_attention(q, k, v, *, scale=None, key_mask=None, causal=False):
    """The naive formula: softmax over allowed keys of scale * q.k, in float64.
    A query without allowed keys gets a zero row."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ np.swapaxes(k, -1, -2)
    allowed = allowed_keys(q.shape[-2], k.shape[-2], key_mask, causal)
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.where(allowed, np.exp(scores - top), 0.0)
    total = weights.sum(-1, keepdims=True)
    return (weights @ v) / np.where(total > 0, total, 1.0)
