"""PyTorch side of :func:`xattn.calibrate_omega`: Adam (``torch.optim.Adam``) on the
objective of :func:`xattn._integrations.calibration.head_errors`, keeping each head's
best samples on the held-out rows."""

from __future__ import annotations

import time
from typing import Any

import torch

from xattn._integrations.calibration import CalibrationData, CalibrationReport, Tracker, head_errors

__all__ = ["fit"]


def _host(x: torch.Tensor) -> Any:
    return x.detach().cpu().double().numpy()


def fit(data: CalibrationData, *, steps: int, learning_rate: float, patience: int | None,
        library: str) -> tuple[torch.Tensor, CalibrationReport]:
    """Fit ``data.omega`` by ``steps`` Adam steps at most; the best samples per head on
    the held-out rows (never worse than the start) and the report."""
    tic = time.perf_counter()
    omega = data.omega.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([omega], lr=learning_rate)
    count = len(data.batches)
    with torch.no_grad():
        train, heldout = head_errors(omega, data)
    tracker = Tracker(_host(omega), _host(train), _host(heldout), patience)
    taken = 0
    for step in range(steps):
        # one batch per step; the held-out rows of all batches after each pass over them
        train, _ = head_errors(omega, data, [data.batches[step % count]])
        optimizer.zero_grad(set_to_none=True)
        train.mean().backward()
        optimizer.step()
        taken = step + 1
        if taken % count == 0 or taken == steps:
            with torch.no_grad():
                _, heldout = head_errors(omega, data)
            if not tracker.update(taken, _host(omega), _host(heldout)):
                break
    best = torch.as_tensor(tracker.best, dtype=omega.dtype, device=omega.device)
    with torch.no_grad():
        train, _ = head_errors(best, data)
    return best, tracker.report(taken, time.perf_counter() - tic, _host(train), data, library)
