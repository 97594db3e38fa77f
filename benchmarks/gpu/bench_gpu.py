"""Time and peak GPU memory of every estimator on torch-CUDA, CuPy and JAX-GPU.

For sequence lengths N = M (exact methods up to ``--exact-max``, linear ones up to
``--linear-max``), batch (B, H) = (``--batch``, ``--heads``), D = Dv = 64, each dtype:

* ``softmax (native)``, ``softmax (native, causal)``: the framework's fused kernel through
  ``softmax_attention(implementation="native")`` (torch SDPA: FlashAttention / cuDNN /
  memory-efficient, torch's choice; JAX ``jax.nn.dot_product_attention``);
* ``softmax (xattn)``: xattn's portable blocked loop (``implementation="xattn"``);
* ``rfa``, ``rfa (causal)``: S = ``--features`` (256) positive random features;
* ``lara``: C = ``--samples`` (64) proposals, decoupled weighting;
* ``ra``: one sample per query, while it fits (``--ra-max``);
* ``performer``, ``performer (causal)`` (torch only, where ``performer_pytorch`` imports):
  performer-pytorch's ``FastAttention`` with the same S, as its users call it.

Timing: every method at one length is called once to warm up (JAX compiles its
``jax.jit``-wrapped call; torch and CuPy run eagerly, as users call them), then
``--repeats`` rounds call each method once, interleaved, and the best round is kept.
torch and CuPy are timed with CUDA events on the current stream, JAX with
``block_until_ready`` around ``time.perf_counter``. Peak memory: torch's
``max_memory_allocated`` above the level before the warm-up call; CuPy's memory-pool hook;
JAX's ``memory_analysis()`` of the compiled call (temp + output bytes). A method stops at
longer lengths once one call takes more than ``--time-limit`` seconds or fails (out of
memory, an unsupported dtype); the failure is recorded, not hidden::

    python benchmarks/gpu/bench_gpu.py --backends torch-cuda,cupy,jax-gpu

Each backend runs in its own process (JAX's and CuPy's allocators would otherwise hold
memory the others need). Writes the JSON given by ``--out`` (one entry per backend and
dtype, with the GPU, driver and package versions; default
``benchmarks/results/gpu_results.json``) and its figure beside it (``.png``).
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
from typing import Any

import numpy as np

LINEAR = ("rfa", "rfa (fixed omega)", "rfa (causal)", "lara", "performer",
          "performer (causal)")
METHODS = ("softmax (native)", "softmax (native, causal)", "softmax (xattn)",
           "rfa", "rfa (fixed omega)", "rfa (causal)", "lara", "ra", "performer",
           "performer (causal)")
BACKENDS = {"torch-cuda": ("torch", "cuda"), "cupy": ("cupy", "cuda"),
            "jax-gpu": ("jax", "cuda"), "torch": ("torch", "cpu"), "jax": ("jax", "cpu")}


def method_names(text: str) -> list[str]:
    """The methods of a comma-separated ``--methods``, whose names may hold a comma
    ("softmax (native, causal)"): pieces are joined until they name a method."""
    names, pending = [], ""
    for piece in text.split(","):
        pending = f"{pending},{piece}" if pending else piece.strip()
        if pending in METHODS:
            names.append(pending)
            pending = ""
    if pending:
        raise SystemExit(f"--methods: unknown method {pending!r}; choose among {METHODS}")
    return names


def method_function(name: str, args: argparse.Namespace, library: str) -> Any:
    """``f(q, k, v)`` computing ``name``; None where the backend has no such method."""
    import xattn

    if name.startswith("softmax (native"):
        if library == "cupy":
            return None
        causal = "causal" in name
        return lambda q, k, v: xattn.softmax_attention(q, k, v, causal=causal,
                                                       implementation="native")
    if name == "softmax (xattn)":
        return lambda q, k, v: xattn.softmax_attention(q, k, v, implementation="xattn")
    if name == "rfa (fixed omega)":  # drawn once, on the device of the first call
        import array_api_compat
        import numpy as np

        from xattn.features import sample_omega

        drawn: dict[str, Any] = {}

        def fixed(q: Any, k: Any, v: Any) -> Any:
            if "omega" not in drawn:
                xp = array_api_compat.array_namespace(q)
                drawn["omega"] = sample_omega(
                    np.random.default_rng(0), args.features, q.shape[-1], xp=xp,
                    dtype=xp.float32, device=array_api_compat.device(q))
            return xattn.rfa(q, k, v, omega=drawn["omega"])
        return fixed
    if name.startswith("rfa"):
        causal = "causal" in name
        return lambda q, k, v: xattn.rfa(q, k, v, num_features=args.features,
                                         causal=causal, rng=0)
    if name == "lara":
        return lambda q, k, v: xattn.lara(q, k, v, num_samples=args.samples, rng=0)
    if name == "ra":
        return lambda q, k, v: xattn.ra(q, k, v, num_samples=1, rng=0)
    if name.startswith("performer"):
        if library != "torch":
            return None
        try:
            from performer_pytorch import FastAttention
        except ImportError:
            return None
        module = FastAttention(dim_heads=args.head_dim, nb_features=args.features,
                               causal="causal" in name).to(args.torch_device)
        return lambda q, k, v: module(q, k, v)
    raise ValueError(name)


def max_length(name: str, args: argparse.Namespace) -> int:
    if name in LINEAR:
        return args.linear_max
    return args.ra_max if name == "ra" else args.exact_max


class Timer:
    """Times one call of ``f`` on the backend's device, in seconds."""

    def __init__(self, library: str, backend: Any) -> None:
        self.library, self.backend = library, backend

    def __call__(self, call: Any) -> float:
        if self.library == "torch" and self.backend.device.startswith("cuda"):
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        if self.library == "cupy":
            import cupy

            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            call()
            end.record()
            end.synchronize()
            return cupy.cuda.get_elapsed_time(start, end) / 1e3
        started = time.perf_counter()
        self.backend.sync(call())
        return time.perf_counter() - started


