"""The ``xattn`` command end to end (small sizes): outputs, figures, bad input, backends."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import xattn
from xattn import cli
from xattn.diagnostics import estimator_error, structured_attention_inputs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SAMPLE_KEYWORDS = {"rfa": "num_features", "ra": "num_samples", "lara": "num_samples"}


def small_inputs(seed=0, heads=2, length=24, head_dim=8):
    q, k, v = structured_attention_inputs(num_heads=heads, length=length,
                                          head_dim=head_dim, num_clusters=4, seed=seed)
    return q, k, v


@pytest.fixture
def npz(tmp_path):
    path = tmp_path / "qkv.npz"
    np.savez(path, **dict(zip("qkv", small_inputs(), strict=True)))
    return path


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def check_png(path: Path):
    from matplotlib import image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_compare_end_to_end(tmp_path, npz, capsys):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "compare", "--input", npz, "--samples", "2,4", "--draws", 3,
                         "--seed", 5, "--out", out_dir, "--ra-max-samples", 2, "--no-progress")
    assert code == 0, err
    assert {p.name for p in out_dir.iterdir()} == {"compare.json", "compare.png"}
    check_png(out_dir / "compare.png")
    assert "uniform" in out and "rfa" in out and "lara" in out

    payload = json.loads((out_dir / "compare.json").read_text())
    cells = [(row["estimator"], row["samples"]) for row in payload["results"]]
    assert cells == [("rfa", 2), ("rfa", 4), ("ra", 2), ("lara", 2), ("lara", 4)]
    assert payload["skipped"] == [{"estimator": "ra", "samples": 4,
                                   "reason": "above --ra-max-samples 2"}]
    assert payload["draws"] == 3 and payload["seed"] == 5

    # the JSON is reproduced by estimator_error with the same seed on the same float32 data
    q, k, v = (a.astype(np.float32) for a in small_inputs())
    for row in payload["results"]:
        function = getattr(xattn, row["estimator"])
        expected = estimator_error(function, q, k, v, draws=3, seed=5,
                                   **{SAMPLE_KEYWORDS[row["estimator"]]: row["samples"]})
        assert row["seeds"] == [5, 6, 7]
        for field in ("mse", "bias_squared", "variance", "relative_error"):
            assert row[field] == pytest.approx(getattr(expected, field), rel=1e-9, abs=0)
        assert row["mse"] > 0 and row["time_s"] > 0 and row["peak_memory_bytes"] > 0
    uniform = np.broadcast_to(v.mean(axis=-2, keepdims=True), v.shape)
    exact = xattn.softmax_attention(q, k, v)
    assert payload["baseline"]["mse"] == pytest.approx(np.mean((uniform - exact) ** 2), rel=1e-5)


def test_default_caps_ra_samples(tmp_path, npz, capsys):
    code, out, _ = run(capsys, "compare", "--input", npz, "--samples", "8,64,128",
                       "--estimators", "ra", "--draws", 1, "--out", tmp_path)
    assert code == 0
    payload = json.loads((tmp_path / "compare.json").read_text())
    assert [row["samples"] for row in payload["results"]] == [8, 64]
    assert payload["ra_max_samples"] == 64
    assert "skipped at samples 128" in out


def test_console_module_in_a_subprocess(tmp_path, npz):
    result = subprocess.run(
        [sys.executable, "-m", "xattn.cli", "compare", "--input", str(npz), "--samples", "2",
         "--estimators", "rfa", "--draws", "2", "--out", str(tmp_path), "--progress"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "xattn compare" in result.stderr  # the progress bar goes to stderr
    payload = json.loads((tmp_path / "compare.json").read_text())
    assert payload["results"][0]["estimator"] == "rfa"
    check_png(tmp_path / "compare.png")


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case,message", [
    ("missing", "missing array(s) v"),
    ("rank", "array k must have shape (..., M, D) (rank >= 2)"),
    ("nan", "array q contains NaN or inf"),
    ("inf", "array v contains NaN or inf"),
    ("head_dim", "q and k must have the same last dim D"),
    ("num_keys", "k and v must have the same number of keys M"),
    ("leading", "do not broadcast"),
    ("complex", "must be real numbers"),
    ("garbage", "cannot read it as an .npz file"),
    ("absent", "cannot read it as an .npz file"),
    ("npy", "not an .npz archive"),
])
def test_bad_input_files(tmp_path, capsys, case, message):
    q, k, v = small_inputs()
    path = tmp_path / "bad.npz"
    if case == "missing":
        write_npz(path, q=q, k=k)
    elif case == "rank":
        write_npz(path, q=q, k=k[0, 0], v=v)
    elif case == "nan":
        q[0, 3, 1] = np.nan
        write_npz(path, q=q, k=k, v=v)
    elif case == "inf":
        v[1, 0, 0] = np.inf
        write_npz(path, q=q, k=k, v=v)
    elif case == "head_dim":
        write_npz(path, q=q, k=k[..., :4], v=v)
    elif case == "num_keys":
        write_npz(path, q=q, k=k, v=v[..., :10, :])
    elif case == "leading":
        write_npz(path, q=q, k=np.concatenate([k, k, k]), v=np.concatenate([v, v, v]))
    elif case == "complex":
        write_npz(path, q=q * 1j, k=k, v=v)
    elif case == "garbage":
        path.write_bytes(b"this is not a zip archive")
    elif case == "absent":
        path = tmp_path / "absent.npz"
    elif case == "npy":
        path = tmp_path / "q.npy"
        np.save(path, q)
    code, _, err = run(capsys, "compare", "--input", path, "--out", tmp_path / "out")
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err and str(path) in err
    assert not (tmp_path / "out" / "compare.json").exists()


@pytest.mark.parametrize("argv,message", [
    (["compare", "--backend", "tensorflow"], "unknown backend 'tensorflow'"),
    (["compare", "--estimators", "rfa,nystrom"], "unknown estimator 'nystrom'"),
    (["bench", "--estimators", "performer"], "unknown estimator 'performer'"),
    (["compare", "--backend", "numpy", "--device", "cuda"], "runs on the CPU only"),
    (["compare", "--device", "tpu"], "unknown device 'tpu'"),
    (["compare", "--samples", "16,x"], "expected comma-separated ints"),
    (["compare", "--draws", "0"], "expected an int >= 1"),
    (["bench", "--samples", "rfa=0"], "--samples: expected an int >= 1"),
    (["bench", "--time-limit", "-1"], "expected a number >= 0"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    code, _, err = run(capsys, *argv, "--out", tmp_path)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err


def test_estimator_errors_are_one_line(tmp_path, npz, capsys):
    """LARA with more samples than queries is a ValueError of the estimator: exit 2."""
    code, _, err = run(capsys, "compare", "--input", npz, "--estimators", "lara",
                       "--samples", "25", "--out", tmp_path)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("xattn compare: error: lara with num_samples=25:")


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_compare_on_other_backends(tmp_path, npz, capsys, backend):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    argv = ["compare", "--input", npz, "--samples", "4", "--draws", 2, "--seed", 1]
    code, _, err = run(capsys, *argv, "--backend", backend, "--out", tmp_path / backend)
    assert code == 0, err
    code, _, err = run(capsys, *argv, "--out", tmp_path / "numpy")
    assert code == 0, err
    results = {}
    for name in (backend, "numpy"):
        payload = json.loads((tmp_path / name / "compare.json").read_text())
        assert payload["environment"]["backend"] == name
        results[name] = payload["results"]
        check_png(tmp_path / name / "compare.png")
    # an int seed draws the same numbers on every backend: float32 figures agree
    for row, numpy_row in zip(results[backend], results["numpy"], strict=True):
        assert row["mse"] == pytest.approx(numpy_row["mse"], rel=1e-3)


def test_bench_small(tmp_path, capsys):
    code, out, err = run(capsys, "bench", "--lengths", "16,32", "--head-dim", 8,
                         "--samples", "24,ra=1", "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert set(payload["results"]) == {"softmax", "rfa", "ra", "lara"}
    assert payload["samples"] == {"softmax": None, "rfa": 24, "ra": 1, "lara": 24}
    assert [row["samples"] for row in payload["results"]["lara"]] == [16, 24]  # C <= N
    for rows in payload["results"].values():
        assert [row["length"] for row in rows] == [16, 32]
        assert all(row["time_s"] > 0 and row["peak_memory_bytes"] > 0 for row in rows)
    assert set(payload["crossover_length"]) == {"rfa", "ra", "lara"}
    assert all(value in (None, 16, 32) for value in payload["crossover_length"].values())
    check_png(tmp_path / "bench.png")
    assert "exact softmax" in out


def test_bench_time_limit_skips_longer_lengths(tmp_path, capsys):
    code, out, err = run(capsys, "bench", "--lengths", "32,16", "--head-dim", 4,
                         "--estimators", "rfa", "--samples", "4", "--time-limit", "1e-9",
                         "--out", tmp_path)
    assert code == 0, err
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["lengths"] == [16, 32]
    for rows in payload["results"].values():
        assert rows[0]["time_s"] > 0
        assert rows[1]["time_s"] is None and "--time-limit" in rows[1]["skipped"]
    assert payload["crossover_length"] == {"rfa": None}
    assert "skipped" in out
    check_png(tmp_path / "bench.png")


def test_crossover_length():
    exact = [{"length": n, "time_s": t} for n, t in [(1, 1.0), (2, 2.0), (4, 4.0), (8, 8.0)]]

    def rows(times):
        return [{"length": n, "time_s": t} for n, t in zip([1, 2, 4, 8], times, strict=True)]

    assert cli.crossover_length(exact, rows([2.0, 3.0, 3.0, 4.0])) == 4
    assert cli.crossover_length(exact, rows([0.5, 3.0, 3.0, 4.0])) == 4  # not faster at 2
    assert cli.crossover_length(exact, rows([0.5, 1.0, 3.0, 4.0])) == 1
    assert cli.crossover_length(exact, rows([2.0, 3.0, 5.0, 9.0])) is None
    # skipped runs (None): softmax's last measured time bounds it; a skipped estimator loses
    exact[3]["time_s"] = None
    assert cli.crossover_length(exact, rows([2.0, 3.0, 3.0, 3.5])) == 4
    assert cli.crossover_length(exact, rows([2.0, 3.0, 3.0, 4.5])) is None
    assert cli.crossover_length(exact, rows([0.5, 1.0, 3.0, None])) is None


def test_help_documents_the_default_input(capsys):
    code, out, _ = run(capsys, "compare", "--help")
    assert code == 0
    assert "N = M = 1024" in out and "D = Dv = 64" in out
