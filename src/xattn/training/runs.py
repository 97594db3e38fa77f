"""One training run from its settings, as ``xattn train`` plans and runs it: the task
settings, the attention rows of each task, the run's specification and data sizes, the
framework's trainer module, and :func:`train`, the Python entry point."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

from xattn._core.options import (
    check_bool,
    check_choice,
    check_nonnegative_int,
    check_positive_int,
)
from xattn.training.lm import (
    LM_QUICK_STEPS,
    RFA_SINKS,
    RFA_WINDOW,
    RFA_WINDOW_ROW,
    LMResult,
    LMSpec,
    train_lm_run,
)
from xattn.training.loop import (
    ATTENTIONS,
    LARA_VARIANTS,
    NATIVE,
    NATIVE_LAYERS,
    ModelConfig,
    RunResult,
    RunSpec,
    attention_options,
    lara_variant_options,
    train_run,
)
from xattn.training.tasks import Task, get_task

__all__ = [
    "DEFAULT_SAMPLES",
    "DEVICES",
    "FRAMEWORKS",
    "LM_QUICK_EVAL_ITERS",
    "MAX_SEED",
    "SETTINGS",
    "TOKEN_INITS",
    "TaskSettings",
    "attention_variants",
    "check_seed",
    "dataset_sizes",
    "grid_pools",
    "lm_spec",
    "load_framework",
    "run_spec",
    "train",
    "train_spec",
]

FRAMEWORKS = ("torch", "flax")  # each also the name of the extra that installs it
DEVICES = ("cpu", "cuda")
#: Largest seed a run accepts: seeds are 32-bit unsigned ints, the range that every
#: generator a run seeds keeps apart (a JAX key keeps only the low 32 bits of a Python
#: int, so larger seeds would silently repeat smaller ones under Flax).
MAX_SEED = 2**32 - 1
TOKEN_INITS = ("scaled", "unit")


def check_seed(seed: Any) -> int:
    """A run's seed: an int from 0 to :data:`MAX_SEED` (TypeError, ValueError)."""
    seed = check_nonnegative_int(seed, "seed")
    if seed > MAX_SEED:
        raise ValueError(f"seed must be <= {MAX_SEED} (a 32-bit unsigned int), got {seed}")
    return seed


def _optional_size(value: Any, name: str) -> int | None:
    """None (the task's default) or an int >= 1."""
    return None if value is None else check_positive_int(value, name)


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """Optimization of one task: steps (full run, ``--quick``), batch size, peak learning
    rate, how many generated training / test examples there are, and the start of the
    token embeddings (:class:`ModelConfig`'s ``token_init``, the same in both frameworks):
    ``"unit"``, N(0, 1), where they are summed with learned position embeddings of that
    scale (``digits``, ``listops``; at N(0, 1/64) the positions drown them, and PyTorch's
    softmax on ``digits`` fell from 92.5 % to 78.5 %), ``"scaled"``, N(0, 1/64), where there
    are none (``mqar``; at N(0, 1) they drown the attention's output, and RFA stayed at
    chance)."""

    steps: int
    quick_steps: int
    batch_size: int
    peak_lr: float
    train_size: int
    test_size: int
    quick_train_size: int
    warmup_fraction: float = 0.1
    token_init: str = "scaled"


SETTINGS = {
    "mqar": TaskSettings(steps=600, quick_steps=300, batch_size=32, peak_lr=1e-3,
                         train_size=19_200, test_size=500, quick_train_size=9_600),
    "listops": TaskSettings(steps=600, quick_steps=200, batch_size=32, peak_lr=1e-3,
                            train_size=8_000, test_size=1_000, quick_train_size=3_000,
                            token_init="unit"),
    "digits": TaskSettings(steps=600, quick_steps=200, batch_size=32, peak_lr=3e-3,
                           train_size=0, test_size=0, quick_train_size=0, token_init="unit"),
}
#: RFA features and LARA proposals of every run unless told otherwise (``--samples``).
DEFAULT_SAMPLES = 16
#: Batches of the final loss estimate of a quick language-model run (200 without).
LM_QUICK_EVAL_ITERS = 50


