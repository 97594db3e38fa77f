"""The capability matrix: estimator x backend x feature, each cell exercised here.

``docs/capabilities.md`` is generated from the tables of this module
(``python docs/_scripts/capabilities.py``), and :func:`test_capability_page_is_up_to_date`
fails when the committed page differs. Each cell of the page is one of

* ``yes``: :func:`test_supported` runs the feature with that estimator on that backend
  and checks the result (against the NumPy result of the same call and seed, plus the
  property that defines the feature);
* ``no``: the estimator does not offer the feature; :func:`test_unsupported` checks that
  asking for it raises a clear error naming the keyword: ``TypeError`` for a keyword the
  estimator does not take, ``ValueError`` for a value of a keyword it takes
  (:data:`UNSUPPORTED_ERROR`, empty since LARA has a causal form);
* ``yes (GPU)``: as ``yes``, on a GPU backend; CI has no GPU, so these cases ran on a
  lent NVIDIA H200 (``XATTN_BACKENDS=cupy,torch-cuda,jax-gpu``, the same tests, which
  skip without a GPU), not on every commit;
* ``untested``: could work, but no test exercises it (:data:`UNTESTED` says why);
* ``—``: the library has no such mechanism (no compiler, no autodiff, no sharded arrays,
  no half-precision dtype).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import xattn
from conftest import CPU_BACKENDS, GPU_BACKENDS, _make_backend, selected_backends

ESTIMATORS = ("softmax_attention", "rfa", "ra", "lara")
FEATURES = ("causal", "key mask", "query mask", "jit", "grad", "sharding",
            "half precision")
#: Page columns: backend name (as in ``XATTN_BACKENDS``) and its heading.
BACKENDS = {"numpy": "NumPy", "array_api_strict": "array-api-strict",
            "torch": "torch CPU", "torch-cuda": "torch CUDA", "jax": "JAX CPU",
            "jax-gpu": "JAX GPU", "dask": "Dask", "cupy": "CuPy"}

#: Features an estimator does not offer (asking for them raises UNSUPPORTED_ERROR's error,
#: TypeError where it lists none).
UNSUPPORTED = {
    ("softmax_attention", "query mask"): {"query_mask": "mask"},
    ("rfa", "query mask"): {"query_mask": "mask"},
    ("ra", "query mask"): {"query_mask": "mask"},
}
#: Unsupported features asked for by a keyword the estimator takes: a ValueError.
UNSUPPORTED_ERROR: dict[tuple[str, str], type] = {}

#: (backend, feature) pairs for which the library has no mechanism, with the reason.
NOT_APPLICABLE = {
    **{(b, "jit"): "no compiler" for b in ("numpy", "array_api_strict", "dask", "cupy")},
    **{(b, "grad"): "no autodiff" for b in ("numpy", "array_api_strict", "dask", "cupy")},
    **{(b, "sharding"): "single-device arrays" for b in ("numpy", "array_api_strict", "cupy")},
    ("array_api_strict", "half precision"): "no half-precision dtype in the standard",
}
#: Cells that could work but that no test exercises (rather than claim them).
UNTESTED = {(b, "sharding"): "torch's DTensor is not tested" for b in ("torch", "torch-cuda")}

HOW = {
    "causal": "``causal=True`` matches NumPy, and changing the last key and value leaves "
              "every earlier output unchanged",
    "key mask": "``key_mask`` matches NumPy, and changing the masked keys and values "
                "changes nothing",
    "query mask": "``query_mask`` matches NumPy, and changing the masked queries leaves "
                  "the other outputs unchanged",
    "jit": "the compiled call equals the eager one (``jax.jit``; ``torch.compile`` with "
           "graph breaks allowed)",
    "grad": "gradients with respect to q, k and v equal finite differences in float64 "
            "(``torch.autograd.gradcheck``, ``jax.test_util.check_grads``)",
    "sharding": "inputs split along the sequence (4 Dask chunks; 4 JAX host devices under "
                "``jax.jit``) give the unsplit result",
    "half precision": "half-precision inputs (bfloat16 on torch and JAX, else float16) "
                      "give a result in that dtype, within its rounding of the float32 "
                      "result",
}


def cell(estimator: str, backend: str, feature: str) -> str:
    """The page's entry for one cell (see the module docstring)."""
    if (backend, feature) in NOT_APPLICABLE:
        return "—"
    if (estimator, feature) in UNSUPPORTED:
        return "no"
    if (backend, feature) in UNTESTED:
        return "untested"
    return "yes (GPU)" if backend in GPU_BACKENDS else "yes"


