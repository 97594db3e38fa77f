"""One table over every public function: bad ranks, dtypes, shapes and option names are
rejected with a ValueError/TypeError whose message names the offending argument."""

from __future__ import annotations

import numpy as np
import pytest

import xattn
from xattn import balance_heuristic, diagnostics, features, lara_weights, mrf
from xattn import random as xrandom

DATA = np.random.default_rng(0)
Q, K, V = DATA.normal(size=(2, 5, 4)), DATA.normal(size=(2, 6, 4)), DATA.normal(size=(2, 6, 3))
EMBEDDINGS = 0.3 * DATA.normal(size=(4, 3, 2))  # (T, |X|, n)
INT = np.ones((2, 6, 4), dtype=np.int64)

ESTIMATORS = {
    "softmax_attention": lambda *a, **kw: xattn.softmax_attention(*a, **kw),
    "rfa": lambda *a, **kw: xattn.rfa(*a, **{"rng": 0, **kw}),
    "ra": lambda *a, **kw: xattn.ra(*a, **{"rng": 0, **kw}),
    "lara": lambda *a, **kw: xattn.lara(*a, **{"num_samples": 2, "rng": 0, **kw}),
    "uniform_attention": lambda *a, **kw: diagnostics.uniform_attention(*a, **kw),
    "estimator_error": lambda *a, **kw: diagnostics.estimator_error(
        xattn.softmax_attention, *a, **{"rng_keyword": None, "draws": 1, **kw}),
}

# the attention-input errors every estimator shares (from xattn._core.inputs.prepare_attention)
COMMON = [
    ("q rank", (Q[0, 0], K, V), {}, ValueError, r"q must have shape \(\.\.\., N, D\)"),
    ("k rank", (Q, K[0, 0], V), {}, ValueError, r"k must have shape \(\.\.\., M, D\)"),
    ("v rank", (Q, K, V[0, 0]), {}, ValueError, r"v must have shape \(\.\.\., M, Dv\)"),
    ("k dtype", (Q, INT, V), {}, TypeError, r"k must have a real floating dtype.*int64"),
    ("v dtype", (Q, K, V.astype(np.complex128)), {}, TypeError, r"v must have a real floating"),
    ("q/k dim", (Q, K[..., :3], V), {}, ValueError, r"q and k must have the same last dim D"),
    ("k/v keys", (Q, K, V[:, :5]), {}, ValueError, r"k and v must have the same number of keys"),
    ("batch", (Q, K[:1].repeat(3, 0), V[:1].repeat(3, 0)), {}, ValueError,
     r"leading \(batch\) dims do not broadcast: q \(2,\), k \(3,\)"),
    ("M = 0", (Q, K[:, :0], V[:, :0]), {}, ValueError, r"k must hold at least one key \(M >= 1\)"),
    ("not an array", (Q, K.tolist(), V), {}, TypeError, r"k must be an array"),
    ("key_mask dtype", (Q, K, V), {"key_mask": np.ones((2, 6))}, TypeError,
     r"key_mask must be a boolean array"),
    ("key_mask shape", (Q, K, V), {"key_mask": np.ones((2, 5), dtype=bool)}, ValueError,
     r"key_mask must have shape \(\.\.\., M\) with M = 6"),
    ("scale", (Q, K, V), {"scale": -1.0}, ValueError, r"scale must be a positive finite"),
    ("scale type", (Q, K, V), {"scale": "0.5"}, TypeError, r"scale must be a Python float"),
]
COMMON_ONLY_ATTENTION = {"uniform_attention", "estimator_error"}  # no scale option

