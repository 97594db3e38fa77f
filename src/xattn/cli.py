"""The ``xattn`` command: ``xattn compare`` and ``xattn bench``.

``xattn compare`` measures how well each randomized estimator approximates exact softmax
attention (MSE, relative error, time, peak memory) as the number of samples grows, next
to the trivial uniform-attention baseline, and writes a table, a PNG and a JSON file.
``xattn bench`` measures time and peak memory against sequence length for every
estimator, exact softmax included, and reports where each linear-time estimator
overtakes exact softmax. Run ``xattn compare --help`` for the options.

This module is the application around the library: it may import array libraries
(lazily, only the chosen backend), synchronize devices for timing and read their memory
counters. Figures are drawn with Matplotlib's Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import platform
import statistics
import sys
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import xattn
from xattn._array import broadcast_shapes
from xattn._softmax import softmax_attention
from xattn.diagnostics import EstimatorError, estimator_error, uniform_attention

__all__ = ["ESTIMATORS", "EstimatorSpec", "main", "structured_attention_inputs"]

BACKENDS = ("numpy", "torch", "jax", "cupy", "dask")
DEFAULT_SAMPLES = (16, 32, 64, 128, 256)
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DEFAULT_OUT = "xattn-out"
EXIT_USAGE = 2


class CommandError(Exception):
    """A problem with the user's input: reported as one line on stderr, exit code 2."""


# --------------------------------------------------------------------------------------
# Estimator registry: names resolved to functions at call time
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EstimatorSpec:
    """How ``xattn compare`` / ``xattn bench`` call one estimator.

    Attributes
    ----------
    name : str
        Command-line name (``"rfa"``).
    sample_keyword : str or None
        Keyword that receives the number of samples (``"num_features"`` for RFA,
        ``"num_samples"`` for RA and LARA); ``None`` for exact softmax.
    load : callable
        Returns the estimator function; called only when the estimator is used, so an
        estimator missing from this version of xattn fails with a clear message.
    bench_samples : int
        Number of samples used by ``xattn bench`` unless ``--samples`` says otherwise.
    quadratic : bool
        True for estimators whose cost is O(N M S D) (RA): ``xattn compare`` runs them
        only at sample counts up to ``--ra-max-samples``.
    options : dict
        Further keywords passed to the estimator.
    """

    name: str
    sample_keyword: str | None
    load: Callable[[], Callable[..., Any]]
    bench_samples: int = 64
    quadratic: bool = False
    options: dict[str, Any] = field(default_factory=dict)


ESTIMATORS: dict[str, EstimatorSpec] = {
    "rfa": EstimatorSpec("rfa", "num_features", lambda: xattn.rfa, bench_samples=64),
    "ra": EstimatorSpec("ra", "num_samples", lambda: xattn.ra, bench_samples=1,
                        quadratic=True),
    "lara": EstimatorSpec("lara", "num_samples", lambda: xattn.lara, bench_samples=64),
}
SOFTMAX = EstimatorSpec("softmax", None, lambda: softmax_attention)


def _estimator_specs(names: Sequence[str], *, allow_softmax: bool = False) -> list[EstimatorSpec]:
    specs = []
    for name in names:
        if allow_softmax and name == "softmax":
            specs.append(SOFTMAX)
        elif name in ESTIMATORS:
            specs.append(ESTIMATORS[name])
        else:
            known = ", ".join((["softmax"] if allow_softmax else []) + list(ESTIMATORS))
            raise CommandError(f"unknown estimator {name!r}; choose from {known}")
    return specs


# --------------------------------------------------------------------------------------
# Backends: moving arrays, synchronizing for timing, peak memory
# --------------------------------------------------------------------------------------


@dataclass
class Backend:
    """An array library on a device, as the command uses it."""

    name: str
    device: str
    library: Any
    to_backend: Callable[[np.ndarray], Any]
    sync: Callable[[Any], Any]
    peak_memory: Callable[[Callable[[], Any]], tuple[Any, int | None]]
    version: str = ""

    def describe(self) -> str:
        return f"{self.name} {self.version} on {self.device}"


