"""Framework-independent core of the attention layers in :mod:`xattn.torch` and
:mod:`xattn.flax`.

In the style of einops' layer mixins, :class:`LayerCore` holds everything that does not
depend on the framework: the calls of the estimators (the layer options, their defaults and
their checks are in :mod:`xattn._core.options`), the ``num_features`` default, the
construction-time probe of the option values, the redraw guard and schedule of the RFA
features, the dtype rule of ``omega`` and the train/eval switch of the estimators; and
generation (:meth:`LayerCore._continue`, :meth:`LayerCore._decode`): a causal sequence
given in pieces through the estimators' ``state=`` / ``return_state=True``, checked against
the layer (the estimator's state class, the heads, RFA's features), with the fixed-size
caches of Flax's ``decode=True`` (a key-value cache of ``max_length`` slots written in
place by a gather, so that the position may be traced).
A framework layer inherits from it and from its framework's module class, calls
:meth:`LayerCore._setup_estimator` in its constructor, and keeps only the framework hooks:
parameters, where the features live, where randomness comes from, and the input layout.
The text the two layers' docstrings share lives here too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import array_api_compat
import numpy as np

import xattn
from xattn._core.array import Array, compute_dtype, concrete_count
from xattn._core.options import (
    DEFAULT_LARA_SAMPLES,
    ESTIMATOR_OPTIONS,
    ESTIMATORS,
    IMPLEMENTATIONS,
    check_bool,
    check_choice,
    check_estimator,
    lara_num_samples,
)
from xattn._core.state import LARAState, RAState, RFAState, SoftmaxState, _KeyValueCache
from xattn._estimators.lara_causal import check_lara_causal_options
from xattn._estimators.rfa import default_num_features
from xattn.features import SAMPLE_NORMS, sample_omega

__all__ = [
    "DEFAULT_LARA_SAMPLES",
    "ESTIMATORS",
    "ESTIMATOR_OPTIONS",
    "ESTIMATOR_OPTIONS_DOC",
    "FIXED_SIZE_STATES",
    "PROBE_LENGTH",
    "RFA_ONLY_RAISES",
    "STATE_CLASSES",
    "LayerCore",
    "attend",
    "check_features_shape",
    "draw_features",
    "learned_proposal_means",
    "module_docstring",
]


# RFA options used when drawing the features rather than when calling the estimator.
_FEATURE_OPTIONS = ("num_features", "orthogonal", "sample_norm")

PROBE_LENGTH = 3
"""Sequence length of the construction-time probe: short, so that the probe costs
microseconds whatever the sample counts (RA's cost grows with length² x samples)."""


def draw_features(rng: Any, num_features: int, head_dim: int, options: dict[str, Any], *,
                  xp: Any, dtype: Any, device: Any = None) -> Array:
    """RFA samples ``(num_features, head_dim)`` with the layer's feature options (checked
    under the names the layer takes them by)."""
    orthogonal = check_bool(options.get("orthogonal", True), "orthogonal")
    sample_norm = check_choice(options.get("sample_norm", "chi"), "sample_norm", SAMPLE_NORMS)
    return sample_omega(rng, num_features, head_dim, xp=xp, dtype=dtype, device=device,
                        orthogonal=orthogonal, norm=sample_norm)


def check_features_shape(shape: tuple[int, ...], head_dim: int, num_heads: int,
                         source: str) -> None:
    """``ValueError`` naming ``features`` unless ``shape`` is a layer's RFA samples:
    ``(S, head_dim)`` shared by the heads, or ``(num_heads, S, head_dim)`` (or
    ``(1, S, head_dim)``) one matrix per head; ``source`` says where ``shape`` came from."""
    if (shape[-1:] != (head_dim,) or len(shape) not in (2, 3)
            or (len(shape) == 3 and shape[0] not in (1, num_heads))):
        raise ValueError(f"features must have shape (S, head_dim) = (S, {head_dim}) or, one "
                         f"matrix per head, (num_heads, S, head_dim) = ({num_heads}, S, "
                         f"{head_dim}); {source} {shape}")


def learned_proposal_means(seed: Any, num_heads: int, num_samples: int,
                           head_dim: int) -> np.ndarray:
    """The initial means of a layer's ``proposal="learned"``, (num_heads, C, head_dim),
    float32: standard normal draws. In evaluation mode LARA uses the means as its
    samples, so an untrained layer then is RFA with i.i.d. N(0, I) features (zero means
    would make every sample 0 and the attention uniform), and distinct means let the
    proposals separate as they learn."""
    return np.random.default_rng(seed).standard_normal(
        (num_heads, num_samples, head_dim)).astype(np.float32)


def attend(estimator: str, q: Array, k: Array, v: Array, *, options: dict[str, Any],
           key_mask: Array | None, causal: bool, training: bool, omega: Array | None = None,
           rng: Any = None, state: Any = None, stateful: bool = False) -> Any:
    """Run ``estimator`` on per-head inputs ``(..., L, head_dim)``.

    Training mode draws with ``rng``; evaluation mode is deterministic for every
    estimator: RFA uses the fixed ``omega`` (for LARA with ``proposal="learned"``, ``omega``
    holds the layer's proposal means), RA its biased deterministic form, LARA its
    deterministic form (proposal means as samples). With ``stateful`` (causal attention)
    the call continues ``state`` (None: starts a sequence) and returns ``(out, state)``.
    """
    generation = {"state": state, "return_state": True} if stateful else {}
    if estimator == "softmax":
        return xattn.softmax_attention(q, k, v, key_mask=key_mask, causal=causal,
                                       **generation, **options)
    if estimator == "rfa":
        call_options = {name: value for name, value in options.items()
                        if name not in _FEATURE_OPTIONS}
        sinks = call_options.get("sinks")
        if (isinstance(sinks, numbers.Integral) and not isinstance(sinks, bool)
                and not stateful):  # a state's sinks are those of the whole sequence
            call_options["sinks"] = min(int(sinks), k.shape[-2])  # at most every key a sink
        return xattn.rfa(q, k, v, omega=omega, key_mask=key_mask, causal=causal,
                         **generation, **call_options)
    if estimator == "ra":
        if training:
            return xattn.ra(q, k, v, key_mask=key_mask, causal=causal, rng=rng, **generation,
                            **options)
        return xattn.ra(q, k, v, key_mask=key_mask, causal=causal, biased=True,
                        deterministic=True, **generation, **options)
    call_options = dict(options)
    num_samples = lara_num_samples(call_options)
    call_options.pop("num_samples", None)
    if call_options.get("proposal") == "learned":  # omega: the layer's means (h, C, d)
        call_options.pop("proposal")
        call_options.setdefault("weighting", "query_proposal")
        call_options["proposal_means"] = omega
    elif call_options.get("grid") is None and not causal:  # C capped at N (at least 1)
        num_samples = min(num_samples, max(q.shape[-2], 1))
    defensive = call_options.get("defensive")
    if isinstance(defensive, numbers.Integral) and not isinstance(defensive, bool):
        call_options["defensive"] = min(int(defensive), num_samples)  # capped with C
    # causal=True raises lara's own error (the same for the layers and the function)
    if training:
        return xattn.lara(q, k, v, num_samples=num_samples, key_mask=key_mask, causal=causal,
                          rng=rng, **generation, **call_options)
    return xattn.lara(q, k, v, num_samples=num_samples, key_mask=key_mask, causal=causal,
                      deterministic=True, **generation, **call_options)


def _python_where(condition: bool, if_true: Any, if_false: Any) -> Any:
    return if_true if condition else if_false


class LayerCore:
    """The framework-independent half of an xattn attention layer.

    A subclass (also a ``torch.nn.Module`` or a ``flax.nnx.Module``) calls
    :meth:`_setup_estimator` in its constructor before it creates parameters, and uses
    :meth:`_counts_training_steps`, :meth:`_redraw_schedule` and :meth:`_estimate` in its
    call; it keeps the RFA features where its framework keeps state.
    """

    estimator: str
    estimator_options: dict[str, Any]
    redraw_interval: int | None
    head_dim: int
    num_features: int | None

    def _setup_estimator(self, *, head_dim: int, estimator: Any, redraw_interval: Any,
                         options: dict[str, Any]) -> None:
        """Check the estimator and its options, set the estimator attributes, and probe
        the option values (see :meth:`_check_option_values`)."""
        check_estimator(estimator, options, redraw_interval)
        self.head_dim = head_dim
        self.estimator = estimator
        self.redraw_interval = redraw_interval
        self.estimator_options = dict(options)
        self.num_features = None
        self.learned_proposals = estimator == "lara" and options.get("proposal") == "learned"
        if estimator == "rfa":
            self.num_features = options.get("num_features", default_num_features(head_dim))
        self._check_option_values()

    def _check_option_values(self) -> None:
        """Run the estimator on a tiny NumPy input, in training and in evaluation mode, so
        that a bad option value fails at construction. The probe draws from a fixed seed
        on the host: no framework generator or global state is touched. The input has
        :data:`PROBE_LENGTH` tokens, or with LARA's ``grid`` the c_h x c_w tokens of the
        smallest grid that holds the bins (the grid itself is checked without arrays)."""
        options = self.estimator_options
        length = PROBE_LENGTH
        if options.get("grid") is not None:  # the smallest grid that holds the c_h x c_w bins
            pools = tuple(lara_num_samples(options))
            options = {**options, "grid": pools, "num_samples": pools}
            length = math.prod(pools)
        if options.get("implementation") is not None:  # NumPy has no fused kernel to probe
            check_choice(options["implementation"], "implementation", IMPLEMENTATIONS)
            options = {name: value for name, value in options.items()
                       if name != "implementation"}
        probe = np.zeros((1, length, self.head_dim), dtype=np.float32)
        omega = None
        if self.learned_proposals:
            omega = learned_proposal_means(0, 1, lara_num_samples(options), self.head_dim)
        if self.estimator == "rfa":
            assert self.num_features is not None  # set for "rfa" by _setup_estimator
            omega = draw_features(0, self.num_features, self.head_dim, self.estimator_options,
                                  xp=np, dtype=np.float32)
        for training in (True, False):
            attend(self.estimator, probe, probe, probe, options=options, key_mask=None,
                   causal=False, training=training, omega=omega, rng=0)

    def _require_rfa(self, method: str) -> None:
        if self.estimator != "rfa":
            raise ValueError(f"{method} needs estimator='rfa', not {self.estimator!r}")

    def _counts_training_steps(self, training: bool) -> bool:
        """The redraw guard: only training-mode calls of an ``"rfa"`` layer with a redraw
        interval count towards the next redraw."""
        return training and self.estimator == "rfa" and self.redraw_interval is not None

    def _redraw_schedule(self, steps: Any, where: Callable[[Any, Any, Any], Any] = _python_where
                         ) -> tuple[Any, Any]:
        """Performer's schedule: whether this training call redraws the features (the
        current ones have served ``redraw_interval`` calls), and the step count after it.

        ``where`` selects between two values (a Python conditional by default,
        :func:`jax.numpy.where` for a count that is traced).
        """
        redraw = steps >= self.redraw_interval
        return redraw, where(redraw, 1, steps + 1)

    @staticmethod
    def _omega_like(features: Array, q: Array) -> Array:
        """The features as the ``omega`` of a call on ``q``: in the dtype the estimator
        computes in (float32 for half precision, else the dtype of ``q``)."""
        xp = array_api_compat.array_namespace(q)
        return xp.astype(features, compute_dtype(xp, q.dtype))

    def _estimate(self, q: Array, k: Array, v: Array, *, key_mask: Array | None,
                  causal: bool, training: bool, features: Array | None, rng: Any) -> Array:
        """The estimator on per-head inputs ``(..., L, head_dim)`` in the given mode."""
        grid = self.estimator_options.get("grid")
        if grid is not None and not q.shape[-2] == k.shape[-2] == math.prod(grid):
            raise ValueError(
                f"grid (H, W) = {tuple(grid)} needs query and key sequences of H * W = "
                f"{math.prod(grid)} tokens (the image in row-major order); got query "
                f"length {q.shape[-2]} and key length {k.shape[-2]}"
            )
        omega = None if features is None else self._omega_like(features, q)
        return attend(self.estimator, q, k, v, options=self.estimator_options,
                      key_mask=key_mask, causal=causal, training=training, omega=omega,
                      rng=rng if training else None)

    # -- generation: one causal sequence given in pieces (a prefill, then new tokens) -------

    def _require_causal_estimator(self, what: str) -> None:
        """``ValueError`` for a LARA layer whose options look ahead (segment proposals, a
        weighting with a softmax over all queries, a grid): causal LARA needs
        ``proposal="learned"`` (or ``"standard"``, or ``defensive`` = C) and the weighting
        ``"balance"`` or ``"query_proposal"``."""
        if self.estimator != "lara":
            return
        options = self.estimator_options
        try:
            if options.get("grid") is not None:
                raise ValueError("grid= looks ahead (2-D segments of the whole image)")
            num_samples = lara_num_samples(options)
            check_lara_causal_options(
                proposal=options.get("proposal", "segment"), supplied=self.learned_proposals,
                defensive=min(options.get("defensive", 0), num_samples),
                num_samples=num_samples, grid=None, weighting=options.get(
                    "weighting", "query_proposal" if self.learned_proposals else "decoupled"))
        except ValueError as problem:
            raise ValueError(f"{what} continues a causal sequence, but the LARA layer's options "
                             f"have no causal form: {problem} (a layer with "
                             f"proposal='learned' has one)") from None

    def _check_state(self, state: Any, q: Array, v: Array, features: Array | None, *,
                     name: str, restart: str) -> None:
        """``TypeError`` / ``ValueError`` naming ``name`` unless ``state`` continues a
        sequence of this layer: the estimator's state class, the heads of ``q`` and ``v``
        (``(batch..., heads, L, head_dim)``) and, for RFA, the layer's ``features``. The
        features are compared where their values can be read (not under :func:`jax.jit`)."""
        expected = STATE_CLASSES[self.estimator]
        if not isinstance(state, expected):
            raise TypeError(f"{name} must be an xattn.{expected.__name__}, made by a layer with "
                            f"estimator={self.estimator!r}; got {type(state).__name__}")
        if isinstance(state, LARAState):  # its samples are its own (drawn when it began)
            state, features = state.features, None
        rfa = isinstance(state, RFAState)
        keys, values = (state.sink_keys, state.sink_values) if rfa else (state.keys, state.values)
        held = (*keys.shape[:-2], keys.shape[-1], values.shape[-1])
        new = (*q.shape[:-2], q.shape[-1], v.shape[-1])
        if held != new:
            raise ValueError(f"{name} was made for (batch..., num_heads, head_dim, value dim) = "
                             f"{held}, but these tokens have {new}: a sequence continues in the "
                             f"layer and with the batch that began it ({restart})")
        if features is None:
            return
        xp = array_api_compat.array_namespace(q)
        omega = self._omega_like(features, q)
        if (tuple(omega.shape) != tuple(state.omega.shape)
                or concrete_count(xp, omega != xp.astype(state.omega, omega.dtype))):
            raise ValueError(f"{name} holds other RFA features than the layer: they were redrawn "
                             "or loaded after the sequence began, and a sequence keeps the "
                             f"features it began with ({restart})")

    def _continue(self, q: Array, k: Array, v: Array, *, key_mask: Array | None,
                  training: bool, features: Array | None, rng: Any, state: Any,
                  name: str = "state", restart: str = "begin a new one") -> tuple[Array, Any]:
        """Causal attention of the new tokens ``q, k, v`` (per head, ``(..., L,
        head_dim)``) after those that ``state`` has seen (None: the first piece); returns
        ``(out, state)``. An RFA sequence begins with the layer's ``features`` and keeps
        the state's (checked against ``features``, see :meth:`_check_state`)."""
        self._require_causal_estimator("generation")
        if k.shape[-2] != q.shape[-2]:
            raise ValueError(f"generation takes the queries, keys and values of the same new "
                             f"tokens; got {q.shape[-2]} queries and {k.shape[-2]} keys")
        if state is not None:
            self._check_state(state, q, v, features, name=name, restart=restart)
        omega = None if features is None or state is not None else self._omega_like(features, q)
        return attend(self.estimator, q, k, v, options=self.estimator_options,
                      key_mask=key_mask, causal=True, training=training, omega=omega,
                      rng=rng if training else None, state=state, stateful=True)

    def _empty_cache(self, xp: Any, batch: tuple[int, ...], max_length: int, dtype: Any,
                     device: Any, features: Array | None) -> Any:
        """The state of no tokens for the heads ``batch = (batch..., num_heads)``, of fixed
        size: RFA's and LARA's own states (with the layer's ``features``, for LARA its
        learned proposal means: evaluation mode's samples); for softmax and RA a
        key-value cache of ``max_length`` slots, none valid yet (:meth:`_decode` fills
        them in order; a slot not filled is a masked key, which no query attends)."""
        self._require_causal_estimator("a decoding cache")
        dtype = compute_dtype(xp, dtype)
        if self.estimator in FIXED_SIZE_STATES:
            empty = xp.zeros((*batch, 0, self.head_dim), dtype=dtype, device=device)
            return self._continue(empty, empty, empty, key_mask=None, training=False,
                                  features=features, rng=None, state=None)[1]
        slots = xp.zeros((*batch, max_length, self.head_dim), dtype=dtype, device=device)
        return STATE_CLASSES[self.estimator](
            slots, slots, xp.zeros((*batch, max_length), dtype=xp.bool, device=device))

    def _decode(self, q: Array, k: Array, v: Array, *, key_mask: Array | None,
                training: bool, features: Array | None, rng: Any, cache: Any, index: Array,
                name: str, restart: str) -> tuple[Array, Any, Array]:
        """:meth:`_continue` for a fixed-size ``cache`` (:meth:`_empty_cache`) that has seen
        ``index`` tokens (a 0-d integer array, traced under :func:`jax.jit`): returns the
        output, the cache and ``index + L``. A key-value cache's slots ``index .. index + L
        - 1`` take the new keys and values; ``ValueError`` if they do not fit (where
        ``index`` can be read)."""
        self._require_causal_estimator("decoding")
        length = q.shape[-2]
        if not isinstance(cache, RFAState) and isinstance(cache, _KeyValueCache):
            slots, used = cache.keys.shape[-2], _concrete_int(index)
            if used is not None and used + length > slots:
                raise ValueError(f"{name} has {slots} slots (max_length) and holds {used} tokens:"
                                 f" {length} more do not fit; {restart} with a larger max_length")
        out, state = self._continue(q, k, v, key_mask=key_mask, training=training,
                                    features=features, rng=rng, state=cache, name=name,
                                    restart=restart)
        if isinstance(state, RFAState | LARAState):
            return out, state, index + length
        xp = array_api_compat.array_namespace(q)
        slots = cache.keys.shape[-2]  # the new entries follow the slots in the grown cache
        written = type(cache)(
            _write_slots(xp, cache.keys, state.keys[..., slots:, :], index, axis=-2),
            _write_slots(xp, cache.values, state.values[..., slots:, :], index, axis=-2),
            _write_slots(xp, cache.valid, state.valid[..., slots:], index, axis=-1))
        return out, written, index + length


STATE_CLASSES: dict[str, type[Any]] = {"softmax": SoftmaxState, "rfa": RFAState, "ra": RAState,
                                       "lara": LARAState}
"""The state class of each estimator that continues a causal sequence (LARA with causal
options only, see :meth:`LayerCore._require_causal_estimator`)."""

FIXED_SIZE_STATES = ("rfa", "lara")
"""The estimators whose state has a fixed size (no ``max_length`` for a decoding cache)."""


def _concrete_int(x: Array) -> int | None:
    """``int(x)``, or None where the value cannot be read (a traced JAX array)."""
    try:
        return int(x)
    except TypeError:  # jax.errors.ConcretizationTypeError is a TypeError
        return None


def _write_slots(xp: Any, slots: Array, new: Array, start: Array, *, axis: int) -> Array:
    """``slots`` with ``new`` in positions ``start .. start + L - 1`` along ``axis``: a
    gather from ``[slots, new]``, so that ``start`` may be traced; positions past the end
    of ``slots`` are dropped."""
    count, length = slots.shape[axis], new.shape[axis]
    position = xp.arange(count, device=array_api_compat.device(slots))
    inside = (position >= start) & (position < start + length)
    source = xp.where(inside, count + position - start, position)
    return xp.take(xp.concat([slots, new], axis=axis), source, axis=axis)


# -- docstring text shared by the two layers -------------------------------------------------

_ESTIMATORS_DOC = """
The attention itself is computed by one of xattn's estimators, chosen by name:

* ``"softmax"``: exact softmax attention (:func:`xattn.softmax_attention`);
* ``"rfa"``: random feature attention (:func:`xattn.rfa`) with an ``(S, head_dim)`` sample
  matrix kept in
  {features_home},
  redrawn every ``redraw_interval`` training steps and fixed in evaluation mode;
* ``"ra"``: randomized attention (:func:`xattn.ra`): unbiased random estimates in
  training mode, the biased deterministic form in evaluation mode;
* ``"lara"``: linear randomized attention (:func:`xattn.lara`): fresh random samples at
  every training step, ``deterministic=True`` (the proposal means) in evaluation mode.
  With ``proposal="learned"`` the means are a parameter ``proposal_means`` of shape
  ``(num_heads, C, head_dim)``, initialized with standard normal draws (so that the
  evaluation mode, which uses the means as samples, starts as RFA with N(0, I)
  features), trained through the reparameterized samples; the layer's causal mode then
  runs causal LARA (``weighting`` ``"query_proposal"``, the default, or ``"balance"``).

Evaluation outputs are therefore deterministic for every estimator. Every option is checked
when the layer is constructed (a short probe of the estimator on a tiny input, which draws
nothing from the layer's random source).
"""

#: The layers' ``**estimator_options`` parameter (the marker ``{{estimator_options}}`` of
#: their docstrings, :func:`xattn._core.docstrings.fill_docstring`).
ESTIMATOR_OPTIONS_DOC = """\
**estimator_options
    Passed to the estimator (see its page for each option):

    * ``"rfa"``: ``num_features`` (default ``max(d, int(d ln d))``, d = head_dim),
      ``feature_map``, ``orthogonal``, ``sample_norm``, ``scale``, ``block_size``,
      ``chunk_size``, ``working_memory``, ``window`` and ``sinks`` (exact attention on
      the keys with ``|n - m| <= window``, ``0 <= n - m <= window`` with causal masking,
      and on the first ``sinks`` keys, capped at the key length; random features for the
      others);
    * ``"lara"``: ``num_samples`` (C, default 16, capped at the query length; with
      ``grid``, a pair ``(c_h, c_w)``, default ``(4, 4)`` capped at the grid), ``grid``
      (``(H, W)``: the tokens are an H x W image in row-major order, segmented into the
      bins of 2-D adaptive average pooling, so every sequence must have H W tokens),
      ``proposal`` (also ``"learned"``, above), ``weighting``, ``beta``, ``noise_scale``,
      ``scale``, ``chunk_size``, ``defensive``, ``working_memory``;
    * ``"ra"``: ``num_samples``, ``noise_scale``, ``scale``, ``chunk_size``;
    * ``"softmax"``: ``scale``, ``chunk_size``, ``implementation`` (default None: the
      framework's fused kernel, ``scaled_dot_product_attention`` for torch and
      ``jax.nn.dot_product_attention`` for JAX in float32 off the CPU backend, else
      xattn's portable loop; ``"native"`` or ``"xattn"`` to choose).

    ``noise_scale`` (default 1, the paper's estimator) acts in training mode only:
    evaluation mode draws no noise."""

#: The Raises section of the methods that only an ``"rfa"`` layer has
#: (:meth:`LayerCore._require_rfa`; the marker ``{{raises}}``).
RFA_ONLY_RAISES = """\
Raises
------
ValueError
    If the layer's estimator is not ``"rfa"``."""


def module_docstring(intro: str, *, features_home: str) -> str:
    """A layer module's docstring: ``intro`` and the shared list of estimators."""
    return (intro or "").rstrip() + "\n" + _ESTIMATORS_DOC.format(features_home=features_home)
