"""Time per training step of the ``xattn train`` model against sequence length.

The model, optimizer and estimator options are exactly those of ``xattn train`` (the LRA
encoder, AdamW, RFA features = LARA proposals = ``--samples``, RA one sample), on the
``mqar`` task at each length; batch ``--batch-size``. For each length a trainer is built
per estimator, ``--warmup`` steps are run, then ``--repeats`` rounds in which every
estimator takes one step, interleaved, so that load changes on a shared machine hit all
estimators alike; the figure is the median step time. Single-threaded by default
(``--threads``), like ``xattn train``.

    python benchmarks/bench_train.py                       # torch, lengths 256 ... 2048
    python benchmarks/bench_train.py --framework flax --lengths 2048

Writes ``<out>.json`` and ``<out>.png`` (default ``benchmarks/train_step_times_<framework>``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import xattn
from xattn.cli.figures import loglog_axes, new_figure, save_figure
from xattn.cli.tasks import get_task
from xattn.cli.train import load_framework
from xattn.cli.train_core import RunSpec, attention_options, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="torch", choices=("torch", "flax"))
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--estimators", default="softmax,rfa,lara")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or f"benchmarks/train_step_times_{args.framework}")
    module = load_framework(args.framework, args.threads)
    estimators = args.estimators.split(",")
    results: dict[str, list[dict]] = {name: [] for name in estimators}
    for length in (int(item) for item in args.lengths.split(",")):
        task = get_task("mqar", length)
        train, _ = task.datasets(args.batch_size * (args.warmup + args.repeats), 1)
        trainers = {}
        for name in estimators:
            spec = RunSpec(task, name, name, attention_options(name, args.samples), seed=0,
                           steps=args.warmup + args.repeats, batch_size=args.batch_size,
                           peak_lr=1e-3)
            trainers[name] = (module.Trainer(spec), batches(train, args.batch_size, 0))
        times: dict[str, list[float]] = {name: [] for name in estimators}
        for round_ in range(args.warmup + args.repeats):
            for name, (trainer, source) in trainers.items():
                batch = next(source)
                start = time.perf_counter()
                trainer.step(batch, 1e-3)
                if round_ >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        for name in estimators:
            median = 1000 * statistics.median(times[name])
            results[name].append({"length": length, "ms_per_step": median,
                                  "all_ms": [1000 * t for t in times[name]]})
            print(f"{args.framework} N={length:>5} {name:<8} {median:9.1f} ms/step", flush=True)
    payload = {"benchmark": "bench_train.py", "framework": args.framework,
               "batch_size": args.batch_size, "samples": args.samples,
               "threads": args.threads, "warmup": args.warmup, "repeats": args.repeats,
               "task": "mqar", "xattn": xattn.__version__, "numpy": np.__version__,
               "python": platform.python_version(), "platform": platform.platform(),
               **module.versions(), "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    figure, axes = new_figure()
    for name, rows in results.items():
        axes.plot([row["length"] for row in rows], [row["ms_per_step"] for row in rows],
                  marker="o", label=name)
    loglog_axes(axes, "sequence length N", "ms per training step")
    axes.set_title(f"xattn train model, {args.framework}, batch {args.batch_size}, "
                   f"{args.threads} thread(s)")
    axes.legend()
    save_figure(figure, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
