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
    arrays = ([tuple(getattr(batch, f.name) for f in fields(batch))
               for batch in data.batches], data.train_norm, data.heldout_norm)

    def errors(omega: Any, arrays: Any) -> tuple[Any, Any]:
        batches, train_norm, heldout_norm = arrays
        return head_errors(omega, replace(data, batches=[Batch(*b) for b in batches],
                                          train_norm=train_norm, heldout_norm=heldout_norm))

    def objective(omega: Any, arrays: Any) -> tuple[Any, tuple[Any, Any]]:
        train, heldout = errors(omega, arrays)
        return jnp.mean(train), (train, heldout)

    @jax.jit
    def step(omega: Any, state: Any, arrays: Any) -> tuple[Any, Any, Any, Any]:
        (_, (train, heldout)), grad = jax.value_and_grad(objective, has_aux=True)(omega,
                                                                                  arrays)
        updates, state = optimizer.update(grad, state, omega)
        return omega + updates, state, train, heldout

    evaluate = jax.jit(errors)
    omega = data.omega
    state = optimizer.init(omega)
    tracker: Tracker | None = None
    taken = 0
    for index in range(steps + 1):
        if index == steps:
            train, heldout = evaluate(omega, arrays)
            new_omega = omega
        else:
            new_omega, state, train, heldout = step(omega, state, arrays)
        host = (np.asarray(omega, dtype=np.float64), np.asarray(train, dtype=np.float64),
                np.asarray(heldout, dtype=np.float64))
        if tracker is None:
            tracker = Tracker(*host, patience)
        elif not tracker.update(index, *host):
            break
        if index == steps:
            break
        omega = new_omega
        taken = index + 1
    assert tracker is not None
    return jnp.asarray(tracker.best, dtype=data.omega.dtype), tracker.report(
        taken, time.perf_counter() - tic, data, library)
