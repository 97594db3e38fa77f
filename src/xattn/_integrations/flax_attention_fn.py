r"""xattn's estimators as the ``attention_fn=`` of :class:`flax.nnx.MultiHeadAttention`.

:func:`attention_fn` returns an :class:`AttentionFunction`: a callable with the signature
of ``flax.nnx.dot_product_attention`` (Flax's default ``attention_fn``), which is
also a small :class:`flax.nnx.Module`, so that the layer that holds it holds its state
(the random stream, RFA's feature key) and its train/eval switch.

Framework code (it imports Flax), kept apart from ``xattn/flax.py`` so that the layer
module stays short; loaded with :mod:`xattn.flax`, which exports both names.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from xattn._core.array import compute_dtype
from xattn._core.options import check_bool, check_choice, default_num_features
from xattn._integrations.flax_layer import FeatureState
from xattn._integrations.layers import LayerCore, attend, draw_features

__all__ = ["MASK_STRUCTURES", "AttentionFunction", "attention_fn"]

MASK_STRUCTURES = ("auto", "padding", "causal")
"""The values of ``mask_structure``: how a full ``(q_length, kv_length)`` mask is read."""

_RANDOM_ESTIMATORS = ("rfa", "ra", "lara")
_PROBE_HEAD_DIM = 4  # the head dim of the construction-time probe of the options


def attention_fn(estimator: str, *, rngs: nnx.Rngs | None = None,
                 rng_collection: str = "attention", deterministic: bool = False,
                 mask_structure: str = "auto", omega: Any = None,
                 **options: Any) -> AttentionFunction:
    r"""An xattn estimator as the ``attention_fn=`` of :class:`flax.nnx.MultiHeadAttention`.

    Returns an :class:`AttentionFunction`: a callable with the signature of
    ``flax.nnx.dot_product_attention``, ``(query, key, value, bias=None, mask=None,
    ..., is_causal=False)`` with ``query (batch..., q_length, num_heads, head_dim)``,
    ``key (batch..., kv_length, num_kv_heads, head_dim)``, ``value (batch...,
    kv_length, num_kv_heads, v_dim)`` and output ``(batch..., q_length, num_heads,
    v_dim)``, which runs ``estimator`` on every head with scale ``1/sqrt(head_dim)``
    (``num_heads`` a multiple of ``num_kv_heads``: grouped-query attention, as in Flax).

    **Train/eval switch.** :class:`flax.nnx.MultiHeadAttention` passes
    ``deterministic=True`` to its ``attention_fn`` whenever its ``dropout_rate`` is 0,
    in training mode too, so that argument cannot carry the mode. The mode is instead
    the attribute ``deterministic`` of the returned object, a submodule of every layer
    that holds it: ``model.train()`` / ``model.eval()`` and
    ``nnx.view(model, deterministic=...)`` set it, as for ``flax.nnx.Dropout``
    (a per-call ``deterministic=`` of the layer does not reach it). In training mode
    (``deterministic=False``, the default) ``"rfa"`` draws new features at every call,
    ``"ra"`` and ``"lara"`` new samples; in evaluation mode nothing is drawn: ``"rfa"``
    uses fixed features (:meth:`AttentionFunction.features`, drawn from a key taken from
    ``rngs`` once, here, and kept in the module state, so checkpoints keep them), ``"ra"``
    runs ``biased=True, deterministic=True`` and ``"lara"`` ``deterministic=True``.

    **Randomness** in training mode comes from the ``rng_collection`` stream of ``rngs``
    (forked here; ``"attention"`` falls back to the ``default`` stream): each call draws
    a new key, and the stream's count is module state, so the draws differ from step to
    step under :func:`flax.nnx.jit`. A caller that passes a key as ``dropout_rng`` (with
    ``dropout_rate=0``; Flax's layer never does) draws from that key instead, which also
    works under plain :func:`jax.jit`. Without either a training-mode call of a random
    estimator raises a ``ValueError``. One function may serve several layers: they share
    its stream (each call draws a new key), its mode and RFA's evaluation features; make
    one per layer for separate features.

    **Masks.** Flax's ``mask`` (True or nonzero = attend) must be broadcastable to
    ``(batch..., num_heads, q_length, kv_length)``. A key mask (size 1 along
    ``q_length``: padding, or the fill level of Flax's ``decode=True`` cache) becomes
    the estimators' ``key_mask``, and ``is_causal=True`` their ``causal`` (top-left
    aligned). A full mask must be a padding mask ``query_valid & key_valid`` or a causal
    padding mask ``query_valid & key_valid & (m <= n)`` (Flax's ``make_attention_mask``,
    ``make_causal_mask`` and their ``combine_masks``); it is translated exactly into
    ``key_mask``, ``causal`` and zero rows for the invalid queries. Its structure is
    read from its values where they exist (``mask_structure="auto"``); under
    :func:`jax.jit` they do not, and ``mask_structure="padding"`` or ``"causal"`` declares
    it (checked where the values can be read). Any other mask raises. A query that may
    attend to no key gets a zero output row (Flax's default gives the mean of the values).

    **Other arguments.** ``dtype`` is honoured as Flax does: ``promote_dtype`` casts
    ``query``, ``key`` and ``value`` to it, and the output has it (half precision is
    accumulated in float32). ``precision`` is accepted and ignored (the estimators use
    JAX's default matmul precision). ``bias``, ``dropout_rate > 0`` and ``module``
    (``sow_weights=True``) need the attention weights, which only softmax has: with
    ``estimator="softmax"`` such a call is ``flax.nnx.dot_product_attention`` itself
    (dropout from ``dropout_rng``, following the ``deterministic`` argument, as in
    Flax); the other estimators raise a ``ValueError`` naming the argument.

    Parameters
    ----------
    estimator : {"softmax", "rfa", "ra", "lara"}
        The xattn estimator (see :class:`xattn.flax.MultiHeadAttention`).
    rngs : flax.nnx.Rngs, optional
        Source of the random draws and of RFA's evaluation features; required for
        ``"rfa"``, optional for ``"ra"`` and ``"lara"`` (then give keys as
        ``dropout_rng`` or use evaluation mode only), unused by ``"softmax"``.
    rng_collection : str
        The stream of ``rngs`` to draw from (default ``"attention"``).
    deterministic : bool
        Evaluation mode (True) or training mode (False, default), in Flax's sense.
    mask_structure : {"auto", "padding", "causal"}
        How a full ``(q_length, kv_length)`` mask is read (above).
    omega : array, shape (S, head_dim) or (num_heads, S, head_dim), optional
        ``"rfa"``: fitted samples (e.g. :func:`xattn.calibrate_omega`'s, one matrix per
        head) used in evaluation mode in place of the features drawn from ``rngs``;
        training mode still draws random features.
    **options
        The estimator's options, as for :class:`xattn.flax.MultiHeadAttention` (RFA's
        ``num_features`` defaults to ``max(d, int(d ln d))`` for the head dim d of the
        call), except LARA's ``proposal="learned"``, which needs parameters of the layer.

    Returns
    -------
    AttentionFunction
        The attention function, an :class:`flax.nnx.Module`.

    Raises
    ------
    ValueError
        Unknown ``estimator`` or ``mask_structure``, a bad option value (checked by a
        probe on a tiny input), ``proposal="learned"``, ``"rfa"`` without ``rngs``.
    TypeError
        An option the estimator does not take, or an argument of the wrong type.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import xattn.flax
    >>> rfa = xattn.flax.attention_fn("rfa", num_features=16, rngs=nnx.Rngs(0))
    >>> layer = nnx.MultiHeadAttention(4, 16, attention_fn=rfa, decode=False,
    ...                                rngs=nnx.Rngs(1))
    >>> x = jnp.ones((2, 10, 16), dtype=jnp.float32)
    >>> layer(x).shape                      # training mode: new features at every call
    (2, 10, 16)
    >>> layer.eval()                        # reaches rfa, a submodule of the layer
    >>> rfa.deterministic, bool(jnp.array_equal(layer(x), layer(x)))
    (True, True)
    """
    return AttentionFunction(estimator, rngs=rngs, rng_collection=rng_collection,
                             deterministic=deterministic, mask_structure=mask_structure,
                             omega=omega, **options)


class _Signature:
    """``__signature__`` of :class:`AttentionFunction`: the call's for an instance (the
    signature of ``flax.nnx.dot_product_attention``), the constructor's for the class
    (nnx's metaclass defines ``__call__(*args, **kwargs)``, which would be shown)."""

    def __get__(self, instance: Any, owner: type) -> inspect.Signature:
        method = getattr(owner, "__init__" if instance is None else "__call__")
        parameters = list(inspect.signature(method).parameters.values())[1:]  # no self
        return inspect.Signature(parameters)


class AttentionFunction(nnx.Module):
    """An xattn estimator with the signature of ``flax.nnx.dot_product_attention``;
    made by :func:`attention_fn` (see there for the modes, randomness and masks).

    Attributes
    ----------
    estimator : str
        The estimator's name.
    estimator_options : dict
        The options passed to it.
    deterministic : bool
        Evaluation mode (True) or training mode (False), set by ``model.eval()`` /
        ``model.train()`` and :func:`flax.nnx.view`.
    mask_structure : str
        How full masks are read.
    rngs : flax.nnx.RngStream or None
        The stream of training-mode draws.
    feature_key : xattn.flax.FeatureState or None
        ``"rfa"``: the JAX key of the evaluation features.
    """

    __signature__ = _Signature()

    def __init__(self, estimator: str, *, rngs: nnx.Rngs | None = None,
                 rng_collection: str = "attention", deterministic: bool = False,
                 mask_structure: str = "auto", omega: Any = None, **options: Any) -> None:
        probe = LayerCore()  # checks the estimator and the option values on a tiny input
        probe._setup_estimator(head_dim=_PROBE_HEAD_DIM, estimator=estimator,
                               redraw_interval=None, options=options)
        if estimator == "lara" and options.get("proposal") == "learned":
            raise ValueError("proposal='learned' needs the proposal means as parameters of a "
                             "layer; use xattn.flax.MultiHeadAttention(estimator='lara', "
                             "proposal='learned') instead of an attention_fn")
        self.estimator = estimator
        self.estimator_options = dict(options)
        self.deterministic = check_bool(deterministic, "deterministic")
        self.mask_structure = check_choice(mask_structure, "mask_structure", MASK_STRUCTURES)
        if not isinstance(rng_collection, str):
            raise TypeError(f"rng_collection must be a str, got "
                            f"{type(rng_collection).__name__} {rng_collection!r}")
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be a flax.nnx.Rngs or None, got {type(rngs).__name__}")
        if rngs is None and estimator == "rfa":
            raise ValueError("estimator='rfa' needs rngs=nnx.Rngs(...): its evaluation "
                             "features and its training draws come from it")
        self.rngs: nnx.RngStream | None = (nnx.data(None) if rngs is None
                                           else rngs[rng_collection].fork())
        self.feature_key: Any = nnx.data(None)
        if estimator == "rfa":
            assert self.rngs is not None
            self.feature_key = FeatureState(self.rngs())
        self.fitted: Any = nnx.data(None)
        if omega is not None:
            if estimator != "rfa" or getattr(omega, "ndim", 0) not in (2, 3):
                raise ValueError("omega (fitted samples, (S, head_dim) or (num_heads, S, "
                                 f"head_dim)) is an option of estimator='rfa' only; got "
                                 f"{estimator!r} and shape {getattr(omega, 'shape', None)}")
            self.fitted = FeatureState(jnp.asarray(omega))

    def set_view(self, deterministic: bool | None = None) -> None:
        """The attribute that :func:`flax.nnx.view` sets: ``deterministic``.

        Examples
        --------
        >>> from flax import nnx
        >>> import xattn.flax
        >>> ra = xattn.flax.attention_fn("ra")
        >>> nnx.view(ra, deterministic=True).deterministic, ra.deterministic
        (True, False)
        """
        if deterministic is not None:
            self.deterministic = check_bool(deterministic, "deterministic")

    def num_features(self, head_dim: int) -> int:
        """``"rfa"``: the number of features S for heads of ``head_dim`` dims (the option
        ``num_features``, or ``max(d, int(d ln d))``).

        Examples
        --------
        >>> from flax import nnx
        >>> import xattn.flax
        >>> xattn.flax.attention_fn("rfa", rngs=nnx.Rngs(0)).num_features(64)
        266
        """
        return int(self.estimator_options.get("num_features", default_num_features(head_dim)))

    def features(self, head_dim: int, dtype: Any = jnp.float32) -> jax.Array:
        """``"rfa"``: the evaluation-mode features ``omega``, ``(S, head_dim)``.

        Drawn from the module's ``feature_key`` with the feature options
        (``num_features``, ``orthogonal``, ``sample_norm``) on every call, so always the
        same for a given head dim; in evaluation mode the function equals
        :func:`xattn.rfa` with ``omega=features(head_dim)`` (in the compute dtype).

        Raises
        ------
        ValueError
            If the estimator is not ``"rfa"``.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import xattn, xattn.flax
        >>> rfa = xattn.flax.attention_fn("rfa", num_features=8, deterministic=True,
        ...                               rngs=nnx.Rngs(0))
        >>> q = jnp.ones((1, 5, 2, 4), dtype=jnp.float32)  # (batch, length, heads, dim)
        >>> omega = rfa.features(4)
        >>> omega.shape
        (8, 4)
        >>> heads = jnp.swapaxes(q, 1, 2)                  # (batch, heads, length, dim)
        >>> expected = jnp.swapaxes(xattn.rfa(heads, heads, heads, omega=omega), 1, 2)
        >>> bool(jnp.allclose(rfa(q, q, q), expected, atol=1e-6))
        True
        """
        if self.estimator != "rfa" or self.feature_key is None:
            raise ValueError(f"features exist for estimator='rfa' only, not {self.estimator!r}")
        if self.fitted is not None:  # the fitted samples given as omega=
            return jnp.asarray(self.fitted[...], dtype=dtype)
        return draw_features(self.feature_key[...], self.num_features(head_dim), head_dim,
                             self.estimator_options, xp=jnp, dtype=dtype)

    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array,
                 bias: jax.Array | None = None, mask: jax.Array | None = None,
                 broadcast_dropout: bool = True, dropout_rng: jax.Array | None = None,
                 dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
                 precision: Any = None, module: nnx.Module | None = None,
                 promote_dtype: Any = dtypes.promote_dtype, is_causal: bool = False
                 ) -> jax.Array:
        """Attention of ``query`` to ``key`` / ``value`` with the estimator, in Flax's
        layout ``(batch..., length, heads, head_dim)``; the arguments are those of
        ``flax.nnx.dot_product_attention`` (their treatment: :func:`attention_fn`).

        Raises
        ------
        ValueError
            Shapes that do not fit, a mask that is not a (causal) padding mask or whose
            structure cannot be read, ``bias`` / ``dropout_rate > 0`` / ``module`` with an
            estimator other than ``"softmax"``, a training-mode draw without a key.
        TypeError
            A flag that is not a bool, a mask that is not boolean or real.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import xattn.flax
        >>> lara = xattn.flax.attention_fn("lara", num_samples=2, deterministic=True)
        >>> q = jnp.ones((2, 6, 4, 8), dtype=jnp.float32)    # (batch, length, heads, dim)
        >>> mask = (jnp.arange(6) < 4)[None, None, None, :]  # the first 4 keys
        >>> lara(q, q, q, mask=mask).shape
        (2, 6, 4, 8)
        """
        is_causal = check_bool(is_causal, "is_causal")
        if (not isinstance(dropout_rate, numbers.Real) or isinstance(dropout_rate, bool)
                or not 0.0 <= float(dropout_rate) < 1.0):
            raise ValueError(f"dropout_rate must be a real number in [0, 1), got "
                             f"{dropout_rate!r}")
        needs_weights = {"bias": bias is not None, "dropout_rate > 0": dropout_rate > 0,
                         "module (sow_weights=True)": module is not None}
        if any(needs_weights.values()):
            return self._flax_softmax(query, key, value, bias=bias, mask=mask,
                                      broadcast_dropout=broadcast_dropout,
                                      dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                                      deterministic=deterministic, dtype=dtype,
                                      precision=precision, module=module,
                                      promote_dtype=promote_dtype, is_causal=is_causal,
                                      needs=[name for name, used in needs_weights.items()
                                             if used])
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        heads, kv_heads = _check_shapes(query, key, value)
        # (batch..., length, heads, dim) -> (batch..., heads, length, dim)
        q, k, v = (jnp.swapaxes(x, -3, -2) for x in (query, key, value))
        key_mask, query_mask, causal = self._translate_mask(
            mask, (*q.shape[:-2],), q.shape[-2], k.shape[-2])
        causal = causal or is_causal
        if kv_heads != heads:  # grouped-query attention: heads h = g * group + r
            group = heads // kv_heads
            q = _split_heads(q, -3, kv_heads, group)
            k, v = (jnp.expand_dims(x, -3) for x in (k, v))
            key_mask, query_mask = (None if m is None else _split_heads(m, -2, kv_heads, group)
                                    for m in (key_mask, query_mask))
        training = not self.deterministic
        rng, omega = None, None
        if training and self.estimator in _RANDOM_ESTIMATORS:
            rng = self._training_key(dropout_rng)
        if self.estimator == "rfa":
            head_dim, omega_dtype = q.shape[-1], compute_dtype(jnp, q.dtype)
            omega = (draw_features(rng, self.num_features(head_dim), head_dim,
                                   self.estimator_options, xp=jnp, dtype=omega_dtype)
                     if training else self.features(head_dim, omega_dtype))
            if omega.ndim == 3 and kv_heads != heads:  # per-head samples, heads split
                omega = _split_heads(omega, -3, kv_heads, heads // kv_heads)
        out = attend(self.estimator, q, k, v, options=self.estimator_options,
                     key_mask=key_mask, causal=causal, training=training, omega=omega,
                     rng=rng)
        if query_mask is not None:  # rows of queries that attend to no key
            out = jnp.where(query_mask[..., None], out, jnp.zeros((), dtype=out.dtype))
        if kv_heads != heads:
            out = jnp.reshape(out, (*out.shape[:-4], heads, *out.shape[-2:]))
        return jnp.swapaxes(out, -3, -2)

    def _training_key(self, dropout_rng: Any) -> Any:
        """The key of a training-mode draw: ``dropout_rng`` if given, else the stream's
        next key."""
        if dropout_rng is not None:
            return dropout_rng
        if self.rngs is None:
            raise ValueError(
                f"estimator={self.estimator!r} draws random samples in training mode "
                "(deterministic=False) but has no key: give rngs=nnx.Rngs(...) to "
                "xattn.flax.attention_fn, pass a key as dropout_rng to the call, or use "
                "evaluation mode (model.eval(), nnx.view(model, deterministic=True) or "
                "attention_fn(..., deterministic=True))")
        return self.rngs()

    def _flax_softmax(self, *args: Any, needs: list[str], **kwargs: Any) -> jax.Array:
        """``flax.nnx.dot_product_attention`` for softmax calls that need the attention
        weights; ``ValueError`` naming ``needs`` for the other estimators."""
        if self.estimator != "softmax":
            raise ValueError(
                f"{' and '.join(needs)} need(s) the attention weights, which "
                f"estimator={self.estimator!r} never forms; only estimator='softmax' "
                "supports bias, attention dropout (dropout_rate > 0) and sow_weights=True: "
                "set dropout_rate=0 on the layer, drop the bias or sow_weights")
        if (kwargs["dropout_rate"] > 0 and not kwargs["deterministic"]
                and kwargs["dropout_rng"] is None):
            raise ValueError("dropout_rate > 0 with deterministic=False needs a key as "
                             "dropout_rng")
        return nnx.dot_product_attention(*args, **kwargs)

    def _translate_mask(self, mask: Any, batch: tuple[int, ...], q_length: int,
                        kv_length: int) -> tuple[Any, Any, bool]:
        """Flax's ``mask`` -> ``(key_mask, query_mask, causal)`` per head: key mask
        ``(batch..., heads|1, kv_length)``, query mask ``(batch..., heads|1, q_length)``
        or None (no query without keys), and whether the mask is causal."""
        if mask is None:
            return None, None, False
        mask = jnp.asarray(mask)
        if not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.integer)
                or jnp.issubdtype(mask.dtype, jnp.floating)):
            raise TypeError(f"mask must be boolean (True = attend) or real (nonzero = attend),"
                            f" got {mask.dtype}")
        full = (*batch, q_length, kv_length)
        expected = f"broadcastable to (batch..., num_heads, q_length, kv_length) = {full}"
        try:
            fits = mask.ndim <= len(full) and jnp.broadcast_shapes(mask.shape, full) == full
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"mask must be {expected}, got shape {tuple(mask.shape)}")
        mask = jnp.reshape(mask.astype(jnp.bool_), (1,) * (len(full) - mask.ndim) + mask.shape)
        if mask.shape[-2] == 1:  # a key mask
            return mask[..., 0, :], None, False
        key_valid, query_valid = jnp.any(mask, axis=-2), jnp.any(mask, axis=-1)
        padding = query_valid[..., :, None] & key_valid[..., None, :]
        lower = jnp.arange(kv_length)[None, :] <= jnp.arange(q_length)[:, None]  # m <= n
        structure = self.mask_structure
        if isinstance(mask, jax.core.Tracer):
            if structure == "auto":
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} is a full (q_length, kv_length) mask "
                    "whose values cannot be read here (under jax.jit): declare its structure "
                    "with xattn.flax.attention_fn(..., mask_structure='causal') (a causal "
                    "padding mask) or mask_structure='padding', or pass a key mask "
                    "(batch..., 1, 1, kv_length) and is_causal=True")
        else:
            is_padding = bool(jnp.array_equal(mask, jnp.broadcast_to(padding, mask.shape)))
            is_causal = bool(jnp.array_equal(mask, jnp.broadcast_to(padding & lower,
                                                                    mask.shape)))
            found = "padding" if is_padding else "causal" if is_causal else None
            if structure == "auto":
                structure = found or structure
            if structure not in (found, "causal" if is_causal else None):
                wanted = {"auto": "neither a padding mask (query_valid & key_valid) nor a "
                                  "causal padding mask (query_valid & key_valid & (m <= n))",
                          "padding": "not a padding mask (query_valid & key_valid), as "
                                     "mask_structure='padding' declares",
                          "causal": "not a causal padding mask (query_valid & key_valid & "
                                    "(m <= n)), as mask_structure='causal' declares"}
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} is {wanted[self.mask_structure]}; "
                    "the estimators cannot apply an arbitrary (q_length, kv_length) mask. "
                    "Use a key mask (batch..., 1, 1, kv_length) with is_causal=True, or "
                    "estimator='softmax' with flax.nnx.dot_product_attention")
        return key_valid, query_valid, structure == "causal"


