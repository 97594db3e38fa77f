"""Causal language modelling in ``xattn train`` (``--task shakespeare``), framework
independent: the GPT configuration, nanoGPT's learning-rate schedule, random windows as
batches, the loss estimate, the training loop and sampling (token by token with the
layers' generation state, and by recomputing the whole context).

The defaults reproduce nanoGPT's ``train_shakespeare_char`` with its CPU overrides
(README: ``--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64
--batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0``), whose validation loss nanoGPT reports as about
1.88. The framework modules (:mod:`xattn.training.lm_torch`,
:mod:`xattn.training.lm_flax`) build the model and give an :class:`LMTrainer`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from xattn.training.loop import RunRecord, StepLog
from xattn.training.tasks import shakespeare

__all__ = ["EVAL_SEED", "LM_QUICK_STEPS", "RFA_SINKS", "RFA_WINDOW", "RFA_WINDOW_ROW",
           "GPTConfig", "LMResult", "LMSpec", "LMTrainer", "Sampler",
           "estimate_loss", "generate", "lm_learning_rate", "random_windows", "train_lm_run"]

#: Seed of the evaluation windows: every run is evaluated on the same windows.
EVAL_SEED = 1234
#: Training steps with ``--quick`` (2,000 without, nanoGPT's ``max_iters``).
LM_QUICK_STEPS = 500
#: The second RFA row of a causal task: RFA with the keys within ``RFA_WINDOW`` positions
#: and the first ``RFA_SINKS`` keys computed exactly (``xattn.rfa(window=, sinks=)``).
RFA_WINDOW_ROW = "rfa-window"
RFA_WINDOW = 16
RFA_SINKS = 4


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's model at the CPU configuration: pre-norm blocks (LayerNorm without bias,
    attention, LayerNorm, MLP 4 x width with GELU), learned position embeddings, a final
    LayerNorm and the output head tied to the token embedding (as nanoGPT); weights drawn
    from N(0, 0.02), the residual output projections from N(0, 0.02 / sqrt(2 layers)),
    biases 0; no dropout."""

    layers: int = 4
    heads: int = 4
    dim: int = 128
    vocabulary: int = shakespeare.VOCABULARY_SIZE

    @property
    def ffn(self) -> int:
        return 4 * self.dim


@dataclass(frozen=True)
class LMSpec:
    """One language-model run: ``name`` is the row name, ``estimator`` the layer's
    estimator (or ``native``), ``options`` its options; the optimization is nanoGPT's
    (AdamW, betas (0.9, 0.99), weight decay 0.1 on the matrices and embeddings only,
    gradient norm clipped at 1, linear warm-up over ``warmup`` steps then cosine decay to
    ``min_lr`` at the last step)."""

    name: str
    estimator: str
    options: dict[str, Any]
    seed: int
    steps: int = 2000
    length: int = 64
    batch_size: int = 12
    peak_lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    final_eval_iters: int = 200
    sample_length: int = 300
    prompt: str = "\n"
    temperature: float = 0.8
    model: GPTConfig = field(default_factory=GPTConfig)


def lm_learning_rate(step: int, spec: LMSpec) -> float:
    """nanoGPT's ``get_lr``: ``peak * (step + 1) / (warmup + 1)`` during the warm-up,
    then cosine decay from ``peak_lr`` to ``min_lr`` at step ``spec.steps``."""
    if step < spec.warmup:
        return spec.peak_lr * (step + 1) / (spec.warmup + 1)
    ratio = min(1.0, (step - spec.warmup) / max(1, spec.steps - spec.warmup))
    return spec.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (spec.peak_lr - spec.min_lr)


