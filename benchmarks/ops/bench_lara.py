"""LARA against RFA at equal sample counts (C = S): time and peak memory over N.

For each backend (NumPy, torch CPU), each sample count C = S and each sequence length
N = M, times ``xattn.lara`` (defaults: segment proposals, decoupled weights) and
``xattn.rfa`` (defaults: positive map, orthogonal samples), and LARA with
``weighting="balance"`` (no per-query weights) on float32 inputs of one head
(D = Dv = 64), best of ``--repeats`` calls after a warm-up, and measures the peak memory a
call adds: the process's resident high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before each call, Linux), or NumPy's traced allocations where
that is unavailable. Writes JSON and a plot (time and time ratio against N)::

    python benchmarks/ops/bench_lara.py                       # N = 1k .. 64k, C = 64, 256
    python benchmarks/ops/bench_lara.py --quick               # N = 1k, 4k; one repeat
    python benchmarks/ops/bench_lara.py --lengths 1024,8192 --samples 64 --backends numpy
    python benchmarks/ops/bench_lara.py --weightings decoupled         # LARA's default only

Each library runs on one thread (``BENCH_THREADS`` to change). The machine's load
matters: on a shared machine, read ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import sys
from pathlib import Path

# One thread per library by default (BENCH_THREADS to change): on a small shared machine,
# multithreaded BLAS and torch pools make timings erratic. Set before NumPy loads.
THREADS = os.environ.get("BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import best_time, loglog_slope, rss_peak  # noqa: E402

import xattn  # noqa: E402
from xattn.cli.figures import loglog_axes, new_figure  # noqa: E402
from xattn.cli.measure import tracemalloc_peak  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def use_mmap_for_large_blocks() -> None:
    """Make glibc serve blocks >= 64 KiB by mmap and return them on free (it otherwise
    raises that threshold as blocks are freed and reuses heap pages, hiding later peaks
    from the resident high-water mark)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def peak_memory_mib(call) -> tuple[float, str]:
    """Memory a call adds at its peak, in MiB, and how it was measured."""
    _, peak = rss_peak(call)
    if peak is not None:
        return peak / 2**20, "rss-high-water"
    return tracemalloc_peak(call)[1] / 2**20, "tracemalloc"


def make_inputs(backend: str, length: int, head_dim: int, seed: int = 0):
    gen = np.random.default_rng(seed)
    arrays = [gen.standard_normal((length, head_dim), dtype=np.float32) for _ in range(3)]
    if backend == "torch":
        import torch

        torch.set_num_threads(int(THREADS))
        return [torch.from_numpy(a) for a in arrays]
    return arrays


def estimators(num_samples: int, weightings):
    chosen = {
        f"lara-{weighting}": lambda q, k, v, weighting=weighting: xattn.lara(
            q, k, v, num_samples=num_samples, weighting=weighting, rng=1)
        for weighting in weightings
    }
    chosen["rfa"] = lambda q, k, v: xattn.rfa(q, k, v, num_features=num_samples, rng=1)
    return chosen


def run(backends, samples, lengths, head_dim, repeats, weightings):
    rows = []
    for backend in backends:
        for num_samples in samples:
            for length in lengths:
                if num_samples > length:
                    continue
                inputs = make_inputs(backend, length, head_dim)
                for name, estimate in estimators(num_samples, weightings).items():
                    def call(estimate=estimate, inputs=inputs):
                        return estimate(*inputs)

                    seconds = best_time(call, repeats)
                    memory, method = peak_memory_mib(call)
                    rows.append(dict(backend=backend, estimator=name, num_samples=num_samples,
                                     length=length, seconds=seconds, peak_mib=memory,
                                     memory_method=method))
                    print(f"{backend:6s} {name:15s} C=S={num_samples:4d} N={length:6d} "
                          f"{seconds * 1e3:9.2f} ms  peak {memory:8.1f} MiB", flush=True)
                del inputs
    return rows


