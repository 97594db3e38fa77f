"""Backends and measurement: arrays onto a device, synchronizing, timing, peak memory.

Used by ``xattn compare``, ``xattn bench``, ``xattn train`` (torch) and the scripts in
``benchmarks/`` (whose own helpers are in ``benchmarks/_common.py``):

* :func:`load_backend` imports one array library lazily and returns a :class:`Backend`
  that moves NumPy arrays onto its device, synchronizes it for timing and measures the
  peak memory of a call;
* :class:`Measurement` and :func:`measured` time the calls of a function (the first call
  warms up and measures memory);
* :func:`tracemalloc_peak` measures host memory; the torch peak (CPU profiler, CUDA
  counter) is :mod:`xattn.training.peak`'s, as the training step measures it.
"""

from __future__ import annotations

import importlib
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xattn.cli import memory
from xattn.cli.common import CommandError
from xattn.training.peak import allocator_peak, native_stderr_silenced, torch_memory

__all__ = ["BACKENDS", "DEVICES", "Backend", "Measurement", "allocator_peak", "load_backend",
           "measured", "native_stderr_silenced", "tracemalloc_peak"]

#: The array libraries (``--backend``) and devices (``--device``) the commands run on.
BACKENDS = ("numpy", "torch", "jax", "cupy", "dask")
DEVICES = ("cpu", "cuda")

PeakMemory = Callable[[Callable[[], Any]], tuple[Any, "int | None"]]


@dataclass
class Backend:
    """An array library on a device, as the command uses it.

    Attributes
    ----------
    name, device, version : str
        Backend name (``"torch"``), device (``"cpu"``, ``"cuda:0"``) and library version.
    namespace : module
        The Array API namespace the inputs live in.
    to_backend : callable
        A NumPy array onto the device, in the chosen dtype.
    sync : callable
        Waits until a result is computed (CUDA streams, JAX dispatch, Dask graphs).
    peak_memory : callable
        ``peak_memory(run) -> (run(), peak bytes or None)``.
    memory_available : callable
        Bytes of memory free for the run on its device (host memory on the CPU), or
        None where unknown.
    memory_method : str
        How the peak memory is obtained (printed with the tables, written to the JSON).
    compiled_peak : callable, optional
        ``compiled_peak(function, args, kwargs) -> bytes or None``: the peak read from
        the compiled program instead of a run (JAX); used instead of ``peak_memory``.
    """

    name: str
    device: str
    namespace: Any
    to_backend: Callable[[np.ndarray], Any]
    sync: Callable[[Any], Any]
    peak_memory: PeakMemory
    version: str = ""
    memory_available: Callable[[], int | None] = field(default=lambda: _host_available())
    memory_method: str = "not measured"
    compiled_peak: Callable[[Callable[..., Any], tuple, dict], int | None] | None = None

    def describe(self) -> str:
        return f"{self.name} {self.version} on {self.device}"


def tracemalloc_peak(run: Callable[[], Any]) -> tuple[Any, int]:
    """``run()`` and the peak host memory it allocated above what was allocated before.

    NumPy (and so Dask's NumPy chunks) reports its buffers to :mod:`tracemalloc`.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.cli.measure import tracemalloc_peak
    >>> out, peak = tracemalloc_peak(lambda: np.ones(2**20))
    >>> peak >= 8 * 2**20
    True
    """
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


def _host_available() -> int | None:
    return memory.host_memory_available()


def _no_peak(run: Callable[[], Any]) -> tuple[Any, None]:
    return run(), None


