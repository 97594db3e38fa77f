"""xattn.keras.MultiHeadAttention on the Keras backends "jax" and "torch".

Keras chooses its backend once per process, when it is first imported (``KERAS_BACKEND``),
so each backend runs the checks of ``tests/keras_checks.py`` in a subprocess. The JAX ones
run in three, of about 18 s of CPU time each, so that ``pytest -n auto`` spreads them and
none takes half a minute: each subprocess imports Keras and JAX (3 s) and compiles JAX's
eager operations anew (in four subprocesses the checks took 68 s, in three 53 s). XLA's
backend optimizations are turned off in the JAX subprocesses: the checks compile many
small programs, whose compile time would otherwise dominate. Nothing here imports Keras
in the pytest process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SOURCE = TESTS.parent / "src"

# installed? (not imported: with no KERAS_BACKEND, Keras imports TensorFlow, its default)
if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed (pip install xattn[keras])", allow_module_level=True)

# the checks of keras_checks.py (read from the file: importing it would import Keras here)
CHECKS = re.findall(r"^def check_(\w+)\(", (TESTS / "keras_checks.py").read_text(), re.M)
GROUPS = {
    "layer": ["softmax_equals_keras", "evaluation_is_deterministic", "compiled_attention_mask",
              "errors"],
    "training": ["fit", "mixed_precision"],
    "saving": ["serialization", "doctests"],
}


def run_checks(backend: str, *arguments: str, timeout: float = 240) -> str:
    """Run ``keras_checks.py arguments`` with ``KERAS_BACKEND=backend``; its output."""
    env = {**os.environ, "KERAS_BACKEND": backend,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE),
                                                       os.environ.get("PYTHONPATH")]))}
    if backend == "jax":
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"),
                                                  "--xla_backend_optimization_level=0"]))
    result = subprocess.run([sys.executable, str(TESTS / "keras_checks.py"), *arguments],
                            env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.parametrize(("backend", "group"), [
    pytest.param("torch", "all", id="torch"),
    pytest.param("jax", "layer", id="jax-layer"),
    pytest.param("jax", "training", id="jax-training"),
    pytest.param("jax", "saving", id="jax-saving"),
])
def test_keras_checks(backend, group):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    names = CHECKS if group == "all" else GROUPS[group]
    output = run_checks(backend, *names)
    for name in names:  # every check ran and passed
        assert f"ok {name}\n" in output, output


def test_groups_hold_every_check():
    assert sorted(CHECKS) == sorted(name for group in GROUPS.values() for name in group)


def test_tensorflow_backend_is_refused():
    """``KERAS_BACKEND=tensorflow``: without TensorFlow, importing Keras fails and the
    layer module says which backends it runs on; with TensorFlow, the layer's
    construction raises ``ValueError`` naming them."""
    code = ("import xattn.keras as k\n"
            "try:\n    k.MultiHeadAttention(2, 4)\n"
            "except ValueError as error:\n    print(error)\n")
    env = {**os.environ, "KERAS_BACKEND": "tensorflow",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE),
                                                       os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    output = result.stdout + result.stderr
    if importlib.util.find_spec("tensorflow") is None:
        assert result.returncode != 0, output
        assert "ImportError: Keras could not be imported" in output, output
    else:
        assert result.returncode == 0, output
    assert "KERAS_BACKEND=jax or KERAS_BACKEND=torch" in output, output
