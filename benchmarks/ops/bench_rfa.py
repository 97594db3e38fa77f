"""Time and peak memory of ``xattn.rfa`` against ``softmax_attention`` and performer-pytorch.

Measures, for sequence lengths N (keys M = N), head dim D and S random features:

* ``numpy/rfa``, ``numpy/rfa-causal``, ``numpy/softmax`` (xattn on NumPy);
* ``torch/rfa``, ``torch/rfa-causal``, ``torch/softmax`` (xattn on PyTorch CPU);
* ``torch/performer``, ``torch/performer-causal``: performer-pytorch's ``FastAttention``
  with the same N, D and number of features (only if ``performer_pytorch`` is importable:
  install it in a separate benchmark environment, never in the test environment)::

    python -m venv .venv-bench && . .venv-bench/bin/activate
    pip install -c constraints.txt torch==2.13.0 performer-pytorch matplotlib -e .
    python benchmarks/ops/bench_rfa.py            # or --quick, or --lengths 1024 4096

Both estimators use a fixed sample matrix (xattn gets ``omega=``; FastAttention keeps its
projection buffer), D^-1/2 score scaling, one batch-head, torch under ``no_grad``.

Time: best of ``--repeats`` rounds after one warm-up call (``time.perf_counter``); each
round calls every method once, interleaved, so load changes hit all methods alike.
Peak memory, above what the inputs and the imports already hold (the measurement helpers
of ``xattn bench``, :mod:`xattn.cli.measure`, and ``benchmarks/_common.py``):

* NumPy: :mod:`tracemalloc` peak during one call (NumPy reports its buffers to it);
* torch CPU: a fresh subprocess per (method, N) builds the inputs, resets the kernel's
  peak-RSS mark (``/proc/self/clear_refs``, Linux), runs one call and reports
  ``VmHWM - VmRSS`` (peak resident memory during the call minus resident memory before
  it). This counts every page the call touched (allocator caching included); resolution
  is a page, noise a few MB. Where ``/proc`` is missing the figure is not available.

Threads: the machine this was written for is small and shared, so every library runs
single-threaded by default (``XATTN_BENCH_THREADS``, default 1, sets OMP/OpenBLAS/MKL
threads and ``torch.set_num_threads``); oversubscribed BLAS thread pools make timings
meaningless.

Exact softmax is measured only up to ``--softmax-max-length`` (default 16384 keys), since
it is O(N^2) in time, and performer-pytorch's causal mode (its CPU fallback materializes
N x S x Dv prefix sums) up to ``--performer-causal-max-length`` (default 8192).
Results: ``<out>.json`` and ``<out>.png`` (default ``benchmarks/results/bench_rfa``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

THREADS = os.environ.get("XATTN_BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)  # before NumPy loads its BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import interleaved_best_times, loglog_slope, rss_peak  # noqa: E402

from xattn.cli.figures import loglog_axes, new_figure  # noqa: E402
from xattn.cli.measure import tracemalloc_peak  # noqa: E402

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (1024, 2048, 4096)
METHODS = ("numpy/rfa", "numpy/rfa-causal", "numpy/softmax",
           "torch/rfa", "torch/rfa-causal", "torch/softmax",
           "torch/performer", "torch/performer-causal")


def have_performer() -> bool:
    try:
        import performer_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def make_call(method: str, length: int, args: argparse.Namespace):
    """A zero-argument callable computing ``method`` at sequence length ``length``."""
    import torch

    import xattn
    from xattn.features import sample_omega

    backend, name = method.split("/")
    rng = np.random.default_rng(0)
    shape = (1, length, args.head_dim)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    omega = sample_omega(1, args.num_features, args.head_dim, xp=np, dtype=np.float32)
    causal = name.endswith("-causal")
    if backend == "numpy":
        if name == "softmax":
            return lambda: xattn.softmax_attention(q, k, v)
        return lambda: xattn.rfa(q, k, v, omega=omega, causal=causal,
                                 block_size=args.block_size)
    torch.set_num_threads(int(THREADS))
    tq, tk, tv, tomega = map(torch.from_numpy, (q, k, v, omega))
    if name == "softmax":
        call = lambda: xattn.softmax_attention(tq, tk, tv)  # noqa: E731
    elif name.startswith("rfa"):
        call = lambda: xattn.rfa(tq, tk, tv, omega=tomega, causal=causal,  # noqa: E731
                                 block_size=args.block_size)
    else:
        from performer_pytorch import FastAttention

        attention = FastAttention(dim_heads=args.head_dim, nb_features=args.num_features,
                                  causal=causal)
        hq, hk, hv = (t[:, None] for t in (tq, tk, tv))  # (batch, heads, N, D)
        call = lambda: attention(hq, hk, hv)  # noqa: E731

    def no_grad_call():
        with torch.no_grad():
            return call()

    return no_grad_call


def memory_worker(method: str, length: int, args: argparse.Namespace) -> None:
    """Subprocess entry: one call in a fresh process, print its peak resident growth."""
    call = make_call(method, length, args)
    _, peak = rss_peak(call)
    print(json.dumps({"peak_bytes": peak}))


def peak_memory(method: str, length: int, args: argparse.Namespace) -> tuple[int, str]:
    if method.startswith("numpy/"):
        call = make_call(method, length, args)
        call()
        return tracemalloc_peak(call)[1], "tracemalloc"
    command = [sys.executable, __file__, "--_memory-worker", method, str(length),
               "--head-dim", str(args.head_dim), "--num-features", str(args.num_features),
               "--block-size", str(args.block_size)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]
    return (0, "unavailable") if peak is None else (peak, "rss_high_water_subprocess")


def summarize(results: list[dict]) -> dict:
    by_method: dict[str, dict[int, dict]] = {}
    for row in results:
        by_method.setdefault(row["method"], {})[row["length"]] = row
    summary: dict = {"time_loglog_slope_from_4096": {}}
    for method, rows in by_method.items():
        lengths = sorted(n for n in rows if n >= 4096)
        slope = loglog_slope(lengths, [rows[n]["time_s"] for n in lengths])
        summary["time_loglog_slope_from_4096"][method] = slope
    if "torch/performer" in by_method:
        for ours, theirs in (("torch/rfa", "torch/performer"),
                             ("torch/rfa-causal", "torch/performer-causal")):
            summary[f"time_ratio_{ours}_over_{theirs}"] = {
                n: by_method[ours][n]["time_s"] / by_method[theirs][n]["time_s"]
                for n in sorted(by_method.get(ours, {})) if n in by_method.get(theirs, {})
            }
    for backend in ("numpy", "torch"):
        rfa, softmax = by_method.get(f"{backend}/rfa", {}), by_method.get(f"{backend}/softmax", {})
        summary[f"{backend}_rfa_faster_than_softmax"] = {
            n: rfa[n]["time_s"] < softmax[n]["time_s"] for n in sorted(softmax) if n in rfa
        }
    return summary


def plot(results: list[dict], path: Path, title: str) -> None:
    figure, (time_axis, memory_axis) = new_figure(ncols=2, width=6.0, height=4.5)
    for method in dict.fromkeys(row["method"] for row in results):
        rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["length"])
        lengths = [r["length"] for r in rows]
        style = "--" if method.startswith("numpy") else "-"
        time_axis.plot(lengths, [r["time_s"] for r in rows], style, marker="o", label=method)
        memory_axis.plot(lengths, [max(r["peak_bytes"], 1) / 2**20 for r in rows], style,
                         marker="o", label=method)
    loglog_axes(time_axis, "sequence length N (= M)", "time per call (s)")
    loglog_axes(memory_axis, "sequence length N (= M)", "peak memory (MiB)")
    time_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--quick", action="store_true",
                        help=f"lengths {QUICK_LENGTHS}, one repeat")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-features", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=128, help="rfa causal block size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--softmax-max-length", type=int, default=16384)
    parser.add_argument("--performer-causal-max-length", type=int, default=8192,
                        help="performer-pytorch's CPU causal path stores N x S x Dv")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "results" / "bench_rfa")
    parser.add_argument("--_memory-worker", nargs=2, metavar=("METHOD", "N"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._memory_worker:
        method, length = args._memory_worker
        memory_worker(method, int(length), args)
        return

    lengths = args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    repeats = 1 if args.quick else args.repeats
    methods = [m for m in args.methods if "performer" not in m or have_performer()]
    skipped = sorted(set(args.methods) - set(methods))
    if skipped:
        print(f"skipping {skipped}: performer_pytorch is not installed", file=sys.stderr)
    import torch

    torch.set_num_threads(int(THREADS))
    results = []
    for length in lengths:
        measured = [m for m in methods
                    if not ("softmax" in m and length > args.softmax_max_length)
                    and not (m == "torch/performer-causal"
                             and length > args.performer_causal_max_length)]
        seconds = interleaved_best_times({m: make_call(m, length, args) for m in measured},
                                         repeats)
        for method in measured:
            peak, how = (0, "skipped") if args.no_memory else peak_memory(method, length, args)
            results.append({"method": method, "length": length, "time_s": seconds[method],
                            "peak_bytes": peak, "memory_method": how})
            print(f"{method:24s} N={length:6d}  {seconds[method] * 1e3:10.2f} ms  "
                  f"{peak / 2**20:9.1f} MiB ({how})", flush=True)

    config = {"head_dim": args.head_dim, "num_features": args.num_features,
              "block_size": args.block_size, "batch_heads": 1, "dtype": "float32",
              "repeats": repeats, "softmax_max_length": args.softmax_max_length,
              "performer_causal_max_length": args.performer_causal_max_length,
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "numpy": np.__version__, "cpu_count": os.cpu_count(),
              "platform": platform.platform()}
    summary = summarize(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": config, "results": results, "summary": summary}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(results, args.out.with_suffix(".png"),
         f"rfa vs softmax vs performer-pytorch (D={args.head_dim}, S={args.num_features}, "
         "float32, CPU)")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
