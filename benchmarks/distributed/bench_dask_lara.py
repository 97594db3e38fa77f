"""LARA over a multi-million-token sequence on a 2-worker Dask cluster with a memory limit.

Starts a ``distributed.LocalCluster`` on loopback (2 worker processes, one thread each, a
per-worker memory limit), draws q, k, v of shape ``(N, 64)`` in float32 lazily on the
workers (chunked along the sequence, never on the client), runs ``xattn.lara`` (segment
proposals, decoupled weights, C samples, an int seed) and reduces the ``(N, 64)`` output
to a few summary numbers on the workers. Reports the wall time of the computation and, per
worker, the peak resident memory of the worker process (``resource.getrusage``
``ru_maxrss``, read in each worker through ``client.run``) and how much it spilled to
disk (the cumulative counters of the worker's spill buffer)::

    python benchmarks/distributed/bench_dask_lara.py      # N = 4 Mi tokens, 2 GiB/worker
    python benchmarks/distributed/bench_dask_lara.py --length 262144 --chunk 32768 \
        --memory-limit 1GiB

Writes ``benchmarks/results/dask_lara_results.json`` (``--output`` to change). The machine's load
matters: on a shared machine the wall time is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

# one BLAS thread per worker process: the cluster provides the parallelism
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import dask  # noqa: E402
import dask.array as da  # noqa: E402
import distributed  # noqa: E402
import numpy as np  # noqa: E402

import xattn  # noqa: E402

GIB = 2**30


def worker_memory(dask_worker=None) -> dict:
    """Peak RSS of this worker process (getrusage) and its spill counters, in MiB."""
    import resource

    import psutil

    report = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB
        "rss_mib": psutil.Process().memory_info().rss / 2**20,
    }
    # cumulative spill counters of the worker's SpillBuffer (distributed >= 2023)
    metrics = getattr(getattr(dask_worker, "data", None), "cumulative_metrics", None)
    if metrics is not None:
        report["spilled_to_disk_mib"] = sum(
            value for (label, unit), value in metrics.items()
            if label == "disk-write" and unit == "bytes") / 2**20
        report["spill_metrics"] = {f"{label} ({unit})": value
                                   for (label, unit), value in metrics.items()}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4 * 2**20, help="N = M tokens")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2**17, help="tokens per Dask chunk")
    parser.add_argument("--samples", type=int, default=64, help="C, LARA's proposals")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="2GiB", help="per worker")
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).resolve().parents[1] / "results"
                        / "dask_lara_results.json")
    args = parser.parse_args(argv)

    cluster = distributed.LocalCluster(
        n_workers=args.workers, threads_per_worker=1, host="127.0.0.1",
        dashboard_address=None, memory_limit=args.memory_limit, processes=True)
    client = distributed.Client(cluster)
    try:
        memory_limit_bytes = next(iter(client.scheduler_info()["workers"].values()))[
            "memory_limit"]
        before = client.run(worker_memory)
        shape, chunks = (args.length, args.head_dim), (args.chunk, args.head_dim)
        generator = da.random.default_rng(0)
        q, k, v = (generator.standard_normal(shape, chunks=chunks, dtype=np.float32)
                   for _ in range(3))
        out = xattn.lara(q, k, v, num_samples=args.samples, rng=0)
        summary = (da.mean(out), da.max(da.abs(out)), da.all(da.isfinite(out)), out[:4, :4])
        num_tasks = len(out.__dask_graph__())

        start = time.perf_counter()
        mean, largest, finite, corner = client.compute(summary, sync=True)
        seconds = time.perf_counter() - start
        after = client.run(worker_memory)
    finally:
        client.close()
        cluster.close()

    input_gib = 3 * args.length * args.head_dim * 4 / GIB
    result = {
        "meta": {
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()),
            "dask": dask.__version__, "distributed": distributed.__version__,
            "numpy": np.__version__, "xattn": getattr(xattn, "__version__", "dev"),
        },
        "config": {
            "length": args.length, "head_dim": args.head_dim, "value_dim": args.head_dim,
            "dtype": "float32", "chunk": args.chunk, "num_chunks": -(-args.length // args.chunk),
            "num_samples": args.samples, "proposal": "segment", "weighting": "decoupled",
            "workers": args.workers, "threads_per_worker": 1,
            "memory_limit_per_worker_gib": memory_limit_bytes / GIB,
            "num_tasks": num_tasks,
        },
        "inputs_gib": input_gib,
        "output_gib": input_gib / 3,
        "wall_seconds": seconds,
        "workers": {
            address: {"before": before[address], "after": after[address]}
            for address in after
        },
        "peak_rss_mib_max_over_workers": max(w["peak_rss_mib"] for w in after.values()),
        "check": {"output_mean": float(mean), "output_max_abs": float(largest),
                  "all_finite": bool(finite), "corner": np.asarray(corner).tolist()},
    }
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: result[key] for key in ("config", "wall_seconds",
                                                   "peak_rss_mib_max_over_workers")},
                     indent=2))
    for address, memory in result["workers"].items():
        print(address, memory["after"])
    return result


if __name__ == "__main__":
    main()
