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
    tracker: Tracker | None = None
    taken = 0
    for step in range(steps + 1):
        train, heldout = head_errors(omega, data)
        host = (_host(omega), _host(train), _host(heldout))
        if tracker is None:
            tracker = Tracker(host[0], host[1], host[2], patience)
        elif not tracker.update(step, *host):
            break
        if step == steps:
            break
        optimizer.zero_grad(set_to_none=True)
        train.mean().backward()
        optimizer.step()
        taken = step + 1
    assert tracker is not None
    best = torch.as_tensor(tracker.best, dtype=omega.dtype, device=omega.device)
    return best, tracker.report(taken, time.perf_counter() - tic, data, library)