def _tracemalloc_peak(run: Callable[[], Any]) -> tuple[Any, int | None]:
    """Peak host memory allocated during ``run()`` (NumPy reports its buffers to tracemalloc)."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        baseline = tracemalloc.get_traced_memory()[0]
        result = run()
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return result, max(int(peak), 0)


def _no_peak(run: Callable[[], Any]) -> tuple[Any, int | None]:
    return run(), None


def _import_backend(module: str, backend: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CommandError(f"backend {backend!r} needs {module.split('.')[0]}, which is not "
                           f"installed (pip install 'xattn[{backend}]')") from None


def load_backend(name: str, device: str, dtype: str) -> Backend:
    """Import the backend ``name`` lazily and check that ``device`` and ``dtype`` work."""
    if name not in BACKENDS:
        raise CommandError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    if device not in ("cpu", "cuda"):
        raise CommandError(f"unknown device {device!r}; choose from cpu, cuda")
    if name in ("numpy", "dask") and device != "cpu":
        raise CommandError(f"backend {name!r} runs on the CPU only; use --device cpu")
    if name == "cupy" and device != "cuda":
        raise CommandError("backend 'cupy' runs on CUDA only; use --device cuda")

    if name == "numpy":
        np_dtype = np.dtype(dtype)
        return Backend(name, device, np, lambda a: np.asarray(a, dtype=np_dtype),
                       lambda out: out, _tracemalloc_peak, np.__version__)

    if name == "torch":
        torch = _import_backend("torch", name)
        if device == "cuda" and not torch.cuda.is_available():
            raise CommandError("--device cuda: torch sees no CUDA device")
        torch_device = torch.device("cuda:0" if device == "cuda" else "cpu")
        torch_dtype = getattr(torch, dtype)

        def torch_sync(out: Any) -> Any:
            if torch_device.type == "cuda":
                torch.cuda.synchronize(torch_device)
            return out

        def torch_peak(run: Callable[[], Any]) -> tuple[Any, int | None]:
            if torch_device.type != "cuda":
                return run(), None  # torch's CPU allocator keeps no counters
            torch.cuda.synchronize(torch_device)
            torch.cuda.reset_peak_memory_stats(torch_device)
            baseline = torch.cuda.memory_allocated(torch_device)
            result = run()
            return result, int(torch.cuda.max_memory_allocated(torch_device) - baseline)

        return Backend(name, str(torch_device), torch,
                       lambda a: torch.as_tensor(a, device=torch_device).to(torch_dtype),
                       torch_sync, torch_peak, torch.__version__)

    if name == "jax":
        jax = _import_backend("jax", name)
        jnp = importlib.import_module("jax.numpy")
        try:
            jax_device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        except RuntimeError:
            raise CommandError(f"--device {device}: JAX sees no such device") from None
        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise CommandError("--dtype float64 with JAX needs the environment variable "
                               "JAX_ENABLE_X64=1")
        jax_dtype = getattr(jnp, dtype)

        def jax_sync(out: Any) -> Any:
            return out.block_until_ready()

        return Backend(name, str(jax_device), jnp,
                       lambda a: jax.device_put(jnp.asarray(a, dtype=jax_dtype), jax_device),
                       jax_sync, _no_peak, jax.__version__)

    if name == "cupy":
        cupy = _import_backend("cupy", name)
        try:
            cupy.cuda.runtime.getDeviceCount()
        except Exception:
            raise CommandError("--device cuda: CuPy sees no CUDA device") from None
        cupy_dtype = getattr(cupy, dtype)

        def cupy_sync(out: Any) -> Any:
            cupy.cuda.get_current_stream().synchronize()
            return out

        def cupy_peak(run: Callable[[], Any]) -> tuple[Any, int | None]:
            hook = _cupy_peak_hook(cupy)
            with hook:
                result = run()
            return result, hook.peak

        return Backend(name, "cuda:0", cupy, lambda a: cupy.asarray(a, dtype=cupy_dtype),
                       cupy_sync, cupy_peak, cupy.__version__)

    dask = _import_backend("dask", name)
    da = importlib.import_module("dask.array")
    np_dtype = np.dtype(dtype)

    def to_dask(a: np.ndarray) -> Any:
        chunks = (1,) * (a.ndim - 2) + a.shape[-2:]  # one chunk per batch-head
        return da.from_array(np.asarray(a, dtype=np_dtype), chunks=chunks)

    return Backend(name, device, da, to_dask, lambda out: out.persist(), _tracemalloc_peak,
                   dask.__version__)


def _cupy_peak_hook(cupy: Any) -> Any:
    """A CuPy memory hook that records the peak of bytes handed out by the memory pool."""

    class PeakHook(cupy.cuda.MemoryHook):
        name = "xattn_peak"

        def __init__(self) -> None:
            self.current = 0
            self.peak = 0

        def malloc_postprocess(self, **kwargs: Any) -> None:
            self.current += int(kwargs.get("mem_size", 0))
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kwargs: Any) -> None:
            self.current -= int(kwargs.get("mem_size", 0))

    return PeakHook()


@dataclass
class Measurement:
    """Wall time and peak memory of the calls of one function.

    The first call (a warm-up: JAX compiles, caches fill) measures the peak memory; the
    others are timed without memory tracing. ``time_s`` is the median of the timed calls,
    or the first call's time when there is only one.
    """

    first_time: float | None = None
    times: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None

    @property
    def time_s(self) -> float:
        return statistics.median(self.times) if self.times else float(self.first_time)


def measured(function: Callable[..., Any], backend: Backend,
             measurement: Measurement) -> Callable[..., Any]:
    """Wrap ``function`` so that each call is synchronized, timed and (first) memory-traced."""

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        if measurement.first_time is None:
            out, peak = backend.peak_memory(lambda: backend.sync(function(*args, **kwargs)))
            measurement.first_time = time.perf_counter() - start
            measurement.peak_memory_bytes = peak
        else:
            out = backend.sync(function(*args, **kwargs))
            measurement.times.append(time.perf_counter() - start)
        return out

    return call


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------


def structured_attention_inputs(
    *, num_heads: int = 4, length: int = 1024, head_dim: int = 64, num_clusters: int = 16,
    radius: float = 6.0, noise: float = 0.5, shuffled_fraction: float = 0.25, seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""The default input of ``xattn compare``: deterministic, sharp, structured attention.

    For each of ``num_heads`` heads, ``num_clusters`` cluster centres are drawn as random
    directions of norm ``radius``. Tokens ``0..length-1`` are assigned to clusters in
    contiguous blocks (locality, as in text and image patches), except a
    ``shuffled_fraction`` of them assigned at random. Queries and keys are their
    cluster's centre plus Gaussian noise of standard deviation ``noise`` per coordinate;
    values are standard normal. With the default scale :math:`1/\sqrt{D}` a query's score
    with keys of its own cluster is about :math:`r^2/\sqrt{D} = 4.5` above the others, so
    attention concentrates on the ~1/16 of keys of its cluster: sharp, like the attention
    of pretrained models, where random-feature estimators struggle.

    Parameters
    ----------
    num_heads, length, head_dim, num_clusters : int
        Leading dim, N = M, D = Dv, and the number of clusters.
    radius, noise, shuffled_fraction : float
        Centre norm, per-coordinate noise and fraction of randomly assigned tokens.
    seed : int
        Seed of the NumPy generator (the data are the same on every run).

    Returns
    -------
    q, k, v : numpy.ndarray, float64, shape (num_heads, length, head_dim)

    Examples
    --------
    >>> from xattn.cli import structured_attention_inputs
    >>> q, k, v = structured_attention_inputs(num_heads=2, length=32, head_dim=8)
    >>> q.shape, k.shape, v.shape
    ((2, 32, 8), (2, 32, 8), (2, 32, 8))
    """
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(num_heads, num_clusters, head_dim))
    centres = radius * directions / np.linalg.norm(directions, axis=-1, keepdims=True)
    block = np.arange(length) * num_clusters // length
    shuffled = rng.random((num_heads, length)) < shuffled_fraction
    cluster = np.where(shuffled, rng.integers(num_clusters, size=(num_heads, length)), block)
    heads = np.arange(num_heads)[:, None]
    q = centres[heads, cluster] + noise * rng.normal(size=(num_heads, length, head_dim))
    k = centres[heads, cluster] + noise * rng.normal(size=(num_heads, length, head_dim))
    v = rng.normal(size=(num_heads, length, head_dim))
    return q, k, v


