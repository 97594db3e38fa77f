"""``xattn train --resume``: taking over the runs of an earlier ``train.json`` (those the
command plans again, and the others, kept), and refusing a file it could not put in one
table with its own runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from xattn.cli.common import CommandError
from xattn.cli.train_report import read_results
from xattn.training.loop import ATTENTIONS, RunResult, RunSpec
from xattn.training.runs import attention_variants
from xattn.training.tasks import Task

__all__ = ["RESUME_KEYS", "PreviousRuns", "previous_runs", "row_names"]


#: Configuration entries that must match for ``--resume`` to take runs over, with the
#: option that sets each (None: not an option, fixed by the version or the framework).
RESUME_KEYS = {"framework": "--framework", "device": "--device", "samples": "--samples",
               "quick": "--quick", "batch_size": "--batch-size", "model": None,
               "lara_2d_segments": None}


@dataclasses.dataclass
class PreviousRuns:
    """The runs of an earlier ``train.json``: ``taken`` are those this command plans (by
    job index), ``kept`` those it does not plan (other attentions or seeds), kept in
    the file and in the table."""

    taken: dict[int, RunResult]
    kept: list[RunResult]
    wall_s: float


def previous_runs(path: Path, config: dict[str, Any], jobs: dict[int, RunSpec],
                  rows: dict[str, dict[str, str]]) -> PreviousRuns:
    """The runs of an earlier ``train.json`` at ``path``: those the planned ``jobs`` (their
    specifications by job index) would repeat (same task, attention and seed), and the
    others, which are kept. Nothing is dropped: a run that this command could not put in
    one table with its own (another task, other task settings such as the length, other
    steps) makes it refuse. ``rows`` maps each task to its row names and their layers'
    estimators.

    Raises
    ------
    CommandError
        The file is not a ``train.json`` (any entry it reads has the wrong type or
        range, see :func:`~xattn.cli.train_report.read_results`; a row that is not one
        of ``xattn train``), its settings differ from ``config``, or it holds runs of
        another task, task setting or number of steps. One line; the file is left as it is.
    """
    if not path.exists():
        return PreviousRuns({}, [], 0.0)
    untouched = "nothing was trained and the file is left as it is"
    try:
        previous_config, runs = read_results(path)
    except ValueError as problem:
        raise CommandError(f"--resume: {path}: {problem}; {untouched}") from None
    for key, option in RESUME_KEYS.items():
        if previous_config.get(key) != config[key]:
            raise CommandError(f"--resume: {path} was written with {option or key} "
                               f"{_setting(previous_config.get(key))}, this command has "
                               f"{_setting(config[key])}; {untouched}")
    planned = {(spec.task.name, spec.name, spec.seed): index for index, spec in jobs.items()}
    steps = {spec.task.name: spec.steps for spec in jobs.values()}
    taken: dict[int, RunResult] = {}
    kept: dict[tuple[str, str, int], RunResult] = {}
    for index, result in enumerate(runs):
        where = f"--resume: {path} holds {result.task} runs"
        if result.task not in config["tasks"]:
            raise CommandError(f"{where}, a task this command does not train; add --task "
                               f"{result.task}, or choose another --out; {untouched}")
        settings = previous_config.get("tasks", {}).get(result.task)
        if settings != config["tasks"][result.task]:
            length = (settings or {}).get("length")
            if length != config["tasks"][result.task]["length"]:
                raise CommandError(f"{where} at --length {length}, this command has "
                                   f"{config['tasks'][result.task]['length']}; {untouched}")
            token_init = (settings or {}).get("token_init", "not recorded (xattn 0.1)")
            if token_init != config["tasks"][result.task]["token_init"]:
                raise CommandError(f"{where} with --token-init {token_init}, this command "
                                   f"has {config['tasks'][result.task]['token_init']}; "
                                   f"{untouched}")
            raise CommandError(f"{where} with other task settings ({settings!r:.60}); "
                               f"choose another --out; {untouched}")
        if result.steps != steps.get(result.task, result.steps):
            raise CommandError(f"{where} of {result.steps} steps, this command trains "
                               f"{steps[result.task]} (--steps); give --steps "
                               f"{result.steps}, or choose another --out; {untouched}")
        if rows[result.task].get(result.name) != result.estimator:
            raise CommandError(f"--resume: {path}: runs[{index}] is not a row of xattn train "
                               f"(attention {result.name!r:.40}, estimator "
                               f"{result.estimator!r:.40}); {untouched}")
        run_key = (result.task, result.name, result.seed)
        if run_key in planned:
            taken[planned[run_key]] = result
        else:
            kept[run_key] = result
    wall_s = previous_config.get("wall_s", 0.0) if runs else 0.0
    return PreviousRuns(taken, list(kept.values()), wall_s)


def _setting(value: Any) -> str:
    """A recorded setting in a message (None: the option was not given)."""
    return "the default" if value is None else f"{value!r:.60}"


def row_names(tasks: list[Task], samples: int, has_grid: bool,
              framework: str) -> dict[str, dict[str, str]]:
    """Every row ``xattn train`` can run on each task: ``{task: {row name: attention}}``
    (the name in ``--estimators``), for reading back a ``train.json``."""
    names: dict[str, dict[str, str]] = {}
    for task in tasks:
        names[task.name] = {}
        for attention in ATTENTIONS:
            for name, _, _ in attention_variants(task, [attention], samples, has_grid,
                                                 framework):
                names[task.name][name] = attention
    return names
