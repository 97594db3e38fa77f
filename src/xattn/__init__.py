"""xattn: randomized attention estimators for any Array API library.

Estimators (each a function of ``q (..., N, D)``, ``k (..., M, D)``, ``v (..., M, Dv)``):

- :func:`softmax_attention`: exact softmax attention (the reference);
- :func:`rfa`: random feature attention (RFA / Performer FAVOR+: positive, hyperbolic,
  trigonometric maps; orthogonal samples; causal mode);
- :func:`ra`: randomized attention (unbiased, biased and deterministic forms);
- :func:`lara`: linear randomized attention (multiple-importance sampling, linear cost).

Helpers of the estimators: :func:`default_num_features`,
:class:`TrigonometricDenominatorWarning`, :func:`lara_weights`, :func:`balance_heuristic`,
the states that continue a causal sequence (generation: ``return_state=True``, then
``state=``), :class:`RFAState` and :class:`LARAState` (fixed size),
:class:`SoftmaxState` and :class:`RAState` (key-value caches), and the constants
:data:`ESTIMATORS` (the four names, as the layers' ``estimator=`` and ``xattn train``
take them), :data:`PROPOSALS`, :data:`WEIGHTINGS`, :data:`WEIGHT_FLOOR`.

Calibration: :func:`calibrate_omega` fits RFA's samples to a layer's own attention (one
matrix per head; torch or JAX) and returns them with a :class:`CalibrationReport`.

Submodules, reachable after ``import xattn`` (loaded on first use, so that a framework is
imported only when its layer is asked for): :mod:`xattn.random` (the random-number
adapter), :mod:`xattn.features` (random feature maps and samples),
:mod:`xattn.diagnostics` (bias, variance and MSE against exact attention),
:mod:`xattn.mrf` (linear-chain MRF partition functions), :mod:`xattn.torch`,
:mod:`xattn.flax` and :mod:`xattn.keras` (attention layers), :mod:`xattn.transformers`
(the Hugging Face transformers hook).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from xattn._core.array import default_working_memory
from xattn._core.options import ESTIMATORS
from xattn._core.state import LARAState, RAState, RFAState, SoftmaxState
from xattn._estimators.importance import WEIGHT_FLOOR, WEIGHTINGS, balance_heuristic, lara_weights
from xattn._estimators.lara import PROPOSALS, lara
from xattn._estimators.ra import ra
from xattn._estimators.rfa import TrigonometricDenominatorWarning, default_num_features, rfa
from xattn._estimators.softmax import softmax_attention

if TYPE_CHECKING:  # loaded on first use (__getattr__ below)
    from xattn._integrations.calibration import CalibrationReport, calibrate_omega

__all__ = [
    "ESTIMATORS",
    "PROPOSALS",
    "WEIGHTINGS",
    "WEIGHT_FLOOR",
    "CalibrationReport",
    "LARAState",
    "RAState",
    "RFAState",
    "SoftmaxState",
    "TrigonometricDenominatorWarning",
    "balance_heuristic",
    "calibrate_omega",
    "default_num_features",
    "default_working_memory",
    "diagnostics",
    "features",
    "flax",
    "keras",
    "lara",
    "lara_weights",
    "mrf",
    "ra",
    "random",
    "rfa",
    "softmax_attention",
    "torch",
    "transformers",
]
__version__ = "0.1.0"

_SUBMODULES = ("diagnostics", "features", "flax", "keras", "mrf", "random", "torch",
               "transformers")


# the calibration of samples, loaded on first use (its framework's module only then)
_CALIBRATION = ("CalibrationReport", "calibrate_omega")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"xattn.{name}")
    if name in _CALIBRATION:
        return getattr(importlib.import_module("xattn._integrations.calibration"), name)
    raise AttributeError(f"module 'xattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