def cast(library: str, array: Any, dtype: str) -> Any:
    if dtype == "float32":
        return array
    if library == "torch":
        import torch

        return array.to(getattr(torch, dtype))
    if library == "jax":
        import jax.numpy as jnp

        return array.astype(getattr(jnp, dtype))
    raise ValueError(f"{library} has no {dtype}")


def run_backend(args: argparse.Namespace) -> dict[str, Any]:
    """Every method at every length on one backend and dtype (runs in its own process)."""
    from xattn.cli.common import environment
    from xattn.cli.measure import load_backend

    library, device = BACKENDS[args.backend]
    backend = load_backend(library, device, "float32")
    args.torch_device = "cuda:0" if device == "cuda" else "cpu"
    timer = Timer(library, backend)
    calls: dict[str, Any] = {}
    for name in method_names(args.methods):
        function = method_function(name, args, library)
        if function is not None:
            calls[name] = jax_jit(function) if library == "jax" else function
    stopped: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    host = np.random.default_rng(0)
    lengths = [n for n in args.lengths if n <= args.linear_max]
    for length in lengths:
        shape = (args.batch, args.heads, length, args.head_dim)
        arrays = tuple(cast(library, backend.to_backend(host.standard_normal(shape,
                                                                             np.float32)),
                            args.dtype) for _ in range(3))
        active = {name: call for name, call in calls.items()
                  if name not in stopped and length <= max_length(name, args)}
        times: dict[str, float] = {}
        for name, call in list(active.items()):  # warm-up, and the peak memory
            try:
                peak = peak_memory(library, backend, call, arrays)
                times[name] = timer(lambda call=call, arrays=arrays: call(*arrays))
            except Exception as error:  # out of memory, unsupported dtype: recorded
                stopped[name] = f"N = {length}: {type(error).__name__}: {str(error)[:300]}"
                del active[name]
                release(library)
                continue
            rows.append({"method": name, "length": length, "peak_bytes": peak})
        for _ in range(args.repeats):
            for name, call in active.items():
                elapsed = timer(lambda call=call, arrays=arrays: call(*arrays))
                times[name] = min(times[name], elapsed)
        for row in rows:
            if row["length"] == length and row["method"] in times:
                row["time_s"] = times[row["method"]]
                if times[row["method"]] > args.time_limit:
                    stopped.setdefault(row["method"], f"N = {length}: over the time limit")
        print(f"{args.backend} {args.dtype} N = {length}: "
              + ", ".join(f"{name} {1e3 * t:.3f} ms" for name, t in times.items()), flush=True)
        del arrays
        release(library)
    return {"backend": args.backend, "dtype": args.dtype, "rows": rows, "stopped": stopped,
            "environment": environment(backend), "gpu": gpu_description(library)}


def jax_jit(function: Any) -> Any:
    import jax

    return jax.jit(function)


def peak_memory(library: str, backend: Any, call: Any, arrays: tuple) -> int | None:
    if library == "jax":
        analysis = call.lower(*arrays).compile().memory_analysis()
        backend.sync(call(*arrays))
        if analysis is None:
            return None
        return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)
    _, peak = backend.peak_memory(lambda: backend.sync(call(*arrays)))
    return peak


def release(library: str) -> None:
    if library == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    elif library == "cupy":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


