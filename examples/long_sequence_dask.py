"""LARA over a sequence of millions of tokens on a 2-worker Dask cluster.

Run with ``python examples/long_sequence_dask.py`` (4 Mi tokens, D = 64, under a
minute on two cores) or ``--length 262144`` for a quick try. What it shows:

1. xattn estimators take Dask arrays chunked along the sequence. They build a lazy task
   graph in which the key statistics and LARA's segment means are reductions over the
   chunks and the queries are processed chunk by chunk, so no worker ever holds a whole
   sequence.
2. On a short sequence, the cluster's result equals NumPy's (same int seed, same samples).
3. On a long one (q, k, v drawn lazily on the workers: 3 GiB in float32 at 4 Mi tokens),
   the workers stay within their memory limit; the script reports the wall time and each
   worker's peak resident memory.
"""

from __future__ import annotations

import argparse
import resource
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster

import xattn


def peak_rss_mib() -> float:
    """Peak resident memory of the calling process in MiB (run in each worker)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def check_against_numpy(client: Client, head_dim: int) -> float:
    """LARA on a short chunked sequence, on the cluster and in NumPy: the same numbers."""
    rng = np.random.default_rng(0)
    q_host, k_host, v_host = (rng.normal(size=(4096, head_dim)) for _ in range(3))
    q, k, v = (da.from_array(x, chunks=(512, head_dim)) for x in (q_host, k_host, v_host))
    lazy = xattn.lara(q, k, v, num_samples=16, rng=0)
    print(f"lazy LARA output {lazy.shape}, chunks along N: {lazy.chunks[0]}")
    on_cluster = client.compute(lazy).result()
    in_numpy = xattn.lara(q_host, k_host, v_host, num_samples=16, rng=0)
    return float(np.max(np.abs(on_cluster - in_numpy)))


def main() -> None:
    parser = argparse.ArgumentParser(description="LARA on a long sequence with Dask")
    parser.add_argument("--length", type=int, default=4 * 2**20, help="N = M tokens")
    parser.add_argument("--chunk", type=int, default=2**17, help="tokens per chunk")
    parser.add_argument("--samples", type=int, default=64, help="C, LARA's proposals")
    parser.add_argument("--memory-limit", default="2GiB", help="per worker")
    args = parser.parse_args()
    head_dim = 64

    with LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address=None, memory_limit=args.memory_limit) as cluster, \
            Client(cluster) as client:
        print(f"cluster: 2 workers, 1 thread each, {args.memory_limit} per worker")
        difference = check_against_numpy(client, head_dim)
        print(f"short sequence: max |cluster - numpy| = {difference:.1e}")

        # q, k, v are drawn lazily, chunk by chunk, on the workers: never on this process
        generator = da.random.default_rng(1)
        shape, chunks = (args.length, head_dim), (args.chunk, head_dim)
        q, k, v = (generator.standard_normal(shape, chunks=chunks, dtype=np.float32)
                   for _ in range(3))
        out = xattn.lara(q, k, v, num_samples=args.samples, rng=0)
        # reduce the (N, 64) output on the workers; bring back a few numbers only
        summary = (da.mean(out), da.max(da.abs(out)), da.all(da.isfinite(out)))
        start = time.perf_counter()
        mean, largest, finite = client.compute(summary, sync=True)
        seconds = time.perf_counter() - start
        print(f"LARA, N = M = {args.length:,} tokens, D = {head_dim}, C = {args.samples}, "
              f"{out.numblocks[0]} chunks: {seconds:.1f} s")
        print(f"output: mean {float(mean):.2e}, max |y| {float(largest):.3f}, "
              f"all finite: {bool(finite)}")
        for address, peak in client.run(peak_rss_mib).items():
            print(f"worker {address}: peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
