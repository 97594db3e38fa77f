"""``xattn bench``: time and peak memory against sequence length, crossover with exact
softmax attention (the framework's fused kernel where it has one)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xattn.cli import common
from xattn.cli.common import CommandError
from xattn.cli.decode import (
    DECODE_SAMPLES,
    DEFAULT_POSITIONS,
    PREFILL_CHUNK,
    add_decode_options,
    bracket,
    rfa_decode_bytes,
    run_decode,
)
from xattn.cli.figures import loglog_axes, new_figure, save_figure
from xattn.cli.measure import Backend, Measurement, load_backend, measured
from xattn.cli.memory import Problem, format_size, require_memory, softmax_bytes
from xattn.cli.options import (
    add_common_options,
    int_list,
    nonnegative_float,
    positive_int,
)
from xattn.cli.registry import (
    ESTIMATOR_SPECS,
    PORTABLE_SOFTMAX,
    EstimatorSpec,
    native_softmax_spec,
)

__all__ = ["DEFAULT_ESTIMATORS", "DEFAULT_LENGTHS", "add_parser", "crossover_length",
           "fastest_rows", "run"]

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_ESTIMATORS = "rfa,ra,lara"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to ``subparsers``."""
    parser = subparsers.add_parser(
        "bench", help="time and peak memory vs sequence length",
        description="Time (median of --repeats calls after a warm-up call) and peak memory "
        "(of the warm-up call: tracemalloc for NumPy and Dask, torch.profiler with "
        "profile_memory for torch on the CPU, the CUDA allocator's peak for torch on CUDA, "
        "the XLA memory analysis (temp + output bytes) of the jit-compiled call for JAX, "
        "the memory-pool hook for CuPy; the table says which) of exact softmax and each "
        "estimator at each sequence length N = M, on standard normal inputs; report the "
        "crossover length from which each estimator is faster than exact softmax; write "
        "DIR/bench.png and DIR/bench.json. Exact softmax is always measured, by xattn's "
        "portable loop and, on torch and JAX (float32), by the framework's fused kernel "
        "(torch SDPA, jax.nn.dot_product_attention); the crossover is reported against "
        "each and against the faster of the two at each length. Lengths where the fused "
        "kernel's estimated memory exceeds what is available are skipped for it. Name only "
        "estimators in --estimators, each once.")
    add_common_options(parser, DEFAULT_ESTIMATORS)
    parser.add_argument("--lengths", type=int_list, default=None,
                        metavar="LIST", help="comma-separated sequence lengths (default: "
                        f"{DEFAULT_LENGTHS[0]},{DEFAULT_LENGTHS[1]},...,{DEFAULT_LENGTHS[-1]}); "
                        "with --decode, the positions")
    default_samples = ",".join(f"{name}={ESTIMATOR_SPECS[name].bench_samples}"
                               for name in DEFAULT_ESTIMATORS.split(","))
    parser.add_argument("--samples", default=None, metavar="SPEC",
                        help="samples per estimator: an int for all, name=int pairs (each "
                        "name once), or both (the int for the others); capped at N "
                        f"(default: {default_samples}); with --decode, one int: RFA's "
                        "features")
    parser.add_argument("--heads", type=positive_int, default=1,
                        help="number of heads (default: 1)")
    parser.add_argument("--head-dim", type=positive_int, default=64,
                        help="D = Dv (default: 64)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="timed calls after the warm-up call (default: 1)")
    parser.add_argument("--time-limit", type=nonnegative_float, default=60.0,
                        metavar="SECONDS",
                        help="stop running an estimator at larger lengths once one of its "
                        "calls took longer than this (0: no limit; default: 60)")
    parser.add_argument("--compile", action="store_true",
                        help="torch backends: also time each estimator compiled whole, "
                        "torch.compile(fullgraph=True) with inductor, one graph per length "
                        "(compiled in the warm-up call, whose time is not in the table), as "
                        "the row 'NAME (compiled)' beside the eager one and exact softmax by "
                        "the fused kernel")
    add_decode_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``xattn bench``."""
    if args.decode:
        return _run_decode(args)
    if args.lengths is None:
        args.lengths = list(DEFAULT_LENGTHS)
    if args.compile and args.backend != "torch":
        raise CommandError("--compile compiles with torch.compile: use --backend torch "
                           f"(got --backend {args.backend}; JAX's calls are jit-compiled "
                           "already)")
    out_dir = common.output_dir(args.out, ("bench.json", "bench.png"))  # before any work
    native = native_softmax_spec(args.backend, args.dtype)
    # the references: xattn's portable loop, and the framework's fused kernel where it has
    # one (what users of that framework already run)
    exact = [PORTABLE_SOFTMAX] if native is None else [PORTABLE_SOFTMAX, native]
    specs = [*exact, *(ESTIMATOR_SPECS[name] for name in args.estimators)]
    samples = _bench_samples(args.samples, specs)
    if args.compile:  # each estimator compiled, beside its eager row
        twins = [dataclasses.replace(spec, name=f"{spec.name} (compiled)",
                                     load=functools.partial(_compiled_loader, spec))
                 for spec in specs if spec not in exact]
        samples.update({twin.name: samples[twin.name[:-len(" (compiled)")]] for twin in twins})
        specs += twins
    functions = {spec.name: spec.load() for spec in specs}
    backend = load_backend(args.backend, args.device, args.dtype)
    lengths = sorted(set(args.lengths))
    too_large = _check_memory(specs, samples, lengths, args, backend, optional=native)
    host_rng = np.random.default_rng(args.seed)

    results: dict[str, list[dict[str, Any]]] = {spec.name: [] for spec in specs}
    too_slow: set[str] = set()
    print(f"xattn bench: {backend.describe()}, {args.dtype}, {args.heads} heads, "
          f"D = {args.head_dim}, lengths {', '.join(map(str, lengths))}")
    with common.progress_bar(len(specs) * len(lengths), "xattn bench", args.progress) as bar:
        for length in lengths:
            shape = (args.heads, length, args.head_dim)
            q, k, v = (backend.to_backend(host_rng.normal(size=shape)) for _ in range(3))
            for spec in specs:
                if (spec.name, length) in too_large:
                    results[spec.name].append({"length": length, "samples": None,
                                               "time_s": None, "peak_memory_bytes": None,
                                               "skipped": too_large[spec.name, length]})
                    common.advance(bar, f"{spec.name} N={length} skipped")
                    continue
                if spec.name in too_slow:
                    results[spec.name].append({"length": length, "samples": None,
                                               "time_s": None, "peak_memory_bytes": None,
                                               "skipped": f"a call took over --time-limit "
                                                          f"{args.time_limit:g} s at a "
                                                          "shorter length"})
                    common.advance(bar, f"{spec.name} N={length} skipped")
                    continue
                measurement = Measurement()
                call = measured(functions[spec.name], backend, measurement)
                options = dict(spec.options)
                used_samples = None
                if spec.sample_keyword is not None:
                    used_samples = min(samples[spec.name], length)  # LARA needs C <= N
                    options[spec.sample_keyword] = used_samples
                    options["rng"] = args.seed
                try:
                    for _ in range(1 + args.repeats):
                        call(q, k, v, **options)
                except ValueError as problem:
                    raise CommandError(f"{spec.name} at length {length}: {problem}") from None
                results[spec.name].append({"length": length, "samples": used_samples,
                                           "time_s": measurement.time_s,
                                           "peak_memory_bytes": measurement.peak_memory_bytes})
                assert measurement.first_time is not None  # the calls above set it
                if args.time_limit and max(measurement.first_time,
                                           measurement.time_s) > args.time_limit:
                    too_slow.add(spec.name)
                common.advance(bar, f"{spec.name} N={length}")
            del q, k, v

    estimators = [spec.name for spec in specs if spec not in exact]
    fastest = fastest_rows([results[spec.name] for spec in exact])
    crossover = {name: crossover_length(fastest, results[name]) for name in estimators}
    by_reference = {spec.name: {name: crossover_length(results[spec.name], results[name])
                                for name in estimators} for spec in exact}
    brackets = {name: bracket(results[name], crossover[name], "length")
                for name in estimators}
    _print_bench_table(results, lengths)
    for name in estimators:
        verdicts = [_verdict(brackets[name], "exact softmax (the faster implementation)")]
        if native is not None:
            verdicts += [_verdict(bracket(results[name], by_reference[spec.name][name],
                                          "length"), spec.name) for spec in exact]
        print(f"{name}: {'; '.join(verdicts)}")
    print(f"[MiB]: peak memory of the first call, from {backend.memory_method}")
    budget = common.environment(backend)["working_memory_bytes"]
    print(f"causal rfa and lara: blocks of at most {budget / 2**20:.0f} MiB of intermediates "
          f"(xattn.default_working_memory on {backend.device}; the whole sequence when it "
          f"fits)")
    payload = {
        "command": "bench",
        "environment": common.environment(backend),
        "dtype": args.dtype,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "seed": args.seed,
        "repeats": args.repeats,
        "compiled": bool(args.compile),
        "lengths": lengths,
        "time_limit_s": args.time_limit,
        "samples": {spec.name: samples.get(spec.name) for spec in specs},
        "results": results,
        "crossover_length": crossover,
        "crossover_bracket": brackets,
        "crossover_length_by_reference": by_reference,
        "peak_memory_method": backend.memory_method,
        "crossover_rule": "the smallest measured length from which on the estimator is "
                          "faster than exact softmax (crossover_length: the faster of the "
                          "exact rows at each length; crossover_length_by_reference: each "
                          "exact row) at every larger measured length "
                          "(where softmax was skipped as too slow, its last measured time "
                          "is the bound; a skipped estimator is not faster); null if it "
                          "never is; crossover_bracket: [the measured length before it "
                          "(null: it is the first), crossover_length]: the crossing lies "
                          "between the two, lengths between them were not measured",
    }
    json_path = out_dir / "bench.json"
    png_path = out_dir / "bench.png"
    common.write_json(json_path, payload)
    _plot_bench(png_path, results, crossover, backend)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _compiled_loader(spec: EstimatorSpec) -> Any:
    """``spec``'s estimator, compiled (:func:`_compiled`)."""
    return _compiled(spec.load())


def _compiled(function: Any) -> Any:
    """``function`` under ``torch.compile(fullgraph=True)`` (inductor), its options (the
    samples, an int seed) constants of the graph; dynamo's notes on the library's cached
    helpers silenced."""
    import warnings

    import torch

    # one graph per length (xattn's shapes are Python ints: dynamic shapes would make
    # them symbols, which its segment arithmetic does not take)
    compiled = torch.compile(function, fullgraph=True, dynamic=False)

    def call(*arrays: Any, **options: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return compiled(*arrays, **options)

    return call


def _run_decode(args: argparse.Namespace) -> int:
    """``xattn bench --decode`` (:mod:`xattn.cli.decode`), after the checks of its
    arguments and of the memory the largest position needs."""
    if args.samples is not None:
        try:
            args.samples = int(args.samples)
        except ValueError:
            args.samples = 0
        if args.samples < 1:
            raise CommandError("--samples: with --decode, one int >= 1 (RFA's features)")
    backend = load_backend(args.backend, args.device, args.dtype)
    positions = list(DEFAULT_POSITIONS) if args.lengths is None else args.lengths
    args.lengths = positions
    itemsize = 4 if args.dtype == "float32" else 8
    largest = max(positions)
    chunk = min(PREFILL_CHUNK, largest)
    # the key-value cache (and its copy as it grows) and one prefill piece against it
    cache = 2 * 2 * itemsize * args.heads * largest * args.head_dim
    piece = Problem(batch=args.heads, num_queries=chunk, num_keys=largest,
                    head_dim=args.head_dim, value_dim=args.head_dim, itemsize=itemsize)
    samples = DECODE_SAMPLES if args.samples is None else args.samples
    sizes = f"--samples {samples}, --heads {args.heads}, --head-dim {args.head_dim}"
    # the variants run one after the other: the largest of them must fit
    require_memory([
        (f"softmax's key-value cache at position {largest} (--lengths)",
         cache + piece.input_bytes + softmax_bytes(piece)),
        (f"rfa's state and prefill at position {largest} ({sizes})", rfa_decode_bytes(
            heads=args.heads, head_dim=args.head_dim, samples=samples, window=0, sinks=0,
            position=largest, itemsize=itemsize)),
        (f"rfa+window's state and prefill at position {largest} (--window {args.window}, "
         f"--sinks {args.sinks}, {sizes})", rfa_decode_bytes(
             heads=args.heads, head_dim=args.head_dim, samples=samples, window=args.window,
             sinks=args.sinks, position=largest, itemsize=itemsize)),
    ], backend.memory_available(), backend.describe())
    out_dir = common.output_dir(args.out, ("decode.json", "decode.png"))
    return run_decode(args, backend, out_dir, common.environment(backend))


def _check_memory(specs: list[EstimatorSpec], samples: dict[str, int], lengths: list[int],
                  args: argparse.Namespace, backend: Backend,
                  optional: EstimatorSpec | None) -> dict[tuple[str, int], str]:
    """Refuse up front the sizes whose estimated memory exceeds what is available; the
    ``optional`` row (the fused kernel, a baseline) is skipped at those lengths instead:
    returns ``{(name, length): why}`` of the skipped cells."""
    itemsize = 4 if args.dtype == "float32" else 8
    available = backend.memory_available()
    needs = []
    skipped = {}
    for length in lengths:
        problem = Problem(batch=args.heads, num_queries=length, num_keys=length,
                          head_dim=args.head_dim, value_dim=args.head_dim, itemsize=itemsize)
        host_draw = 8 * args.heads * length * args.head_dim  # one float64 input at a time
        fixed = problem.input_bytes + problem.output_bytes + host_draw
        for spec in specs:
            count = min(samples.get(spec.name, 1), length)
            label = f"{spec.name} at N = {length}" + (
                f" with {count} samples" if spec.sample_keyword else "")
            need = fixed + spec.memory(problem, count)
            if spec is optional and available is not None and need > available:
                skipped[spec.name, length] = (f"needs about {format_size(need)} (estimated), "
                                              f"more than the {format_size(available)} "
                                              "available")
            else:
                needs.append((label, need))
    require_memory(needs, available, backend.describe())
    return skipped


def _bench_samples(text: str | None, specs: list[EstimatorSpec]) -> dict[str, int]:
    """The samples of each sampled estimator: ``--samples`` is an int for all, name=int
    pairs, or both (the int then applies to the estimators not named). An estimator named
    twice, or two plain ints, is a CommandError: neither value would be clearly the one."""
    samples = {spec.name: spec.bench_samples for spec in specs if spec.sample_keyword}
    if text is None:
        return samples
    named: dict[str, int] = {}
    for_all: int | None = None
    for item in text.split(","):
        name, _, count = item.strip().rpartition("=")
        name = name.strip()
        try:
            value = int(count)
        except ValueError:
            value = 0
        if value < 1 or (name and name not in samples):
            raise CommandError(f"--samples: expected an int >= 1 or name=int pairs for "
                               f"{', '.join(samples)}, got {item.strip()!r}")
        if name in named:
            raise CommandError(f"--samples: {name} is given twice ({name}={named[name]} "
                               f"and {name}={value}); give each estimator once")
        if not name and for_all is not None:
            raise CommandError(f"--samples: two counts for all estimators ({for_all} and "
                               f"{value}); give one, or name=int pairs")
        if name:
            named[name] = value
        else:
            for_all = value
    return {name: named.get(name, default if for_all is None else for_all)
            for name, default in samples.items()}


def fastest_rows(reference_rows: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per length, the row of the faster reference (the shortest ``time_s``; rows skipped
    as too slow or too large, ``time_s`` None, count only where all are skipped).

    Examples
    --------
    >>> from xattn.cli.bench import fastest_rows
    >>> portable = [{"length": 1, "time_s": 2.0}, {"length": 2, "time_s": 3.0}]
    >>> native = [{"length": 1, "time_s": 1.0}, {"length": 2, "time_s": None}]
    >>> [row["time_s"] for row in fastest_rows([portable, native])]
    [1.0, 3.0]
    """
    def time_or_inf(row: dict[str, Any]) -> float:
        return math.inf if row["time_s"] is None else row["time_s"]

    return [min(rows, key=time_or_inf) for rows in zip(*reference_rows, strict=True)]


def crossover_length(softmax_rows: list[dict[str, Any]],
                     estimator_rows: list[dict[str, Any]]) -> int | None:
    """Smallest length from which on the estimator beats softmax at every larger length.

    Rows are sorted by length; ``time_s`` is ``None`` where a run was skipped for taking
    too long. A skipped estimator is not faster; where softmax was skipped, its last
    measured time (a lower bound, its cost grows with the length) is compared.

    Examples
    --------
    >>> from xattn.cli import crossover_length
    >>> exact = [{"length": n, "time_s": t} for n, t in [(1, 1.0), (2, 4.0), (4, 16.0)]]
    >>> linear = [{"length": n, "time_s": t} for n, t in [(1, 3.0), (2, 6.0), (4, 12.0)]]
    >>> crossover_length(exact, linear)
    4
    """
    faster = []
    softmax_bound = None
    for exact, row in zip(softmax_rows, estimator_rows, strict=True):
        if exact["time_s"] is not None:
            softmax_bound = exact["time_s"]
        faster.append(row["time_s"] is not None and softmax_bound is not None
                      and row["time_s"] < softmax_bound)
    crossover = None
    for index in range(len(faster) - 1, -1, -1):
        if not faster[index]:
            break
        crossover = estimator_rows[index]["length"]
    return crossover


def _verdict(span: list[int | None] | None, reference: str) -> str:
    """The sentence of a crossover :func:`~xattn.cli.decode.bracket`."""
    if span is None:
        return f"not faster than {reference} at the measured lengths"
    before, crossing = span
    if before is None:
        return f"faster than {reference} at every measured length ({crossing:,} on)"
    return (f"faster than {reference} from an N between {before:,} and {crossing:,} on "
            f"(slower at {before:,})")


def _print_bench_table(results: dict[str, list[dict[str, Any]]],
                       lengths: Sequence[int]) -> None:
    columns = [("length", ">7")]
    for name in results:
        header = f"{name} [ms]"
        columns += [(header, f">{max(13, len(header))}"), ("[MiB]", ">8")]
    rows = []
    for index, length in enumerate(lengths):
        cells = [str(length)]
        for name_rows in results.values():
            row = name_rows[index]
            cells += ["skipped" if row["time_s"] is None else f"{1e3 * row['time_s']:.2f}",
                      common.format_bytes(row["peak_memory_bytes"])]
        rows.append(cells)
    print(common.format_table(columns, rows, rule=False))


def _plot_bench(path: Path, results: dict[str, list[dict[str, Any]]],
                crossover: dict[str, int | None], backend: Backend) -> None:
    figure, (time_axes, memory_axes) = new_figure(ncols=2)
    for index, (name, rows) in enumerate(results.items()):
        color = f"C{index % 10}"
        label = name if name.startswith("softmax") else name.upper()
        timed = [(row["length"], row["time_s"]) for row in rows
                 if row["time_s"] is not None and row["time_s"] > 0]
        if timed:
            time_axes.plot(*zip(*timed, strict=True), marker="o", label=label, color=color)
        if crossover.get(name) is not None:
            time_axes.axvline(crossover[name], color=color, linestyle=":", alpha=0.6)
        memory = [(row["length"], row["peak_memory_bytes"] / 2**20) for row in rows
                  if row["peak_memory_bytes"]]  # None (no counter) and 0 are left out
        if memory:
            memory_axes.plot(*zip(*memory, strict=True), marker="o", label=label, color=color)
    for axes, ylabel in ((time_axes, "time [s]"), (memory_axes, "peak memory [MiB]")):
        loglog_axes(axes, "sequence length N = M", ylabel)
    time_axes.legend(title="dotted: crossover")
    time_axes.set_title(f"xattn bench: {backend.describe()}", fontsize="small")
    if memory_axes.lines:
        memory_axes.legend()
    else:
        memory_axes.text(0.5, 0.5, f"no peak-memory counter for {backend.name} on "
                         f"{backend.device}", ha="center", va="center",
                         transform=memory_axes.transAxes)
    save_figure(figure, path)
