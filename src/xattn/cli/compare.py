"""``xattn compare``: error of each estimator against exact softmax attention vs samples."""

from __future__ import annotations

import argparse
import inspect
import math
from pathlib import Path
from typing import Any

import numpy as np

import xattn
from xattn.cli.common import (
    CommandError,
    advance,
    environment,
    format_bytes,
    format_table,
    output_dir,
    progress_bar,
    write_json,
)
from xattn.cli.figures import new_figure, save_figure
from xattn.cli.inputs import load_inputs, validate_inputs
from xattn.cli.measure import Measurement, load_backend, measured
from xattn.cli.memory import Problem, host_memory_available, require_memory, softmax_bytes
from xattn.cli.options import (
    add_common_options,
    int_at_least,
    int_list,
    nonnegative_int,
    positive_int,
)
from xattn.cli.registry import ESTIMATOR_SPECS, EstimatorSpec, windowed_rfa_spec
from xattn.diagnostics import (
    EstimatorError,
    estimator_error,
    structured_attention_inputs,
    uniform_attention,
)

__all__ = ["DEFAULT_ESTIMATORS", "DEFAULT_REPEATS", "DEFAULT_SAMPLE_COUNTS", "MAX_DRAWS",
           "add_parser", "check_cells", "run"]

#: The numbers of samples ``--samples`` measures by default.
DEFAULT_SAMPLE_COUNTS = (16, 32, 64, 128, 256)
# Draws per cell: beyond this the run would take days (each draw is a full estimator
# call), while the figures' relative standard error, about sqrt(2 / draws), is already 0.1%.
MAX_DRAWS = 1_000_000
DEFAULT_ESTIMATORS = "rfa,ra,ra-biased,ra-det,lara,lara-det"
#: Timed calls per cell at least (``--repeats``), after the warm-up call.
DEFAULT_REPEATS = 5
# the default input's sizes, for the help: structured_attention_inputs' own defaults
_INPUT = {name: parameter.default for name, parameter
          in inspect.signature(structured_attention_inputs).parameters.items()}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``compare`` sub-command to ``subparsers``."""
    parser = subparsers.add_parser(
        "compare", help="MSE of the estimators against softmax attention vs samples",
        description="Run each estimator at each number of samples against exact softmax "
        "attention; print MSE, squared bias, variance, relative error (RMSE / RMS of the "
        "exact output), time and peak memory, with the uniform-attention baseline (every "
        "query gets the mean of the values); write DIR/compare.png (MSE vs samples) and "
        "DIR/compare.json (all figures). Without --input the data are deterministic "
        f"structured attention: {_INPUT['num_heads']} heads, N = M = {_INPUT['length']}, "
        f"D = Dv = {_INPUT['head_dim']}, queries and keys around {_INPUT['num_clusters']} "
        f"cluster centres of norm {_INPUT['radius']:g} (contiguous blocks of tokens, "
        f"{100 * _INPUT['shuffled_fraction']:g}%% shuffled), so attention is sharp "
        "(xattn.diagnostics.structured_attention_inputs). Draw r of "
        "every cell uses rng = SEED + r, as xattn.diagnostics.estimator_error(seed=SEED). "
        "Estimators: rfa, ra, lara (sampled), ra-biased (RA with biased=True), and the "
        "evaluation modes lara-det (LARA with deterministic=True, one draw per cell) and "
        "ra-det (biased, deterministic RA: the same for every sample count, one cell, a "
        "horizontal line in the plot). RA costs O(N M S D), so ra and ra-biased run only "
        "at sample counts <= --ra-max-samples. The memory a run needs is estimated "
        "first; sizes that do not fit are refused.")
    add_common_options(parser, DEFAULT_ESTIMATORS)
    parser.add_argument("--input", metavar="FILE.npz",
                        help="arrays q (..., N, D), k (..., M, D), v (..., M, Dv)")
    parser.add_argument("--samples", type=int_list, default=list(DEFAULT_SAMPLE_COUNTS),
                        metavar="LIST", help="comma-separated numbers of samples, each "
                        f"measured once (default: {','.join(map(str, DEFAULT_SAMPLE_COUNTS))})")
    parser.add_argument("--draws", default=4,
                        type=int_at_least(1, MAX_DRAWS, " (draws per cell: each is a full "
                                          "estimator call)"),
                        help="independent draws per (estimator, samples) cell, at most "
                        f"{MAX_DRAWS} (default: 4)")
    parser.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="R",
                        help="time each cell (and the uniform baseline and exact softmax) by "
                        "the median of at least R timed calls after a warm-up call: the "
                        "first draw, which also measures the peak memory, is not timed; the "
                        "other draws are, and further calls make up R (default: "
                        f"{DEFAULT_REPEATS})")
    parser.add_argument("--ra-max-samples", type=nonnegative_int, default=64, metavar="S",
                        help="run RA, whose cost is O(N M S D), only at sample counts "
                        "<= S; 0 runs every count (default: 64)")
    parser.add_argument("--window", type=nonnegative_int, default=None, metavar="W",
                        help="also run rfa+window: xattn.rfa(..., window=W, sinks=K), exact "
                        "on the keys |n - m| <= W and the first K keys, random features for "
                        "the others (next to plain rfa, which is added if not listed)")
    parser.add_argument("--sinks", type=nonnegative_int, default=0, metavar="K",
                        help="attention sinks of rfa+window: the first K keys computed "
                        "exactly (default: 0; alone, it also adds rfa+window)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``xattn compare``."""
    specs = [ESTIMATOR_SPECS[name] for name in args.estimators]
    if args.window is not None or args.sinks:  # rfa+window right after plain rfa
        rfa = ESTIMATOR_SPECS["rfa"]
        if rfa not in specs:
            specs.insert(0, rfa)
        specs.insert(specs.index(rfa) + 1, windowed_rfa_spec(args.window, args.sinks))
    functions = {spec.name: spec.load() for spec in specs}
    if args.input is None:
        q_host, k_host, v_host = validate_inputs(*structured_attention_inputs(), args.dtype,
                                                 "default inputs")
        heads, length, dim = q_host.shape
        source = (f"default: structured_attention_inputs() ({heads} heads, N = M = {length}, "
                  f"D = {dim})")
    else:
        source = str(args.input)
        q_host, k_host, v_host = load_inputs(args.input, args.dtype)

    cells, skipped = _plan(specs, args)
    check_cells(cells, functions, q_host, k_host, v_host, args.seed)
    out_dir = output_dir(args.out, ("compare.json", "compare.png"))  # before any work
    backend = load_backend(args.backend, args.device, args.dtype)
    problem = Problem(batch=math.prod(np.broadcast_shapes(q_host.shape[:-2], k_host.shape[:-2],
                                                       v_host.shape[:-2])),
                      num_queries=q_host.shape[-2], num_keys=k_host.shape[-2],
                      head_dim=q_host.shape[-1], value_dim=v_host.shape[-1],
                      itemsize=q_host.dtype.itemsize)
    fixed = problem.input_bytes + 3 * problem.output_bytes  # exact and the running sums
    needs = [("exact softmax attention", fixed + softmax_bytes(problem))]
    needs += [(f"{spec.name} with {samples} samples", fixed + spec.memory(problem, samples))
              for spec, samples in cells]
    require_memory(needs, backend.memory_available(), backend.describe())

    q, k, v = (backend.to_backend(a) for a in (q_host, k_host, v_host))
    exact_measurement = Measurement()
    exact_call = measured(xattn.softmax_attention, backend, exact_measurement)
    exact = exact_call(q, k, v)
    _time_more(exact_call, exact_measurement, args.repeats, q, k, v)
    if not bool(backend.namespace.all(backend.namespace.isfinite(exact))):
        raise CommandError(f"exact softmax attention is not finite in {args.dtype} on these "
                           "inputs; rescale them or use --dtype float64")
    baseline_measurement = Measurement()
    baseline_call = measured(uniform_attention, backend, baseline_measurement)
    baseline_error = estimator_error(lambda q, k, v: baseline_call(q, k, v), q, k, v, draws=1,
                                     rng_keyword=None, exact=exact)
    _time_more(baseline_call, baseline_measurement, args.repeats, q, k, v)

    rows: list[dict[str, Any]] = []
    print(f"xattn compare: {backend.describe()}, {args.dtype}, q {q_host.shape}, "
          f"k {k_host.shape}, v {v_host.shape}; {args.draws} draws per cell, seeds "
          f"{args.seed}..{args.seed + args.draws - 1} (one draw for deterministic modes); "
          f"time: median of at least {args.repeats} calls per cell after a warm-up call")
    total_runs = sum(max(_draws(spec, args), 1 + args.repeats) for spec, _ in cells)
    with progress_bar(total_runs, "xattn compare", args.progress) as bar:
        for spec, samples in cells:
            assert spec.sample_keyword is not None  # --estimators refuses softmax
            # passed on to the estimator through estimator_error's **options
            sample_option: dict[str, Any] = {spec.sample_keyword: samples}
            measurement = Measurement()
            timed = measured(functions[spec.name], backend, measurement)

            def draw(q: Any, k: Any, v: Any, *, rng: Any, _timed: Any = timed,
                     _label: str = f"{spec.name} S={samples}", **options: Any) -> Any:
                out = _timed(q, k, v, rng=rng, **options)
                advance(bar, _label)
                return out

            try:
                error = estimator_error(draw, q, k, v, draws=_draws(spec, args), seed=args.seed,
                                        exact=exact, **sample_option, **spec.options)
            except ValueError as problem_:
                raise CommandError(f"{spec.name} with {spec.sample_keyword}={samples}: "
                                   f"{problem_}") from None
            # the draws after the first were timed; more calls (the first draw's seed)
            # make up --repeats
            _time_more(draw, measurement, args.repeats, q, k, v, rng=args.seed,
                       **sample_option, **spec.options)
            rows.append(_row(spec, samples, error, measurement))

    baseline_row = _row(None, None, baseline_error, baseline_measurement)
    exact_row = {"estimator": "softmax", "samples": None, "mse": 0.0, "bias_squared": 0.0,
                 "variance": 0.0, "relative_error": 0.0,
                 "time_s": exact_measurement.time_s,
                 "timed_calls": len(exact_measurement.times),
                 "peak_memory_bytes": exact_measurement.peak_memory_bytes}
    _print_compare_table(rows, baseline_row, exact_row)
    print(f"time [ms]: {_time_rule(args.repeats)}")
    print(f"peak [MiB]: first call of each cell, from {backend.memory_method}")
    if skipped:
        cells_text = ", ".join(f"{cell['estimator']} S={cell['samples']}" for cell in skipped)
        print(f"note: skipped (cost O(N M S D)): {cells_text} "
              f"(--ra-max-samples {args.ra_max_samples}; 0 runs every count)")
    not_finite = [f"{row['estimator']} S={row['samples']}" for row in rows
                  if not math.isfinite(row["mse"])]
    if not_finite:
        print(f"note: non-finite outputs ({', '.join(not_finite)}): their figures are null "
              "in the JSON and left out of the plot")

    payload = {
        "command": "compare",
        "environment": environment(backend),
        "input": {"source": source, "q_shape": list(q_host.shape),
                  "k_shape": list(k_host.shape), "v_shape": list(v_host.shape),
                  "dtype": args.dtype},
        "seed": args.seed,
        "draws": args.draws,
        "seed_rule": "draw r (r = 0..draws-1) of every (estimator, samples) cell runs with "
                     "rng = seed + r (xattn.diagnostics.draw_seeds); deterministic modes "
                     "run one draw; each result gives its seeds as {first, last}",
        "samples": list(args.samples),
        "estimators": {spec.name: {"sample_keyword": spec.sample_keyword,
                                   "options": spec.options,
                                   "deterministic": spec.deterministic,
                                   "samples_matter": spec.samples_matter} for spec in specs},
        "ra_max_samples": args.ra_max_samples,
        "repeats": args.repeats,
        "time_rule": f"time_s: {_time_rule(args.repeats)}; timed_calls: how many",
        "results": rows,
        "skipped": skipped,
        "baseline": baseline_row,
        "exact": exact_row,
        "peak_memory_method": backend.memory_method,
    }
    json_path = out_dir / "compare.json"
    png_path = out_dir / "compare.png"
    write_json(json_path, payload)
    _plot_compare(png_path, rows, baseline_row, specs, source, skipped)
    print(f"wrote {json_path} and {png_path}")
    return 0


