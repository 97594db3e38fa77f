"""PyTorch against Flax in ``xattn train`` (issue 43): which difference moves the accuracy?

Two parts, both on one task (default ``mqar``) with the command's settings (steps,
batch, schedule, data, seeds):

* ``--check-steps N``: the two training loops from the **same** initial weights (the
  PyTorch model's, copied into the Flax one with :mod:`xattn.training.parity`), the
  same batches, the same LayerNorm epsilon (Flax's 1e-6), and the same random numbers:
  RFA with its features copied and fixed (``redraw_interval=None``), RA with the same
  noise (an int seed, which draws the same numbers in both frameworks). It records the
  training loss of both at each of the first N steps and their largest difference.
* ``--variants``: full training runs, each a framework and an estimator, optionally
  starting from the other framework's initial weights for the same seed (all of them or
  some :data:`~xattn.training.parity.PARAMETER_GROUPS`). A variant is written
  ``framework:estimator[:source[:group+group...]]``, e.g. ``torch:rfa`` (the command's
  run), ``torch:rfa:flax`` (PyTorch from Flax's initial weights),
  ``torch:rfa:flax:embeddings`` (only Flax's embeddings); the estimator may also be a
  name of :data:`ATTENTIONS` (``flax:rfa-s64``). Each is one run per seed, one at a
  time, one thread.

    python benchmarks/training/bench_train_parity.py --check-steps 30 --variants '' \\
        --out benchmarks/results/train_parity_mqar.json
    python benchmarks/training/bench_train_parity.py --seeds 0,1,2 \\
        --variants torch:rfa:flax,flax:rfa:torch --out benchmarks/results/train_parity_mqar.json

(every command of ``benchmarks/results/train_parity_mqar.json`` is in its ``commands``; the
results are in ``docs/guide/09_training.md``, "PyTorch against Flax on mqar")

With ``--out`` of an existing file, its runs are kept and the new ones added (a run of
the same variant and seed is replaced).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from xattn.training.loop import (
    ModelConfig,
    RunSpec,
    attention_options,
    batches,
    learning_rate,
    train_run,
)
from xattn.training.parity import (
    PARAMETER_GROUPS,
    flax_parameters,
    load_flax_parameters,
    load_torch_parameters,
    torch_parameters,
)
from xattn.training.runs import SETTINGS, load_framework
from xattn.training.tasks import get_task

FLAX_LAYER_NORM_EPSILON = 1e-6  # nnx.LayerNorm's default; torch.nn.LayerNorm's is 1e-5


#: Attentions beyond the command's rows: name -> (estimator, options over the command's).
#: On ``mqar`` the 16 key-value pairs are the first 16 positions, so ``rfa-sinks16``
#: attends to every pair exactly (a linear cost, but one fitted to the task's layout).
ATTENTIONS = {
    "rfa-s64": ("rfa", {"num_features": 64}),
    "rfa-s128": ("rfa", {"num_features": 128}),
    "rfa-s256": ("rfa", {"num_features": 256}),
    "rfa-orthogonal": ("rfa", {"orthogonal": True}),
    "rfa-window-sinks": ("rfa", {"window": 16, "sinks": 4}),
    "rfa-sinks16": ("rfa", {"sinks": 16}),
}


#: ``--token-init framework``: each framework's token embeddings as xattn 0.1 drew them
#: (PyTorch's ``nn.Embedding`` N(0, 1), Flax's ``nnx.Embed`` N(0, 1/width)), with which
#: the runs of ``benchmarks/results/train_parity_mqar.json`` were made.
FRAMEWORK_TOKEN_INITS = {"torch": "unit", "flax": "scaled"}


def make_spec(task_name: str, attention: str, seed: int, samples: int,
              token_init: str = "scaled", **options: Any) -> RunSpec:
    """The :class:`RunSpec` of ``xattn train`` for one run of ``attention`` (an
    estimator or a name of :data:`ATTENTIONS`), with extra layer options and the token
    embeddings' initialization ``token_init`` (see :class:`ModelConfig`)."""
    settings = SETTINGS[task_name]
    estimator, extra = ATTENTIONS.get(attention, (attention, {}))
    return RunSpec(
        get_task(task_name),
        attention,
        estimator,
        {**attention_options(estimator, samples), **extra, **options},
        seed,
        settings.steps,
        settings.batch_size,
        settings.peak_lr,
        warmup_fraction=settings.warmup_fraction,
        model=ModelConfig(token_init=token_init),
    )


