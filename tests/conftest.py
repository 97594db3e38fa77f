"""The backend matrix: one ``backend`` fixture parametrized over array libraries.

``xp`` is the plain Array API namespace of the backend under test (as in scipy's and
array-api-extra's suites); ``backend`` is the same backend with the test helpers
(:meth:`Backend.asarray`, :meth:`Backend.check`, :meth:`Backend.to_numpy`, its ``name``
and ``device``). A test asks for whichever it needs; both follow one parametrization.

Select the backends with the environment variable ``XATTN_BACKENDS`` (comma-separated;
default: every CPU and GPU backend below). CPU backends must be installed (the ``test``
extra installs them); GPU backends skip cleanly when no GPU is present, so the same suite
runs on a GPU machine with plain ``python -m pytest`` against its installed packages::

    XATTN_BACKENDS=cupy,torch-cuda,jax-gpu python -m pytest

When ``XATTN_BACKENDS`` names only GPU backends, the run keeps only the GPU cases (see
:func:`is_gpu_case`) and deselects the rest, which the CPU runs cover. With the
environment variable ``XATTN_TEST_LOG`` set to a file name, each test's outcome is
written there as it finishes, one line ``nodeid outcome seconds``, so a run stopped at a
time limit still says what passed and what failed (``benchmarks/summarize_test_log.py``
counts the lines per backend).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


def _one_thread_per_worker() -> None:
    """Under pytest-xdist with several workers (``-n auto``: one per core), each worker
    computes with one thread: the test arrays are tiny, so the threads that torch, XLA and
    NumPy's BLAS would each start per core only contend with the other workers. Set
    before any of them is loaded (a variable the caller set is kept)."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= 1:
        return
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    # (XLA stops reading XLA_FLAGS at a word that is not a flag, such as the
    # "intra_op_parallelism_threads=1" often quoted beside this one: the flags after it,
    # the quick compiles below, were ignored in every worker)
    _add_xla_flags("--xla_cpu_multi_thread_eigen=false")


def _add_xla_flags(*flags: str) -> None:
    """Append ``flags`` to ``XLA_FLAGS`` (each unless it is there already: a worker
    inherits the variable its pytest-xdist controller set)."""
    present = os.environ.get("XLA_FLAGS", "")
    missing = [flag for flag in flags if flag not in present]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [present, *missing]))


def _quick_xla_compiles() -> None:
    """XLA compiles the tests' programs quickly: the suite compiles thousands of small
    programs (eager JAX compiles each operation for each new shape), each run a few
    times, so compiling, not running, is most of a JAX test's time. Two flags: no LLVM
    backend optimizations (a JAX-compiled windowed ``rfa`` ~40 % less CPU), and XLA's
    CPU loop emitters rather than its newer fusion emitters (about half the compile time
    of a small program again: 47 to 24 ms each). Both change how fast the machine code
    runs, not its arithmetic (no fast-math either way). XLA stops a process whose
    ``XLA_FLAGS`` name a flag it does not know, and newer XLA retired the CPU loop
    emitters with their flag: the second flag only for the jaxlib versions measured
    (before 0.11)."""
    _add_xla_flags("--xla_backend_optimization_level=0")
    try:
        from importlib.metadata import version

        major, minor = (int(part) for part in version("jaxlib").split(".")[:2])
    except Exception:  # no jaxlib, or a version string of another form
        return
    if (major, minor) < (0, 11):
        _add_xla_flags("--xla_cpu_use_fusion_emitters=false")


_one_thread_per_worker()
_quick_xla_compiles()

# after the thread settings above
import array_api_compat  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from array_api_extra._lib import _helpers as _xpx_helpers  # noqa: E402
from array_api_extra.testing import lazy_xp_function, patch_lazy_xp_functions  # noqa: E402

import xattn  # noqa: E402
from xattn._core.array import host_to_device  # noqa: E402

CPU_BACKENDS = ("numpy", "array_api_strict", "torch", "jax", "dask")
GPU_BACKENDS = ("cupy", "torch-cuda", "jax-gpu")
ALL_BACKENDS = CPU_BACKENDS + GPU_BACKENDS


def selected_backends() -> tuple[str, ...]:
    raw = os.environ.get("XATTN_BACKENDS", "")
    names = tuple(n.strip() for n in raw.split(",") if n.strip()) or ALL_BACKENDS
    unknown = set(names) - set(ALL_BACKENDS)
    if unknown:
        raise pytest.UsageError(f"XATTN_BACKENDS: unknown backends {sorted(unknown)}; "
                                f"choose from {', '.join(ALL_BACKENDS)}")
    return names


