"""The estimators ``xattn compare`` and ``xattn bench`` know, and how to call them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xattn
from xattn._softmax import softmax_attention
from xattn.cli.common import CommandError

__all__ = ["ESTIMATORS", "SOFTMAX", "EstimatorSpec", "estimator_specs"]


@dataclass(frozen=True)
class EstimatorSpec:
    """How ``xattn compare`` / ``xattn bench`` call one estimator.

    Attributes
    ----------
    name : str
        Command-line name (``"rfa"``).
    sample_keyword : str or None
        Keyword that receives the number of samples (``"num_features"`` for RFA,
        ``"num_samples"`` for RA and LARA); ``None`` for exact softmax.
    load : callable
        Returns the estimator function.
    bench_samples : int
        Number of samples used by ``xattn bench`` unless ``--samples`` says otherwise.
    quadratic : bool
        True for estimators whose cost is O(N M S D) (RA): ``xattn compare`` runs them
        only at sample counts up to ``--ra-max-samples``.
    options : dict
        Further keywords passed to the estimator.
    """

    name: str
    sample_keyword: str | None
    load: Callable[[], Callable[..., Any]]
    bench_samples: int = 64
    quadratic: bool = False
    options: dict[str, Any] = field(default_factory=dict)


ESTIMATORS: dict[str, EstimatorSpec] = {
    "rfa": EstimatorSpec("rfa", "num_features", lambda: xattn.rfa, bench_samples=64),
    "ra": EstimatorSpec("ra", "num_samples", lambda: xattn.ra, bench_samples=1,
                        quadratic=True),
    "lara": EstimatorSpec("lara", "num_samples", lambda: xattn.lara, bench_samples=64),
}
SOFTMAX = EstimatorSpec("softmax", None, lambda: softmax_attention)


def estimator_specs(names: Sequence[str], *, allow_softmax: bool = False) -> list[EstimatorSpec]:
    """The specs of ``names`` (raises CommandError for an unknown name)."""
    specs = []
    for name in names:
        if allow_softmax and name == "softmax":
            specs.append(SOFTMAX)
        elif name in ESTIMATORS:
            specs.append(ESTIMATORS[name])
        else:
            known = ", ".join((["softmax"] if allow_softmax else []) + list(ESTIMATORS))
            raise CommandError(f"unknown estimator {name!r}; choose from {known}")
    return specs
