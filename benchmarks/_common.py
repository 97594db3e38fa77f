"""Helpers the benchmark scripts share: best-of timings, the resident-memory peak and the
log-log slope. (Backends, the measured calls of ``xattn bench`` and the peak memory of a
call on each backend are the command's own, in :mod:`xattn.cli.measure`.)

The scripts run as ``python benchmarks/<group>/<script>.py`` and put this folder
(``benchmarks/``) on ``sys.path`` before ``from _common import ...``, which then finds this
module.
"""

from __future__ import annotations

import gc
import math
import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["best_time", "interleaved_best_times", "interleaved_best_wall_and_cpu_times",
           "loglog_slope", "rss_peak"]


def best_time(call: Callable[[], Any], repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``call()`` after one warm-up call."""
    call()
    return min(timeit.repeat(call, repeat=repeats, number=1))


def interleaved_best_times(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Best wall time of each call over ``repeats`` rounds, after one warm-up call each.

    Rounds interleave the calls (one call of each per round), so that a change of load
    on a shared machine affects all of them alike instead of whichever ran at the time.
    """
    best = interleaved_best_wall_and_cpu_times(calls, repeats)
    return {name: times["wall_s"] for name, times in best.items()}


def interleaved_best_wall_and_cpu_times(
    calls: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, dict[str, float]]:
    """Best wall time and best CPU time of each call over ``repeats`` interleaved rounds.

    As :func:`interleaved_best_times`, and also the CPU time of this process
    (:func:`time.process_time`), which leaves out the time the process waited for a core:
    on a loaded shared machine, and a library on one thread, it is the steadier figure.
    (Not :mod:`timeit`: it repeats one statement back to back, on one clock.)

    Returns
    -------
    dict
        ``{name: {"wall_s": best wall time, "cpu_s": best CPU time}}``, in seconds.

    Examples
    --------
    >>> times = interleaved_best_wall_and_cpu_times({"sum": lambda: sum(range(1000))}, 3)
    >>> sorted(times["sum"])
    ['cpu_s', 'wall_s']
    """
    for call in calls.values():
        call()  # warm-up
    best = {name: {"wall_s": math.inf, "cpu_s": math.inf} for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            wall, cpu = time.perf_counter(), time.process_time()
            call()
            best[name]["cpu_s"] = min(best[name]["cpu_s"], time.process_time() - cpu)
            best[name]["wall_s"] = min(best[name]["wall_s"], time.perf_counter() - wall)
    return best


def _proc_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # Linux: reset VmHWM to the current resident size
        return True
    except OSError:
        return False


def rss_peak(run: Callable[[], Any]) -> tuple[Any, int | None]:
    """``run()`` and the growth of the resident high-water mark during it (Linux).

    Counts every page the call touched, whatever allocated it (torch's CPU allocator,
    BLAS workspaces); resolution is a page, noise a few MB. ``None`` where
    ``/proc/self/clear_refs`` is unavailable.
    """
    gc.collect()
    if not _reset_high_water_mark() or _proc_status_kib("VmHWM") is None:
        return run(), None
    before = _proc_status_kib("VmRSS")
    _reset_high_water_mark()
    result = run()
    high_water = _proc_status_kib("VmHWM")
    if before is None or high_water is None:
        return result, None
    return result, max(high_water - before, 0) * 1024


def loglog_slope(lengths: Sequence[float], values: Sequence[float | None]) -> float | None:
    """Least-squares slope of log(value) against log(length) (1: linear); ``None`` with
    fewer than two positive values.

    Examples
    --------
    >>> round(loglog_slope([1, 2, 4], [3.0, 12.0, 48.0]), 6)
    2.0
    """
    points = [(math.log(n), math.log(t)) for n, t in zip(lengths, values, strict=True)
              if t is not None and t > 0]
    if len(points) < 2:
        return None
    x, y = np.array(points).T
    return float(np.polyfit(x, y, 1)[0])
