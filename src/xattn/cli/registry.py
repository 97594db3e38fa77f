"""The estimators ``xattn compare`` and ``xattn bench`` know, and how to call them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xattn
from xattn.cli.memory import Problem, lara_bytes, ra_bytes, rfa_bytes, softmax_bytes

__all__ = ["ESTIMATOR_SPECS", "PORTABLE_SOFTMAX", "SOFTMAX", "EstimatorSpec",
           "native_softmax_spec", "windowed_rfa_spec"]


@dataclass(frozen=True)
class EstimatorSpec:
    """How ``xattn compare`` / ``xattn bench`` call one estimator.

    Attributes
    ----------
    name : str
        Command-line name (``"rfa"``).
    sample_keyword : str or None
        Keyword that receives the number of samples (``"num_features"`` for RFA,
        ``"num_samples"`` for RA and LARA); ``None`` for exact softmax.
    load : callable
        Returns the estimator function.
    bench_samples : int
        Number of samples used by ``xattn bench`` unless ``--samples`` says otherwise.
    quadratic : bool
        True for estimators whose cost is O(N M S D) (RA): ``xattn compare`` runs them
        only at sample counts up to ``--ra-max-samples``.
    options : dict
        Further keywords passed to the estimator.
    memory : callable
        ``memory(problem, samples)``: estimated bytes of one call beyond its inputs
        (see :mod:`xattn.cli.memory`).
    deterministic : bool
        The estimator draws nothing (an evaluation mode): ``xattn compare`` runs one
        draw per cell.
    samples_matter : bool
        False when the result does not depend on the number of samples (deterministic
        biased RA: all samples coincide): ``xattn compare`` runs one cell and draws it as
        a horizontal line.
    """

    name: str
    sample_keyword: str | None
    load: Callable[[], Callable[..., Any]]
    bench_samples: int = 64
    quadratic: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    memory: Callable[[Problem, int], int] = softmax_bytes
    deterministic: bool = False
    samples_matter: bool = True


#: The estimators ``--estimators`` of ``compare`` and ``bench`` names, by name (not the
#: layers' estimator names, ``xattn.torch.ESTIMATORS``: these include evaluation modes).
ESTIMATOR_SPECS: dict[str, EstimatorSpec] = {
    "rfa": EstimatorSpec("rfa", "num_features", lambda: xattn.rfa, bench_samples=64,
                         memory=rfa_bytes),
    "ra": EstimatorSpec("ra", "num_samples", lambda: xattn.ra, bench_samples=1,
                        quadratic=True, memory=ra_bytes),
    # biased RA: one Gaussian proposal at the mixture mean (lower variance, biased)
    "ra-biased": EstimatorSpec("ra-biased", "num_samples", lambda: xattn.ra, bench_samples=1,
                               quadratic=True, memory=ra_bytes, options={"biased": True}),
    # the paper's evaluation mode of RA: biased and noise-free, all samples coincide
    "ra-det": EstimatorSpec("ra-det", "num_samples", lambda: xattn.ra, bench_samples=1,
                            quadratic=True, memory=ra_bytes,
                            options={"biased": True, "deterministic": True},
                            deterministic=True, samples_matter=False),
    "lara": EstimatorSpec("lara", "num_samples", lambda: xattn.lara, bench_samples=64,
                          memory=lara_bytes),
    # the paper's evaluation mode of LARA: omega = the proposal means, no draws
    "lara-det": EstimatorSpec("lara-det", "num_samples", lambda: xattn.lara,
                              bench_samples=64, memory=lara_bytes,
                              options={"deterministic": True}, deterministic=True),
}
#: Exact softmax attention, the reference every command measures (the automatic choice
#: of :func:`xattn.softmax_attention`: the framework's fused kernel where it has one).
SOFTMAX = EstimatorSpec("softmax", None, lambda: xattn.softmax_attention)
#: Exact softmax attention by xattn's portable tiled loop, on every backend.
PORTABLE_SOFTMAX = EstimatorSpec("softmax (xattn)", None, lambda: xattn.softmax_attention,
                                 options={"implementation": "xattn"})


def native_softmax_spec(backend: str, dtype: str) -> EstimatorSpec | None:
    """Exact softmax attention by the array library's own fused kernel
    (``xattn.softmax_attention(..., implementation="native")``), named after the kernel:
    ``"softmax (torch SDPA)"`` on torch, ``"softmax (jax.nn.dot_product_attention)"`` on
    JAX in float32; None on the backends without one (and JAX in float64, which the
    kernel computes in float32).

    The memory estimate of JAX's kernel on a CPU counts the (N, M) score matrix that XLA
    forms there, twice (the scores and their exponentials).
    """
    if backend == "torch":
        return EstimatorSpec("softmax (torch SDPA)", None, lambda: xattn.softmax_attention,
                             options={"implementation": "native"})
    if backend != "jax" or dtype != "float32":
        return None

    def dense_scores(problem: Problem, samples: int | None = None) -> int:
        return softmax_bytes(problem) + 2 * problem.itemsize * problem.batch * (
            problem.num_queries * problem.num_keys)

    return EstimatorSpec("softmax (jax.nn.dot_product_attention)", None,
                         lambda: xattn.softmax_attention, memory=dense_scores,
                         options={"implementation": "native"})


def windowed_rfa_spec(window: int | None, sinks: int) -> EstimatorSpec:
    """``rfa+window``: RFA with the keys ``|n - m| <= window`` and the first ``sinks`` keys
    computed exactly (``xattn.rfa(..., window=, sinks=)``)."""
    band = (0 if window is None else 2 * window + 1) + sinks

    def memory(problem: Problem, samples: int) -> int:  # + the exact band, in blocks
        return rfa_bytes(problem, samples) + 3 * problem.itemsize * problem.batch * (
            problem.num_queries * band)

    return EstimatorSpec("rfa+window", "num_features", lambda: xattn.rfa, memory=memory,
                         options={"window": window, "sinks": sinks})

