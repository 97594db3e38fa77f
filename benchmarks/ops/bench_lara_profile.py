"""LARA against RFA at equal samples: the time ratio, and where the time goes (NumPy).

At N = M = 32768, C = S = 64, D = Dv = 64, one batch-head, float32, NumPy on one thread,
this measures in one interleaved run (best of ``--repeats`` rounds, one call of each per
round) the wall-clock and CPU time (``time.process_time``, the steadier figure on a loaded
machine) of

- ``lara``: ``xattn.lara(q, k, v, num_samples=64, rng=0)`` (segment proposals, decoupled
  weights, the default);
- ``lara-balance``: the same with ``weighting="balance"`` (no per-query weights);
- ``rfa``: ``xattn.rfa(q, k, v, num_features=64, rng=0)`` (positive map, orthogonal
  samples, the default);
- ``lara-c128`` against ``rfa-s128``: the same at C = S = 128 > Dv, where LARA recomputes
  the exponentials of its first pass over the queries instead of keeping them,

and then profiles each estimator with :mod:`cProfile` (time spent inside each function,
per call, so the GEMMs and elementwise operators are charged to the function that runs
them), and times the primitive operations on one (1024, 64) piece of queries: a GEMM
against (64, 64), ``exp``, a reduction over either axis, an elementwise operation with a
row or a column vector. Writes ``benchmarks/results/lara_profile_results.json``::

    python benchmarks/ops/bench_lara_profile.py            # about a minute
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path

THREADS = os.environ.get("BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import interleaved_best_wall_and_cpu_times  # noqa: E402

import xattn  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "lara_profile_results.json"
LENGTH, SAMPLES, DIM = 32768, 64, 64


def profile(call, runs=5, top=12):
    """Time inside each function (tottime) per call, the ``top`` largest, in ms."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(runs):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = []
    for (filename, line, function), (_, _, tottime, cumtime, _) in stats.items():
        name = f"{Path(filename).name}:{function}" if line else function
        rows.append({"function": name, "self_ms": 1e3 * tottime / runs,
                     "cumulative_ms": 1e3 * cumtime / runs})
    rows.sort(key=lambda row: -row["self_ms"])
    return rows[:top]


def primitives(repeats=200):
    gen = np.random.default_rng(0)
    piece = gen.normal(size=(1, 1024, SAMPLES)).astype(np.float32)
    queries = gen.normal(size=(1, 1024, DIM)).astype(np.float32)
    samples_t = gen.normal(size=(1, DIM, SAMPLES)).astype(np.float32)
    values = gen.normal(size=(1, SAMPLES, DIM)).astype(np.float32)
    row = gen.normal(size=(1, 1, SAMPLES)).astype(np.float32)
    column = gen.normal(size=(1, 1024, 1)).astype(np.float32)
    ops = {
        "GEMM (1024, 64) @ (64, 64)": lambda: queries @ samples_t,
        "GEMM (1024, 64) @ (64, 64) [read-out]": lambda: piece @ values,
        "matrix-vector (1024, 64) @ (64, 1)": lambda: piece @ row.transpose(0, 2, 1),
        "exp": lambda: np.exp(piece),
        "max over the 64 samples (per query)": lambda: piece.max(-1, keepdims=True),
        "max over the 1024 queries (per sample)": lambda: piece.max(-2, keepdims=True),
        "sum over the 1024 queries": lambda: piece.sum(-2, keepdims=True),
        "elementwise with a row vector": lambda: piece + row,
        "elementwise with a column vector": lambda: piece - column,
        "elementwise of two pieces": lambda: piece * piece,
        "maximum with a scalar (weight floor)": lambda: np.maximum(piece, np.float32(1e-8)),
    }
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(repeats):
        for name, op in ops.items():
            start = time.process_time_ns()
            op()
            best[name] = min(best[name], (time.process_time_ns() - start) / 1e3)
    return {name: {"us_per_piece": value, "ms_per_32_pieces": value * 32 / 1e3}
            for name, value in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    gen = np.random.default_rng(0)
    q, k, v = (gen.normal(size=(1, LENGTH, DIM)).astype(np.float32) for _ in range(3))
    calls = {
        "lara": lambda: xattn.lara(q, k, v, num_samples=SAMPLES, rng=0),
        "lara-balance": lambda: xattn.lara(q, k, v, num_samples=SAMPLES, rng=0,
                                           weighting="balance"),
        "rfa": lambda: xattn.rfa(q, k, v, num_features=SAMPLES, rng=0),
        # C > Dv: LARA recomputes the exponentials of its first pass (no (N, C) array kept)
        "lara-c128": lambda: xattn.lara(q, k, v, num_samples=2 * SAMPLES, rng=0),
        "rfa-s128": lambda: xattn.rfa(q, k, v, num_features=2 * SAMPLES, rng=0),
    }
    times = interleaved_best_wall_and_cpu_times(calls, args.repeats)
    baseline = {name: "rfa-s128" if name.endswith("128") else "rfa" for name in times}
    ratios = {name: {clock: times[name][clock] / times[baseline[name]][clock]
                     for clock in ("wall_s", "cpu_s")} for name in times}
    for name in times:
        print(f"{name:13s} wall {times[name]['wall_s'] * 1e3:7.1f} ms  cpu "
              f"{times[name]['cpu_s'] * 1e3:7.1f} ms   / {baseline[name]}: wall "
              f"{ratios[name]['wall_s']:.2f}  cpu {ratios[name]['cpu_s']:.2f}")
    profiles = {name: profile(calls[name]) for name in ("lara", "rfa")}
    for name, rows in profiles.items():
        print(f"\n{name}: time inside each function per call (ms)")
        for row in rows:
            print(f"  {row['self_ms']:7.2f}  {row['function']}")
    units = primitives()
    print("\nprimitives on one (1024, 64) float32 piece (32 pieces = N = 32768):")
    for name, value in units.items():
        print(f"  {value['us_per_piece']:7.1f} us  ({value['ms_per_32_pieces']:.2f} ms for N)  "
              f"{name}")
    OUT.write_text(json.dumps({
        "description": __doc__.splitlines()[0],
        "shape": {"N": LENGTH, "M": LENGTH, "C_S": SAMPLES, "D": DIM, "Dv": DIM,
                  "batch_heads": 1, "dtype": "float32"},
        "threads": THREADS, "repeats": args.repeats, "numpy": np.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "times": times, "ratio_to_rfa": ratios, "profiles": profiles,
        "primitives": units,
    }, indent=2) + "\n")
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