def render_page() -> str:
    """The Markdown of ``docs/capabilities.md``."""
    lines = [
        "# Capability matrix",
        "",
        "What each estimator supports on each backend. This page is generated from",
        "`tests/test_capabilities.py` (`python docs/_scripts/capabilities.py`), and the test",
        "suite fails when it is out of date. Every **yes** is a test case,",
        "`test_supported[<backend>-<estimator>-<feature>]`, run on every CPU backend;",
        "**no** means that the estimator does not offer the feature and raises an error",
        "naming the keyword (also tested: a `TypeError`); **yes (GPU)** is the same test",
        "case on a GPU backend: CI has no",
        "GPU, so these ran on lent GPUs (CuPy 14.2, torch 2.11 with CUDA 13.0, JAX 0.11.2;",
        "`benchmarks/gpu/run_gpu.sh`), last on 2026-11-27: CuPy and torch CUDA on an NVIDIA",
        "H200, JAX GPU on an H100, every case passed; see {ref}`on-a-gpu`), not on every",
        "commit; **untested** could work but no test",
        "exercises it; **—** means that the library has no such mechanism.",
        "",
    ]
    header = "| feature | " + " | ".join(BACKENDS.values()) + " |"
    rule = "|---|" + "---|" * len(BACKENDS)
    for estimator in ESTIMATORS:
        lines += [f"## {{func}}`xattn.{estimator}`", "", header, rule]
        for feature in FEATURES:
            cells = [cell(estimator, b, feature) for b in BACKENDS]
            lines.append(f"| {feature} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## What each feature test checks", ""]
    lines += [f"* **{feature}**: {HOW[feature]}." for feature in FEATURES]
    lines += ["", "## Why a cell is empty", ""]
    reasons: dict[str, list[str]] = {}
    for (backend, _feature), reason in NOT_APPLICABLE.items():
        reasons.setdefault(reason, [])
        if BACKENDS[backend] not in reasons[reason]:
            reasons[reason].append(BACKENDS[backend])
    lines += [f"* {reason}: {', '.join(names)}." for reason, names in reasons.items()]
    lines += [f"* **untested** on {BACKENDS[b]} ({f}): {r}." for (b, f), r in
              UNTESTED.items()]
    return "\n".join(lines) + "\n"


# -- the tests ---------------------------------------------------------------------------
PAGE = Path(__file__).resolve().parents[1] / "docs" / "capabilities.md"
SHAPE = dict(batch=2, n=12, m=12, d=4, dv=3)


def _call(estimator: str, q, k, v, **options):
    """One estimator with small, fixed sample counts and an int seed (same draws on every
    backend)."""
    if estimator == "softmax_attention":
        return xattn.softmax_attention(q, k, v, **options)
    if estimator == "rfa":
        return xattn.rfa(q, k, v, num_features=16, rng=0, **options)
    if estimator == "ra":
        return xattn.ra(q, k, v, num_samples=2, rng=0, **options)
    if options.get("causal"):  # causal LARA: proposals that do not depend on later keys
        options = {"proposal_means": 0.3 * q[..., :3, :], "weighting": "query_proposal",
                   **options}
    return xattn.lara(q, k, v, num_samples=3, rng=0, **options)


def _inputs(seed: int = 0, batch=SHAPE["batch"], n=SHAPE["n"], m=SHAPE["m"]):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(batch, n, SHAPE["d"])), rng.normal(size=(batch, m, SHAPE["d"])),
            rng.normal(size=(batch, m, SHAPE["dv"])))