def check_cells(cells: list[tuple[EstimatorSpec, int]], functions: dict[str, Any],
                q: np.ndarray, k: np.ndarray, v: np.ndarray, seed: int) -> None:
    """Check every cell's options against the shapes of ``q``, ``k``, ``v`` before any
    work: each estimator validates one call on an empty batch of those shapes (its own
    checks; the call draws its samples, whose memory is checked first), so a sample
    count the inputs cannot take (LARA's C > N, say) is refused up front instead of
    after the cells before it ran.

    Raises
    ------
    CommandError
        One line naming the cell and the estimator's message.
    """
    empty = [np.zeros((0, *array.shape[-2:]), dtype=array.dtype) for array in (q, k, v)]
    nothing = Problem(0, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], q.dtype.itemsize)
    available = host_memory_available()
    for spec, samples in cells:
        assert spec.sample_keyword is not None  # --estimators refuses softmax
        # what the empty call itself holds (the samples it draws), against host memory
        require_memory([(f"{spec.name} with {samples} samples", spec.memory(nothing, samples))],
                       available, "this machine")
        try:
            functions[spec.name](*empty, rng=seed, **{spec.sample_keyword: samples},
                                 **spec.options)
        except (ValueError, TypeError) as problem:
            message = str(problem)
            for stand_in, array in zip(empty, (q, k, v), strict=True):  # the real shapes
                message = message.replace(str(stand_in.shape), str(array.shape))
            raise CommandError(f"{spec.name} with {spec.sample_keyword}={samples}: "
                               f"{message}") from None


