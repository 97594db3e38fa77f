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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the XATTN_TEST_LOG file")
    parser.add_argument("pytest_output", type=Path, nargs="?",
                        help="pytest's output, for the number of tests collected")
    parser.add_argument("--slowest", type=int, default=25, metavar="N")
    args = parser.parse_args()
    log_text = (args.log.read_text(encoding="utf-8", errors="replace")
                if args.log.exists() else "")
    output = args.pytest_output
    output_text = (output.read_text(encoding="utf-8", errors="replace")
                   if output is not None and output.exists() else None)
    print(summarize(log_text, output_text, args.slowest))


if __name__ == "__main__":
    main()
