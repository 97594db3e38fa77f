"""JAX side of :func:`xattn.calibrate_omega`: Adam (``optax.adam``) on the objective of
:func:`xattn._integrations.calibration.head_errors`, one jitted step, keeping each
head's best samples on the held-out rows."""

from __future__ import annotations

import time
from dataclasses import fields, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xattn._integrations.calibration import (
    Batch,
    CalibrationData,
    CalibrationReport,
    Tracker,
    head_errors,
)

__all__ = ["fit"]


def _optax() -> Any:
    try:
        import optax
    except ImportError:  # pragma: no cover - optax ships with the flax extra
        raise ImportError("calibrate_omega on JAX arrays needs optax (pip install optax, or "
                          "the xattn[flax] extra)") from None
    return optax


def fit(data: CalibrationData, *, steps: int, learning_rate: float, patience: int | None,
        library: str) -> tuple[Any, CalibrationReport]:
    """Fit ``data.omega`` by ``steps`` Adam steps at most; the best samples per head on
    the held-out rows (never worse than the start) and the report."""
    tic = time.perf_counter()
    optimizer = _optax().adam(learning_rate)

    # the arrays are arguments of the jitted functions, not constants folded into them
    arrays = [tuple(getattr(batch, f.name) for f in fields(batch)) for batch in data.batches]
    norms = (data.train_norm, data.heldout_norm)

    def errors(omega: Any, batches: Any, norms: Any) -> tuple[Any, Any]:
        return head_errors(omega, replace(data, batches=[Batch(*b) for b in batches],
                                          train_norm=norms[0], heldout_norm=norms[1]))

    def objective(omega: Any, batch: Any, norms: Any) -> Any:
        return jnp.mean(errors(omega, [batch], norms)[0])

    @jax.jit
    def step(omega: Any, state: Any, batch: Any, norms: Any) -> tuple[Any, Any]:
        grad = jax.grad(objective)(omega, batch, norms)
        updates, state = optimizer.update(grad, state, omega)
        return omega + updates, state

    evaluate = jax.jit(errors)

    def host(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)

    omega = data.omega
    state = optimizer.init(omega)
    train, heldout = evaluate(omega, arrays, norms)
    tracker = Tracker(host(omega), host(train), host(heldout), patience)
    taken = 0
    for index in range(steps):
        # one batch per step; the held-out rows of all batches after each pass over them
        omega, state = step(omega, state, arrays[index % len(arrays)], norms)
        taken = index + 1
        if taken % len(arrays) == 0 or taken == steps:
            _, heldout = evaluate(omega, arrays, norms)
            if not tracker.update(taken, host(omega), host(heldout)):
                break
    best = jnp.asarray(tracker.best, dtype=data.omega.dtype)
    train, _ = evaluate(best, arrays, norms)
    return best, tracker.report(taken, time.perf_counter() - tic, host(train), data, library)
