"""
Linear-chain MRF partition functions with random features
==========================================================

A linear-chain Markov random field over :math:`T` variables with :math:`|\\mathcal X|`
states each has potentials :math:`\\psi_t(a, b) = \\exp(e_{t-1}(a) \\cdot e_t(b))`.
:func:`xattn.mrf.log_partition` computes :math:`\\log Z` exactly by a forward pass in
:math:`O(T |\\mathcal X|^2 n)`; :func:`xattn.mrf.log_partition_rf` replaces each potential
by positive random features :math:`\\phi(e_{t-1}(a)) \\cdot \\phi(e_t(b))` and carries the
forward messages in the :math:`d`-dimensional feature space, :math:`O(T |\\mathcal X| d)`.

This example shows (1) the error in :math:`\\log Z` against the number of features
:math:`d`, and (2) the time of both against the number of states, where the linearized
form overtakes the exact one. Sizes are small so that it runs in seconds.
"""

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

from xattn.mrf import log_partition, log_partition_rf

rng = np.random.default_rng(0)
num_steps, num_states, embed_dim = 16, 32, 8
embeddings = 0.35 * rng.normal(size=(num_steps, num_states, embed_dim))
exact = log_partition(embeddings)
print(f"exact log Z = {float(exact):.4f}")

# %%
# Error in log Z against the number of features
# ---------------------------------------------
# Mean absolute error over 16 seeds, for iid and block-orthogonal samples. The error
# falls like :math:`1/\sqrt d` (dotted line): the estimate of each potential is a mean
# over :math:`d` features.
feature_counts = [8, 16, 32, 64, 128, 256, 512]
seeds = range(16)
errors = {}
for orthogonal in (False, True):
    label = "orthogonal" if orthogonal else "iid"
    errors[label] = [
        np.mean([abs(float(log_partition_rf(embeddings, num_features=d, rng=seed,
                                             orthogonal=orthogonal)) - float(exact))
                 for seed in seeds])
        for d in feature_counts
    ]
    for d, error in zip(feature_counts, errors[label], strict=True):
        print(f"{label:10s} d={d:4d}  mean |error in log Z| = {error:.4f}")

fig, ax = plt.subplots(figsize=(5.5, 3.8))
for label, values in errors.items():
    ax.loglog(feature_counts, values, marker="o", label=label)
guide = errors["iid"][0] * np.sqrt(feature_counts[0] / np.asarray(feature_counts))
ax.loglog(feature_counts, guide, "k:", label=r"$1/\sqrt{d}$")
ax.set_xlabel("random features d")
ax.set_ylabel("mean |log Z_rf - log Z|")
ax.set_title(f"T={num_steps}, |X|={num_states}, n={embed_dim}")
ax.legend()
fig.tight_layout()

# %%
# Time against the number of states
# ---------------------------------
# The exact pass costs :math:`O(T |\mathcal X|^2 n)`, the linearized one
# :math:`O(T |\mathcal X| d)`: for a fixed :math:`d` the linearized form wins once
# :math:`|\mathcal X|` is large enough (here a few hundred states with :math:`d = 64`).
# Best of three runs with NumPy on CPU; the crossover moves with hardware and backend.
def best_time(function, repeats=3):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


num_features = 64
state_counts = [16, 32, 64, 128, 256, 512]
timings = {"exact": [], "random features (sequential)": []}
for states in state_counts:
    chain = rng.normal(size=(num_steps, states, 16)) / 4.0
    omega = rng.normal(size=(num_steps - 1, num_features, 16))  # one matrix per potential
    timings["exact"].append(best_time(lambda chain=chain: log_partition(chain)))
    timings["random features (sequential)"].append(
        best_time(lambda chain=chain, omega=omega: log_partition_rf(chain, omega=omega)))
    print(f"|X|={states:4d}  exact {timings['exact'][-1] * 1e3:8.2f} ms   "
          f"random features {timings['random features (sequential)'][-1] * 1e3:8.2f} ms")

fig, ax = plt.subplots(figsize=(5.5, 3.8))
for label, values in timings.items():
    ax.loglog(state_counts, values, marker="o", label=label)
ax.set_xlabel("states |X|")
ax.set_ylabel("time (s)")
ax.set_title(f"T={num_steps}, n=16, d={num_features}")
ax.legend()
fig.tight_layout()
plt.show()
