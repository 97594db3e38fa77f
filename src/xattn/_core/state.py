r"""The states that causal estimators hand back to continue a sequence (generation).

A causal call with ``return_state=True`` returns ``(out, state)``; a later call with
``state=`` takes the queries and keys at the positions after those already seen, under
the same top-left causal convention, so that a sequence processed in pieces (a prefill,
then one token at a time) gives the outputs and the state of one causal call on the whole
sequence, up to rounding.

* :class:`RFAState` (:func:`xattn.rfa`) is of **fixed size**: the samples
  :math:`\omega`, the stabilized random-feature sums of the keys seen with their running
  maxima, the position count, and with ``window`` / ``sinks`` the keys and values of the
  last ``window`` positions and of the ``sinks`` first ones.
* :class:`SoftmaxState` (:func:`xattn.softmax_attention`) and :class:`RAState`
  (:func:`xattn.ra`) are **key-value caches**: the keys and values seen, which grow by
  concatenation (the quadratic baselines).

Every state is an immutable dataclass of arrays, registered as a JAX pytree once JAX is
imported (:func:`xattn._core.array.register_pytree`): a decode loop runs under
:func:`jax.jit` and ``jax.lax.scan`` (an :class:`RFAState` keeps its shapes from step
to step), and torch's autograd flows through the arrays of a state. The checks of a state
against a call's options and inputs are here too (:func:`check_state_call`,
:func:`check_state_inputs`, :func:`rfa_state_options`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from xattn._core.array import Array, concrete_count, library_name, register_pytree
from xattn._core.docstrings import (
    KEY_VALUE_CACHE_ATTRIBUTES,
    SELF_ATTENTION_EXAMPLE_INPUTS,
    fill_docstring,
)
from xattn._core.inputs import AttentionInputs
from xattn._core.options import check_bool

__all__ = ["IMPORTANCE_FEATURES", "LARAState", "RAState", "RFAState", "SoftmaxState",
           "check_state_array", "check_state_call", "check_state_inputs", "empty_cache",
           "empty_rfa_state", "refuse", "rfa_state_options"]


@dataclass(frozen=True, eq=False)
class RFAState:
    r"""What causal :func:`xattn.rfa` carries from one call to the next: fixed size.

    Returned by ``xattn.rfa(..., causal=True, return_state=True)`` as ``(out, state)``;
    passed back as ``state=`` to continue the sequence. With :math:`P` tokens seen, a
    call with ``state=`` and :math:`L` new tokens treats its queries and keys as the
    positions :math:`P, \dots, P + L - 1`; its output and the state it returns are those
    of one causal call on all :math:`P + L` tokens, up to rounding. Its size does not
    depend on :math:`P`.

    With the samples :math:`\omega_s` (rows of ``omega``), :math:`\hat k = \sqrt{s}\, k`
    and the keys :math:`R` that the random features cover (every key seen without
    ``window`` and ``sinks``; with them, the keys :math:`K \le m \le P - 1 - w`), the
    positive and hyperbolic maps keep

    .. math::

        a_{ms} = \omega_s \cdot \hat k_m - \lVert \hat k_m \rVert^2 / 2, \quad
        K_s = \max_{m \in R} a_{ms}, \quad
        A'_s = \sum_{m \in R} e^{a_{ms} - K_s} [v_m, 1],

    (:math:`K_s = -\infty` and :math:`A'_s = 0` while :math:`R` is empty), the
    trigonometric map :math:`M = \max_{m \in R} \lVert \hat k_m \rVert^2/2`,
    :math:`A' = \sum_{m \in R} e^{\lVert \hat k_m \rVert^2/2 - M} \phi(\hat k_m) [v_m,
    1]` and :math:`W = \sum_{m \in R} e^{\lVert \hat k_m \rVert^2/2 - M}`. A new key
    joins with the online-softmax merge (a running maximum rescales the sums), so the
    sums never overflow, at any length. Masked keys (``key_mask`` False) never enter a
    state.

    The arrays have the compute dtype (float32 for half-precision inputs) and the
    broadcast leading dims ``...`` of the first call. ``window`` and ``sinks`` are the
    lengths of the buffers (:attr:`window`, :attr:`sinks`). Memory:
    ``O(F Dv + (w + K)(D + Dv) + S D)`` per batch-head, whatever :math:`P`.

    Attributes
    ----------
    omega : array, shape (S, D) or (..., S, D)
        The samples, drawn by the first call (from ``rng``, ``num_features``,
        ``orthogonal``, ``sample_norm``) or given to it as ``omega=`` (with leading dims:
        per head). A call with ``state=`` takes them from here.
    feature_max : array, shape (..., F) or (..., 1, 1)
        The running maxima: :math:`K_s` (positive map: ``F = S``; hyperbolic: ``F = 2S``,
        the samples :math:`\pm\omega`), or :math:`M` (trigonometric map).
    feature_sums : array, shape (..., F, Dv + 1)
        :math:`A'_s`: the numerator columns and, last, the denominator column
        (trigonometric map: ``F = 2S``, the sine and cosine features).
    feature_weight : array, shape (..., 1, 1), or None
        :math:`W`, the bound on the trigonometric denominator; None for the other maps.
    position : array, shape ()
        :math:`P`, the number of tokens seen (an integer array, so that it can be
        carried through ``jax.lax.scan``).
    window_keys, window_values : arrays, shapes (..., w, D) and (..., w, Dv)
        The keys and values of positions :math:`P - w, \dots, P - 1` (``window=w``),
        oldest first; zeros where ``window_valid`` is False.
    window_valid : bool array, shape (..., w)
        True where that position exists, is not a sink and was not masked.
    sink_keys, sink_values : arrays, shapes (..., K, D) and (..., K, Dv)
        The keys and values of positions :math:`0, \dots, K - 1` (``sinks=K``), slot
        :math:`i` holding position :math:`i`; zeros where ``sink_valid`` is False.
    sink_valid : bool array, shape (..., K)
        True where that position was seen and not masked.
    feature_map : str
        ``"positive"``, ``"hyperbolic"`` or ``"trigonometric"`` (static);
        ``"importance"`` in the ``features`` of a :class:`LARAState`.
    scale : float
        The score scale of the keys in the sums (static).


    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 6, 8)), rng.normal(size=(3, 6, 8)), rng.normal(size=(3, 6, 2))
    >>> out, state = xattn.rfa(q[:, :4], k[:, :4], v[:, :4], num_features=16, rng=0,
    ...                        causal=True, return_state=True)
    >>> out_t, state = xattn.rfa(q[:, 4:], k[:, 4:], v[:, 4:], causal=True, state=state,
    ...                          return_state=True)
    >>> int(state.position), state.feature_sums.shape
    (6, (3, 16, 3))
    >>> whole = xattn.rfa(q, k, v, num_features=16, rng=0, causal=True)
    >>> bool(np.allclose(np.concatenate([out, out_t], axis=1), whole))
    True
    """

    omega: Array
    feature_max: Array
    feature_sums: Array
    feature_weight: Array | None
    position: Array
    window_keys: Array
    window_values: Array
    window_valid: Array
    sink_keys: Array
    sink_values: Array
    sink_valid: Array
    feature_map: str
    scale: float

    @property
    def window(self) -> int:
        """``w``, the half-width of the exact band (0: none)."""
        return int(self.window_keys.shape[-2])

    @property
    def sinks(self) -> int:
        """``K``, the number of sink keys (0: none)."""
        return int(self.sink_keys.shape[-2])

    @property
    def feature_state(self) -> tuple[Array, ...]:
        """The sums as the blockwise scan of causal RFA carries them (a tuple of arrays)."""
        if self.feature_weight is None:
            return self.feature_max, self.feature_sums
        return self.feature_max, self.feature_sums, self.feature_weight


@dataclass(frozen=True, eq=False)
class _KeyValueCache:
    """The keys and values seen, with their validity: the state of a quadratic estimator."""

    keys: Array
    values: Array
    valid: Array

    @property
    def position(self) -> int:
        """The number of tokens seen (the length of the cache)."""
        return int(self.keys.shape[-2])


@fill_docstring(attributes=KEY_VALUE_CACHE_ATTRIBUTES, examples=SELF_ATTENTION_EXAMPLE_INPUTS)
@dataclass(frozen=True, eq=False)
class SoftmaxState(_KeyValueCache):
    r"""The key-value cache of causal :func:`xattn.softmax_attention`.

    Returned by ``softmax_attention(..., causal=True, return_state=True)`` as
    ``(out, state)`` and passed back as ``state=``: a call with :math:`L` new tokens
    attends the cached keys and its own (query :math:`P + j` sees the keys
    :math:`m \le P + j`) and returns the cache grown by :math:`L`. It grows with the
    sequence, ``O(P (D + Dv))`` per batch-head: the baseline that the fixed-size
    :class:`RFAState` is measured against. Under :func:`jax.jit` each length compiles
    once (a prefill, then one step per length); a ``jax.lax.scan`` loop needs a
    fixed-size state (:class:`RFAState`).

    {{attributes}}

    {{examples}}
    >>> out, cache = xattn.softmax_attention(q[:, :3], k[:, :3], v[:, :3], causal=True,
    ...                                      return_state=True)
    >>> out_t, cache = xattn.softmax_attention(q[:, 3:], k[:, 3:], v[:, 3:], causal=True,
    ...                                        state=cache, return_state=True)
    >>> cache.position, cache.keys.shape
    (5, (2, 5, 4))
    >>> whole = xattn.softmax_attention(q, k, v, causal=True)
    >>> bool(np.allclose(np.concatenate([out, out_t], axis=1), whole))
    True
    """


@fill_docstring(attributes=KEY_VALUE_CACHE_ATTRIBUTES, examples=SELF_ATTENTION_EXAMPLE_INPUTS)
@dataclass(frozen=True, eq=False)
class RAState(_KeyValueCache):
    r"""The key-value cache of causal :func:`xattn.ra` (RA stays quadratic).

    The same cache as :class:`SoftmaxState`, its own type so that a state is used with
    the estimator that made it. A call with ``state=`` draws the randomness of its own
    queries from its ``rng`` as a call without state does (uniforms of shape
    ``(*batch, L, S)``, then normals ``(*batch, L, S, D)``); the estimate of query
    :math:`P + j` is that of one causal call over all :math:`P + L` tokens with the same
    draws for that query, so it stays unbiased, and pieces in deterministic mode equal
    one call exactly (up to rounding).

    {{attributes}}

    {{examples}}
    >>> options = dict(biased=True, deterministic=True, causal=True)
    >>> out, cache = xattn.ra(q[:, :2], k[:, :2], v[:, :2], return_state=True, **options)
    >>> out_t = xattn.ra(q[:, 2:], k[:, 2:], v[:, 2:], state=cache, **options)
    >>> whole = xattn.ra(q, k, v, **options)
    >>> bool(np.allclose(np.concatenate([out, out_t], axis=1), whole))
    True
    """


@fill_docstring(examples=SELF_ATTENTION_EXAMPLE_INPUTS)
@dataclass(frozen=True, eq=False)
class LARAState:
    r"""What causal :func:`xattn.lara` carries from one call to the next: fixed size.

    Returned by ``xattn.lara(..., causal=True, return_state=True)`` as ``(out, state)``;
    passed back as ``state=`` to continue the sequence, whose outputs and state are then
    those of one causal call on all the tokens, up to rounding. Causal LARA's prefix sums
    are RFA's with LARA's samples :math:`\omega_c` (:doc:`/theory/04_lara`), so the state
    is an :class:`RFAState` of those samples with what the query weights need besides.
    A call with ``state=`` takes the samples, the proposal means, ``weighting`` and
    ``beta`` from here (``rng`` and ``proposal_means`` unused).

    Attributes
    ----------
    features : RFAState
        The prefix sums; its ``omega`` are LARA's samples, shape (..., C, D), and its
        ``feature_map`` is ``"importance"`` (:func:`xattn.rfa` refuses it).
    proposal_means : array, shape (..., C, D)
        The means :math:`\mu_c` of the proposals, defensive ones included (zero).
    weighting : str
        ``"balance"`` or ``"query_proposal"``.
    beta : float

    {{examples}}
    >>> options = dict(num_samples=6, proposal_means=0.3 * rng.normal(size=(6, 4)),
    ...                weighting="query_proposal", causal=True)
    >>> out, state = xattn.lara(q[:, :2], k[:, :2], v[:, :2], return_state=True, rng=0,
    ...                         **options)
    >>> out_t = xattn.lara(q[:, 2:], k[:, 2:], v[:, 2:], state=state, **options)
    >>> whole = xattn.lara(q, k, v, rng=0, **options)
    >>> bool(np.allclose(np.concatenate([out, out_t], axis=1), whole))
    True
    """

    features: RFAState
    proposal_means: Array
    weighting: str
    beta: float


IMPORTANCE_FEATURES = "importance"
"""The ``feature_map`` of the :class:`RFAState` inside a :class:`LARAState`: RFA's positive
features with LARA's importance weights in the query logits."""

