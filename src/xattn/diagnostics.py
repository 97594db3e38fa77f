r"""Error diagnostics: empirical bias, variance and MSE of an estimator; closed-form kernel MSE.

Everything here goes through the Array API namespace of the inputs, so it runs on every
backend the estimators run on. Two tools:

* :func:`estimator_error` runs a randomized attention estimator ``draws`` times with
  independent seeds and measures, against exact softmax attention, its squared bias,
  variance and mean squared error, averaged over the output elements;
* :func:`kernel_mse_positive` is the closed-form MSE of the positive random-feature
  estimate of the exponential kernel (Choromanski et al., *Rethinking
  Attention with Performers*, Lemma 2).

:func:`uniform_attention` is the trivial baseline every query of which receives the mean
of the values; the ``xattn compare`` command reports it next to the estimators, on the
sharp, clustered inputs of :func:`structured_attention_inputs` by default.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from xattn._core.array import Array, array_namespace
from xattn._core.inputs import check_attention_inputs, prepare_attention
from xattn._core.options import check_positive_int
from xattn._core.primitives import nonzero_divisor
from xattn._estimators.softmax import softmax_attention

__all__ = [
    "EstimatorError",
    "check_attention_inputs",
    "draw_seeds",
    "estimator_error",
    "kernel_mse_positive",
    "structured_attention_inputs",
    "uniform_attention",
]


# options of the estimators that also change what exact softmax attention computes
_REFERENCE_OPTIONS = ("scale", "key_mask", "causal")


@dataclass(frozen=True)
class EstimatorError:
    """Empirical error of an estimator over independent draws (see :func:`estimator_error`).

    Attributes
    ----------
    bias_squared : float
        Mean over output elements of :math:`(\\bar y - y)^2`, with :math:`\\bar y` the mean
        of the draws and :math:`y` exact softmax attention.
    variance : float
        Mean over output elements of the population variance over draws,
        :math:`\\frac1R \\sum_r (y^{(r)} - \\bar y)^2`.
    mse : float
        Mean over output elements and draws of :math:`(y^{(r)} - y)^2`; equals
        ``bias_squared + variance`` up to rounding.
    relative_error : float
        :math:`\\sqrt{\\mathrm{mse} / \\overline{y^2}}`: root-mean-square error relative to the
        root-mean-square of exact attention (``inf`` when exact attention is all zero
        and the error is not, ``0.0`` when both are).
    draws : int
        Number of draws :math:`R`.
    seeds : range or None
        The int seeds of the draws, ``seed, seed + 1, ..., seed + draws - 1``, as a
        :class:`range` (a sequence of ints of constant size, however many draws);
        ``None`` when an explicit generator was used or nothing was drawn.
    """

    bias_squared: float
    variance: float
    mse: float
    relative_error: float
    draws: int
    seeds: range | None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict.

        ``seeds`` is summarized as ``{"first": seed, "last": seed + draws - 1}`` (the
        seeds are consecutive), so the dict stays small however many draws were made.

        Examples
        --------
        >>> from xattn.diagnostics import EstimatorError
        >>> error = EstimatorError(0.0, 1.0, 1.0, 0.5, draws=3, seeds=range(7, 10))
        >>> error.as_dict()["seeds"]
        {'first': 7, 'last': 9}
        """
        result = {name: value for name, value in asdict(self).items() if name != "seeds"}
        result["seeds"] = (None if self.seeds is None or len(self.seeds) == 0
                           else {"first": self.seeds[0], "last": self.seeds[-1]})
        return result


