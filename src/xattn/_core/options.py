"""The checks of every scalar option of xattn's estimators, helpers and layers.

Arrays are checked by :func:`xattn._core.inputs.prepare_attention` (shapes, dtypes, masks,
devices); everything else an estimator or a layer takes (flags, counts, choices, scales,
RFA's window and sinks, LARA's segments, the layers' estimator options) is checked here,
once, so that one kind of mistake raises one exception type with one message wherever it
is made:

* ``TypeError`` for a value of the wrong type (a float where an int is needed, an int
  where a bool is needed, a choice that is not a string, an option the function does not
  take);
* ``ValueError`` for a value of the right type that is out of range, or a combination of
  options that is not supported (``ra(deterministic=True, biased=False)``,
  ``lara(causal=True)``).

Each check takes the value and the argument's name (for the message), returns the value
as a Python type, and raises as above; each message names the argument and says what it
accepts. The module also holds the
defaults that several modules share (:data:`DEFAULT_CHUNK_SIZE`, RFA's
:func:`default_num_features`, the layers' :data:`DEFAULT_LARA_SAMPLES`). It imports
nothing from xattn, so that every module can use it.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, TypeGuard

import numpy as np

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LARA_SAMPLES",
    "ESTIMATORS",
    "ESTIMATOR_OPTIONS",
    "IMPLEMENTATIONS",
    "LEARNED_WEIGHTINGS",
    "check_bool",
    "check_choice",
    "check_estimator",
    "check_finite_real",
    "check_noise_scale",
    "check_nonnegative_int",
    "check_positive_int",
    "check_scale",
    "check_segments",
    "check_sizes",
    "check_window",
    "default_num_features",
    "lara_num_samples",
    "pair_of_ints",
]


# -- shared defaults -------------------------------------------------------------------------

DEFAULT_CHUNK_SIZE = 1024
"""Default ``chunk_size`` of :func:`xattn.softmax_attention`, :func:`xattn.rfa` and
:func:`xattn.lara`: the queries and keys they take per piece. Their pieces hold
``(chunk_size, chunk_size)`` scores (softmax) or ``(chunk_size, S)`` / ``(chunk_size, C)``
feature logits (RFA, LARA), whatever the sequence lengths."""

def default_num_features(head_dim: int) -> int:
    """Performer's default number of samples, ``max(D, int(D ln D))``.

    Parameters
    ----------
    head_dim : int
        The head dimension ``D`` of the queries and keys.

    Returns
    -------
    int
        The number of random features ``S`` used when ``num_features=None``.

    Examples
    --------
    >>> import xattn
    >>> xattn.default_num_features(64)
    266
    """
    return max(head_dim, int(head_dim * math.log(head_dim)))


# -- generic checks ---------------------------------------------------------------------------

def check_bool(value: Any, name: str) -> bool:
    """A flag: a bool or a NumPy bool (``np.True_``, as NumPy's own functions accept),
    returned as a Python bool; anything else (ints included) is a TypeError."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """A string among ``choices``, returned as it is: TypeError if it is not a ``str``,
    ValueError if it is another string (both messages list the choices)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {', '.join(map(repr, choices))}; "
                        f"got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_positive_int(value: Any, name: str) -> int:
    """A count or size >= 1: a Python or NumPy int, returned as a Python int; TypeError
    for anything else (a float, even ``2.0``, a bool, a string), ValueError if < 1."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_nonnegative_int(value: Any, name: str) -> int:
    """A count that may be 0: anything with ``__index__`` except bools, returned as a
    Python int; TypeError for anything else, ValueError if < 0."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} "
                        f"{value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_finite_real(value: Any, name: str) -> float:
    """A real number that may take any finite value (LARA's ``beta``): a Python or NumPy
    real, returned as a Python float; TypeError for anything else (bools included),
    ValueError for NaN or infinity."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_scale(scale: Any, head_dim: int) -> float:
    """The score scale: ``None`` (the default, ``1/sqrt(head_dim)``) or a positive finite
    Python or NumPy number, returned as a float; TypeError for anything else (a bool, a
    string, an array), ValueError if it is not positive and finite."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating | np.integer):
        raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


# -- options of the estimators ----------------------------------------------------------------

def check_noise_scale(noise_scale: Any) -> float:
    """RA's and LARA's ``noise_scale``, the standard deviation of the noise: a finite real
    >= 0 (Python or NumPy, bools excluded), returned as a float; TypeError for anything
    else, ValueError if it is negative, NaN or infinite."""
    if isinstance(noise_scale, bool) or not isinstance(noise_scale, numbers.Real):
        raise TypeError(f"noise_scale must be a real number >= 0, got "
                        f"{type(noise_scale).__name__} {noise_scale!r}")
    if not math.isfinite(noise_scale) or noise_scale < 0:
        raise ValueError(f"noise_scale must be a finite number >= 0, got {noise_scale}")
    return float(noise_scale)


def check_window(window: Any, sinks: Any, num_keys: int | None) -> tuple[int, int]:
    """Check RFA's ``window`` and ``sinks``.

    Parameters
    ----------
    window : Any
        None or an int >= 0 (0 and None both mean no exact band).
    sinks : Any
        None (0) or an int, ``0 <= sinks <= M``.
    num_keys : int or None
        ``M``, the number of keys; None where the sinks may come later (a call that
        starts or continues a sequence, ``return_state=True``).

    Returns
    -------
    (int, int)
        ``window`` (0 for None) and ``sinks``.

    Raises
    ------
    TypeError
        If either is not an int (see :func:`check_nonnegative_int`).
    ValueError
        If either is negative, or ``sinks > M``.
    """
    window = 0 if window is None else check_nonnegative_int(window, "window")
    sinks = 0 if sinks is None else check_nonnegative_int(sinks, "sinks")
    if num_keys is not None and sinks > num_keys:
        raise ValueError(f"sinks must be <= M = {num_keys} (the number of keys), got {sinks}")
    return window, sinks


def pair_of_ints(value: Any) -> TypeGuard[tuple[Any, ...] | list[Any]]:
    """True if ``value`` is a tuple or list of two ints (bools excluded): a grid
    ``(H, W)`` or a pair of pool sizes ``(c_h, c_w)``. Never raises."""
    return (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in value))


