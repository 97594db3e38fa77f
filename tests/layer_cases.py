"""Cases shared by the tests of the torch and Flax layers (tests/test_*_module.py)."""

from __future__ import annotations

import inspect
import math

import numpy as np

import xattn

ESTIMATORS = ("softmax", "rfa", "ra", "lara")
SMALL_OPTIONS = {"softmax": {}, "rfa": {"num_features": 16}, "ra": {"num_samples": 2},
                 "lara": {"num_samples": 4}}

# Bad values of every option the layers pass to an estimator: wrong types and wrong values.
# Each must fail when the layer is constructed, with the exception type the estimator itself
# raises for it (TypeError for a wrong type, ValueError for a wrong value).
BAD_OPTION_VALUES = {
    "softmax": {"scale": [-1.0, "2", math.nan], "chunk_size": [0, 2.5],
                "implementation": ["fused", 1]},
    "rfa": {"num_features": [0, 2.5, True], "feature_map": ["relu"],
            "orthogonal": ["yes", 1], "sample_norm": ["unit"], "scale": [0.0],
            "block_size": [0, 2.5], "chunk_size": [0, 2.5], "window": [-1, 1.5, "a"],
            "sinks": [-1, 2.5, "a"], "working_memory": [0, 2.5, "1 GiB"]},
    "ra": {"num_samples": [0, 2.5, 512.0], "noise_scale": [-1.0, "x", math.nan],
           "scale": ["x"], "chunk_size": [0, 1.5], "working_memory": [0, 2.5, "1 GiB"]},
    "lara": {"num_samples": [0, 2.5, 2.0, -1, (2, 2)], "grid": [(0, 4), "8x8", (2.5, 4)],
             "proposal": ["uniform"],
             "weighting": ["uniform"], "beta": ["2", math.nan],
             "noise_scale": [-0.5, True, math.inf], "scale": [-2.0], "chunk_size": [0, 1.5],
             "defensive": [-1, 1.5, "2"], "working_memory": [0, -8, 1.5]},
}
BAD_OPTION_CASES = [(estimator, option, value)
                    for estimator, options in BAD_OPTION_VALUES.items()
                    for option, values in options.items() for value in values]

_ESTIMATOR_FUNCTIONS = {"softmax": xattn.softmax_attention, "rfa": xattn.rfa, "ra": xattn.ra,
                        "lara": xattn.lara}


def direct_error(estimator: str, option: str, value) -> type[Exception]:
    """The exception type the estimator itself raises for ``option=value`` on a small
    NumPy input (8 tokens, so that no sample count is capped)."""
    q = np.random.default_rng(0).normal(size=(1, 8, 4)).astype(np.float32)
    options = {option: value}
    if estimator == "lara":
        options.setdefault("num_samples", 4)
    if estimator != "softmax":
        options["rng"] = 0
    try:
        _ESTIMATOR_FUNCTIONS[estimator](q, q, q, **options)
    except (TypeError, ValueError) as error:
        return type(error)
    raise AssertionError(f"{estimator}({option}={value!r}) is accepted by the estimator: "
                         "not a bad value")


# LARA's grid option with a sample count of the wrong form, or pools larger than the grid.
BAD_GRID_OPTIONS = [
    ({"grid": (4, 4), "num_samples": 4}, TypeError, r"num_samples must be a pair \(c_h, c_w\)"),
    ({"grid": (4, 4), "num_samples": (5, 1)}, ValueError, r"1 <= c_h <= H"),
    ({"grid": (4, 4), "num_samples": (2, 0)}, ValueError, r"1 <= c_w <= W"),
    ({"grid": (4,), "num_samples": (2, 2)}, TypeError, r"grid must be a pair \(H, W\)"),
]

# Options whose layer output must equal the estimator's own output on the layer's
# projections (same weights, same random source): they reach the estimator unchanged.
PASS_THROUGH_CASES = [
    ("softmax", {"scale": 0.3}),
    ("rfa", {"num_features": 16, "feature_map": "hyperbolic"}),
    ("rfa", {"num_features": 16, "window": 2, "sinks": 1, "chunk_size": 5}),
    ("ra", {"num_samples": 2, "noise_scale": 0.5}),
    ("ra", {"num_samples": 2, "noise_scale": 0.0}),
    ("lara", {"num_samples": 4, "noise_scale": 0.25}),
    ("lara", {"num_samples": 4, "chunk_size": 3}),
    ("lara", {"num_samples": (2, 2), "grid": (3, 4), "proposal": "key_attention"}),
]


def estimator_call(estimator: str, options: dict, *, training: bool, omega=None, rng=None):
    """``(function, keywords)``: the estimator call a layer makes in the given mode."""
    options = dict(options)
    for name in ("num_features", "orthogonal", "sample_norm"):  # used to draw omega
        options.pop(name, None)
    if estimator == "softmax":
        return xattn.softmax_attention, options
    if estimator == "rfa":
        return xattn.rfa, {**options, "omega": omega}
    if training:
        return _ESTIMATOR_FUNCTIONS[estimator], {**options, "rng": rng}
    if estimator == "ra":
        return xattn.ra, {**options, "biased": True, "deterministic": True}
    return xattn.lara, {**options, "deterministic": True}


def bool_options(function):
    """The options of ``function`` annotated ``bool`` (or ``bool | None``), found with
    :mod:`inspect`, so that a new bool option is checked without editing the tests."""
    return [name for name, parameter in inspect.signature(function).parameters.items()
            if parameter.annotation in (bool, "bool", "bool | None")]


def constructor_bool_cases(layer_init):
    """(estimator, option) of every bool a layer constructor takes: its own (with the rfa
    estimator) and each estimator's bool options that the layer passes on."""
    from xattn._integrations import layers as _layers

    return [*(("rfa", name) for name in bool_options(layer_init)),
            *((estimator, name) for estimator, options in _layers.ESTIMATOR_OPTIONS.items()
              for name in options if name in bool_options(_ESTIMATOR_FUNCTIONS[estimator]))]