def _numpy(estimator, q, k, v, **options) -> np.ndarray:
    return np.asarray(_call(estimator, q, k, v, **options))


def _supported_cases() -> list:
    cases = []
    for backend in selected_backends():
        for estimator in ESTIMATORS:
            for feature in FEATURES:
                if cell(estimator, backend, feature).startswith("yes"):
                    cases.append(pytest.param(backend, estimator, feature,
                                              id=f"{backend}-{estimator}-{feature}"))
    return cases


@pytest.fixture(scope="module")
def jax_sharded_errors() -> dict[str, float | str]:
    """Per estimator: the largest difference (relative to the largest output) between the
    result of inputs sharded along the sequence over 4 JAX host devices and the one-device
    result, or the error raised. Runs in a fresh process: JAX fixes its device count when
    it starts."""
    program = textwrap.dedent("""
        import json
        import jax, numpy as np
        jax.config.update("jax_enable_x64", True)
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        import xattn
        assert len(jax.devices()) == 4
        sharding = NamedSharding(Mesh(np.array(jax.devices()), ("seq",)),
                                 PartitionSpec(None, "seq", None))
        rng = np.random.default_rng(0)
        q, k, v = (jax.numpy.asarray(rng.normal(size=(2, 16, 4))) for _ in range(3))
        calls = {
            "softmax_attention": lambda q, k, v: xattn.softmax_attention(q, k, v),
            "rfa": lambda q, k, v: xattn.rfa(q, k, v, num_features=16, rng=0),
            "ra": lambda q, k, v: xattn.ra(q, k, v, num_samples=2, rng=0),
            "lara": lambda q, k, v: xattn.lara(q, k, v, num_samples=4, rng=0),
        }
        errors = {}
        for name, call in calls.items():
            try:
                one = jax.jit(call)(q, k, v)
                split = [jax.device_put(x, sharding) for x in (q, k, v)]
                many = jax.jit(call)(*split)
                assert len(many.sharding.device_set) == 4, many.sharding
                scale = max(1.0, float(np.max(np.abs(np.asarray(one)))))
                errors[name] = float(np.max(np.abs(np.asarray(many) - np.asarray(one)))) / scale
            except Exception as error:  # reported to the test, which fails on it
                errors[name] = f"{type(error).__name__}: {error}"
        print(json.dumps(errors))
    """)
    # 4 host devices, first (XLA stops reading at a word without "--"), then the caller's
    # flags (the suite's quick compiles)
    flags = ["--xla_force_host_platform_device_count=4",
             *(word for word in os.environ.get("XLA_FLAGS", "").split()
               if "force_host_platform_device_count" not in word)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("backend_name", "estimator", "feature"), _supported_cases())
