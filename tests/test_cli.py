"""The ``xattn`` command end to end (small sizes): outputs, figures, bad input, backends."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import xattn
from xattn import cli
from xattn.diagnostics import estimator_error, structured_attention_inputs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def small_inputs(seed=0, heads=2, length=24, head_dim=8):
    q, k, v = structured_attention_inputs(num_heads=heads, length=length,
                                          head_dim=head_dim, num_clusters=4, seed=seed)
    return q, k, v


@pytest.fixture
def npz(tmp_path):
    path = tmp_path / "qkv.npz"
    np.savez(path, **dict(zip("qkv", small_inputs(), strict=True)))
    return path


def load_json(path):
    """Strict JSON: NaN and infinity are not JSON (the command writes null instead)."""
    def refuse(token):
        raise AssertionError(f"{path} holds {token}")
    return json.loads(path.read_text(), parse_constant=refuse)


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

    payload = load_json(out_dir / "compare.json")
    cells = [(row["estimator"], row["samples"]) for row in payload["results"]]
    assert cells == [("rfa", 2), ("rfa", 4), ("ra", 2), ("ra-biased", 2), ("ra-det", None),
                     ("lara", 2), ("lara", 4), ("lara-det", 2), ("lara-det", 4)]
    assert payload["skipped"] == [
        {"estimator": name, "samples": 4, "reason": "above --ra-max-samples 2"}
        for name in ("ra", "ra-biased")]
    assert payload["draws"] == 3 and payload["seed"] == 5
    for name in ("ra-biased", "ra-det", "lara-det"):  # the evaluation-mode rows, in the table
        assert any(line.startswith(name + " ") for line in out.splitlines())

    # the JSON is reproduced by estimator_error with the same seed on the same float32 data
    q, k, v = (a.astype(np.float32) for a in small_inputs())
    for row in payload["results"]:
        spec = cli.ESTIMATOR_SPECS[row["estimator"]]
        draws = 1 if spec.deterministic else 3
        expected = estimator_error(spec.load(), q, k, v, draws=draws, seed=5,
                                   **{spec.sample_keyword: row["samples"] or 1}, **spec.options)
        assert row["seeds"] == {"first": 5, "last": 5 + draws - 1}  # summarized
        for field in ("mse", "bias_squared", "variance", "relative_error"):
            assert row[field] == pytest.approx(getattr(expected, field), rel=1e-9, abs=0)
        assert row["mse"] > 0 and row["time_s"] > 0 and row["peak_memory_bytes"] > 0
        if spec.deterministic:  # nothing is drawn: no variance
            assert row["variance"] == 0 and row["draws"] == 1
    uniform = np.broadcast_to(v.mean(axis=-2, keepdims=True), v.shape)
    exact = xattn.softmax_attention(q, k, v)
    assert payload["baseline"]["mse"] == pytest.approx(np.mean((uniform - exact) ** 2), rel=1e-5)


def test_default_caps_ra_samples(tmp_path, npz, capsys):
    code, out, _ = run(capsys, "compare", "--input", npz, "--samples", "8,64,128",
                       "--estimators", "ra", "--draws", 1, "--out", tmp_path)
    assert code == 0
    payload = load_json(tmp_path / "compare.json")
    assert [row["samples"] for row in payload["results"]] == [8, 64]
    assert payload["ra_max_samples"] == 64
    assert "skipped (cost O(N M S D)): ra S=128" in out


def test_console_module_in_a_subprocess(tmp_path, npz):
    result = subprocess.run(
        [sys.executable, "-m", "xattn.cli", "compare", "--input", str(npz), "--samples", "2",
         "--estimators", "rfa", "--draws", "2", "--out", str(tmp_path), "--progress"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "xattn compare" in result.stderr  # the progress bar goes to stderr
    payload = load_json(tmp_path / "compare.json")
    assert payload["results"][0]["estimator"] == "rfa"
    check_png(tmp_path / "compare.png")


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case,message", [
    ("missing", "missing array(s) v"),
    ("rank", "k must have shape (..., M, D) (rank >= 2)"),
    ("nan", "array q contains NaN or inf"),
    ("inf", "array v contains NaN or inf"),
    ("head_dim", "q and k must have the same last dim D"),
    ("num_keys", "k and v must have the same number of keys M"),
    ("leading", "do not broadcast"),
    ("complex", "must be real numbers"),
    ("garbage", "not an .npz archive"),
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
    (["bench", "--samples", "rfa=4,rfa=8"], "--samples: rfa is given twice (rfa=4 and rfa=8)"),
    (["bench", "--estimators", "rfa,lara", "--samples", "lara=2,rfa=4,lara=2"],
     "--samples: lara is given twice"),
    (["bench", "--samples", "4,8"], "--samples: two counts for all estimators (4 and 8)"),
    (["compare", "--draws", "1000001"], "argument --draws: expected an int <= 1000000"),
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
    if backend == "jax":  # each call compiles: two random estimators (their draws agree)
        argv += ["--estimators", "rfa,ra"]
    code, _, err = run(capsys, *argv, "--backend", backend, "--out", tmp_path / backend)
    assert code == 0, err
    code, _, err = run(capsys, *argv, "--out", tmp_path / "numpy")
    assert code == 0, err
    results = {}
    for name in (backend, "numpy"):
        payload = load_json(tmp_path / name / "compare.json")
        assert payload["environment"]["backend"] == name
        results[name] = payload["results"]
        check_png(tmp_path / name / "compare.png")
    # an int seed draws the same numbers on every backend: float32 figures agree
    for row, numpy_row in zip(results[backend], results["numpy"], strict=True):
        assert row["mse"] == pytest.approx(numpy_row["mse"], rel=1e-3)
        assert row["peak_memory_bytes"] > 0  # torch.profiler / XLA memory analysis


def test_bench_small(tmp_path, capsys):
    code, out, err = run(capsys, "bench", "--lengths", "16,32", "--head-dim", 8,
                         "--samples", "24,ra=1", "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "bench.json")
    assert set(payload["results"]) == {"softmax (xattn)", "rfa", "ra", "lara"}  # no native
    assert payload["samples"] == {"softmax (xattn)": None, "rfa": 24, "ra": 1, "lara": 24}
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
    payload = load_json(tmp_path / "bench.json")
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


def assert_usage_error(code, err, *fragments):
    """Exit code 2, exactly one line on stderr, no traceback, every fragment named."""
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


# --- estimator lists: never double counted -------------------------------------------


@pytest.mark.parametrize("command", ["compare", "bench"])
@pytest.mark.parametrize("estimators,message", [
    ("softmax", "softmax is the exact reference"),
    ("softmax,rfa", "softmax is the exact reference"),
    ("rfa,rfa", "rfa is named twice"),
    ("lara,rfa,lara", "lara is named twice"),
    ("ra-det,ra,ra-det", "ra-det is named twice"),
])
def test_repeated_or_reference_estimators_are_rejected(tmp_path, capsys, command, estimators,
                                                       message):
    code, _, err = run(capsys, command, "--estimators", estimators, "--out", tmp_path)
    assert_usage_error(code, err, message)
    assert not list(tmp_path.glob("*.json"))


def test_compare_measures_each_sample_count_once(tmp_path, npz, capsys, monkeypatch):
    """--samples 4,4,8,4: S = 4 and S = 8 are measured once each (in the order given)."""
    calls = []
    real = cli.compare.estimator_error

    def counting(estimator, *args, **kwargs):
        calls.append(kwargs.get("num_features"))
        return real(estimator, *args, **kwargs)

    monkeypatch.setattr(cli.compare, "estimator_error", counting)
    code, out, err = run(capsys, "compare", "--input", npz, "--samples", "4,4,8,4",
                         "--draws", 1, "--estimators", "rfa", "--out", tmp_path,
                         "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "compare.json")
    assert payload["samples"] == [4, 8]
    assert [row["samples"] for row in payload["results"]] == [4, 8]
    assert calls == [None, 4, 8]  # the uniform baseline, then each cell once
    assert [line.split()[:2] for line in out.splitlines()
            if line.startswith("rfa ")] == [["rfa", "4"], ["rfa", "8"]]


@pytest.mark.parametrize("spec,expected", [
    ("4", {"rfa": 4, "lara": 4}),
    ("rfa=4,lara=2", {"rfa": 4, "lara": 2}),
    ("lara=2,4", {"rfa": 4, "lara": 2}),  # the plain int: every estimator not named
    ("4,lara=2", {"rfa": 4, "lara": 2}),  # ... in either order
])
def test_bench_samples_each_estimator_once(tmp_path, capsys, spec, expected):
    code, _, err = run(capsys, "bench", "--estimators", "rfa,lara", "--lengths", 8,
                       "--head-dim", 4, "--samples", spec, "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "bench.json")
    assert payload["samples"] == {"softmax (xattn)": None, **expected}


def test_compare_draws_are_bounded_up_front(tmp_path, capsys, monkeypatch):
    """A billion draws per cell is refused with one line naming the figure, before any
    work and without listing the seeds; the bound itself is accepted."""
    def no_work(*args, **kwargs):
        raise AssertionError("work started on an absurd --draws")

    for name in ("load_backend", "estimator_error", "output_dir"):
        monkeypatch.setattr(cli.compare, name, no_work)
    code, _, err = run(capsys, "compare", "--draws", "1000000000", "--samples", 2,
                       "--out", tmp_path)
    assert_usage_error(code, err, "--draws", "1000000000", "<= 1000000")
    assert not list(tmp_path.iterdir())
    args = cli.build_parser().parse_args(["compare", "--draws", str(cli.compare.MAX_DRAWS)])
    assert args.draws == cli.compare.MAX_DRAWS == 10**6


def test_bench_measures_each_estimator_once_per_length(tmp_path, capsys):
    code, out, err = run(capsys, "bench", "--estimators", "lara,rfa", "--lengths", "16,8,16",
                         "--head-dim", 4, "--samples", 4, "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "bench.json")
    assert list(payload["results"]) == ["softmax (xattn)", "lara", "rfa"]
    assert payload["lengths"] == [8, 16]
    for rows in payload["results"].values():
        assert [row["length"] for row in rows] == [8, 16]
    table = [line.split()[0] for line in out.splitlines() if line.split()[:1] in (["8"], ["16"])]
    assert table == ["8", "16"]


# --- --out is checked before any work -------------------------------------------------


def unwritable_out_dirs(tmp_path):
    regular_file = tmp_path / "a-file"
    regular_file.write_text("not a directory")
    cases = {"under /proc": Path("/proc/xattn-test/out"),
             "/proc itself": Path("/proc"),  # exists, but takes no new file, even as root
             "under a file": regular_file / "out",
             "a file": regular_file}
    if hasattr(os, "geteuid") and os.geteuid() != 0:  # root may write anywhere
        read_only = tmp_path / "read-only"
        read_only.mkdir()
        read_only.chmod(0o500)
        cases["read-only"] = read_only
    return cases


@pytest.mark.parametrize("command", ["compare", "bench"])
def test_unwritable_out_fails_before_any_work(tmp_path, capsys, monkeypatch, command):
    def no_work(*args, **kwargs):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr(cli.compare, "load_backend", no_work)
    monkeypatch.setattr(cli.bench, "load_backend", no_work)
    for name, out in unwritable_out_dirs(tmp_path).items():
        code, _, err = run(capsys, command, "--out", out)
        assert_usage_error(code, err, f"--out {out}: cannot")
        assert not Path("/proc/xattn-test").exists(), name


@pytest.mark.parametrize("command", ["compare", "bench"])
@pytest.mark.parametrize("suffix", ["json", "png"])
def test_output_name_taken_by_a_directory_fails_before_any_work(tmp_path, capsys,
                                                                 monkeypatch, command, suffix):
    """DIR/compare.json (or .png) existing as a directory: nothing could be written at the
    end, so the command fails first, naming it."""
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the output files were checked")

    monkeypatch.setattr(cli.compare, "load_backend", no_work)
    monkeypatch.setattr(cli.bench, "load_backend", no_work)
    taken = tmp_path / f"{command}.{suffix}"
    taken.mkdir()
    code, _, err = run(capsys, command, "--out", tmp_path)
    assert_usage_error(code, err, f"--out {tmp_path}: cannot write {taken}: it is a directory")
    assert taken.is_dir() and list(tmp_path.iterdir()) == [taken]


def test_existing_output_files_are_overwritten(tmp_path, npz, capsys):
    """Regular files of the output names are no obstacle: they are replaced."""
    for name in ("compare.json", "compare.png"):
        (tmp_path / name).write_text("old")
    code, _, err = run(capsys, "compare", "--input", npz, "--samples", 2, "--draws", 1,
                       "--estimators", "rfa", "--out", tmp_path, "--no-progress")
    assert code == 0, err
    assert load_json(tmp_path / "compare.json")["command"] == "compare"
    check_png(tmp_path / "compare.png")


# --- hostile .npz files ---------------------------------------------------------------


def patch_zip_headers(path, *, flag_bits=None, method=None):
    """Set the general-purpose flags and/or compression method of every zip member."""
    data = bytearray(path.read_bytes())
    for signature, flag_offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        start = data.find(signature)
        while start >= 0:
            if flag_bits is not None:
                data[start + flag_offset:start + flag_offset + 2] = flag_bits.to_bytes(2, "little")
            if method is not None:
                data[start + flag_offset + 2:start + flag_offset + 4] = method.to_bytes(2, "little")
            start = data.find(signature, start + 4)
    path.write_bytes(bytes(data))


def npy_bytes(header, payload=b""):
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + payload


def write_members(path, **members):
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, content in members.items():
            archive.writestr(f"{name}.npy", content)
    return path


def valid_npy(array):
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.mark.parametrize("case,message", [
    ("huge shape", "declares shape (10000000, 10000000)"),
    ("shape larger than the data", "declares shape (24, 8)"),
    ("compression method 99", "compression method 99"),
    ("encrypted", "is encrypted"),
    ("text file", "not an .npz archive"),
    ("empty file", "not an .npz archive"),
    ("object array", "pickled (object) data"),
    ("bad npy header", "not a valid .npy array"),
    ("corrupt data", "cannot read it as an .npz file"),
])
def test_hostile_npz_is_a_usage_error(tmp_path, capsys, case, message):
    q, k, v = small_inputs()
    good = {"k": valid_npy(k), "v": valid_npy(v)}
    path = tmp_path / "hostile.npz"
    if case == "huge shape":
        write_members(path, q=npy_bytes({"descr": "<f8", "fortran_order": False,
                                          "shape": (10**7, 10**7)}, b"\0" * 64), **good)
    elif case == "shape larger than the data":
        write_members(path, q=npy_bytes({"descr": "<f8", "fortran_order": False,
                                          "shape": (24, 8)}, b"\0" * 64), **good)
    elif case == "compression method 99":
        write_members(path, q=valid_npy(q), **good)
        patch_zip_headers(path, method=99)
    elif case == "encrypted":
        write_members(path, q=valid_npy(q), **good)
        patch_zip_headers(path, flag_bits=0x1)
    elif case == "text file":
        path.write_text("q, k, v\n1, 2, 3\n")
    elif case == "empty file":
        path.write_bytes(b"")
    elif case == "object array":
        np.savez(path, q=np.array([{"a": 1}, None], dtype=object), k=k, v=v)
    elif case == "bad npy header":
        write_members(path, q=b"\x93NUMPY\x01\x00\x10\x00{'descr': 'junk'", **good)
    elif case == "corrupt data":
        np.savez_compressed(path, q=q, k=k, v=v)
        data = bytearray(path.read_bytes())
        middle = data.find(b"PK\x03\x04") + 200
        data[middle:middle + 40] = bytes(40)  # deflate stream or CRC breaks
        path.write_bytes(bytes(data))
    code, _, err = run(capsys, "compare", "--input", path, "--out", tmp_path / "out")
    assert_usage_error(code, err, message, str(path))
    assert not (tmp_path / "out" / "compare.json").exists()


# --- values that overflow after the cast ----------------------------------------------


@pytest.mark.parametrize("dtype,name,value,message", [
    ("float32", "q", 1e39, "array q overflows float32"),
    ("float32", "v", -1e39, "array v overflows float32"),
    ("float32", "k", 1e30, "array k holds values up to 1e+30, too large for float32"),
    ("float32", "v", 1e30, "array v holds values up to 1e+30, too large for float32"),
    ("float64", "q", 1e200, "array q holds values up to 1e+200, too large for float64"),
    ("float64", "k", 1e300, "array k holds values up to 1e+300, too large for float64"),
])
def test_values_are_validated_after_the_cast(tmp_path, capsys, dtype, name, value, message):
    arrays = dict(zip("qkv", small_inputs(), strict=True))
    arrays[name][1, 5, 2] = value
    path = write_npz(tmp_path / "large.npz", **arrays)
    code, _, err = run(capsys, "compare", "--input", path, "--dtype", dtype,
                       "--out", tmp_path / "out")
    assert_usage_error(code, err, message)
    assert not (tmp_path / "out" / "compare.json").exists()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_accepted_values_give_strict_json_and_a_plot(tmp_path, capsys, dtype):
    """Just inside the accepted range, the run completes: every figure finite or null
    (never NaN in the JSON, never a NaN point in the plot)."""
    from xattn.cli.inputs import largest_safe_value

    arrays = dict(zip("qkv", small_inputs(), strict=True))
    for name in "qkv":
        arrays[name][0, 3, 1] = 0.9 * largest_safe_value(dtype, 24)
    path = write_npz(tmp_path / "large.npz", **arrays)
    code, out, err = run(capsys, "compare", "--input", path, "--dtype", dtype, "--samples", 4,
                         "--draws", 2, "--estimators", "rfa,lara,lara-det,ra-det",
                         "--out", tmp_path)
    assert code == 0, err
    payload = load_json(tmp_path / "compare.json")
    for row in payload["results"]:
        assert row["mse"] is None or np.isfinite(row["mse"])
    assert ("non-finite outputs" in out) == any(row["mse"] is None
                                                for row in payload["results"])
    check_png(tmp_path / "compare.png")


@pytest.mark.parametrize("estimators", ["rfa,lara,ra-det", "rfa,lara"])
def test_non_finite_rows_are_null_in_the_json_and_left_out_of_the_plot(
        tmp_path, npz, capsys, monkeypatch, estimators):
    """Estimators forced to give NaN (rfa) and inf (lara, lara-det) outputs: the run
    completes (exit 0), their figures are null in strict JSON, the table says so, and
    the plot is drawn from what is finite (ra-det and the baseline; the baseline alone
    in the second case)."""
    real_rfa, real_lara = xattn.rfa, xattn.lara

    def spoiled(function, value):
        def estimator(*args, **kwargs):
            out = np.array(function(*args, **kwargs))
            out[..., 1, 0] = value
            return out
        return estimator

    monkeypatch.setattr(xattn, "rfa", spoiled(real_rfa, np.nan))
    monkeypatch.setattr(xattn, "lara", spoiled(real_lara, np.inf))
    code, out, err = run(capsys, "compare", "--input", npz, "--samples", "2,4", "--draws", 2,
                         "--estimators", estimators, "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "compare.json")
    spoilt = {"rfa", "lara"}
    names = {row["estimator"] for row in payload["results"]}
    assert spoilt <= names
    for row in payload["results"]:
        figures = [row[field] for field in ("mse", "bias_squared", "relative_error")]
        if row["estimator"] in spoilt:
            assert figures == [None, None, None], row
        else:
            assert all(np.isfinite(figure) for figure in figures), row
    assert np.isfinite(payload["baseline"]["mse"])
    assert "non-finite outputs (rfa S=2, rfa S=4, lara S=2, lara S=4)" in out
    check_png(tmp_path / "compare.png")


# --- absurd sizes are refused up front -------------------------------------------------


@pytest.mark.parametrize("argv,fragments", [
    (["compare", "--samples", "1000000000000", "--estimators", "rfa"],
     ("rfa with 1000000000000 samples needs about", "available on")),
    # on N = 1024 queries the same count is refused by LARA's own check (C <= N) first
    (["compare", "--samples", "16,1000000000", "--estimators", "lara"],
     ("lara with num_samples=1000000000", "must be <= the number of queries N = 1024")),
    (["bench", "--head-dim", "1000000000"], ("needs about", "available on")),
    (["bench", "--lengths", "1000000000"], ("at N = 1000000000", "available on")),
    (["bench", "--heads", "10000000000", "--lengths", "1024"], ("needs about",
                                                                "available on")),
])
def test_absurd_sizes_are_refused_up_front(tmp_path, capsys, monkeypatch, argv, fragments):
    calls = []
    monkeypatch.setattr(cli.compare, "estimator_error",
                        lambda *args, **kwargs: calls.append(args))  # no estimator may run
    code, _, err = run(capsys, *argv, "--out", tmp_path)
    assert_usage_error(code, err, *fragments)
    assert calls == [] and not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("available_mib,refused", [(1, True), (4096, False)])
def test_memory_estimate_against_the_memory_available(tmp_path, npz, capsys, monkeypatch,
                                                      available_mib, refused):
    """The same small run is refused or run according to the memory said to be free."""
    from xattn.cli import memory

    monkeypatch.setattr(memory, "host_memory_available", lambda: available_mib * 2**20)
    code, _, err = run(capsys, "compare", "--input", npz, "--estimators", "ra",
                       "--samples", 64, "--ra-max-samples", 0, "--draws", 1, "--out", tmp_path)
    if refused:
        assert_usage_error(code, err, "ra with 64 samples needs about", "1.0 MiB available")
    else:
        assert code == 0, err


# --- peak memory on every CPU backend ----------------------------------------------------


def needs(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


@pytest.mark.parametrize("backend,method", [("torch", "torch.profiler"),
                                            ("jax", "memory_analysis()"),
                                            ("numpy", "tracemalloc"),
                                            ("dask", "tracemalloc")])
def test_bench_reports_peak_memory_and_how(tmp_path, capsys, backend, method):
    needs(backend)
    # every estimator where a call is cheap; on JAX (each call compiles) and Dask, RFA
    # besides the exact rows: the method of measuring is the backend's, not the estimator's
    estimators = ("--estimators", "rfa", "--samples", "8") if backend in ("jax", "dask") \
        else ("--samples", "8,ra=1")
    code, out, err = run(capsys, "bench", "--backend", backend, "--lengths", "32,64",
                         "--head-dim", 8, *estimators, "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "bench.json")
    assert method in payload["peak_memory_method"] and method in out
    for rows in payload["results"].values():
        for row in rows:
            assert isinstance(row["peak_memory_bytes"], int) and row["peak_memory_bytes"] > 0
    if backend != "dask":  # Dask's first call also counts its one-time graph machinery
        # exact softmax holds N x chunk scores: its peak grows with N
        softmax = [row["peak_memory_bytes"] for row in payload["results"]["softmax (xattn)"]]
        assert softmax[1] > softmax[0]


@pytest.mark.parametrize("backend,kernel", [
    ("torch", "softmax (torch SDPA)"), ("jax", "softmax (jax.nn.dot_product_attention)")])
def test_bench_measures_the_frameworks_fused_kernel(tmp_path, capsys, backend, kernel):
    """On torch and JAX the fused kernel is a row of its own, named after it; the headline
    crossover is against the faster exact row at each length, and each exact row has its
    own crossover too."""
    needs(backend)
    code, out, err = run(capsys, "bench", "--backend", backend, "--lengths", "16,32",
                         "--head-dim", 8, "--estimators", "rfa", "--samples", 8,
                         "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "bench.json")
    assert list(payload["results"]) == ["softmax (xattn)", kernel, "rfa"]
    assert all(row["time_s"] > 0 for row in payload["results"][kernel])
    assert set(payload["crossover_length_by_reference"]) == {"softmax (xattn)", kernel}
    fastest = cli.bench.fastest_rows([payload["results"]["softmax (xattn)"],
                                      payload["results"][kernel]])
    assert payload["crossover_length"] == {
        "rfa": cli.crossover_length(fastest, payload["results"]["rfa"])}
    assert kernel in out


def test_bench_compile_times_the_compiled_estimators(tmp_path, capsys):
    """``--compile`` (torch): each estimator compiled whole, timed after the warm-up call
    that compiles it, beside the eager fused kernel; refused on other backends before any
    work."""
    needs("torch")
    code, out, err = run(capsys, "bench", "--backend", "torch", "--lengths", "16,40",
                         "--head-dim", 8, "--estimators", "rfa,lara", "--samples", 8,
                         "--compile", "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "bench.json")
    assert payload["compiled"] is True
    assert "rfa (compiled)" in out and "lara (compiled)" in out
    names = ["rfa", "lara", "rfa (compiled)", "lara (compiled)"]
    assert list(payload["results"]) == ["softmax (xattn)", "softmax (torch SDPA)", *names]
    assert all(row["time_s"] > 0 for name in names for row in payload["results"][name])
    assert payload["samples"]["rfa (compiled)"] == payload["samples"]["rfa"] == 8
    assert set(payload["crossover_length"]) == set(names)
    code, _, err = run(capsys, "bench", "--backend", "numpy", "--compile", "--out",
                         tmp_path / "numpy", "--no-progress")
    assert code != 0 and "--compile" in err and "--backend torch" in err
    assert not (tmp_path / "numpy").exists()


def test_bench_skips_the_fused_kernel_where_it_does_not_fit(tmp_path, capsys, monkeypatch):
    """JAX's kernel forms the (N, M) scores on a CPU: at lengths where its estimate exceeds
    the memory available, its row is skipped with the figure, and the others still run."""
    needs("jax")
    load_backend = cli.bench.load_backend

    def small_machine(*args):
        backend = load_backend(*args)
        backend.memory_available = lambda: 100 * 2**20  # the 4096^2 scores need 128 MiB
        return backend

    monkeypatch.setattr(cli.bench, "load_backend", small_machine)
    code, _, err = run(capsys, "bench", "--backend", "jax", "--lengths", "64,4096",
                       "--head-dim", 4, "--estimators", "rfa", "--samples", 4,
                       "--out", tmp_path, "--no-progress")
    assert code == 0, err
    rows = load_json(tmp_path / "bench.json")["results"]
    native = rows["softmax (jax.nn.dot_product_attention)"]
    assert native[0]["time_s"] > 0
    assert native[1]["time_s"] is None and "more than the 100.0 MiB" in native[1]["skipped"]
    assert all(row["time_s"] > 0 for row in rows["softmax (xattn)"] + rows["rfa"])


@pytest.mark.parametrize("mebibytes", [1, 8])
def test_peak_memory_counters_see_a_known_allocation(mebibytes):
    """Each backend's counter reports at least the bytes of a tensor made in the call and
    not much more (the figure is what the call allocates, not the process)."""
    from xattn.cli.measure import load_backend

    size = mebibytes * 2**20
    numpy_backend = load_backend("numpy", "cpu", "float32")
    _, peak = numpy_backend.peak_memory(lambda: np.ones(size // 4, dtype=np.float32))
    assert size <= peak < size + 2**20
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch_backend = load_backend("torch", "cpu", "float32")
        _, peak = torch_backend.peak_memory(lambda: torch.ones(size // 4) * 2)
        assert 2 * size <= peak < 2 * size + 2**20  # ones and the product
    if importlib.util.find_spec("jax") is not None:
        import jax.numpy as jnp

        jax_backend = load_backend("jax", "cpu", "float32")
        x = jnp.ones(size // 4, dtype=jnp.float32)
        peak = jax_backend.compiled_peak(lambda x: jnp.exp(x) * 2 + x, (x,), {})
        assert size <= peak < 3 * size  # the output, and at most a temporary


# --- rfa+window ----------------------------------------------------------------------------


def test_compare_window_and_sinks_rows(tmp_path, npz, capsys):
    """`--window 16 --sinks 1` adds rfa+window next to plain rfa (added when not listed)
    and the uniform baseline, reproduced by estimator_error with the same options."""
    code, out, err = run(capsys, "compare", "--input", npz, "--window", 16, "--sinks", 1,
                         "--estimators", "lara", "--samples", "4,8", "--draws", 2,
                         "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "compare.json")
    cells = [(row["estimator"], row["samples"]) for row in payload["results"]]
    assert cells == [("rfa", 4), ("rfa", 8), ("rfa+window", 4), ("rfa+window", 8),
                     ("lara", 4), ("lara", 8)]
    assert payload["estimators"]["rfa+window"]["options"] == {"window": 16, "sinks": 1}
    assert any(line.startswith("rfa+window ") for line in out.splitlines())
    assert "uniform" in out
    q, k, v = (a.astype(np.float32) for a in small_inputs())
    for row in payload["results"][2:4]:
        expected = estimator_error(xattn.rfa, q, k, v, draws=2, seed=0, window=16, sinks=1,
                                   num_features=row["samples"])
        assert row["mse"] == pytest.approx(expected.mse, rel=1e-9)
    check_png(tmp_path / "compare.png")


@pytest.mark.parametrize("argv,exact", [(["--window", 0], False), (["--window", 23], True),
                                        (["--window", 23, "--sinks", 3], True)])
def test_compare_window_limits(tmp_path, npz, capsys, argv, exact):
    """window 0 (no band, no sinks) is plain rfa for the same seed; a band that covers
    every key (N = M = 24) is exact attention."""
    code, _, err = run(capsys, "compare", "--input", npz, *argv, "--estimators", "rfa",
                       "--samples", 4, "--draws", 2, "--out", tmp_path)
    assert code == 0, err
    plain, windowed = load_json(tmp_path / "compare.json")["results"]
    assert (plain["estimator"], windowed["estimator"]) == ("rfa", "rfa+window")
    if exact:
        assert windowed["mse"] < 1e-10 < plain["mse"]
    else:
        assert windowed["mse"] == plain["mse"]


@pytest.mark.parametrize("argv,message", [
    (["--sinks", 25], "rfa+window with num_features=4:"),
    (["--window", -1], "expected an int >= 0"),
    (["--sinks", "x"], "expected an int >= 0"),
])
def test_compare_window_bad_values(tmp_path, npz, capsys, argv, message):
    code, _, err = run(capsys, "compare", "--input", npz, *argv, "--estimators", "rfa",
                       "--samples", 4, "--out", tmp_path)
    assert_usage_error(code, err, message)


def test_compare_checks_every_cell_against_the_input_before_any_work(tmp_path, capsys,
                                                                       monkeypatch):
    """A sample count one estimator cannot take on the loaded shapes (LARA's C > N here,
    N = 24) is refused in one line naming the cell and the real shapes, before the
    backend is loaded, any cell runs or the output directory is made."""
    q, k, v = small_inputs(length=24)
    path = tmp_path / "qkv.npz"
    np.savez(path, q=q, k=k, v=v)

    def no_work(*args, **kwargs):
        raise AssertionError("work started before every cell was checked")

    for name in ("load_backend", "estimator_error", "output_dir"):
        monkeypatch.setattr(cli.compare, name, no_work)
    out = tmp_path / "out"
    code, out_text, err = run(capsys, "compare", "--input", path, "--samples", "4,32",
                              "--estimators", "rfa,lara", "--out", out)
    assert_usage_error(code, err, "lara with num_samples=32", str(q.shape))
    assert out_text == "" and not out.exists()


def test_version_option_and_metadata(capsys):
    """``xattn --version`` prints the package version, which is the installed metadata's
    (pyproject.toml takes it from ``xattn.__version__``)."""
    import importlib.metadata

    code, out, err = run(capsys, "--version")
    assert code == 0, err
    assert out == "xattn 0.1.0\n"
    assert xattn.__version__ == "0.1.0"
    assert importlib.metadata.version("xattn") == xattn.__version__


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_bench_decode_measures_each_variant_at_each_position(tmp_path, capsys, backend):
    """Per-token decoding from a state: RFA's state has the same bytes at every position,
    softmax's key-value cache grows in proportion to the position."""
    needs(backend)
    # JAX compiles each variant at each position: one position there (the sizes' growth
    # with the position is the same arithmetic on every backend)
    positions = [10] if backend == "jax" else [10, 40]
    code, out, err = run(capsys, "bench", "--decode", "--backend", backend, "--lengths",
                         ",".join(map(str, positions[::-1])), "--head-dim", 4,
                         "--samples", 6, "--window", 3, "--sinks", 2, "--decode-steps", 2,
                         "--out", tmp_path, "--no-progress")
    assert code == 0, err
    payload = load_json(tmp_path / "decode.json")
    assert payload["positions"] == positions and payload["jit"] == (backend == "jax")
    rows = payload["results"]
    assert list(rows) == ["softmax (KV cache)", "rfa", "rfa+window 3, 2 sinks"]
    for name, variant_rows in rows.items():
        assert [row["position"] for row in variant_rows] == positions
        assert all(row["ms_per_token"] > 0 and len(row["all_ms"]) == 2
                   for row in variant_rows)
        sizes = [row["state_bytes"] for row in variant_rows]
        if name.startswith("softmax"):  # keys and values (4 floats each) and a flag, per token
            assert sizes == [position * (2 * 4 * 4 + 1) for position in positions]
        else:
            assert sizes[0] == sizes[-1] > 0
    assert set(payload["overtaking_position"]) == {"rfa", "rfa+window 3, 2 sinks"}
    check_png(tmp_path / "decode.png")
    assert "[ms/token]" in out