def _plan(specs: list[EstimatorSpec], args: argparse.Namespace
          ) -> tuple[list[tuple[EstimatorSpec, int]], list[dict[str, Any]]]:
    """The (estimator, samples) cells to run and the ones skipped by --ra-max-samples."""
    cells, skipped = [], []
    for spec in specs:
        if not spec.samples_matter:  # every sample count gives the same result: one cell
            cells.append((spec, 1))
            continue
        for samples in args.samples:
            if spec.quadratic and args.ra_max_samples and samples > args.ra_max_samples:
                skipped.append({"estimator": spec.name, "samples": samples,
                                "reason": f"above --ra-max-samples {args.ra_max_samples}"})
            else:
                cells.append((spec, samples))
    return cells, skipped


def _time_rule(repeats: int) -> str:
    return (f"median of at least {repeats} timed calls (--repeats) per cell after a warm-up "
            "call: the first draw, which measures the peak memory, is not timed, the other "
            "draws are, and further calls with the first draw's seed make up the count")


def _time_more(call: Any, measurement: Measurement, repeats: int, *args: Any,
               **kwargs: Any) -> None:
    """Call ``call`` (wrapped by :func:`~xattn.cli.measure.measured`) until
    ``measurement`` holds ``repeats`` timed calls."""
    while len(measurement.times) < repeats:
        call(*args, **kwargs)