def random_windows(data: np.ndarray, length: int, batch_size: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """nanoGPT's ``get_batch``: ``batch_size`` windows at uniform random starts; inputs
    ``(B, length)`` and the next characters as targets, int64."""
    starts = rng.integers(0, len(data) - length, size=batch_size)
    index = starts[:, None] + np.arange(length)
    return data[index].astype(np.int64), data[index + 1].astype(np.int64)


class LMTrainer(Protocol):
    """What a framework module gives :func:`train_lm_run`."""

    memory_method: str

    def step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, *,
             measure_memory: bool = False) -> tuple[float, int | None]:
        """One AdamW step; its loss and, if ``measure_memory``, its peak bytes."""

    def loss(self, inputs: np.ndarray, targets: np.ndarray) -> float:
        """Mean cross-entropy (nats) in evaluation mode."""

    def next_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits ``(V,)`` after ``tokens`` (1-D), by a causal forward on all of them."""

    def state_sampler(self) -> Sampler | None:
        """Generation with the layers' state, or None (the framework's own layer)."""


class Sampler(Protocol):
    """Token-by-token generation with the attention layers' state."""

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Begin a sequence with ``tokens`` (1-D); the logits after them."""

    def advance(self, token: int) -> np.ndarray:
        """Append one token; the logits after it."""


def estimate_loss(trainer: LMTrainer, data: np.ndarray, spec: LMSpec, iters: int) -> float:
    """nanoGPT's ``estimate_loss`` on one split: the mean loss over ``iters`` batches of
    random windows, drawn from :data:`EVAL_SEED` (the same windows for every run)."""
    rng = np.random.default_rng(EVAL_SEED)
    return statistics.fmean(trainer.loss(*random_windows(data, spec.length, spec.batch_size,
                                                         rng)) for _ in range(iters))


def _draw(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    cumulative = np.cumsum(weights)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"),
                   len(weights) - 1))


def generate(trainer: LMTrainer, prompt: np.ndarray, count: int, context: int, *,
             seed: int, temperature: float, use_state: bool) -> tuple[np.ndarray, float]:
    """``count`` tokens after ``prompt``, each drawn from the softmax of the logits at
    ``temperature`` (by inverse CDF from ``numpy.random.default_rng(seed)``); and the
    tokens per second.

    The model sees at most ``context`` tokens (its learned positions): when the context is
    full it restarts from its last ``context // 2`` tokens (a state cannot drop its first
    token, so both samplers slide by half a context). ``use_state``: the prompt (and each
    restart) is prefilled and every further token is one step with the layers' state;
    otherwise each token recomputes a causal forward over the whole context. Both give the
    same logits up to rounding, so the same characters.
    """
    if not 0 < len(prompt) < context:
        raise ValueError(f"the prompt needs 1 to {context - 1} tokens, got {len(prompt)}")
    rng = np.random.default_rng(seed)
    sampler = trainer.state_sampler() if use_state else None
    if use_state and sampler is None:
        raise ValueError("this model has no generation state")
    tokens = [int(token) for token in prompt]
    start = 0
    tic = time.perf_counter()
    logits = (sampler.prefill(np.asarray(tokens)) if sampler is not None
              else trainer.next_logits(np.asarray(tokens)))
    for _ in range(count):
        tokens.append(_draw(logits, temperature, rng))
        if len(tokens) - start > context:
            start = len(tokens) - context // 2
            window = np.asarray(tokens[start:])
            logits = (sampler.prefill(window) if sampler is not None
                      else trainer.next_logits(window))
        elif sampler is not None:
            logits = sampler.advance(tokens[-1])
        else:
            logits = trainer.next_logits(np.asarray(tokens[start:]))
    elapsed = time.perf_counter() - tic
    return np.asarray(tokens[len(prompt):]), count / elapsed


@dataclass
class LMResult(RunRecord):
    """Every figure of one language-model run (losses in nats per character)."""

    val_loss: float
    train_loss: float
    sample: str
    sample_tokens_per_s_recompute: float
    sample_tokens_per_s_state: float | None
    sample_same_as_recompute: bool | None

    @property
    def val_bits_per_char(self) -> float:
        return self.val_loss / math.log(2)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "val_bits_per_char": self.val_bits_per_char}


def train_lm_run(spec: LMSpec, trainer: LMTrainer, progress: Any = None) -> LMResult:
    """Train ``spec.steps`` steps on random training windows (drawn from the run's seed),
    estimating the losses every ``eval_interval`` steps on ``eval_iters`` batches and at
    the end on ``final_eval_iters`` batches of each split; then sample
    ``spec.sample_length`` characters after ``spec.prompt`` by recomputation and, where
    the model has one, with the generation state (same seed: the same characters)."""
    train, val = shakespeare.split()
    rng = np.random.default_rng(spec.seed)
    curve: list[dict[str, float]] = []
    log = StepLog(spec.steps)
    started = time.perf_counter()
    for step in range(spec.steps):
        batch = random_windows(train, spec.length, spec.batch_size, rng)
        tic = time.perf_counter()
        loss, peak = trainer.step(*batch, lm_learning_rate(step, spec),
                                  measure_memory=log.measures_memory(step))
        log.record(step, loss, peak, time.perf_counter() - tic, progress)
        if (step + 1) % spec.eval_interval == 0 and step + 1 < spec.steps:
            curve.append({"step": step + 1,
                          "train_loss": estimate_loss(trainer, train, spec, spec.eval_iters),
                          "val_loss": estimate_loss(trainer, val, spec, spec.eval_iters)})
    val_loss = estimate_loss(trainer, val, spec, spec.final_eval_iters)
    train_loss = estimate_loss(trainer, train, spec, spec.final_eval_iters)
    curve.append({"step": spec.steps, "train_loss": train_loss, "val_loss": val_loss})
    wall_s = time.perf_counter() - started
    prompt = shakespeare.encode(spec.prompt)

    def sample_twice(use_state: bool) -> tuple[np.ndarray, float]:
        """The sample and the speed of its second generation: the first one compiles
        (jitted frameworks: a trace per length), which is not the sampling speed."""
        for _ in range(2):
            tokens, tokens_per_s = generate(trainer, prompt, spec.sample_length, spec.length,
                                            seed=spec.seed, temperature=spec.temperature,
                                            use_state=use_state)
        return tokens, tokens_per_s

    sample, speed = sample_twice(use_state=False)
    state_speed = same = None
    if trainer.state_sampler() is not None:
        with_state, state_speed = sample_twice(use_state=True)
        same = bool(np.array_equal(with_state, sample))
    return LMResult(task="shakespeare", name=spec.name, estimator=spec.estimator,
                    options=spec.options, seed=spec.seed, steps=spec.steps,
                    val_loss=val_loss, train_loss=train_loss,
                    final_train_loss=log.final_train_loss, ms_per_step=log.ms_per_step,
                    peak_memory_bytes=log.peak_memory_bytes,
                    peak_memory_method=trainer.memory_method, wall_s=wall_s, curve=curve,
                    sample=spec.prompt + shakespeare.decode(sample),
                    sample_tokens_per_s_recompute=speed,
                    sample_tokens_per_s_state=state_speed, sample_same_as_recompute=same)
