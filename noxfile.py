"""Sessions: ``nox -s tests`` (CPU backend matrix), ``tests_gpu``, ``keras``, ``lint``,
``docs``.

Environments use ``constraints.txt`` (known-good pins; torch must be pinned). nox's
``uv`` backend does not read pip's local wheel folder, so sessions use virtualenv + pip.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["lint", "tests"]

CONSTRAINTS = ("-c", "constraints.txt")
CPU_BACKENDS = ["numpy", "array_api_strict", "torch", "jax", "dask"]


@nox.session
@nox.parametrize("backend", CPU_BACKENDS)
def tests(session: nox.Session, backend: str) -> None:
    """The test suite on one CPU backend (every backend-independent test runs too)."""
    session.install(*CONSTRAINTS, "-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "auto", *session.posargs,
                env={"XATTN_BACKENDS": backend})


@nox.session
@nox.parametrize("backend", ["jax", "torch"])
def keras(session: nox.Session, backend: str) -> None:
    """xattn.keras on one Keras backend, in a minimal environment: the layer's extra and
    the backend's, without the other frameworks (the ``tests`` sessions run the same
    checks with everything installed)."""
    session.install(*CONSTRAINTS, "-e", f".[keras,{backend}]")
    session.run("python", "tests/keras_checks.py", *session.posargs,
                env={"KERAS_BACKEND": backend})


@nox.session(venv_backend="none")
def tests_gpu(session: nox.Session) -> None:
    """GPU backends against the packages already installed on the machine: the GPU cases
    only (the rest are deselected), each backend skipping cleanly where no GPU (or no
    package) is present.

    Each test's outcome is written as it finishes to ``$XATTN_TEST_LOG`` (default
    ``gpu_test_outcomes.txt``), which ``benchmarks/summarize_test_log.py`` counts per
    backend, also after a run stopped at a time limit; the 25 slowest tests are listed.
    """
    log = os.environ.get("XATTN_TEST_LOG", "gpu_test_outcomes.txt")
    session.run("python", "-m", "pytest", "-n", "auto", "-v", "--durations=25",
                *session.posargs,
                env={"XATTN_BACKENDS": "cupy,torch-cuda,jax-gpu", "XATTN_TEST_LOG": log,
                     # the pytest-xdist workers share the GPU
                     "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    session.run("python", "benchmarks/summarize_test_log.py", "--slowest", "0", log)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, over the sources, tests, benchmarks and docs; mypy over src/xattn."""
    # the test extras: mypy follows the imports of torch, JAX, Flax, Dask and matplotlib
    session.install(*CONSTRAINTS, "-e", ".[test]", "ruff", "mypy")
    session.run("ruff", "check", ".")
    session.run("mypy")  # files and settings: [tool.mypy] in pyproject.toml


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx documentation with warnings as errors."""
    # the gallery runs examples on torch, JAX and Dask: install the backends too
    session.install(*CONSTRAINTS, "-e", ".[docs,cli,torch,jax,dask]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")
    session.run("python", "docs/_scripts/check_offline.py", "docs/_build/html")
