"""``xattn train``: train the Long Range Arena model with each estimator as its attention,
through the public layers (:class:`xattn.torch.MultiheadAttention`,
:class:`xattn.flax.MultiHeadAttention`), on generated or shipped tasks, and report test
accuracy, training loss, time per step and peak memory; optionally also with the
framework's own layer (``--estimators native``: :class:`torch.nn.MultiheadAttention`,
:class:`flax.nnx.MultiHeadAttention`) as the baseline of the softmax row.

What is trained (the model, optimizer, schedule, estimator options, tasks) is
:mod:`xattn.training`'s, through the functions :func:`xattn.training.train` uses; this
module parses the options, plans the runs, runs them (each in its own process with
``--jobs``) and writes the outputs (:mod:`xattn.cli.train_report`; ``--resume``:
:mod:`xattn.cli.train_resume`; ``--task shakespeare``: :mod:`xattn.cli.train_lm_report`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from xattn.cli.common import CommandError, load_framework, output_dir, progress_bar
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
from xattn.cli.train_lm_report import run_lm
from xattn.cli.train_report import write_outputs, write_results
from xattn.cli.train_resume import previous_runs, row_names
from xattn.training.lm import LM_QUICK_STEPS, RFA_SINKS, RFA_WINDOW, RFA_WINDOW_ROW
from xattn.training.loop import (
    ATTENTIONS,
    LARA_VARIANTS,
    NATIVE,
    NATIVE_LAYERS,
    TOKEN_INITS,
    RunResult,
    RunSpec,
)
from xattn.training.runs import (
    DEFAULT_SAMPLES,
    FRAMEWORKS,
    SETTINGS,
    attention_variants,
    dataset_sizes,
    run_spec,
    train_spec,
)
from xattn.training.tasks import CLASSIFICATION_TASKS, TASKS, Task, get_task

__all__ = ["DEFAULT_ATTENTIONS", "DEFAULT_SAMPLES", "EXIT_INTERRUPTED", "FRAMEWORKS",
           "SETTINGS", "Job", "add_parser", "attention_variants", "check_jobs",
           "dataset_sizes", "load_framework", "plan_jobs", "run", "run_jobs"]

EXIT_INTERRUPTED = 130


#: ``--estimators`` by default: every estimator. The framework's own layer
#: (:data:`~xattn.training.loop.NATIVE`) is opt-in: its losses and accuracies are those of
#: the softmax row (tests/test_train.py), so by default the time goes to the estimators.
DEFAULT_ATTENTIONS = tuple(name for name in ATTENTIONS
                           if name != NATIVE and name not in LARA_VARIANTS)


#: ``xattn train --help``'s description (argparse reflows it).
_DESCRIPTION = """\
Train the Long Range Arena model (2 layers, embedding 64, feed-forward 128, 2 heads,
mean pooling) with each estimator as its attention, through
xattn.torch.MultiheadAttention or xattn.flax.MultiHeadAttention, with AdamW (weight
decay 0.01, gradient norm clipped at 1, linear warm-up over 10 % of the steps, then
cosine decay to 0). With --estimators native the same model also runs with the
framework's own attention layer (torch.nn.MultiheadAttention, nnx.MultiHeadAttention;
same initialization as the xattn layer), the baseline of the softmax row. Test accuracy
is measured on a held-out split with every attention in its evaluation mode: RFA with
its last features, RA biased and deterministic, LARA deterministic (the proposal means
as samples). Prints a table (test accuracy mean +- std over seeds, final training loss,
ms per step, peak memory) and writes DIR/train.json (every figure, learning curves,
configuration, versions) and DIR/train.png (test accuracy against step). DIR/train.json
is rewritten (atomically) as each run finishes, so neither Ctrl-C nor a crash loses a
finished run; --resume then runs only the missing ones, keeping the runs it does not
plan (see --resume). The memory the runs need is estimated first and too large a size is
refused before any work."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train`` sub-command to ``subparsers``."""
    parser = subparsers.add_parser(
        "train", help="train a small Transformer with each estimator; test accuracy",
        description=_DESCRIPTION)
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
    parser.add_argument("--token-init", default=None, choices=TOKEN_INITS,
                        help="initial token embeddings of the classification tasks, the "
                        "same in both frameworks: scaled N(0, 1/width) or unit N(0, 1) "
                        "(default: the task's, unit where learned N(0, 1) position "
                        "embeddings are added to them (digits, listops), scaled where none "
                        "are (mqar))")
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


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run: its place in the plan, its label, what it trains and the sizes of
    its generated training and test sets."""

    index: int
    label: str
    spec: RunSpec
    train_size: int
    test_size: int


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
    with progress_bar(job.spec.steps, job.label, progress, unit="step",
                      position=position) as bar:
        try:
            return train_spec(job.spec, _WORKER["module"], job.train_size, job.test_size,
                              device=device, progress=bar)
        except FloatingPointError as problem:
            return f"stopped, {problem}"
        except ValueError as problem:  # a device the framework does not see
            raise CommandError(str(problem)) from None


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
                              "grid": task.grid, **dataclasses.asdict(SETTINGS[task.name]),
                              "token_init": args.token_init or SETTINGS[task.name].token_init}
                  for task in tasks},
        "estimators": list(args.estimators), "seeds": seeds, "samples": args.samples,
        "quick": args.quick, "steps": args.steps, "batch_size": args.batch_size,
        # the model every task shares; its token_init is a task setting (above)
        "model": {key: value for key, value in dataclasses.asdict(jobs[0].spec.model).items()
                  if key != "token_init"} if jobs else None,
        "lara_2d_segments": has_grid,
    }
    # JSON's view of the configuration (tuples become lists), as a resumed file holds it
    config = json.loads(json.dumps(config))
    finished: dict[int, RunResult] = {}
    earlier_wall_s = 0.0
    kept = 0
    if args.resume:  # the whole file is checked here, before any training
        rows = row_names(tasks, args.samples, has_grid, args.framework)
        previous = previous_runs(out_dir / "train.json", config,
                                 {job.index: job.spec for job in jobs}, rows)
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
    plan = []
    for task in tasks:
        for seed in seeds:
            for name, estimator, options in attention_variants(
                    task, list(dict.fromkeys(args.estimators or DEFAULT_ATTENTIONS)),
                    args.samples, has_grid, args.framework):
                plan.append(run_spec(task, name, estimator, options, seed, steps=args.steps,
                                     batch_size=args.batch_size, quick=args.quick,
                                     token_init=args.token_init))
    return [Job(index, f"[{index}/{len(plan)}] {spec.task.name} {spec.name} seed {spec.seed}",
                spec, *dataset_sizes(SETTINGS[spec.task.name], spec, args.quick))
            for index, spec in enumerate(plan, 1)]
