"""
A long sequence on Dask
=======================

Dask arrays are lazy and chunked, so a sequence too long for memory can be processed in
pieces, on one machine or on a cluster. xattn functions take Dask arrays like any other
Array API arrays: they build a task graph, and nothing is computed until ``.compute()``.
:func:`xattn.softmax_attention` processes keys in chunks of ``chunk_size`` with a running
maximum (online softmax), so its memory stays :math:`O((N + M) D)` instead of
:math:`O(NM)`.
"""

# %%
import dask
import dask.array as da
import matplotlib.pyplot as plt
import numpy as np

import xattn

# Small enough for the documentation build; the same code scales to much longer inputs.
num_tokens, head_dim, chunk = 4096, 32, 1024
rng = np.random.default_rng(0)
q_host, k_host, v_host = (rng.normal(size=(num_tokens, head_dim)) for _ in range(3))
q, k, v = (da.from_array(a, chunks=(chunk, head_dim)) for a in (q_host, k_host, v_host))

lazy = xattn.softmax_attention(q, k, v, causal=True, chunk_size=chunk)
print(type(lazy).__name__, lazy.shape, lazy.dtype, "| chunks:", lazy.chunks)

# %%
# Computing the graph with the threaded scheduler gives the same numbers as NumPy:
with dask.config.set(scheduler="threads", num_workers=2):
    out = lazy.compute()
reference = xattn.softmax_attention(q_host, k_host, v_host, causal=True)
print(f"max |dask - numpy| = {np.max(np.abs(out - reference)):.1e}")

# %%
# Linear-time estimators
# ----------------------
# :func:`xattn.rfa` and :func:`xattn.lara` take Dask arrays the same way, at a cost linear
# in the sequence length. With an int seed the samples are drawn on the host, so the
# lazy result equals the NumPy one with the same seed.
lazy_rfa = xattn.rfa(q, k, v, num_features=64, causal=True, rng=0)
with dask.config.set(scheduler="threads", num_workers=2):
    out_rfa = lazy_rfa.compute()
same_seed_numpy = xattn.rfa(q_host, k_host, v_host, num_features=64, causal=True, rng=0)
print(f"rfa: max |dask - numpy, same seed| = {np.max(np.abs(out_rfa - same_seed_numpy)):.1e}")
print(f"rfa: RMS error against exact attention = {np.sqrt(np.mean((out_rfa - out) ** 2)):.3f}")

# %%
# Scaling out
# -----------
# On a cluster, create a ``distributed.Client`` first and the same ``.compute()`` runs
# there; keep the chunks along the sequence a few thousand tokens long so each task
# stays in cache.
#
# Causal attention: later queries average over more keys, so their outputs shrink
# towards the mean value.
fig, ax = plt.subplots(figsize=(6, 3))
positions = np.arange(num_tokens)
ax.semilogx(positions + 1, np.linalg.norm(out, axis=-1), lw=0.6)
ax.set_xlabel("query position n + 1")
ax.set_ylabel("|y_n|")
ax.set_title(f"Causal softmax attention on Dask, N = {num_tokens}")
fig.tight_layout()
