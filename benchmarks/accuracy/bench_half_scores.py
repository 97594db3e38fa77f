"""Half-precision accuracy at large scores: bfloat16 and float16 inputs against float64.

q and k at 1 to 4 times a standard normal (``--scales``), v standard normal, seed 0, at
(1, 4, 512, D) (D = 64 on torch, 32 on JAX), S = C = 64 fixed samples: the relative error
``|out - ref| / |ref|`` (Frobenius norms) of each call in each half dtype against the same
call in float64 on the half-rounded inputs (so that the samples, and LARA's segment means,
match). float16 inputs are computed in float32 (their exponent range cannot hold the
features of the estimators' shared stabilizers at large scores: guide 05); bfloat16 inputs
are multiplied in bfloat16 where the library can.

Run::

    python benchmarks/accuracy/bench_half_scores.py   # benchmarks/results/half_scores.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np

import xattn

HERE = Path(__file__).resolve().parent.parent

CALLS = {
    "causal rfa": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega, causal=True),
    "causal rfa, hyperbolic": lambda q, k, v, omega: xattn.rfa(
        q, k, v, omega=omega, causal=True, feature_map="hyperbolic"),
    "rfa": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega),
    "rfa, hyperbolic": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega,
                                                        feature_map="hyperbolic"),
    "lara, decoupled": lambda q, k, v, omega: xattn.lara(q, k, v, num_samples=64, rng=0),
    "lara, balance": lambda q, k, v, omega: xattn.lara(q, k, v, num_samples=64, rng=0,
                                                       weighting="balance"),
    "causal rfa, window=64, sinks=1": lambda q, k, v, omega: xattn.rfa(
        q, k, v, omega=omega, causal=True, window=64, sinks=1),
}


def measure(backend: str, scales: list[float]) -> dict:
    """``{call: {dtype: {scale: error}}}`` on ``backend`` ("torch" or "jax")."""
    if backend == "torch":
        import torch
        dim, to = 64, (lambda x, dtype: torch.asarray(x, dtype=getattr(torch, dtype)))
        back = lambda x: x.to(torch.float64).numpy()  # noqa: E731
    else:
        import jax.numpy as jnp
        dim, to = 32, (lambda x, dtype: jnp.asarray(x, dtype=getattr(jnp, dtype)))
        back = lambda x: np.asarray(x.astype(jnp.float32), dtype=np.float64)  # noqa: E731
    results: dict = {}
    for scale in scales:
        data = np.random.default_rng(0)
        q, k = (scale * data.normal(size=(1, 4, 512, dim)) for _ in range(2))
        v = data.normal(size=(1, 4, 512, dim))
        omega = data.normal(size=(64, dim))
        for dtype in ("bfloat16", "float16"):
            inputs = [to(x, dtype) for x in (q, k, v)]
            rounded = [back(x) for x in inputs]
            for name, call in CALLS.items():
                expected = call(*rounded, omega)
                out = back(call(*inputs, to(omega, "float32")))
                error = float(np.linalg.norm(out - expected) / np.linalg.norm(expected))
                results.setdefault(name, {}).setdefault(dtype, {})[f"{scale:g}"] = error
                print(f"  {backend} {name:32s} {dtype:9s} {scale:g}x: {error:.2e}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="1,2,3,4")
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "half_scores.json")
    args = parser.parse_args()
    scales = [float(item) for item in args.scales.split(",")]
    report = {"description": __doc__.splitlines()[0],
              "command": "python benchmarks/accuracy/bench_half_scores.py",
              "machine": {"python": platform.python_version(),
                          "platform": platform.platform()},
              "xattn": xattn.__version__, "errors": {}}
    for backend in args.backends.split(","):
        report["errors"][backend] = measure(backend, scales)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
