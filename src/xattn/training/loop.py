"""The framework-independent training of the Long Range Arena model (``xattn train``, and
:func:`xattn.training.train`): the run configuration, the attention options per
estimator, the learning-rate schedule, batching, the training loop with its learning curve
and timing, and the peak-memory probe.

The framework modules (:mod:`xattn.training.encoder_torch`,
:mod:`xattn.training.encoder_flax`) build the model and give a :class:`Trainer`;
:func:`train_run` drives it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from xattn import ESTIMATORS
from xattn.training.tasks import Dataset, Task

__all__ = [
    "ATTENTIONS",
    "LARA_VARIANTS",
    "NATIVE",
    "NATIVE_LAYERS",
    "TOKEN_INITS",
    "WARMUP_STEPS",
    "ModelConfig",
    "RunIdentity",
    "RunRecord",
    "RunResult",
    "RunSpec",
    "StepLog",
    "Trainer",
    "accuracy_counts",
    "advance",
    "attention_options",
    "batches",
    "lara_variant_options",
    "learning_rate",
    "train_run",
]


#: The attention that is the framework's own layer, not an xattn estimator: the baseline
#: row of ``xattn train`` (``--estimators native``) and ``benchmarks/training/bench_train.py``.
NATIVE = "native"
#: The layer ``native`` is, by framework; also its row name in tables and JSON. Each has
#: the parameters (names, shapes, initialization: the same seed gives the same values) and
#: the key-mask convention of the xattn layer of its framework, whose
#: ``estimator="softmax"`` equals it to float32 rounding (except for a query whose keys are
#: all masked, which no task has).
NATIVE_LAYERS = {"torch": "torch.nn.MultiheadAttention", "flax": "nnx.MultiHeadAttention"}
#: LARA with proposals beyond the paper's segments (opt-in rows of ``xattn train``, see
#: :func:`lara_variant_options`): learned proposal means, and a quarter of the proposals
#: defensive (N(0, I)). Both have a causal form, so they also run on the causal task.
LARA_VARIANTS = ("lara-learned", "lara-defensive")
#: What ``xattn train --estimators`` takes: the layers' estimators, :data:`LARA_VARIANTS`
#: and :data:`NATIVE`.
ATTENTIONS = (*ESTIMATORS, *LARA_VARIANTS, NATIVE)

#: Steps not timed (compilation, warm-up); the last of them measures the peak memory.
WARMUP_STEPS = 5


#: Token-embedding initializations of :class:`ModelConfig` (see ``token_init`` there).
TOKEN_INITS = ("scaled", "unit")


@dataclass(frozen=True)
class ModelConfig:
    """The Long Range Arena model (Tay et al., 2021; the LARA paper's Table 9): a 2-layer
    pre-norm Transformer encoder, embedding 64, feed-forward 128 (GELU), 2 heads, learned
    position embeddings (initialized N(0, 1); with the common 0.02 scale the digits model
    reached 53 % instead of 91 % test accuracy after 600 steps), mean pooling over the real
    tokens, and a 2-layer classifier (64 -> 128 -> classes, ReLU) as in Xiong et al.'s LRA
    code. Per-position tasks (``mqar``) apply the classifier at every position instead of
    pooling; tasks whose order carries no information (``mqar``) have no position
    embeddings.

    ``token_init``: the token embeddings' initialization, the same in both frameworks:
    ``"scaled"`` draws N(0, 1/dim) (Flax's ``nnx.Embed`` default), ``"unit"`` N(0, 1)
    (PyTorch's ``nn.Embedding`` default, which the PyTorch model used before 0.2). On
    ``mqar`` it decides whether RFA learns (see ``benchmarks/training/bench_train_parity.py`` and
    ``xattn.training.parity``). Every other weight starts as its framework's layer
    starts it: projections and linear layers with PyTorch's or Flax's initializers.

    ``equal_query_key_init``: the key projection starts as a copy of the query projection
    (both are then trained independently), so that at initialization tokens that share an
    embedding (a query and the key-value pair holding its key) attend to each other more
    than to unrelated tokens. Without it, softmax attention stayed at chance on ``mqar`` at
    length 256 for 1,500 steps in 2 of 3 seeds (see ``xattn.training.tasks.mqar``)."""

    dim: int = 64
    ffn: int = 128
    heads: int = 2
    layers: int = 2
    equal_query_key_init: bool = True
    token_init: str = "scaled"

    def __post_init__(self) -> None:
        if self.token_init not in TOKEN_INITS:
            raise ValueError(f"token_init must be one of {', '.join(TOKEN_INITS)}, "
                             f"got {self.token_init!r}")

    @property
    def token_std(self) -> float:
        """The standard deviation of the initial token embeddings (``token_init``)."""
        return self.dim ** -0.5 if self.token_init == "scaled" else 1.0


@dataclass(frozen=True)
class RunSpec:
    """One training run: a task, an attention (``name`` is the row name, ``estimator``
    the layer's estimator or :data:`NATIVE` for the framework's own layer, ``options``
    its options), a seed and the optimization."""

    task: Task
    name: str
    estimator: str
    options: dict[str, Any]
    seed: int
    steps: int
    batch_size: int
    peak_lr: float
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    clip_norm: float = 1.0
    eval_points: int = 10
    curve_test_size: int = 250
    model: ModelConfig = field(default_factory=ModelConfig)
    evaluate_sampled: bool = False  # also test with the attention in training mode

    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_fraction * self.steps))


@dataclass
class RunIdentity:
    """Which run a result is of: the task, the row name, the layer's estimator and its
    options, the seed and the number of training steps (the first fields of
    :class:`RunResult` and :class:`~xattn.training.lm.LMResult`)."""

    task: str
    name: str
    estimator: str
    options: dict[str, Any]
    seed: int
    steps: int


@dataclass
class RunRecord(RunIdentity):
    """A run and what its training measured, the fields that :class:`RunResult` and
    :class:`~xattn.training.lm.LMResult` share: the mean training loss of the last
    steps, the median milliseconds per step, the peak memory and how it was measured,
    the wall time, and the learning ``curve`` (a dict per evaluation point)."""

    final_train_loss: float
    ms_per_step: float
    peak_memory_bytes: int | None
    peak_memory_method: str
    wall_s: float
    curve: list[dict[str, float]]


@dataclass
class RunResult(RunRecord):
    """Every figure of one run (``curve``: test accuracy and mean training loss at the
    evaluation points; the last point uses the whole test set)."""

    test_accuracy: float
    sampled_test_accuracy: float | None = None  # attention in training mode (sampled)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def attention_options(estimator: str, samples: int, *, grid: tuple[int, int] | None = None,
                      ) -> dict[str, Any]:
    """Layer options of each estimator at ``samples`` samples.

    RFA: ``samples`` i.i.d. positive features (no orthogonal coupling), redrawn at every
    training step, as the LARA paper trains Performer (its Appendix G.1). LARA:
    ``samples`` proposals (one sample each; with ``grid=(H, W)`` the pools
    ``(sqrt(samples), sqrt(samples))`` of 2-D segments), fresh samples at every training
    step. RA: one sample per query (``xattn.ra``'s default). Softmax and :data:`NATIVE`
    (the framework's own layer): exact, no options.
    """
    if estimator == "rfa":
        return {"num_features": samples, "orthogonal": False, "redraw_interval": 1}
    if estimator == "lara":
        if grid is not None:
            side = math.isqrt(samples)
            return {"num_samples": (side, side), "grid": grid}
        return {"num_samples": samples}
    if estimator == "ra":
        return {"num_samples": 1}
    return {}


def lara_variant_options(name: str, samples: int, *, causal: bool) -> dict[str, Any]:
    """Layer options of a row of :data:`LARA_VARIANTS` at ``samples`` proposals.

    ``"lara-learned"``: ``proposal="learned"`` (means as parameters, the weighting
    ``"query_proposal"``). ``"lara-defensive"``: ``defensive = max(1, samples // 4)`` of
    the proposals N(0, I) (Hesterberg, 1995), the others the segment means, or on a causal
    task, where segments look ahead, learned means.
    """
    if name == "lara-learned":
        return {"num_samples": samples, "proposal": "learned"}
    defensive = {"num_samples": samples, "defensive": max(1, samples // 4)}
    return {**defensive, "proposal": "learned"} if causal else defensive


def learning_rate(step: int, spec: RunSpec) -> float:
    """The schedule: linear warm-up from ``peak/warmup`` to ``peak_lr`` over the first
    ``warmup_fraction`` of the steps, then cosine decay to 0 at the last step. ``step``
    counts from 0 (the rate of the first update)."""
    warmup = spec.warmup_steps()
    if step < warmup:
        return spec.peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, spec.steps - warmup))
    return spec.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def batches(data: Dataset, batch_size: int, seed: int) -> Iterator[Dataset]:
    """Endless shuffled minibatches (a new permutation per epoch, drawn from ``seed``).

    Raises
    ------
    ValueError
        ``batch_size`` is not from 1 to ``len(data)`` (no full batch could ever be
        formed, and the iterator would search forever).
    """
    if not 1 <= batch_size <= len(data):
        raise ValueError(f"batch_size must be from 1 to the {len(data)} examples of the "
                         f"data, got {batch_size}")
    return _batches(data, batch_size, seed)


def _batches(data: Dataset, batch_size: int, seed: int) -> Iterator[Dataset]:
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(data))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield data.take(order[start:start + batch_size])


def accuracy_counts(logits: np.ndarray, targets: np.ndarray) -> tuple[int, int]:
    """(correct, counted): argmax against targets, positions with target -1 left out."""
    counted = targets >= 0
    correct = (np.argmax(logits, axis=-1) == targets) & counted
    return int(correct.sum()), int(counted.sum())


def advance(bar: Any, label: str) -> None:
    """Advance the progress bar (a tqdm bar, or None for none) by one step, labelled
    ``label``."""
    if bar is not None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)


class StepLog:
    """The training losses, the wall time of each step and the peak memory of a run, as
    :func:`train_run` and :func:`~xattn.training.lm.train_lm_run` record them.

    Parameters
    ----------
    steps : int
        The run's number of steps: the last of the first :data:`WARMUP_STEPS` (or of all
        steps, if fewer) measures the peak memory.
    """

    def __init__(self, steps: int) -> None:
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.peak_memory_bytes: int | None = None
        self._memory_step = min(WARMUP_STEPS, steps) - 1

    def measures_memory(self, step: int) -> bool:
        """Whether step ``step`` (from 0) measures the peak memory."""
        return step == self._memory_step

    def record(self, step: int, loss: float, peak: int | None, seconds: float,
               progress: Any = None) -> None:
        """Log step ``step`` (from 0): its training ``loss``, its ``peak`` memory (kept
        where :meth:`measures_memory`) and its wall time; advance ``progress`` (a tqdm
        bar, or None).

        Raises
        ------
        FloatingPointError
            ``loss`` is not finite.
        """
        self.step_times.append(seconds)
        if self.measures_memory(step):
            self.peak_memory_bytes = peak
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step + 1}")
        self.losses.append(loss)
        advance(progress, f"loss {loss:.3f}")

    @property
    def ms_per_step(self) -> float:
        """The median wall time in ms of the steps after the first :data:`WARMUP_STEPS`
        (of every step, if there are no more)."""
        return 1000 * statistics.median(self.step_times[WARMUP_STEPS:] or self.step_times)

    @property
    def final_train_loss(self) -> float:
        """The mean training loss of the last tenth of the steps (at least the last)."""
        return statistics.fmean(self.losses[-max(1, len(self.losses) // 10):])


class Trainer(Protocol):
    """What a framework module gives :func:`train_run`."""

    memory_method: str
    """How :meth:`step` measures peak memory (written to the JSON)."""

    def step(self, batch: Dataset, lr: float, *,
             measure_memory: bool = False) -> tuple[float, int | None]:
        """One optimization step at learning rate ``lr``; waits for it and returns its
        training loss and, if ``measure_memory``, its peak memory in bytes (else None)."""

    def accuracy(self, data: Dataset, *, sampled: bool = False) -> float:
        """Test accuracy in evaluation mode (deterministic attention), or with the
        attention in training mode (random draws) if ``sampled``."""


def train_run(spec: RunSpec, trainer: Trainer, train: Dataset, test: Dataset,
              progress: Any = None) -> RunResult:
    """Train for ``spec.steps`` steps, evaluating ``spec.eval_points`` times on the first
    ``spec.curve_test_size`` test examples and at the end on the whole test set.

    ``trainer`` is the ``Trainer`` of a framework module for ``spec``
    (``load_framework(framework).Trainer(spec, device=device)``); ``progress`` is a tqdm
    bar (or None). ms per step is the median wall time of the
    steps after the first ``WARMUP_STEPS`` (5: compilation and warm-up), evaluation
    excluded; the peak memory is measured on the last of those warm-up steps.
    """
    curve_test = test.take(np.arange(min(len(test), spec.curve_test_size)))
    eval_at = {max(1, round(spec.steps * (point + 1) / spec.eval_points))
               for point in range(spec.eval_points)}
    eval_at.add(spec.steps)
    since_eval: list[float] = []
    curve: list[dict[str, float]] = []
    source = batches(train, spec.batch_size, spec.seed)
    started = time.perf_counter()
    log = StepLog(spec.steps)
    for step in range(spec.steps):
        tic = time.perf_counter()
        loss, peak = trainer.step(next(source), learning_rate(step, spec),
                                  measure_memory=log.measures_memory(step))
        log.record(step, loss, peak, time.perf_counter() - tic, progress)
        since_eval.append(loss)
        if step + 1 in eval_at:
            last = step + 1 == spec.steps
            accuracy = trainer.accuracy(test if last else curve_test)
            curve.append({"step": step + 1, "test_accuracy": accuracy,
                          "train_loss": statistics.fmean(since_eval)})
            since_eval = []
    sampled = trainer.accuracy(test, sampled=True) if spec.evaluate_sampled else None
    return RunResult(task=spec.task.name, name=spec.name, estimator=spec.estimator,
                     options=spec.options, seed=spec.seed, steps=spec.steps,
                     test_accuracy=curve[-1]["test_accuracy"],
                     final_train_loss=log.final_train_loss, ms_per_step=log.ms_per_step,
                     peak_memory_bytes=log.peak_memory_bytes,
                     peak_memory_method=trainer.memory_method, wall_s=time.perf_counter() - started,
                     curve=curve, sampled_test_accuracy=sampled)