@dataclass
class Backend:
    """An array library on a device, as seen by the tests.

    ``ns`` is its Array API namespace; :meth:`asarray` places NumPy data on the backend's
    device.
    """

    name: str
    ns: Any
    device: Any
    is_native: Any = field(repr=False)

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        x = np.asarray(x)
        if dtype is None:
            dtype = {np.dtype(np.float64): self.ns.float64, np.dtype(np.float32): self.ns.float32,
                     np.dtype(bool): self.ns.bool}.get(x.dtype)
        return host_to_device(self.ns, x, dtype=dtype, device=self.device)

    def half_dtype(self) -> Any:
        """The half-precision dtype to test: bfloat16 where the library has it (torch,
        JAX), else float16; skips the test where the namespace has neither."""
        if not self.name.startswith(("numpy", "array_api_strict", "dask", "cupy")):
            half = getattr(self.ns, "bfloat16", None) or getattr(self.ns, "float16", None)
        else:
            half = getattr(self.ns, "float16", None)
        if half is None:
            pytest.skip(f"{self.name} has no half-precision dtype")
        return half

    def thin(self, values: Any, kept: Any, on: tuple[str, ...] = ()) -> list[Any]:
        """The values of a loop inside a test: all of ``values``, but on
        :data:`THIN_BACKENDS` (or those of them named in ``on``) only those in ``kept``
        (``XATTN_FULL=1``: all), as the ``thin`` marker does for a parameter. For sweeps
        of sizes, splits and kinds of input that run the same lines of xattn on every
        backend: each new size compiles again on JAX and builds a new graph on Dask,
        whose arithmetic is NumPy's own (``on=("dask",)`` where JAX's arithmetic is
        the point)."""
        values = list(values)
        costly = on or THIN_BACKENDS
        if self.name not in costly or os.environ.get("XATTN_FULL") == "1":
            return values
        thinned = [value for value in values if value in kept]
        assert thinned, f"thin: none of {kept!r} is among {values!r}"
        return thinned

    def settled(self, state: Any) -> Any:
        """A state (or any dataclass or collection of arrays) as the next call of a loop
        takes it: on Dask with its arrays computed into chunks (``dask.persist``), else
        as it is. A loop of calls that each continue the last one's state (decoding,
        pieces of a sequence) otherwise hands each call a graph that holds every earlier
        call, so that computing the n-th output runs the n calls before it again:
        quadratic in the number of calls. The calls themselves are the same (lazy: the
        fixture's check that they compute nothing still holds), and so are their
        outputs."""
        if self.name != "dask":
            return state
        import dask

        return dask.persist(state, optimize_graph=False)[0]

    def to_numpy(self, x: Any) -> np.ndarray:
        """A float64 (or bool) NumPy copy of a backend array."""
        if array_api_compat.is_torch_array(x):
            x = x.detach().cpu()
            return x.numpy() if x.dtype == self.ns.bool else x.double().numpy()
        if array_api_compat.is_dask_array(x):
            # as xattn built the graph: Dask's graph optimizations (culling, fusing) took
            # 13 % of a Dask test's time on the tests' small graphs of many layers
            x = x.compute(optimize_graph=False)
        if array_api_compat.is_cupy_array(x):
            x = x.get()
        x = np.asarray(x)
        return x if x.dtype == bool else x.astype(np.float64)

    def check(self, out: Any, expected: np.ndarray, *, dtype: Any, rtol: float | None = None,
              atol: float | None = None) -> None:
        """Assert that ``out`` is native to this backend, on its device, of ``dtype``,
        and equal to the float64 NumPy reference ``expected`` within the dtype tolerance."""
        assert self.is_native(out), f"result is a {type(out)}, not a {self.name} array"
        assert array_api_compat.device(out) == self.device, (
            f"result on {array_api_compat.device(out)}, expected {self.device}")
        assert out.dtype == dtype, f"result dtype {out.dtype}, expected {dtype}"
        if rtol is None:
            rtol = tolerance(self.ns, dtype)
        if atol is None:
            atol = rtol * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
        np.testing.assert_allclose(self.to_numpy(out), expected, rtol=rtol, atol=atol)


def tolerance(ns: Any, dtype: Any) -> float:
    """Relative tolerance of a dtype: float64 1e-10, float32 1e-5, half 1e-2."""
    if dtype == ns.float64:
        return 1e-10
    if dtype == ns.float32:
        return 2e-5
    return 2e-2


