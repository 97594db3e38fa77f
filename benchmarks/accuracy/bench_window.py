"""Windowed RFA (``xattn.rfa(..., window=W, sinks=K)``): error against window and samples,
and time against sequence length.

Two inputs, both deterministic:

* ``structured``: the default input of ``xattn compare``
  (:func:`xattn.diagnostics.structured_attention_inputs`: 4 heads, N = M = 1024, D = 64,
  queries and keys around 16 cluster centres, tokens assigned to clusters in contiguous
  blocks): sharp attention on the ~1/16 of keys of a query's cluster, mostly nearby.
* ``peaked_local``: attention shaped like the heads of pretrained language models
  (:func:`peaked_local_inputs`): a diagonal (scores decay with |n - m| through
  sinusoidal position features), a first-token sink (every query shares a direction
  with key 0) and content matches far away (tokens of the same cluster, which also
  share their values).

For each input the script measures the MSE (:func:`xattn.diagnostics.estimator_error`,
``--draws`` seeded draws) and the relative MSE (``relative_mse``: the MSE over the mean
square of the exact output) of

* ``rfa`` (window 0, sinks 0) and ``rfa+window`` for each ``--windows`` x ``--sinks``
  at each ``--samples`` (positive features, orthogonal samples);
* two baselines without random features: ``uniform`` (the mean of the values) and
  ``band only`` (exact softmax restricted to the band and the sinks, the other keys
  dropped);

and the time of ``rfa+window`` (W = 16, K = 1, S = 64, NumPy float32, one batch-head,
D = 64) for N = 2048 .. 16384 (N x 8), with and without ``causal``: the best process
CPU time of ``--repeats`` calls after a warm-up, with single-threaded BLAS
(``XATTN_BENCH_THREADS``, default 1), so that the figure is the compute time of the call
even on a shared machine.

Run (about 10 minutes on one core)::

    python benchmarks/accuracy/bench_window.py          # benchmarks/results/window_results.json
    python benchmarks/accuracy/bench_window.py --quick  # a smaller grid, for a smoke test
    python benchmarks/accuracy/bench_window.py --time-only    # only the time growth
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

THREADS = os.environ.get("XATTN_BENCH_THREADS", "1")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, THREADS)  # before NumPy loads its BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import loglog_slope  # noqa: E402

import xattn  # noqa: E402
from xattn.diagnostics import (  # noqa: E402
    estimator_error,
    structured_attention_inputs,
    uniform_attention,
)

HERE = Path(__file__).resolve().parents[1]  # benchmarks/


def peaked_local_inputs(*, num_heads: int = 4, length: int = 1024, head_dim: int = 64,
                        locality: float = 2.0, sink: float = 2.6, content: float = 1.5,
                        num_clusters: int = 16, noise: float = 0.3, value_noise: float = 0.7,
                        seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Queries, keys and values whose attention has a diagonal, a first-token sink and
    content matches far away, like the heads of pretrained language models.

    Coordinates of q and k (``D = head_dim``, scores scaled by :math:`D^{-1/2}`):

    * position: :math:`D/2` sinusoidal features :math:`[\cos f_j n, \sin f_j n]` at
      frequencies :math:`f_j` spread log-uniformly in ``[1/256, 1]``, scaled so that the
      score of query n with key m gets :math:`\text{locality}^2 \cdot \text{mean}_j
      \cos f_j (n - m)`: largest at m = n, decaying with |n - m|;
    * sink: one coordinate equal to ``sink`` for every query and for key 0 (0 for the
      other keys), so every query scores key 0 :math:`\text{sink}^2` higher;
    * content: each token belongs to one of ``num_clusters`` clusters (at random) whose
      centre has norm ``content``: tokens of the same cluster attend each other wherever
      they are;

    plus Gaussian ``noise`` on every coordinate. Values are the token's cluster value
    (standard normal, shared by the cluster) plus ``value_noise``: tokens that match
    carry related values, as in a real model where q, k and v come from the same token.
    With the defaults a query puts about 22 % of its attention on key 0, 27 % on the
    band :math:`|n - m| \le 16` and the rest mostly on far keys of its cluster.
    """
    rng = np.random.default_rng(seed)
    root = head_dim**0.25  # a coordinate c contributes c^2 to the scaled score
    num_frequencies = head_dim // 4
    frequencies = np.exp(rng.uniform(np.log(1 / 256), 0.0, size=(num_heads, num_frequencies)))
    phases = frequencies[:, None, :] * np.arange(length)[None, :, None]  # (H, N, F)
    position = np.concatenate([np.cos(phases), np.sin(phases)], axis=-1)
    position *= locality * root / np.sqrt(num_frequencies)
    content_dim = head_dim - 2 * num_frequencies - 1
    centres = rng.normal(size=(num_heads, num_clusters, content_dim))
    centres *= content * root / np.linalg.norm(centres, axis=-1, keepdims=True)
    clusters = rng.integers(num_clusters, size=(num_heads, length))
    token_content = np.take_along_axis(centres, clusters[..., None], axis=1)
    sink_query = np.full((num_heads, length, 1), sink * root)
    sink_key = np.zeros((num_heads, length, 1))
    sink_key[:, 0] = sink * root
    q = np.concatenate([position, sink_query, token_content], axis=-1)
    k = np.concatenate([position, sink_key, token_content], axis=-1)
    q = q + noise * rng.normal(size=q.shape)
    k = k + noise * rng.normal(size=k.shape)
    cluster_values = rng.normal(size=(num_heads, num_clusters, head_dim))
    v = (np.take_along_axis(cluster_values, clusters[..., None], axis=1)
         + value_noise * rng.normal(size=(num_heads, length, head_dim)))
    return q, k, v


