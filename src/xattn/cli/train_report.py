"""Outputs of ``xattn train``: the table, ``train.json`` and ``train.png``."""

from __future__ import annotations

import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import xattn
from xattn.cli.common import format_bytes, write_json
from xattn.cli.figures import new_figure, save_figure
from xattn.cli.tasks import Task
from xattn.cli.train_core import RunResult

__all__ = ["EVALUATION_MODES", "TRAINING_MODES", "summarize", "write_outputs"]

EVALUATION_MODES = {
    "softmax": "exact softmax attention",
    "rfa": "the features of the last training step, fixed",
    "ra": "biased and deterministic (omega = the mixture mean, no noise)",
    "lara": "deterministic (omega_c = the proposal means mu_c)",
}
TRAINING_MODES = {
    "softmax": "exact softmax attention",
    "rfa": "fresh i.i.d. features at every step",
    "ra": "unbiased, one fresh sample per query at every step",
    "lara": "fresh samples omega_c ~ N(mu_c, I) at every step",
}


def summarize(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per (task, attention): the mean and std (over seeds, ddof = 1; 0 for one
    seed) of test accuracy and final training loss, median ms per step, max peak memory."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.task, result.name), []).append(result)
    rows = []
    for (task, name), runs in groups.items():
        accuracies = [run.test_accuracy for run in runs]
        losses = [run.final_train_loss for run in runs]
        peaks = [run.peak_memory_bytes for run in runs if run.peak_memory_bytes is not None]
        rows.append({
            "task": task, "name": name, "estimator": runs[0].estimator,
            "options": runs[0].options, "seeds": [run.seed for run in runs],
            "test_accuracy_mean": statistics.fmean(accuracies),
            "test_accuracy_std": statistics.stdev(accuracies) if len(runs) > 1 else 0.0,
            "test_accuracies": accuracies,
            "final_train_loss_mean": statistics.fmean(losses),
            "final_train_loss_std": statistics.stdev(losses) if len(runs) > 1 else 0.0,
            "ms_per_step": statistics.median(run.ms_per_step for run in runs),
            "peak_memory_bytes": max(peaks) if peaks else None,
        })
    return rows


def _print_table(rows: list[dict[str, Any]], memory_method: str) -> None:
    header = (f"{'task':<8} {'attention':<9} {'test accuracy':>17} {'train loss':>11} "
              f"{'ms/step':>8} {'peak MiB':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = (f" +- {row['test_accuracy_std']:.3f}" if len(row["seeds"]) > 1
                  else " " * 9)
        print(f"{row['task']:<8} {row['name']:<9} {row['test_accuracy_mean']:>8.3f}{spread} "
              f"{row['final_train_loss_mean']:>11.3f} {row['ms_per_step']:>8.1f} "
              f"{format_bytes(row['peak_memory_bytes']):>9}")
    print("test accuracy: mean +- std over seeds, on the held-out split, attention in its "
          "evaluation mode (rfa: fixed features; ra: biased, deterministic; lara: "
          "deterministic); train loss: mean over the last 10% of the steps; ms/step: "
          f"median after 5 warm-up steps; peak memory: {memory_method}")


def _plot(path: Path, results: Sequence[RunResult], tasks: Sequence[Task],
          framework: str) -> None:
    names = [task.name for task in tasks if any(run.task == task.name for run in results)]
    figure, axes = new_figure(max(1, len(names)), width=4.8, height=3.8)
    axes = np.atleast_1d(axes)
    for ax, task in zip(axes, names, strict=False):
        rows: dict[str, list[RunResult]] = {}
        for run in results:
            if run.task == task:
                rows.setdefault(run.name, []).append(run)
        for name, runs in rows.items():
            steps = [point["step"] for point in runs[0].curve]
            curves = np.array([[point["test_accuracy"] for point in run.curve]
                               for run in runs if len(run.curve) == len(steps)])
            mean = curves.mean(axis=0)
            line, = ax.plot(steps, mean, marker="o", markersize=3, label=name)
            if len(curves) > 1:
                ax.fill_between(steps, curves.min(axis=0), curves.max(axis=0),
                                color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(task)
        ax.set_xlabel("training step")
        ax.set_ylabel("test accuracy")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    figure.suptitle(f"xattn train ({framework}): mean over seeds, band from min to max",
                    fontsize="medium")
    save_figure(figure, path)


def write_outputs(out_dir: Path, results: Sequence[RunResult], config: dict[str, Any],
                  versions: dict[str, str], tasks: Sequence[Task]) -> None:
    """Print the table and write ``train.json`` and (when any run finished) ``train.png``."""
    rows = summarize(results)
    memory_method = results[0].peak_memory_method if results else "not measured"
    if rows:
        _print_table(rows, memory_method)
    payload = {
        "command": "xattn train",
        "config": config,
        "evaluation_modes": EVALUATION_MODES,
        "training_modes": TRAINING_MODES,
        "peak_memory_method": memory_method,
        "environment": {"xattn": xattn.__version__, "python": platform.python_version(),
                        "platform": platform.platform(), "numpy": np.__version__,
                        **versions},
        "summary": rows,
        "runs": [result.to_json() for result in results],
    }
    write_json(out_dir / "train.json", payload)
    written = [str(out_dir / "train.json")]
    if results:
        _plot(out_dir / "train.png", results, tasks, config["framework"])
        written.append(str(out_dir / "train.png"))
    print(f"wrote {', '.join(written)}")
