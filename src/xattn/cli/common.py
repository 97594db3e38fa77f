"""What every sub-command shares: the usage-error exception and the output helpers (the
progress bar, the text table, JSON, the output directory); and the trainer module of
``xattn train --framework`` (:func:`load_framework`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import xattn

__all__ = ["DEFAULT_OUT", "EXIT_USAGE", "CommandError", "advance", "environment",
           "format_bytes", "format_table", "load_framework", "output_dir", "progress_bar",
           "write_json"]

#: The ``--out`` directory of every sub-command unless told otherwise.
DEFAULT_OUT = "xattn-out"
EXIT_USAGE = 2


class CommandError(Exception):
    """A problem with the user's input: reported as one line on stderr, exit code 2."""


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool | None, *, unit: str = "run",
                 position: int | None = None) -> Iterator[Any]:
    """A tqdm bar on stderr counting ``unit`` (``enabled`` None: shown on a terminal
    only), or None when ``enabled`` is False or tqdm is missing; ``position``: its line,
    for the bars of parallel runs. The bar closes when the ``with`` block ends."""
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety: run without it
        tqdm = None
    if tqdm is None or enabled is False:
        yield None
        return
    with tqdm(total=total, desc=description, file=sys.stderr, leave=False,
              disable=None if enabled is None else False, unit=unit,
              position=position) as bar:
        yield bar


def advance(bar: Any, label: str) -> None:
    """Advance the progress bar (if any) by one unit, labelled ``label``."""
    if bar is not None:
        bar.set_postfix_str(label, refresh=False)
        bar.update(1)


def load_framework(framework: str, threads: int, *, language_model: bool = False) -> Any:
    """The trainer module of ``--framework`` (:func:`xattn.training.runs.load_framework`),
    a CommandError naming the extra when the framework is not installed."""
    from xattn.training.runs import load_framework as load  # xattn train only

    try:
        return load(framework, threads, language_model=language_model)
    except ImportError as error:
        raise CommandError(f"--framework {framework} needs {error.name or framework}, which "
                           f"is not installed (in the clone of xattn: pip install -e "
                           f"'.[{framework}]')") from None


def format_bytes(value: int | None) -> str:
    """Bytes as MiB with one decimal, ``n/a`` for ``None``."""
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def format_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]], *,
                 rule: bool = True) -> str:
    """A text table: ``columns`` are (header, format spec such as ``"<10"`` or ``">7"``),
    each row one string per column; cells one space apart, a rule of dashes under the
    header if ``rule``.

    The widths are fixed by the caller, not taken from the contents as a table library
    (tabulate, rich) would, so that the tables of the commands line up the same way from
    run to run; for three small tables such a dependency is not worth it.

    Examples
    --------
    >>> from xattn.cli.common import format_table
    >>> print(format_table([("name", "<6"), ("ms", ">5")], [["rfa", "1.25"]]))
    name      ms
    ------------
    rfa     1.25
    """
    def line(cells: Sequence[str]) -> str:
        return " ".join(f"{cell:{spec}}" for cell, (_, spec) in zip(cells, columns, strict=True))

    header = line([name for name, _ in columns])
    return "\n".join([header, *(["-" * len(header)] if rule else []), *map(line, rows)])


def _strict_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN and inf are not JSON
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented, strict JSON (non-finite numbers become ``null``).

    The write is atomic: the text goes to a temporary file in the same directory, which
    then replaces ``path`` (:func:`os.replace`), so a crash or Ctrl-C leaves the old file
    or the new one, never a part of either.
    """
    text = json.dumps(_strict_json(payload), indent=2, allow_nan=False) + "\n"
    temporary = None
    try:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent,
                                         prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False) as file:
            temporary = Path(file.name)
            file.write(text)
        os.replace(temporary, path)
    except OSError as error:
        raise CommandError(f"cannot write {path} ({error.strerror})") from None
    finally:
        if temporary is not None and temporary.exists():
            temporary.unlink()


def environment(backend: Any) -> dict[str, Any]:
    """Versions and platform, for the JSON outputs; with the working memory a block of the
    causal scan may hold on the backend's device (:func:`xattn.default_working_memory`)."""
    return {"xattn": xattn.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "backend": backend.name,
            "backend_version": backend.version, "device": backend.device,
            "working_memory_bytes": xattn.default_working_memory(
                backend.to_backend(np.zeros(1)))}


def output_dir(path: str, files: tuple[str, ...] = ()) -> Path:
    """Create the ``--out`` directory and check that a file can be written in it.

    Called before any work, so that an unwritable ``--out`` costs nothing; raises
    CommandError. ``files`` are the names the command will write in the directory: each
    that exists already must be a regular file it may overwrite (not, for example, a
    directory of that name).
    """
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CommandError(f"--out {path}: cannot create the directory "
                           f"({error.strerror or type(error).__name__})") from None
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise CommandError(f"--out {path}: cannot write in the directory "
                           f"({error.strerror or type(error).__name__})") from None
    for name in files:
        target = out / name
        if target.is_dir():
            raise CommandError(f"--out {path}: cannot write {target}: it is a directory")
        if target.exists() and not target.is_file():
            raise CommandError(f"--out {path}: cannot write {target}: it is not a "
                               "regular file")
        if target.exists() and not os.access(target, os.W_OK):
            raise CommandError(f"--out {path}: cannot write {target}: permission denied")
    return out
