"""The Python entry point of training, :func:`xattn.training.train`: the run of the
command line (``xattn train``) with the same settings, and a package that imports no
framework until a run needs one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xattn.cli import main

#: What depends on the machine's clock and allocator, not on the run's numbers.
TIMING = ("ms_per_step", "wall_s", "peak_memory_bytes")


def test_import_loads_no_framework():
    code = ("import sys, xattn.training, xattn.training.parity, xattn.training.peak; "
            "print(sorted(name for name in ('torch', 'jax', 'flax') if name in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("attention", ["softmax", "rfa"])
def test_train_gives_the_command_s_run(tmp_path, attention):
    """``train`` and ``xattn train`` with the same settings: the same run, number for
    number (every entry of ``train.json``'s run but the timings)."""
    pytest.importorskip("torch")
    from xattn.training import RunResult, train

    assert main(["train", "--task", "digits", "--estimators", attention, "--steps", "3",
                 "--seeds", "1", "--samples", "4", "--batch-size", "8", "--quick",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    [command_run] = json.loads((tmp_path / "train.json").read_text())["runs"]
    result = train("digits", attention, "torch", seed=1, steps=3, samples=4, batch_size=8,
                   quick=True, threads=1)
    assert isinstance(result, RunResult)
    run = json.loads(json.dumps(result.to_json()))  # as the command writes it
    for key in TIMING:
        run.pop(key), command_run.pop(key)
    assert run == command_run


def test_train_refuses_unknown_or_non_causal_attention():
    pytest.importorskip("torch")
    from xattn.training import train

    with pytest.raises(ValueError, match="unknown attention 'nope' on digits"):
        train("digits", "nope", steps=1)
    with pytest.raises(ValueError, match="lara-learned or lara-defensive"):
        train("shakespeare", "lara", steps=1)
    with pytest.raises(ValueError, match="framework must be one of torch, flax"):
        train("digits", "softmax", "keras", steps=1)