def _data_fields(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in fields(cls)
                 if field.name not in ("feature_map", "scale"))


register_pytree(RFAState, _data_fields(RFAState), ("feature_map", "scale"))
for _cache in (SoftmaxState, RAState):
    register_pytree(_cache, ("keys", "values", "valid"), ())
register_pytree(LARAState, ("features", "proposal_means"), ("weighting", "beta"))

_ESTIMATOR_OF = {RFAState: "rfa", SoftmaxState: "softmax_attention", RAState: "ra",
                 LARAState: "lara"}


def check_state_call(state: Any, return_state: Any, causal: bool, cls: type) -> bool:
    """Check ``state`` and ``return_state`` of a call to the estimator of ``cls``.

    Returns whether the call starts or continues a sequence (``state`` given or
    ``return_state``). ``TypeError`` for a non-bool ``return_state`` or a state of another
    class, ``ValueError`` for either without ``causal=True``.
    """
    return_state = check_bool(return_state, "return_state")
    estimator = _ESTIMATOR_OF[cls]
    if state is not None and not isinstance(state, cls):
        made_by = _ESTIMATOR_OF.get(type(state))
        origin = (f"a state of {made_by}(), another estimator" if made_by
                  else f"{type(state).__module__}.{type(state).__qualname__}")
        raise TypeError(f"state must be an xattn.{cls.__name__}, as returned by "
                        f"{estimator}(..., causal=True, return_state=True); got {origin}")
    for name, given in (("state", state is not None), ("return_state", return_state)):
        if given and not causal:
            raise ValueError(f"{name}= continues a causal sequence: {estimator}() needs "
                             f"causal=True with {name}=")
    return state is not None or return_state