def summarize(rows):
    summary = []
    keys = sorted({(r["backend"], r["num_samples"], r["estimator"]) for r in rows
                   if r["estimator"] != "rfa"})
    for backend, num_samples, name in keys:
        def select(estimator, backend=backend, num_samples=num_samples):
            chosen = [r for r in rows if (r["backend"], r["num_samples"], r["estimator"])
                      == (backend, num_samples, estimator)]
            return sorted(chosen, key=lambda r: r["length"])
        lara_rows, rfa_rows = select(name), select("rfa")
        lengths = [r["length"] for r in lara_rows]
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(lara_rows, rfa_rows, strict=True)]
        entry = dict(backend=backend, num_samples=num_samples, estimator=name, lengths=lengths,
                     time_ratio_over_rfa=ratios,
                     memory_ratio_over_rfa=[
                         a["peak_mib"] / b["peak_mib"] if b["peak_mib"] > 0 else math.nan
                         for a, b in zip(lara_rows, rfa_rows, strict=True)])
        if len(lengths) >= 2:
            entry["log_log_slope"] = loglog_slope(lengths, [r["seconds"] for r in lara_rows])
            entry["log_log_slope_rfa"] = loglog_slope(lengths,
                                                      [r["seconds"] for r in rfa_rows])
        summary.append(entry)
    return summary


def plot(rows, summary, path: Path) -> None:
    fig, (time_axis, ratio_axis, memory_axis) = new_figure(ncols=3, width=5.3, height=4.5)
    curves = sorted({(r["backend"], r["num_samples"], r["estimator"]) for r in rows})
    for backend, num_samples, name in curves:
        chosen = sorted((r for r in rows if (r["backend"], r["num_samples"], r["estimator"])
                         == (backend, num_samples, name)), key=lambda r: r["length"])
        label = f"{name} {backend} C=S={num_samples}"
        style = "--" if name == "rfa" else "-"
        time_axis.loglog([r["length"] for r in chosen], [r["seconds"] for r in chosen],
                         style, marker="o", label=label)
        memory_axis.loglog([r["length"] for r in chosen], [r["peak_mib"] for r in chosen],
                           style, marker="o", label=label)
    for entry in summary:
        ratio_axis.semilogx(entry["lengths"], entry["time_ratio_over_rfa"], marker="o",
                            label=f"{entry['estimator']} {entry['backend']} "
                                  f"C=S={entry['num_samples']}")
    ratio_axis.axhline(1.2, color="gray", linestyle=":", label="target 1.2")
    loglog_axes(time_axis, "N = M", "seconds (best)", xbase=10)
    loglog_axes(memory_axis, "N = M", "MiB", xbase=10)
    time_axis.set_title("time")
    memory_axis.set_title("peak memory added by a call")
    ratio_axis.set(xlabel="N = M", ylabel="LARA time / RFA time", title="time ratio")
    ratio_axis.grid(True, which="both", alpha=0.3)
    for axis in (time_axis, ratio_axis, memory_axis):
        axis.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="numpy,torch")
    parser.add_argument("--samples", default="64,256", help="C = S values, comma-separated")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--weightings", default="decoupled,balance",
                        help="LARA weightings to time (decoupled is LARA's default)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="N = 1k, 4k and one repeat")
    parser.add_argument("--output", type=Path, default=RESULTS / "bench_lara")
    args = parser.parse_args(argv)
    use_mmap_for_large_blocks()
    lengths = [1024, 4096] if args.quick else [int(n) for n in args.lengths.split(",")]
    repeats = 1 if args.quick else args.repeats
    rows = run(args.backends.split(","), [int(c) for c in args.samples.split(",")], lengths,
               args.head_dim, repeats, args.weightings.split(","))
    summary = summarize(rows)
    for entry in summary:
        print(json.dumps(entry))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=platform.machine(), cpus=os.cpu_count(), numpy=np.__version__,
                threads=int(THREADS), load_average=os.getloadavg(),
                head_dim=args.head_dim, repeats=repeats, dtype="float32")
    with open(args.output.with_suffix(".json"), "w") as out:
        json.dump(dict(meta=meta, rows=rows, summary=summary), out, indent=1)
    plot(rows, summary, args.output.with_suffix(".png"))
    print(f"wrote {args.output.with_suffix('.json')} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
