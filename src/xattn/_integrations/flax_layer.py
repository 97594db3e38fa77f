"""The Flax half of :class:`xattn.flax.MultiHeadAttention` that is not the layer itself.

* **Flax's key mask** (:func:`key_mask`): ``(batch..., 1 or heads, 1, kv_length)``, True
  = attend, checked and converted to xattn's ``key_mask``.
* **Generation** (:class:`Decoding`): the cache of ``decode=True`` calls, as
  :class:`flax.nnx.MultiHeadAttention` keeps it (``init_cache``, ``set_view`` for
  :func:`flax.nnx.view`).
* **Displayed signatures** (:func:`variable_signature`, :func:`constructor_signature`):
  nnx's metaclasses define ``__call__(*args, **kwargs)``, which :func:`inspect.signature`
  and Sphinx would show as a class's signature; the layer module sets ``__signature__``
  from these.

Framework code (it imports Flax), kept apart from ``xattn/flax.py`` so that the layer
module stays short; loaded with :mod:`xattn.flax`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xattn._core.options import check_bool
from xattn._integrations.layers import FIXED_SIZE_STATES, LayerCore, check_features_shape

__all__ = ["Decoding", "FeatureState", "constructor_signature", "key_mask",
           "variable_signature"]


def key_mask(mask: Any, kv_length: int, num_heads: int) -> Any:
    """Flax's mask ``(batch..., heads|1, 1, kv_length)``, True = attend -> ``key_mask``
    ``(batch..., heads|1, kv_length)``; ``ValueError`` naming the wrong dim, ``TypeError``
    for a mask that is not boolean."""
    if mask is None:
        return None
    shape = tuple(mask.shape)
    expected = f"(batch..., 1 or {num_heads}, 1, {kv_length})"
    if len(shape) < 3:
        raise ValueError(f"mask must be a key mask of shape {expected}, got {shape}")
    if shape[-2] != 1:
        raise ValueError(
            f"mask must be a key mask of shape {expected}, got {shape}: linear "
            "estimators cannot apply a full (q_length, kv_length) mask; use "
            "is_causal=True for causal masking"
        )
    if shape[-1] != kv_length:
        raise ValueError(f"mask must be a key mask of shape {expected}, got {shape}: its "
                         f"last dim must be the key length {kv_length}")
    if shape[-3] not in (1, num_heads):
        raise ValueError(
            f"mask must be a key mask of shape {expected}, got {shape}: its head dim "
            f"(-3) has {shape[-3]} entries but the layer has num_heads={num_heads}; "
            "use 1 to share the mask across heads"
        )
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype}")
    return mask[..., 0, :]  # (batch..., heads|1, kv_length)


class Decoding(LayerCore):
    """The generation methods of :class:`xattn.flax.MultiHeadAttention` (a base class of
    it): the ``cache`` and ``cache_index`` variables (:class:`flax.nnx.Cache`) and the
    decoding step that continues them."""

    in_features: int
    num_heads: int
    deterministic: bool
    decode: bool
    features: Any
    proposal_means: Any
    cache: Any
    cache_index: Any

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        """Begin a sequence for generation with ``decode=True``, as
        :meth:`flax.nnx.MultiHeadAttention.init_cache` does.

        Sets the variables ``cache`` (the estimator's state of no tokens) and
        ``cache_index`` (the tokens seen, 0), of type :class:`flax.nnx.Cache`. Call it
        again to begin a new sequence. ``"rfa"``: an :class:`xattn.RFAState` of fixed size
        with the layer's ``features``, which the sequence keeps (a decoding call refuses a
        cache whose features are no longer the layer's, where it can compare them: not
        under :func:`flax.nnx.jit`, which goes on with the cache's); no length limit.
        ``"lara"`` with ``proposal="learned"``: an :class:`xattn.LARAState` of fixed size
        whose samples are the layer's proposal means at this call (evaluation mode's
        samples, kept by the sequence); no length limit.
        ``"softmax"`` and ``"ra"``: a key-value cache of ``max_length`` slots (a
        decoding call refuses tokens past them where it can read ``cache_index``).

        Parameters
        ----------
        input_shape : tuple of int
            ``(batch..., max_length, in_features)``: the shape of an input holding the
            whole sequence (``max_length`` is unused by ``"rfa"`` and ``"lara"``).
        dtype : dtype
            Of the cached arrays: that of the projected tokens (float32 for half
            precision).

        Raises
        ------
        ValueError
            ``estimator="lara"`` with options that look ahead (segment proposals: use
            ``proposal="learned"``); ``input_shape`` of fewer than 2 dims, a size below 1 or
            a last dim other than ``in_features``.
        TypeError
            ``input_shape`` not a tuple of ints.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import xattn.flax
        >>> layer = xattn.flax.MultiHeadAttention(4, 16, estimator="softmax",
        ...                                       rngs=nnx.Rngs(0))
        >>> x = jnp.ones((2, 10, 16), dtype=jnp.float32)
        >>> layer.init_cache(x.shape)
        >>> prompt = layer(x[:, :6], decode=True)
        >>> token = layer(x[:, 6:7], decode=True)
        >>> int(layer.cache_index[...]), layer.cache.get_value().keys.shape
        (7, (2, 4, 10, 4))
        """
        self._require_causal_estimator("init_cache")
        if not isinstance(input_shape, tuple | list) or not all(
                isinstance(size, int) and not isinstance(size, bool) for size in input_shape):
            raise TypeError(f"input_shape must be a tuple of ints (batch..., max_length, "
                            f"in_features), got {input_shape!r}")
        if len(input_shape) < 2 or min(input_shape) < 1 or input_shape[-1] != self.in_features:
            raise ValueError(f"input_shape must be (batch..., max_length, {self.in_features}) "
                             f"with sizes >= 1, got {tuple(input_shape)}")
        features = self._estimator_features()
        batch = (*input_shape[:-2], self.num_heads)
        self.cache = nnx.Cache(self._empty_cache(jnp, batch, input_shape[-2], dtype, None,
                                                 features))
        self.cache_index = nnx.Cache(jnp.zeros((), dtype=jnp.int32))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | tuple[int, ...] | None = None,
                 max_length: int | None = None) -> None:
        """The attributes that :func:`flax.nnx.view` sets, as for
        :class:`flax.nnx.MultiHeadAttention`: ``deterministic``, ``decode``, and with
        ``decode=True`` a cache of ``batch_size`` sequences of ``max_length`` tokens if
        there is none yet (:meth:`init_cache`; ``max_length`` may be None for ``"rfa"``).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import xattn.flax
        >>> layer = xattn.flax.MultiHeadAttention(4, 16, estimator="rfa", rngs=nnx.Rngs(0))
        >>> decoder = nnx.view(layer, decode=True, deterministic=True, batch_size=2,
        ...                    max_length=None)
        >>> decoder(jnp.ones((2, 3, 16), dtype=jnp.float32)).shape, int(decoder.cache_index[...])
        ((2, 3, 16), 3)
        """
        if deterministic is not None:
            self.deterministic = check_bool(deterministic, "deterministic")
        if decode is None:
            return
        self.decode = check_bool(decode, "decode")
        if self.decode and self.cache is None:
            if batch_size is None or (max_length is None
                                      and self.estimator not in FIXED_SIZE_STATES):
                raise TypeError("decode=True without a cache needs batch_size and "
                                "max_length to make one (or call init_cache first)")
            batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
            self.init_cache((*batch, max_length or 1, self.in_features))

    def _estimator_features(self) -> jax.Array | None:
        """What reaches the estimator as ``omega``: RFA's features, or LARA's learned
        proposal means (evaluation mode's samples); None for the other estimators."""
        if self.proposal_means is not None:
            return self.proposal_means[...]
        return None if self.features is None else self._checked_features()[...]

    def _checked_features(self) -> Any:
        """The ``features`` variable of an ``"rfa"`` layer, ``(S, head_dim)`` shared by the
        heads or ``(num_heads, S, head_dim)`` one matrix per head (or ``(1, S, head_dim)``);
        ``TypeError`` for a plain array, ``ValueError`` naming ``features`` for another
        shape (read at every call, redraw and :meth:`init_cache`: the user may assign
        fitted samples between them)."""
        features = self.features
        if not isinstance(features, nnx.Variable):
            raise TypeError(f"features must be a xattn.flax.FeatureState (module state), got "
                            f"{type(features).__name__}: assign fitted samples with "
                            "layer.features = xattn.flax.FeatureState(omega)")
        check_features_shape(tuple(features.shape), self.head_dim, self.num_heads, "got")
        return features

    def _decode_step(self, q: jax.Array, k: jax.Array, v: jax.Array, key_mask: Any,
                     deterministic: bool, key: Any) -> jax.Array:
        """The heads of the new tokens after those in the cache, which they join."""
        if self.cache is None or self.cache_index is None:
            raise ValueError("decode=True needs the cache: call init_cache(input_shape) first "
                             "(or nnx.view(layer, decode=True, batch_size=..., max_length=...))")
        heads, state, index = self._decode(
            q, k, v, key_mask=key_mask, training=not deterministic, rng=key,
            features=self._estimator_features(),
            cache=self.cache.get_value(), index=self.cache_index[...], name="cache",
            restart="call init_cache to begin a new sequence")
        self.cache.set_value(state)
        self.cache_index[...] = index
        return heads


def variable_signature() -> inspect.Signature:
    """The signature of an :class:`flax.nnx.Variable` subclass's constructor:
    ``nnx.Variable.__init__``'s without ``self`` and without the annotations (Flax's type
    variables, shown as strings)."""
    parameters = list(inspect.signature(nnx.Variable.__init__).parameters.values())[1:]
    return inspect.Signature([parameter.replace(annotation=inspect.Parameter.empty)
                              for parameter in parameters])


class FeatureState(nnx.Variable):
    """Non-trainable state of :class:`xattn.flax.MultiHeadAttention`: the RFA samples and
    the count of training steps since they were drawn (not a :class:`flax.nnx.Param`, so
    optimizers leave it alone; it is saved and restored with the rest of the state).

    Constructed as any :class:`flax.nnx.Variable`: ``FeatureState(value, **metadata)``.
    """
    # public as xattn.flax.FeatureState; defined here so that the attention function
    # (xattn._integrations.flax_attention_fn) uses it without importing xattn.flax (no
    # import circle)


# nnx.Variable's metaclass defines ``__call__(*args, **kwargs)``, which inspect.signature
# and Sphinx would show as the class signature: expose the constructor's instead.
# (inspect reads __signature__ off any object; typeshed does not declare it on classes)
FeatureState.__signature__ = variable_signature()  # type: ignore[attr-defined]
FeatureState.__module__ = "xattn.flax"  # where users import it (and Sphinx documents it)


class _SourceName:
    """A default value shown by its name in the source (functions and dtypes would show as
    ``<function ... at 0x...>``); for the displayed signature only."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def constructor_signature(init: Callable[..., Any], names: dict[str, str]) -> inspect.Signature:
    """The signature of a class whose constructor is ``init``: without ``self``, the
    defaults of the parameters in ``names`` shown as the source names them."""
    parameters = list(inspect.signature(init).parameters.values())[1:]
    return inspect.Signature([
        parameter.replace(default=_SourceName(names[parameter.name]))
        if parameter.name in names else parameter for parameter in parameters
    ])