def check_segments(num_samples: Any, grid: Any, num_queries: int, num_keys: int,
                   shapes: str) -> tuple[int, tuple[int, int] | None, tuple[int, int] | None]:
    """Check LARA's ``num_samples`` and ``grid``.

    Parameters
    ----------
    num_samples : Any
        Without ``grid``, an int C, ``1 <= C <= N`` (any C when N = 0). With
        ``grid=(H, W)``, a pair ``(c_h, c_w)`` of ints, ``1 <= c_h <= H``,
        ``1 <= c_w <= W``.
    grid : Any
        None, or a pair ``(H, W)`` of ints >= 1; then N = M = H W.
    num_queries, num_keys : int
        N and M.
    shapes : str
        A description of q and k for the messages.

    Returns
    -------
    (int, (int, int) or None, (int, int) or None)
        ``(C, grid, pools)``: ``C = c_h c_w`` with a grid; ``grid`` and ``pools`` are
        None without one.

    Raises
    ------
    TypeError
        If ``num_samples`` is not an int (without ``grid``, a pair included) or not a pair
        of ints (with ``grid``), or ``grid`` is not a pair of ints.
    ValueError
        If C < 1 or C > N; with ``grid``, if H or W is < 1, a pool size lies outside
        ``1 .. H`` / ``1 .. W``, or N or M is not H W.
    """
    if grid is None:
        if isinstance(num_samples, tuple | list):
            raise TypeError(f"num_samples must be an int >= 1 (C segments); the pair form "
                            f"(c_h, c_w) needs grid=(H, W), got num_samples={num_samples!r} "
                            "without grid")
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral):
            raise TypeError(f"num_samples must be an int >= 1, got "
                            f"{type(num_samples).__name__} {num_samples!r}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        count = int(num_samples)
        if 0 < num_queries < count:
            raise ValueError(f"num_samples (C = {count}) must be <= the number of queries "
                             f"N = {num_queries} ({shapes})")
        return count, None, None
    if not pair_of_ints(grid):
        raise TypeError(f"grid must be a pair (H, W) of ints, got {type(grid).__name__} "
                        f"{grid!r}")
    height, width = (int(x) for x in grid)
    if height < 1 or width < 1:
        raise ValueError(f"grid (H, W) must hold positive ints, got {grid!r}")
    if not pair_of_ints(num_samples):
        raise TypeError(f"with grid=(H, W), num_samples must be a pair (c_h, c_w) of ints "
                        f"(c_h * c_w segments, the bins of 2-D adaptive average pooling), got "
                        f"{type(num_samples).__name__} {num_samples!r}")
    pool_h, pool_w = (int(x) for x in num_samples)
    if not (1 <= pool_h <= height and 1 <= pool_w <= width):
        raise ValueError(f"num_samples (c_h, c_w) = {(pool_h, pool_w)} must satisfy "
                         f"1 <= c_h <= H and 1 <= c_w <= W for grid (H, W) = "
                         f"{(height, width)}")
    tokens = height * width
    if num_queries != tokens or num_keys != tokens:
        raise ValueError(f"grid (H, W) = {(height, width)} needs N = M = H * W = {tokens} "
                         f"queries and keys in row-major order; got N = {num_queries}, "
                         f"M = {num_keys} ({shapes})")
    return pool_h * pool_w, (height, width), (pool_h, pool_w)


# -- options of the layers --------------------------------------------------------------------

ESTIMATORS = ("softmax", "rfa", "ra", "lara")
"""Estimator names the layers accept."""

IMPLEMENTATIONS = ("native", "xattn")
"""The values of ``softmax_attention(..., implementation=)`` besides None (automatic)."""

# Options each estimator takes through the layers' ``**estimator_options``. Keywords the
# layer sets itself (masks, causal, rng, omega, the train/eval switches) are not among them.
ESTIMATOR_OPTIONS = {
    "softmax": ("scale", "chunk_size", "implementation"),
    "rfa": ("num_features", "feature_map", "orthogonal", "sample_norm", "scale",
            "block_size", "chunk_size", "window", "sinks", "working_memory"),
    "ra": ("num_samples", "noise_scale", "scale", "chunk_size", "working_memory"),
    "lara": ("num_samples", "grid", "proposal", "weighting", "beta", "noise_scale", "scale",
             "chunk_size", "defensive", "working_memory"),
}
LEARNED_WEIGHTINGS = ("balance", "query_proposal")
"""The weightings of a layer's ``proposal="learned"`` (they need no segments)."""
# Sample counts: checked here, since the probe of a short input would cap LARA's count.
_COUNT_OPTIONS = {"rfa": "num_features", "ra": "num_samples"}

DEFAULT_LARA_SAMPLES = 16
"""Default number of LARA proposals C (capped at the query length); with ``grid=(H, W)``,
``(4, 4)`` capped at ``(H, W)``."""


def lara_num_samples(options: dict[str, Any]) -> Any:
    """LARA's ``num_samples`` among a layer's ``options``, or its default:
    :data:`DEFAULT_LARA_SAMPLES`, or ``(4, 4)`` capped at the grid ``(H, W)``. Unchecked
    (see :func:`check_estimator`)."""
    if "num_samples" in options:
        return options["num_samples"]
    grid = options.get("grid")
    if pair_of_ints(grid):
        side = math.isqrt(DEFAULT_LARA_SAMPLES)
        return (min(side, grid[0]), min(side, grid[1]))
    return DEFAULT_LARA_SAMPLES


def check_sizes(**sizes: Any) -> None:
    """A layer's sizes (``embed_dim=...``, ``num_heads=...``): each an int >= 1 or
    ``None`` (the layer's default), as :func:`check_positive_int`."""
    for name, value in sizes.items():
        if value is not None:
            check_positive_int(value, name)


def check_estimator(estimator: Any, options: dict[str, Any], redraw_interval: Any) -> None:
    """Check a layer's estimator, the options passed on to it and its redraw interval.

    The values of the options are checked further by running the estimator (the layers'
    probe); what is checked here cannot be probed on a short input: the sample counts
    (LARA's would be capped) and LARA's grid.

    Parameters
    ----------
    estimator : Any
        One of :data:`ESTIMATORS`.
    options : dict
        The layer's ``**estimator_options``: names among the estimator's
        :data:`ESTIMATOR_OPTIONS`.
    redraw_interval : Any
        An int >= 1, or None (keep the features until redrawn by hand).

    Raises
    ------
    TypeError
        If ``estimator`` is not a str, an option is one the estimator does not take, or a
        sample count, LARA's grid or ``redraw_interval`` has the wrong type.
    ValueError
        If ``estimator`` is an unknown name, or a sample count, LARA's grid or
        ``redraw_interval`` is out of range.
    """
    if redraw_interval is not None:
        check_positive_int(redraw_interval, "redraw_interval")
    if not isinstance(estimator, str):
        raise TypeError(f"estimator must be a str, one of {list(ESTIMATORS)}; got "
                        f"{type(estimator).__name__} {estimator!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    allowed = ESTIMATOR_OPTIONS[estimator]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"estimator {estimator!r} does not take the option(s) {unknown}; its options are "
            f"{list(allowed)} (masks, causal mode, rng, omega and the train/eval switches "
            "are set by the layer)"
        )
    if estimator in _COUNT_OPTIONS and _COUNT_OPTIONS[estimator] in options:
        check_positive_int(options[_COUNT_OPTIONS[estimator]], _COUNT_OPTIONS[estimator])
    if estimator == "lara" and options.get("proposal") == "learned":
        if options.get("grid") is not None:
            raise ValueError("proposal='learned' takes no grid: the learned means replace "
                             "the segments")
        check_positive_int(lara_num_samples(options), "num_samples")
        if options.get("weighting", "query_proposal") not in LEARNED_WEIGHTINGS:
            raise ValueError(f"proposal='learned' takes weighting in {LEARNED_WEIGHTINGS} "
                             f"(they need no segments), got {options['weighting']!r}")
    elif estimator == "lara":  # C, or the pair (c_h, c_w) with grid=(H, W)
        grid = options.get("grid")
        tokens = math.prod(grid) if pair_of_ints(grid) else 0
        check_segments(lara_num_samples(options), grid, tokens, tokens, "the layer's grid")