def _make_backend(name: str) -> Backend:
    if name == "numpy":
        return Backend(name, array_api_compat.array_namespace(np.empty(0)), "cpu",
                       array_api_compat.is_numpy_array)
    if name == "array_api_strict":
        strict = importlib.import_module("array_api_strict")
        return Backend(name, strict, strict.Device("CPU_DEVICE"),
                       lambda a: type(a).__module__.startswith("array_api_strict"))
    if name in ("torch", "torch-cuda"):
        torch = importlib.import_module("torch")
        if name == "torch-cuda" and not torch.cuda.is_available():
            pytest.skip("torch-cuda: no CUDA device")
        device = torch.device("cuda:0" if name == "torch-cuda" else "cpu")
        return Backend(name, array_api_compat.array_namespace(torch.empty(0)), device,
                       array_api_compat.is_torch_array)
    if name in ("jax", "jax-gpu"):
        jax = importlib.import_module("jax")
        # tests need float64 (the library never sets it): for this test only, undone after
        # it by the global-state guard (_global_state_unchanged)
        set_for_this_test(jax, "jax_enable_x64", True)
        if name == "jax-gpu":
            try:
                device = jax.devices("gpu")[0]
            except RuntimeError:
                pytest.skip("jax-gpu: no GPU device")
            # On a GPU, XLA computes float32 matrix products in TF32 by default (about
            # 3 significant digits), where torch and CuPy keep full float32; the float32
            # tolerances of this suite are those of float32 arithmetic, so the GPU run
            # asks for it (the docs' "On a GPU" section gives the measured effect).
            set_for_this_test(jax, "jax_default_matmul_precision", "highest")
        else:
            device = jax.devices("cpu")[0]
        return Backend(name, importlib.import_module("jax.numpy"), device,
                       array_api_compat.is_jax_array)
    if name == "dask":
        da = importlib.import_module("dask.array")
        return Backend(name, array_api_compat.array_namespace(da.empty(0)), "cpu",
                       array_api_compat.is_dask_array)
    if name == "cupy":
        try:
            cupy = importlib.import_module("cupy")
        except ImportError:
            pytest.skip("cupy: not installed")
        if not cupy.cuda.is_available():
            pytest.skip("cupy: no CUDA device")
        return Backend(name, array_api_compat.array_namespace(cupy.empty(0)),
                       cupy.cuda.Device(0), array_api_compat.is_cupy_array)
    raise AssertionError(name)


# The estimators run JIT-compiled on JAX and must never compute a Dask graph by
# themselves (array-api-extra's lazy testing): a test module opts in with
# ``lazy_xp_modules = [xattn]``, and the ``backend`` fixture patches the tagged functions.
for _estimator in (xattn.softmax_attention, xattn.rfa, xattn.ra, xattn.lara):
    lazy_xp_function(_estimator)

_jax_autojit = _xpx_helpers.jax_autojit


@functools.cache
def _jit_on_jax_inputs(function: Any) -> Any:
    """array-api-extra's ``jax.jit`` wrapper of a tagged function, called only when the
    call's arrays are JAX arrays.

    * One wrapper per function for the whole session (array-api-extra made a new one for
      every test, so every test compiled again what an earlier one had compiled: the
      same function, static options and shapes); JAX's cache serves them.
    * A call on NumPy arrays, a test's float64 reference such as the non-causal
      ``xattn.rfa`` of each prefix, runs the function itself, in NumPy: through the
      wrapper JAX compiled it anew for every prefix's shape, most of such a test's time.
    """
    jitted = _jax_autojit(function)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        arrays = [*args, *kwargs.values()]
        if any(array_api_compat.is_jax_array(value) for value in arrays):
            return jitted(*args, **kwargs)
        return function(*args, **kwargs)

    return call


_xpx_helpers.jax_autojit = _jit_on_jax_inputs


def is_gpu_case(item: pytest.Item) -> bool:
    """Whether a collected test exercises a GPU: one of its parameters names a GPU
    backend (the ``backend`` fixture's, or a test's own such as ``backend_name``), or it
    carries the ``gpu`` marker (a GPU test that does not take the fixture)."""
    if item.get_closest_marker("gpu") is not None:
        return True
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return any(isinstance(value, str) and value in GPU_BACKENDS for value in params)


#: Backends whose every call is costly (JAX compiles, Dask builds and runs a graph) and
#: whose path is NumPy's own code: a test marked ``thin`` runs there with fewer values
#: of its other parameters (see :func:`thinned`)
THIN_BACKENDS = ("jax", "dask")


