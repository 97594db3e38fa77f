"""Peak memory of a PyTorch training step, as ``xattn bench`` measures it on torch: the
CPU allocator's peak through :mod:`torch.profiler`, or CUDA's peak counter. Torch is
imported inside the functions only (:mod:`xattn.cli.measure` uses these for its torch
backend too)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["TORCH_MEMORY_METHODS", "TorchMemory", "allocator_peak", "native_stderr_silenced",
           "torch_cpu_peak", "torch_memory"]

#: How :meth:`TorchMemory.peak_memory` measures, by device type (written to the JSON).
TORCH_MEMORY_METHODS = {
    "cuda": "torch.cuda.max_memory_allocated above the level before the call",
    "cpu": "torch.profiler (profile_memory=True): peak of torch's CPU allocator above the "
           "level before the call",
}


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Silence file descriptor 2 (the torch profiler's native start/stop log lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocator_peak(trace_events: list[dict[str, Any]]) -> int:
    """Peak of the CPU allocator's total above its level before the first event.

    ``trace_events`` are the events of a Chrome trace written by :mod:`torch.profiler`
    with ``profile_memory=True``: each ``[memory]`` event carries the bytes allocated
    (freed, if negative) and the allocator's ``Total Allocated`` after it.

    Examples
    --------
    >>> from xattn.training.peak import allocator_peak
    >>> def event(ts, size, total):
    ...     return {"name": "[memory]", "ts": ts,
    ...             "args": {"Bytes": size, "Total Allocated": total, "Device Type": 0}}
    >>> allocator_peak([event(2, -8, 92), event(1, 100, 100), event(3, 50, 142)])
    142
    """
    memory = sorted((event for event in trace_events if event.get("name") == "[memory]"
                     and event.get("args", {}).get("Device Type", 0) == 0),
                    key=lambda event: float(event["ts"]))
    if not memory:
        return 0
    first = memory[0]["args"]
    baseline = first["Total Allocated"] - first["Bytes"]
    return max(max(event["args"]["Total Allocated"] for event in memory) - baseline, 0)


def torch_cpu_peak(run: Callable[[], Any]) -> tuple[Any, int | None]:
    """``run()`` under :mod:`torch.profiler` with ``profile_memory=True``: the peak of
    the bytes torch's CPU allocator holds during the call, above the level before it."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with native_stderr_silenced():
        profiler.start()
    try:
        result = run()
    finally:
        with native_stderr_silenced():
            profiler.stop()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace).get("traceEvents", [])
    return result, allocator_peak(events)


@dataclass(frozen=True)
class TorchMemory:
    """A torch device (``"cpu"`` or ``"cuda:0"``) and how a call's peak memory is read
    on it (:attr:`memory_method`)."""

    device: str

    @property
    def memory_method(self) -> str:
        return TORCH_MEMORY_METHODS["cuda" if self.device.startswith("cuda") else "cpu"]

    def peak_memory(self, run: Callable[[], Any]) -> tuple[Any, int | None]:
        """``run()`` and its peak memory in bytes above the level before the call."""
        if not self.device.startswith("cuda"):
            return torch_cpu_peak(run)
        import torch

        device = torch.device(self.device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        result = run()
        return result, int(torch.cuda.max_memory_allocated(device) - baseline)


def torch_memory(device: str) -> TorchMemory:
    """The :class:`TorchMemory` of ``device`` (``"cpu"`` or ``"cuda"``).

    Raises
    ------
    ValueError
        ``device`` is ``"cuda"`` and torch sees no CUDA device.
    """
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA device")
    return TorchMemory("cuda:0" if device == "cuda" else "cpu")
