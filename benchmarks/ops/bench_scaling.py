"""Scaling report: time and peak memory against N for softmax, rfa, lara and ra (issue 18).

One run measures, on NumPy and torch (CPU), float32, one batch-head, D = Dv = 64, N = M
from 1024 to 131072:

- time and peak memory of ``softmax_attention`` (up to N = 32768; its automatic choice:
  on torch ``scaled_dot_product_attention``, the fused kernel, and next to it xattn's
  portable loop as ``softmax (xattn)``), ``rfa`` (S = 256), ``lara`` (C = 64) and ``ra``
  (S = 1, up to N = 16384), and causal ``rfa`` (S = 256) and causal softmax next to the
  non-causal calls; softmax and ra stop at larger N once one of their calls took longer
  than ``--time-limit`` seconds;
- the crossover length against exact softmax (``xattn bench``'s rule; causal RFA against
  causal softmax), the time growth from N = 16384 to 131072 and the log-log slope;
- the fp32 GEMM peak of the same library on the same threads (a 2048 x 2048 x 2048
  matmul, and a GEMM of RFA's own shape, 1024 x 64 by 64 x 256), timed in the same rounds
  as RFA at the largest N, and the fraction of it that RFA reaches, counting RFA's FLOPs
  from its GEMMs: 2 (N + M) S D for the feature logits, 2 M S Dv for the key sums and
  2 N S Dv for the read-out;
- the LARA/RFA time ratio at N = 32768, C = S = 64, NumPy (default weighting);
- on JAX (CPU), the memory XLA plans for the jit-compiled call (``memory_analysis()``:
  temp + output bytes), without running it.

It uses ``xattn bench``'s machinery (:mod:`xattn.cli.measure`: backends, the first call
traced for peak memory, then timed calls; :func:`xattn.cli.bench.crossover_length`; the
estimator registry) and differs from the command in one respect: the calls at one length
run in interleaved rounds (one call of each estimator per round) and the best round
counts, since the machine is shared. Wall and CPU time (``time.process_time``) are both
recorded; on one thread the CPU time leaves out the time the process waited for a core.
Peak memory: tracemalloc on NumPy, ``torch.profiler`` (``profile_memory=True``, the CPU
allocator's peak) on torch, both above the level before the call, inputs excluded.

Writes ``benchmarks/results/scaling_results.json`` and ``benchmarks/results/scaling_results.png``::

    nice -n 5 python benchmarks/ops/bench_scaling.py            # about 4 minutes here
    python benchmarks/ops/bench_scaling.py --quick              # a smoke run, seconds

``BENCH_THREADS`` (default 1) sets the BLAS / OpenMP / torch threads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

THREADS = os.environ.get("BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import interleaved_best_wall_and_cpu_times, loglog_slope  # noqa: E402

import xattn  # noqa: E402
from xattn.cli.bench import crossover_length  # noqa: E402
from xattn.cli.common import environment, write_json  # noqa: E402
from xattn.cli.figures import loglog_axes, new_figure, save_figure  # noqa: E402
from xattn.cli.measure import Measurement, load_backend, measured  # noqa: E402
from xattn.cli.memory import rfa_bytes  # noqa: E402
from xattn.cli.registry import (  # noqa: E402
    ESTIMATOR_SPECS,
    PORTABLE_SOFTMAX,
    SOFTMAX,
    EstimatorSpec,
)

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
DIM = 64
SAMPLES = {"rfa": 256, "rfa-causal": 256, "lara": 64, "ra": 1}
MAX_LENGTH = {"softmax": 32768, "softmax (xattn)": 32768, "softmax-causal": 32768,
              "ra": 16384}
RFA_CAUSAL = EstimatorSpec("rfa-causal", "num_features", lambda: xattn.rfa,
                           memory=rfa_bytes, options={"causal": True})
SOFTMAX_CAUSAL = EstimatorSpec("softmax-causal", None, lambda: xattn.softmax_attention,
                               options={"causal": True})
GEMM_SIZE = 2048
CHUNK = 1024  # the estimators' default chunk_size


def rfa_flops(num_queries: int, num_keys: int, samples: int, dim: int, value_dim: int) -> int:
    """FLOPs of RFA's GEMMs: feature logits of queries and keys, key sums, read-out."""
    return (2 * (num_queries + num_keys) * samples * dim + 2 * num_keys * samples * value_dim
            + 2 * num_queries * samples * value_dim)


