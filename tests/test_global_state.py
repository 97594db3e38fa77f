"""No global state: xattn never changes torch's default dtype or device, JAX's x64 flag or
NumPy's global random state.

The suite's conftest turns JAX x64 on for the jax backend, so the in-process test can only
see the library leave it *on*; the subprocess test starts fresh interpreters with x64 off
(JAX's default) and on, and torch's default dtype float32 (its default) and float64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import xattn
from xattn import mrf


def run_everything(q, k, v, embeddings, everything=True):
    """Call every estimator and public sampling function once, with int seeds and
    rng=None (fresh entropy: must not come from NumPy's global generator)."""
    xattn.softmax_attention(q, k, v)
    xattn.rfa(q, k, v, num_features=4, rng=None)
    xattn.ra(q, k, v, rng=None)
    xattn.lara(q, k, v, num_samples=2, rng=0)
    xattn.random.default_rng(None, like=q).normal(xattn._core.array.array_namespace(q), (2,),
                                                   dtype=q.dtype)
    if not everything:  # the estimators only (JAX: traced by jax.jit)
        return
    xattn.rfa(q, k, v, num_features=4, feature_map="trigonometric", rng=0)
    mrf.log_partition(embeddings)
    mrf.log_partition_rf(embeddings, num_features=4, rng=None)


def global_state():
    state = {"numpy": np.random.get_state()[1].tolist()}  # noqa: NPY002 (the legacy global)
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        state["torch_dtype"] = str(torch.get_default_dtype())
        state["torch_device"] = str(torch.get_default_device())
    if "jax" in sys.modules:
        state["jax_x64"] = bool(sys.modules["jax"].config.jax_enable_x64)
    return state


def test_estimators_leave_global_state_unchanged(backend):
    xp = backend.ns
    if backend.name == "jax":
        pytest.skip("JAX inputs run in fresh interpreters below, with x64 off and on")
    data = np.random.default_rng(0)
    q, k, v = (backend.asarray(data.normal(size=(2, 6, 4)), dtype=xp.float32) for _ in range(3))
    embeddings = backend.asarray(0.3 * data.normal(size=(4, 3, 2)), dtype=xp.float32)
    before = global_state()
    run_everything(q, k, v, embeddings)
    assert global_state() == before


SCRIPT = textwrap.dedent("""
    import functools, json, sys
    import numpy as np
    import jax
    import torch

    sys.path.insert(0, {tests!r})
    from test_global_state import global_state, run_everything

    np.random.seed(1234)
    data = np.random.default_rng(0)
    q, k, v = (data.normal(size=(2, 6, 4)).astype(np.float32) for _ in range(3))
    embeddings = (0.3 * data.normal(size=(4, 3, 2)).astype(np.float32))
    states = []
    # JAX's default (x64 off) with torch's default dtype, then both switched
    for x64, torch_dtype in ((False, torch.float32), (True, torch.float64)):
        jax.config.update("jax_enable_x64", x64)
        torch.set_default_dtype(torch_dtype)
        before = global_state()
        run_everything(*map(torch.as_tensor, (q, k, v, embeddings)))
        # traced by jax.jit, which runs the same Python lines (eager, JAX compiled each
        # operation anew for each x64 setting: 12 s)
        jax.jit(functools.partial(run_everything, everything=False))(
            *map(jax.numpy.asarray, (q, k, v, embeddings)))
        states.append({{"before": before, "after": global_state()}})
    print(json.dumps(states))
""")


def test_fresh_interpreter_keeps_jax_x64_and_torch_defaults():
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)],
                            capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    states = json.loads(result.stdout.strip().splitlines()[-1])
    assert [s["before"]["jax_x64"] for s in states] == [False, True]
    assert [s["before"]["torch_dtype"] for s in states] == ["torch.float32", "torch.float64"]
    for state in states:
        assert state["after"] == state["before"]


OFFENDERS = textwrap.dedent("""
    import os

    import numpy as np


    def test_changes_numpy_error_state():
        np.seterr(divide="raise")


    def test_sets_an_environment_variable():
        os.environ["XATTN_TEST_LEFT_BEHIND"] = "1"


    def test_sees_the_settings_of_the_session_start():
        assert np.geterr()["divide"] == "warn"
        assert "XATTN_TEST_LEFT_BEHIND" not in os.environ


    def test_monkeypatch_restores(monkeypatch):
        monkeypatch.setenv("XATTN_TEST_LEFT_BEHIND", "1")
        with np.errstate(divide="raise"):
            pass
""")


def test_a_test_that_leaves_global_state_changed_fails(tmp_path):
    """The suite's guard (``_global_state_unchanged`` in conftest.py): a test that leaves
    NumPy's error state or an environment variable changed fails, naming it, and the next
    test sees the settings of the session's start; monkeypatch and context managers pass.
    In a separate pytest run of a small file, with this suite's conftest as a plugin."""
    (tmp_path / "test_offenders.py").write_text(OFFENDERS)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
           "XATTN_BACKENDS": "numpy"}
    env.pop("XATTN_TEST_LOG", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:xdist",
                             "-p", "no:cacheprovider", "-q", "-rE", "test_offenders.py"],
                            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
                            check=False)
    output = result.stdout + result.stderr
    assert "4 passed, 2 errors" in output, output[-3000:]
    assert ("test_changes_numpy_error_state left global state changed" in output
            and "'numpy.errstate'" in output), output[-3000:]
    assert ("test_sets_an_environment_variable left global state changed" in output
            and "XATTN_TEST_LEFT_BEHIND" in output), output[-3000:]
