r"""Calibrated random features: the samples :math:`\omega` of ``rfa`` fitted to one
attention layer's own queries, keys and values (attention transfer, every model weight
frozen).

The framework-independent part: the checks, the exact targets, the split into fitted and
held-out rows, the objective (written once against the Array API, so torch and JAX
evaluate the same function), the choice of the best samples per head and the report.
The optimization loops, which need automatic differentiation, are in
:mod:`~xattn._integrations.calibration_torch` (``torch.optim.Adam``) and
:mod:`~xattn._integrations.calibration_jax` (``optax.adam``), imported only when arrays of
their library arrive.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from array_api_compat import device as array_device

from xattn._core.array import array_namespace, library_name
from xattn._core.options import (
    check_bool,
    check_choice,
    check_finite_real,
    check_nonnegative_int,
    check_positive_int,
    check_scale,
    check_window,
)
from xattn._estimators.rfa import rfa
from xattn._estimators.softmax import softmax_attention
from xattn._integrations.calibration_dense import DENSE_FEATURE_MAPS, DENSE_MAX_PAIRS, dense_rfa
from xattn.features import FEATURE_MAPS, SAMPLE_NORMS, sample_omega

__all__ = ["CALIBRATION_LIBRARIES", "Batch", "CalibrationData", "CalibrationReport", "Tracker",
           "calibrate_omega", "head_errors", "prepare"]

#: The array libraries whose automatic differentiation fits the samples, and the module
#: of each that runs the optimization.
CALIBRATION_LIBRARIES = {"torch": "xattn._integrations.calibration_torch",
                         "jax": "xattn._integrations.calibration_jax"}


@dataclass(frozen=True)
class CalibrationReport:
    """What :func:`xattn.calibrate_omega` did, measured on the rows it did not fit.

    Errors are normalized mean squared errors of the attention outputs against exact
    softmax attention: per head, the mean over rows of :math:`\\lVert \\hat y_n - y_n
    \\rVert^2` divided by the head's output variance (the mean of :math:`\\lVert y_n -
    \\bar y \\rVert^2` over all rows), so 1 is the error of returning every row the
    head's mean output; the scalars are means over heads.

    Attributes
    ----------
    heldout_error_before, heldout_error_after : float
        Held-out error of the starting (orthogonal random) samples and of the returned
        ones (never larger: each head keeps the samples of its lowest held-out error).
    train_error_before, train_error_after : float
        The same on the fitted rows (``train_error_after`` at each head's returned
        samples).
    head_errors_before, head_errors_after : tuple of float
        The held-out errors per head (the head dimensions flattened, C order).
    steps : int
        Adam steps taken (fewer than asked if every head stopped improving for
        ``patience`` steps).
    best_steps : tuple of int
        Per head, the step whose samples were returned (0: the start).
    seconds : float
        Wall time of the fit, targets and evaluations included.
    sequences, heldout_sequences : int
        Sequences given, and how many of them were held out (0 when there is a single
        sequence: its query rows are split instead).
    heldout_rows, train_rows : int
        Query rows (per head) in each part.
    library : str
        ``"torch"`` or ``"jax"``.

    Examples
    --------
    >>> import torch
    >>> import xattn
    >>> q = torch.randn(4, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    >>> _, report = xattn.calibrate_omega(q, q, q, num_features=8, steps=3)
    >>> report.sequences, report.heldout_sequences, len(report.head_errors_after)
    (4, 1, 2)
    >>> report.heldout_error_after <= report.heldout_error_before
    True
    """

    heldout_error_before: float
    heldout_error_after: float
    train_error_before: float
    train_error_after: float
    head_errors_before: tuple[float, ...]
    head_errors_after: tuple[float, ...]
    steps: int
    best_steps: tuple[int, ...]
    seconds: float
    sequences: int
    heldout_sequences: int
    heldout_rows: int
    train_rows: int
    library: str

    def to_json(self) -> dict[str, Any]:
        """The report as a dict of plain numbers and lists (for ``json.dump``)."""
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in self.__dict__.items()}


@dataclass
class Batch:
    """One batch of a fit: its inputs, exact outputs and row weights."""

    q: Any
    k: Any
    v: Any
    key_mask: Any
    target: Any  # exact softmax attention
    train: Any  # (*batch, *ones, N) float: 1 on the fitted rows
    heldout: Any  # 1 on the held-out rows


@dataclass
class CalibrationData:
    """The prepared inputs of a fit: the batches with their targets and row weights, the
    normalizers of each part (rows times the head's output variance) and the options of
    the estimator calls."""

    batches: list[Batch]
    head_shape: tuple[int, ...]
    options: dict[str, Any]
    train_norm: Any
    heldout_norm: Any
    sequences: int
    heldout_sequences: int
    train_rows: int
    heldout_rows: int
    omega: Any
    extra: dict[str, Any] = field(default_factory=dict)


def _as_batches(q: Any, k: Any, v: Any, key_mask: Any, query_mask: Any) -> list[tuple]:
    if k is not None or v is not None:
        if k is None or v is None:
            raise TypeError("calibrate_omega takes q, k and v together, or an iterable of "
                            "(q, k, v[, key_mask[, query_mask]]) batches as q alone")
        return [(q, k, v, key_mask, query_mask)]
    if key_mask is not None or query_mask is not None:
        raise TypeError("with an iterable of batches, key_mask and query_mask go inside "
                        "each batch: (q, k, v, key_mask, query_mask)")
    if not isinstance(q, Iterable) or hasattr(q, "shape"):
        raise TypeError("calibrate_omega takes q, k and v arrays, or an iterable of "
                        f"(q, k, v[, key_mask[, query_mask]]) batches as q; got a "
                        f"{type(q).__name__} q without k and v")
    batches = []
    for index, batch in enumerate(q):
        if not isinstance(batch, Sequence) or not 3 <= len(batch) <= 5:
            raise TypeError(f"batch {index} must be a tuple (q, k, v[, key_mask[, "
                            f"query_mask]]), got {type(batch).__name__}")
        batches.append((*batch, *(None,) * (5 - len(batch))))
    if not batches:
        raise ValueError("calibrate_omega needs at least one batch, got an empty iterable")
    return batches


def _library(arrays: list[Any]) -> str:
    names = {library_name(array) for array in arrays if array is not None}
    if len(names) != 1:
        raise TypeError(f"q, k, v and the masks must be arrays of one library, got "
                        f"{sorted(names)}")
    name = names.pop()
    if name not in CALIBRATION_LIBRARIES:
        raise TypeError(f"q must be a torch or JAX array (the fit needs automatic "
                        f"differentiation), got an array of {name!r}")
    return name


def _row_split(shapes: list[tuple[int, int]], holdout: float,
               rng: np.random.Generator) -> tuple[list[np.ndarray], int]:
    """Per batch, a boolean ``(sequences, N)`` array True on the held-out rows: whole
    sequences when there are two or more, else a share of the one sequence's rows."""
    counts = [math.prod(shape[:-1]) for shape in shapes]
    total = sum(counts)
    if total >= 2:
        chosen = rng.permutation(total)[:min(total - 1, max(1, round(holdout * total)))]
        flags = np.zeros(total, dtype=bool)
        flags[chosen] = True
        parts = np.split(flags, np.cumsum(counts)[:-1])
        return [np.repeat(part[:, None], shape[-1], axis=1)
                for part, shape in zip(parts, shapes, strict=True)], len(chosen)
    (shape,) = shapes
    rows = shape[-1]
    if rows < 2:
        raise ValueError("calibrate_omega needs two sequences, or one of two or more "
                         "queries, to hold rows out")
    flags = np.zeros(rows, dtype=bool)
    flags[rng.permutation(rows)[:min(rows - 1, max(1, round(holdout * rows)))]] = True
    return [flags[None]], 0


def prepare(q: Any, k: Any, v: Any, *, key_mask: Any, query_mask: Any, num_features: int,
            feature_map: str, window: Any, sinks: Any, causal: bool, scale: Any,
            holdout: float, head_dims: int, seed: int, omega: Any, orthogonal: bool,
            sample_norm: str) -> tuple[str, CalibrationData]:
    """Check the inputs and options, compute the exact targets and split the rows (the
    caller's library computes them without gradients)."""
    raw = _as_batches(q, k, v, key_mask, query_mask)
    library = _library([array for batch in raw for array in batch] + [omega])
    head_dims = check_positive_int(head_dims, "head_dims")
    first = raw[0][0]
    if first.ndim < head_dims + 2:
        raise ValueError(f"q must have shape (..., {'H, ' * head_dims}N, D), got "
                         f"{tuple(first.shape)}")
    head_shape = tuple(first.shape[-2 - head_dims:-2])
    dim = first.shape[-1]
    xp = array_namespace(first)
    options: dict[str, Any] = {
        "feature_map": check_choice(feature_map, "feature_map", FEATURE_MAPS),
        "causal": check_bool(causal, "causal"), "scale": check_scale(scale, dim)}
    window, sinks = check_window(window, sinks, None)
    options.update(window=window or None, sinks=sinks or None)
    shapes: list[tuple[int, int]] = []
    prepared = []
    for index, (bq, bk, bv, bkey, bquery) in enumerate(raw):
        if bq.ndim != first.ndim or tuple(bq.shape[-2 - head_dims:-2]) != head_shape \
                or bq.shape[-1] != dim:
            raise ValueError(f"every batch's q must have shape (..., {head_shape}, N, {dim})"
                             f" with {first.ndim - 2 - head_dims} batch dimensions; batch "
                             f"{index} has {tuple(bq.shape)}")
        lead = tuple(bq.shape[:-2])
        rows_shape = (*lead[:len(lead) - head_dims], *(1,) * head_dims, bq.shape[-2])
        if bkey is not None:
            bkey = xp.broadcast_to(bkey, (*lead, bk.shape[-2]))
        valid = (xp.ones(rows_shape, dtype=first.dtype, device=array_device(first))
                 if bquery is None else
                 xp.astype(xp.broadcast_to(bquery, rows_shape), first.dtype))
        target = softmax_attention(bq, bk, bv, scale=options["scale"], key_mask=bkey,
                                   causal=options["causal"])
        prepared.append((bq, bk, bv, bkey, target, valid))
        shapes.append((math.prod(rows_shape[:len(lead) - head_dims]), bq.shape[-2]))
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    held, heldout_sequences = _row_split(shapes, holdout, rng)
    batches, sums, squares, counts = [], 0.0, 0.0, [0.0, 0.0]
    for (bq, bk, bv, bkey, target, valid), out in zip(prepared, held, strict=True):
        out = xp.asarray(out.reshape(valid.shape), dtype=valid.dtype, device=array_device(valid))
        fit, test = valid * (1 - out), valid * out
        counts[0] += float(xp.sum(fit))
        counts[1] += float(xp.sum(test))
        axes = (*range(bq.ndim - 2 - head_dims), bq.ndim - 2)
        sums = sums + xp.sum(target * valid[..., None], axis=axes)
        squares = squares + xp.sum(xp.sum(target * target, axis=-1) * valid, axis=axes)
        batches.append(Batch(bq, bk, bv, bkey, target, fit, test))
    if min(counts) == 0:
        raise ValueError("query_mask leaves no row to fit or none to hold out")
    total = counts[0] + counts[1]
    # per head: the mean squared distance of the outputs to their mean (the variance)
    variance = squares / total - xp.sum(sums * sums, axis=-1) / total ** 2
    variance = xp.where(variance > 0, variance, xp.ones_like(variance))
    omega = _start(xp, omega, head_shape, num_features, dim, seed, orthogonal, sample_norm,
                   dtype=first.dtype, device=array_device(first))
    data = CalibrationData(batches, head_shape, options, variance * counts[0],
                           variance * counts[1], sum(shape[0] for shape in shapes),
                           heldout_sequences, round(counts[0]), round(counts[1]), omega)
    return library, data


def _start(xp: Any, omega: Any, head_shape: tuple[int, ...], num_features: int, dim: int,
           seed: int, orthogonal: bool, norm: str, *, dtype: Any, device: Any) -> Any:
    """The starting samples ``(*head_shape, S, D)``: the caller's, or one orthogonal draw
    per head from the integer seeds ``SeedSequence([seed, head])`` (the same on every
    backend)."""
    if omega is not None:
        if tuple(omega.shape) != (*head_shape, num_features, dim):
            raise ValueError(f"omega must have shape {(*head_shape, num_features, dim)} "
                             f"(heads, num_features, D), got {tuple(omega.shape)}")
        if not bool(xp.all(xp.isfinite(omega))):
            raise ValueError("omega must be finite")
        return xp.asarray(omega, dtype=dtype, copy=True)
    heads = math.prod(head_shape)
    draws = [sample_omega(int(np.random.SeedSequence([seed, head]).generate_state(1)[0]),
                          num_features, dim, xp=xp, dtype=dtype, device=device,
                          orthogonal=orthogonal, norm=norm) for head in range(heads)]
    return xp.reshape(xp.stack(draws), (*head_shape, num_features, dim))


def _estimate(batch: Batch, omega: Any, options: dict[str, Any]) -> Any:
    """``rfa`` of the batch with one sample matrix per head (``omega``'s leading
    dimensions broadcast against the batch's); formed densely where that is equal and
    faster (:mod:`~xattn._integrations.calibration_dense`)."""
    if (options["feature_map"] in DENSE_FEATURE_MAPS
            and batch.q.shape[-2] * batch.k.shape[-2] <= DENSE_MAX_PAIRS):
        return dense_rfa(batch.q, batch.k, batch.v, omega, key_mask=batch.key_mask,
                         **options)
    return rfa(batch.q, batch.k, batch.v, omega=omega, key_mask=batch.key_mask, **options)


def head_errors(omega: Any, data: CalibrationData,
                batches: list[Batch] | None = None) -> tuple[Any, Any]:
    """The objective: per head, the normalized squared error of ``rfa`` with ``omega``
    against exact attention on the fitted rows and on the held-out rows (arrays of the
    head shape; one estimator call per batch serves both), summed over ``batches``
    (default all: with fewer, the sums of those batches over the normalizers of all)."""
    xp = array_namespace(omega)
    head_dims = len(data.head_shape)
    train = heldout = 0.0
    for batch in data.batches if batches is None else batches:
        out = _estimate(batch, omega, data.options)
        error = xp.sum((out - batch.target) ** 2, axis=-1)
        axes = (*range(error.ndim - 1 - head_dims), error.ndim - 1)
        train = train + xp.sum(error * batch.train, axis=axes)
        heldout = heldout + xp.sum(error * batch.heldout, axis=axes)
    return train / data.train_norm, heldout / data.heldout_norm


class Tracker:
    """The best samples of each head on the held-out rows, and early stopping: the fit
    stops when no head has improved for ``patience`` steps."""

    def __init__(self, omega: np.ndarray, train: np.ndarray, heldout: np.ndarray,
                 patience: int | None) -> None:
        self.best, self.train_before, self.heldout_before = omega, train, heldout
        self.best_heldout = heldout.copy()
        self.best_steps = np.zeros(heldout.shape, dtype=int)
        self.patience = patience
        self.last_improvement = 0

    def update(self, step: int, omega: np.ndarray, heldout: np.ndarray) -> bool:
        """Record the samples after ``step`` steps; whether to go on."""
        better = heldout < self.best_heldout
        if better.any():
            self.last_improvement = step
            self.best = np.where(better[..., None, None], omega, self.best)
            self.best_heldout = np.where(better, heldout, self.best_heldout)
            self.best_steps = np.where(better, step, self.best_steps)
        return self.patience is None or step - self.last_improvement < self.patience

    def report(self, steps: int, seconds: float, train_after: np.ndarray,
               data: CalibrationData, library: str) -> CalibrationReport:
        return CalibrationReport(
            heldout_error_before=float(self.heldout_before.mean()),
            heldout_error_after=float(self.best_heldout.mean()),
            train_error_before=float(self.train_before.mean()),
            train_error_after=float(train_after.mean()),
            head_errors_before=tuple(float(x) for x in self.heldout_before.ravel()),
            head_errors_after=tuple(float(x) for x in self.best_heldout.ravel()),
            steps=steps, best_steps=tuple(int(x) for x in self.best_steps.ravel()),
            seconds=seconds, sequences=data.sequences,
            heldout_sequences=data.heldout_sequences, heldout_rows=data.heldout_rows,
            train_rows=data.train_rows, library=library)


def calibrate_omega(q: Any, k: Any = None, v: Any = None, *, num_features: int,
                    feature_map: str = "positive", window: int | None = None,
                    sinks: int | None = None, causal: bool = False,
                    scale: float | None = None, key_mask: Any = None,
                    query_mask: Any = None, steps: int = 300, learning_rate: float = 1e-2,
                    holdout: float = 0.25, patience: int | None = 50, head_dims: int = 1,
                    seed: int = 0, omega: Any = None, orthogonal: bool = True,
                    sample_norm: str = "chi") -> tuple[Any, CalibrationReport]:
    r"""Fit the samples :math:`\omega` of :func:`xattn.rfa` to one attention layer's own
    queries, keys and values: a fitted feature map per head.

    Minimizes the squared error of ``rfa``'s outputs (with the given ``num_features``,
    ``feature_map``, ``window``, ``sinks``, ``causal`` and ``scale``, as at inference)
    against exact softmax attention on the same inputs, normalized per head by the
    head's output variance, by Adam on :math:`\omega` alone (attention transfer: the
    model that produced ``q``, ``k``, ``v`` stays frozen). The start is one orthogonal
    random draw per head (the samples the layer would use otherwise), and each head
    returns the samples of its lowest error on **held-out rows** seen during the fit, so
    the result is never worse than the start there; the fit stops early when no head has
    improved on them for ``patience`` steps. The held-out rows are a share ``holdout`` of
    the sequences (of all batches; of the query rows when there is a single sequence).

    Fitted samples are no longer a draw from :math:`N(0, I)`: the estimator becomes a
    deterministic feature map tuned to these inputs, not an unbiased estimate of softmax
    attention over the draw (see :doc:`/theory/01_random_features`).

    Parameters
    ----------
    q : array, shape (..., H, N, D), or an iterable of batches
        Queries of the layer (torch or JAX: the fit needs automatic differentiation);
        the leading dimensions before the last ``head_dims + 2`` are sequences (batch).
        Or, with ``k`` and ``v`` left out, an iterable of ``(q, k, v)``, ``(q, k, v,
        key_mask)`` or ``(q, k, v, key_mask, query_mask)`` batches of the same head shape
        and D (lengths may differ), all fitted together.
    k : array, shape (..., H, M, D)
    v : array, shape (..., H, M, Dv)
    num_features : int
        S, the samples per head.
    feature_map : {"positive", "hyperbolic", "trigonometric"}
        As in :func:`xattn.rfa` (default ``"positive"``).
    window, sinks : int, optional
        The exact band and sink keys of :func:`xattn.rfa`; fit with those used at
        inference (the features then only model the keys outside them).
    causal : bool
        Causal attention (default False).
    scale : float, optional
        As in :func:`xattn.rfa` (default :math:`1/\sqrt{D}`).
    key_mask : array of bool, broadcastable to (..., H, M), optional
        True where the key takes part (padding excluded).
    query_mask : array of bool, broadcastable to (..., 1, N), optional
        True on the query rows that count in the error (e.g. the non-padding tokens).
    steps : int
        Adam steps at most (default 300; 0 returns the start and its errors).
    learning_rate : float
        Adam's step size (default 1e-2).
    holdout : float
        The share of sequences (or of rows) held out, in (0, 1) (default 0.25).
    patience : int or None
        Stop when no head's held-out error has improved for this many steps (default
        50; None: run every step).
    head_dims : int
        How many dimensions before ``N`` get their own samples (default 1: ``H``; 2 fits
        ``(L, H)`` samples to queries of shape ``(..., L, H, N, D)``, several layers in
        one call).
    seed : int
        Seed of the starting draw (head ``h`` draws from ``SeedSequence([seed, h])``, the
        same on every backend) and of the held-out split (default 0).
    omega : array, shape (heads..., S, D), optional
        Start from these samples instead of a random draw.
    orthogonal, sample_norm
        The starting draw's options (:func:`xattn.features.sample_omega`).

    Returns
    -------
    omega : array, shape (heads..., S, D)
        The fitted samples, in the library, dtype and on the device of ``q``; pass them
        as ``rfa(..., omega=omega)`` (they broadcast against the leading dimensions of
        ``q``).
    report : CalibrationReport
        Errors before and after on the held-out and fitted rows, steps, time.

    Raises
    ------
    TypeError
        Arrays of a library other than torch or JAX, or of different libraries; ``k``
        without ``v``; a batch that is not a tuple.
    ValueError
        Shapes that differ between batches, an ``omega`` of the wrong shape or not
        finite, an option out of range (``num_features`` < 1, ``holdout`` outside (0, 1),
        a negative ``steps``, ...), nothing to hold out.

    See Also
    --------
    xattn.transformers.calibrate : Calibrate every attention layer of a Hugging Face
        model.

    References
    ----------
    .. [1] M. Zhang, K. Bhatia, H. Kumbong, C. Ré, "The Hedgehog & the Porcupine:
       Expressive linear attentions with softmax mimicry", ICLR 2024.
    .. [2] M. Zhang, S. Arora, R. Chalamala, et al., "LoLCATs: On low-rank linearizing of
       large language models", 2024.

    Examples
    --------
    >>> import torch
    >>> import xattn
    >>> g = torch.Generator().manual_seed(0)
    >>> shift = 2 * torch.randn(1, 2, 1, 16, generator=g)  # heads with a preferred direction
    >>> q = torch.randn(8, 2, 32, 16, generator=g) + shift
    >>> k = torch.randn(8, 2, 32, 16, generator=g) + shift
    >>> v = torch.randn(8, 2, 32, 16, generator=g)
    >>> omega, report = xattn.calibrate_omega(q, k, v, num_features=16, steps=60)
    >>> omega.shape
    torch.Size([2, 16, 16])
    >>> report.heldout_error_after < report.heldout_error_before
    True
    >>> out = xattn.rfa(q, k, v, omega=omega)  # one (S, D) matrix per head
    """
    num_features = check_positive_int(num_features, "num_features")
    steps = check_nonnegative_int(steps, "steps")
    learning_rate = check_finite_real(learning_rate, "learning_rate")
    if learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    holdout = check_finite_real(holdout, "holdout")
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    if patience is not None:
        patience = check_positive_int(patience, "patience")
    seed = check_nonnegative_int(seed, "seed")
    orthogonal = check_bool(orthogonal, "orthogonal")
    sample_norm = check_choice(sample_norm, "sample_norm", SAMPLE_NORMS)
    library, data = prepare(
        q, k, v, key_mask=key_mask, query_mask=query_mask, num_features=num_features,
        feature_map=feature_map, window=window, sinks=sinks, causal=causal, scale=scale,
        holdout=holdout, head_dims=head_dims, seed=seed, omega=omega,
        orthogonal=orthogonal, sample_norm=sample_norm)
    backend = importlib.import_module(CALIBRATION_LIBRARIES[library])
    return backend.fit(data, steps=steps, learning_rate=learning_rate, patience=patience,
                       library=library)