def load_framework(framework: str, threads: int = 0, *, language_model: bool = False) -> Any:
    """Import the trainer module of ``framework`` (``"torch"`` or ``"flax"``): the
    encoder's (``xattn.training.encoder_torch``, ``xattn.training.encoder_flax``) or
    with ``language_model`` the causal GPT's (``xattn.training.lm_torch``,
    ``xattn.training.lm_flax``). ``threads`` > 0 sets the CPU threads of the
    framework (torch's intra-op threads; JAX's, through ``XLA_FLAGS``, before JAX
    starts); 0 leaves the framework's default.

    Raises
    ------
    ImportError
        The framework is not installed (``name`` is the missing module).
    ValueError
        ``framework`` is not ``"torch"`` or ``"flax"``.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    if framework == "flax" and threads and "jax" not in sys.modules:
        # XLA reads its thread settings when JAX starts
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                              f"intra_op_parallelism_threads={threads}")
    module = importlib.import_module(f"xattn.training.encoder_{framework}")
    if framework == "torch" and threads:
        import torch
        torch.set_num_threads(threads)
    if language_model:
        module = importlib.import_module(f"xattn.training.lm_{framework}")
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
    LARA runs twice: ``lara-2d`` (2-D segments on the image grid, if ``has_grid``: the
    layer takes ``grid=``) and ``lara-1d``; on a causal task RFA runs twice, plain and
    with a window and sinks (``rfa-window``). The rows of ``LARA_VARIANTS``
    (``"lara-learned"``, ``"lara-defensive"``) run LARA with the options of
    ``xattn.training.loop.lara_variant_options``. :data:`NATIVE` is the row of
    ``framework``'s own layer, named after it (``"torch.nn.MultiheadAttention"``,
    ``"nnx.MultiHeadAttention"``)."""
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


def run_spec(task: Task, name: str, estimator: str, options: dict[str, Any], seed: int, *,
             steps: int | None = None, batch_size: int | None = None, quick: bool = False,
             token_init: str | None = None) -> RunSpec:
    """The run of one row (``name``, ``estimator``, ``options`` as
    :func:`attention_variants` gives them) on a classification ``task`` with its
    :data:`SETTINGS`: ``steps`` (default: the task's, fewer if ``quick``), ``batch_size``
    (default: the task's), ``token_init`` (default: the task's), the peak learning rate
    and warm-up of the task."""
    settings = SETTINGS[task.name]
    seed, steps, batch_size = (check_seed(seed), _optional_size(steps, "steps"),
                               _optional_size(batch_size, "batch_size"))
    if check_bool(quick, "quick") and steps is None:
        steps = settings.quick_steps
    if token_init is not None:
        check_choice(token_init, "token_init", TOKEN_INITS)
    return RunSpec(task, name, estimator, options, seed,
                   settings.steps if steps is None else steps,
                   settings.batch_size if batch_size is None else batch_size, settings.peak_lr,
                   warmup_fraction=settings.warmup_fraction,
                   model=ModelConfig(token_init=token_init or settings.token_init))


def dataset_sizes(settings: TaskSettings, spec: RunSpec, quick: bool) -> tuple[int, int]:
    """(training, test) examples of a run: a shipped task's fixed split, else the task's
    settings (``quick``: the smaller training set) with at least one batch of training
    examples."""
    if spec.task.fixed_sizes is not None:
        return spec.task.fixed_sizes
    train_size = settings.quick_train_size if quick else settings.train_size
    return max(train_size, spec.batch_size), settings.test_size


def train_spec(spec: RunSpec, module: Any, train_size: int, test_size: int, *,
               device: str = "cpu", progress: Any = None) -> RunResult:
    """Train ``spec`` with the trainer of ``module`` (:func:`load_framework`) on
    ``train_size`` training and ``test_size`` test examples of its task (see
    :func:`dataset_sizes`); ``progress``: a tqdm bar or None.

    Raises
    ------
    FloatingPointError
        The training loss is not finite (the run diverged).
    ValueError
        ``device`` is not available.
    """
    train, test = spec.task.datasets(train_size, test_size)
    trainer = module.Trainer(spec, device=device)
    return train_run(spec, trainer, train, test, progress)


