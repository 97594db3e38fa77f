"""Time per training step of the ``xattn train`` model against sequence length.

The model, optimizer and estimator options are exactly those of ``xattn train`` (the LRA
encoder, AdamW, RFA features = LARA proposals = ``--samples``, RA one sample), on the
``mqar`` task at each length; batch ``--batch-size``. ``native`` is the framework's own
attention layer in the same model (:class:`torch.nn.MultiheadAttention`,
:class:`flax.nnx.MultiHeadAttention`; ``xattn train --estimators native``), the baseline
of the softmax row: the JSON and the output give ``softmax / native``, the step time of
the xattn layer with ``estimator="softmax"`` over that of the framework's layer. For each
length a trainer is built per estimator, ``--warmup`` steps are run, then ``--repeats``
rounds in which every estimator takes one step, interleaved, so that load changes on a
shared machine hit all estimators alike; the figures are the median wall time of a step
and its median CPU time (:func:`time.process_time`, which leaves out the time the process
waited for a core: the steadier figure on a loaded machine), and the load average before
and after the run is recorded. After the
timed rounds, one more step per estimator measures its peak memory as ``xattn train``
does (torch's CPU allocator or CUDA; XLA's memory analysis of the compiled step).
Single-threaded by default (``--threads``), like ``xattn train``. The full torch run
(lengths 256, 1024, 2048) takes about 10 minutes on one core.

    python benchmarks/training/bench_train.py                       # torch, lengths 256 ... 2048
    python benchmarks/training/bench_train.py --framework flax --lengths 256,1024

Writes ``<out>.json`` and ``<out>.png`` (default
``benchmarks/results/train_step_times_<framework>``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import xattn
from xattn.cli.figures import loglog_axes, new_figure, save_figure
from xattn.training.loop import ATTENTIONS, NATIVE, NATIVE_LAYERS, RunSpec, batches
from xattn.training.runs import attention_variants, load_framework
from xattn.training.tasks import get_task

RESULTS = Path(__file__).resolve().parents[1] / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="torch", choices=("torch", "flax"))
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--estimators", default=f"softmax,{NATIVE},rfa,lara",
                        help=f"comma-separated, among {', '.join(ATTENTIONS)}")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or RESULTS / f"train_step_times_{args.framework}")
    estimators = list(dict.fromkeys(args.estimators.split(",")))
    unknown = [name for name in estimators if name not in ATTENTIONS]
    if unknown:
        parser.error(f"--estimators: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(ATTENTIONS)}")
    module = load_framework(args.framework, args.threads)
    native = NATIVE_LAYERS[args.framework]
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {}
    ratios = []
    for length in (int(item) for item in args.lengths.split(",")):
        task = get_task("mqar", length)
        train, _ = task.datasets(args.batch_size * (args.warmup + args.repeats + 1), 1)
        trainers = {}
        for name, estimator, options in attention_variants(
                task, estimators, args.samples, has_grid=False, framework=args.framework):
            spec = RunSpec(task, name, estimator, options, seed=0,
                           steps=args.warmup + args.repeats, batch_size=args.batch_size,
                           peak_lr=1e-3)
            trainers[name] = (module.Trainer(spec), batches(train, args.batch_size, 0))
        times: dict[str, list[float]] = {name: [] for name in trainers}
        cpu_times: dict[str, list[float]] = {name: [] for name in trainers}
        for round_ in range(args.warmup + args.repeats):
            for name, (trainer, source) in trainers.items():
                batch = next(source)
                start, cpu_start = time.perf_counter(), time.process_time()
                trainer.step(batch, 1e-3)
                if round_ >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                    cpu_times[name].append(time.process_time() - cpu_start)
        medians, cpu_medians = {}, {}
        for name, (trainer, source) in trainers.items():
            medians[name] = 1000 * statistics.median(times[name])
            cpu_medians[name] = 1000 * statistics.median(cpu_times[name])
            peak = trainer.step(next(source), 1e-3, measure_memory=True)[1]  # not timed
            results.setdefault(name, []).append({
                "length": length, "ms_per_step": medians[name],
                "cpu_ms_per_step": cpu_medians[name],
                "all_ms": [1000 * t for t in times[name]],
                "all_cpu_ms": [1000 * t for t in cpu_times[name]],
                "peak_memory_bytes": peak})
            memory = "" if peak is None else f" {peak / 2**20:9.1f} MiB"
            print(f"{args.framework} N={length:>5} {name:<28} {medians[name]:9.1f} ms/step "
                  f"(CPU {cpu_medians[name]:9.1f} ms)" + memory, flush=True)
        if "softmax" in medians and native in medians:
            ratios.append({"length": length, "ratio": medians["softmax"] / medians[native],
                           "cpu_ratio": cpu_medians["softmax"] / cpu_medians[native]})
            print(f"{args.framework} N={length:>5} softmax / {native}: "
                  f"{ratios[-1]['ratio']:.3f} (CPU time {ratios[-1]['cpu_ratio']:.3f})",
                  flush=True)
    payload = {"benchmark": "bench_train.py", "framework": args.framework,
               "batch_size": args.batch_size, "samples": args.samples,
               "threads": args.threads, "warmup": args.warmup, "repeats": args.repeats,
               "task": "mqar", "xattn": xattn.__version__, "numpy": np.__version__,
               "python": platform.python_version(), "platform": platform.platform(),
               **module.versions(), "native": native,
               "peak_memory_method": next(iter(trainers.values()))[0].memory_method,
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "softmax_over_native": ratios, "results": results}
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