def check_state_inputs(state: RFAState | _KeyValueCache, inputs: AttentionInputs) -> None:
    """``ValueError`` (naming ``state``) unless the new tokens fit the state: the same
    array library (checked first: the other checks compare its shapes and dtypes), head
    dims ``D`` and ``Dv``, leading dims that broadcast to the state's, and compute
    dtype."""
    keys = state.sink_keys if isinstance(state, RFAState) else state.keys
    values = state.sink_values if isinstance(state, RFAState) else state.values
    if _namespace(keys) is not inputs.xp:
        raise ValueError(f"state holds arrays of {library_name(keys)} but q, k and v are "
                         f"arrays of {library_name(inputs.q)}; continue a sequence with the "
                         "array library that started it")
    batch = tuple(keys.shape[:-2])
    head_dim, value_dim = keys.shape[-1], values.shape[-1]
    new = (inputs.q.shape[-1], inputs.v.shape[-1])
    if new != (head_dim, value_dim):
        raise ValueError(f"state holds heads of D = {head_dim}, Dv = {value_dim}, but the new "
                         f"tokens have D = {new[0]} (q, k) and Dv = {new[1]} (v)")
    try:
        fits = tuple(np.broadcast_shapes(inputs.batch_shape, batch)) == batch
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"state has the leading (batch, head) dims {batch}, which the new "
                         f"tokens' leading dims {inputs.batch_shape} do not broadcast to")
    if keys.dtype != inputs.compute_dtype:
        raise ValueError(f"state holds {keys.dtype} arrays but the new tokens compute in "
                         f"{inputs.compute_dtype}; continue a sequence in one dtype")


