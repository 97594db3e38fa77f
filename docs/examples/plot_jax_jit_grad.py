"""
JAX: ``jit`` and ``grad``
=========================

xattn functions are traced like any other JAX code: they contain no Python control flow
on array values and no in-place writes, so they work under :func:`jax.jit` and
:func:`jax.grad`. Randomness under ``jit`` comes from a JAX PRNG key, which xattn splits
for every draw.
"""

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import xattn

num_tokens, head_dim = 64, 16
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(key, (num_tokens, head_dim)) for key in keys)


@jax.jit
def attend(q, k, v):
    return xattn.softmax_attention(q, k, v, causal=True)


out = attend(q, k, v)
print(type(out).__name__, out.shape, out.dtype)

# %%
# Gradients
# ---------
# Differentiate a scalar loss with respect to the queries, and check one directional
# derivative against a central finite difference.
def loss(q, k, v):
    return jnp.sum(xattn.softmax_attention(q, k, v, causal=True) ** 2)


grad_q = jax.jit(jax.grad(loss))(q, k, v)
direction = jax.random.normal(jax.random.key(1), q.shape)
step = 1e-2
finite_difference = (loss(q + step * direction, k, v) - loss(q - step * direction, k, v)) / (
    2 * step
)
print(f"grad . direction = {float(jnp.vdot(grad_q, direction)):.4f}, "
      f"finite difference = {float(finite_difference):.4f}")

# %%
# Random draws under ``jit``
# --------------------------
# A key passed as an argument is traced like any input; the adapter returned by
# :func:`xattn.random.as_generator` splits it for every draw, so two draws differ and the
# same key reproduces them.
@jax.jit
def two_draws(key):
    generator = xattn.random.as_generator(key)
    first = generator.normal(jnp, (4,), dtype=jnp.float32)
    second = generator.normal(jnp, (4,), dtype=jnp.float32)
    return first, second


first, second = two_draws(jax.random.key(42))
again, _ = two_draws(jax.random.key(42))
print("draws differ:", not bool(jnp.all(first == second)),
      "| same key reproduces:", bool(jnp.all(first == again)))

# %%
# A randomized estimator under ``jit``
# ------------------------------------
# The same key mechanism drives the estimators: pass the key as ``rng`` and as an
# argument of the compiled function. A fixed key gives a fixed set of features, so the
# estimate is a smooth function of the inputs and can be differentiated too.
@jax.jit
def approximate(q, k, v, key):
    return xattn.rfa(q, k, v, num_features=64, rng=key)


estimate = approximate(q, k, v, jax.random.key(3))
exact = xattn.softmax_attention(q, k, v)
print(f"rfa under jit: RMS error {float(jnp.sqrt(jnp.mean((estimate - exact) ** 2))):.3f} "
      f"(RMS of exact attention {float(jnp.sqrt(jnp.mean(exact ** 2))):.3f})")

grad_rfa = jax.jit(jax.grad(lambda q: jnp.sum(approximate(q, k, v, jax.random.key(3)) ** 2)))
print("gradient of the rfa loss:", grad_rfa(q).shape)

# %%
# Where the gradient goes
# -----------------------
# The norm of the gradient for each query row: with causal attention the early queries
# see few keys.
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(np.asarray(jnp.linalg.norm(grad_q, axis=-1)), marker=".")
ax.set_xlabel("query position n")
ax.set_ylabel("|d loss / d q_n|")
ax.set_title("Gradient of a causal attention loss")
fig.tight_layout()
