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

Two kinds of inputs are measured: iid Gaussian queries and keys (flat attention with no
structure), and the structured inputs of ``xattn compare``
(:func:`xattn.diagnostics.structured_attention_inputs`: tokens in contiguous clusters, so
attention is sharp and local, closer to trained models). The sizes are small so the
documentation builds fast: one realization of each input, 8 draws per point. Run this
script with your own ``q, k, v`` to measure the estimators on your data.
"""

# %%
import matplotlib.pyplot as plt
import numpy as np

import xattn
from xattn.diagnostics import estimator_error, structured_attention_inputs

num_tokens, head_dim = 128, 32
rng = np.random.default_rng(0)
inputs = {
    "iid Gaussian inputs": tuple(rng.normal(size=(num_tokens, head_dim)) for _ in range(3)),
    "structured inputs": structured_attention_inputs(
        num_heads=1, length=num_tokens, head_dim=head_dim, num_clusters=8, seed=0),
}
sample_counts = [4, 8, 16, 32, 64]
estimators = {  # name: (function, keyword of its number of samples)
    "rfa": (xattn.rfa, "num_features"),
    "ra": (xattn.ra, "num_samples"),
    "lara": (xattn.lara, "num_samples"),
}

results = {}
for input_name, (q, k, v) in inputs.items():
    exact = xattn.softmax_attention(q, k, v)
    print(input_name)
    for name, (estimator, keyword) in estimators.items():
        errors = []
        for count in sample_counts:
            error = estimator_error(estimator, q, k, v, draws=8, seed=0, exact=exact,
                                    **{keyword: count})
            errors.append(error)
            print(f"  {name:5s} S={count:3d}  mse={error.mse:.2e}  "
                  f"bias^2={error.bias_squared:.2e}  variance={error.variance:.2e}")
        results[input_name, name] = errors

# %%
# Mean squared error
# ------------------
# The dotted line is a :math:`1/S` slope through the first RA point: RA is unbiased and
# follows it. On flat, unstructured attention the kernel variance
# :math:`e^{2x\cdot y}(e^{\lVert x+y \rVert^2} - 1)` dominates and neither RFA nor LARA
# improves much at these :math:`S`. On structured inputs LARA's proposals, centred on
# segment means of the queries and keys, lower the error below RFA's at the same number
# of samples.
def plot_panels(value, ylabel):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, input_name in zip(axes, inputs, strict=True):
        for name in estimators:
            errors = results[input_name, name]
            ax.loglog(sample_counts, [value(e) for e in errors], marker="o", label=name)
        first_ra = value(results[input_name, "ra"][0])
        ax.loglog(sample_counts, first_ra * sample_counts[0] / np.asarray(sample_counts),
                  "k:", label="1/S")
        ax.set_title(input_name)
        ax.set_xlabel("samples S (features for rfa, proposals C for lara)")
        ax.set_xticks(sample_counts, [str(count) for count in sample_counts])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0].set_ylabel(ylabel)
    fig.tight_layout()


plot_panels(lambda error: error.mse, "MSE against softmax attention")

# %%
# The share of the bias
# ---------------------
# The squared bias of the mean of 8 draws. For RA it is only Monte Carlo noise (about
# variance / 8, on the :math:`1/S` line); for RFA and LARA it is a systematic part of the
# error that more draws do not remove and that shrinks only with more samples per call.
plot_panels(lambda error: error.bias_squared, "squared bias (mean of 8 draws)")