def draw_seeds(seed: int, draws: int) -> range:
    """Int seeds of the ``draws`` independent draws: ``seed, seed + 1, ..., seed + draws - 1``.

    An int seed makes every xattn estimator draw with a portable host generator
    (``numpy.random.default_rng(seed)``, whose seeding hashes the seed, so consecutive
    seeds give independent streams), which gives the same numbers on every backend.

    Parameters
    ----------
    seed : int
        The first seed, >= 0 (a Python or NumPy integer).
    draws : int
        Number of draws, >= 1.

    Returns
    -------
    range
        The seeds, as a :class:`range`: a sequence of Python ints that takes constant
        memory however many draws there are (``tuple(...)`` or ``list(...)`` of it lists
        them).

    Raises
    ------
    TypeError
        ``seed`` or ``draws`` is not an integer (bools included).
    ValueError
        ``seed`` is negative or ``draws`` below 1.

    Examples
    --------
    >>> from xattn.diagnostics import draw_seeds
    >>> draw_seeds(7, 3)
    range(7, 10)
    >>> list(draw_seeds(7, 3))
    [7, 8, 9]
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be a non-negative int, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    draws = check_positive_int(draws, "draws")
    return range(int(seed), int(seed) + draws)


def estimator_error(
    estimator: Callable[..., Array],
    q: Array,
    k: Array,
    v: Array,
    *,
    draws: int = 8,
    seed: int | None = 0,
    rng: Any = None,
    rng_keyword: str | None = "rng",
    exact: Array | None = None,
    **options: Any,
) -> EstimatorError:
    r"""Squared bias, variance and MSE of an attention estimator against exact softmax.

    The estimator is called ``draws`` times, ``estimator(q, k, v, rng=..., **options)``,
    and each output :math:`y^{(r)}` is compared with exact softmax attention :math:`y`
    (:func:`xattn.softmax_attention` with the ``scale``, ``key_mask`` and ``causal``
    found in ``options``):

    .. math::

        \mathrm{MSE} = \frac{1}{RE} \sum_{r,e} (y^{(r)}_e - y_e)^2
        = \underbrace{\frac1E \sum_e (\bar y_e - y_e)^2}_{\text{bias}^2}
        + \underbrace{\frac{1}{RE} \sum_{r,e} (y^{(r)}_e - \bar y_e)^2}_{\text{variance}}

    over the :math:`E` output elements, with :math:`\bar y = \frac1R \sum_r y^{(r)}`.
    Running sums are kept (Welford's update), so memory does not grow with ``draws``. A
    draw with a non-finite output (NaN or inf) makes the figures non-finite (NaN or inf).
    With a ``query_mask`` among the options (:func:`xattn.lara`), only the rows of the
    queries it selects count: masked queries have no defined attention (LARA returns zero
    rows there), so :math:`E` is the number of elements of the valid rows.

    **Seeds.** With an int ``seed`` (the default, 0), draw ``r`` (``r = 0 .. draws-1``)
    calls the estimator with ``rng=seed + r`` (see :func:`draw_seeds`); an int seed draws
    on the host, so the figures are the same on every backend up to floating-point
    rounding, and ``xattn compare --seed S`` reproduces with ``seed=S``. Alternatively
    pass ``rng`` (an :mod:`xattn.random` generator or a native one, converted once with
    :func:`xattn.random.as_generator`); then every draw continues its stream.

    Parameters
    ----------
    estimator : callable
        ``estimator(q, k, v, **options)`` returning an array of shape ``(..., N, Dv)``,
        e.g. :func:`xattn.rfa`, :func:`xattn.ra` or :func:`xattn.lara`.
    q, k, v : arrays, shapes (..., N, D), (..., M, D), (..., M, Dv)
        Attention inputs, in any Array API library.
    draws : int, default 8
        Number of independent draws :math:`R`.
    seed : int or None, default 0
        Base seed of the draws (ignored when ``rng`` is given).
    rng : generator, optional
        A generator to draw every call from, instead of per-draw seeds.
    rng_keyword : str or None, default "rng"
        Keyword through which the estimator receives its randomness; ``None`` for a
        deterministic function that takes none (then all draws are equal).
    exact : array, shape (..., N, Dv), optional
        Precomputed exact softmax attention (saves its computation when the same inputs
        are measured many times).
    **options
        Passed to the estimator (e.g. ``num_features=64``). ``query_mask`` (bool, shape
        broadcastable to ``(..., N)``) also restricts the figures to the valid rows.

    Returns
    -------
    EstimatorError
        ``bias_squared``, ``variance``, ``mse``, ``relative_error`` as Python floats.

    References
    ----------
    Zheng et al., *Linear Complexity Randomized Self-attention Mechanism*, ICML 2022,
    Fig. 1 (MSE of estimators against softmax attention).

    Examples
    --------
    Exact softmax attention itself has zero error:

    >>> import numpy as np
    >>> import xattn
    >>> from xattn.diagnostics import estimator_error
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(2, 16, 8)) for _ in range(3))
    >>> error = estimator_error(xattn.softmax_attention, q, k, v, draws=2, rng_keyword=None)
    >>> error.mse, error.draws
    (0.0, 2)

    A noisy estimator: exact attention plus N(0, 0.1²) noise has variance close to 0.01:

    >>> def noisy(q, k, v, *, rng):
    ...     out = xattn.softmax_attention(q, k, v)
    ...     return out + 0.1 * np.random.default_rng(rng).normal(size=out.shape)
    >>> error = estimator_error(noisy, q, k, v, draws=50, seed=0)
    >>> round(error.variance, 2), list(error.seeds[:3])
    (0.01, [0, 1, 2])
    >>> bool(abs(error.mse - error.bias_squared - error.variance) < 1e-12)
    True
    """
    draws = check_positive_int(draws, "draws")
    if not callable(estimator):
        raise TypeError(f"estimator must be callable, got {type(estimator).__name__}")
    xp = array_namespace(q, k, v, names=("q", "k", "v"))
    if exact is None:
        reference_options = {name: options[name] for name in _REFERENCE_OPTIONS
                             if name in options}
        exact = softmax_attention(q, k, v, **reference_options)

    rngs: Iterable[Any]
    seeds: range | None
    if rng_keyword is None:
        rngs = itertools.repeat(None, draws)
        seeds = None
    elif rng is not None:
        from xattn.random import as_generator

        generator = as_generator(rng)
        rngs = itertools.repeat(generator, draws)
        seeds = None
    else:
        if seed is None:
            raise ValueError("pass an int seed or an rng")
        seeds = draw_seeds(seed, draws)
        rngs = seeds  # a range: the seeds are never all held at once

    mean_residual = None  # running mean over draws of (y_r - y), elementwise
    sum_sq_deviation = None  # running sum over draws of (y_r - mean)^2 (Welford's M2)
    for draw, draw_rng in enumerate(rngs, start=1):
        call_options = dict(options)
        if rng_keyword is not None:
            call_options[rng_keyword] = draw_rng
        out = estimator(q, k, v, **call_options)
        if tuple(out.shape) != tuple(exact.shape):
            raise ValueError(f"the estimator returned shape {tuple(out.shape)}, but exact "
                             f"softmax attention has shape {tuple(exact.shape)}")
        residual = out - exact
        if mean_residual is None:
            mean_residual = residual
            sum_sq_deviation = xp.zeros_like(residual)
        else:
            delta = _difference_or_nan(xp, residual, mean_residual)
            mean_residual = mean_residual + delta / draw
            sum_sq_deviation = sum_sq_deviation + delta * (residual - mean_residual)

    assert mean_residual is not None and sum_sq_deviation is not None  # draws >= 1
    mean = _valid_rows_mean(xp, exact, options.get("query_mask"))
    bias_squared = mean(mean_residual * mean_residual)
    variance = mean(sum_sq_deviation) / draws
    mse = bias_squared + variance
    exact_mean_square = mean(exact * exact)
    return EstimatorError(
        bias_squared=bias_squared,
        variance=variance,
        mse=mse,
        relative_error=_relative(mse, exact_mean_square),
        draws=draws,
        seeds=seeds,
    )


def _difference_or_nan(xp: Any, a: Array, b: Array) -> Array:
    """``a - b`` where both are finite, NaN elsewhere.

    A non-finite output makes the figures non-finite either way; computing the difference
    on finite operands only keeps ``inf - inf`` from raising floating-point warnings
    (NumPy's ``invalid value encountered in subtract``) draw after draw.
    """
    finite = xp.isfinite(a) & xp.isfinite(b)
    zero = xp.zeros_like(a)
    difference = xp.where(finite, a, zero) - xp.where(finite, b, zero)
    return xp.where(finite, difference, xp.full_like(a, math.nan))


def _valid_rows_mean(xp: Any, exact: Array, query_mask: Any) -> Callable[[Array], float]:
    """The mean over output elements, restricted to the rows ``query_mask`` selects."""
    if query_mask is None:
        return lambda values: float(xp.mean(values))
    if getattr(query_mask, "dtype", None) != xp.bool:
        raise TypeError(f"query_mask must be a bool array, got "
                        f"{getattr(query_mask, 'dtype', type(query_mask).__name__)}")
    try:
        valid = xp.broadcast_to(query_mask[..., None], tuple(exact.shape))
    except (ValueError, RuntimeError, TypeError):
        raise ValueError(f"query_mask must have a shape broadcastable to (..., N) = "
                         f"{tuple(exact.shape[:-1])}, got {tuple(query_mask.shape)}") from None
    count = float(xp.sum(xp.astype(valid, exact.dtype)))
    if count == 0:
        raise ValueError("query_mask selects no query: there is no row to score")
    # where, not a product: a masked row may hold anything (NaN * 0 is NaN)
    return lambda values: float(xp.sum(xp.where(valid, values, xp.zeros_like(values)))) / count


def _relative(mse: float, reference_mean_square: float) -> float:
    if reference_mean_square > 0:
        return math.sqrt(mse / reference_mean_square)
    return 0.0 if mse == 0 else math.inf


def uniform_attention(q: Array, k: Array, v: Array, *, key_mask: Array | None = None) -> Array:
    r"""The uniform-attention baseline: every query receives the mean of the values.

    .. math:: y_n = \frac{1}{M} \sum_m v_m

    (over the keys allowed by ``key_mask``). This is attention with every score equal;
    an estimator that does worse than it on some input (random features on the sharp
    attention of pretrained models can) is no better than ignoring the queries.

    Parameters
    ----------
    q : array, shape (..., N, D)
        Queries (only their number and leading dims matter).
    k : array, shape (..., M, D)
        Keys (only validated).
    v : array, shape (..., M, Dv)
        Values.
    key_mask : bool array, shape broadcastable to (..., M), optional
        True where the key takes part; a query without keys gets a zero row.

    Returns
    -------
    array, shape (..., N, Dv)
        In the namespace, device and dtype of the inputs.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.diagnostics import uniform_attention
    >>> v = np.arange(6.0).reshape(3, 2)
    >>> uniform_attention(np.zeros((2, 4)), np.zeros((3, 4)), v)
    array([[2., 3.],
           [2., 3.]])
    """
    inputs = prepare_attention(q, k, v, key_mask=key_mask)
    xp = inputs.xp
    values = inputs.v
    if inputs.key_mask is None:
        mean = xp.mean(values, axis=-2, keepdims=True)
    else:
        weights = xp.astype(inputs.key_mask, values.dtype)[..., None]
        total = xp.sum(weights * values, axis=-2, keepdims=True)
        count = xp.sum(weights, axis=-2, keepdims=True)
        mean = total / nonzero_divisor(xp, count)
    shape = (*inputs.batch_shape, inputs.num_queries, values.shape[-1])
    return inputs.finish(xp.zeros(shape, dtype=values.dtype, device=inputs.device) + mean)


def kernel_mse_positive(x: Array, y: Array, num_features: int) -> Array:
    r"""Closed-form MSE of the positive random-feature estimate of :math:`\exp(x \cdot y)`.

    With :math:`\xi(x, \omega) = \exp(\omega \cdot x - \lVert x \rVert^2 / 2)` and
    :math:`S` iid samples :math:`\omega_s \sim N(0, I)`, the estimate
    :math:`\frac1S \sum_s \xi(x, \omega_s) \xi(y, \omega_s)` is unbiased and

    .. math::

        \mathrm{MSE} = \frac1S \exp(2\, x \cdot y)
        \left(\exp(\lVert x + y \rVert^2) - 1\right)

    (Choromanski et al., *Rethinking Attention with Performers*, ICLR 2021,
    Lemma 2). It grows like :math:`\exp(\lVert x + y\rVert^2)`: large norms make positive
    random features noisy. ``x`` and ``y`` are the *scaled* inputs
    :math:`\hat q, \hat k` when studying attention.

    Parameters
    ----------
    x, y : arrays, shape (..., D)
        Points; leading dims broadcast. Real floating dtype.
    num_features : int
        Number of samples :math:`S` (>= 1).

    Returns
    -------
    array, shape (...)
        In the namespace and dtype of the inputs.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.diagnostics import kernel_mse_positive
    >>> x = np.array([0.5, 0.0])
    >>> y = np.array([0.0, 0.5])
    >>> round(float(kernel_mse_positive(x, y, num_features=1)), 4)  # e^0.5 - 1
    0.6487
    >>> round(float(kernel_mse_positive(x, y, num_features=64)), 5)
    0.01014
    """
    num_features = check_positive_int(num_features, "num_features")
    xp = array_namespace(x, y, names=("x", "y"))
    if x.ndim < 1 or y.ndim < 1 or x.shape[-1] != y.shape[-1]:
        raise ValueError(f"x and y must have shape (..., D) with the same D, got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    dot = xp.sum(x * y, axis=-1)
    total = x + y
    sq_norm = xp.sum(total * total, axis=-1)
    return xp.exp(2.0 * dot) * xp.expm1(sq_norm) / num_features


def structured_attention_inputs(
    *, num_heads: int = 4, length: int = 1024, head_dim: int = 64, num_clusters: int = 16,
    radius: float = 6.0, noise: float = 0.5, shuffled_fraction: float = 0.25, seed: int = 0,
) -> tuple[Any, Any, Any]:
    r"""The default input of ``xattn compare``: deterministic, sharp, structured attention.

    For each of ``num_heads`` heads, ``num_clusters`` cluster centres are drawn as random
    directions of norm ``radius``. Tokens ``0..length-1`` are assigned to clusters in
    contiguous blocks (locality, as in text and image patches), except a
    ``shuffled_fraction`` of them assigned at random. Queries and keys are their
    cluster's centre plus Gaussian noise of standard deviation ``noise`` per coordinate;
    values are standard normal. With the default scale :math:`1/\sqrt{D}` a query's score
    with keys of its own cluster is about :math:`r^2/\sqrt{D} = 4.5` above the others, so
    attention concentrates on the ~1/16 of keys of its cluster: sharp, like the attention
    of pretrained models, where random-feature estimators struggle.

    Parameters
    ----------
    num_heads, length, head_dim, num_clusters : int
        Leading dim, N = M, D = Dv, and the number of clusters.
    radius, noise, shuffled_fraction : float
        Centre norm, per-coordinate noise and fraction of randomly assigned tokens.
    seed : int
        Seed of the NumPy generator (the data are the same on every run).

    Returns
    -------
    q, k, v : numpy.ndarray, float64, shape (num_heads, length, head_dim)
        NumPy arrays; move them to another library with its ``asarray``.

    Examples
    --------
    >>> from xattn.diagnostics import structured_attention_inputs
    >>> q, k, v = structured_attention_inputs(num_heads=2, length=32, head_dim=8)
    >>> q.shape, k.shape, v.shape
    ((2, 32, 8), (2, 32, 8), (2, 32, 8))
    """
    import numpy as np  # host data, the same on every run

    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(num_heads, num_clusters, head_dim))
    centres = radius * directions / np.linalg.norm(directions, axis=-1, keepdims=True)
    block = np.arange(length) * num_clusters // length
    shuffled = rng.random((num_heads, length)) < shuffled_fraction
    cluster = np.where(shuffled, rng.integers(num_clusters, size=(num_heads, length)), block)
    heads = np.arange(num_heads)[:, None]
    q = centres[heads, cluster] + noise * rng.normal(size=(num_heads, length, head_dim))
    k = centres[heads, cluster] + noise * rng.normal(size=(num_heads, length, head_dim))
    v = rng.normal(size=(num_heads, length, head_dim))
    return q, k, v