def cpu_clocked(function, sink: list[float]):
    """``function`` that appends the process CPU time of each call to ``sink``."""

    def call(*args, **kwargs):
        start = time.process_time()
        out = function(*args, **kwargs)
        sink.append(time.process_time() - start)
        return out

    return call


def gemm_calls(backend) -> dict[str, tuple]:
    """Square GEMM (the peak) and one GEMM of RFA's shape (a chunk of 1024 queries or keys
    against the (D, S) samples), as (call, flops)."""
    draw = np.random.default_rng(1)
    a, b = (backend.to_backend(draw.normal(size=(GEMM_SIZE, GEMM_SIZE))) for _ in range(2))
    x = backend.to_backend(draw.normal(size=(CHUNK, DIM)))
    w = backend.to_backend(draw.normal(size=(DIM, SAMPLES["rfa"])))
    return {"gemm-square": (lambda: backend.sync(a @ b), 2 * GEMM_SIZE**3),
            "gemm-rfa-shape": (lambda: backend.sync(x @ w), 2 * CHUNK * DIM * SAMPLES["rfa"])}


def source_state() -> dict:
    """The commit measured and the source files that differed from it (shared checkout)."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD"),
            "modified_sources": git("diff", "--name-only", "HEAD", "--", "src").split()}


def measure_backend(name: str, lengths, repeats: int, causal_repeats: int,
                    time_limit: float, seed: int) -> dict:
    backend = load_backend(name, "cpu", "float32")
    if name == "torch":
        import torch

        torch.set_num_threads(int(THREADS))
    # softmax: the automatic choice (torch: the fused kernel, SDPA), the baseline; on
    # torch also xattn's portable loop, for comparison
    specs = [SOFTMAX, *([PORTABLE_SOFTMAX] if name == "torch" else []), ESTIMATOR_SPECS["rfa"],
             ESTIMATOR_SPECS["lara"], ESTIMATOR_SPECS["ra"], SOFTMAX_CAUSAL, RFA_CAUSAL]
    functions = {spec.name: spec.load() for spec in specs}
    results = {spec.name: [] for spec in specs}
    too_slow: set[str] = set()
    gemm = {}
    host = np.random.default_rng(seed)
    print(f"{backend.describe()}: {backend.memory_method}", flush=True)
    for length in lengths:
        q, k, v = (backend.to_backend(host.normal(size=(1, length, DIM))) for _ in range(3))
        runs = {}
        for spec in specs:
            if spec.name in too_slow or length > MAX_LENGTH.get(spec.name, length):
                reason = ("a call took over the time limit at a shorter length"
                          if spec.name in too_slow else "not run at this length")
                results[spec.name].append({"length": length, "skipped": reason})
                continue
            options = dict(spec.options)
            if spec.sample_keyword is not None:
                options[spec.sample_keyword] = SAMPLES[spec.name]
                options["rng"] = seed
            measurement, cpu_times = Measurement(), []
            call = measured(cpu_clocked(functions[spec.name], cpu_times), backend,
                            measurement)
            rounds = causal_repeats if spec.name.endswith("-causal") else repeats
            runs[spec.name] = (lambda call=call, options=options, arrays=(q, k, v):
                               call(*arrays, **options), measurement, cpu_times, rounds)
        extra = gemm_calls(backend) if length == max(lengths) else {}
        gemm_best = {key: [np.inf, np.inf] for key in extra}
        load = os.getloadavg()
        for run, *_ in runs.values():
            run()  # warm-up, traced for peak memory
        for call, _ in extra.values():
            call()
        for round_index in range(repeats):
            for run, _, _, rounds in runs.values():
                if round_index < rounds:
                    run()
            for key, (call, _) in extra.items():
                wall, cpu = time.perf_counter(), time.process_time()
                call()
                gemm_best[key] = [min(gemm_best[key][0], time.perf_counter() - wall),
                                  min(gemm_best[key][1], time.process_time() - cpu)]
        for spec_name, (_, measurement, cpu_times, _) in runs.items():
            row = {"length": length, "samples": SAMPLES.get(spec_name),
                   "time_s": min(measurement.times), "cpu_s": min(cpu_times[1:]),
                   "first_call_s": measurement.first_time, "rounds": len(measurement.times),
                   "peak_memory_bytes": measurement.peak_memory_bytes,
                   "load_average_1min": load[0]}
            results[spec_name].append(row)
            if spec.name in MAX_LENGTH and max(measurement.first_time,
                                               row["time_s"]) > time_limit:
                too_slow.add(spec_name)
            print(f"  N={length:6d} {spec_name:15s} {1e3 * row['time_s']:10.1f} ms wall "
                  f"{1e3 * row['cpu_s']:10.1f} ms cpu  peak "
                  f"{(row['peak_memory_bytes'] or 0) / 2**20:7.1f} MiB  load {load[0]:.1f}",
                  flush=True)
        for key, (_, flops) in extra.items():
            gemm[key] = {"length": length, "flops": flops, "time_s": gemm_best[key][0],
                         "cpu_s": gemm_best[key][1],
                         "gflops_wall": flops / gemm_best[key][0] / 1e9,
                         "gflops_cpu": flops / gemm_best[key][1] / 1e9}
            print(f"  {key}: {gemm[key]['gflops_wall']:.1f} GFLOP/s wall, "
                  f"{gemm[key]['gflops_cpu']:.1f} cpu", flush=True)
        del q, k, v, runs, extra
    return {"environment": environment(backend), "peak_memory_method": backend.memory_method,
            "results": results, "gemm": gemm, **summary(results, gemm, lengths)}


def timed(rows, key="time_s"):
    return {row["length"]: row[key] for row in rows if row.get(key) is not None}


def summary(results: dict, gemm: dict, lengths) -> dict:
    names = [name for name in results if not name.startswith("softmax")]

    def reference(name: str) -> str:  # causal estimators against causal softmax
        return "softmax-causal" if name.endswith("-causal") else "softmax"

    def clocked(name: str, clock: str) -> list[dict]:
        return [{"length": row["length"], "time_s": row.get(clock)} for row in results[name]]

    out = {"crossover_length": {name: crossover_length(clocked(reference(name), "time_s"),
                                                       clocked(name, "time_s"))
                                for name in names},
           "crossover_length_cpu": {name: crossover_length(clocked(reference(name), "cpu_s"),
                                                           clocked(name, "cpu_s"))
                                    for name in names},
           "crossover_reference": {name: reference(name) for name in names},
           "loglog_slope": {}, "growth_16k_to_128k": {}}
    for name, rows in results.items():
        wall, cpu = timed(rows), timed(rows, "cpu_s")
        out["loglog_slope"][name] = loglog_slope(list(wall), list(wall.values()))
        if 16384 in wall and 131072 in wall:
            out["growth_16k_to_128k"][name] = {"wall": wall[131072] / wall[16384],
                                               "cpu": cpu[131072] / cpu[16384]}
    largest = max(lengths)
    rfa = timed(results["rfa"]), timed(results["rfa"], "cpu_s")
    if largest in rfa[0] and "gemm-square" in gemm:
        flops = rfa_flops(largest, largest, SAMPLES["rfa"], DIM, DIM)
        out["rfa_gemm_fraction"] = {
            "length": largest, "rfa_flops": flops,
            "rfa_gflops_wall": flops / rfa[0][largest] / 1e9,
            "rfa_gflops_cpu": flops / rfa[1][largest] / 1e9,
            "of_square_gemm_peak_wall": flops / rfa[0][largest] / 1e9
            / gemm["gemm-square"]["gflops_wall"],
            "of_square_gemm_peak_cpu": flops / rfa[1][largest] / 1e9
            / gemm["gemm-square"]["gflops_cpu"],
            "of_rfa_shape_gemm_cpu": flops / rfa[1][largest] / 1e9
            / gemm["gemm-rfa-shape"]["gflops_cpu"]}
    if "rfa-causal" in results:
        causal, plain = timed(results["rfa-causal"]), timed(results["rfa"])
        causal_cpu, plain_cpu = timed(results["rfa-causal"], "cpu_s"), timed(
            results["rfa"], "cpu_s")
        out["causal_over_noncausal_rfa"] = {
            str(n): {"wall": causal[n] / plain[n], "cpu": causal_cpu[n] / plain_cpu[n]}
            for n in causal if n in plain}
    return out


def jax_compiled_memory(lengths) -> dict:
    """Temp + output bytes of the XLA program jit-compiled for each call (JAX on the CPU,
    ``memory_analysis()``, no run): what XLA plans to hold at once."""
    backend = load_backend("jax", "cpu", "float32")
    specs = {"softmax": (SOFTMAX, {}), "rfa": (ESTIMATOR_SPECS["rfa"], {}),
             "lara": (ESTIMATOR_SPECS["lara"], {})}
    rows = {name: [] for name in specs}
    for length in lengths:
        arrays = tuple(backend.to_backend(np.random.default_rng(index).normal(
            size=(1, length, DIM))) for index in range(3))
        for name, (spec, options) in specs.items():
            if name == "softmax" and length > 16384:  # XLA plans all N x M scores
                continue
            if spec.sample_keyword is not None:
                options = {**options, spec.sample_keyword: SAMPLES[name], "rng": 0}
            start = time.perf_counter()
            peak = backend.compiled_peak(spec.load(), arrays, options)
            rows[name].append({"length": length, "peak_memory_bytes": peak,
                               "compile_s": time.perf_counter() - start})
            print(f"  jax N={length:6d} {name:8s} {(peak or 0) / 2**20:8.1f} MiB (compiled)",
                  flush=True)
    return {"environment": environment(backend), "peak_memory_method":
            backend.memory_method, "results": rows}


def lara_rfa_ratio(length: int, repeats: int) -> dict:
    """LARA (default decoupled weighting) over RFA at C = S = 64, NumPy, interleaved."""
    draw = np.random.default_rng(0)
    q, k, v = (draw.normal(size=(1, length, DIM)).astype(np.float32) for _ in range(3))
    calls = {"lara": lambda: xattn.lara(q, k, v, num_samples=64, rng=0),
             "rfa": lambda: xattn.rfa(q, k, v, num_features=64, rng=0)}
    best = interleaved_best_wall_and_cpu_times(calls, repeats)
    ratio = {clock: best["lara"][clock] / best["rfa"][clock] for clock in ("wall_s", "cpu_s")}
    print(f"LARA/RFA at N = {length}, C = S = 64, NumPy: wall {ratio['wall_s']:.2f}, "
          f"cpu {ratio['cpu_s']:.2f}", flush=True)
    return {"length": length, "samples": 64, "repeats": repeats, "times": best,
            "ratio": ratio, "load_average": list(os.getloadavg())}


def plot(path: Path, report: dict) -> None:
    figure, (time_axes, memory_axes, causal_axes) = new_figure(ncols=3, width=5.2)
    for style, backend in (("-", "numpy"), ("--", "torch")):
        results = report["backends"].get(backend, {}).get("results", {})
        for index, (name, rows) in enumerate(results.items()):
            if name.endswith("-causal"):
                continue
            wall = timed(rows, "cpu_s")
            label = f"{name} ({backend})"
            if wall:
                time_axes.plot(list(wall), list(wall.values()), style, marker="o",
                               color=f"C{index}", label=label, markersize=3)
            memory = {row["length"]: row["peak_memory_bytes"] / 2**20 for row in rows
                      if row.get("peak_memory_bytes")}
            if memory:
                memory_axes.plot(list(memory), list(memory.values()), style, marker="o",
                                 color=f"C{index}", label=label, markersize=3)
    lengths = report["shape"]["N=M"]
    memory_axes.plot(lengths, [2 * n * DIM * 4 / 2**20 for n in lengths], ":", color="black",
                     label="2 x output")
    for style, backend in (("-", "numpy"), ("--", "torch")):
        results = report["backends"].get(backend, {}).get("results", {})
        for index, name in enumerate(("rfa", "rfa-causal", "softmax-causal")):
            cpu = timed(results.get(name, []), "cpu_s")
            if cpu:
                causal_axes.plot(list(cpu), list(cpu.values()), style, marker="o",
                                 color=f"C{index + 5}", label=f"{name} ({backend})",
                                 markersize=3)
    loglog_axes(time_axes, "N = M", "best CPU time per call [s]")
    loglog_axes(memory_axes, "N = M", "peak memory of one call [MiB]")
    loglog_axes(causal_axes, "N = M", "best CPU time per call [s]")
    time_axes.set_title("time (solid: NumPy, dashed: torch)", fontsize="small")
    memory_axes.set_title("tracemalloc (NumPy), torch.profiler (torch)", fontsize="small")
    causal_axes.set_title("causal RFA and softmax", fontsize="small")
    for axes in (time_axes, memory_axes, causal_axes):
        axes.legend(fontsize="x-small")
    save_figure(figure, path)


def _cell(value, scale=1e3, digits=1):
    return "–" if value is None else f"{scale * value:,.{digits}f}"


def markdown_tables(report: dict) -> str:
    """The report's tables in Markdown (for the scaling page of the guide)."""
    lines = []
    backends = report["backends"]
    for backend, data in backends.items():
        names = list(data["results"])
        lines += [f"**{backend}**, best CPU time (wall time) per call in ms:", "",
                  "| N | " + " | ".join(f"`{name}`" for name in names) + " |",
                  "|---:|" + "---:|" * len(names)]
        for index, length in enumerate(report["shape"]["N=M"]):
            cells = []
            for name in names:
                row = data["results"][name][index]
                cells.append("–" if row.get("time_s") is None else
                             f"{_cell(row['cpu_s'])} ({_cell(row['time_s'])})")
            lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Peak memory of one call in MiB (NumPy: tracemalloc; torch: torch.profiler):",
              "", "| N | " + " | ".join(f"`{name}` {backend}" for backend, data in
                                     backends.items() for name in data["results"]) + " |",
              "|---:|" + "---:|" * sum(len(data["results"]) for data in backends.values())]
    for index, length in enumerate(report["shape"]["N=M"]):
        cells = [_cell(data["results"][name][index].get("peak_memory_bytes"), 2**-20)
                 for data in backends.values() for name in data["results"]]
        lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
    lines += ["", "| backend | estimator | crossover N (wall / CPU) | growth 16k to 128k "
              "(wall / CPU) | log-log slope (wall) |", "|---|---|---|---|---|"]
    for backend, data in backends.items():
        for name in data["results"]:
            growth = data["growth_16k_to_128k"].get(name)
            cross = " / ".join(str(data[key][name] or "never") for key in (
                "crossover_length", "crossover_length_cpu")) if not name.startswith(
                    "softmax") else ""
            lines.append(f"| {backend} | `{name}` | {cross} | " + (
                f"{growth['wall']:.2f} / {growth['cpu']:.2f}" if growth else "") +
                f" | {data['loglog_slope'][name]:.2f} |")
    lines += ["", "| backend | square GEMM GFLOP/s (wall / CPU) | RFA-shape GEMM GFLOP/s "
              "(CPU) | RFA GFLOP/s at the largest N (wall / CPU) | fraction of the square "
              "peak (wall / CPU) |", "|---|---|---|---|---|"]
    for backend, data in backends.items():
        gemm, fraction = data["gemm"].get("gemm-square"), data.get("rfa_gemm_fraction")
        if gemm and fraction:
            lines.append(
                f"| {backend} | {gemm['gflops_wall']:.1f} / {gemm['gflops_cpu']:.1f} | "
                f"{data['gemm']['gemm-rfa-shape']['gflops_cpu']:.1f} | "
                f"{fraction['rfa_gflops_wall']:.1f} / {fraction['rfa_gflops_cpu']:.1f} | "
                f"{100 * fraction['of_square_gemm_peak_wall']:.0f} % / "
                f"{100 * fraction['of_square_gemm_peak_cpu']:.0f} % |")
    jax = report.get("jax_compiled_memory")
    if jax:
        lines += ["", "JAX (CPU), XLA memory_analysis() of the jit-compiled call, temp + output "
                  "in MiB:", ""]
        for name, rows in jax["results"].items():
            lines.append(f"- `{name}`: " + ", ".join(
                f"N = {row['length']:,}: {_cell(row['peak_memory_bytes'], 2**-20)}"
                for row in rows))
    ratio = report.get("lara_over_rfa")
    if ratio:
        lines += ["", f"LARA/RFA at N = {ratio['length']:,}, C = S = {ratio['samples']}: "
                  f"wall {ratio['ratio']['wall_s']:.2f}, CPU {ratio['ratio']['cpu_s']:.2f}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="numpy,torch")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--causal-repeats", type=int, default=2,
                        help="rounds that include causal RFA (its calls are the longest)")
    parser.add_argument("--time-limit", type=float, default=30.0, metavar="SECONDS",
                        help="softmax and ra stop at larger N once a call took longer")
    parser.add_argument("--ratio-length", type=int, default=32768)
    parser.add_argument("--ratio-repeats", type=int, default=7)
    parser.add_argument("--jax-lengths", default="16384,131072",
                        help="lengths of the JAX memory_analysis figures ('' skips them; "
                        "compiling at N = 131072 takes a minute or two)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results" / "scaling_results.json"))
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: N = 1024, 2048, one round, ratio at N = 4096")
    parser.add_argument("--tables", metavar="JSON",
                        help="print the Markdown tables of a finished run and exit")
    parser.add_argument("--replot", metavar="JSON",
                        help="redraw the PNG of a finished run (next to it) and exit")
    args = parser.parse_args()
    if args.tables:
        print(markdown_tables(json.loads(Path(args.tables).read_text())))
        return
    if args.replot:
        plot(Path(args.replot).with_suffix(".png"), json.loads(Path(args.replot).read_text()))
        return
    if args.quick:
        args.lengths, args.repeats, args.causal_repeats = "1024,2048", 1, 1
        args.ratio_length, args.ratio_repeats, args.jax_lengths = 4096, 1, "2048"
    lengths = sorted(int(item) for item in args.lengths.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report = {
        "description": __doc__.splitlines()[0],
        "command": "nice -n 5 python benchmarks/ops/bench_scaling.py" + (
            " --quick" if args.quick else ""),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                    "machine": platform.machine(), "threads": int(THREADS),
                    "nice": os.nice(0), "load_average_start": list(os.getloadavg()),
                    "shared": "a 2-core machine shared with other jobs (a training run and "
                              "other engineers' tests) during the run"},
        "source": source_state(),
        "shape": {"batch_heads": 1, "D": DIM, "Dv": DIM, "dtype": "float32", "N=M": lengths},
        "samples": SAMPLES, "max_length": MAX_LENGTH, "repeats": args.repeats,
        "causal_repeats": args.causal_repeats, "time_limit_s": args.time_limit,
        "timing": "best of the interleaved rounds (wall: perf_counter, cpu: process_time)",
        "rfa_flops": "2 (N + M) S D + 2 M S Dv + 2 N S Dv",
        "crossover_rule": "xattn.cli.bench.crossover_length: the smallest measured length "
                          "from which on the estimator beats softmax at every larger length "
                          "(softmax's last measured time bounds it beyond its largest N)",
        "backends": {},
    }
    report["lara_over_rfa"] = lara_rfa_ratio(args.ratio_length, args.ratio_repeats)
    for name in args.backends.split(","):
        report["backends"][name] = measure_backend(name, lengths, args.repeats,
                                                   args.causal_repeats, args.time_limit,
                                                   args.seed)
        write_json(out, report)  # what is finished survives an interrupted run
    if args.jax_lengths:
        report["jax_compiled_memory"] = jax_compiled_memory(
            [int(item) for item in args.jax_lengths.split(",")])
    report["machine"]["load_average_end"] = list(os.getloadavg())
    report["duration_s"] = time.time() - started
    write_json(out, report)
    plot(out.with_suffix(".png"), report)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
