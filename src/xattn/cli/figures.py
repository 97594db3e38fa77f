"""Figures on Matplotlib's Agg canvas, without pyplot state (also used by ``benchmarks/``)."""

from __future__ import annotations

from typing import Any

from xattn.cli.common import CommandError

__all__ = ["loglog_axes", "new_figure", "save_figure"]


def new_figure(ncols: int = 1, width: float = 6.4, height: float = 4.4) -> tuple[Any, Any]:
    """A Matplotlib figure on the Agg canvas with ``ncols`` axes (no pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CommandError("writing the PNG needs matplotlib (in the clone of xattn: "
                           "pip install -e '.[cli]')") from None
    figure = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, ncols)
    return figure, axes


def save_figure(figure: Any, path: Any, dpi: int = 120) -> None:
    """Save ``figure`` as PNG (raises CommandError when the file cannot be written)."""
    try:
        figure.savefig(path, dpi=dpi)
    except OSError as error:
        raise CommandError(f"cannot write {path} ({error.strerror})") from None


def loglog_axes(axes: Any, xlabel: str, ylabel: str, *, xbase: int = 2) -> None:
    """Log-log scales, labels and a light grid."""
    axes.set_xscale("log", base=xbase)
    axes.set_yscale("log")
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, which="both", alpha=0.3)