def thinned(item: pytest.Item) -> bool:
    """Whether ``item`` is left out as a redundant case on a costly backend.

    ``@pytest.mark.thin(length=(17, 100))`` keeps, on :data:`THIN_BACKENDS`, only the
    cases whose ``length`` is one of those (every value still runs on NumPy,
    array-api-strict and torch, and on the GPU backends): the parameters it names test
    the same lines of xattn on every backend (block sizes, shapes, kinds of bad value),
    while what differs between backends (compiling, laziness, chunks) is exercised by the
    values kept. A selection with ``XATTN_FULL=1`` keeps every case."""
    marker = item.get_closest_marker("thin")
    callspec = getattr(item, "callspec", None)
    if marker is None or callspec is None or os.environ.get("XATTN_FULL") == "1":
        return False
    # the backend fixture's, or test_precision's half_backend
    if callspec.params.get("backend", callspec.params.get("half_backend")) not in THIN_BACKENDS:
        return False
    return any(callspec.params.get(name) not in kept for name, kept in marker.kwargs.items())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A GPU-only selection (``XATTN_BACKENDS`` names GPU backends only) runs the GPU
    cases only: every other test runs the same on the CPU backends' runs. The cases that
    :func:`thinned` leaves out are deselected."""
    lean = [item for item in items if not thinned(item)]
    if len(lean) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if thinned(item)])
        items[:] = lean
    if not set(selected_backends()) <= set(GPU_BACKENDS):
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (kept if is_gpu_case(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_test_log: list[Any] = []  # the open XATTN_TEST_LOG file, in the process that reports


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get("XATTN_TEST_LOG")
    if path and not hasattr(config, "workerinput"):  # not in a pytest-xdist worker
        log = open(path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed at unconfigure)
        log.write(f"# started {time.strftime('%Y-%m-%d %H:%M:%S')} "
                  f"XATTN_BACKENDS={os.environ.get('XATTN_BACKENDS', '')}\n")
        _test_log.append(log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One ``XATTN_TEST_LOG`` line per outcome as pytest reports it (with pytest-xdist,
    in the controller, as each worker's result arrives)."""
    if not _test_log:
        return
    if report.when == "call":
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        outcome = "error"  # in setup or teardown
    elif report.when == "setup" and report.skipped:
        outcome = "skipped"
    else:
        return
    _test_log[0].write(f"{report.nodeid} {outcome} {report.duration:.3f}\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _test_log:
        _test_log[0].write(f"# finished exit status {int(exitstatus)}\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    while _test_log:
        _test_log.pop().close()


# ---- global state: no test leaves it changed for the next ----------------------------

#: What the suite's own setup changed for one test (the jax backend's 64-bit mode, a GPU's
#: matmul precision, the ``jax_x64`` fixture): undone after the test, before the check.
_undo_after_test: list[Callable[[], None]] = []


def set_for_this_test(jax: Any, name: str, value: Any) -> None:
    """Set the JAX option ``name`` to ``value`` for the running test only (restored after
    it by :func:`_global_state_unchanged`)."""
    before = getattr(jax.config, name)
    if before != value:
        jax.config.update(name, value)
        _undo_after_test.append(lambda: jax.config.update(name, before))


#: The state of libraries first imported during a test, as they start (a test that
#: imports one and changes it at once is caught too); other values: as first seen
_STARTING_STATE = {"jax_enable_x64": os.environ.get("JAX_ENABLE_X64", "0").lower()
                   in ("1", "true", "yes", "on"),
                   "jax_default_matmul_precision": None, "jax_debug_nans": False,
                   "jax_disable_jit": False, "torch.default_dtype": "torch.float32",
                   "torch.grad_enabled": True, "torch.inference_mode": False,
                   "torch.deterministic": (False, False), "torch.default_device": "cpu"}
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_debug_nans",
                "jax_disable_jit", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion")


def global_state() -> dict[str, Any]:
    """The process-wide settings a test could leave changed: JAX's options (64-bit mode,
    matmul precision, ...), torch's default dtype and device, threads, autograd and
    deterministic modes, NumPy's floating-point error handling, Keras's dtype policy, the
    environment variables. Libraries not imported yet are left out (a few microseconds in
    all: it runs twice per test)."""
    # pytest's own (PYTEST_CURRENT_TEST), and inductor's note to its compile workers
    # (_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR, set at its first compilation)
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(("PYTEST_", "_TORCHINDUCTOR_"))}
    state: dict[str, Any] = {"numpy.errstate": np.geterr(), "environ": environ}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "are_deterministic_algorithms_enabled"):
        state.update({
            "torch.default_dtype": str(torch.get_default_dtype()),
            "torch.default_device": str(torch.get_default_device()),
            "torch.num_threads": torch.get_num_threads(),
            "torch.grad_enabled": torch.is_grad_enabled(),
            "torch.inference_mode": torch.is_inference_mode_enabled(),
            "torch.deterministic": (torch.are_deterministic_algorithms_enabled(),
                                    torch.is_deterministic_algorithms_warn_only_enabled()),
            "torch.float32_matmul_precision": torch.get_float32_matmul_precision()})
    jax = sys.modules.get("jax")
    if jax is not None and hasattr(jax, "config"):
        state.update({name: getattr(jax.config, name) for name in _JAX_OPTIONS})
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "config"):
        state["keras.floatx"] = keras.config.floatx()
        state["keras.dtype_policy"] = keras.config.dtype_policy().name
    return state