def rfa_state_options(state: RFAState, *, num_features: Any, feature_map: Any, omega: Any,
                      window: Any, sinks: Any, scale: Any) -> tuple[str, int, int, float]:
    """The options of a call that continues ``state``: those of the state. An option given
    explicitly must equal the state's (``ValueError`` naming it); returns
    ``(feature_map, window, sinks, scale)``. ``TypeError`` for the feature sums of a
    :class:`LARAState` (its ``features``), which only :func:`xattn.lara` continues."""
    if state.feature_map == IMPORTANCE_FEATURES:
        raise TypeError("state is the feature sums of an xattn.LARAState (its .features: "
                        "LARA's samples and weights), which rfa() cannot continue; pass the "
                        "LARAState itself to xattn.lara(..., state=)")
    samples = state.omega.shape[-2]
    if feature_map is not None and feature_map != state.feature_map:
        refuse("feature_map", feature_map, state.feature_map)
    if num_features is not None and num_features != samples:
        refuse("num_features", num_features, samples)
    for name, given, held in (("window", window, state.window), ("sinks", sinks, state.sinks)):
        if given is not None and given != held:
            refuse(name, given, held)
    if scale is not None and not math.isclose(float(scale), state.scale, rel_tol=1e-12):
        refuse("scale", scale, state.scale)
    check_state_array("omega", omega, state.omega)
    return state.feature_map, state.window, state.sinks, state.scale