def load_inputs(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read and validate ``q``, ``k``, ``v`` from an ``.npz`` file (raises CommandError)."""
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise CommandError(f"{path}: not an .npz archive (save one with "
                               "numpy.savez(path, q=q, k=k, v=v))")
        with archive:
            missing = [name for name in ("q", "k", "v") if name not in archive.files]
            if missing:
                raise CommandError(f"{path}: missing array(s) {', '.join(missing)}; expected "
                                   f"q, k, v, found {', '.join(archive.files) or 'none'}")
            q, k, v = (archive[name] for name in ("q", "k", "v"))
    except CommandError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CommandError(f"{path}: cannot read it as an .npz file ({reason})") from None
    for name, array, shape in (("q", q, "(..., N, D)"), ("k", k, "(..., M, D)"),
                               ("v", v, "(..., M, Dv)")):
        if array.dtype.kind not in "fiu":
            raise CommandError(f"{path}: array {name} must be real numbers, got dtype "
                               f"{array.dtype}")
        if array.ndim < 2:
            raise CommandError(f"{path}: array {name} must have shape {shape} (rank >= 2), "
                               f"got shape {array.shape}")
        if array.size == 0:
            raise CommandError(f"{path}: array {name} is empty (shape {array.shape})")
        if not np.all(np.isfinite(array)):
            raise CommandError(f"{path}: array {name} contains NaN or inf")
    if q.shape[-1] != k.shape[-1]:
        raise CommandError(f"{path}: q and k must have the same last dim D, got shapes "
                           f"{q.shape} and {k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise CommandError(f"{path}: k and v must have the same number of keys M, got "
                           f"shapes {k.shape} and {v.shape}")
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise CommandError(f"{path}: the leading dims of q {q.shape}, k {k.shape} and "
                           f"v {v.shape} do not broadcast") from None
    return q, k, v


# --------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool | None) -> Iterator[Any]:
    """A tqdm bar on stderr (shown on a terminal unless ``enabled`` says otherwise)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety: run without it
        tqdm = None
    if tqdm is None or enabled is False:
        yield None
        return
    with tqdm(total=total, desc=description, file=sys.stderr, leave=False,
              disable=None if enabled is None else False, unit="run") as bar:
        yield bar


def _advance(bar: Any, label: str) -> None:
    if bar is not None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)


