"""Flax (NNX) side of ``xattn train``: the LRA model with :class:`xattn.flax.MultiHeadAttention`
(or, for the ``native`` row, :class:`flax.nnx.MultiHeadAttention`) and its jitted AdamW
training step (optax)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import xattn.flax as xflax
from xattn.training.loop import NATIVE, ModelConfig, RunSpec, accuracy_counts
from xattn.training.tasks import Dataset, Task

__all__ = ["Encoder", "FlaxTrainer", "FlaxTrainerBase", "Trainer", "attention_layer",
           "schedule", "supports_grid", "versions"]

_Model = TypeVar("_Model", bound=nnx.Module)


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}


def supports_grid() -> bool:
    """Whether this version's layer takes ``grid=`` (2-D LARA segments)."""
    try:
        xflax.MultiHeadAttention(1, 2, estimator="lara", num_samples=(1, 1), grid=(1, 2),
                                 rngs=nnx.Rngs(0))
    except (TypeError, ValueError):
        return False
    return True


def attention_layer(dim: int, heads: int, estimator: str, options: dict[str, Any],
                    rngs: nnx.Rngs) -> xflax.MultiHeadAttention | nnx.MultiHeadAttention:
    """The attention of a block, its parameters drawn from the ``params`` stream of
    ``rngs``: :class:`flax.nnx.MultiHeadAttention` for
    :data:`~xattn.training.loop.NATIVE`, else :class:`xattn.flax.MultiHeadAttention` with
    ``estimator`` and its ``options`` (``redraw_interval`` 1000 unless they give one),
    drawing from the ``attention`` stream."""
    if estimator == NATIVE:
        # Flax's own layer: the submodules and initializers of the xattn layer, drawn from
        # the same ``params`` stream (the xattn layer's ``attention`` stream is not used for
        # parameters), so the same seed gives the same parameters
        return nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    layer_options = dict(options)
    redraw = layer_options.pop("redraw_interval", 1000)
    return xflax.MultiHeadAttention(heads, dim, estimator=estimator, redraw_interval=redraw,
                                    rngs=rngs, **layer_options)


class _Block(nnx.Module):
    """Pre-norm Transformer layer: x + attention(norm(x)), then x + FFN(norm(x))."""

    def __init__(self, config: ModelConfig, estimator: str, options: dict[str, Any],
                 rngs: nnx.Rngs) -> None:
        self.attention_norm = nnx.LayerNorm(config.dim, rngs=rngs)
        # Flax's own layer (NATIVE) takes the key mask (batch, 1, 1, kv) of the xattn layer
        # as it is: True = attend, broadcast to (batch, heads, q, kv)
        self.attention = attention_layer(config.dim, config.heads, estimator, options, rngs)
        if config.equal_query_key_init:  # see ModelConfig
            # a copy: two parameters sharing one buffer cannot both be donated to the step
            self.attention.key.kernel[...] = jnp.array(self.attention.query.kernel[...],
                                                       copy=True)
        self.ffn_norm = nnx.LayerNorm(config.dim, rngs=rngs)
        self.ffn_in = nnx.Linear(config.dim, config.ffn, rngs=rngs)
        self.ffn_out = nnx.Linear(config.ffn, config.dim, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.ffn_out(nnx.gelu(self.ffn_in(self.ffn_norm(x)), approximate=False))


class Encoder(nnx.Module):
    """The LRA encoder of :class:`xattn.training.loop.ModelConfig` for ``task``."""

    def __init__(self, task: Task, estimator: str, options: dict[str, Any], *,
                 config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.per_token = task.per_token
        # ModelConfig.token_init: "scaled" is nnx.Embed's own N(0, 1/dim)
        embedding_init: dict[str, Any] = ({} if config.token_init == "scaled"
                                          else {"embedding_init": nnx.initializers.normal(
                                              config.token_std)})
        self.embeddings = nnx.List([nnx.Embed(size, config.dim, rngs=rngs, **embedding_init)
                                    for size in task.vocabulary_sizes])
        # learned positions, initialized N(0, 1) as in the PyTorch model; none where the
        # order carries no information (mqar)
        self.position = nnx.Param(jax.random.normal(rngs.params(), (task.length, config.dim))
                                  ) if task.positional else nnx.data(None)
        self.blocks = nnx.List([_Block(config, estimator, options, rngs)
                                for _ in range(config.layers)])
        self.norm = nnx.LayerNorm(config.dim, rngs=rngs)
        self.hidden = nnx.Linear(config.dim, config.ffn, rngs=rngs)
        self.classifier = nnx.Linear(config.ffn, task.num_classes, rngs=rngs)

    def __call__(self, tokens: jax.Array, mask: jax.Array | None) -> jax.Array:
        # an array, not sum's start value 0: a task has at least one token field
        x = cast(jax.Array, sum(embedding(tokens[..., field])
                                for field, embedding in enumerate(self.embeddings)))
        if self.position is not None:
            x = x + self.position[...]
        key_mask = None if mask is None else mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, key_mask)
        x = self.norm(x)
        if not self.per_token:
            if mask is None:
                x = jnp.mean(x, axis=1)
            else:
                weights = mask.astype(x.dtype)[..., None]
                x = jnp.sum(x * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        return self.classifier(nnx.relu(self.hidden(x)))


def schedule(spec: RunSpec) -> Callable[[Any], Any]:
    """:func:`xattn.training.loop.learning_rate` as an optax schedule (jnp operations)."""
    warmup = spec.warmup_steps()
    decay_steps = max(1, spec.steps - warmup)

    def rate(step: Any) -> Any:
        warm = spec.peak_lr * (step + 1) / warmup
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        decayed = spec.peak_lr * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup, warm, decayed)

    return rate


def _loss(model: Encoder, tokens: jax.Array, mask: jax.Array | None,
          targets: jax.Array) -> jax.Array:
    logits = model(tokens, mask)
    counted = targets >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.where(counted, targets, 0))
    return jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


