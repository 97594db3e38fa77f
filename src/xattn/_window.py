r"""Windowed RFA: an exact local band and attention sinks, random features for the rest.

For query :math:`n` the keys split into an exact set :math:`E_n` and the rest
:math:`R_n`:

.. math::

    E_n = \{m : |n - m| \le w\} \cup \{m : m < K\}, \qquad
    y_n = \frac{\sum_{m \in E_n} e^{\hat q_n \cdot \hat k_m} v_m
                + \sum_{m \in R_n} \hat\kappa(\hat q_n, \hat k_m) v_m}
               {\sum_{m \in E_n} e^{\hat q_n \cdot \hat k_m}
                + \sum_{m \in R_n} \hat\kappa(\hat q_n, \hat k_m)}

with :math:`w` = ``window``, :math:`K` = ``sinks`` and :math:`\hat\kappa` the
random-feature estimate of :math:`e^{\hat q \cdot \hat k}` (an unbiased one for the
positive, hyperbolic and trigonometric maps), restricted to allowed keys (``key_mask``;
``causal``: :math:`m \le n`, so the band becomes :math:`n - w \le m \le n`). This is the
sparse + low-rank split of Scatterbrain (Chen et al., NeurIPS 2021) with the attention
sinks of Xiao et al. (2023).

Nothing is counted twice and nothing is subtracted: :math:`R_n` is the union of the keys
:math:`m \le n - w - 1` and :math:`m \ge n + w + 1` (:math:`m \ge K`), whose random-feature
sums are prefix and suffix sums computed directly (:func:`xattn._rf_scan.scan_partials`
with offset :math:`w + 1`), never totals minus band terms. The band is computed in blocks
of queries against the keys within :math:`w` of the block (memory
``O(block_size * (block_size + 2w + K))``, never an ``N x M`` mask). The exact and the
random-feature parts are combined with one shift per query, the largest log-term of
either, without an epsilon.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import array_api_compat

from xattn._array import Array, AttentionInputs
from xattn._primitives import finite_shift
from xattn._rf_scan import (
    Partial,
    combine_partials,
    finish_partial,
    finite_rows,
    scan_partials,
    state_over_keys,
    value_columns,
)

__all__ = ["check_window", "windowed_rfa"]


def _check_count(value: Any, name: str) -> int:
    """``value`` as an int if it is an integer >= 0 (bools are not), else raise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= 0, got {type(value).__name__} "
                        f"{value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_window(window: Any, sinks: Any, num_keys: int) -> tuple[int, int]:
    """Validate ``window`` (None or an int >= 0; 0 and None mean no band) and ``sinks``
    (an int, 0 <= sinks <= M); returns them as ints."""
    window = 0 if window is None else _check_count(window, "window")
    sinks = _check_count(sinks, "sinks")
    if sinks > num_keys:
        raise ValueError(f"sinks must be <= M = {num_keys} (the number of keys), got {sinks}")
    return window, sinks