def refuse(name: str, given: Any, held: Any, described: bool = False) -> None:
    """``ValueError``: the option ``name`` of a call with ``state=`` is not the state's."""
    given, held = (given, held) if described else (repr(given), repr(held))
    raise ValueError(f"{name}={given} differs from the state's {name} ({held}); a "
                     f"state continues its own sequence: leave {name} out (None) or pass "
                     "the state's value")


def check_state_array(name: str, given: Any, held: Array, *, strict: bool = True) -> None:
    """Refuse an array option ``name`` of a call with ``state=`` unless it is None, the
    state's own array or equal to it. Values that cannot be read (under :func:`jax.jit`,
    lazy Dask) are refused with ``strict``, else taken as the state's (shapes checked)."""
    if given is None or given is held:
        return
    if tuple(given.shape) != tuple(held.shape):
        refuse(name, f"<array of shape {tuple(given.shape)}>",
               f"an array of shape {tuple(held.shape)}", described=True)
    xp = _namespace(held)
    differs = concrete_count(xp, xp.astype(given, held.dtype) != held)
    if differs is None and not strict:
        return
    if differs is None:
        raise ValueError(f"{name}= with state=: the arrays cannot be compared here (under "
                         f"jax.jit or lazily); leave {name} out, the state holds it")
    if differs:
        refuse(name, "<other values>", "other values", described=True)


def _namespace(x: Array) -> Any:
    import array_api_compat

    return array_api_compat.array_namespace(x)


def empty_rfa_state(inputs: AttentionInputs, mapping: Any, omega: Array, feature_map: str,
                    window: int, sinks: int) -> RFAState:
    """The state of no tokens, for the heads of ``inputs``, the samples ``omega`` and their
    feature map (``mapping``, a :class:`xattn._estimators.rf_scan.FeatureMap`)."""
    xp, batch, dtype, device = inputs.xp, inputs.batch_shape, inputs.compute_dtype, inputs.device
    head_dim, value_dim = inputs.q.shape[-1], inputs.v.shape[-1]
    feature_state = mapping.empty_state(batch, value_dim + 1, dtype, device)

    def buffers(length: int) -> tuple[Array, Array, Array]:
        return (xp.zeros((*batch, length, head_dim), dtype=dtype, device=device),
                xp.zeros((*batch, length, value_dim), dtype=dtype, device=device),
                xp.zeros((*batch, length), dtype=xp.bool, device=device))

    weight = feature_state[2] if len(feature_state) == 3 else None
    return RFAState(omega, feature_state[0], feature_state[1], weight,
                    xp.asarray(0, device=device), *buffers(window), *buffers(sinks),
                    feature_map=feature_map, scale=inputs.scale)


def empty_cache(cls: type, inputs: AttentionInputs) -> Any:
    """The key-value cache of no tokens for the inputs' heads (a ``cls`` instance)."""
    xp, batch, dtype, device = inputs.xp, inputs.batch_shape, inputs.compute_dtype, inputs.device
    return cls(xp.zeros((*batch, 0, inputs.q.shape[-1]), dtype=dtype, device=device),
               xp.zeros((*batch, 0, inputs.v.shape[-1]), dtype=dtype, device=device),
               xp.zeros((*batch, 0), dtype=xp.bool, device=device))