def test_bench_decode_refuses_bad_arguments_before_any_work(tmp_path, capsys):
    code, _, err = run(capsys, "bench", "--decode", "--samples", "rfa=4", "--out", tmp_path)
    assert_usage_error(code, err, "--samples", "--decode")
    code, _, err = run(capsys, "bench", "--decode", "--lengths", "1000000000",
                       "--out", tmp_path)
    assert_usage_error(code, err, "key-value cache", "1000000000")
    assert not (tmp_path / "decode.json").exists()


@pytest.mark.parametrize("arguments, option", [
    (["--samples", "1000000000"], "--samples 1000000000"),
    (["--samples", "20000000"], "--samples 20000000"),
    (["--window", "1000000000"], "--window 1000000000"),
    (["--sinks", "1000000000"], "--sinks 1000000000"),
    (["--sinks", "3000000"], "--sinks 3000000"),
], ids=["samples-1e9", "samples-2e7", "window", "sinks-1e9", "sinks-3e6"])
def test_bench_decode_counts_rfa_state_in_its_memory_check(arguments, option, tmp_path,
                                                           capsys):
    """RFA's state (samples x Dv sums, the window's and the sinks' keys and values) and
    the calls that make it are in the memory check: too large is one line naming the
    option, exit 2, before any work."""
    out = tmp_path / "out"
    code, text, err = run(capsys, "bench", "--decode", *arguments, "--out", out,
                          "--no-progress")
    assert_usage_error(code, err, "needs about", option)
    assert text == "" and not out.exists()


