"""Per-backend counts of a per-test log written by the test suite (``XATTN_TEST_LOG``).

``tests/conftest.py`` writes one line ``nodeid outcome seconds`` as each test finishes,
so the log holds every finished test even when pytest was stopped at a time limit. This
prints, per GPU backend (the backend named in the test's parameters; ``other`` for the
rest), a pytest-like summary line, then each failed test, whether the run finished, and
the slowest tests (``--slowest``, default 25: what pytest's ``--durations`` lists, also
after a run that was killed)::

    python benchmarks/summarize_test_log.py test_outcomes.txt [pytest_output.txt]

With pytest's output (``-v`` with pytest-xdist prints ``[N items]``), the number of tests
that never reported (still running or not started when the run was stopped) is printed.
``--by-file`` prints instead where the time went: per test file, its tests and seconds,
and the seconds of its JAX and Dask cases (the costly CPU backends), largest first::

    python benchmarks/summarize_test_log.py test_outcomes.txt --by-file
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

GPU_BACKENDS = ("cupy", "torch-cuda", "jax-gpu")
ORDER = ("failed", "error", "passed", "skipped", "xfailed", "xpassed")
_BACKEND = re.compile(r"(?:^|-)(" + "|".join(map(re.escape, GPU_BACKENDS)) + r")(?:-|$)")


def backend_of(nodeid: str) -> str:
    """The GPU backend named in a test id's parameters, else ``other``."""
    if not nodeid.endswith("]") or "[" not in nodeid:
        return "other"
    found = _BACKEND.search(nodeid[nodeid.index("[") + 1:-1])
    return found.group(1) if found else "other"


def summarize(log_text: str, pytest_output: str | None = None, slowest: int = 0) -> str:
    """The report printed by this script, from the texts of the log and pytest's output,
    with the ``slowest`` longest tests."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    seconds: Counter[str] = Counter()
    failures: list[str] = []
    durations: list[tuple[float, str]] = []
    finished = None
    reported = set()
    for line in log_text.splitlines():
        if line.startswith("# finished"):
            finished = line[2:]
            continue
        parts = line.rsplit(" ", 2)
        if line.startswith("#") or len(parts) != 3:
            continue
        nodeid, outcome, duration = parts
        backend = backend_of(nodeid)
        counts[backend][outcome] += 1
        seconds[backend] += float(duration)
        durations.append((float(duration), f"{nodeid} {outcome}"))
        reported.add(nodeid)
        if outcome in ("failed", "error", "xpassed"):
            failures.append(f"{outcome.upper()} {nodeid}")
    lines = []
    for backend in (*GPU_BACKENDS, "other"):
        if backend in counts:
            outcomes = sorted(counts[backend], key=lambda o: (*ORDER, o).index(o))
            lines.append(f"{backend}: " + ", ".join(f"{counts[backend][o]} {o}"
                                                     for o in outcomes)
                         + f" ({seconds[backend]:.1f} s in tests)")
    if not counts:
        lines.append("no test reported")
    lines.extend(failures)
    collected = None
    if pytest_output:
        found = re.findall(r"\[(\d+) items?\]|collected (\d+) items?", pytest_output)
        if found:
            collected = int(found[-1][0] or found[-1][1])
    if collected is not None:
        lines.append(f"{len(reported)} of {collected} collected tests reported; "
                     f"{max(collected - len(reported), 0)} did not finish")
    lines.append(finished or "the run did not finish (stopped before pytest's end)")
    if slowest and durations:
        lines.append(f"slowest {min(slowest, len(durations))} tests (seconds):")
        lines.extend(f"{duration:8.2f} {what}"
                     for duration, what in sorted(durations, reverse=True)[:slowest])
    return "\n".join(lines)


def time_by_file(log_text: str) -> str:
    """A Markdown table: per test file, its tests, the seconds they took (summed over the
    workers), and the seconds of its cases on JAX and on Dask; the largest first."""
    tests: Counter[str] = Counter()
    seconds: dict[str, Counter[str]] = defaultdict(Counter)
    for line in log_text.splitlines():
        parts = line.rsplit(" ", 2)
        if line.startswith("#") or len(parts) != 3:
            continue
        nodeid, _, duration = parts
        path = nodeid.split("::")[0]
        parameters = nodeid[nodeid.index("[") + 1:] if "[" in nodeid else ""
        tests[path] += 1
        seconds[path]["all"] += float(duration)
        for backend in ("jax", "dask"):
            if re.match(rf"{backend}(?:-|\])", parameters) and not parameters.startswith(
                    "jax-gpu"):
                seconds[path][backend] += float(duration)
    total = sum(times["all"] for times in seconds.values())
    lines = ["| file | tests | seconds | share | of which JAX | of which Dask |",
             "|---|---:|---:|---:|---:|---:|"]
    for path in sorted(seconds, key=lambda p: -seconds[p]["all"]):
        times = seconds[path]
        lines.append(f"| `{path}` | {tests[path]} | {times['all']:.0f} | "
                     f"{100 * times['all'] / total:.1f} % | {times['jax']:.0f} | "
                     f"{times['dask']:.0f} |")
    lines.append(f"| all | {sum(tests.values())} | {total:.0f} | 100 % | "
                 f"{sum(t['jax'] for t in seconds.values()):.0f} | "
                 f"{sum(t['dask'] for t in seconds.values()):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the XATTN_TEST_LOG file")
    parser.add_argument("pytest_output", type=Path, nargs="?",
                        help="pytest's output, for the number of tests collected")
    parser.add_argument("--slowest", type=int, default=25, metavar="N")
    parser.add_argument("--by-file", action="store_true",
                        help="where the time went: a table per test file")
    args = parser.parse_args()
    log_text = (args.log.read_text(encoding="utf-8", errors="replace")
                if args.log.exists() else "")
    output = args.pytest_output
    output_text = (output.read_text(encoding="utf-8", errors="replace")
                   if output is not None and output.exists() else None)
    print(time_by_file(log_text) if args.by_file else
          summarize(log_text, output_text, args.slowest))


if __name__ == "__main__":
    main()