def _new_figure(ncols: int = 1) -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CommandError("writing the PNG needs matplotlib: pip install 'xattn[cli]'") from None
    figure = Figure(figsize=(6.4 * ncols, 4.4), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, ncols)
    return figure, axes


def _format_bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n")


def _environment(backend: Backend) -> dict[str, Any]:
    return {"xattn": xattn.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "backend": backend.name,
            "backend_version": backend.version, "device": backend.device}


def _output_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CommandError(f"--out {path}: cannot create the directory "
                           f"({error.strerror})") from None
    return out


# --------------------------------------------------------------------------------------
# xattn compare
# --------------------------------------------------------------------------------------


def compare(args: argparse.Namespace) -> int:
    """Run ``xattn compare`` (see :func:`main`)."""
    specs = _estimator_specs(args.estimators)
    functions = {spec.name: spec.load() for spec in specs}
    backend = load_backend(args.backend, args.device, args.dtype)
    if args.input is None:
        q_host, k_host, v_host = structured_attention_inputs()
        source = "default: structured_attention_inputs() (4 heads, N = M = 1024, D = 64)"
    else:
        q_host, k_host, v_host = load_inputs(args.input)
        source = str(args.input)
    out_dir = _output_dir(args.out)
    q, k, v = (backend.to_backend(a) for a in (q_host, k_host, v_host))

    exact_measurement = Measurement()
    exact_call = measured(softmax_attention, backend, exact_measurement)
    exact = exact_call(q, k, v)
    exact_call(q, k, v)  # a second, timed call
    baseline_measurement = Measurement()
    baseline_call = measured(uniform_attention, backend, baseline_measurement)
    baseline_error = estimator_error(lambda q, k, v: baseline_call(q, k, v), q, k, v, draws=1,
                                     rng_keyword=None, exact=exact)

    cells = [(spec, samples) for spec in specs for samples in args.samples
             if not (spec.quadratic and args.ra_max_samples and samples > args.ra_max_samples)]
    skipped = [{"estimator": spec.name, "samples": samples,
                "reason": f"above --ra-max-samples {args.ra_max_samples}"}
               for spec in specs for samples in args.samples
               if (spec, samples) not in cells]
    rows: list[dict[str, Any]] = []
    print(f"xattn compare: {backend.describe()}, {args.dtype}, q {q_host.shape}, "
          f"k {k_host.shape}, v {v_host.shape}; {args.draws} draws per cell, seeds "
          f"{args.seed}..{args.seed + args.draws - 1}")
    with progress_bar(len(cells) * args.draws, "xattn compare", args.progress) as bar:
        for spec, samples in cells:
            measurement = Measurement()
            timed = measured(functions[spec.name], backend, measurement)

            def draw(q: Any, k: Any, v: Any, *, rng: Any, _timed: Any = timed,
                     _label: str = f"{spec.name} S={samples}", **options: Any) -> Any:
                out = _timed(q, k, v, rng=rng, **options)
                _advance(bar, _label)
                return out

            try:
                error = estimator_error(draw, q, k, v, draws=args.draws, seed=args.seed,
                                        exact=exact, **{spec.sample_keyword: samples},
                                        **spec.options)
            except ValueError as problem:
                raise CommandError(f"{spec.name} with {spec.sample_keyword}={samples}: "
                                   f"{problem}") from None
            rows.append(_row(spec, samples, error, measurement))

    baseline_row = _row(None, None, baseline_error, baseline_measurement)
    exact_row = {"estimator": "softmax", "samples": None, "mse": 0.0, "bias_squared": 0.0,
                 "variance": 0.0, "relative_error": 0.0,
                 "time_s": exact_measurement.time_s,
                 "peak_memory_bytes": exact_measurement.peak_memory_bytes}
    _print_compare_table(rows, baseline_row, exact_row)
    if skipped:
        print(f"note: ra (cost O(N M S D)) skipped at samples "
              f"{', '.join(str(cell['samples']) for cell in skipped)} (--ra-max-samples "
              f"{args.ra_max_samples}; 0 runs every count)")

    payload = {
        "command": "compare",
        "environment": _environment(backend),
        "input": {"source": source, "q_shape": list(q_host.shape),
                  "k_shape": list(k_host.shape), "v_shape": list(v_host.shape),
                  "dtype": args.dtype},
        "seed": args.seed,
        "draws": args.draws,
        "seed_rule": "draw r (r = 0..draws-1) of every (estimator, samples) cell runs with "
                     "rng = seed + r (xattn.diagnostics.draw_seeds)",
        "samples": list(args.samples),
        "estimators": {spec.name: {"sample_keyword": spec.sample_keyword,
                                   "options": spec.options} for spec in specs},
        "ra_max_samples": args.ra_max_samples,
        "results": rows,
        "skipped": skipped,
        "baseline": baseline_row,
        "exact": exact_row,
    }
    json_path = out_dir / "compare.json"
    png_path = out_dir / "compare.png"
    _write_json(json_path, payload)
    _plot_compare(png_path, rows, baseline_row, specs, source, skipped)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _row(spec: EstimatorSpec | None, samples: int | None, error: EstimatorError,
         measurement: Measurement) -> dict[str, Any]:
    return {"estimator": "uniform" if spec is None else spec.name,
            "samples": samples,
            **{key: value for key, value in error.as_dict().items()},
            "time_s": measurement.time_s,
            "peak_memory_bytes": measurement.peak_memory_bytes}


