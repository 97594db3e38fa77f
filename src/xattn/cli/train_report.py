"""Outputs of ``xattn train``: the table, ``train.json`` and ``train.png``, and reading
``train.json`` back for ``--resume``."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import xattn
from xattn.cli.common import format_bytes, format_table, write_json
from xattn.cli.figures import new_figure, save_figure
from xattn.cli.options import MAX_SEED
from xattn.training.loop import RunResult
from xattn.training.tasks import Task

__all__ = ["EVALUATION_MODES", "LARGEST_FIGURE", "TRAINING_MODES", "read_results",
           "summarize", "write_outputs", "write_results"]

#: Bound on every time, loss and byte count read back from a ``train.json``: far above
#: any real figure, and far enough below the largest float that sums over runs (means,
#: the total wall time) stay finite.
LARGEST_FIGURE = 1e15

EVALUATION_MODES = {
    "softmax": "exact softmax attention",
    "rfa": "the features of the last training step, fixed",
    "ra": "biased and deterministic (omega = the mixture mean, no noise)",
    "lara": "deterministic (omega_c = the proposal means mu_c)",
    "native": "the framework's own layer: exact softmax attention",
}
TRAINING_MODES = {
    "softmax": "exact softmax attention",
    "rfa": "fresh i.i.d. features at every step",
    "ra": "unbiased, one fresh sample per query at every step",
    "lara": "fresh samples omega_c ~ N(mu_c, I) at every step",
    "native": "the framework's own layer: exact softmax attention",
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


_COLUMNS = (("task", "<8"), ("attention", "<9"), ("test accuracy", ">17"),
            ("train loss", ">11"), ("ms/step", ">8"), ("peak MiB", ">9"))


def _print_table(rows: list[dict[str, Any]], memory_method: str) -> None:
    # the attention column widens for a longer row name (the framework's own layer,
    # "torch.nn.MultiheadAttention"), so that the columns after it stay aligned
    width = max([9, *(len(row["name"]) for row in rows)])
    columns = tuple((header, f"<{width}") if header == "attention" else (header, spec)
                    for header, spec in _COLUMNS)
    cells = []
    for row in rows:
        spread = (f" +- {row['test_accuracy_std']:.3f}" if len(row["seeds"]) > 1
                  else " " * 9)
        cells.append([row["task"], row["name"], f"{row['test_accuracy_mean']:>8.3f}{spread}",
                      f"{row['final_train_loss_mean']:.3f}", f"{row['ms_per_step']:.1f}",
                      format_bytes(row["peak_memory_bytes"])])
    print(format_table(columns, cells))
    print("test accuracy: mean +- std over seeds, on the held-out split, attention in its "
          "evaluation mode (rfa: fixed features; ra: biased, deterministic; lara: "
          "deterministic; the framework's own layer: exact); train loss: mean over the "
          "last 10% of the steps; ms/step: "
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


def write_results(path: Path, results: Sequence[RunResult], config: dict[str, Any],
                  versions: dict[str, str]) -> list[dict[str, Any]]:
    """Write ``train.json`` at ``path`` (atomically: a reader sees the old file or the new
    one, never a part); return its summary rows."""
    rows = summarize(results)
    memory_method = results[0].peak_memory_method if results else "not measured"
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
    write_json(path, payload)
    return rows


def write_outputs(out_dir: Path, results: Sequence[RunResult], config: dict[str, Any],
                  versions: dict[str, str], tasks: Sequence[Task]) -> None:
    """Write ``train.json``, print the table and write (when any run finished)
    ``train.png``."""
    rows = write_results(out_dir / "train.json", results, config, versions)
    if rows:
        _print_table(rows, results[0].peak_memory_method)
    written = [str(out_dir / "train.json")]
    if results:
        _plot(out_dir / "train.png", results, tasks, config["framework"])
        written.append(str(out_dir / "train.png"))
    print(f"wrote {', '.join(written)}")


# --------------------------------------------------------------------------------------
# reading train.json back (--resume)
# --------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A short rendering of a JSON value for a one-line message."""
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any, where: str, upper: float = LARGEST_FIGURE) -> float:
    """A JSON number from 0 to ``upper`` (NaN, infinities, bools and strings fail)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= upper:
        raise ValueError(f"{where} must be a number from 0 to {upper:g}, got {_shown(value)}")
    return float(value)


def _integer(value: Any, where: str, lower: int, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        raise ValueError(f"{where} must be an int from {lower} to {upper}, got "
                         f"{_shown(value)}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {_shown(value)}")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {_shown(value)}")
    return value


def _optional(check: Any) -> Any:
    return lambda value, where: None if value is None else check(value, where)


def _fraction(value: Any, where: str) -> float:
    return _number(value, where, upper=1.0)


def _curve(value: Any, where: str) -> list[dict[str, float]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list, got {_shown(value)}")
    points = []
    for index, point in enumerate(value):
        at = f"{where}[{index}]"
        point = _object(point, at)
        if set(point) != {"step", "test_accuracy", "train_loss"}:
            raise ValueError(f"{at} must have the keys step, test_accuracy, train_loss, "
                             f"has {', '.join(sorted(point)) or 'none'}")
        points.append({"step": _integer(point["step"], f"{at}.step", 1, 2**63 - 1),
                       "test_accuracy": _fraction(point["test_accuracy"],
                                                  f"{at}.test_accuracy"),
                       "train_loss": _number(point["train_loss"], f"{at}.train_loss")})
    return points


#: The check of each field of a run (a :class:`RunResult` as JSON).
_RUN_FIELDS: dict[str, Any] = {
    "task": _text, "name": _text, "estimator": _text, "options": _object,
    "seed": lambda value, where: _integer(value, where, 0, MAX_SEED),
    "steps": lambda value, where: _integer(value, where, 1, 2**63 - 1),
    "test_accuracy": _fraction, "final_train_loss": _number, "ms_per_step": _number,
    "peak_memory_bytes": _optional(lambda value, where: _integer(value, where, 0, 2**63 - 1)),
    "peak_memory_method": _text, "wall_s": _number, "curve": _curve,
    "sampled_test_accuracy": _optional(_fraction),
}
_REQUIRED_RUN_FIELDS = {field.name for field in dataclasses.fields(RunResult)
                        if field.default is dataclasses.MISSING}


def _run(value: Any, where: str) -> RunResult:
    run = _object(value, where)
    missing = sorted(_REQUIRED_RUN_FIELDS - set(run))
    unknown = sorted(set(run) - set(_RUN_FIELDS))
    if missing or unknown:
        raise ValueError(f"{where} " + "; ".join(
            text for text in (missing and f"lacks {', '.join(missing)}",
                              unknown and f"has unknown keys {', '.join(unknown)}") if text))
    return RunResult(**{name: _RUN_FIELDS[name](item, f"{where}.{name}")
                        for name, item in run.items()})


def read_results(path: Path) -> tuple[dict[str, Any], list[RunResult]]:
    """The configuration and the runs of a ``train.json``, every field checked.

    Everything ``--resume`` reads is checked here, before any training: the runs (each
    field of :class:`~xattn.training.loop.RunResult`, with its type and range: accuracies
    in [0, 1], times, losses and byte counts finite, from 0 to :data:`LARGEST_FIGURE`),
    and the configuration entries it uses (``tasks``, ``wall_s``).

    Raises
    ------
    ValueError
        One line naming the first entry that is wrong: the file cannot be read, is not
        JSON (or is nested too deeply to parse), or does not hold what ``xattn train``
        writes.
    """
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read it ({error.strerror or type(error).__name__})"
                         ) from None
    except RecursionError:
        raise ValueError("it is nested too deeply to be a train.json") from None
    except ValueError as error:
        raise ValueError(f"it is not JSON ({str(error).splitlines()[0]})") from None
    payload = _object(payload, "the file")
    for key in ("config", "runs"):
        if key not in payload:
            raise ValueError(f"it has no {key!r} entry")
    config = _object(payload["config"], "config")
    if "wall_s" in config:
        _number(config["wall_s"], "config.wall_s")
    for task, settings in _object(config.get("tasks", {}), "config.tasks").items():
        _object(settings, f"config.tasks.{task}")
    runs = payload["runs"]
    if not isinstance(runs, list):
        raise ValueError(f"runs must be a list, got {_shown(runs)}")
    return config, [_run(run, f"runs[{index}]") for index, run in enumerate(runs)]
