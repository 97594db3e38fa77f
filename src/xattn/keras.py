r"""Keras 3 multi-head attention layer backed by an xattn estimator.

:class:`MultiHeadAttention` is shaped after ``keras.layers.MultiHeadAttention``: the same
constructor arguments where they apply, the same projections (``EinsumDense`` sublayers
``query``, ``key``, ``value`` and ``attention_output`` with the same kernel shapes, so
weights can be copied between the two layers), the same call signature (``query``,
``value``, ``key``, ``attention_mask``, ``use_causal_mask``, ``training``) and the same
Keras masks. It is registered for serialization (``get_config``, ``.keras`` files) under
the package name ``"xattn"``.

The layer runs on the Keras backends ``"jax"`` and ``"torch"``: the attention is computed
by xattn's estimators directly on the backend's tensors (JAX arrays and torch tensors
have an Array API namespace), under the ``jit`` of ``model.fit`` on JAX too. On any other
backend (TensorFlow, whose tensors have no Array API namespace) the layer raises a
``ValueError`` naming the supported backends. Under a mixed-precision policy
(``"mixed_bfloat16"``, ``"mixed_float16"``) the projections and the output are in the
compute dtype, the estimators accumulate in float32, and the variables stay float32.

Randomness comes from a ``keras.random.SeedGenerator`` seeded by ``seed`` (as for
``keras.layers.Dropout``): its state is a variable of the layer, advanced by every random
draw, so ``keras.utils.set_random_seed`` makes runs reproducible.

This module needs Keras 3, so ``import xattn`` does not import it: it is loaded on the first
use of ``xattn.keras`` (or by ``import xattn.keras``). Keras chooses its backend when it is
first imported (``KERAS_BACKEND``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    import keras
except ModuleNotFoundError as error:  # the configured backend's library is missing
    if error.name in (None, "keras"):
        raise
    raise ImportError(
        f"Keras could not be imported ({error}): xattn's Keras layer runs on the Keras "
        "backends 'jax' and 'torch'; set the environment variable KERAS_BACKEND=jax or "
        "KERAS_BACKEND=torch before importing keras"
    ) from error

from xattn._core.docstrings import fill_docstring
from xattn._core.options import check_bool, check_nonnegative_int, check_sizes, lara_num_samples
from xattn._integrations.keras_layer import (
    SUPPORTED_BACKENDS,
    KerasGenerator,
    backend_namespace,
    check_backend,
    key_padding_mask,
    masks_detached,
    projection_equations,
)
from xattn._integrations.layers import (
    DEFAULT_LARA_SAMPLES,
    ESTIMATOR_OPTIONS,
    ESTIMATOR_OPTIONS_DOC,
    ESTIMATORS,
    LayerCore,
    draw_features,
    module_docstring,
)

__all__ = ["DEFAULT_LARA_SAMPLES", "ESTIMATORS", "SUPPORTED_BACKENDS", "MultiHeadAttention"]

__doc__ = module_docstring(__doc__, features_home="the non-trainable weight ``features`` "
                                                  "(saved with the model)")

# every name an estimator takes through the layer (the others go to keras.layers.Layer)
_OPTION_NAMES = frozenset(name for names in ESTIMATOR_OPTIONS.values() for name in names)


@keras.saving.register_keras_serializable(package="xattn")
@fill_docstring(estimator_options=ESTIMATOR_OPTIONS_DOC)
class MultiHeadAttention(LayerCore, keras.layers.Layer):
    r"""Multi-head attention with an xattn estimator, shaped after
    ``keras.layers.MultiHeadAttention``.

    .. math::

        \mathrm{head}_i = \mathrm{attention}(Q W_i^Q, K W_i^K, V W_i^V), \quad
        \mathrm{output} = \sum_i \mathrm{head}_i W_i^O

    where ``attention`` is the chosen estimator of softmax attention with scale
    ``1/sqrt(key_dim)``. Inputs are ``(batch, length, features)``.

    **Training and evaluation** follow Keras's ``training`` argument (``model.fit``
    passes True; ``predict``, ``evaluate`` and a direct call pass False or None, which is
    evaluation). ``estimator="rfa"``: the samples :math:`\omega` (weight ``features``,
    shape ``(num_features, key_dim)``, shared by all heads, non-trainable, drawn when the
    layer is built) are redrawn at the start of a training call once ``redraw_interval``
    training calls have used them (the choice is made with ``keras.ops.where``, so it
    works under ``jit``); the count is the non-trainable weight ``steps_since_redraw``.
    ``"ra"``: the unbiased random estimator in training mode, the biased deterministic
    form in evaluation mode. ``"lara"``: random samples in training mode,
    ``deterministic=True`` in evaluation mode. Evaluation outputs are deterministic.

    **Masks.** The key padding of the Keras masks of ``value`` and ``key`` (from an
    ``Embedding(mask_zero=True)`` or a ``Masking`` layer) and ``use_causal_mask=True``
    are applied exactly; the Keras mask of ``query`` is passed on to the output, as
    ``keras.layers.MultiHeadAttention`` does. An explicit ``attention_mask`` is accepted
    when it is a key padding mask (every query row the same, once the causal mask is
    applied; rows that are all False, padded queries, are exempt): the estimators cannot
    apply a general ``(T, S)`` mask, and another mask raises a ``ValueError``. Under
    ``jit`` (``model.fit``, ``predict`` and ``evaluate`` compile by default on JAX) the
    mask's values cannot be read: it is then used as a key padding mask unchecked (key
    ``m`` attended if any query row attends it), so check a new mask in an eager call
    first, and prefer Keras masks and ``use_causal_mask``. A query whose keys are all
    masked gets zero attention (the output bias only).

    **Not supported**: attention scores (the linear estimators never form them:
    ``return_attention_scores=True`` raises); ``dropout`` on the attention weights, for
    the same reason (it must be 0: apply ``keras.layers.Dropout`` to the output);
    ``attention_axes`` other than the sequence axis, ``sliding_window`` and
    ``use_gate=True`` (accepted with their default values, so that the configuration of a
    ``keras.layers.MultiHeadAttention`` loads with ``from_config``).

    Parameters
    ----------
    num_heads : int
        Number of attention heads h.
    key_dim : int
        Size of each head for query and key (the estimators' ``head_dim``).
    value_dim : int, optional
        Size of each head for value (default ``key_dim``).
    dropout : float
        Must be 0 (see above).
    use_bias : bool
        Whether the projections have biases.
    output_shape : int or tuple of int, optional
        The output shape besides the batch and sequence dims (default: the query's
        feature dim).
    attention_axes, sliding_window, use_gate
        Only their defaults (None, None, False; ``attention_axes`` may also name axis 1).
    kernel_initializer, bias_initializer
        As in ``keras.layers.MultiHeadAttention`` (for the projections).
    kernel_regularizer, bias_regularizer, activity_regularizer
        As in ``keras.layers.MultiHeadAttention``.
    kernel_constraint, bias_constraint
        As in ``keras.layers.MultiHeadAttention``.
    seed : int, optional
        Seed of the layer's ``keras.random.SeedGenerator``, the source of every random
        draw: the RFA features (at build time and at each redraw), and the samples of
        ``"ra"`` and ``"lara"`` in training mode.
    estimator : {"softmax", "rfa", "ra", "lara"}
        The attention estimator (default ``"rfa"``).
    redraw_interval : int or None
        ``"rfa"`` only: redraw the features after this many training calls (default
        1000); ``None`` keeps the features drawn at build time.
    **kwargs
        The estimator's options (below), and the keyword arguments of
        ``keras.layers.Layer`` (``name``, ``dtype``, ``trainable``).
    {{estimator_options}}

    Raises
    ------
    ValueError
        On a Keras backend other than ``"jax"`` and ``"torch"``; sizes or
        ``redraw_interval`` below 1, ``dropout`` not 0, an unsupported ``attention_axes``,
        ``sliding_window`` or ``use_gate``, an unknown ``estimator`` or a bad option value
        (checked here, before any call); an unknown keyword argument (by
        ``keras.layers.Layer``).
    TypeError
        An option the estimator does not take, or an argument or option of the wrong
        type (a float ``num_heads``, a non-bool ``use_bias``, ...).

    Examples
    --------
    >>> import numpy as np
    >>> import keras
    >>> import xattn.keras
    >>> layer = xattn.keras.MultiHeadAttention(num_heads=2, key_dim=8, estimator="rfa",
    ...                                        num_features=16, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 16)).astype("float32")
    >>> out = layer(x, x)
    >>> tuple(out.shape), tuple(layer.features.shape)
    ((2, 10, 16), (16, 8))
    >>> bool(np.array_equal(keras.ops.convert_to_numpy(layer(x, x)),
    ...                     keras.ops.convert_to_numpy(out)))  # evaluation: deterministic
    True

    Padding from a Keras mask, and causal masking:

    >>> tokens = np.array([[3, 5, 2, 0, 0], [4, 1, 1, 7, 6]])  # 0 = padding
    >>> embedded = keras.layers.Embedding(10, 16, mask_zero=True)(tokens)
    >>> tuple(layer(embedded, embedded, use_causal_mask=True).shape)
    (2, 5, 16)
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: int | tuple[int, ...] | None = None,
        attention_axes: Any = None,
        sliding_window: int | None = None,
        kernel_initializer: Any = "glorot_uniform",
        bias_initializer: Any = "zeros",
        kernel_regularizer: Any = None,
        bias_regularizer: Any = None,
        activity_regularizer: Any = None,
        kernel_constraint: Any = None,
        bias_constraint: Any = None,
        use_gate: bool = False,
        seed: int | None = None,
        *,
        estimator: str = "rfa",
        redraw_interval: int | None = 1000,
        **kwargs: Any,
    ) -> None:
        check_backend()
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in _OPTION_NAMES}
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        check_sizes(num_heads=num_heads, key_dim=key_dim, value_dim=value_dim)
        if dropout != 0:
            raise ValueError(
                f"dropout must be 0, got {dropout!r}: dropout acts on attention weights, "
                "which xattn's linear estimators never form; apply keras.layers.Dropout "
                "to the output"
            )
        if attention_axes not in (None, 1, (1,), [1]):
            raise ValueError(f"attention_axes must be None (or 1, the sequence axis of "
                             f"(batch, length, features) inputs), got {attention_axes!r}")
        if sliding_window is not None:
            raise ValueError(f"sliding_window is not supported, got {sliding_window!r}: use "
                             "estimator='rfa' with window=... for an exact band")
        if check_bool(use_gate, "use_gate"):
            raise ValueError("use_gate=True is not supported")
        if output_shape is not None:
            if not isinstance(output_shape, int | np.integer | tuple | list):
                raise TypeError(f"output_shape must be an int, a tuple of ints or None, got "
                                f"{type(output_shape).__name__} {output_shape!r}")
            output_shape = ((output_shape,) if isinstance(output_shape, int | np.integer)
                            else tuple(output_shape))
            check_sizes(**{f"output_shape[{i}]": size for i, size in enumerate(output_shape)})
        if seed is not None:
            seed = check_nonnegative_int(seed, "seed")
        self._setup_estimator(head_dim=key_dim, estimator=estimator,
                              redraw_interval=redraw_interval, options=options)
        self.supports_masking = True
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim if value_dim is not None else key_dim
        self.use_bias = check_bool(use_bias, "use_bias")
        self._output_shape = output_shape
        self._initializers = {"kernel_initializer": keras.initializers.get(kernel_initializer),
                              "bias_initializer": keras.initializers.get(bias_initializer)}
        self._regularizers = {
            "kernel_regularizer": keras.regularizers.get(kernel_regularizer),
            "bias_regularizer": keras.regularizers.get(bias_regularizer),
            "kernel_constraint": keras.constraints.get(kernel_constraint),
            "bias_constraint": keras.constraints.get(bias_constraint),
        }
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.features = self.steps_since_redraw = self.proposal_means = None  # see build

    # -- configuration and building ------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments (Keras's serialization): those of
        ``keras.layers.MultiHeadAttention``, ``estimator``, ``redraw_interval`` and the
        estimator's options."""
        config = super().get_config()
        serialize = keras.saving.serialize_keras_object
        config.update({
            "num_heads": self.num_heads, "key_dim": self.key_dim,
            "value_dim": self.value_dim, "dropout": 0.0, "use_bias": self.use_bias,
            "output_shape": self._output_shape, "seed": self.seed,
            **{name: serialize(value) for name, value in self._initializers.items()},
            **{name: serialize(value) for name, value in self._regularizers.items()},
            "activity_regularizer": serialize(self.activity_regularizer),
            "estimator": self.estimator, "redraw_interval": self.redraw_interval,
            **dict(self.estimator_options),
        })
        return config

    def build(self, query_shape: Any, value_shape: Any, key_shape: Any = None) -> None:
        """Create the projections (``EinsumDense`` sublayers with the names and kernel
        shapes of ``keras.layers.MultiHeadAttention``) and the estimator's weights:
        ``features`` and ``steps_since_redraw`` for ``"rfa"``, ``proposal_means`` for
        LARA's ``proposal="learned"``."""
        check_backend()
        key_shape = value_shape if key_shape is None else key_shape
        for name, shape in (("query", query_shape), ("value", value_shape),
                            ("key", key_shape)):
            if len(shape) != 3:
                raise ValueError(f"{name} must be 3-D (batch, length, features), got shape "
                                 f"{tuple(shape)}")
        if value_shape[1] is not None and key_shape[1] not in (None, value_shape[1]):
            raise ValueError(f"key and value must have the same length, got shapes "
                             f"{tuple(key_shape)} and {tuple(value_shape)}")
        output_shape = self._output_shape or (query_shape[-1],)
        projection, bias, out_projection, out_bias = projection_equations(len(output_shape))
        common = {**self._regularizers, "dtype": self.dtype_policy}

        def dense(equation: str, shape: tuple[Any, ...], bias_axes: str,
                  name: str) -> keras.layers.EinsumDense:
            # fresh initializers for each sublayer, as Keras does (a stateless initializer
            # object would give every kernel the same values)
            initializers = {key: type(value).from_config(value.get_config())
                            for key, value in self._initializers.items()}
            return keras.layers.EinsumDense(equation, output_shape=shape,
                                            bias_axes=bias_axes if self.use_bias else None,
                                            name=name, **initializers, **common)

        heads = (None, self.num_heads)
        self._query_dense = dense(projection, (*heads, self.key_dim), bias, "query")
        self._key_dense = dense(projection, (*heads, self.key_dim), bias, "key")
        self._value_dense = dense(projection, (*heads, self.value_dim), bias, "value")
        self._output_dense = dense(out_projection, (None, *output_shape), out_bias,
                                   "attention_output")
        self._query_dense.build(query_shape)
        self._key_dense.build(key_shape)
        self._value_dense.build(value_shape)
        self._output_dense.build((query_shape[0], query_shape[1], self.num_heads,
                                  self.value_dim))
        if self.estimator == "rfa":
            assert self.num_features is not None  # set for "rfa" by _setup_estimator
            self.features = self.add_weight(
                shape=(self.num_features, self.key_dim), initializer=self._draw_features,
                trainable=False, autocast=False, name="features")
            self.steps_since_redraw = self.add_weight(
                shape=(), initializer="zeros", dtype="int32", trainable=False,
                autocast=False, name="steps_since_redraw")
        if self.learned_proposals:  # LARA's means, learned: (num_heads, C, key_dim)
            self.proposal_means = self.add_weight(
                shape=(self.num_heads, lara_num_samples(self.estimator_options), self.key_dim),
                initializer=self._standard_normal, autocast=False, name="proposal_means")

    def _draw_features(self, shape: tuple[int, ...], dtype: Any = None) -> Any:
        """RFA samples of ``shape`` ``(num_features, key_dim)`` with the layer's feature
        options, drawn from the seed generator (in float32 at least) in ``dtype``."""
        xp = backend_namespace()
        dtype = keras.backend.standardize_dtype(dtype or self.variable_dtype)
        omega = draw_features(KerasGenerator(self.seed_generator), shape[0], shape[1],
                              self.estimator_options, xp=xp,
                              dtype=xp.float64 if dtype == "float64" else xp.float32)
        return keras.ops.cast(omega, dtype)

    def _standard_normal(self, shape: tuple[int, ...], dtype: Any = None) -> Any:
        """N(0, 1) draws from the seed generator: the initial ``proposal_means``."""
        return keras.random.normal(shape, dtype=dtype, seed=self.seed_generator)

    @property
    def query_dense(self) -> Any:
        """The query projection (``EinsumDense``), as in ``keras.layers.MultiHeadAttention``."""
        return self._query_dense

    @property
    def key_dense(self) -> Any:
        """The key projection (``EinsumDense``)."""
        return self._key_dense

    @property
    def value_dense(self) -> Any:
        """The value projection (``EinsumDense``)."""
        return self._value_dense

    @property
    def output_dense(self) -> Any:
        """The output projection (``EinsumDense``)."""
        return self._output_dense

    def compute_output_shape(self, query_shape: Any, value_shape: Any,
                             key_shape: Any = None) -> tuple[Any, ...]:
        """``(batch, query length, *output_shape)``; ``output_shape`` defaults to the
        query's feature dim."""
        return tuple(query_shape)[:-1] + (self._output_shape or tuple(query_shape)[-1:])

    def compute_output_spec(self, query: Any, value: Any, key: Any = None,
                            **kwargs: Any) -> Any:
        """The symbolic output (functional models), in the compute dtype."""
        self._refuse_scores(kwargs.get("return_attention_scores", False))
        shape = self.compute_output_shape(query.shape, value.shape)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    @staticmethod
    def _refuse_scores(return_attention_scores: Any) -> None:
        if check_bool(return_attention_scores, "return_attention_scores"):
            raise ValueError(
                "return_attention_scores=True is not supported: xattn's estimators do not "
                "materialize attention scores (the linear ones never form the T x S matrix)"
            )

    # -- the call ------------------------------------------------------------------------

    def call(self, query: Any, value: Any, key: Any = None, query_mask: Any = None,
             value_mask: Any = None, key_mask: Any = None, attention_mask: Any = None,
             return_attention_scores: bool = False, training: bool | None = None,
             use_causal_mask: bool = False) -> Any:
        """Attend ``query`` to ``key`` / ``value`` with the layer's estimator.

        Parameters
        ----------
        query : tensor, shape (B, T, dim)
        value : tensor, shape (B, S, value features)
        key : tensor, shape (B, S, key features), optional
            Default ``value``.
        query_mask, value_mask, key_mask : bool tensor, shape (B, T) / (B, S), optional
            Keras masks (True = a real token), filled in by Keras from the inputs' masks.
            The value and key masks mask keys; the query mask is passed on to the output.
        attention_mask : bool or integer tensor, shape (B, T, S), optional
            True (1) = attend. Only key padding masks (see the class).
        return_attention_scores : bool
            Must be False.
        training : bool, optional
            Training mode (random draws; RFA's redraw schedule) or evaluation mode (None
            or False: deterministic).
        use_causal_mask : bool
            Causal masking: query t attends keys s <= t (top-left aligned).

        Returns
        -------
        tensor, shape (B, T) + output_shape, in the layer's compute dtype
            ``output_shape`` defaults to ``(dim,)``.

        Raises
        ------
        ValueError
            ``return_attention_scores=True``; inputs that are not 3-D or of other feature
            sizes than at build time; an ``attention_mask`` of the wrong shape or (where
            its values can be read) not a key padding mask; ``use_causal_mask=True`` with
            ``estimator="lara"`` (except ``proposal="learned"``); with LARA's ``grid``,
            sequences of other than H W tokens.
        TypeError
            ``training`` (when given) or ``use_causal_mask`` not a bool; an
            ``attention_mask`` that is neither boolean nor integer.
        """
        self._refuse_scores(return_attention_scores)
        training = False if training is None else check_bool(training, "training")
        causal = check_bool(use_causal_mask, "use_causal_mask")
        key = value if key is None else key
        for name, tensor in (("query", query), ("value", value), ("key", key)):
            if len(tensor.shape) != 3:
                raise ValueError(f"{name} must be 3-D (batch, length, features), got shape "
                                 f"{tuple(tensor.shape)}")
        keys = self._key_mask(value_mask, key_mask, attention_mask, query.shape[1],
                              value.shape[1], causal)
        with masks_detached(query, value, key):  # the projections would warn of the masks
            # (B, L, heads, head_dim) -> (B, heads, L, head_dim)
            q, k, v = (keras.ops.transpose(dense(x), (0, 2, 1, 3)) for dense, x in (
                (self._query_dense, query), (self._key_dense, key),
                (self._value_dense, value)))
        features = None
        if self._counts_training_steps(training):
            features = self._redraw_features()
        elif self.features is not None:
            features = self.features.value
        if self.proposal_means is not None:  # the learned means reach LARA as omega
            features = self.proposal_means.value
        heads = self._estimate(q, k, v, key_mask=None if keys is None else keys[:, None, :],
                               causal=causal, training=training, features=features,
                               rng=KerasGenerator(self.seed_generator) if training else None)
        # Keras passes the query's mask on to the output (supports_masking)
        return self._output_dense(keras.ops.transpose(heads, (0, 2, 1, 3)))

    def _key_mask(self, value_mask: Any, key_mask: Any, attention_mask: Any,
                  query_length: int, key_length: int, causal: bool) -> Any:
        """xattn's key mask (B or 1, S) of the Keras masks and ``attention_mask``, or
        None."""
        keys = None
        for mask in (value_mask, key_mask):
            if mask is not None:
                mask = keras.ops.cast(mask, "bool")
                keys = mask if keys is None else keras.ops.logical_and(keys, mask)
        if attention_mask is not None:
            mask = key_padding_mask(attention_mask, query_length=query_length,
                                    key_length=key_length, causal=causal)
            keys = mask if keys is None else keras.ops.logical_and(keys, mask)
        return keys

    def _redraw_features(self) -> Any:
        """Performer's schedule in a training call: the features, redrawn (a fresh draw
        chosen with ``keras.ops.where``) once ``redraw_interval`` calls have used them."""
        assert self.features is not None and self.steps_since_redraw is not None
        redraw, steps = self._redraw_schedule(self.steps_since_redraw.value, keras.ops.where)
        fresh = self._draw_features(tuple(self.features.shape), self.features.dtype)
        features = keras.ops.where(redraw, fresh, self.features.value)
        self.features.assign(features)
        self.steps_since_redraw.assign(keras.ops.cast(steps, "int32"))
        return features

