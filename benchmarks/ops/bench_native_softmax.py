"""softmax_attention against the frameworks' fused kernels, in one interleaved run.

The targets of the native delegation (``softmax_attention(implementation=None)``):

* torch, forward plus backward, (32, 2, N, 32), N = 1024 and 2048: xattn / SDPA <= 1.1;
* JAX, ``jax.jit``-compiled forward, the same shapes: xattn / ``jax.nn.dot_product_attention``
  <= 1.1.

Each round calls, in turn, the framework's kernel, ``xattn.softmax_attention`` (automatic
choice: the same kernel behind xattn's checks) and the portable loop
(``implementation="xattn"``), so a change of load affects all alike; the best of the
rounds is reported. Causal and not.

NumPy has no fused kernel: there the figure is the fraction of the machine's GEMM peak
that the portable loop reaches at N = M = 4096, D = Dv = 64, float32, one head (its
FLOPs: ``2 N M D`` for the scores and ``2 N M Dv`` for the weighted values; the peak: a
2048^3 float32 matmul, timed in the same rounds), for each ``chunk_size`` of
``--chunk-sizes`` (the tile of queries and of keys per step; the default is marked), and
the fraction of the rate that attention's two products alone reach at their own shapes
(``(N, 64) @ (64, M)`` and ``(N, M) @ (M, 64)``, no softmax between them). Usage::

    python benchmarks/ops/bench_native_softmax.py                 # N = 1024, 2048; 5 rounds
    python benchmarks/ops/bench_native_softmax.py --lengths 256 --repeats 2 --threads 2
    python benchmarks/ops/bench_native_softmax.py --frameworks numpy
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import interleaved_best_times

import xattn

RESULTS = Path(__file__).resolve().parents[1] / "results" / "native_softmax_results.json"


def torch_rows(lengths, repeats, batch, heads, head_dim):
    import torch
    rows = []
    for length in lengths:
        for causal in (False, True):
            generator = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator,
                                   requires_grad=True) for _ in range(3))

            def step(function, leaves=(q, k, v)):
                for leaf in leaves:
                    leaf.grad = None
                function(*leaves).sum().backward()

            def sdpa(query, key, value, causal=causal):
                return torch.nn.functional.scaled_dot_product_attention(query, key, value,
                                                                        is_causal=causal)

            def auto(query, key, value, causal=causal):
                return xattn.softmax_attention(query, key, value, causal=causal)

            def portable(query, key, value, causal=causal):
                return xattn.softmax_attention(query, key, value, causal=causal,
                                               implementation="xattn")

            calls = {"torch SDPA": lambda f=sdpa, step=step: step(f),
                     "xattn (auto)": lambda f=auto, step=step: step(f),
                     "xattn (portable)": lambda f=portable, step=step: step(f)}
            times = interleaved_best_times(calls, repeats)
            rows.append({"framework": "torch", "pass": "forward+backward", "length": length,
                         "causal": causal, "ms": {n: 1000 * t for n, t in times.items()},
                         "auto_over_native": times["xattn (auto)"] / times["torch SDPA"]})
            print(rows[-1], flush=True)
    return rows


def jax_rows(lengths, repeats, batch, heads, head_dim):
    import jax
    import jax.numpy as jnp
    rows = []
    for length in lengths:
        for causal in (False, True):
            keys = jax.random.split(jax.random.key(0), 3)
            q, k, v = (jax.random.normal(key, (batch, heads, length, head_dim)) for key in keys)
            def native(query, key, value, causal=causal):
                swap = [jnp.swapaxes(x, 1, 2) for x in (query, key, value)]  # (B, T, H, D)
                return jnp.swapaxes(jax.nn.dot_product_attention(*swap, is_causal=causal), 1, 2)

            def auto(query, key, value, causal=causal):
                return xattn.softmax_attention(query, key, value, causal=causal)

            def portable(query, key, value, causal=causal):
                return xattn.softmax_attention(query, key, value, causal=causal,
                                               implementation="xattn")

            arrays = (q, k, v)
            compiled = {"jax.nn.dot_product_attention": jax.jit(native),
                        "xattn (auto)": jax.jit(auto), "xattn (portable)": jax.jit(portable)}
            calls = {name: (lambda f=f, arrays=arrays: f(*arrays).block_until_ready())
                     for name, f in compiled.items()}
            times = interleaved_best_times(calls, repeats)
            rows.append({"framework": "jax", "pass": "forward (jit)", "length": length,
                         "causal": causal, "ms": {n: 1000 * t for n, t in times.items()},
                         "auto_over_native":
                             times["xattn (auto)"] / times["jax.nn.dot_product_attention"]})
            print(rows[-1], flush=True)
    return rows


GEMM_SIZE = 2048


def numpy_rows(repeats, chunk_sizes, length=4096, head_dim=64):
    from xattn._core.options import DEFAULT_CHUNK_SIZE
    draw = np.random.default_rng(0)
    q, k, v = (draw.standard_normal((1, length, head_dim), dtype=np.float32)
               for _ in range(3))
    a, b = (draw.standard_normal((GEMM_SIZE, GEMM_SIZE), dtype=np.float32) for _ in range(2))
    scores = draw.standard_normal((length, length), dtype=np.float32)
    calls = {"gemm 2048^3": lambda: a @ b,
             # the two products of attention alone, at its shapes (inner size 64 and 4096)
             "attention's two gemms": lambda: (q[0] @ k[0].T, scores @ v[0])}
    for chunk in chunk_sizes:
        calls[f"portable chunk_size={chunk}"] = (
            lambda chunk=chunk: xattn.softmax_attention(q, k, v, chunk_size=chunk))
    times = interleaved_best_times(calls, repeats)
    peak = 2 * GEMM_SIZE**3 / times["gemm 2048^3"]
    flops = 4 * length * length * head_dim
    gemms_alone = flops / times["attention's two gemms"]
    rows = []
    for chunk in chunk_sizes:
        seconds = times[f"portable chunk_size={chunk}"]
        rows.append({"framework": "numpy", "pass": "forward", "length": length,
                     "head_dim": head_dim, "chunk_size": chunk,
                     "default_chunk_size": chunk == DEFAULT_CHUNK_SIZE,
                     "ms": 1000 * seconds, "gflops": flops / seconds / 1e9,
                     "gemm_peak_gflops": peak / 1e9, "fraction_of_gemm_peak":
                         flops / seconds / peak,
                     "two_gemms_alone_gflops": gemms_alone / 1e9,
                     "fraction_of_two_gemms_alone": flops / seconds / gemms_alone})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--frameworks", default="torch,jax,numpy")
    parser.add_argument("--chunk-sizes", default="256,512,1024,2048,4096",
                        help="numpy: tiles of keys to measure")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    lengths = [int(item) for item in args.lengths.split(",")]
    shape = {"batch": 32, "heads": 2, "head_dim": 32}
    rows, versions = [], {"xattn": xattn.__version__, "numpy": np.__version__}
    frameworks = args.frameworks.split(",")
    if "torch" in frameworks:
        import torch
        torch.set_num_threads(args.threads)
        versions["torch"] = torch.__version__
        rows += torch_rows(lengths, args.repeats, **shape)
    if "jax" in frameworks:
        import jax
        versions["jax"] = jax.__version__
        rows += jax_rows(lengths, args.repeats, **shape)
    if "numpy" in frameworks:  # the BLAS's own threads (all cores unless its variables say)
        rows += numpy_rows(args.repeats, [int(item) for item in args.chunk_sizes.split(",")])
    payload = {"shape": shape, "repeats": args.repeats, "torch_threads": args.threads,
               "machine": platform.platform(), "processor": platform.processor(),
               "cpu_count": os.cpu_count(),
               "versions": versions, "rows": rows}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