def _jax_compiled_peak(function: Callable[..., Any], args: tuple, kwargs: dict) -> int | None:
    """Temp + output bytes of the XLA program compiled for ``function(*args, **kwargs)``."""
    import jax

    try:
        compiled = jax.jit(lambda *arrays: function(*arrays, **kwargs)).lower(*args).compile()
        analysis = compiled.memory_analysis()
    except Exception:  # a function that does not trace, a backend without the analysis
        return None
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def _import_backend(module: str, backend: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CommandError(f"backend {backend!r} needs {module.split('.')[0]}, which is not "
                           f"installed (in the clone of xattn: pip install -e '.[{backend}]')"
                           ) from None


def load_backend(name: str, device: str, dtype: str) -> Backend:
    """Import the backend ``name`` (one of :data:`BACKENDS`) lazily and check that
    ``device`` (one of :data:`DEVICES`) and ``dtype`` work."""
    if name in ("numpy", "dask") and device != "cpu":
        raise CommandError(f"backend {name!r} runs on the CPU only; use --device cpu")
    if name == "cupy" and device != "cuda":
        raise CommandError("backend 'cupy' runs on CUDA only; use --device cuda")
    loader = {"numpy": _numpy, "torch": _torch, "jax": _jax, "cupy": _cupy, "dask": _dask}
    return loader[name](device, dtype)


def _converter(xp: Any, dtype: Any, device: Any) -> Callable[[np.ndarray], Any]:
    """The Array API way onto a device; torch and JAX have their own (below)."""
    return lambda host: xp.asarray(host, dtype=dtype, device=device)


def _numpy(device: str, dtype: str) -> Backend:
    import array_api_compat.numpy as xp

    return Backend("numpy", device, xp, _converter(xp, getattr(xp, dtype), "cpu"),
                   lambda out: out, tracemalloc_peak, np.__version__,
                   memory_method="tracemalloc: host bytes NumPy allocated during the call")


def _torch(device: str, dtype: str) -> Backend:
    torch = _import_backend("torch", "torch")
    import array_api_compat.torch as xp

    try:
        memory = torch_memory(device)
    except ValueError:
        raise CommandError("--device cuda: torch sees no CUDA device") from None
    torch_device = torch.device(memory.device)

    def torch_sync(out: Any) -> Any:
        if torch_device.type == "cuda":
            torch.cuda.synchronize(torch_device)
        return out

    torch_dtype = getattr(torch, dtype)
    return Backend("torch", str(torch_device), xp,
                   lambda host: torch.as_tensor(host, device=torch_device).to(torch_dtype),
                   torch_sync, memory.peak_memory, torch.__version__,
                   memory_available=(lambda: int(torch.cuda.mem_get_info(torch_device)[0]))
                   if torch_device.type == "cuda" else _host_available,
                   memory_method=memory.memory_method)


def _jax(device: str, dtype: str) -> Backend:
    jax = _import_backend("jax", "jax")
    jnp = importlib.import_module("jax.numpy")
    try:
        jax_device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    except RuntimeError:
        raise CommandError(f"--device {device}: JAX sees no such device") from None
    if dtype == "float64" and not jax.config.jax_enable_x64:
        raise CommandError("--dtype float64 with JAX needs the environment variable "
                           "JAX_ENABLE_X64=1")
    jax_dtype = getattr(jnp, dtype)
    return Backend("jax", str(jax_device), jnp,
                   lambda host: jax.device_put(jnp.asarray(host, dtype=jax_dtype), jax_device),
                   lambda out: out.block_until_ready(), _no_peak, jax.__version__,
                   memory_available=lambda: _jax_memory_available(jax_device),
                   memory_method="XLA memory_analysis() of the jit-compiled call: temp + "
                   "output bytes", compiled_peak=_jax_compiled_peak)


def _jax_memory_available(device: Any) -> int | None:
    if device.platform == "cpu":
        return _host_available()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def _cupy(device: str, dtype: str) -> Backend:
    cupy = _import_backend("cupy", "cupy")
    import array_api_compat.cupy as xp

    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception:
        raise CommandError("--device cuda: CuPy sees no CUDA device") from None

    def cupy_sync(out: Any) -> Any:
        cupy.cuda.get_current_stream().synchronize()
        return out

    def cupy_peak(run: Callable[[], Any]) -> tuple[Any, int | None]:
        hook = _cupy_peak_hook(cupy)
        with hook:
            result = run()
        return result, hook.peak

    return Backend("cupy", "cuda:0", xp, _converter(xp, getattr(xp, dtype), None),
                   cupy_sync, cupy_peak, cupy.__version__,
                   memory_available=lambda: int(cupy.cuda.runtime.memGetInfo()[0]),
                   memory_method="CuPy memory-pool hook: peak bytes handed out during the "
                   "call")


def _dask(device: str, dtype: str) -> Backend:
    dask = _import_backend("dask", "dask")
    import array_api_compat.dask.array as xp

    convert = _converter(xp, getattr(xp, dtype), "cpu")

    def to_dask(host: np.ndarray) -> Any:
        chunks = (1,) * (host.ndim - 2) + host.shape[-2:]  # one chunk per batch-head
        return convert(host).rechunk(chunks)

    return Backend("dask", device, xp, to_dask, lambda out: out.persist(), tracemalloc_peak,
                   dask.__version__, memory_method="tracemalloc: host bytes allocated while "
                   "the graph is computed (persist) in this process")


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
        if self.times:
            return statistics.median(self.times)
        assert self.first_time is not None  # read after a measured call
        return float(self.first_time)


def measured(function: Callable[..., Any], backend: Backend,
             measurement: Measurement) -> Callable[..., Any]:
    """Wrap ``function`` so that each call is synchronized, timed and (first) memory-traced.

    Not :mod:`timeit` (which times a statement in a loop, with no device synchronization
    and no memory trace of the first call) nor ``torch.utils.benchmark`` (torch only:
    the commands time NumPy, JAX, CuPy and Dask calls the same way).
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        if measurement.first_time is None and backend.compiled_peak is not None:
            # read from the compiled program before (and outside) the timed call
            measurement.peak_memory_bytes = backend.compiled_peak(function, args, kwargs)
            start = time.perf_counter()
            out = backend.sync(function(*args, **kwargs))
            measurement.first_time = time.perf_counter() - start
            return out
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
