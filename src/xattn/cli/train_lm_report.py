"""``xattn train --task shakespeare``: the runs of the causal language model (their
plan, the checks of the options), the table, ``train.json`` and ``train.png`` (validation
loss against step)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import xattn
from xattn.cli.common import (
    CommandError,
    format_bytes,
    format_table,
    load_framework,
    output_dir,
    progress_bar,
    write_json,
)
from xattn.cli.figures import new_figure, save_figure
from xattn.cli.memory import host_memory_available, require_memory, training_step_bytes
from xattn.training.lm import LMResult, LMSpec, train_lm_run
from xattn.training.loop import NATIVE
from xattn.training.runs import LM_QUICK_EVAL_ITERS, attention_variants, lm_spec
from xattn.training.tasks import get_task

__all__ = ["DEFAULT_LM_ATTENTIONS", "LM_QUICK_EVAL_ITERS", "lm_step_bytes", "plan_lm", "run_lm",
           "summarize_lm"]

#: ``--estimators`` of ``--task shakespeare`` by default (rfa gives two rows, plain and
#: with a window and sinks); lara's segment proposals look ahead (lara-learned and
#: lara-defensive, causal LARA, are opt-in).
DEFAULT_LM_ATTENTIONS = ("softmax", "rfa", "ra")


def _check(args: argparse.Namespace) -> list[str]:
    """The attentions of the run; CommandError (one line) for options it cannot take."""
    if len(set(args.task)) > 1:
        raise CommandError("--task shakespeare runs alone (a causal language model with its "
                           "own outputs); give the other tasks in another command")
    estimators = list(dict.fromkeys(args.estimators or DEFAULT_LM_ATTENTIONS))
    if "lara" in estimators:
        raise CommandError("--estimators lara: --task shakespeare needs causal attention and "
                           "lara's segment proposals look ahead; use lara-learned or "
                           "lara-defensive (causal LARA), or softmax, rfa, ra, native")
    if args.resume:
        raise CommandError("--resume is not available with --task shakespeare")
    if args.jobs != 1:
        raise CommandError("--jobs: --task shakespeare runs one run at a time (--jobs 1)")
    return estimators


def plan_lm(args: argparse.Namespace, framework: str = "torch") -> list[LMSpec]:
    """Every run of the command, by seed and attention (``args`` as parsed)."""
    estimators = _check(args)
    try:
        task = get_task("shakespeare", args.length)
    except ValueError as problem:
        raise CommandError(str(problem)) from None
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    return [lm_spec(name, estimator, options, seed, steps=args.steps, length=task.length,
                    batch_size=args.batch_size, quick=args.quick)
            for seed in seeds
            for name, estimator, options in attention_variants(
                task, estimators, args.samples, False, framework)]


def lm_step_bytes(spec: LMSpec) -> int:
    """Memory of a run of ``spec`` at its largest, a training step: the parameters
    with their gradients and AdamW's two moments (float32; the position table grows with
    the context), :func:`~xattn.cli.memory.training_step_bytes` (with RFA's window and
    sinks), and for the framework's own layer (``native``) the causal mask it needs in
    each block, ``(L, L)`` booleans (torch: the mask and the copy ``triu`` makes; Flax:
    one per sequence of the batch), counted twice per sequence. The xattn layers take
    ``is_causal=True`` and no mask, so the linear estimators (RFA, causal LARA) stay
    linear in L. Evaluation and sampling (no gradients, at most the same windows) need
    less."""
    model = spec.model
    parameters = (model.layers * (4 * model.dim**2 + 2 * model.dim * model.ffn
                                  + 4 * model.dim + 2 * model.dim)
                  + (model.vocabulary + spec.length + 1) * model.dim)
    step = 16 * parameters + training_step_bytes(
        batch=spec.batch_size, length=spec.length, dim=model.dim, ffn=model.ffn,
        heads=model.heads, layers=model.layers, estimator=spec.estimator,
        samples=int(spec.options.get("num_features", spec.options.get("num_samples", 1))),
        window=int(spec.options.get("window") or 0), sinks=int(spec.options.get("sinks") or 0))
    if spec.estimator == NATIVE:
        step += model.layers * 2 * spec.batch_size * spec.length**2
    return step


def _payload(results: list[LMResult], config: dict[str, Any],
             versions: dict[str, str], memory_method: str) -> dict[str, Any]:
    return {"command": "xattn train", "config": config, "peak_memory_method": memory_method,
            "environment": {"xattn": xattn.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "numpy": np.__version__,
                            **versions},
            "summary": summarize_lm(results), "runs": [result.to_json() for result in results]}


def summarize_lm(results: list[LMResult]) -> list[dict[str, Any]]:
    """One row per attention: validation loss (nats and bits per character) mean and std
    over seeds, median ms per step and sampling speeds, max peak memory."""
    groups: dict[str, list[LMResult]] = {}
    for result in results:
        groups.setdefault(result.name, []).append(result)
    rows = []
    for name, runs in groups.items():
        losses = [run.val_loss for run in runs]
        states = [run.sample_tokens_per_s_state for run in runs
                  if run.sample_tokens_per_s_state is not None]
        peaks = [run.peak_memory_bytes for run in runs if run.peak_memory_bytes is not None]
        rows.append({
            "name": name, "estimator": runs[0].estimator, "seeds": [run.seed for run in runs],
            "val_loss_mean": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(runs) > 1 else 0.0,
            "val_bits_per_char_mean": statistics.fmean(losses) / math.log(2),
            "ms_per_step": statistics.median(run.ms_per_step for run in runs),
            "sample_tokens_per_s_recompute": statistics.median(
                run.sample_tokens_per_s_recompute for run in runs),
            "sample_tokens_per_s_state": statistics.median(states) if states else None,
            "peak_memory_bytes": max(peaks) if peaks else None})
    return rows


def _print_table(rows: list[dict[str, Any]], memory_method: str, length: int) -> None:
    width = max([9, *(len(row["name"]) for row in rows)])
    columns = (("attention", f"<{width}"), ("val loss", ">17"), ("bits/char", ">9"),
               ("ms/step", ">8"), ("peak MiB", ">9"), ("tok/s state", ">11"),
               ("tok/s recompute", ">15"))
    cells = []
    for row in rows:
        spread = f" +- {row['val_loss_std']:.3f}" if len(row["seeds"]) > 1 else " " * 9
        state = row["sample_tokens_per_s_state"]
        cells.append([row["name"], f"{row['val_loss_mean']:>8.3f}{spread}",
                      f"{row['val_bits_per_char_mean']:.3f}", f"{row['ms_per_step']:.1f}",
                      format_bytes(row["peak_memory_bytes"]),
                      "-" if state is None else f"{state:.0f}",
                      f"{row['sample_tokens_per_s_recompute']:.0f}"])
    print(format_table(columns, cells))
    print("val loss: nats per character on the validation split (last 10 %), mean +- std "
          "over seeds, estimated as nanoGPT does on random windows of the context (every "
          "position counted), attention in its evaluation mode; tok/s: sampling speed with "
          "the layers' generation state and by recomputing the whole context (at most "
          f"{length} tokens) for each token, timed in a second generation (the first one "
          "compiles); ms/step: median after 5 warm-up steps; peak "
          f"memory: {memory_method}")


def _plot(path: Path, results: list[LMResult]) -> None:
    figure, ax = new_figure(1, width=5.6, height=3.8)
    for name in dict.fromkeys(result.name for result in results):
        runs = [result for result in results if result.name == name]
        steps = [point["step"] for point in runs[0].curve]
        losses = np.mean([[point["val_loss"] for point in run.curve] for run in runs], axis=0)
        ax.plot(steps, losses, marker="o", markersize=3, label=name)
    ax.set_title("shakespeare")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    save_figure(figure, path)


def run_lm(args: argparse.Namespace) -> int:
    """Run ``xattn train --task shakespeare``."""
    specs = plan_lm(args, args.framework)
    if args.device == "cpu":
        require_memory([(f"shakespeare at context {spec.length} with batch size "
                         f"{spec.batch_size} ({spec.name})", lm_step_bytes(spec))
                        for spec in specs], host_memory_available(), "this machine")
    out_dir = output_dir(args.out, ("train.json", "train.png"))
    module = load_framework(args.framework, args.threads, language_model=True)
    config = {"framework": args.framework, "device": args.device, "threads": args.threads,
              "task": "shakespeare", "estimators": list(dict.fromkeys(spec.name for spec in specs)),
              "seeds": sorted({spec.seed for spec in specs}), "samples": args.samples,
              "quick": args.quick, **({k: v for k, v in dataclasses.asdict(specs[0]).items()
                                       if k not in ("name", "estimator", "options", "seed")}
                                      if specs else {})}
    print(f"xattn train: {args.framework} on {args.device}, {len(specs)} runs (shakespeare, "
          f"context {specs[0].length}, {specs[0].steps} steps)", flush=True)
    results: list[LMResult] = []
    started = time.perf_counter()
    interrupted = False
    try:
        for index, spec in enumerate(specs, 1):
            label = f"[{index}/{len(specs)}] shakespeare {spec.name} seed {spec.seed}"
            try:
                trainer = module.Trainer(spec, device=args.device)
            except ValueError as problem:  # a device the framework does not see
                raise CommandError(str(problem)) from None
            with progress_bar(spec.steps, label, args.progress, unit="step") as bar:
                try:
                    result = train_lm_run(spec, trainer, bar)
                except FloatingPointError as problem:
                    print(f"{label}: stopped, {problem}", file=sys.stderr, flush=True)
                    continue
            results.append(result)
            state = result.sample_tokens_per_s_state
            print(f"{label}: val loss {result.val_loss:.3f} nats/char "
                  f"({result.val_bits_per_char:.3f} bits), {result.ms_per_step:.0f} ms/step, "
                  f"sampling {'-' if state is None else f'{state:.0f}'} tok/s with the state, "
                  f"{result.sample_tokens_per_s_recompute:.0f} recomputing, "
                  f"{result.wall_s:.0f} s; sample:\n{result.sample}\n", flush=True)
            config.update({"wall_s": time.perf_counter() - started, "interrupted": True})
            write_json(out_dir / "train.json", _payload(results, config, module.versions(),
                                                        result.peak_memory_method))
    except KeyboardInterrupt:
        interrupted = True
        print(f"\nxattn train: interrupted; writing the {len(results)} finished runs",
              file=sys.stderr)
    config.update({"wall_s": time.perf_counter() - started, "interrupted": interrupted})
    method = results[0].peak_memory_method if results else "not measured"
    write_json(out_dir / "train.json", _payload(results, config, module.versions(), method))
    written = [str(out_dir / "train.json")]
    if results:
        _print_table(summarize_lm(results), method, specs[0].length)
        _plot(out_dir / "train.png", results)
        written.append(str(out_dir / "train.png"))
    print(f"wrote {', '.join(written)}")
    return 130 if interrupted else 0
