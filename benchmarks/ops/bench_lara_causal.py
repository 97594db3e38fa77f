"""Causal LARA's cost against the sequence length, next to causal RFA at equal samples.

NumPy float32, one thread, (B, N, D) = (4, N, 64), C = S = 64; causal LARA with learned
(here random, fixed) proposal means and the ``"query_proposal"`` weighting, causal RFA
with its orthogonal features. Best CPU time (:func:`time.process_time`, which leaves out
waiting for a core on a shared machine) of ``--repeats`` interleaved rounds after a
warm-up. The target: the time for 8 N at most 10 times that for N (linear cost)::

    python benchmarks/ops/bench_lara_causal.py  # writes benchmarks/results/lara_causal_results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")  # before NumPy loads its BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import interleaved_best_wall_and_cpu_times  # noqa: E402

import xattn  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # benchmarks/


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lara_causal_results.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    head_dim, samples = 64, args.samples
    means = (0.3 * rng.normal(size=(samples, head_dim))).astype(np.float32)
    rows = []
    for length in (int(item) for item in args.lengths.split(",")):
        q, k, v = (rng.normal(size=(4, length, head_dim)).astype(np.float32) for _ in range(3))
        calls = {
            "lara (causal)": lambda q=q, k=k, v=v: xattn.lara(
                q, k, v, num_samples=samples, proposal_means=means,
                weighting="query_proposal", causal=True, rng=0),
            "rfa (causal)": lambda q=q, k=k, v=v: xattn.rfa(
                q, k, v, num_features=samples, causal=True, rng=0),
        }
        best = interleaved_best_wall_and_cpu_times(calls, args.repeats)
        row = {"length": length, **{name: times["cpu_s"] for name, times in best.items()}}
        rows.append(row)
        print(row, flush=True)
    first, last = rows[0], rows[-1]
    ratio = last["lara (causal)"] / first["lara (causal)"]
    report = {"description": __doc__.splitlines()[0], "command": "python "
              "benchmarks/ops/bench_lara_causal.py", "machine": {
                  "cpus": os.cpu_count(), "processor": platform.processor(), "threads": 1,
                  "load_average_end": list(os.getloadavg())},
              "xattn": xattn.__version__, "numpy": np.__version__, "shape": [4, "N", head_dim],
              "samples": samples, "rows": rows,
              f"lara_time_at_{last['length']}_over_{first['length']}": ratio,
              "lara_over_rfa": [row["lara (causal)"] / row["rfa (causal)"] for row in rows]}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"causal LARA {last['length']} / {first['length']}: {ratio:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