@pytest.mark.parametrize("head_dim, samples, window, sinks", [
    (16, 2048, 0, 0), (16, 16, 2048, 1), (16, 16, 4, 1024), (64, 512, 64, 4)])
def test_bench_decode_memory_estimate_covers_a_measured_run(head_dim, samples, window,
                                                            sinks):
    """What tracemalloc sees NumPy allocate while ``bench --decode`` builds RFA's state up
    to a position and steps from it stays below the estimate of its memory check."""
    import tracemalloc

    from xattn.cli.decode import DecodeVariant, measure_decode, rfa_decode_bytes
    from xattn.cli.measure import load_backend
    backend = load_backend("numpy", "cpu", "float32")
    options = {"num_features": samples, "rng": 0}
    if window or sinks:
        options.update(window=window, sinks=sinks)
    tracemalloc.start()
    try:
        measure_decode(backend, [DecodeVariant("rfa", xattn.rfa, options)], [2500], heads=2,
                       head_dim=head_dim, steps=1, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    estimate = rfa_decode_bytes(heads=2, head_dim=head_dim, samples=samples, window=window,
                                sinks=sinks, position=2500, itemsize=4)
    assert peak < estimate, (peak, estimate)


def test_bench_decode_reports_the_overtaking_position_as_a_bracket(tmp_path, capsys,
                                                                   monkeypatch):
    """Where RFA is slower at 16,384 and faster from 65,536 on, the verdict and the JSON
    say between 16,384 and 65,536 (32,768 was not measured), not "from 65,536"."""
    from xattn.cli import decode

    def measured(backend, variants, positions, **kwargs):
        times = {"softmax (KV cache)": [0.1, 0.2, 0.4, 1.6], "rfa": [0.5, 0.5, 0.5, 0.5],
                 "rfa+window 64, 1 sink": [0.01, 0.01, 0.01, 0.01]}
        return {variant.name: [{"position": position, "ms_per_token": time,
                                "all_ms": [time], "state_bytes": 1}
                               for position, time in zip(positions, times[variant.name],
                                                         strict=True)]
                for variant in variants}

    monkeypatch.setattr(decode, "measure_decode", measured)
    code, out, err = run(capsys, "bench", "--decode", "--lengths", "1024,4096,16384,65536",
                         "--out", tmp_path, "--no-progress")
    assert code == 0, err
    assert "rfa: faster per token than softmax's cache from a position between 16,384 and " \
           "65,536 on" in out
    assert "rfa+window 64, 1 sink: faster per token than softmax's cache at every measured " \
           "position" in out
    payload = load_json(tmp_path / "decode.json")
    assert payload["overtaking_bracket"] == {"rfa": [16384, 65536],
                                             "rfa+window 64, 1 sink": [None, 1024]}


def test_bench_reports_the_crossover_as_a_bracket(tmp_path, capsys, monkeypatch):
    """The crossover of xattn bench is a bracket between measured lengths too."""
    from xattn.cli import bench
    times = {16: 1.0, 32: 1.0, 64: 1.0}  # rfa; softmax: 0.5, 0.9, 4.0

    def fake_measured(function, backend, measurement):
        def call(q, k, v, **options):
            length = q.shape[-2]
            time = times[length] if "num_features" in options else {
                16: 0.5, 32: 0.9, 64: 4.0}[length]
            measurement.first_time, measurement.times = time, [time]
            measurement.peak_memory_bytes = 1
        return call

    monkeypatch.setattr(bench, "measured", fake_measured)
    code, out, err = run(capsys, "bench", "--backend", "numpy", "--estimators", "rfa",
                         "--lengths", "16,32,64", "--head-dim", 4, "--out", tmp_path,
                         "--no-progress")
    assert code == 0, err
    assert "rfa: faster than exact softmax (the faster implementation) from an N between " \
           "32 and 64 on" in out
    assert load_json(tmp_path / "bench.json")["crossover_bracket"] == {"rfa": [32, 64]}


@pytest.mark.parametrize("draws, repeats", [(1, 3), (6, 2)])
def test_compare_times_each_cell_by_the_median_of_repeated_calls(draws, repeats, tmp_path,
                                                                  npz, capsys, monkeypatch):
    """The time of every cell (each estimator, the uniform baseline, exact softmax) is the
    median of at least --repeats timed calls after a warm-up call, not one call; the
    table and the JSON say so."""
    from xattn.cli import compare
    calls: dict[str, int] = {}
    real = compare.measured

    def counted(function, backend, measurement):
        call = real(function, backend, measurement)

        def wrapped(*args, **kwargs):
            calls[function.__name__] = calls.get(function.__name__, 0) + 1
            return call(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(compare, "measured", counted)
    code, out, err = run(capsys, "compare", "--input", npz, "--samples", 2, "--estimators",
                         "rfa,lara-det", "--draws", draws, "--repeats", repeats, "--out",
                         tmp_path, "--no-progress")
    assert code == 0, err
    timed = max(repeats, draws - 1)  # the draws after the first are timed too
    assert calls["rfa"] == 1 + timed and calls["lara"] == 1 + repeats
    assert calls["uniform_attention"] == calls["softmax_attention"] == 1 + repeats
    payload = load_json(tmp_path / "compare.json")
    assert payload["repeats"] == repeats and "median" in payload["time_rule"]
    assert [row["timed_calls"] for row in payload["results"]] == [timed, repeats]
    assert payload["baseline"]["timed_calls"] == payload["exact"]["timed_calls"] == repeats
    assert f"median of at least {repeats} timed calls" in out