def lm_spec(name: str, estimator: str, options: dict[str, Any], seed: int, *,
            steps: int | None = None, length: int | None = None,
            batch_size: int | None = None, quick: bool = False) -> LMSpec:
    """The language-model run of one row: ``steps`` (default 2,000, with ``quick``
    :data:`~xattn.training.lm.LM_QUICK_STEPS`), warm-up over 5 % of them, eight loss
    estimates along the way and a shorter final estimate with ``quick``."""
    seed, steps, length, batch_size = (
        check_seed(seed), _optional_size(steps, "steps"), _optional_size(length, "length"),
        _optional_size(batch_size, "batch_size"))
    if steps is None:
        steps = LM_QUICK_STEPS if check_bool(quick, "quick") else LMSpec.steps
    return LMSpec(name, estimator, options, seed, steps=steps,
                  length=LMSpec.length if length is None else length,
                  batch_size=LMSpec.batch_size if batch_size is None else batch_size,
                  warmup=max(1, round(0.05 * steps)), eval_interval=max(1, steps // 8),
                  final_eval_iters=LM_QUICK_EVAL_ITERS if quick else LMSpec.final_eval_iters)


def _row(task: Task, attention: str, samples: int, has_grid: bool,
         framework: str) -> tuple[str, str, dict[str, Any]]:
    """The row ``attention`` names: an attention (its first row) or a row name."""
    if attention in ATTENTIONS:
        return attention_variants(task, [attention], samples, has_grid, framework)[0]
    rows = {row[0]: row for name in ATTENTIONS
            for row in attention_variants(task, [name], samples, has_grid, framework)}
    if attention not in rows:
        raise ValueError(f"unknown attention {attention!r} on {task.name}; choose from "
                         f"{', '.join(dict.fromkeys([*ATTENTIONS, *rows]))}")
    return rows[attention]


def train(task: str, attention: str, framework: str = "torch", seed: int = 0,
          steps: int | None = None, *, length: int | None = None,
          samples: int = DEFAULT_SAMPLES, batch_size: int | None = None,
          token_init: str | None = None, quick: bool = False, device: str = "cpu",
          threads: int = 0, progress: Any = None) -> RunResult | LMResult:
    """Train one run of ``xattn train``: the same model, data, optimization and result
    as the command with ``--task task --estimators attention --seeds seed`` and the same
    options.

    Parameters
    ----------
    task : str
        ``"mqar"``, ``"listops"``, ``"digits"`` (the Long Range Arena classifier) or
        ``"shakespeare"`` (the causal character-level GPT).
    attention : str
        An attention of ``xattn train --estimators`` (``"softmax"``, ``"rfa"``,
        ``"ra"``, ``"lara"``, ``"lara-learned"``, ``"lara-defensive"``, ``"native"``: the
        framework's own layer), which trains its first row; or a row name: ``"lara-2d"``
        and ``"lara-1d"`` on ``digits``, ``"rfa-window"`` on ``shakespeare``.
    framework : str
        ``"torch"`` or ``"flax"``.
    seed : int
        Seeds the initialization, the batch order and the attention's samples (the data
        do not depend on it).
    steps : int, optional
        Training steps (default: the task's, see :data:`SETTINGS`; ``shakespeare`` 2,000;
        fewer with ``quick``).
    length : int, optional
        Sequence length (default: the task's; ``digits`` is always 64).
    samples : int
        RFA features and LARA proposals.
    batch_size : int, optional
        Batch size (default: the task's).
    token_init : str, optional
        ``"scaled"`` or ``"unit"``, the initial token embeddings of the classifier
        (:class:`ModelConfig`; default: the task's, see :class:`TaskSettings`).
    quick : bool
        ``--quick``'s fewer steps and training examples (and final loss estimate).
    device : str
        ``"cpu"`` or ``"cuda"``.
    threads : int
        CPU threads of the framework; 0 (the default) leaves them as they are (the
        command sets 1 unless told otherwise).
    progress : tqdm bar, optional
        Advanced by one at every step.

    Returns
    -------
    RunResult or LMResult
        Every figure of the run (:class:`RunResult`; for ``shakespeare``
        :class:`LMResult`), as ``train.json`` holds it.

    Raises
    ------
    ValueError
        An unknown task, attention, framework or device, a length the task cannot use,
        or a number out of its range (``steps``, ``length``, ``samples`` and
        ``batch_size`` >= 1, ``seed`` from 0 to 2**32 - 1, ``threads`` >= 0).
    TypeError
        A number that is not an int (a float or a bool), a flag that is not a bool.
    ImportError
        The framework is not installed.

    Examples
    --------
    Two steps of the classifier with exact softmax attention on ``digits`` (PyTorch):

    >>> from xattn.training import train
    >>> result = train("digits", "softmax", steps=2)
    >>> result.steps, [point["step"] for point in result.curve]
    (2, [1, 2])
    >>> 0.0 <= result.test_accuracy <= 1.0
    True
    """
    # every argument checked before any data is loaded or a framework imported
    check_seed(seed)
    for value, name in ((steps, "steps"), (length, "length"), (batch_size, "batch_size")):
        _optional_size(value, name)
    check_positive_int(samples, "samples")
    check_nonnegative_int(threads, "threads")
    check_bool(quick, "quick")
    check_choice(device, "device", DEVICES)
    if token_init is not None:
        check_choice(token_init, "token_init", TOKEN_INITS)
    task_object = get_task(task, length)
    module = load_framework(framework, threads)
    if task_object.causal:
        if attention == "lara":
            raise ValueError("attention 'lara' cannot train shakespeare: it needs causal "
                             "attention and lara's segment proposals look ahead; use "
                             "lara-learned or lara-defensive (causal LARA)")
        name, estimator, options = _row(task_object, attention, samples, False, framework)
        spec = lm_spec(name, estimator, options, seed, steps=steps, length=task_object.length,
                       batch_size=batch_size, quick=quick)
        lm_module = load_framework(framework, threads, language_model=True)
        return train_lm_run(spec, lm_module.Trainer(spec, device=device), progress)
    name, estimator, options = _row(task_object, attention, samples, module.supports_grid(),
                                    framework)
    run = run_spec(task_object, name, estimator, options, seed, steps=steps,
                   batch_size=batch_size, quick=quick, token_init=token_init)
    return train_spec(run, module, *dataset_sizes(SETTINGS[task], run, quick), device=device,
                      progress=progress)