def _draws(spec: EstimatorSpec, args: argparse.Namespace) -> int:
    return 1 if spec.deterministic else args.draws


def _row(spec: EstimatorSpec | None, samples: int | None, error: EstimatorError,
         measurement: Measurement) -> dict[str, Any]:
    return {"estimator": "uniform" if spec is None else spec.name,
            "samples": samples if spec is None or spec.samples_matter else None,
            **error.as_dict(),
            "time_s": measurement.time_s,
            "timed_calls": len(measurement.times),
            "peak_memory_bytes": measurement.peak_memory_bytes}


_COLUMNS = (("estimator", "<10"), ("samples", ">7"), ("MSE", ">10"), ("bias^2", ">10"),
            ("variance", ">10"), ("rel.err", ">9"), ("time [ms]", ">10"), ("peak [MiB]", ">10"))


def _samples_cell(row: dict[str, Any]) -> str:
    if row["samples"] is not None:
        return str(row["samples"])
    return "-" if row["estimator"] in ("uniform", "softmax") else "any"


def _print_compare_table(rows: list[dict[str, Any]], baseline: dict[str, Any],
                         exact: dict[str, Any]) -> None:
    print(format_table(_COLUMNS, ([
        row["estimator"], _samples_cell(row), f"{row['mse']:.3e}", f"{row['bias_squared']:.3e}",
        f"{row['variance']:.3e}", f"{row['relative_error']:.3f}", f"{1e3 * row['time_s']:.2f}",
        format_bytes(row["peak_memory_bytes"])] for row in [*rows, baseline, exact])))
    worse = sorted({row["estimator"] for row in rows if row["mse"] > baseline["mse"]})
    if worse:
        print(f"note: {', '.join(worse)} do worse than uniform attention (MSE "
              f"{baseline['mse']:.3e}) at some sample counts")