# option errors of single functions: (id, function, args, kwargs, error, pattern)
SPECIFIC = [
    ("softmax causal", ESTIMATORS["softmax_attention"], (Q, K, V), {"causal": 1}, TypeError,
     r"causal must be a bool"),
    ("softmax chunk_size", ESTIMATORS["softmax_attention"], (Q, K, V), {"chunk_size": 0},
     ValueError, r"chunk_size must be >= 1"),
    *[(f"{name} check_finite", ESTIMATORS[name], (Q, K, V), {"check_finite": "yes"}, TypeError,
       r"check_finite must be a bool") for name in ("softmax_attention", "rfa", "ra", "lara")],
    ("rfa feature_map", ESTIMATORS["rfa"], (Q, K, V), {"feature_map": "relu"}, ValueError,
     r"feature_map must be one of 'positive', 'hyperbolic', 'trigonometric'; got 'relu'"),
    ("rfa feature_map type", ESTIMATORS["rfa"], (Q, K, V), {"feature_map": 3}, TypeError,
     r"feature_map must be a str, one of 'positive', 'hyperbolic', 'trigonometric'; got int 3"),
    ("rfa sample_norm", ESTIMATORS["rfa"], (Q, K, V), {"sample_norm": "unit"}, ValueError,
     r"sample_norm must be one of"),
    ("rfa sample_norm type", ESTIMATORS["rfa"], (Q, K, V), {"sample_norm": None}, TypeError,
     r"sample_norm must be a str"),
    ("rfa num_features", ESTIMATORS["rfa"], (Q, K, V), {"num_features": 0}, ValueError,
     r"num_features must be >= 1"),
    ("rfa num_features type", ESTIMATORS["rfa"], (Q, K, V), {"num_features": 2.0}, TypeError,
     r"num_features must be an int"),
    ("rfa omega shape", ESTIMATORS["rfa"], (Q, K, V), {"omega": np.ones((8, 3))}, ValueError,
     r"omega must have shape \(S, D\) = \(S, 4\)"),
    ("rfa omega dtype", ESTIMATORS["rfa"], (Q, K, V), {"omega": np.ones((8, 4), dtype=int)},
     TypeError, r"omega must have a real floating dtype"),
    ("rfa orthogonal", ESTIMATORS["rfa"], (Q, K, V), {"orthogonal": "yes"}, TypeError,
     r"orthogonal must be a bool"),
    ("rfa block_size", ESTIMATORS["rfa"], (Q, K, V), {"block_size": -1}, ValueError,
     r"block_size must be >= 1"),
    ("rfa rng", ESTIMATORS["rfa"], (Q, K, V), {"rng": "seed"}, TypeError, r"rng must be None"),
    ("rfa rng seed", ESTIMATORS["rfa"], (Q, K, V), {"rng": -3}, ValueError,
     r"rng seed must be a non-negative int"),
    ("ra num_samples", ESTIMATORS["ra"], (Q, K, V), {"num_samples": 0}, ValueError,
     r"num_samples must be >= 1"),
    ("ra biased", ESTIMATORS["ra"], (Q, K, V), {"biased": 1}, TypeError,
     r"biased must be a bool"),
    ("ra deterministic", ESTIMATORS["ra"], (Q, K, V), {"deterministic": True}, ValueError,
     r"deterministic=True requires biased=True"),
    ("ra chunk_size", ESTIMATORS["ra"], (Q, K, V), {"chunk_size": 1.5}, TypeError,
     r"chunk_size must be an int"),
    ("lara num_samples > N", ESTIMATORS["lara"], (Q, K, V), {"num_samples": 6}, ValueError,
     r"num_samples \(C = 6\) must be <= the number of queries N = 5"),
    ("lara proposal", ESTIMATORS["lara"], (Q, K, V), {"proposal": "segments"}, ValueError,
     r"proposal must be one of 'segment'"),
    ("lara weighting", ESTIMATORS["lara"], (Q, K, V), {"weighting": "mis"}, ValueError,
     r"weighting must be one of"),
    ("lara proposal type", ESTIMATORS["lara"], (Q, K, V), {"proposal": ["segment"]},
     TypeError, r"proposal must be a str, one of 'segment'"),
    ("lara beta", ESTIMATORS["lara"], (Q, K, V), {"beta": float("inf")}, ValueError,
     r"beta must be finite"),
    ("lara beta type", ESTIMATORS["lara"], (Q, K, V), {"beta": "2"}, TypeError,
     r"beta must be a real number"),
    ("lara query_mask", ESTIMATORS["lara"], (Q, K, V), {"query_mask": np.ones((2, 6), bool)},
     ValueError, r"query_mask must have shape \(\.\.\., N\) with N = 5"),
    ("lara deterministic", ESTIMATORS["lara"], (Q, K, V), {"deterministic": None}, TypeError,
     r"deterministic must be a bool"),
    ("log_partition rank", mrf.log_partition, (EMBEDDINGS[0],), {}, ValueError,
     r"embeddings must have shape \(\.\.\., T, \|X\|, n\) \(rank >= 3\)"),
    ("log_partition T", mrf.log_partition, (EMBEDDINGS[:1],), {}, ValueError,
     r"embeddings must have T >= 2 positions"),
    ("log_partition dtype", mrf.log_partition, (EMBEDDINGS.astype(np.int32),), {}, TypeError,
     r"embeddings must have a real floating dtype"),
    ("log_partition not an array", mrf.log_partition, ("abc",), {}, TypeError,
     r"embeddings must be an array"),
    ("log_partition sequence", mrf.log_partition, ([EMBEDDINGS[0], EMBEDDINGS[1, :2]],), {},
     ValueError, r"embeddings given as a sequence must be T arrays of one shape"),
    ("log_partition_rf method", mrf.log_partition_rf, (EMBEDDINGS,),
     {"num_features": 4, "method": "scan"}, ValueError, r"method must be one of"),
    ("log_partition_rf samples type", mrf.log_partition_rf, (EMBEDDINGS,),
     {"num_features": 4, "samples": 1}, TypeError, r"samples must be a str"),
    ("log_partition_rf num_features", mrf.log_partition_rf, (EMBEDDINGS,), {}, TypeError,
     r"num_features is required"),
    ("log_partition_rf num_features 0", mrf.log_partition_rf, (EMBEDDINGS,),
     {"num_features": 0}, ValueError, r"num_features must be >= 1"),
    ("log_partition_rf omega", mrf.log_partition_rf, (EMBEDDINGS,),
     {"omega": np.ones((4, 3)), "samples": "shared"}, ValueError,
     r"omega must have shape \(\.\.\., d, n\) with n = 2"),
    ("log_partition_rf omega rows", mrf.log_partition_rf, (EMBEDDINGS,),
     {"omega": np.ones((4, 2)), "num_features": 5, "samples": "shared"}, ValueError,
     r"num_features = 5 disagrees with omega"),
    ("estimator_error draws", ESTIMATORS["estimator_error"], (Q, K, V), {"draws": 0},
     ValueError, r"draws must be >= 1"),
    ("estimator_error estimator", diagnostics.estimator_error, ("rfa", Q, K, V), {}, TypeError,
     r"estimator must be callable"),
    ("estimator_error seed", diagnostics.estimator_error, (xattn.rfa, Q, K, V),
     {"seed": -1}, ValueError, r"seed must be a non-negative int"),
    ("estimator_error shape", diagnostics.estimator_error,
     (lambda q, k, v, rng: v, Q, K, V), {}, ValueError,
     r"the estimator returned shape \(2, 6, 3\), but exact softmax attention has shape"),
    ("kernel_mse_positive shapes", diagnostics.kernel_mse_positive, (Q[0, 0], K[0, 0, :3]),
     {"num_features": 4}, ValueError, r"x and y must have shape \(\.\.\., D\) with the same D"),
    ("kernel_mse_positive num_features", diagnostics.kernel_mse_positive, (Q[0, 0], K[0, 0]),
     {"num_features": 0}, ValueError, r"num_features must be >= 1"),
    ("default_rng seed", xrandom.default_rng, ("0",), {}, TypeError, r"seed must be an int"),
    ("default_rng like", xrandom.default_rng, (0,), {"like": [1.0]}, TypeError,
     r"like must be an array"),
    ("as_generator", xrandom.as_generator, (1.5,), {}, TypeError, r"rng must be None"),
    ("sample_omega num_features", features.sample_omega, (0, 0, 4),
     {"xp": np, "dtype": np.float64}, ValueError, r"num_features must be >= 1"),
    ("sample_omega dim", features.sample_omega, (0, 4, 0), {"xp": np, "dtype": np.float64},
     ValueError, r"dim must be >= 1"),
    ("sample_omega norm", features.sample_omega, (0, 4, 4),
     {"xp": np, "dtype": np.float64, "norm": "unit"}, ValueError, r"norm must be one of"),
    ("sample_omega orthogonal", features.sample_omega, (0, 4, 4),
     {"xp": np, "dtype": np.float64, "orthogonal": 0}, TypeError, r"orthogonal must be a bool"),
    ("random_features feature_map", features.random_features, (np, Q, np.ones((3, 4))),
     {"feature_map": "cos"}, ValueError, r"feature_map must be one of"),
    ("sample_omega norm type", features.sample_omega, (0, 4, 4),
     {"xp": np, "dtype": np.float64, "norm": 2.0}, TypeError, r"norm must be a str"),
    ("balance_heuristic", balance_heuristic, (Q, [[1.0]]), {}, TypeError,
     r"proposal_means must be an array"),
    ("lara_weights weighting", lara_weights, (np.ones(3), np.ones((2, 3))),
     {"weighting": "heuristic"}, ValueError, r"weighting must be one of"),
]