_state_at_start: dict[str, Any] = {}
_LIBRARIES = frozenset({"jax", "jaxlib", "torch", "flax", "keras", "tensorflow", "transformers",
                        "dask", "distributed", "cupy", "tokenizers", "matplotlib"})


@pytest.fixture(autouse=True)
def _global_state_unchanged(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves the global settings (:func:`global_state`) as the session
    started with them, so that no test's outcome depends on which ran before it in its
    worker: the suite's own per-test settings are undone, any other change fails the
    test (and is undone too, so that it fails alone). Use the ``jax_x64`` fixture,
    ``monkeypatch`` (``setenv``), or a context manager (``np.errstate``,
    ``torch.no_grad``) that restores what it changes. (Warning filters need no check:
    pytest restores them after each test.)"""
    for name, value in global_state().items():
        _state_at_start.setdefault(name, value)
    libraries = _LIBRARIES.intersection(sys.modules)
    yield
    while _undo_after_test:
        _undo_after_test.pop()()
    after = global_state()
    if not _LIBRARIES.intersection(sys.modules) <= libraries:
        # a library imported by this test may set variables as it starts (JAX:
        # TF_CPP_MIN_LOG_LEVEL, TPU_SKIP_MDS_QUERY): new ones are taken as the start's
        for key, value in after["environ"].items():
            _state_at_start["environ"].setdefault(key, value)
    changed = {}
    for name, value in after.items():
        expected = _state_at_start.setdefault(name, _STARTING_STATE.get(name, value))
        if value != expected:
            changed[name] = (expected, value)
    if "environ" in changed:  # only the variables that differ
        expected, value = changed["environ"]
        changed["environ"] = {key: (expected.get(key), value.get(key))
                              for key in expected.keys() | value.keys()
                              if expected.get(key) != value.get(key)}
    if not changed:
        return
    _restore(changed)
    pytest.fail(f"{request.node.nodeid} left global state changed for the next test "
                f"(name: (before, after)): {changed}", pytrace=False)


def _restore(changed: dict[str, Any]) -> None:
    """Put back the settings a test changed (so that the next test is not affected)."""
    jax, torch = sys.modules.get("jax"), sys.modules.get("torch")
    for name, difference in changed.items():
        if name in _JAX_OPTIONS and jax is not None:
            jax.config.update(name, difference[0])
        elif name == "numpy.errstate":
            np.seterr(**difference[0])
        elif name == "environ":
            for key, (before, _) in difference.items():
                if before is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = before
        elif name == "torch.default_dtype" and torch is not None:
            torch.set_default_dtype(getattr(torch, difference[0].removeprefix("torch.")))
        elif name == "torch.num_threads" and torch is not None:
            torch.set_num_threads(difference[0])
        elif name == "torch.grad_enabled" and torch is not None:
            torch.set_grad_enabled(difference[0])
        elif name == "torch.deterministic" and torch is not None:
            torch.use_deterministic_algorithms(difference[0][0], warn_only=difference[0][1])
        elif name == "torch.float32_matmul_precision" and torch is not None:
            torch.set_float32_matmul_precision(difference[0])


@pytest.fixture
def jax_x64() -> Any:
    """JAX with its 64-bit mode on for this test only (float64 references); the mode it
    had is restored after the test."""
    jax = pytest.importorskip("jax")
    set_for_this_test(jax, "jax_enable_x64", True)
    return jax


@pytest.fixture(params=selected_backends())
def backend(request) -> Iterator[Backend]:
    """The backend under test, with the test helpers (see the module docstring)."""
    selected = _make_backend(request.param)
    with patch_lazy_xp_functions(request, xp=selected.ns):
        yield selected


@pytest.fixture
def xp(backend: Backend) -> Any:
    """The Array API namespace of the backend under test."""
    return backend.ns


@pytest.fixture
def rng() -> np.random.Generator:
    """A fixed-seed NumPy generator for test data."""
    return np.random.default_rng(20221122)
