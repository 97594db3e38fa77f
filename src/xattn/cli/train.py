"""``xattn train``: train the Long Range Arena model with each estimator as its attention,
through the public layers (:class:`xattn.torch.MultiheadAttention`,
:class:`xattn.flax.MultiHeadAttention`), on generated or shipped tasks, and report test
accuracy, training loss, time per step and peak memory; optionally also with the
framework's own layer (``--estimators native``: :class:`torch.nn.MultiheadAttention`,
:class:`flax.nnx.MultiHeadAttention`) as the baseline of the softmax row.

The run configuration (model, optimizer, schedule, estimator options) is in
:mod:`xattn.cli.train_core`, the tasks in :mod:`xattn.cli.tasks`, the outputs in
:mod:`xattn.cli.train_report`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import json
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xattn.cli.common import CommandError, output_dir, progress_bar
from xattn.cli.measure import DEVICES
from xattn.cli.memory import (
    dataset_bytes,
    host_memory_available,
    require_memory,
    training_step_bytes,
)
from xattn.cli.options import (
    MAX_SEED,
    add_out_option,
    add_progress_options,
    int_at_least,
    name_list,
    positive_int,
    seed_list,
)
from xattn.cli.tasks import CLASSIFICATION_TASKS, TASKS, Task, get_task
from xattn.cli.train_core import (
    ATTENTIONS,
    LARA_VARIANTS,
    NATIVE,
    NATIVE_LAYERS,
    TOKEN_INITS,
    ModelConfig,
    RunResult,
    RunSpec,
    attention_options,
    lara_variant_options,
    train_run,
)
from xattn.cli.train_lm import LM_QUICK_STEPS, RFA_SINKS, RFA_WINDOW, RFA_WINDOW_ROW
from xattn.cli.train_lm_report import run_lm
from xattn.cli.train_report import read_results, write_outputs, write_results

__all__ = ["DEFAULT_ATTENTIONS", "DEFAULT_SAMPLES", "EXIT_INTERRUPTED", "FRAMEWORKS",
           "RESUME_KEYS", "SETTINGS", "Job", "PreviousRuns", "TaskSettings", "add_parser",
           "attention_variants", "check_jobs", "dataset_sizes", "grid_pools",
           "load_framework", "plan_jobs", "previous_runs", "row_names", "run", "run_jobs"]

FRAMEWORKS = ("torch", "flax")  # each also the name of the extra that installs it
EXIT_INTERRUPTED = 130


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """Optimization of one task: steps (full run, ``--quick``), batch size, peak learning
    rate, and how many generated training / test examples there are."""

    steps: int
    quick_steps: int
    batch_size: int
    peak_lr: float
    train_size: int
    test_size: int
    quick_train_size: int
    warmup_fraction: float = 0.1


SETTINGS = {
    "mqar": TaskSettings(steps=600, quick_steps=300, batch_size=32, peak_lr=1e-3,
                         train_size=19_200, test_size=500, quick_train_size=9_600),
    "listops": TaskSettings(steps=600, quick_steps=200, batch_size=32, peak_lr=1e-3,
                            train_size=8_000, test_size=1_000, quick_train_size=3_000),
    "digits": TaskSettings(steps=600, quick_steps=200, batch_size=32, peak_lr=3e-3,
                           train_size=0, test_size=0, quick_train_size=0),
}
#: RFA features and LARA proposals of every run unless ``--samples`` says otherwise.
DEFAULT_SAMPLES = 16
#: ``--estimators`` by default: every estimator. The framework's own layer
#: (:data:`~xattn.cli.train_core.NATIVE`) is opt-in: its losses and accuracies are those of
#: the softmax row (tests/test_train.py), so by default the time goes to the estimators.
DEFAULT_ATTENTIONS = tuple(name for name in ATTENTIONS
                           if name != NATIVE and name not in LARA_VARIANTS)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command to ``subparsers``."""
    parser = subparsers.add_parser(
        "train", help="train a small Transformer with each estimator; test accuracy",
        description="Train the Long Range Arena model (2 layers, embedding 64, feed-forward "
        "128, 2 heads, mean pooling) with each estimator as its attention, through "
        "xattn.torch.MultiheadAttention or xattn.flax.MultiHeadAttention, with AdamW "
        "(weight decay 0.01, gradient norm clipped at 1, linear warm-up over 10 % of the "
        "steps, then cosine decay to 0). With --estimators native the same model also "
        "runs with the framework's own attention layer (torch.nn.MultiheadAttention, "
        "nnx.MultiHeadAttention; same initialization as the xattn layer), the baseline "
        "of the softmax row. Test accuracy is measured on a held-out split "
        "with every attention in its evaluation mode: RFA with its last features, RA "
        "biased and deterministic, LARA deterministic (the proposal means as samples). "
        "Prints a table (test accuracy mean +- std over seeds, final training loss, ms "
        "per step, peak memory) and writes DIR/train.json (every figure, learning curves, "
        "configuration, versions) and DIR/train.png (test accuracy against step). "
        "DIR/train.json is rewritten (atomically) as each run finishes, so neither "
        "Ctrl-C nor a crash loses a finished run; --resume then runs only the missing "
        "ones, keeping the runs it does not plan (see --resume). The memory the runs "
        "need is estimated first and too large a size is refused before any work.")
    parser.add_argument("--framework", default="torch", choices=FRAMEWORKS,
                        metavar="|".join(FRAMEWORKS),
                        help=f"{' or '.join(FRAMEWORKS)} (default: torch)")
    parser.add_argument("--task", type=name_list, choices=TASKS,
                        default=list(CLASSIFICATION_TASKS), metavar="LIST",
                        help=f"comma-separated tasks among {', '.join(TASKS)} (default: "
                        f"{','.join(CLASSIFICATION_TASKS)}); shakespeare (a causal "
                        "character-level GPT, nanoGPT's CPU configuration) runs alone")
    parser.add_argument("--estimators", type=name_list, choices=ATTENTIONS,
                        default=None, metavar="LIST",
                        help="comma-separated attentions among "
                        f"{', '.join(ATTENTIONS)} (default: "
                        f"{','.join(DEFAULT_ATTENTIONS)}; shakespeare: softmax,rfa,ra, "
                        "no lara, whose segments look ahead); lara-learned: LARA with "
                        "learned proposal means; lara-defensive: a quarter of the proposals "
                        "N(0, I), the others segment means (shakespeare: learned); on "
                        f"shakespeare, rfa runs also as {RFA_WINDOW_ROW} "
                        f"(window {RFA_WINDOW}, {RFA_SINKS} sinks); on digits, lara runs with 2-D "
                        f"(8x8 image) and 1-D segments; {NATIVE} is the framework's own "
                        f"layer ({' or '.join(NATIVE_LAYERS.values())}, exact softmax "
                        "attention), the baseline of the softmax row")
    parser.add_argument("--seeds", type=seed_list, default=None, metavar="LIST",
                        help=f"comma-separated seeds, each 0 to {MAX_SEED} (default: 0,1,2; "
                        "0 with --quick)")
    parser.add_argument("--steps", type=positive_int, default=None, metavar="N",
                        help="training steps of every task (default: mqar 600, listops "
                        "600, digits 600, shakespeare 2000; with --quick 300, 200, 200, "
                        f"{LM_QUICK_STEPS})")
    parser.add_argument("--length", type=positive_int, default=None, metavar="N",
                        help="sequence length (default: mqar 256, listops 512 at most; "
                        "digits is always 64; shakespeare's context 64)")
    parser.add_argument("--samples", type=positive_int, default=DEFAULT_SAMPLES,
                        metavar="S", help="RFA features and LARA proposals, equal for a "
                        f"fair comparison (default: {DEFAULT_SAMPLES}); RA draws 1 sample")
    parser.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                        help="batch size (default: 32; shakespeare 12)")
    parser.add_argument("--token-init", default="scaled", choices=TOKEN_INITS,
                        help="initial token embeddings of the classification tasks, in "
                        "both frameworks: scaled N(0, 1/width) (default; Flax's nnx.Embed) "
                        "or unit N(0, 1) (PyTorch's nn.Embedding; the PyTorch default of "
                        "xattn 0.1)")
    parser.add_argument("--quick", action="store_true",
                        help="one seed and fewer steps and examples (a few minutes)")
    parser.add_argument("--device", default="cpu", choices=DEVICES,
                        help="device (default: cpu)")
    parser.add_argument("--threads", type=int_at_least(0), default=1, metavar="N",
                        help="CPU threads per run (default: 1, which is about as fast for "
                        "these small models and does not fight other processes; 0: the "
                        "framework's default)")
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                        help="runs at a time, each in its own process (default: 1; on a "
                        "free machine up to the number of cores, with --threads 1)")
    add_out_option(parser)
    parser.add_argument("--resume", action="store_true",
                        help="take over the runs already in DIR/train.json (from a run "
                        "stopped by Ctrl-C, or with fewer seeds) and run only the missing "
                        "ones. A finished run is never removed: runs of other --estimators "
                        "or --seeds stay in DIR/train.json and in the table; a file with "
                        "runs of another --task, --steps or --length, or written with "
                        "another --framework, --device, --samples, --quick or --batch-size, "
                        "is refused (exit 2, nothing trained, the file left as it is)")
    add_progress_options(parser, "the progress bars")
    parser.set_defaults(run=run)
    return parser