try:  # the PyTorch module (torch extra)
    import torch

    from xattn.torch import MultiheadAttention
except ImportError:  # pragma: no cover - torch is in the test extra
    torch = None
else:
    X = torch.zeros(5, 2, 8)  # (L, N, E)
    SPECIFIC += [
        ("torch module embed_dim", MultiheadAttention, (0, 1), {}, ValueError,
         r"embed_dim must be >= 1"),
        ("torch module num_heads", MultiheadAttention, (8, 3), {}, ValueError,
         r"embed_dim \(8\) must be divisible by num_heads \(3\)"),
        ("torch module estimator", MultiheadAttention, (8, 2), {"estimator": "performer"},
         ValueError, r"estimator must be one of"),
        ("torch module option", MultiheadAttention, (8, 2), {"estimator": "lara",
                                                            "proposal": "x"},
         ValueError, r"proposal must be one of"),
        ("torch module query rank", lambda *a: MultiheadAttention(8, 2)(*a, need_weights=False),
         (X[None], X[None], X[None]), {}, ValueError, r"query must be 2-D \(unbatched\) or 3-D"),
        ("torch module key dim", lambda *a: MultiheadAttention(8, 2)(*a, need_weights=False),
         (X, X[..., :4], X), {}, ValueError, r"key must have 8 features in its last dim"),
    ]


