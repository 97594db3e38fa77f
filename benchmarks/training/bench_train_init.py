"""PyTorch against Flax on ``digits``: how much does the projections' initialization matter?

The layers follow their frameworks' defaults: Flax initializes the query, key, value and
output kernels with variance 1/64 (LeCun-normal), PyTorch's ``MultiheadAttention`` the
stacked input projection with variance 1/128 (Xavier-uniform). This trains the
``xattn train`` model on ``digits`` (the command's settings, 600 steps) with the
projections drawn at another variance, by patching the layers' initializers here only:
Flax with a truncated normal of ``--variance``, PyTorch with a normal of ``--variance``
(the input and output projections). One process, one thread.

    python benchmarks/training/bench_train_init.py --framework flax --variance 0.0078125 \
        --out benchmarks/results/train_init_flax_var128.json
    python benchmarks/training/bench_train_init.py --framework torch --variance 0.015625 \
        --out benchmarks/results/train_init_torch_var64.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from xattn.cli import train as command
from xattn.training.loop import RunSpec, attention_options
from xattn.training.runs import SETTINGS, load_framework
from xattn.training.tasks import get_task

PROJECTION_FAN_IN = 64  # the model's embedding


def patch_initialization(module, framework: str, variance: float) -> None:
    """Make the framework's attention layer draw its projections at ``variance``."""
    if framework == "flax":
        from flax import nnx

        init = nnx.initializers.variance_scaling(variance * PROJECTION_FAN_IN, "fan_in",
                                                 "truncated_normal")
        module.xflax.MultiHeadAttention = functools.partial(module.xflax.MultiHeadAttention,
                                                            kernel_init=init)
        return
    import torch

    default_reset = module.xtorch.MultiheadAttention._reset_parameters

    def reset(layer):
        default_reset(layer)
        with torch.no_grad():
            for weight in (layer.in_proj_weight, layer.out_proj.weight):
                if weight is not None:
                    weight.normal_(0.0, variance ** 0.5)

    module.xtorch.MultiheadAttention._reset_parameters = reset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="flax", choices=("torch", "flax"))
    parser.add_argument("--variance", type=float, default=1 / 128)
    parser.add_argument("--estimators", default="rfa,lara")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    module = load_framework(args.framework, 1)
    patch_initialization(module, args.framework, args.variance)
    command._WORKER["module"] = module  # run_jobs with one job at a time uses it
    task = get_task("digits")
    settings = SETTINGS["digits"]
    jobs = []
    for seed in (int(item) for item in args.seeds.split(",")):
        for estimator in args.estimators.split(","):
            spec = RunSpec(task, estimator, estimator, attention_options(estimator, 16), seed,
                           settings.steps, settings.batch_size, settings.peak_lr,
                           warmup_fraction=settings.warmup_fraction)
            jobs.append(command.Job(len(jobs) + 1, f"{estimator} seed {seed}", spec, 0, 0))
    namespace = argparse.Namespace(framework=args.framework, threads=1, device="cpu",
                                   progress=False, jobs=1)
    runs = [run.to_json() for run in command.run_jobs(jobs, namespace).values()]
    for run in runs:
        print(f"{args.framework} variance {args.variance:g} {run['name']} seed {run['seed']}: "
              f"test accuracy {run['test_accuracy']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"framework": args.framework,
                                              "variance": args.variance, "runs": runs},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
