"""
NumPy basics
============

A first tour of xattn with plain NumPy arrays: shapes and broadcasting, the ``scale``
argument, key masks and causal attention, and the portable random-number adapter.
"""

# %%
# Shapes
# ------
# Queries ``(..., N, D)``, keys ``(..., M, D)`` and values ``(..., M, Dv)`` give an output
# ``(..., N, Dv)``. Leading dimensions (batch, heads) broadcast like NumPy arrays.
import matplotlib.pyplot as plt
import numpy as np

import xattn

rng = np.random.default_rng(0)
batch, heads, num_queries, num_keys, head_dim, value_dim = 2, 3, 24, 32, 8, 5
q = rng.normal(size=(batch, heads, num_queries, head_dim))
k = rng.normal(size=(batch, heads, num_keys, head_dim))
v = rng.normal(size=(batch, heads, num_keys, value_dim))

out = xattn.softmax_attention(q, k, v)
print(out.shape, out.dtype)

# %%
# Keys and values shared by all heads broadcast against per-head queries:
out_shared = xattn.softmax_attention(q, k[:, :1], v[:, :1])
print(out_shared.shape)

# %%
# The attention matrix
# --------------------
# With the identity matrix as values, attention returns its own weights
# :math:`\pi_{nm} = \mathrm{softmax}_m(s\, q_n \cdot k_m)`. ``scale=None`` means
# :math:`s = 1/\sqrt{D}`; a larger scale gives sharper weights.
identity = np.eye(num_keys)
weights = xattn.softmax_attention(q[0, 0], k[0, 0], identity)
sharp = xattn.softmax_attention(q[0, 0], k[0, 0], identity, scale=1.0)
print("rows sum to one:", np.allclose(weights.sum(axis=-1), 1.0))

# %%
# Key masks and causal attention
# ------------------------------
# ``key_mask`` is boolean, broadcastable to ``(..., M)``, True where the key takes part.
# ``causal=True`` lets query ``n`` see keys ``m <= n`` (top-left aligned). A query
# without any allowed key gets a zero row, never NaN.
key_mask = np.arange(num_keys) < 20  # the last 12 keys are padding
masked = xattn.softmax_attention(q[0, 0], k[0, 0], identity, key_mask=key_mask)
causal = xattn.softmax_attention(q[0, 0], k[0, 0], identity, causal=True)

fig, axes = plt.subplots(1, 4, figsize=(12, 3.4), sharey=True)
panels = [(weights, "scale = 1/sqrt(D)"), (sharp, "scale = 1"),
          (masked, "key_mask: 20 keys"), (causal, "causal=True")]
for ax, (matrix, title) in zip(axes, panels, strict=True):
    ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=0.5)
    ax.set_title(title)
    ax.set_xlabel("key m")
axes[0].set_ylabel("query n")
fig.tight_layout()

# %%
# Reproducible randomness
# -----------------------
# Randomized estimators take ``rng``: an ``int`` seed, a native generator or an xattn
# generator. An int seed draws on the host in float64, so the same seed gives the same
# numbers on every backend; :func:`xattn.random.default_rng` makes a reusable generator.
generator = xattn.random.default_rng(0)
first = generator.normal(np, (2, 4), dtype=np.float64)
again = xattn.random.default_rng(0).normal(np, (2, 4), dtype=np.float64)
print(np.array_equal(first, again))