def _print_compare_table(rows: list[dict[str, Any]], baseline: dict[str, Any],
                         exact: dict[str, Any]) -> None:
    header = (f"{'estimator':<10} {'samples':>7} {'MSE':>10} {'bias^2':>10} {'variance':>10} "
              f"{'rel.err':>9} {'time [ms]':>10} {'peak [MiB]':>10}")
    print(header)
    print("-" * len(header))
    for row in [*rows, baseline, exact]:
        samples = "-" if row["samples"] is None else str(row["samples"])
        print(f"{row['estimator']:<10} {samples:>7} {row['mse']:>10.3e} "
              f"{row['bias_squared']:>10.3e} {row['variance']:>10.3e} "
              f"{row['relative_error']:>9.3f} {1e3 * row['time_s']:>10.2f} "
              f"{_format_bytes(row['peak_memory_bytes']):>10}")
    worse = sorted({row["estimator"] for row in rows if row["mse"] > baseline["mse"]})
    if worse:
        print(f"note: {', '.join(worse)} do worse than uniform attention (MSE "
              f"{baseline['mse']:.3e}) at some sample counts")


def _plot_compare(path: Path, rows: list[dict[str, Any]], baseline: dict[str, Any],
                  specs: list[EstimatorSpec], source: str,
                  skipped: list[dict[str, Any]]) -> None:
    figure, axes = _new_figure()
    for spec in specs:
        points = [(row["samples"], row["mse"]) for row in rows if row["estimator"] == spec.name]
        if not points:
            continue
        label = spec.name.upper()
        if any(cell["estimator"] == spec.name for cell in skipped):
            label += f" (samples <= {max(samples for samples, _ in points)})"
        axes.plot(*zip(*points, strict=True), marker="o", label=label)
    axes.axhline(baseline["mse"], color="0.4", linestyle="--", label="uniform attention")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("number of samples")
    axes.set_ylabel("MSE against softmax attention")
    axes.set_title(f"xattn compare: {Path(source).name if '/' in source else source}",
                   fontsize="small")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------
