"""Per-token decoding time and state bytes against the position, on NumPy, torch and JAX.

The measurement of ``xattn bench --decode`` (:mod:`xattn.cli.decode`) on each backend in
one run: for positions 1k to 64k, the state of a causal call on that many tokens is built
by prefill calls, then single-token steps from it are timed (median of ``--steps``; JAX:
``jax.jit``-compiled steps), for

- exact softmax with its key-value cache (the baseline: what a Transformer keeps),
- RFA, S = 256 features,
- RFA with a window of 64 and 1 sink,
- on torch, RFA's step compiled by ``torch.compile(fullgraph=True)`` (one compilation:
  the state has the same shapes at every position; ``--no-torch-compile`` leaves it out),

float32, one head, D = Dv = 64. The targets: RFA's per-token time at 64k over its time
at 1k at most 1.2, with the state's bytes the same at every position; and the position
from which RFA is faster per token than softmax's cache, on each backend.
``BENCH_THREADS`` (default 1) sets the BLAS / OpenMP / torch threads::

    python benchmarks/models/bench_decode.py                      # a few minutes
    python benchmarks/models/bench_decode.py --positions 1024,4096 --backends numpy
    python benchmarks/models/bench_decode.py --backends torch --device cuda \
        --out benchmarks/results/gpu_decode.json

Writes ``benchmarks/results/decode_results.json`` and ``benchmarks/results/decode_results.png``
(``--out`` to change).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

THREADS = os.environ.get("BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)

import xattn  # noqa: E402
from xattn.cli.common import environment, write_json  # noqa: E402
from xattn.cli.decode import (  # noqa: E402
    decode_variants,
    measure_decode,
    overtaking_position,
    plot_decode,
    print_decode_table,
)
from xattn.cli.measure import load_backend  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # benchmarks/


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="numpy,torch,jax")
    parser.add_argument("--positions", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "decode_results.json")
    parser.add_argument("--device", default="cpu",
                        help="the device of every backend (cpu, or cuda on a GPU)")
    parser.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                        help="leave out the torch.compile(fullgraph=True) step of RFA")
    args = parser.parse_args()
    positions = [int(item) for item in args.positions.split(",")]
    report = {"description": __doc__.splitlines()[0],
              "command": "python benchmarks/models/bench_decode.py",
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                          "threads": int(THREADS), "load_average_start": list(os.getloadavg())},
              "xattn": xattn.__version__, "device": args.device, "dtype": "float32", "heads": 1,
              "head_dim": args.head_dim, "samples": args.samples, "window": args.window,
              "sinks": args.sinks, "steps": args.steps, "positions": positions,
              "backends": {}}
    results_by_backend = {}
    for name in args.backends.split(","):
        backend = load_backend(name, args.device, "float32")
        if name == "torch":
            import torch
            torch.set_num_threads(int(THREADS))
        variants = decode_variants(args.samples, args.window, args.sinks, seed=0,
                                   torch_compile=args.torch_compile and name == "torch")
        started = time.perf_counter()
        results = measure_decode(backend, variants, positions, heads=1,
                                 head_dim=args.head_dim, steps=args.steps, seed=0)
        print(f"{backend.describe()} ({time.perf_counter() - started:.0f} s)")
        print_decode_table(results)
        rows = {variant.name: results[variant.name] for variant in variants}
        first, last = positions[0], positions[-1]
        summary = {}
        for variant in variants[1:]:
            if variant.name not in results:
                continue
            times = {row["position"]: row["ms_per_token"] for row in rows[variant.name]}
            sizes = {row["state_bytes"] for row in rows[variant.name]}
            summary[variant.name] = {
                "overtaking_position": overtaking_position(results, variant.name),
                f"time_at_{last}_over_time_at_{first}": times[last] / times[first],
                "state_bytes_constant": len(sizes) == 1, "state_bytes": sorted(sizes)}
            print(f"  {variant.name}: {summary[variant.name]}")
        report["backends"][name] = {"environment": environment(backend), "jit": name == "jax",
                                    "results": results, "summary": summary,
                                    "load_average_end": list(os.getloadavg())}
        results_by_backend[name] = results
        write_json(args.out, report)  # what is finished survives an interrupted run
    plot_decode(args.out.with_suffix(".png"), results_by_backend,
                f"per-token decoding, float32, D = {args.head_dim}, one thread "
                "(solid: NumPy, dashed: torch, dotted: JAX jit)")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
