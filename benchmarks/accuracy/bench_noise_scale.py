"""Bias, variance and MSE of LARA and RA against their ``noise_scale`` (NumPy, float64).

``noise_scale`` (sigma) draws omega = mu + sigma * eps while keeping the importance weights
of the unit-covariance proposals N(mu, I). sigma = 1 is the paper's estimator; sigma =
D**-0.25 is what the authors' implementation computes in training mode (it divides q and k
by D**(1/4) and draws unit-variance noise); sigma = 0 gives the noise-free omega (for LARA
and biased RA the deterministic, evaluation-mode estimate).

For each input set, estimator and sigma this measures squared bias, variance and MSE
against exact softmax attention with :func:`xattn.diagnostics.estimator_error` (``draws``
independent int seeds), averaged over the output elements. The measured squared bias
(the squared distance of the mean of R draws from exact attention) also holds the Monte
Carlo error of that mean, variance / R on average; ``bias_squared_corrected`` = bias² -
variance / (R - 1) removes it (an unbiased estimate of the true squared bias; it can come
out slightly negative where the bias is zero):

- ``structured``: the default data of ``xattn compare``
  (:func:`xattn.diagnostics.structured_attention_inputs`: 4 heads, N = M = 1024, D = 64,
  clustered, sharp attention);
- ``peaked``: q, k ~ 1.5 N(0, 1) and v ~ N(0, 1), same shape (4, 1024, 64).

Estimators: ``lara`` (C = 64, defaults: segment proposals, decoupled weights), ``ra``
(S = 1, unbiased) and ``ra-biased`` (S = 1, ``biased=True``). Writes
``benchmarks/results/noise_scale_results.json`` and prints a Markdown table::

    python benchmarks/accuracy/bench_noise_scale.py              # 32 draws, about 3 min on 1 core
    python benchmarks/accuracy/bench_noise_scale.py --draws 4    # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

THREADS = os.environ.get("BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)

import numpy as np  # noqa: E402

import xattn  # noqa: E402
from xattn.diagnostics import estimator_error, structured_attention_inputs  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "noise_scale_results.json"
HEAD_DIM = 64
NOISE_SCALES = (0.0, HEAD_DIM ** -0.25, 0.5, 0.75, 1.0)
ESTIMATORS = {
    "lara": (xattn.lara, {"num_samples": 64}),
    "ra": (xattn.ra, {"num_samples": 1}),
    "ra-biased": (xattn.ra, {"num_samples": 1, "biased": True}),
}


def input_sets() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    gen = np.random.default_rng(0)
    shape = (4, 1024, HEAD_DIM)
    peaked = (1.5 * gen.normal(size=shape), 1.5 * gen.normal(size=shape), gen.normal(size=shape))
    return {"structured": structured_attention_inputs(), "peaked": peaked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rows = []
    for data_name, (q, k, v) in input_sets().items():
        exact = xattn.softmax_attention(q, k, v)
        for name, (estimator, options) in ESTIMATORS.items():
            for sigma in NOISE_SCALES:
                start = time.perf_counter()
                error = estimator_error(estimator, q, k, v, draws=args.draws, seed=args.seed,
                                        exact=exact, noise_scale=sigma, **options)
                row = {"data": data_name, "estimator": name, "noise_scale": sigma,
                       "options": options, **error.as_dict(),
                       "seconds": time.perf_counter() - start}
                row.pop("seeds")
                row["bias_squared_corrected"] = (error.bias_squared
                                                 - error.variance / (args.draws - 1))
                rows.append(row)
                print(f"{data_name:10s} {name:9s} sigma={sigma:.3f}  mse={error.mse:.4e}  "
                      f"bias2={error.bias_squared:.4e}  var={error.variance:.4e}", flush=True)
    result = {
        "description": __doc__.splitlines()[0],
        "command": "python benchmarks/accuracy/bench_noise_scale.py "
                   f"--draws {args.draws} --seed {args.seed}",
        "head_dim": HEAD_DIM,
        "noise_scales": list(NOISE_SCALES),
        "draws": args.draws,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {OUT}\n")
    print("| data | estimator | noise_scale | MSE | bias² | bias² (corrected) | variance |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        sigma = row["noise_scale"]
        label = "D^-1/4 = 0.354" if abs(sigma - HEAD_DIM ** -0.25) < 1e-12 else f"{sigma:g}"
        print(f"| {row['data']} | {row['estimator']} | {label} | {row['mse']:.3e} | "
              f"{row['bias_squared']:.3e} | {row['bias_squared_corrected']:.2e} | "
              f"{row['variance']:.3e} |")


if __name__ == "__main__":
    main()