def cases():
    for name, estimator in ESTIMATORS.items():
        for case, args, kwargs, error, pattern in COMMON:
            if name in COMMON_ONLY_ATTENTION and "scale" in kwargs:
                continue
            yield pytest.param(estimator, args, kwargs, error, pattern, id=f"{name}-{case}")
    for case, function, args, kwargs, error, pattern in SPECIFIC:
        yield pytest.param(function, args, kwargs, error, pattern, id=case)


@pytest.mark.parametrize("function,args,kwargs,error,pattern", list(cases()))
def test_bad_input_is_rejected_naming_the_argument(function, args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        function(*args, **kwargs)


@pytest.mark.parametrize("argument", ["k", "v", "key_mask", "omega"])
def test_an_array_on_another_device_is_named(argument):
    """An input on another device than q is a ValueError naming it, before any work (on a
    GPU this was a backend traceback for ``omega`` on the host)."""
    import array_api_strict as xps

    other = xps.Device("device1")
    q, k, v = (xps.asarray(np.ones((2, 5, 4))) for _ in range(3))
    arrays = {"k": k, "v": v, "key_mask": xps.ones((2, 5), dtype=xps.bool),
              "omega": xps.asarray(np.ones((8, 4)))}
    arrays[argument] = xps.asarray(arrays[argument], device=other)
    key_mask, omega = arrays["key_mask"], arrays["omega"]
    with pytest.raises(ValueError, match=rf"^{argument} is on device .* but q is on"):
        xattn.rfa(q, arrays["k"], arrays["v"], key_mask=key_mask, omega=omega)
