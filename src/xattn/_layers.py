"""Framework-independent logic of the attention layers in :mod:`xattn.torch` and
:mod:`xattn.flax`: the estimator registry, option checks, and the train/eval switch."""

from __future__ import annotations

from typing import Any

import xattn
from xattn._array import Array
from xattn.features import sample_omega

__all__ = [
    "DEFAULT_LARA_SAMPLES",
    "ESTIMATORS",
    "attend",
    "check_estimator",
    "draw_features",
]


ESTIMATORS = ("softmax", "rfa", "ra", "lara")
"""Estimator names the layers accept."""

# Options each estimator takes through the layers' ``**estimator_options``. Keywords the
# layer sets itself (masks, causal, rng, omega, the train/eval switches) are not among them.
ESTIMATOR_OPTIONS = {
    "softmax": ("scale", "chunk_size"),
    "rfa": ("num_features", "feature_map", "orthogonal", "sample_norm", "scale",
            "block_size"),
    "ra": ("num_samples", "scale", "chunk_size"),
    "lara": ("num_samples", "proposal", "weighting", "beta", "scale"),
}
# RFA options used when drawing the features rather than when calling the estimator.
FEATURE_OPTIONS = ("num_features", "orthogonal", "sample_norm")

DEFAULT_LARA_SAMPLES = 16
"""Default number of LARA proposals C (capped at the query length)."""


def check_estimator(estimator: Any, options: dict[str, Any], redraw_interval: Any) -> None:
    """Reject an unknown estimator name, options it does not take, or a bad redraw
    interval (a positive int, or None to keep the features until redrawn by hand)."""
    if redraw_interval is not None and (
        isinstance(redraw_interval, bool) or not isinstance(redraw_interval, int)
        or redraw_interval < 1
    ):
        raise ValueError(
            f"redraw_interval must be a positive int or None, got {redraw_interval!r}"
        )
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    allowed = ESTIMATOR_OPTIONS[estimator]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"estimator {estimator!r} does not take the option(s) {unknown}; its options are "
            f"{list(allowed)} (masks, causal mode, rng, omega and the train/eval switches "
            "are set by the layer)"
        )


def draw_features(rng: Any, num_features: int, head_dim: int, options: dict[str, Any], *,
                  xp: Any, dtype: Any, device: Any = None) -> Array:
    """RFA samples ``(num_features, head_dim)`` with the layer's feature options."""
    return sample_omega(rng, num_features, head_dim, xp=xp, dtype=dtype, device=device,
                        orthogonal=options.get("orthogonal", True),
                        norm=options.get("sample_norm", "chi"))


def attend(estimator: str, q: Array, k: Array, v: Array, *, options: dict[str, Any],
           key_mask: Array | None, causal: bool, training: bool, omega: Array | None = None,
           rng: Any = None) -> Array:
    """Run ``estimator`` on per-head inputs ``(..., L, head_dim)``.

    Training mode draws with ``rng``; evaluation mode is deterministic for every
    estimator: RFA uses the fixed ``omega``, RA its biased deterministic form, LARA its
    deterministic form (proposal means as samples).
    """
    if estimator == "softmax":
        return xattn.softmax_attention(q, k, v, key_mask=key_mask, causal=causal, **options)
    if estimator == "rfa":
        call_options = {name: value for name, value in options.items()
                        if name not in FEATURE_OPTIONS}
        return xattn.rfa(q, k, v, omega=omega, key_mask=key_mask, causal=causal,
                         **call_options)
    if estimator == "ra":
        if training:
            return xattn.ra(q, k, v, key_mask=key_mask, causal=causal, rng=rng, **options)
        return xattn.ra(q, k, v, key_mask=key_mask, causal=causal, biased=True,
                        deterministic=True, **options)
    if causal:
        raise ValueError("estimator 'lara' has no causal mode; use 'rfa', 'ra' or "
                         "'softmax' with is_causal=True")
    call_options = dict(options)
    num_samples = min(call_options.pop("num_samples", DEFAULT_LARA_SAMPLES), q.shape[-2])
    if training:
        return xattn.lara(q, k, v, num_samples=num_samples, key_mask=key_mask, rng=rng,
                          **call_options)
    return xattn.lara(q, k, v, num_samples=num_samples, key_mask=key_mask,
                      deterministic=True, **call_options)
