"""
Approximation error against the number of samples
==================================================

How close do the randomized estimators get to exact softmax attention, and how fast do
they improve with more samples? :func:`xattn.diagnostics.estimator_error` runs an
estimator with independent int seeds and splits its mean squared error (MSE) against
:func:`xattn.softmax_attention` into squared bias and variance.

* ``rfa`` (Performer, positive orthogonal features) is a self-normalized importance
  sampler: consistent but biased; its error vanishes only as :math:`S \\to \\infty`;
* ``ra`` samples from the query's own mixture distribution and is unbiased; its cost is
  quadratic, so it serves as the accuracy reference for the randomized family;
* ``lara`` uses :math:`C` input-dependent proposals (one sample each) at linear cost.

The sizes are small so the documentation builds fast; the trend, not the exact values,
is the point (one realization of random Gaussian inputs, 8 draws per point). Such inputs
have no structure for LARA's segment proposals to exploit, and with :math:`D = 16` the
kernel variance :math:`e^{2x\\cdot y}(e^{\\lVert x+y \\rVert^2} - 1)` is large, so RFA and
LARA improve slowly at these :math:`S`. The LARA paper reports its advantage on inputs
of trained vision and language models, which have such structure. Run this script with
your own ``q, k, v`` to measure the estimators on your data.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np

import xattn
from xattn.diagnostics import estimator_error

rng = np.random.default_rng(0)
num_tokens, head_dim = 128, 16
q, k, v = (rng.normal(size=(num_tokens, head_dim)) for _ in range(3))
exact = xattn.softmax_attention(q, k, v)

sample_counts = [4, 8, 16, 32, 64]
estimators = {
    "rfa": lambda s: {"estimator": xattn.rfa, "num_features": s},
    "ra": lambda s: {"estimator": xattn.ra, "num_samples": s},
    "lara": lambda s: {"estimator": xattn.lara, "num_samples": s},
}
results = {name: [] for name in estimators}
for name, options_for in estimators.items():
    for count in sample_counts:
        options = options_for(count)
        estimator = options.pop("estimator")
        error = estimator_error(estimator, q, k, v, draws=8, seed=0, exact=exact, **options)
        results[name].append(error)
        print(f"{name:5s} S={count:3d}  mse={error.mse:.2e}  bias^2={error.bias_squared:.2e}"
              f"  variance={error.variance:.2e}  relative={error.relative_error:.3f}")

# %%
# Mean squared error and the share of the bias
# --------------------------------------------
# The dotted line is a :math:`1/S` slope through the first RA point. RA is unbiased: its
# squared bias is only the Monte Carlo noise of the mean of 8 draws (about variance / 8).
# The squared bias of RFA and LARA is a systematic part of their error that more draws do
# not remove; it shrinks only with more samples per call.
fig, (ax_mse, ax_bias) = plt.subplots(1, 2, figsize=(10, 3.8))
for name, errors in results.items():
    ax_mse.loglog(sample_counts, [e.mse for e in errors], marker="o", label=name)
    ax_bias.loglog(sample_counts, [e.bias_squared for e in errors], marker="o", label=name)
slope = results["ra"][0].mse * sample_counts[0] / np.asarray(sample_counts)
ax_mse.loglog(sample_counts, slope, "k:", label="1/S")
ax_mse.set_xlabel("samples S (features for rfa, proposals C for lara)")
ax_mse.set_ylabel("MSE against softmax attention")
ax_bias.set_xlabel("samples S")
ax_bias.set_ylabel("squared bias (mean of 8 draws)")
for ax in (ax_mse, ax_bias):
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xticks(sample_counts, [str(count) for count in sample_counts])
    ax.minorticks_off()
fig.tight_layout()
