r"""Flax (NNX) multi-head attention layer backed by an xattn estimator.

:class:`MultiHeadAttention` is shaped after :class:`flax.nnx.MultiHeadAttention` (same
constructor arguments where they apply, same submodules ``query``, ``key``, ``value`` and
``out`` of type :class:`flax.nnx.LinearGeneral`, same input layout ``(batch..., length,
features)`` and ``__call__`` signature), so its parameters can be exchanged with Flax's
layer.

Training and evaluation follow Flax's convention: the attribute ``deterministic`` (set by
``model.train()`` / ``model.eval()``, or overridden per call) selects the mode, as it does
for ``flax.nnx.Dropout`` and :class:`flax.nnx.MultiHeadAttention`. ``deterministic=True``
is evaluation mode, in which the layer draws nothing; it is not the ``deterministic``
keyword of :func:`xattn.ra` and :func:`xattn.lara`, which only drops their noise (see
:class:`MultiHeadAttention`).
Randomness comes from the ``rng_collection`` stream (default ``"attention"``, which falls
back to the ``default`` stream) of the :class:`flax.nnx.Rngs` given at construction, or
from ``rngs=`` passed to the call. Everything works under :func:`flax.nnx.jit`.

For Flax's own :class:`flax.nnx.MultiHeadAttention`, :func:`attention_fn` makes an
estimator its ``attention_fn=`` (an :class:`AttentionFunction`).

This module needs Flax, so ``import xattn`` does not import it: it is loaded on the first
use of ``xattn.flax`` (or by ``import xattn.flax``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xattn._core.docstrings import fill_docstring
from xattn._core.options import check_bool, check_sizes, lara_num_samples
from xattn._integrations.flax_attention_fn import AttentionFunction, attention_fn
from xattn._integrations.flax_layer import Decoding, FeatureState, constructor_signature
from xattn._integrations.flax_layer import key_mask as flax_key_mask
from xattn._integrations.layers import (
    DEFAULT_LARA_SAMPLES,
    ESTIMATOR_OPTIONS_DOC,
    ESTIMATORS,
    draw_features,
    learned_proposal_means,
    module_docstring,
)

__all__ = ["DEFAULT_LARA_SAMPLES", "ESTIMATORS", "AttentionFunction", "FeatureState",
           "MultiHeadAttention", "attention_fn"]

__doc__ = module_docstring(__doc__, features_home="the variable ``features`` (a "
                                                  ":class:`FeatureState`, part of the module "
                                                  "state)")

default_kernel_init = nnx.initializers.lecun_normal()  # Flax's default for projections
default_bias_init = nnx.initializers.zeros_init()


#: The first lines of the Examples sections below.
_EXAMPLES_OPENING = """\
Examples
--------
>>> import jax.numpy as jnp
>>> from flax import nnx
>>> import xattn.flax"""


@fill_docstring(examples=_EXAMPLES_OPENING, estimator_options=ESTIMATOR_OPTIONS_DOC)
class MultiHeadAttention(Decoding, nnx.Module):
    r"""Multi-head attention with an xattn estimator, shaped after
    :class:`flax.nnx.MultiHeadAttention`.

    .. math::

        \mathrm{head}_i = \mathrm{attention}(x_q W_i^Q, x_k W_i^K, x_v W_i^V), \quad
        \mathrm{output} = \sum_i \mathrm{head}_i W_i^O

    where ``attention`` is the chosen estimator of softmax attention with scale
    ``1/sqrt(head_dim)``.

    **Training and evaluation.** ``estimator="rfa"``: the samples :math:`\omega`
    (variable ``features``, shape ``(num_features, head_dim)``, shared by all heads, or
    ``(num_heads, num_features, head_dim)``, one matrix per head, when such an array is
    assigned with ``layer.features = FeatureState(omega)`` or restored with
    ``flax.nnx.update``: fitted samples, say; another shape raises a ``ValueError``
    naming ``features`` at the next call) are redrawn at the start of a training-mode
    call once ``redraw_interval`` training calls have used them (the choice is made with
    :func:`jax.numpy.where`, so it works under :func:`flax.nnx.jit`; per-head features
    are redrawn one matrix per head); never in evaluation mode, which uses them as they
    are; :meth:`redraw_features` redraws by hand. ``"lara"``: random samples in training
    mode, ``deterministic=True`` in evaluation mode. ``"ra"``: the unbiased random
    estimator in training mode, ``biased=True, deterministic=True`` in evaluation mode.
    Evaluation outputs are deterministic for every estimator.

    Attention weights are never materialized (there is no ``sow_weights``). Supported
    masks are key masks ``mask`` of shape ``(batch..., 1 or num_heads, 1, kv_length)``
    (True = attend, as in Flax) and causal masking with ``is_causal=True``; a full
    ``(q_length, kv_length)`` mask raises.

    **Generation** follows :class:`flax.nnx.MultiHeadAttention`: :meth:`init_cache`
    creates the ``cache`` and ``cache_index`` variables (:class:`flax.nnx.Cache`), and
    calls with ``decode=True`` attend their new tokens (a prompt, one token, a chunk)
    causally to every token before and update the cache; the outputs are those of one
    ``is_causal=True`` call on the whole sequence. ``cache`` holds the estimator's state:
    :class:`xattn.RFAState` for ``"rfa"`` (fixed size, whatever the length),
    :class:`xattn.LARAState` for ``"lara"`` with ``proposal="learned"`` (fixed size), a
    :class:`xattn.SoftmaxState` or :class:`xattn.RAState` of ``max_length`` slots for
    ``"softmax"`` and ``"ra"``. A decoding step traces once under :func:`flax.nnx.jit`.

    Parameters
    ----------
    num_heads : int
        Number of heads h; ``qkv_features`` must be divisible by it.
    in_features : int
        Features of the query inputs.
    qkv_features : int, optional
        Total features of the projected queries, keys and values (default
        ``in_features``).
    out_features : int, optional
        Output features (default ``in_features``).
    in_kv_features : int, optional
        Features of the key and value inputs (default ``in_features``).
    estimator : {"softmax", "rfa", "ra", "lara"}
        The attention estimator (default ``"lara"``).
    redraw_interval : int or None
        ``"rfa"`` only: redraw the features after this many training calls; ``None``
        keeps them fixed until :meth:`redraw_features`.
    use_bias, dtype, param_dtype, kernel_init, bias_init
        As in :class:`flax.nnx.LinearGeneral` (the projections).
    deterministic : bool
        Evaluation mode (True) or training mode (False, default), in Flax's sense (as for
        ``flax.nnx.Dropout``); ``model.eval()`` and ``model.train()`` set it. In
        evaluation mode the layer draws nothing: ``"rfa"`` keeps its features, ``"ra"``
        runs ``biased=True, deterministic=True`` and ``"lara"`` ``deterministic=True``. (The
        estimators' own ``deterministic`` only drops the noise of the samples.)
    decode : bool
        Generation mode (default False), as in :class:`flax.nnx.MultiHeadAttention`:
        calls continue the sequence in the cache (see :meth:`init_cache`); overridden per
        call. With ``estimator="lara"``, only with options that do not look ahead
        (``proposal="learned"``).
    rng_collection : str
        Name of the RNG stream the random draws come from.
    rngs : flax.nnx.Rngs
        Parameter initialization and the random stream.
    {{estimator_options}}

    Raises
    ------
    ValueError
        ``qkv_features`` not divisible by ``num_heads``, unknown ``estimator``,
        sizes or ``redraw_interval`` below 1, or a bad option value (checked here, before
        any call).
    TypeError
        An option the estimator does not take, or an argument or option of the wrong
        type (a float ``num_samples``, a non-bool ``deterministic``, ...).

    {{examples}}
    >>> layer = xattn.flax.MultiHeadAttention(4, 16, estimator="rfa", num_features=32,
    ...                                       rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 10, 16), dtype=jnp.float32)
    >>> layer(x).shape
    (2, 10, 16)
    >>> layer.features.shape
    (32, 4)
    >>> layer.eval()
    >>> bool(jnp.array_equal(layer(x), layer(x)))
    True
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        *,
        in_kv_features: int | None = None,
        estimator: str = "lara",
        redraw_interval: int | None = 1000,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = default_kernel_init,
        bias_init: Any = default_bias_init,
        deterministic: bool = False,
        decode: bool = False,
        rng_collection: str = "attention",
        rngs: nnx.Rngs,
        **estimator_options: Any,
    ) -> None:
        check_sizes(num_heads=num_heads, in_features=in_features, qkv_features=qkv_features,
                    out_features=out_features, in_kv_features=in_kv_features)
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features if qkv_features is not None else in_features
        self.out_features = out_features if out_features is not None else in_features
        self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
        if self.qkv_features % num_heads != 0:
            raise ValueError(f"qkv_features ({self.qkv_features}) must be divisible by "
                             f"num_heads ({num_heads})")
        use_bias = check_bool(use_bias, "use_bias")
        deterministic = check_bool(deterministic, "deterministic")
        decode = check_bool(decode, "decode")
        if not isinstance(rng_collection, str):
            raise TypeError(f"rng_collection must be a str, got "
                            f"{type(rng_collection).__name__} {rng_collection!r}")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
        self._setup_estimator(head_dim=self.qkv_features // num_heads, estimator=estimator,
                              redraw_interval=redraw_interval, options=estimator_options)
        self.deterministic = deterministic
        self.decode = decode
        if decode:
            self._require_causal_estimator("decode=True")
        self.rng_collection = rng_collection

        projection = {"use_bias": use_bias, "dtype": dtype, "param_dtype": param_dtype,
                      "kernel_init": kernel_init, "bias_init": bias_init, "rngs": rngs}
        heads = (num_heads, self.head_dim)
        self.query = nnx.LinearGeneral(in_features, heads, **projection)
        self.key = nnx.LinearGeneral(self.in_kv_features, heads, **projection)
        self.value = nnx.LinearGeneral(self.in_kv_features, heads, **projection)
        self.out = nnx.LinearGeneral(heads, self.out_features, axis=(-2, -1), **projection)
        self.rngs = rngs[rng_collection].fork()

        # None unless the estimator is "rfa"
        self.features: FeatureState | None
        self.steps_since_redraw: FeatureState | None
        if estimator == "rfa":
            self.features = FeatureState(self._draw_features(self.rngs()))
            self.steps_since_redraw = FeatureState(jnp.zeros((), dtype=jnp.int32))
        else:
            self.features = nnx.data(None)
            self.steps_since_redraw = nnx.data(None)
        # LARA's learned proposal means (num_heads, C, head_dim), a parameter
        self.proposal_means: nnx.Param | None = nnx.data(None)
        if self.learned_proposals:
            seed = int(jax.random.randint(self.rngs(), (), 0, 2 ** 31 - 1))
            self.proposal_means = nnx.Param(jnp.asarray(learned_proposal_means(
                seed, num_heads, lara_num_samples(estimator_options), self.head_dim),
                dtype=param_dtype))
        # the estimator's state and the count of tokens seen; set by init_cache
        self.cache: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def _draw_features(self, key: Any, heads: tuple[int, ...] = ()) -> jax.Array:
        """A ``(num_features, head_dim)`` draw, or ``heads + (num_features, head_dim)``
        of independent draws (per-head features: one matrix per head)."""
        assert self.num_features is not None  # set for "rfa" by _setup_estimator
        if heads:
            keys = jax.random.split(key, math.prod(heads))
            return jnp.stack([self._draw_features(one) for one in keys]).reshape(
                *heads, self.num_features, self.head_dim)
        return draw_features(key, self.num_features, self.head_dim, self.estimator_options,
                             xp=jnp, dtype=jnp.float32)

    def redraw_features(self, rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None
                        ) -> None:
        """Draw new RFA samples ``features`` in place of the old and restart the count.

        A training-mode call does this itself every ``redraw_interval`` calls; call it by
        hand to redraw at other times (for example with ``redraw_interval=None``). The
        draw uses the feature options given at construction; ``steps_since_redraw`` is
        reset to 0. Per-head features ``(num_heads, num_features, head_dim)`` get
        ``num_heads`` independent draws.

        Parameters
        ----------
        rngs : flax.nnx.Rngs, flax.nnx.RngStream or JAX key, optional
            Source of the draw (the ``rng_collection`` stream of an :class:`flax.nnx.Rngs`);
            default: the layer's own stream.

        Raises
        ------
        ValueError
            If the layer's estimator is not ``"rfa"``, or ``features`` has a shape other
            than ``(S, head_dim)`` or ``(num_heads, S, head_dim)``.
        TypeError
            ``features`` not a :class:`FeatureState` (a plain array).

        Examples
        --------
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import xattn.flax
        >>> layer = xattn.flax.MultiHeadAttention(4, 16, estimator="rfa", num_features=8,
        ...                                       redraw_interval=None, rngs=nnx.Rngs(0))
        >>> before = layer.features[...]
        >>> layer.redraw_features(jax.random.key(1))
        >>> layer.features.shape, bool(jnp.array_equal(layer.features[...], before))
        ((8, 4), False)
        >>> int(layer.steps_since_redraw[...])
        0
        >>> layer.features = xattn.flax.FeatureState(jnp.ones((4, 8, 4)))  # one per head
        >>> layer.redraw_features(jax.random.key(2))
        >>> layer.features.shape
        (4, 8, 4)
        """
        self._require_rfa("redraw_features")
        assert self.steps_since_redraw is not None  # "rfa"
        features = self._checked_features()  # per-head features (h, S, d): h draws
        features[...] = self._draw_features(self._next_key(rngs), features.shape[:-2])
        self.steps_since_redraw[...] = jnp.zeros((), dtype=jnp.int32)

    def _next_key(self, rngs: Any) -> jax.Array:
        if rngs is None:
            return self.rngs()
        if isinstance(rngs, nnx.Rngs):
            return rngs[self.rng_collection]()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        return rngs  # a JAX key

    @fill_docstring(examples=_EXAMPLES_OPENING)
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        is_causal: bool = False,
        decode: bool | None = None,
    ) -> jax.Array:
        """Attend ``inputs_q`` to ``inputs_k`` / ``inputs_v`` with the layer's estimator.

        Projects the inputs to ``num_heads`` heads (the submodules ``query``, ``key`` and
        ``value``), runs the estimator on every head, and projects the heads back with
        ``out``. In training mode (``deterministic=False``) the estimator draws from
        ``rngs`` or the layer's stream, and ``"rfa"`` redraws its features when
        ``redraw_interval`` calls have used them; evaluation mode is deterministic.
        Works under :func:`flax.nnx.jit`.

        Parameters
        ----------
        inputs_q : array, shape (batch..., q_length, in_features)
        inputs_k : array, shape (batch..., kv_length, in_kv_features), optional
            Default ``inputs_q`` (self attention).
        inputs_v : array, shape (batch..., kv_length, in_kv_features), optional
            Default ``inputs_k``.
        mask : bool array, shape (batch..., 1 or num_heads, 1, kv_length), optional
            True where a key is attended (a key mask, for example padding).
        deterministic : bool, optional
            Evaluation mode (no random draws, see the class); overrides the attribute
            ``deterministic``.
        rngs : flax.nnx.Rngs, flax.nnx.RngStream or JAX key, optional
            Source of this call's random draws; default: the layer's stream.
        is_causal : bool
            Causal masking (query n attends keys m <= n, top-left aligned).
        decode : bool, optional
            Generation (overrides the attribute ``decode``): the inputs are the next
            tokens of the sequence in the cache (:meth:`init_cache`), attended causally
            whatever ``is_causal``, and join the cache; ``mask`` masks the new keys. Never
            redraws the features nor counts towards ``redraw_interval``.

        Returns
        -------
        array, shape (batch..., q_length, out_features)

        Raises
        ------
        ValueError
            Inputs whose last dim is not ``in_features`` / ``in_kv_features``;
            ``inputs_v`` without ``inputs_k``; a ``mask`` that is not a key mask of shape
            ``(batch..., 1 or num_heads, 1, kv_length)`` (the message names the wrong
            dim); causal masking with ``estimator="lara"`` and options that look ahead;
            with LARA's ``grid``, sequences of other than H W tokens. ``decode=True``: no
            cache (call :meth:`init_cache`), ``estimator="lara"`` with options that look
            ahead (use ``proposal="learned"``), keys of another length than the
            queries, a batch other than the cache's, ``"rfa"`` features redrawn since
            :meth:`init_cache`, more tokens than ``max_length`` (the last two checked
            outside :func:`flax.nnx.jit` only). ``"rfa"``: ``features`` of a shape other
            than ``(S, head_dim)`` or ``(num_heads, S, head_dim)``.
        TypeError
            ``features`` not a :class:`FeatureState` (a plain array); a ``mask`` that is
            not boolean; ``deterministic`` (when given), ``is_causal``
            or ``decode`` not a bool (NumPy bools are accepted).

        {{examples}}
        >>> layer = xattn.flax.MultiHeadAttention(4, 16, estimator="ra", num_samples=2,
        ...                                       rngs=nnx.Rngs(0))
        >>> x = jnp.ones((2, 10, 16), dtype=jnp.float32)
        >>> lengths = jnp.array([10, 7])  # the second sequence has 7 tokens
        >>> mask = (jnp.arange(10) < lengths[:, None])[:, None, None, :]  # (2, 1, 1, 10)
        >>> layer(x, mask=mask).shape
        (2, 10, 16)

        The same key gives the same draws; evaluation mode draws nothing:

        >>> first = layer(x, rngs=nnx.Rngs(attention=5))
        >>> bool(jnp.array_equal(first, layer(x, rngs=nnx.Rngs(attention=5))))
        True
        >>> bool(jnp.array_equal(layer(x, deterministic=True), layer(x, deterministic=True)))
        True

        Generation: a prompt, then one token at a time, under :func:`flax.nnx.jit`; the
        outputs are those of one causal call:

        >>> layer.eval()
        >>> layer.init_cache(x.shape)
        >>> step = nnx.jit(lambda layer, tokens: layer(tokens, decode=True))
        >>> pieces = [step(layer, x[:, :6])] + [step(layer, x[:, t:t + 1]) for t in range(6, 10)]
        >>> bool(jnp.allclose(jnp.concatenate(pieces, axis=1), layer(x, is_causal=True),
        ...                   atol=1e-5))
        True
        """
        deterministic = (self.deterministic if deterministic is None
                         else check_bool(deterministic, "deterministic"))
        is_causal = check_bool(is_causal, "is_causal")
        decode = self.decode if decode is None else check_bool(decode, "decode")
        if decode:
            self._require_causal_estimator("decode=True")
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_k cannot be None if inputs_v is given; pass the "
                                 "same array as inputs_k for keys equal to values")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"inputs_q must have {self.in_features} features in its last "
                             f"dim, got shape {inputs_q.shape}")
        for name, inputs in (("inputs_k", inputs_k), ("inputs_v", inputs_v)):
            if inputs.shape[-1] != self.in_kv_features:
                raise ValueError(f"{name} must have {self.in_kv_features} features in its "
                                 f"last dim, got shape {inputs.shape}")
        key_mask = flax_key_mask(mask, inputs_k.shape[-2], self.num_heads)

        # (batch..., length, heads, head_dim) -> (batch..., heads, length, head_dim)
        q, k, v = (jnp.swapaxes(projection(inputs), -3, -2) for projection, inputs in (
            (self.query, inputs_q), (self.key, inputs_k), (self.value, inputs_v)))
        key = None
        if self.estimator in ("ra", "lara") and not deterministic:
            key = self._next_key(rngs)
        if decode:
            heads = self._decode_step(q, k, v, key_mask, deterministic, key)
            return self.out(jnp.swapaxes(heads, -3, -2))
        if self._counts_training_steps(not deterministic):
            # an "rfa" layer (see _counts_training_steps) holds both
            assert self.steps_since_redraw is not None
            features = self._checked_features()
            redraw, steps = self._redraw_schedule(self.steps_since_redraw[...], jnp.where)
            fresh = self._draw_features(self._next_key(rngs), features.shape[:-2])
            features[...] = jnp.where(redraw, fresh, features[...])
            self.steps_since_redraw[...] = steps
        heads = self._estimate(q, k, v, key_mask=key_mask, causal=is_causal,
                               training=not deterministic, features=self._estimator_features(),
                               rng=key)
        return self.out(jnp.swapaxes(heads, -3, -2))

# nnx.Module's metaclass defines ``__call__(*args, **kwargs)``, which inspect.signature and
# Sphinx would show as the class signature: expose the constructor's instead.
# (inspect reads __signature__ off any object; typeshed does not declare it on classes)
MultiHeadAttention.__signature__ = constructor_signature(  # type: ignore[attr-defined]
    MultiHeadAttention.__init__, {"param_dtype": "jnp.float32",
                                  "kernel_init": "default_kernel_init",
                                  "bias_init": "default_bias_init"})