# xattn bench
# --------------------------------------------------------------------------------------


def bench(args: argparse.Namespace) -> int:
    """Run ``xattn bench`` (see :func:`main`)."""
    specs = _estimator_specs(["softmax", *args.estimators], allow_softmax=True)
    functions = {spec.name: spec.load() for spec in specs}
    samples = _bench_samples(args.samples, specs)
    backend = load_backend(args.backend, args.device, args.dtype)
    out_dir = _output_dir(args.out)
    host_rng = np.random.default_rng(args.seed)

    lengths = sorted(set(args.lengths))
    results: dict[str, list[dict[str, Any]]] = {spec.name: [] for spec in specs}
    too_slow: set[str] = set()
    print(f"xattn bench: {backend.describe()}, {args.dtype}, {args.heads} heads, "
          f"D = {args.head_dim}, lengths {', '.join(map(str, lengths))}")
    with progress_bar(len(specs) * len(lengths), "xattn bench", args.progress) as bar:
        for length in lengths:
            shape = (args.heads, length, args.head_dim)
            q, k, v = (backend.to_backend(host_rng.normal(size=shape)) for _ in range(3))
            for spec in specs:
                if spec.name in too_slow:
                    results[spec.name].append({"length": length, "samples": None,
                                               "time_s": None, "peak_memory_bytes": None,
                                               "skipped": f"a call took over --time-limit "
                                                          f"{args.time_limit:g} s at a "
                                                          "shorter length"})
                    _advance(bar, f"{spec.name} N={length} skipped")
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
                if args.time_limit and max(measurement.first_time,
                                           measurement.time_s) > args.time_limit:
                    too_slow.add(spec.name)
                _advance(bar, f"{spec.name} N={length}")
            del q, k, v

    crossover = {spec.name: crossover_length(results["softmax"], results[spec.name])
                 for spec in specs if spec.name != "softmax"}
    _print_bench_table(results, crossover, lengths)
    payload = {
        "command": "bench",
        "environment": _environment(backend),
        "dtype": args.dtype,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "seed": args.seed,
        "repeats": args.repeats,
        "lengths": lengths,
        "time_limit_s": args.time_limit,
        "samples": {spec.name: samples.get(spec.name) for spec in specs},
        "results": results,
        "crossover_length": crossover,
        "crossover_rule": "the smallest measured length from which on the estimator is "
                          "faster than exact softmax at every larger measured length "
                          "(where softmax was skipped as too slow, its last measured time "
                          "is the bound; a skipped estimator is not faster); null if it "
                          "never is",
    }
    json_path = out_dir / "bench.json"
    png_path = out_dir / "bench.png"
    _write_json(json_path, payload)
    _plot_bench(png_path, results, crossover, backend)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _bench_samples(text: str, specs: list[EstimatorSpec]) -> dict[str, int]:
    samples = {spec.name: spec.bench_samples for spec in specs if spec.sample_keyword}
    if text is None:
        return samples
    for item in text.split(","):
        name, _, count = item.strip().rpartition("=")
        try:
            value = int(count)
        except ValueError:
            value = 0
        if value < 1 or (name and name not in samples):
            raise CommandError(f"--samples: expected an int >= 1 or name=int pairs for "
                               f"{', '.join(samples)}, got {item.strip()!r}")
        for key in [name] if name else list(samples):
            samples[key] = value
    return samples


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