def trainer_parameters(framework: str, trainer: Any) -> dict[str, np.ndarray]:
    """The current parameters (and RFA features) of a trainer's model, Flax layout."""
    if framework == "torch":
        return torch_parameters(trainer.model)
    from flax import nnx

    model, _ = nnx.merge(trainer.graphdef, trainer.state)
    return flax_parameters(model)


def set_trainer_parameters(
    framework: str,
    trainer: Any,
    parameters: dict[str, np.ndarray],
    groups: tuple[str, ...] = PARAMETER_GROUPS,
) -> None:
    """Load ``parameters`` (Flax layout) into a trainer's model before training."""
    if framework == "torch":
        load_torch_parameters(trainer.model, parameters, groups)
        return
    from flax import nnx

    model, optimizer = nnx.merge(trainer.graphdef, trainer.state)
    load_flax_parameters(model, parameters, groups)
    trainer.state = nnx.state((model, optimizer))


def set_torch_layer_norm_epsilon(trainer: Any, epsilon: float) -> None:
    """Give every LayerNorm of a PyTorch trainer's model the epsilon ``epsilon``."""
    import torch

    for module in trainer.model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = epsilon


def fix_noise(framework: str, trainer: Any, seed: int) -> None:
    """Make RA's training-mode draws the same numbers in both frameworks: an int seed
    (xattn's host generator) in place of the layer's random source, at every step."""
    if framework == "torch":
        for block in trainer.model.blocks:
            block.attention._random = lambda: seed
        return
    from flax import nnx

    model, optimizer = nnx.merge(trainer.graphdef, trainer.state)
    for block in model.blocks:
        # read at trace time: the compiled step holds these numbers as constants
        object.__setattr__(block.attention, "_next_key", lambda rngs: seed)
    trainer.graphdef, trainer.state = nnx.split((model, optimizer))


def check_trajectories(
    task_name: str, steps: int, samples: int, modules: dict[str, Any],
    token_init: str = "scaled",
) -> list[dict[str, Any]]:
    """The first ``steps`` training losses of both frameworks from the same weights,
    batches and random numbers (see the module docstring), per estimator."""
    results = []
    for estimator in ("softmax", "rfa", "ra"):
        options = {"redraw_interval": None} if estimator == "rfa" else {}
        init = FRAMEWORK_TOKEN_INITS["torch"] if token_init == "framework" else token_init
        spec = make_spec(task_name, estimator, 0, samples, token_init=init, **options)
        train, _ = spec.task.datasets(SETTINGS[task_name].train_size, 1)
        trainers = {name: module.Trainer(spec) for name, module in modules.items()}
        set_torch_layer_norm_epsilon(trainers["torch"], FLAX_LAYER_NORM_EPSILON)
        set_trainer_parameters(
            "flax", trainers["flax"], trainer_parameters("torch", trainers["torch"])
        )
        if estimator == "ra":
            for name, trainer in trainers.items():
                fix_noise(name, trainer, 7)
        losses: dict[str, list[float]] = {name: [] for name in trainers}
        for name, trainer in trainers.items():
            source = batches(train, spec.batch_size, spec.seed)
            for step in range(steps):
                losses[name].append(trainer.step(next(source), learning_rate(step, spec))[0])
        gap = [abs(a - b) for a, b in zip(losses["torch"], losses["flax"], strict=True)]
        results.append(
            {
                "estimator": estimator,
                "options": spec.options,
                "steps": steps,
                "torch_losses": losses["torch"],
                "flax_losses": losses["flax"],
                "max_abs_loss_difference": max(gap),
                "first_step_loss_difference": gap[0],
            }
        )
        print(
            f"check {estimator}: {steps} steps, largest loss difference {max(gap):.2e} "
            f"(step 1: {gap[0]:.2e}; losses {losses['torch'][0]:.4f} -> "
            f"{losses['torch'][-1]:.4f})",
            flush=True,
        )
    return results


