"""Why do the trained estimators differ? Ablations of ``xattn train`` runs, measured.

Every variant trains the ``xattn train`` model on one task with the command's settings
(steps, batch, schedule, data) and changes one thing in the attention: the number of
samples, LARA's beta, the noise scale of LARA's samples during training (0: the
deterministic proposals; D^-1/4: the scale of the authors' implementation), LARA's
proposals (``standard``: N(0, I) as RFA, ``key_attention``), RFA's orthogonal features
or fixed features. Each trained model is evaluated twice on the
test set: in evaluation mode (deterministic attention, as ``xattn train`` reports) and in
training mode (a fresh random draw per batch), which measures how much the sampling noise
alone costs at test time.

    python benchmarks/training/bench_train_ablation.py --task mqar --jobs 2
    python benchmarks/training/bench_train_ablation.py --task listops --variants lara,lara-s64

Writes ``benchmarks/results/train_ablation_<task>.json`` (every figure, the curves) and prints a
table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

import xattn
from xattn.cli import train as command
from xattn.training.loop import RunSpec, attention_options
from xattn.training.runs import DEFAULT_SAMPLES, SETTINGS, dataset_sizes
from xattn.training.tasks import get_task

HEAD_DIM = 32  # the model's embedding 64 over 2 heads
RESULTS = Path(__file__).resolve().parents[1] / "results"


def variants(samples: int) -> dict[str, tuple[str, dict]]:
    """name -> (estimator, layer options)."""
    lara, rfa = attention_options("lara", samples), attention_options("rfa", samples)
    return {
        "softmax": ("softmax", {}),
        "rfa": ("rfa", rfa),
        "rfa-s64": ("rfa", attention_options("rfa", 64)),
        "rfa-orthogonal": ("rfa", {**rfa, "orthogonal": True}),
        "rfa-fixed": ("rfa", {**rfa, "redraw_interval": None}),
        "ra": ("ra", attention_options("ra", samples)),
        "ra-noise-d14": ("ra", {"num_samples": 1, "noise_scale": HEAD_DIM ** -0.25}),
        "lara": ("lara", lara),
        "lara-s64": ("lara", attention_options("lara", 64)),
        "lara-beta0": ("lara", {**lara, "beta": 0.0}),
        "lara-beta1": ("lara", {**lara, "beta": 1.0}),
        "lara-balance": ("lara", {**lara, "weighting": "balance"}),
        "lara-noise0": ("lara", {**lara, "noise_scale": 0.0}),
        "lara-standard": ("lara", {**lara, "proposal": "standard"}),
        "lara-key-attention": ("lara", {**lara, "proposal": "key_attention"}),
        "lara-noise-d14": ("lara", {**lara, "noise_scale": HEAD_DIM ** -0.25}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mqar")
    parser.add_argument("--variants", default=None,
                        help="comma-separated names (default: all)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--framework", default="torch", choices=("torch", "flax"),
                        help="flax: evaluation mode only (no sampled evaluation)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    table = variants(args.samples)
    names = args.variants.split(",") if args.variants else list(table)
    task = get_task(args.task)
    settings = SETTINGS[task.name]
    jobs = []
    for seed in (int(item) for item in args.seeds.split(",")):
        for name in names:
            estimator, options = table[name]
            spec = RunSpec(task, name, estimator, options, seed,
                           args.steps or settings.steps, settings.batch_size,
                           settings.peak_lr, warmup_fraction=settings.warmup_fraction,
                           evaluate_sampled=args.framework == "torch")
            jobs.append(command.Job(len(jobs) + 1, f"{name} seed {seed}", spec,
                                     *dataset_sizes(settings, spec, False)))
    namespace = argparse.Namespace(framework=args.framework, threads=args.threads,
                                   device="cpu",
                                   progress=False, jobs=args.jobs)
    results = command.run_jobs(jobs, namespace)
    rows = []
    for name in names:
        runs = [run for run in results.values() if run.name == name]
        if not runs:
            continue
        evaluation = [run.test_accuracy for run in runs]
        sampled = [run.sampled_test_accuracy for run in runs]
        rows.append({"name": name, "options": runs[0].options,
                     "seeds": [run.seed for run in runs],
                     "test_accuracy": evaluation, "sampled_test_accuracy": sampled,
                     "final_train_loss": [run.final_train_loss for run in runs],
                     "ms_per_step": statistics.median(run.ms_per_step for run in runs)})
        sampled_mean = "n/a" if None in sampled else f"{np.mean(sampled):.3f}"
        print(f"{name:<15} eval {np.mean(evaluation):.3f} (+- {np.std(evaluation):.3f})  "
              f"sampled {sampled_mean}  train loss "
              f"{np.mean(rows[-1]['final_train_loss']):.3f}", flush=True)
    out = Path(args.out or RESULTS / f"train_ablation_{task.name}.json")
    payload = {"benchmark": "bench_train_ablation.py", "task": task.name,
               "framework": args.framework, "peak_lr": settings.peak_lr,
               "command": " ".join(sys.argv), "samples": args.samples,
               "steps": args.steps or settings.steps, "xattn": xattn.__version__,
               "python": platform.python_version(), "platform": platform.platform(),
               "rows": rows, "runs": [run.to_json() for run in results.values()]}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