def test_supported(backend_name, estimator, feature, request):
    backend = _make_backend(backend_name)  # skips a GPU backend where there is no GPU
    q, k, v = _inputs()
    as_backend = backend.asarray

    if feature == "causal":
        out = _call(estimator, *map(as_backend, (q, k, v)), causal=True)
        backend.check(out, _numpy(estimator, q, k, v, causal=True), dtype=backend.ns.float64)
        k2, v2 = k.copy(), v.copy()
        k2[:, -1], v2[:, -1] = 5.0, -5.0   # only the last position changes
        out2 = _call(estimator, *map(as_backend, (q, k2, v2)), causal=True)
        np.testing.assert_allclose(backend.to_numpy(out2)[:, :-1],
                                   backend.to_numpy(out)[:, :-1], rtol=1e-10, atol=1e-12)

    elif feature in ("key mask", "query mask"):
        keyword = "key_mask" if feature == "key mask" else "query_mask"
        mask = np.ones((SHAPE["batch"], SHAPE["m"]), dtype=bool)
        mask[0, 7:] = False
        mask[1, ::3] = False
        out = _call(estimator, *map(as_backend, (q, k, v)), **{keyword: as_backend(mask)})
        backend.check(out, _numpy(estimator, q, k, v, **{keyword: mask}),
                      dtype=backend.ns.float64)
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        if keyword == "key_mask":
            k2[~mask], v2[~mask] = 3.0, -3.0
        else:
            q2[~mask] = 3.0
        out2 = _call(estimator, *map(as_backend, (q2, k2, v2)), **{keyword: as_backend(mask)})
        kept = mask if keyword == "query_mask" else np.ones_like(mask)
        np.testing.assert_allclose(backend.to_numpy(out2)[kept], backend.to_numpy(out)[kept],
                                   rtol=1e-10, atol=1e-12)

    elif feature == "jit":
        arrays = tuple(map(as_backend, (q, k, v)))
        eager = _call(estimator, *arrays)
        if backend_name.startswith("jax"):
            import jax

            compiled = jax.jit(lambda q, k, v: _call(estimator, q, k, v))(*arrays)
        else:
            import torch

            compiled = torch.compile(lambda q, k, v: _call(estimator, q, k, v),
                                     backend="aot_eager")(*arrays)
        backend.check(compiled, backend.to_numpy(eager), dtype=backend.ns.float64)

    elif feature == "grad":
        q, k, v = _inputs(batch=1, n=6, m=6)
        if backend_name.startswith("jax"):
            import jax
            from jax.test_util import check_grads

            check_grads(jax.jit(lambda q, k, v: _call(estimator, q, k, v)),
                        tuple(map(as_backend, (q, k, v))), order=1, modes=["rev"])
        else:
            import torch

            arrays = tuple(as_backend(a).requires_grad_() for a in (q, k, v))
            assert torch.autograd.gradcheck(lambda q, k, v: _call(estimator, q, k, v),
                                            arrays)

    elif feature == "sharding":
        if backend_name.startswith("jax"):
            error = request.getfixturevalue("jax_sharded_errors")[estimator]
            assert not isinstance(error, str), error
            assert error <= 1e-10, f"sharded result differs by {error:.2e} (relative)"
        else:  # Dask: chunks along the sequence
            import dask.array as da

            chunked = [da.from_array(a, chunks=(1, 3, a.shape[-1])) for a in (q, k, v)]
            out = _call(estimator, *chunked)
            backend.check(out, _numpy(estimator, q, k, v), dtype=backend.ns.float64)

    else:  # half precision
        # Dask arrays hold NumPy's float16, which its Array API namespace does not list
        half = np.dtype(np.float16) if backend_name == "dask" else backend.half_dtype()
        q32, k32, v32 = (as_backend(a, dtype=backend.ns.float32) for a in (q, k, v))
        expected = backend.to_numpy(_call(estimator, q32, k32, v32))
        out = _call(estimator, *(backend.ns.astype(a, half) for a in (q32, k32, v32)))
        assert out.dtype == half, f"result dtype {out.dtype}, expected {half}"
        scale = float(np.max(np.abs(expected)))
        np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=0, atol=5e-2 * scale)


@pytest.mark.parametrize(("estimator", "feature"), sorted(UNSUPPORTED))
def test_unsupported(estimator, feature):
    q, k, v = _inputs()
    options = {key: (np.ones((SHAPE["batch"], SHAPE["n"]), dtype=bool) if value == "mask"
                     else value) for key, value in UNSUPPORTED[(estimator, feature)].items()}
    (keyword,) = options
    with pytest.raises(UNSUPPORTED_ERROR.get((estimator, feature), TypeError), match=keyword):
        _call(estimator, q, k, v, **options)


def test_every_cpu_backend_is_a_column():
    assert set(CPU_BACKENDS) | set(GPU_BACKENDS) == set(BACKENDS)


def test_capability_page_is_up_to_date():
    assert PAGE.read_text(encoding="utf-8") == render_page(), (
        "docs/capabilities.md is stale: run python docs/_scripts/capabilities.py")