def gpu_description(library: str) -> dict[str, Any]:
    description: dict[str, Any] = {}
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               check=True, timeout=30)
        description["nvidia_smi"] = query.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        description["nvidia_smi"] = None
    if library == "torch":
        import torch

        description["torch_cuda"] = torch.version.cuda
        description["cudnn"] = torch.backends.cudnn.version()
    return description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="torch-cuda,cupy,jax-gpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--lengths", default=",".join(str(2 ** p) for p in range(10, 19)))
    parser.add_argument("--exact-max", type=int, default=65536)
    parser.add_argument("--ra-max", type=int, default=16384)
    parser.add_argument("--linear-max", type=int, default=262144)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated methods among: " + ", ".join(METHODS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "results"
                        / "gpu_results.json")
    parser.add_argument("--plot", type=Path, metavar="JSON",
                        help="only draw JSON's figure (JSON with the suffix .png)")
    parser.add_argument("--backend", help=argparse.SUPPRESS)  # one backend, in a child
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lengths = [int(item) for item in str(args.lengths).split(",")]
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    if args.backend:
        json.dump(run_backend(args), sys.stdout if str(args.out) == "-" else args.out.open("w"))
        return
    report: dict[str, Any] = {
        "description": __doc__.splitlines()[0], "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                    "python": platform.python_version()},
        "shape": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim},
        "features": args.features, "samples": args.samples, "repeats": args.repeats,
        "runs": []}
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            if backend == "cupy" and dtype != "float32":
                continue  # CuPy has no bfloat16
            part = args.out.with_suffix(f".{backend}.{dtype}.part")
            command = [sys.executable, __file__, *sys.argv[1:], "--backend", backend,
                       "--dtype", dtype, "--out", str(part)]
            started = time.perf_counter()
            finished = subprocess.run(command, check=False)
            if finished.returncode == 0 and part.exists():
                report["runs"].append(json.loads(part.read_text()))
                part.unlink()
            else:
                report["runs"].append({"backend": backend, "dtype": dtype,
                                       "failed": f"exit {finished.returncode}"})
            report["runs"][-1]["seconds"] = round(time.perf_counter() - started, 1)
            args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    summarize(report)


def plot(report: dict[str, Any], path: Path) -> None:
    """One log-log panel of time against N per backend and dtype that has rows."""
    from xattn.cli.figures import loglog_axes, new_figure, save_figure

    runs = [run for run in report["runs"] if run.get("rows")]
    if not runs:
        return
    figure, axes = new_figure(ncols=len(runs), width=4.2, height=4.2)
    axes = axes if len(runs) > 1 else [axes]
    styles = dict(zip(METHODS, ("k-", "k--", "k:", "C0-", "C0:", "C0--", "C1-", "C2-",
                                "C3-", "C3--"), strict=True))
    for panel, run in zip(axes, runs, strict=True):
        for method in METHODS:
            points = sorted((row["length"], row["time_s"]) for row in run["rows"]
                            if row["method"] == method and "time_s" in row)
            if points:
                panel.plot(*zip(*points, strict=True), styles[method], marker=".",
                           label=method)
        loglog_axes(panel, "N", "seconds")
        panel.set_title(f"{run['backend']}, {run['dtype']}"
                        + (" (partial)" if run.get("partial") else ""))
    axes[0].legend(fontsize="small")
    figure.suptitle(f"{report['machine'].get('gpu', {}).get('nvidia_smi', 'GPU')}: "
                    f"(B, H) = ({report['shape']['batch']}, {report['shape']['heads']}), "
                    f"D = {report['shape']['head_dim']}, S = {report['features']}, "
                    f"C = {report['samples']}")
    save_figure(figure, path)


def summarize(report: dict[str, Any]) -> None:
    """Print, per backend and dtype, the time of each method at each length."""
    for run in report["runs"]:
        if "rows" not in run:
            print(run)
            continue
        print(f"\n{run['backend']} {run['dtype']}: ms (peak MiB)")
        by_length: dict[int, dict[str, str]] = {}
        for row in run["rows"]:
            if "time_s" not in row:
                continue
            peak = row["peak_bytes"]
            by_length.setdefault(row["length"], {})[row["method"]] = (
                f"{1e3 * row['time_s']:.3g}"
                + ("" if peak is None else f" ({peak / 2 ** 20:.0f})"))
        for length, cells in sorted(by_length.items()):
            print(f"  N = {length}: " + "; ".join(f"{m} {c}" for m, c in cells.items()))
        for method, why in run["stopped"].items():
            print(f"  stopped {method}: {why}")


if __name__ == "__main__":
    main()