class FlaxTrainerBase(Generic[_Model]):
    """What the Flax trainers of a model (an ``nnx.Module`` of type ``_Model``) share: the
    JAX device and the training step.

    The step is a pure function of the model and optimizer state (Flax's functional API,
    :func:`flax.nnx.split` / :func:`flax.nnx.merge`) under :func:`jax.jit`, compiled once
    ahead of time; its XLA memory analysis gives the peak memory. A subclass builds its
    model under ``jax.default_device(self.device)`` and hands it to
    :meth:`_prepare_step`; its ``step`` calls :meth:`_update`.
    """

    memory_method = ("XLA memory_analysis() of the compiled training step: temp + output "
                     "bytes (as xattn bench on JAX)")

    def __init__(self, device: str, compiler_options: dict[str, Any] | None) -> None:
        self.compiler_options = compiler_options  # XLA options, e.g. for faster compiles
        try:
            self.device = jax.devices("gpu" if device == "cuda" else "cpu")[0]
        except RuntimeError:
            raise ValueError(f"device {device}: JAX sees no such device") from None
        self._compiled: Any = None

    def _prepare_step(self, model: _Model, transform: Any,
                      loss: Callable[..., jax.Array]) -> None:
        """Keep ``model`` and its optimizer (the optax ``transform``) as the split state
        ``graphdef, state``, and jit the step on ``loss(model, *batch)``. Call it on the
        device (under ``jax.default_device``): the optimizer's state is created here."""
        optimizer = nnx.Optimizer(model, transform, wrt=nnx.Param)
        self.graphdef, self.state = nnx.split((model, optimizer))

        def train_step(state: Any, *batch: jax.Array | None) -> tuple[Any, jax.Array]:
            model, optimizer = nnx.merge(self.graphdef, state)
            value, grads = nnx.value_and_grad(loss)(model, *batch)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), value

        self._train_step = jax.jit(train_step, donate_argnums=0)

    def _update(self, *batch: jax.Array | None,
                measure_memory: bool) -> tuple[float, int | None]:
        """One step on ``batch`` (compiled at the first call); waits for it and returns
        its loss and, if ``measure_memory``, its peak memory in bytes (else None)."""
        arguments = (self.state, *batch)
        if self._compiled is None:
            self._compiled = self._train_step.lower(*arguments).compile(
                compiler_options=self.compiler_options)
        self.state, loss = self._compiled(*arguments)
        peak = None
        if measure_memory:
            analysis = self._compiled.memory_analysis()
            if analysis is not None:
                peak = int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)
        return float(loss), peak  # float() waits for the device


class FlaxTrainer(FlaxTrainerBase[Encoder]):
    """AdamW steps and evaluation of an :class:`Encoder` (see ``Trainer`` and
    :class:`FlaxTrainerBase`). The learning rate follows :func:`schedule` inside optax, so
    ``step`` ignores its ``lr`` argument (the same values).
    """

    def __init__(self, spec: RunSpec, device: str = "cpu", *,
                 compiler_options: dict[str, Any] | None = None) -> None:
        super().__init__(device, compiler_options)
        with jax.default_device(self.device):
            model = Encoder(spec.task, spec.estimator, spec.options, config=spec.model,
                            rngs=nnx.Rngs(params=spec.seed, attention=spec.seed + 1))
            transform = optax.chain(
                optax.clip_by_global_norm(spec.clip_norm),
                optax.adamw(schedule(spec), weight_decay=spec.weight_decay))
            self._prepare_step(model, transform, _loss)
        self._logits: Any = None

    def _inputs(self, data: Dataset) -> tuple[jax.Array, jax.Array | None]:
        tokens = jax.device_put(data.tokens, self.device)
        mask = None if data.mask is None else jax.device_put(data.mask, self.device)
        return tokens, mask

    def step(self, batch: Dataset, lr: float, *,
             measure_memory: bool = False) -> tuple[float, int | None]:
        return self._update(*self._inputs(batch), jax.device_put(batch.targets, self.device),
                            measure_memory=measure_memory)

    def accuracy(self, data: Dataset, batch_size: int = 128, *,
                 sampled: bool = False) -> float:
        if sampled:
            raise NotImplementedError("sampled evaluation is measured with torch only")
        model, _ = nnx.merge(self.graphdef, self.state)
        model.eval()  # deterministic attention
        graphdef, state = nnx.split(model)
        correct = counted = 0
        for start in range(0, len(data), batch_size):
            index = np.arange(start, min(len(data), start + batch_size))
            # pad the last batch to batch_size: one compiled shape for every batch
            arguments = (state, *self._inputs(data.take(np.resize(index, batch_size))))
            if self._logits is None:  # the evaluation graph is the same at every call
                self._logits = jax.jit(
                    lambda state, tokens, mask: nnx.merge(graphdef, state)(tokens, mask)
                ).lower(*arguments).compile(compiler_options=self.compiler_options)
            logits = np.asarray(self._logits(*arguments))
            hits, total = accuracy_counts(logits[:len(index)], data.targets[index])
            correct, counted = correct + hits, counted + total
        return correct / max(counted, 1)


Trainer = FlaxTrainer
