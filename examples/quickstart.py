"""Quickstart: exact softmax attention on NumPy and (if installed) PyTorch and JAX.

Run with ``python examples/quickstart.py``. The same call works on every array library;
the result comes back in the library, device and dtype of the inputs.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

import xattn


def main() -> None:
    rng = np.random.default_rng(0)
    heads, length, head_dim = 4, 2048, 64
    q = rng.normal(size=(heads, length, head_dim))
    k = rng.normal(size=(heads, length, head_dim))
    v = rng.normal(size=(heads, length, head_dim))

    start = time.perf_counter()
    out = xattn.softmax_attention(q, k, v, causal=True)
    print(f"numpy  softmax_attention{out.shape} {out.dtype}: {time.perf_counter() - start:.3f} s")

    if importlib.util.find_spec("torch"):
        import torch

        tq, tk, tv = (torch.as_tensor(a, dtype=torch.float32) for a in (q, k, v))
        out_torch = xattn.softmax_attention(tq, tk, tv, causal=True)
        reference = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        print(f"torch  softmax_attention{tuple(out_torch.shape)} {out_torch.dtype}: "
              f"max |xattn - torch SDPA| = {float((out_torch - reference).abs().max()):.2e}")
    if importlib.util.find_spec("jax"):
        import jax.numpy as jnp

        out_jax = xattn.softmax_attention(*(jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v)),
                                          causal=True)
        print(f"jax    softmax_attention{out_jax.shape} {out_jax.dtype}: "
              f"max |xattn(jax) - xattn(numpy)| = {float(jnp.abs(out_jax - out).max()):.2e}")


if __name__ == "__main__":
    main()
