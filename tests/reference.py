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


def randomized_attention(q, k, v, uniforms=None, noise=None, *, biased=False, scale=None,
                         key_mask=None, causal=False):
    """RA (paper Algorithm 1) for given draws, in float64 over full (..., N, S, M) arrays.

    ``uniforms`` (..., N, S) in (0, 1] pick z_ns = #{m : cdf_nm < u} (clipped to the
    last allowed key) unless ``biased``; ``noise`` (..., N, S, D) is epsilon (None: 0)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    q_hat, k_hat = np.sqrt(scale) * q, np.sqrt(scale) * k
    allowed = allowed_keys(q.shape[-2], k.shape[-2], key_mask, causal)
    identity = np.broadcast_to(np.eye(k.shape[-2]), (*k.shape[:-1], k.shape[-2]))
    pi = softmax_attention(q, k, identity, scale=scale, key_mask=key_mask,
                           causal=causal)  # (..., N, M): the attention weights themselves
    if biased:
        means = (q_hat + pi @ k_hat)[..., None, :]
    else:
        cdf = np.cumsum(pi, axis=-1)
        z = np.sum(cdf[..., None, :] < np.asarray(uniforms)[..., None], axis=-1)
        last = np.max(np.where(allowed, np.arange(k.shape[-2]), 0), axis=-1)
        z = np.minimum(z, last[..., None])
        one_hot = (z[..., None] == np.arange(k.shape[-2])).astype(np.float64)
        k_z = one_hot @ k_hat[..., None, :, :]
        means = q_hat[..., None, :] + k_z
    omega = means if noise is None else means + np.asarray(noise)
    logits = omega @ np.swapaxes(k_hat, -1, -2)[..., None, :, :] - 0.5 * np.sum(
        k_hat**2, axis=-1)[..., None, None, :]
    allowed_s = np.broadcast_to(allowed[..., None, :], logits.shape)
    logits = np.where(allowed_s, logits, -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    weights = np.where(allowed_s, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    return ((weights / np.where(total > 0, total, 1.0)) @ v[..., None, :, :]).mean(axis=-2)
