"""Flax (NNX) side of ``xattn train --task shakespeare``: the causal GPT of
:class:`xattn.training.lm.GPTConfig` with :class:`xattn.flax.MultiHeadAttention`
(``is_causal=True``) or, for the ``native`` row, :class:`flax.nnx.MultiHeadAttention` (with
:func:`flax.nnx.make_causal_mask`), and nanoGPT's AdamW step (optax) under
:func:`jax.jit`."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xattn.training.encoder_flax import FlaxTrainerBase, attention_layer, versions
from xattn.training.lm import GPTConfig, LMSpec, Sampler
from xattn.training.loop import NATIVE

__all__ = ["GPT", "FlaxLMTrainer", "Trainer", "lm_schedule", "versions"]


class _Block(nnx.Module):
    """Pre-norm block: x + attention(norm(x)), then x + MLP(norm(x)) (nanoGPT's)."""

    def __init__(self, config: GPTConfig, estimator: str, options: dict[str, Any],
                 rngs: nnx.Rngs) -> None:
        self.native = estimator == NATIVE
        self.attention_norm = nnx.LayerNorm(config.dim, use_bias=False, rngs=rngs)
        self.attention = attention_layer(config.dim, config.heads, estimator, options, rngs)
        self.ffn_norm = nnx.LayerNorm(config.dim, use_bias=False, rngs=rngs)
        self.ffn_in = nnx.Linear(config.dim, config.ffn, use_bias=False, rngs=rngs)
        self.ffn_out = nnx.Linear(config.ffn, config.dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = self.attention_norm(x)
        if self.native:
            out = self.attention(normed, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
        else:
            out = self.attention(normed, is_causal=True)
        return self._ffn(x + out)

    def _ffn(self, x: jax.Array) -> jax.Array:
        return x + self.ffn_out(nnx.gelu(self.ffn_in(self.ffn_norm(x)), approximate=False))

    def decode(self, x: jax.Array) -> jax.Array:
        """The block on new tokens after those in the layer's cache (generation)."""
        return self._ffn(x + self.attention(self.attention_norm(x), decode=True))


class GPT(nnx.Module):
    """nanoGPT's character model at ``length`` positions, the head tied to the token
    embedding; nanoGPT's initialization (N(0, 0.02), the residual output projections
    N(0, 0.02 / sqrt(2 layers)), biases 0)."""

    def __init__(self, config: GPTConfig, length: int, estimator: str,
                 options: dict[str, Any], *, rngs: nnx.Rngs) -> None:
        self.token = nnx.Embed(config.vocabulary, config.dim, rngs=rngs)
        self.position = nnx.Embed(length, config.dim, rngs=rngs)
        self.blocks = nnx.List([_Block(config, estimator, options, rngs)
                                for _ in range(config.layers)])
        self.norm = nnx.LayerNorm(config.dim, use_bias=False, rngs=rngs)
        residual_std = 0.02 / math.sqrt(2 * config.layers)
        weights = [(self.token.embedding, 0.02), (self.position.embedding, 0.02)]
        for block in self.blocks:
            attention = block.attention
            weights += [(attention.query.kernel, 0.02), (attention.key.kernel, 0.02),
                        (attention.value.kernel, 0.02), (attention.out.kernel, residual_std),
                        (block.ffn_in.kernel, 0.02), (block.ffn_out.kernel, residual_std)]
        for weight, std in weights:
            # in the weight's dtype: with JAX's 64-bit mode on, a float64 draw scattered
            # into a float32 weight warns (and will raise in a later JAX)
            weight[...] = std * jax.random.normal(rngs.params(), weight.shape,
                                                  dtype=weight[...].dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.token(tokens) + self.position.embedding[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.token.attend(self.norm(x))

    def decode(self, tokens: jax.Array, offset: jax.Array) -> jax.Array:
        """Logits of new tokens at positions ``offset, ...`` after those in the attention
        layers' caches (:meth:`xattn.flax.MultiHeadAttention.init_cache`)."""
        positions = jax.lax.dynamic_slice_in_dim(self.position.embedding[...], offset,
                                                 tokens.shape[1])
        x = self.token(tokens) + positions
        for block in self.blocks:
            x = block.decode(x)
        return self.token.attend(self.norm(x))


class _StateSampler:
    """:class:`xattn.training.lm.Sampler` of a :class:`GPT` in evaluation mode: the
    layers' ``decode=True`` caches, stepped by :func:`jax.jit` over the model's split
    state (one trace per length). Not :func:`flax.nnx.jit`: it walks the module graph in
    Python at every call, which at one token per call cost more than the step itself (the
    state path sampled 3 to 6 times slower than recomputation before)."""

    def __init__(self, model: GPT, length: int, dim: int, compiled: dict[str, Any]) -> None:
        self.model, self.shape, self.position = model, (1, length, dim), 0
        self._state: Any = None
        self._compiled = compiled  # the trainer's: the jitted step outlives the sampler

    def _run(self, tokens: np.ndarray) -> np.ndarray:
        logits, self._state = self._compiled["step"](
            self._state, jnp.asarray(np.asarray(tokens)[None], dtype=jnp.int32),
            jnp.asarray(self.position, dtype=jnp.int32))
        self.position += len(tokens)
        return np.asarray(logits[0, -1])

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        for block in self.model.blocks:
            block.attention.init_cache(self.shape)
        graphdef, self._state = nnx.split(self.model)
        if "step" not in self._compiled:  # the graph with caches is the same every time

            def step(state: Any, tokens: jax.Array, offset: jax.Array) -> Any:
                model = nnx.merge(graphdef, state)
                logits = model.decode(tokens, offset)
                return logits, nnx.state(model)  # the caches after these tokens

            self._compiled["step"] = jax.jit(step)
        self.position = 0
        return self._run(tokens)

    def advance(self, token: int) -> np.ndarray:
        return self._run(np.asarray([token]))


def lm_schedule(spec: LMSpec) -> Any:
    """:func:`xattn.training.lm.lm_learning_rate` as an optax schedule."""

    def rate(step: Any) -> Any:
        warm = spec.peak_lr * (step + 1) / (spec.warmup + 1)
        ratio = jnp.clip((step - spec.warmup) / max(1, spec.steps - spec.warmup), 0.0, 1.0)
        decayed = spec.min_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (
            spec.peak_lr - spec.min_lr)
        return jnp.where(step < spec.warmup, warm, decayed)

    return rate


def _loss(model: GPT, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    logits = model(inputs)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


class FlaxLMTrainer(FlaxTrainerBase[GPT]):
    """nanoGPT's AdamW steps, loss estimate and sampling of a :class:`GPT` (jitted; see
    :class:`~xattn.training.encoder_flax.FlaxTrainerBase`)."""

    def __init__(self, spec: LMSpec, device: str = "cpu", *,
                 compiler_options: dict[str, Any] | None = None) -> None:
        super().__init__(device, compiler_options)
        self.length, self.dim, self.native = spec.length, spec.model.dim, spec.estimator == NATIVE
        self._sampler_compiled: dict[str, Any] = {}
        with jax.default_device(self.device):
            model = GPT(spec.model, spec.length, spec.estimator, spec.options,
                        rngs=nnx.Rngs(params=spec.seed, attention=spec.seed + 1))
            # nanoGPT: weight decay on every parameter of 2 or more dimensions only
            transform = optax.chain(
                optax.clip_by_global_norm(spec.clip_norm),
                optax.adamw(lm_schedule(spec), b1=spec.betas[0], b2=spec.betas[1],
                            weight_decay=spec.weight_decay,
                            mask=lambda tree: jax.tree.map(lambda p: jnp.ndim(p) >= 2, tree)))
            self._prepare_step(model, transform, _loss)
        self._eval: Any = None
        self._eval_state: Any = None  # the evaluation-mode state of the current parameters

    def step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, *,
             measure_memory: bool = False) -> tuple[float, int | None]:
        result = self._update(jax.device_put(inputs.astype(np.int32), self.device),
                              jax.device_put(targets.astype(np.int32), self.device),
                              measure_memory=measure_memory)
        self._eval_state = None
        return result

    def _evaluation(self) -> tuple[Any, Any]:
        """The model's state in evaluation mode and the jitted forward (logits)."""
        if self._eval_state is None:
            model, _ = nnx.merge(self.graphdef, self.state)
            model.eval()  # deterministic attention
            graphdef, self._eval_state = nnx.split(model)
            if self._eval is None:  # the evaluation graph is the same at every call
                self._eval = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
        return self._eval_state, self._eval

    def loss(self, inputs: np.ndarray, targets: np.ndarray) -> float:
        state, forward = self._evaluation()
        logits = forward(state, jnp.asarray(inputs, dtype=jnp.int32))
        return float(jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.asarray(targets, dtype=jnp.int32))))

    def next_logits(self, tokens: np.ndarray) -> np.ndarray:
        # padded to the context: one compiled shape; the causal outputs at the real tokens
        # do not depend on the padding after them
        state, forward = self._evaluation()
        padded = np.zeros((1, self.length), dtype=np.int32)
        padded[0, :len(tokens)] = tokens
        return np.asarray(forward(state, jnp.asarray(padded))[0, len(tokens) - 1])

    def state_sampler(self) -> Sampler | None:
        if self.native:  # generation of nnx.MultiHeadAttention is not wired in
            return None
        model, _ = nnx.merge(self.graphdef, self.state)
        model.eval()
        return _StateSampler(model, self.length, self.dim, self._sampler_compiled)


Trainer = FlaxLMTrainer
