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


#: (arguments, error, message): bad numbers, flags and devices of a run
BAD_ARGUMENTS = [
    ({"steps": 0}, ValueError, "steps must be >= 1, got 0"),
    ({"steps": -5}, ValueError, "steps must be >= 1"),
    ({"steps": True}, TypeError, "steps must be an int"),
    ({"steps": 2.5}, TypeError, "steps must be an int"),
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ({"batch_size": 8.0}, TypeError, "batch_size must be an int"),
    ({"length": -1}, ValueError, "length must be >= 1"),
    ({"samples": 0}, ValueError, "samples must be >= 1"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"seed": 2**32}, ValueError, "seed must be <= 4294967295"),
    ({"threads": -2}, ValueError, "threads must be >= 0"),
    ({"threads": None}, TypeError, "threads must be an int"),
    ({"quick": 1}, TypeError, "quick must be a bool"),
    ({"device": "tpu"}, ValueError, "device must be one of 'cpu', 'cuda'"),
    ({"device": "cuda:0"}, ValueError, "device must be one of"),
    ({"device": None}, TypeError, "device must be a str"),
    ({"token_init": "normal"}, ValueError, "token_init must be one of"),
]


@pytest.mark.parametrize("task", ["digits", "shakespeare"])
@pytest.mark.parametrize(("arguments", "error", "message"), BAD_ARGUMENTS)
def test_train_checks_every_argument_before_loading_anything(monkeypatch, task, arguments,
                                                             error, message):
    """Before: ``steps=0`` and ``batch_size=0`` became the task's defaults, ``steps=True``
    and ``device="tpu"`` were taken, the others failed deep inside (an IndexError, a
    NumPy or torch error), or after minutes of training (shakespeare, ``steps=-1``)."""
    from xattn.training import runs

    def loaded(*args, **kwargs):
        raise AssertionError("data or a framework was loaded before the arguments were checked")

    monkeypatch.setattr(runs, "get_task", loaded)
    monkeypatch.setattr(runs, "load_framework", loaded)
    with pytest.raises(error, match=message):
        runs.train(task, "softmax", **arguments)


@pytest.mark.parametrize(("arguments", "error", "message"),
                         [case for case in BAD_ARGUMENTS
                          if set(case[0]) <= {"steps", "batch_size", "seed", "quick"}])
def test_run_specs_check_their_numbers(arguments, error, message):
    from xattn.training import get_task
    from xattn.training.runs import lm_spec, run_spec

    with pytest.raises(error, match=message):
        run_spec(get_task("mqar"), "softmax", "softmax", {}, **{"seed": 0, **arguments})
    with pytest.raises(error, match=message):
        lm_spec("softmax", "softmax", {}, **{"seed": 0, **arguments})