def attention_profile(q: np.ndarray, k: np.ndarray, window: int) -> dict[str, float]:
    """Mean attention mass on key 0 and on the band |n - m| <= window (exact softmax)."""
    n = q.shape[-2]
    weights = xattn.softmax_attention(q, k, np.broadcast_to(np.eye(n), (*q.shape[:-2], n, n)))
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    return {"sink_mass": float(weights[..., 0].mean()),
            "band_mass": float((weights * (distance <= window)).sum(-1).mean())}


def band_only(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int,
              sinks: int) -> np.ndarray:
    """Exact softmax over the band and the sinks only (an explicit N x M mask: a baseline)."""
    n, m = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
    allowed = (m < sinks) | ((np.abs(n - m) <= window) if window else False)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def error_grid(q, k, v, windows, sinks_options, samples, draws):
    exact = xattn.softmax_attention(q, k, v)
    mean_square = float(np.mean(exact**2))
    rows = []

    def add(name, window, sinks, num_features, mse):
        # relative_mse: MSE / mean(exact²), the square of a relative (RMS) error
        rows.append({"estimator": name, "window": window, "sinks": sinks,
                     "samples": num_features, "mse": mse, "relative_mse": mse / mean_square})

    add("uniform", None, None, None, float(np.mean((uniform_attention(q, k, v) - exact) ** 2)))
    for window in windows:
        for sinks in sinks_options:
            if window or sinks:
                band = band_only(q, k, v, window, sinks)
                add("band only", window, sinks, None, float(np.mean((band - exact) ** 2)))
    for num_features in samples:
        for window in windows:
            for sinks in sinks_options:
                error = estimator_error(xattn.rfa, q, k, v, draws=draws, seed=0, exact=exact,
                                        num_features=num_features, window=window, sinks=sinks)
                add("rfa" if not (window or sinks) else "rfa+window", window, sinks,
                    num_features, error.mse)
                print(f"  S={num_features:4d} window={window:3d} sinks={sinks}: "
                      f"MSE {error.mse:.3e}", flush=True)
    return rows


def cpu_best_time(call, repeats: int) -> float:
    """Best CPU time of the process over ``repeats`` calls, after one warm-up call.

    With single-threaded BLAS this is the compute time of the call; unlike wall time it
    does not count the time other processes of a shared machine take from it.
    """
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        call()
        best = min(best, time.process_time() - start)
    return best


def time_growth(lengths, repeats, window=16, sinks=1, num_features=64, head_dim=64):
    rng = np.random.default_rng(0)
    results = {}
    for causal in (False, True):
        times = []
        for length in lengths:
            q, k, v = (rng.normal(size=(1, length, head_dim)).astype(np.float32)
                       for _ in range(3))
            omega = xattn.features.sample_omega(0, num_features, head_dim, xp=np,
                                                dtype=np.float32)

            def call(q=q, k=k, v=v, omega=omega):
                return xattn.rfa(q, k, v, omega=omega, window=window, sinks=sinks,
                                 causal=causal)  # noqa: B023 (called at once)

            best = cpu_best_time(call, repeats)
            times.append(best)
            print(f"  causal={causal} N={length}: {best * 1e3:.1f} ms", flush=True)
        results["causal" if causal else "non_causal"] = {
            "lengths": list(lengths), "seconds": times,
            "ratio_last_to_first": times[-1] / times[0],
            "loglog_slope": loglog_slope(lengths, times)}
    return {"window": window, "sinks": sinks, "samples": num_features, "head_dim": head_dim,
            "dtype": "float32", "backend": "numpy", "clock": "process CPU time, best of "
            f"{repeats} after a warm-up", **results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "window_results.json")
    parser.add_argument("--time-only", action="store_true",
                        help="measure the time growth only, keeping the errors of --out")
    args = parser.parse_args(argv)
    if args.quick:
        windows, sinks_options, samples, length = (0, 16), (0, 1), (16, 64), 256
        lengths = (512, 1024, 2048, 4096)
    else:
        windows, sinks_options, samples, length = (0, 4, 16, 64), (0, 1), (16, 64, 256), 1024
        lengths = (2048, 4096, 8192, 16384)
    if args.time_only:
        report = json.loads(args.out.read_text())
    else:
        inputs = {
            "structured": structured_attention_inputs(length=length),
            "peaked_local": peaked_local_inputs(length=length),
        }
        report = {"python": sys.version.split()[0], "numpy": np.__version__,
                  "machine": platform.machine(), "threads": THREADS, "draws": args.draws,
                  "length": length, "inputs": {}}
        for name, (q, k, v) in inputs.items():
            print(f"{name}:", flush=True)
            report["inputs"][name] = {
                "profile": attention_profile(q, k, 16),
                "errors": error_grid(q, k, v, windows, sinks_options, samples, args.draws)}
    print("time growth:", flush=True)
    report["time"] = time_growth(lengths, args.repeats)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