def load_framework(framework: str, threads: int) -> Any:
    """Import the framework's trainer module (naming the extra when it is missing)."""
    if framework == "flax" and threads and "jax" not in sys.modules:
        # XLA reads its thread settings when JAX starts
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                              f"intra_op_parallelism_threads={threads}")
    try:
        module = importlib.import_module(f"xattn.cli.train_{framework}")
    except ImportError as error:
        raise CommandError(f"--framework {framework} needs {error.name or framework}, which "
                           f"is not installed (in the clone of xattn: pip install -e "
                           f"'.[{framework}]')") from None
    if framework == "torch" and threads:
        import torch
        torch.set_num_threads(threads)
    return module


def grid_pools(samples: int, grid: tuple[int, int]) -> tuple[int, int]:
    """(c_h, c_w) with c_h * c_w = ``samples``, as square as possible, within ``grid``;
    the nearest smaller count when ``samples`` has no such factorization."""
    for count in range(min(samples, grid[0] * grid[1]), 0, -1):
        pairs = [(rows, count // rows) for rows in range(1, grid[0] + 1)
                 if count % rows == 0 and count // rows <= grid[1]]
        if pairs:
            return min(pairs, key=lambda pair: abs(pair[0] - pair[1]))
    return (1, 1)


def attention_variants(task: Task, estimators: list[str], samples: int,
                       has_grid: bool, framework: str = "torch",
                       ) -> list[tuple[str, str, dict[str, Any]]]:
    """(row name, layer estimator, options) of each run on ``task``. On an image task
    LARA runs twice: ``lara-2d`` (2-D segments on the image grid) and ``lara-1d``; on a
    causal task RFA runs twice, plain and with a window and sinks (``rfa-window``). The
    rows of :data:`~xattn.cli.train_core.LARA_VARIANTS` run LARA with the options of
    :func:`~xattn.cli.train_core.lara_variant_options`.
    :data:`~xattn.cli.train_core.NATIVE` is the row of ``framework``'s own layer, named
    after it (:data:`~xattn.cli.train_core.NATIVE_LAYERS`)."""
    variants = []
    for estimator in estimators:
        options = attention_options(estimator, min(samples, task.length))
        if estimator == NATIVE:
            variants.append((NATIVE_LAYERS[framework], NATIVE, options))
        elif estimator == "rfa" and task.causal:  # also with an exact window and sinks
            variants += [("rfa", "rfa", options), (RFA_WINDOW_ROW, "rfa", {
                **options, "window": RFA_WINDOW, "sinks": RFA_SINKS})]
        elif estimator in LARA_VARIANTS:
            variants.append((estimator, "lara", lara_variant_options(
                estimator, min(samples, task.length), causal=task.causal)))
        elif estimator == "lara" and task.grid is not None:
            if has_grid:
                pools = grid_pools(samples, task.grid)
                variants.append(("lara-2d", "lara", {"num_samples": pools,
                                                     "grid": task.grid}))
            variants.append(("lara-1d", "lara", options))
        else:
            variants.append((estimator, estimator, options))
    return variants


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run: its place in the plan, its label, what it trains and the sizes of
    its generated training and test sets."""

    index: int
    label: str
    spec: RunSpec
    train_size: int
    test_size: int


def dataset_sizes(settings: TaskSettings, spec: RunSpec, quick: bool) -> tuple[int, int]:
    """(training, test) examples of a run: a shipped task's fixed split, else the task's
    settings (``quick``: the smaller training set) with at least one batch of training
    examples."""
    if spec.task.fixed_sizes is not None:
        return spec.task.fixed_sizes
    train_size = settings.quick_train_size if quick else settings.train_size
    return max(train_size, spec.batch_size), settings.test_size


def _sample_count(options: dict[str, Any]) -> int:
    """Samples of one attention call: RFA's features, RA's or LARA's samples (a 2-D
    LARA's pools ``(c_h, c_w)`` count ``c_h * c_w``); 1 for softmax."""
    count = options.get("num_features", options.get("num_samples", 1))
    return math.prod(count) if isinstance(count, tuple | list) else int(count)


def check_jobs(jobs: list[Job], parallel: int, device: str,
               available: int | None) -> None:
    """Refuse, before any work, runs that cannot be done: a batch larger than the
    training set, or more memory than ``available`` bytes of host memory (``parallel``
    runs at a time, each with its own data; on ``cpu`` also the training step's, see
    :func:`xattn.cli.memory.training_step_bytes`).

    Raises
    ------
    CommandError
        One line naming the size at fault.
    """
    needs = []
    for job in jobs:
        spec, task = job.spec, job.spec.task
        if spec.batch_size > job.train_size:
            raise CommandError(f"--batch-size {spec.batch_size} is larger than the "
                               f"{task.name} training set ({job.train_size} examples)")
        need = dataset_bytes(job.train_size + job.test_size, task.length,
                             len(task.vocabulary_sizes), task.per_token)
        if device == "cpu":
            model = spec.model
            need += training_step_bytes(
                batch=spec.batch_size, length=task.length, dim=model.dim, ffn=model.ffn,
                heads=model.heads, layers=model.layers, estimator=spec.estimator,
                samples=_sample_count(spec.options))
        needs.append((f"{task.name} at length {task.length} with batch size "
                       f"{spec.batch_size} ({spec.name}, {min(parallel, len(jobs))} at a "
                       "time)", min(parallel, len(jobs)) * need))
    require_memory(needs, available, "this machine")


_WORKER: dict[str, Any] = {}


def _init_worker(framework: str, threads: int) -> None:
    """Process-pool initializer: load the framework; leave Ctrl-C to the main process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER["module"] = load_framework(framework, threads)


def _execute(job: Job, device: str, progress: bool | None,
             position: int | None = None) -> RunResult | str:
    """One run (in this process or a worker); a message instead when it diverged."""
    module = _WORKER["module"]
    train, test = job.spec.task.datasets(job.train_size, job.test_size)
    trainer = module.Trainer(job.spec, device=device)
    with progress_bar(job.spec.steps, job.label, progress, unit="step",
                      position=position) as bar:
        try:
            return train_run(job.spec, trainer, train, test, bar)
        except FloatingPointError as problem:
            return f"stopped, {problem}"


def _execute_in_worker(job: Job, device: str, progress: bool | None) -> RunResult | str:
    identity = multiprocessing.current_process()._identity  # 1, 2, ... per pool worker
    return _execute(job, device, progress, position=identity[0] - 1 if identity else None)


def _report(job: Job, result: RunResult | str, finished: dict[int, RunResult]) -> None:
    if isinstance(result, str):
        print(f"{job.label}: {result}", file=sys.stderr, flush=True)
        return
    finished[job.index] = result
    print(f"{job.label}: test accuracy {result.test_accuracy:.3f}, train loss "
          f"{result.final_train_loss:.3f}, {result.ms_per_step:.0f} ms/step, "
          f"{result.wall_s:.0f} s", flush=True)


def run_jobs(jobs: list[Job], args: argparse.Namespace,
             finished: dict[int, RunResult] | None = None,
             on_finished: Callable[[], object] | None = None) -> dict[int, RunResult]:
    """Run ``jobs``, ``args.jobs`` at a time (in spawned processes when more than one),
    reporting each; the results, by job index, go into ``finished`` as they come, and
    ``on_finished()`` is called after each run that finished."""
    finished = {} if finished is None else finished

    def report(job: Job, result: RunResult | str) -> None:
        _report(job, result, finished)
        if on_finished is not None and not isinstance(result, str):
            on_finished()

    if args.jobs == 1:
        if "module" not in _WORKER:
            _WORKER["module"] = load_framework(args.framework, args.threads)
        for job in jobs:
            report(job, _execute(job, args.device, args.progress))
        return finished
    executor = concurrent.futures.ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker, initargs=(args.framework, args.threads))
    try:
        futures = {executor.submit(_execute_in_worker, job, args.device, args.progress): job
                   for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            report(futures[future], future.result())
    except BaseException:
        for process in list(getattr(executor, "_processes", {}).values()):
            process.terminate()  # the workers ignore Ctrl-C: end the runs in flight
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown()
    return finished


#: Configuration entries that must match for ``--resume`` to take runs over, with the
#: option that sets each (None: not an option, fixed by the version or the framework).
RESUME_KEYS = {"framework": "--framework", "device": "--device", "samples": "--samples",
               "quick": "--quick", "batch_size": "--batch-size", "model": "--token-init",
               "lara_2d_segments": None}


@dataclasses.dataclass
class PreviousRuns:
    """The runs of an earlier ``train.json``: ``taken`` are those this command plans (by
    job index), ``kept`` those it does not plan (other attentions or seeds), kept in
    the file and in the table."""

    taken: dict[int, RunResult]
    kept: list[RunResult]
    wall_s: float


def previous_runs(path: Path, config: dict[str, Any], jobs: list[Job],
                  rows: dict[str, dict[str, str]]) -> PreviousRuns:
    """The runs of an earlier ``train.json`` at ``path``: those ``jobs`` would repeat (same
    task, attention and seed), and the others, which are kept. Nothing is dropped: a run
    that this command could not put in one table with its own (another task, other task
    settings such as the length, other steps) makes it refuse. ``rows`` maps each task to
    its row names and their layers' estimators.

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
    planned = {(job.spec.task.name, job.spec.name, job.spec.seed): job for job in jobs}
    steps = {job.spec.task.name: job.spec.steps for job in jobs}
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
            taken[planned[run_key].index] = result
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


def run(args: argparse.Namespace) -> int:
    """Run ``xattn train``."""
    if "shakespeare" in args.task:  # the causal language model: its own loop and outputs
        return run_lm(args)
    args.estimators = args.estimators or list(DEFAULT_ATTENTIONS)
    tasks = []
    for name in dict.fromkeys(args.task):
        try:
            tasks.append(get_task(name, args.length))
        except ValueError as problem:  # a length the task cannot use
            raise CommandError(str(problem)) from None
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    # sizes are checked on the plan with 2-D LARA segments (the larger one), before any work
    check_jobs(plan_jobs(tasks, seeds, args, has_grid=True), args.jobs, args.device,
               host_memory_available())
    out_dir = output_dir(args.out, ("train.json", "train.png"))
    module = _WORKER["module"] = load_framework(args.framework, args.threads)
    has_grid = module.supports_grid()
    jobs = plan_jobs(tasks, seeds, args, has_grid)
    config = {
        "framework": args.framework, "device": args.device, "threads": args.threads,
        "jobs": args.jobs,
        "tasks": {task.name: {"length": task.length, "description": task.description,
                              "grid": task.grid, **dataclasses.asdict(SETTINGS[task.name])}
                  for task in tasks},
        "estimators": list(args.estimators), "seeds": seeds, "samples": args.samples,
        "quick": args.quick, "steps": args.steps, "batch_size": args.batch_size,
        "model": dataclasses.asdict(jobs[0].spec.model) if jobs else None,
        "lara_2d_segments": has_grid,
    }
    # JSON's view of the configuration (tuples become lists), as a resumed file holds it
    config = json.loads(json.dumps(config))
    finished: dict[int, RunResult] = {}
    earlier_wall_s = 0.0
    kept = 0
    if args.resume:  # the whole file is checked here, before any training
        rows = row_names(tasks, args.samples, has_grid, args.framework)
        previous = previous_runs(out_dir / "train.json", config, jobs, rows)
        finished, earlier_wall_s, kept = previous.taken, previous.wall_s, len(previous.kept)
        # the runs this command does not plan stay, after its own
        finished.update(enumerate(previous.kept, len(jobs) + 1))
        attentions = {name: attention for names in rows.values()
                      for name, attention in names.items()}
        config.update({
            "estimators": list(dict.fromkeys([*config["estimators"], *(
                attentions[result.name] for result in previous.kept)])),
            "seeds": sorted({*seeds, *(result.seed for result in previous.kept)}),
            "kept_runs": kept})
    taken_over = len(finished) - kept
    started = time.perf_counter()

    def save(interrupted: bool) -> list[RunResult]:
        """Write train.json with the runs finished so far; return them."""
        results = [finished[index] for index in sorted(finished)]
        config.update({"wall_s": earlier_wall_s + time.perf_counter() - started,
                       "interrupted": interrupted, "resumed_runs": taken_over})
        write_results(out_dir / "train.json", results, config, module.versions())
        return results

    print(f"xattn train: {args.framework} on {args.device}, {len(jobs)} runs "
          f"({', '.join(task.name for task in tasks)}; seeds {', '.join(map(str, seeds))}; "
          f"{args.jobs} at a time)"
          + (f"; {taken_over} taken over from {out_dir / 'train.json'}" if taken_over
             else "")
          + (f"; {kept} kept from it that this command does not plan" if kept else ""),
          flush=True)
    interrupted = False
    try:
        # each finished run is on disk at once (marked interrupted until the last one)
        run_jobs([job for job in jobs if job.index not in finished], args, finished,
                 on_finished=lambda: save(interrupted=True))
    except KeyboardInterrupt:
        interrupted = True
        print(f"\nxattn train: interrupted; writing the {len(finished)} finished runs "
              "(--resume runs the others)", file=sys.stderr)
    results = save(interrupted)
    write_outputs(out_dir, results, config, module.versions(), tasks)
    return EXIT_INTERRUPTED if interrupted else 0


def plan_jobs(tasks: list[Task], seeds: list[int], args: argparse.Namespace,
          has_grid: bool) -> list[Job]:
    """Every run of the command, in order: by task, seed and attention."""
    plan: list[tuple[RunSpec, TaskSettings]] = []
    for task in tasks:
        settings = SETTINGS[task.name]
        steps = args.steps or (settings.quick_steps if args.quick else settings.steps)
        batch_size = args.batch_size or settings.batch_size
        for seed in seeds:
            for name, estimator, options in attention_variants(
                    task, list(dict.fromkeys(args.estimators or DEFAULT_ATTENTIONS)),
                    args.samples, has_grid,
                    args.framework):
                plan.append((RunSpec(task, name, estimator, options, seed, steps,
                                     batch_size, settings.peak_lr,
                                     warmup_fraction=settings.warmup_fraction,
                                     model=ModelConfig(token_init=args.token_init)),
                             settings))
    return [Job(index, f"[{index}/{len(plan)}] {spec.task.name} {spec.name} seed {spec.seed}",
                spec, *dataset_sizes(settings, spec, args.quick))
            for index, (spec, settings) in enumerate(plan, 1)]