def _print_bench_table(results: dict[str, list[dict[str, Any]]],
                       crossover: dict[str, int | None], lengths: Sequence[int]) -> None:
    names = list(results)
    print(f"{'length':>7} " + " ".join(f"{name + ' [ms]':>13} {'[MiB]':>8}" for name in names))
    for index, length in enumerate(lengths):
        cells = []
        for name in names:
            row = results[name][index]
            time_ms = "skipped" if row["time_s"] is None else f"{1e3 * row['time_s']:.2f}"
            cells.append(f"{time_ms:>13} {_format_bytes(row['peak_memory_bytes']):>8}")
        print(f"{length:>7} " + " ".join(cells))
    for name, length in crossover.items():
        verdict = (f"faster than exact softmax from N = {length} on" if length is not None
                   else "not faster than exact softmax at the measured lengths")
        print(f"{name}: {verdict}")


def _plot_bench(path: Path, results: dict[str, list[dict[str, Any]]],
                crossover: dict[str, int | None], backend: Backend) -> None:
    figure, (time_axes, memory_axes) = _new_figure(ncols=2)
    for name, rows in results.items():
        timed = [(row["length"], row["time_s"]) for row in rows if row["time_s"] is not None]
        label = name if name == "softmax" else name.upper()
        line, = time_axes.plot(*zip(*timed, strict=True), marker="o", label=label)
        if crossover.get(name) is not None:
            time_axes.axvline(crossover[name], color=line.get_color(), linestyle=":",
                              alpha=0.6)
        memory = [(row["length"], row["peak_memory_bytes"] / 2**20) for row in rows
                  if row["peak_memory_bytes"] is not None]
        if memory:
            memory_axes.plot(*zip(*memory, strict=True), marker="o", label=label,
                             color=line.get_color())
    for axes, ylabel in ((time_axes, "time [s]"), (memory_axes, "peak memory [MiB]")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("sequence length N = M")
        axes.set_ylabel(ylabel)
        axes.grid(True, which="both", alpha=0.3)
    time_axes.legend(title="dotted: crossover")
    time_axes.set_title(f"xattn bench: {backend.describe()}", fontsize="small")
    if memory_axes.lines:
        memory_axes.legend()
    else:
        memory_axes.text(0.5, 0.5, f"no peak-memory counter for {backend.name} on "
                         f"{backend.device}", ha="center", va="center",
                         transform=memory_axes.transAxes)
    figure.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------
# Argument parsing
# --------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line on stderr (exit code 2)."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def _int_at_least(minimum: int):
    """An argparse type: an int >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _add_common(parser: argparse.ArgumentParser, default_estimators: str) -> None:
    parser.add_argument("--backend", default="numpy", metavar="NAME",
                        help=f"array library: {', '.join(BACKENDS)} (default: numpy)")
    parser.add_argument("--device", default="cpu", metavar="cpu|cuda",
                        help="device (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="dtype of the inputs (default: float32)")
    parser.add_argument("--estimators", type=_name_list, metavar="LIST",
                        default=_name_list(default_estimators),
                        help=f"comma-separated estimators among {', '.join(ESTIMATORS)} "
                             f"(default: {default_estimators})")
    parser.add_argument("--seed", type=_nonnegative_int, default=0,
                        help="seed of the random draws (default: 0)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"output directory (default: {DEFAULT_OUT})")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="always show the progress bar (default: on a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help="never show the progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``xattn`` command."""
    parser = _Parser(prog="xattn", description="Randomized attention estimators: accuracy "
                     "(compare) and speed (bench) against exact softmax attention.")
    parser.add_argument("--version", action="version", version=f"xattn {xattn.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    compare_parser = commands.add_parser(
        "compare", help="MSE of the estimators against softmax attention vs samples",
        description="Run each estimator at each number of samples against exact softmax "
        "attention; print MSE, squared bias, variance, relative error (RMSE / RMS of the "
        "exact output), time and peak memory, with the uniform-attention baseline (every "
        "query gets the mean of the values); write DIR/compare.png (MSE vs samples) and "
        "DIR/compare.json (all figures). Without --input the data are deterministic "
        "structured attention: 4 heads, N = M = 1024, D = Dv = 64, queries and keys around "
        "16 cluster centres of norm 6 (contiguous blocks of tokens, 25%% shuffled), so "
        "attention is sharp (xattn.cli.structured_attention_inputs). Draw r of every cell "
        "uses rng = SEED + r, as xattn.diagnostics.estimator_error(seed=SEED). RA costs "
        "O(N M S D), so it runs only at sample counts <= --ra-max-samples.")
    _add_common(compare_parser, "rfa,ra,lara")
    compare_parser.add_argument("--input", metavar="FILE.npz",
                                help="arrays q (..., N, D), k (..., M, D), v (..., M, Dv)")
    compare_parser.add_argument("--samples", type=_int_list, default=list(DEFAULT_SAMPLES),
                                metavar="LIST", help="comma-separated numbers of samples "
                                "(default: 16,32,64,128,256)")
    compare_parser.add_argument("--draws", type=_positive_int, default=4,
                                help="independent draws per (estimator, samples) cell "
                                "(default: 4)")
    compare_parser.add_argument("--ra-max-samples", type=_nonnegative_int, default=64, metavar="S",
                                help="run RA, whose cost is O(N M S D), only at sample counts "
                                "<= S; 0 runs every count (default: 64)")
    compare_parser.set_defaults(run=compare)

    bench_parser = commands.add_parser(
        "bench", help="time and peak memory vs sequence length",
        description="Time (median of --repeats calls after a warm-up call) and peak memory "
        "(of the warm-up call: NumPy/Dask host allocations, CUDA allocator counters; n/a "
        "for torch and JAX on CPU) of exact softmax and each estimator at each sequence "
        "length N = M, on standard normal inputs; report the crossover length from which "
        "each estimator is faster than exact softmax; write DIR/bench.png and "
        "DIR/bench.json.")
    _add_common(bench_parser, "rfa,ra,lara")
    bench_parser.add_argument("--lengths", type=_int_list, default=list(DEFAULT_LENGTHS),
                              metavar="LIST", help="comma-separated sequence lengths "
                              "(default: 1024,2048,...,65536)")
    bench_parser.add_argument("--samples", default=None, metavar="SPEC",
                              help="samples per estimator: an int for all, or name=int "
                              "pairs, capped at N (default: rfa=64,ra=1,lara=64)")
    bench_parser.add_argument("--heads", type=_positive_int, default=1,
                              help="number of heads (default: 1)")
    bench_parser.add_argument("--head-dim", type=_positive_int, default=64,
                              help="D = Dv (default: 64)")
    bench_parser.add_argument("--repeats", type=_positive_int, default=1,
                              help="timed calls after the warm-up call (default: 1)")
    bench_parser.add_argument("--time-limit", type=_nonnegative_float, default=60.0,
                              metavar="SECONDS",
                              help="stop running an estimator at larger lengths once one of "
                              "its calls took longer than this (0: no limit; default: 60)")
    bench_parser.set_defaults(run=bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xattn`` console script; returns the exit code.

    Input problems (unreadable or invalid ``--input`` files, unknown backends or
    estimators, unavailable devices) print one line on stderr and return 2.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default: ``sys.argv[1:]``), e.g. ``["compare", "--draws", "8"]``.

    Returns
    -------
    int
        0 on success, 2 for bad input or arguments.

    Examples
    --------
    >>> from xattn.cli import main
    >>> main(["--version"])
    xattn ...
    0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else EXIT_USAGE
    try:
        return args.run(args)
    except CommandError as error:
        print(f"xattn {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
