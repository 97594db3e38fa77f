"""RA against exact softmax attention: time (forward, forward + backward) and peak memory.

Time: at the shape of the paper's Table 6 comparison, (batch, heads, N = M, D) =
(64, 2, 256, 32), float32, S = 1 sample, this times ``xattn.ra`` (unbiased and
``biased=True``) and ``xattn.softmax_attention``

- on NumPy: the forward pass;
- on torch (CPU): the forward pass, and forward plus backward (``out.square().sum()``
  differentiated with respect to q, k and v),

as the best of ``--repeats`` interleaved rounds, in wall-clock time and in CPU time of
this process (``time.process_time``; on a loaded shared machine the CPU time is the
steadier figure, as each library runs on one thread), and reports the ratios RA /
softmax. Memory: the peak that one NumPy call allocates (tracemalloc, inputs
excluded) for S = 64 samples at N = M = 512, 12 heads, D = 64, float32 (the case of the
issue on RA's memory), for a few ``chunk_size`` values.

Each library runs on one thread (``BENCH_THREADS`` to change); read ratios, not absolute
times, on a shared machine. Writes ``benchmarks/results/ra_results.json``::

    python benchmarks/ops/bench_ra.py                # about 3 minutes
    python benchmarks/ops/bench_ra.py --repeats 3 --no-memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

THREADS = os.environ.get("BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import interleaved_best_wall_and_cpu_times  # noqa: E402

import xattn  # noqa: E402
from xattn.cli.measure import tracemalloc_peak  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "ra_results.json"
TIME_SHAPE = (64, 2, 256, 32)  # batch, heads, N = M, D
MEMORY_SHAPE = (12, 512, 64)  # heads, N = M, D; S = 64
MEMORY_SAMPLES = 64


def estimators(**ra_options):
    return {
        "softmax": lambda q, k, v: xattn.softmax_attention(q, k, v),
        "ra": lambda q, k, v: xattn.ra(q, k, v, rng=0, **ra_options),
        "ra-biased": lambda q, k, v: xattn.ra(q, k, v, biased=True, rng=0, **ra_options),
    }


def time_numpy(repeats):
    gen = np.random.default_rng(0)
    q, k, v = (gen.normal(size=TIME_SHAPE).astype(np.float32) for _ in range(3))
    calls = {name: (lambda f=f: f(q, k, v)) for name, f in estimators().items()}
    return interleaved_best_wall_and_cpu_times(calls, repeats)


def time_torch(repeats):
    import torch

    torch.set_num_threads(int(THREADS))
    gen = np.random.default_rng(0)
    q, k, v = (torch.tensor(gen.normal(size=TIME_SHAPE), dtype=torch.float32,
                            requires_grad=True) for _ in range(3))

    def forward(function):
        with torch.no_grad():
            return function(q, k, v)

    def forward_backward(function):
        return torch.autograd.grad(function(q, k, v).square().sum(), (q, k, v))

    calls = {}
    for name, function in estimators().items():
        calls[f"{name}/forward"] = lambda f=function: forward(f)
        calls[f"{name}/forward+backward"] = lambda f=function: forward_backward(f)
    return interleaved_best_wall_and_cpu_times(calls, repeats)


def memory_numpy(chunk_sizes):
    heads, length, dim = MEMORY_SHAPE
    gen = np.random.default_rng(0)
    q, k, v = (gen.normal(size=(heads, length, dim)).astype(np.float32) for _ in range(3))
    peaks = {}
    for chunk_size in chunk_sizes:
        options = {} if chunk_size is None else {"chunk_size": chunk_size}
        _, peak = tracemalloc_peak(lambda options=options: xattn.ra(
            q, k, v, num_samples=MEMORY_SAMPLES, rng=0, **options))
        peaks["default" if chunk_size is None else str(chunk_size)] = peak
    return peaks


def ratios(times, reference):
    return {name: {clock: times[name][clock] / times[reference(name)][clock]
                   for clock in ("wall_s", "cpu_s")} for name in times}


def show(label, times, ratio):
    for name in times:
        print(f"{label:6s} {name:28s} wall {times[name]['wall_s']:.4f} s  cpu "
              f"{times[name]['cpu_s']:.4f} s   ratio to softmax: wall "
              f"{ratio[name]['wall_s']:.2f}  cpu {ratio[name]['cpu_s']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()

    result = {"description": __doc__.splitlines()[0], "threads": THREADS,
              "time_shape": {"batch": TIME_SHAPE[0], "heads": TIME_SHAPE[1],
                             "N": TIME_SHAPE[2], "D": TIME_SHAPE[3], "samples": 1,
                             "dtype": "float32"},
              "numpy": np.__version__, "python": platform.python_version(),
              "machine": platform.machine()}
    times = time_numpy(args.repeats)
    result["numpy_forward"] = times
    result["numpy_forward_ratio_to_softmax"] = ratios(times, lambda name: "softmax")
    show("numpy", times, result["numpy_forward_ratio_to_softmax"])
    if not args.no_torch:
        import torch

        times = time_torch(args.repeats)
        result["torch"] = times
        result["torch_version"] = torch.__version__
        result["torch_ratio_to_softmax"] = ratios(
            times, lambda name: "softmax/" + name.split("/", 1)[1])
        show("torch", times, result["torch_ratio_to_softmax"])
    if not args.no_memory:
        peaks = memory_numpy([None, 32, 128, 512])
        result["memory_shape"] = {"heads": MEMORY_SHAPE[0], "N": MEMORY_SHAPE[1],
                                  "D": MEMORY_SHAPE[2], "samples": MEMORY_SAMPLES,
                                  "dtype": "float32"}
        result["numpy_peak_MiB_by_chunk_size"] = {c: p / 2**20 for c, p in peaks.items()}
        print("NumPy peak MiB by chunk_size:",
              {c: round(p / 2**20, 1) for c, p in peaks.items()})
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