def _plottable(value: float) -> bool:
    return math.isfinite(value) and value > 0  # log scale: no NaN, inf, 0


def _plot_compare(path: Path, rows: list[dict[str, Any]], baseline: dict[str, Any],
                  specs: list[EstimatorSpec], source: str,
                  skipped: list[dict[str, Any]]) -> None:
    """MSE against samples on log axes; NaN, inf and 0 are left out. Where the figures
    span more than 60 decades (Matplotlib's log axis fails near the float limits), the
    y axis shows log10(MSE) on a linear scale instead."""
    plotted = [row["mse"] for row in [*rows, baseline] if _plottable(row["mse"])]
    wide = bool(plotted) and math.log10(max(plotted) / min(plotted)) > 60
    y = math.log10 if wide else float
    figure, axes = new_figure()
    samples_axis = sorted({row["samples"] for row in rows if row["samples"] is not None})
    for index, spec in enumerate(specs):
        color = f"C{index % 10}"  # Matplotlib's colour cycle
        spec_rows = [row for row in rows if row["estimator"] == spec.name]
        points = [(row["samples"], y(row["mse"])) for row in spec_rows
                  if _plottable(row["mse"])]
        label = spec.name.upper()
        if spec.name == "rfa+window":
            label += f" (window {spec.options['window']}, sinks {spec.options['sinks']})"
        if not spec.samples_matter:  # one figure for every sample count
            if points:
                axes.axhline(points[0][1], linestyle="-.", color=color,
                             label=f"{label} (deterministic, any samples)")
            continue
        if not points:
            continue
        if spec.deterministic:
            label += " (deterministic)"
        if any(cell["estimator"] == spec.name for cell in skipped):
            label += f" (samples <= {max(samples for samples, _ in points)})"
        style = {"marker": "s", "linestyle": ":"} if spec.deterministic else {"marker": "o"}
        axes.plot(*zip(*points, strict=True), label=label, color=color, **style)
    if _plottable(baseline["mse"]):
        axes.axhline(y(baseline["mse"]), color="0.4", linestyle="--", label="uniform attention")
    if len(samples_axis) > 1:
        axes.set_xscale("log", base=2)
    if plotted and wide:  # limits that include the horizontal lines (axhline does not scale)
        axes.set_ylim(y(min(plotted)) - 1, y(max(plotted)) + 1)
    elif plotted:
        axes.set_yscale("log")
        axes.set_ylim(min(plotted) / 1.5, max(plotted) * 1.5)
    axes.set_xlabel("number of samples")
    axes.set_ylabel(("log10 of the " if wide else "") + "MSE against softmax attention")
    axes.set_title(f"xattn compare: {Path(source).name if '/' in source else source}",
                   fontsize="small")
    axes.grid(True, which="both", alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    save_figure(figure, path)
