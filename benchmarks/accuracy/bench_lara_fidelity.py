"""Fidelity of LARA's proposals beyond the paper on fixed attention, causal and not.

The input is that of ``xattn compare``: :func:`xattn.diagnostics.structured_attention_inputs`
(4 heads, N = M = 1024, D = 64, sharp clustered attention), NumPy float64. Each cell is the
MSE against exact softmax attention (causal: exact causal attention) over ``--draws``
independent draws (seeds 0, 1, ...), at S = C = 16, 64 and 256, next to the uniform
baseline (every query gets the mean of the values, causal: of the values up to it):

- ``rfa``: :func:`xattn.rfa`, positive orthogonal features (its defaults);
- ``lara``: the paper's estimator, segment proposals, decoupled weighting (not causal);
- ``lara-defensive``: segment proposals with C/4 of them N(0, I) (``defensive=C // 4``);
- ``lara-init``: ``proposal_means`` drawn N(0, I), the layers' initialization of
  ``proposal="learned"``, weighting ``"query_proposal"``;
- ``lara-fitted``: the same means after ``--fit-steps`` Adam steps that minimize the
  estimator's squared error on this very input (fresh samples at every step; torch,
  float32), then evaluated with new seeds: what learned proposals can reach on this input,
  an optimistic bound for learning on other data (a trained model fits its means to the
  distribution of its inputs, not to one input);
- ``lara-fitted-defensive``: the fitted means with C/4 of the proposals N(0, I).

The LARA rows that need no segments are run both ways. Run::

    python benchmarks/accuracy/bench_lara_fidelity.py  # results/lara_fidelity_results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

import xattn
from xattn.diagnostics import estimator_error, structured_attention_inputs, uniform_attention

HERE = Path(__file__).resolve().parents[1]  # benchmarks/


def causal_uniform(v: np.ndarray) -> np.ndarray:
    """The causal uniform baseline: query n gets the mean of the values 0..n."""
    return np.cumsum(v, axis=-2) / np.arange(1, v.shape[-2] + 1)[:, None]


def fit_proposal_means(q: np.ndarray, k: np.ndarray, v: np.ndarray, initial: np.ndarray, *,
                       causal: bool, steps: int, defensive: int, seed: int) -> np.ndarray:
    """Proposal means (H, C, D) after ``steps`` Adam steps on the squared error of LARA
    (weighting ``"query_proposal"``) against exact attention on ``(q, k, v)``; each step
    draws new samples (reparameterized: the gradient reaches the means)."""
    import torch

    q_t, k_t, v_t = (torch.as_tensor(a, dtype=torch.float32) for a in (q, k, v))
    exact = torch.as_tensor(xattn.softmax_attention(q, k, v, causal=causal),
                            dtype=torch.float32)
    means = torch.nn.Parameter(torch.as_tensor(initial, dtype=torch.float32))
    optimizer = torch.optim.Adam([means], lr=0.05)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        out = xattn.lara(q_t, k_t, v_t, num_samples=means.shape[-2], proposal_means=means,
                         weighting="query_proposal", defensive=defensive, causal=causal,
                         rng=generator)
        loss = torch.mean((out - exact) ** 2)
        loss.backward()
        optimizer.step()
    return means.detach().numpy().astype(np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="16,64,256")
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--fit-steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lara_fidelity_results.json")
    args = parser.parse_args()
    q, k, v = (np.asarray(a, dtype=np.float64) for a in structured_attention_inputs())
    heads, _, head_dim = q.shape
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for causal in (False, True):
        uniform = causal_uniform(v) if causal else uniform_attention(q, k, v)
        exact = xattn.softmax_attention(q, k, v, causal=causal)
        uniform_mse = float(np.mean((uniform - exact) ** 2))
        for samples in (int(item) for item in args.samples.split(",")):
            quarter = max(1, samples // 4)
            initial = np.random.default_rng(samples).standard_normal((heads, samples, head_dim))
            fitted = {defensive: fit_proposal_means(
                q, k, v, initial, causal=causal, steps=args.fit_steps, defensive=defensive,
                seed=samples) for defensive in (0, quarter)}
            learned = {"weighting": "query_proposal", "num_samples": samples}
            variants: dict[str, tuple[Any, dict[str, Any]]] = {
                "rfa": (xattn.rfa, {"num_features": samples}),
                "lara-init": (xattn.lara, {**learned, "proposal_means": initial}),
                "lara-fitted": (xattn.lara, {**learned, "proposal_means": fitted[0]}),
                "lara-fitted-defensive": (xattn.lara, {**learned, "defensive": quarter,
                                                       "proposal_means": fitted[quarter]}),
            }
            if not causal:  # segments look ahead
                variants["lara"] = (xattn.lara, {"num_samples": samples})
                variants["lara-defensive"] = (xattn.lara, {"num_samples": samples,
                                                           "defensive": quarter})
            for name, (estimator, options) in variants.items():
                error = estimator_error(estimator, q, k, v, draws=args.draws, seed=0,
                                        causal=causal, exact=exact, **options)
                row = {"causal": causal, "samples": samples, "estimator": name,
                       "mse": error.mse, "bias_squared": error.bias_squared,
                       "variance": error.variance, "uniform_mse": uniform_mse}
                rows.append(row)
                print(f"causal={causal!s:5} S=C={samples:3} {name:22} MSE {error.mse:.3e} "
                      f"(uniform {uniform_mse:.3e})", flush=True)
    report = {"description": __doc__.splitlines()[0],
              "command": "python benchmarks/accuracy/bench_lara_fidelity.py",
              "input": "xattn.diagnostics.structured_attention_inputs() (4, 1024, 64), float64",
              "draws": args.draws, "fit_steps": args.fit_steps,
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
              "xattn": xattn.__version__, "numpy": np.__version__,
              "wall_s": time.perf_counter() - started, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
