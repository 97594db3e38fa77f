"""Error of the random-feature log-partition function against d: per-edge vs shared samples.

For ``--chains`` random linear chains (T = 5 positions, |X| = 3 states, n = 4, embeddings
``0.5 * N(0, 1)``; chain i drawn from seed i) and each number of features d, this calls
:func:`xattn.mrf.log_partition_rf` once per chain (``rng=i``, NumPy, float64, default
sequential method and orthogonal samples) with ``samples="per_edge"`` and with
``samples="shared"``, and compares with the exact :func:`xattn.mrf.log_partition`:

- ``median_abs_log_error``: median over chains of |log Z_rf - log Z|;
- ``rms_log_error``: root mean square of the same errors;
- ``mean_log_error``: their mean (the bias of log Z_rf, negative by Jensen's inequality);
- ``mean_ratio_minus_1`` and ``ratio_standard_error``: mean of Z_rf / Z - 1 over chains and
  its standard error (0 in expectation for an unbiased estimate of Z).

Writes ``benchmarks/results/mrf_results.json`` and prints a Markdown table::

    python benchmarks/accuracy/bench_mrf.py                  # 400 chains, d = 16 .. 4096, ~1 min
    python benchmarks/accuracy/bench_mrf.py --chains 50      # quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

THREADS = os.environ.get("BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)

import numpy as np  # noqa: E402

from xattn.mrf import SAMPLES, log_partition, log_partition_rf  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "mrf_results.json"
NUM_STEPS, NUM_STATES, EMBED_DIM, SPREAD = 5, 3, 4, 0.5
FEATURES = (16, 64, 256, 1024, 4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=400)
    args = parser.parse_args()

    chains = [SPREAD * np.random.default_rng(i).normal(size=(NUM_STEPS, NUM_STATES, EMBED_DIM))
              for i in range(args.chains)]
    exact = np.array([float(log_partition(chain)) for chain in chains])
    rows = []
    for num_features in FEATURES:
        for samples in SAMPLES:
            start = time.perf_counter()
            estimates = np.array([
                float(log_partition_rf(chain, num_features=num_features, rng=i,
                                       samples=samples))
                for i, chain in enumerate(chains)])
            errors = estimates - exact
            ratios = np.exp(errors)
            row = {
                "num_features": num_features,
                "samples": samples,
                "median_abs_log_error": float(np.median(np.abs(errors))),
                "rms_log_error": float(np.sqrt(np.mean(errors ** 2))),
                "mean_log_error": float(np.mean(errors)),
                "mean_ratio_minus_1": float(np.mean(ratios) - 1.0),
                "ratio_standard_error": float(np.std(ratios, ddof=1) / math.sqrt(len(ratios))),
                "seconds": time.perf_counter() - start,
            }
            rows.append(row)
            print(f"d={num_features:5d} {samples:8s} median|err|={row['median_abs_log_error']:.4f}"
                  f"  rms={row['rms_log_error']:.4f}  mean={row['mean_log_error']:+.4f}  "
                  f"E[Z_rf/Z]-1={row['mean_ratio_minus_1']:+.4f} "
                  f"(se {row['ratio_standard_error']:.4f})", flush=True)
    result = {
        "description": __doc__.splitlines()[0],
        "command": f"python benchmarks/accuracy/bench_mrf.py --chains {args.chains}",
        "chain": {"T": NUM_STEPS, "states": NUM_STATES, "n": EMBED_DIM, "spread": SPREAD},
        "chains": args.chains,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {OUT}\n")
    print("| d | samples | median abs log Z error | RMS log Z error | mean log Z error | "
          "mean Z_rf/Z - 1 (± s.e.) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['num_features']} | {row['samples']} | {row['median_abs_log_error']:.4f} | "
              f"{row['rms_log_error']:.4f} | {row['mean_log_error']:+.4f} | "
              f"{row['mean_ratio_minus_1']:+.4f} ± {row['ratio_standard_error']:.4f} |")


if __name__ == "__main__":
    main()