def _check_shapes(query: jax.Array, key: jax.Array, value: jax.Array) -> tuple[int, int]:
    """``ValueError`` unless the arrays have Flax's layout ``(batch..., length, heads,
    dim)`` with matching batch dims, head dims and lengths; returns the query heads and
    the key-value heads (a divisor)."""
    shapes = {"query": query.shape, "key": key.shape, "value": value.shape}
    if any(len(shape) < 3 for shape in shapes.values()):
        raise ValueError(f"query, key and value must be (batch..., length, num_heads, "
                         f"head_dim) arrays, got shapes {shapes}")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(f"query, key and value must have the same batch dims, got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same head_dim (last dim), got {shapes}")
    if key.shape[-3:-1] != value.shape[-3:-1]:
        raise ValueError(f"key and value must have the same length and heads, got {shapes}")
    heads, kv_heads = query.shape[-2], key.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"the query heads ({heads}) must be a multiple of the key-value "
                         f"heads ({kv_heads}) (grouped-query attention), got {shapes}")
    return heads, kv_heads


def _split_heads(x: jax.Array, axis: int, kv_heads: int, group: int) -> jax.Array:
    """``x`` with its heads axis (``num_heads`` or 1 entries) split into ``(kv_heads,
    group)`` (or ``(1, 1)``)."""
    axis %= x.ndim
    parts = (kv_heads, group) if x.shape[axis] != 1 else (1, 1)
    return jnp.reshape(x, (*x.shape[:axis], *parts, *x.shape[axis + 1:]))

