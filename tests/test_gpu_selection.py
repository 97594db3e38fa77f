"""The GPU-only selection and the per-test log of ``conftest.py``, and the log's summary.

Each check runs pytest in a fresh process on a small test file, with this directory's
``conftest.py`` loaded as a plugin (``-p conftest``), as a GPU run would use it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent
SUMMARY_SCRIPT = TESTS.parent / "benchmarks" / "summarize_test_log.py"

SAMPLE = textwrap.dedent("""
    import pytest

    def test_plain():
        pass

    def test_on_backend(backend):
        pass

    def test_on_xp(xp):
        pass

    @pytest.mark.gpu
    def test_marked():
        pass

    @pytest.mark.parametrize("backend", ["torch", "numpy"])
    def test_own_cpu_backend(backend):
        pass

    @pytest.mark.parametrize("backend_name", ["cupy", "numpy"])
    def test_backend_name(backend_name):
        pass
""")

OUTCOMES = textwrap.dedent("""
    import pytest

    def test_passes(backend):
        pass

    def test_fails():
        assert False

    def test_skips():
        pytest.skip("no reason")

    @pytest.mark.xfail(strict=True)
    def test_xfails():
        assert False

    @pytest.fixture
    def broken():
        raise RuntimeError("setup")

    def test_setup_error(broken):
        pass
""")


def run_pytest(tmp_path: Path, source: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(source, encoding="utf-8")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers -p no:cacheprovider\nmarkers =\n    gpu: GPU\n",
        encoding="utf-8")
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("PYTEST_ADDOPTS", "XATTN_TEST_LOG", "XATTN_BACKENDS")}
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    environment.update(env)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:xdist",
                           "-p", "no:randomly", *args, "test_sample.py"],
                          cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=300, check=False)


def collected(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return sorted(line.split("::", 1)[1] for line in result.stdout.splitlines()
                  if line.startswith("test_sample.py::"))


def test_gpu_only_selection_keeps_the_gpu_cases_only(tmp_path):
    result = run_pytest(tmp_path, SAMPLE, "--collect-only", "-q", XATTN_BACKENDS="torch-cuda")
    assert collected(result) == ["test_backend_name[cupy]", "test_marked",
                                 "test_on_backend[torch-cuda]", "test_on_xp[torch-cuda]"]
    assert "4/8 tests collected (4 deselected)" in result.stdout, result.stdout


def test_a_selection_with_a_cpu_backend_keeps_every_test(tmp_path):
    result = run_pytest(tmp_path, SAMPLE, "--collect-only", "-q",
                        XATTN_BACKENDS="numpy,torch-cuda")
    assert len(collected(result)) == 10
    assert "deselected" not in result.stdout, result.stdout


def test_the_log_has_a_line_per_finished_test(tmp_path):
    log = tmp_path / "tests.log"
    result = run_pytest(tmp_path, OUTCOMES, "-q", XATTN_BACKENDS="numpy",
                        XATTN_TEST_LOG=str(log))
    assert result.returncode == 1, result.stdout + result.stderr
    lines = log.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# started ") and lines[0].endswith("XATTN_BACKENDS=numpy")
    assert lines[-1] == "# finished exit status 1"
    outcomes = {line.split()[0].split("::")[1]: line.split()[1] for line in lines[1:-1]}
    assert outcomes == {"test_passes[numpy]": "passed", "test_fails": "failed",
                        "test_skips": "skipped", "test_xfails": "xfailed",
                        "test_setup_error": "error"}
    for line in lines[1:-1]:
        float(line.split()[2])  # the seconds


def load_summary():
    spec = importlib.util.spec_from_file_location("summarize_test_log", SUMMARY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_counts_per_backend_and_names_the_failures():
    summary = load_summary()
    log = "\n".join([
        "# started 2026-01-01 00:00:00 XATTN_BACKENDS=cupy,torch-cuda,jax-gpu",
        "tests/test_a.py::test_x[cupy-float32] passed 0.5",
        "tests/test_a.py::test_x[torch-cuda-float32] failed 1.5",
        "tests/test_a.py::test_x[jax-gpu-float32] skipped 0.0",
        "tests/test_b.py::test_y[torch-cuda] passed 1.0",
        "tests/test_c.py::test_supported[jax-gpu-rfa-causal] error 0.3",
        "tests/test_flax_module.py::test_step[rfa] passed 2.0",
    ])
    report = summary.summarize(log, "created: 12/12 workers\n12 workers [9 items]\n")
    assert report.splitlines() == [
        "cupy: 1 passed (0.5 s in tests)",
        "torch-cuda: 1 failed, 1 passed (2.5 s in tests)",
        "jax-gpu: 1 error, 1 skipped (0.3 s in tests)",
        "other: 1 passed (2.0 s in tests)",
        "FAILED tests/test_a.py::test_x[torch-cuda-float32]",
        "ERROR tests/test_c.py::test_supported[jax-gpu-rfa-causal]",
        "6 of 9 collected tests reported; 3 did not finish",
        "the run did not finish (stopped before pytest's end)",
    ]
    assert summary.summarize(log + "\n# finished exit status 0").endswith(
        "finished exit status 0")
    assert summary.summarize(log, slowest=2).splitlines()[-3:] == [
        "slowest 2 tests (seconds):",
        "    2.00 tests/test_flax_module.py::test_step[rfa] passed",
        "    1.50 tests/test_a.py::test_x[torch-cuda-float32] failed",
    ]


def test_time_by_file_sums_each_file_and_its_jax_and_dask_cases():
    summary = load_summary()
    log = "\n".join([
        "# started 2026-01-01 00:00:00 XATTN_BACKENDS=",
        "tests/test_a.py::test_x[jax-float32] passed 3.0",
        "tests/test_a.py::test_x[jax-gpu-float32] skipped 0.5",
        "tests/test_a.py::test_x[dask] passed 2.0",
        "tests/test_a.py::test_x[numpy] passed 1.0",
        "tests/test_b.py::test_y passed 0.5",
        "# finished exit status 0",
    ])
    assert summary.time_by_file(log).splitlines()[2:] == [
        "| `tests/test_a.py` | 4 | 6 | 92.9 % | 3 | 2 |",
        "| `tests/test_b.py` | 1 | 0 | 7.1 % | 0 | 0 |",
        "| all | 5 | 7 | 100 % | 3 | 2 |",
    ]