def parse_variant(text: str) -> tuple[str, str, str | None, tuple[str, ...]]:
    """``framework:estimator[:source[:group+group]]`` -> its parts."""
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in ("torch", "flax"):
        raise SystemExit(f"bad variant {text!r}: framework:estimator[:source[:groups]]")
    source = parts[2] if len(parts) > 2 else None
    if source not in (None, "torch", "flax"):
        raise SystemExit(f"bad variant {text!r}: the source is torch or flax")
    groups = tuple(parts[3].split("+")) if len(parts) > 3 else PARAMETER_GROUPS
    unknown = set(groups) - set(PARAMETER_GROUPS)
    if unknown:
        raise SystemExit(f"bad variant {text!r}: groups are {', '.join(PARAMETER_GROUPS)}")
    return parts[0], parts[1], source, groups


def run_variant(
    text: str, task_name: str, seed: int, samples: int, modules: dict[str, Any],
    token_init: str = "scaled",
) -> dict[str, Any]:
    """One training run of a variant (see the module docstring)."""
    framework, estimator, source, groups = parse_variant(text)

    def spec_of(name: str) -> RunSpec:  # the model of framework ``name``
        init = FRAMEWORK_TOKEN_INITS[name] if token_init == "framework" else token_init
        return make_spec(task_name, estimator, seed, samples, token_init=init)

    spec = spec_of(framework)
    trainer = modules[framework].Trainer(spec)
    if source is not None and source != framework:
        donor = modules[source].Trainer(spec_of(source))
        set_trainer_parameters(framework, trainer, trainer_parameters(source, donor), groups)
    settings = SETTINGS[task_name]
    train, test = spec.task.datasets(settings.train_size, settings.test_size)
    started = time.perf_counter()
    result = train_run(spec, trainer, train, test).to_json()
    print(
        f"{text} seed {seed}: test accuracy {100 * result['test_accuracy']:.1f} %, train "
        f"loss {result['final_train_loss']:.3f} ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return {
        "variant": text,
        "framework": framework,
        "estimator": estimator,
        "initial_weights": source or framework,
        "groups_from_source": list(groups) if source not in (None, framework) else [],
        **result,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mqar")
    parser.add_argument("--variants", default="torch:rfa:flax,flax:rfa:torch")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--check-steps", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--token-init", default="scaled", choices=["scaled", "unit", "framework"],
                        help="the token embeddings' start in both frameworks (as xattn "
                        "train's --token-init), or framework: each framework's 0.1 default")
    args = parser.parse_args()
    modules = {
        "flax": load_framework("flax", 1),  # XLA's threads before torch
        "torch": load_framework("torch", 1),
    }
    path = Path(args.out) if args.out else None
    record: dict[str, Any] = {"runs": []}
    if path is not None and path.exists():
        record = json.loads(path.read_text())
    record.update(
        {
            "task": args.task,
            "samples": args.samples,
            "settings": vars(SETTINGS[args.task]),
            "versions": {
                **modules["torch"].versions(),
                **modules["flax"].versions(),
                "python": sys.version.split()[0],
                "machine": platform.machine(),
            },
        }
    )
    if args.check_steps:
        record["check"] = check_trajectories(args.task, args.check_steps, args.samples, modules,
                                             args.token_init)
        if path is not None:
            path.write_text(json.dumps(record, indent=1) + "\n")
    for text in filter(None, args.variants.split(",")):
        for seed in (int(item) for item in args.seeds.split(",")):
            run = run_variant(text, args.task, seed, args.samples, modules, args.token_init)
            run["token_init"] = args.token_init
            record["runs"] = [
                old for old in record["runs"] if (old["variant"], old["seed"]) != (text, seed)
            ] + [run]
            if path is not None:  # each run on disk as it finishes
                path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