def _exact_partial(xp: Any, inputs: AttentionInputs, start: int, stop: int, window: int,
                   sinks: int, causal: bool) -> Partial | None:
    """Exact sums of queries ``start:stop`` over their band and sink keys (None if none)."""
    k, v, key_mask = inputs.k, inputs.v, inputs.key_mask
    num_keys = k.shape[-2]
    device = array_api_compat.device(k)
    if window:
        low, high = max(0, start - window), min(num_keys, (stop if causal else stop + window))
        low = min(low, high)
    else:
        low = high = min(sinks, num_keys)
    # the band slice holds every band key of the block; sink keys outside it come apart
    ranges = [(0, min(sinks, low)), (low, high)]
    if not causal:
        ranges.append((max(high, low), sinks))
    ranges = [(a, b) for a, b in ranges if a < b]
    if not ranges:
        return None
    keys, key_poison = finite_rows(xp, _cat(xp, [k[..., a:b, :] for a, b in ranges], -2))
    values, poison = value_columns(xp, _cat(xp, [v[..., a:b, :] for a, b in ranges], -2))
    poison = poison + key_poison
    positions = _cat(xp, [xp.arange(a, b, device=device) for a, b in ranges], -1)
    scores = (inputs.scale * inputs.q[..., start:stop, :]) @ xp.matrix_transpose(keys)
    scores = scores + poison[..., None, :]
    queries = xp.arange(start, stop, device=device)[:, None]
    allowed = positions[None, :] < sinks
    if window:
        distance = queries - positions[None, :]
        in_band = (distance <= window) & (distance >= -window)
        allowed = allowed | in_band
    if causal:
        allowed = allowed & (positions[None, :] <= queries)
    if key_mask is not None:
        allowed = allowed & _cat(xp, [key_mask[..., a:b] for a, b in ranges], -1)[..., None, :]
    scores = xp.where(allowed, scores, -xp.inf)
    shift = xp.max(scores, axis=-1, keepdims=True)
    sums = xp.exp(scores - finite_shift(xp, shift)) @ values
    return shift, sums, sums[..., -1:]


def _cat(xp: Any, pieces: list[Array], axis: int) -> Array:
    return pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=axis)


def windowed_rfa(xp: Any, inputs: AttentionInputs, mapping: Any, *, window: int, sinks: int,
                 causal: bool, block_size: int, chunk_size: int,
                 guard: bool) -> tuple[Array, Array | None]:
    """RFA with the band ``|n - m| <= window`` and the keys ``m < sinks`` exact.

    ``mapping`` is a feature map of :mod:`xattn._rf_scan`. Returns the output (..., N, Dv)
    and, with ``guard``, the rows whose denominators were clamped.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    root_scale = math.sqrt(inputs.scale)
    common = dict(root_scale=root_scale, key_mask=inputs.key_mask, first_key=sinks,
                  block_size=block_size, chunk_size=chunk_size,
                  batch_shape=inputs.batch_shape)
    parts = []  # iterators of the random-feature partials, one per query block
    if window or causal:  # the keys m <= n - (w + 1) (m <= n without a band, causal)
        offset = window + 1 if window else 0
        parts.append(scan_partials(xp, mapping, q, k, v, offset=offset, reverse=False,
                                   **common))
    if window and not causal:  # and the keys m >= n + w + 1
        parts.append(scan_partials(xp, mapping, q, k, v, offset=window + 1, reverse=True,
                                   **common))
    state = None
    if not window and not causal:  # sinks only: every key m >= K, for every query
        state = state_over_keys(xp, mapping, k, v, start=min(sinks, num_keys), stop=num_keys,
                                **{name: common[name] for name in (
                                    "root_scale", "key_mask", "first_key", "chunk_size",
                                    "batch_shape")})
    outputs, invalid_rows = [], []
    for start in range(0, num_queries, block_size):
        stop = min(start + block_size, num_queries)
        q_hat = root_scale * q[..., start:stop, :]
        constant = mapping.query_constant(q_hat)  # makes the estimate e^{q.k} itself
        random_parts = [next(part) for part in parts]
        if state is not None:
            random_parts.append(mapping.readout(mapping.queries(q_hat), state))
        partials = [(shift + constant, sums, weight) for shift, sums, weight in random_parts]
        exact = _exact_partial(xp, inputs, start, stop, window, sinks, causal)
        if exact is not None:
            partials.append(exact)
        out, invalid = finish_partial(xp, combine_partials(xp, partials), guard=guard)
        outputs.append(out)
        if invalid is not None:
            invalid_rows.append(invalid)
    out = outputs[0] if len(outputs) == 1 else xp.concat(outputs, axis=-2)
    if not invalid_rows:
        return out, None
    return out, invalid_rows[0] if len(invalid_rows) == 1 else xp.concat(invalid_rows, axis=-2)
