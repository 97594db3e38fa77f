r"""Hugging Face transformers hook: xattn's estimators as an ``attn_implementation``.

:func:`register` adds a named attention function to transformers' ``AttentionInterface``
and the matching mask function to its ``AttentionMaskInterface``; every model that
dispatches its attention through them (BERT, GPT-2, Llama and most others in
transformers 5) then runs with an xattn estimator when loaded with that name:

.. code-block:: python

    import xattn.transformers
    from transformers import AutoModel

    xattn.transformers.register("xattn_rfa", estimator="rfa", num_features=64,
                                window=16, sinks=1)
    model = AutoModel.from_pretrained("some/model", attn_implementation="xattn_rfa")
    # or, on a model already loaded: model.set_attn_implementation("xattn_rfa")

**What the hook does with each call.** The model's ``scaling`` becomes xattn's
``scale=``; grouped-query key and value heads are repeated to the query heads (as
transformers' ``repeat_kv``). The mask that the registered mask function builds is not
a ``(batch, 1, L, S)`` tensor but an :class:`AttentionMask`: the padding of the keys
(from the model's 2-D ``attention_mask``) and whether the attention is causal. These two
are all the hook accepts, and they reach the estimator exactly (``key_mask=`` and
``causal=True``); a sliding-window, chunked, packed-sequence or any other mask pattern
raises a ``ValueError`` when the model builds its masks, and a prepared 4-D mask tensor
is accepted only if it is a padding mask, possibly causal (checked entry by entry),
else ``ValueError``.

**Training and evaluation** follow ``module.training``, as in xattn's layers. In
evaluation mode every estimator is deterministic: RFA uses fixed features, one
``(num_features, head_dim)`` matrix per attention module, shared by its heads, drawn
from the integer seed ``np.random.SeedSequence([seed, layer, crc32(class name)])`` with
``layer`` the module's ``layer_idx`` (every BERT, GPT-2 and Llama attention has one; a
module without it is numbered in the order of its first call); being drawn from an
integer seed on the host, they are the same on every device and in every process. RA
runs its biased deterministic form and LARA its deterministic form (the proposal means
as samples; with ``proposal="learned"`` the means are fixed per module, drawn as RFA's
features are, and shared by its heads). In training mode
each call draws afresh (RFA new features at every call, RA and LARA new samples) from
``generator`` (a :class:`torch.Generator`) or, without one, from torch's default
generator, as :class:`torch.nn.Dropout` does.

**Generation.** Decoder models work for training, prefill and ``model.generate``, in
two ways. With transformers' own caches (the default) the new queries are the last
positions of the keys that the cache holds, and the hook runs the causal estimator over
all of those keys with the earlier query positions left empty, then keeps the new rows.
This is exact (the same tokens as a forward pass over the whole prefix, to rounding), but
it recomputes the prefix: a step costs O(T S d) per layer and head for RFA after T tokens
(S features), and the key-value cache grows with T as for softmax attention. With an
:class:`XattnCache` (``model.generate(..., cache=xattn.transformers.XattnCache())``, in
evaluation mode) each layer holds the estimator's state instead (:class:`xattn.RFAState`
for RFA, :class:`xattn.LARAState` for LARA: of fixed size, O(S d) per token), one per
key-value head with grouped-query attention, the prefill and each new token run the
estimator with ``state=`` and ``return_state=True`` over the new tokens only, and the
logits are again those of a forward pass over the whole sequence, to rounding; beam
search, ``num_return_sequences`` and left-padded batches work with it (see
:class:`XattnCache` for what it refuses). ``generate`` makes an :class:`XattnCache` only
when given one: transformers 5 builds its ``DynamicCache`` for every model (its
``cache_implementation`` names are a fixed list), and a default would need patching
transformers. Causal attention with ``estimator="lara"`` needs options that do not look
ahead: ``proposal="learned"`` (fixed means per module, the proposal for decoders),
``"standard"`` or ``defensive=num_samples``, with the weighting ``"query_proposal"`` or
``"balance"``; other options (the default segment proposals) raise ``ValueError`` in
causal attention. A static cache
(``model.generate(..., cache_implementation="static")``, the cache of compiled generation)
works too, with every estimator: its key slots after the tokens so far are empty, and
being after the last query they are never attended, so the tokens are those of the
dynamic cache (with softmax, those of ``attn_implementation="sdpa"``). With such a cache
``generate`` makes the masks before each forward pass and hands them to the model as its
``attention_mask``; an :class:`AttentionMask` therefore stands for the 4-D mask tensor
(``ndim`` 4, ``shape`` ``(batch, 1, L, S)``), which the model and transformers' mask
functions take as an already prepared mask. Compiling gains nothing yet: the keys are cut
to the filled slots, whose number changes at each step, so ``torch.compile`` traces the
forward pass again at every step until its recompile limit, then runs it uncompiled.

**Not supported** (``ValueError`` naming the cause): attention dropout in training mode
(set the model's attention dropout to 0, e.g. ``attention_probs_dropout_prob=0.0`` for
BERT, ``attn_pdrop=0.0`` for GPT-2), ``output_attentions=True`` (the linear estimators
form no attention weights; refused on every model, whether the flag comes as a keyword
or from the config and whether or not the model hands it to the attention function, as
GPT-2 does not: the hook checks whether the forward pass collects attention weights),
and the keyword arguments ``softcap``, ``sliding_window``, ``s_aux`` and
``position_bias``. The attention weights returned to the model are None.

This module needs PyTorch and transformers (the ``xattn[transformers]`` extra), so
``import xattn`` does not import it: it is loaded on the first use of
``xattn.transformers`` (or by ``import xattn.transformers``).
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any

import array_api_compat
import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from xattn._core.array import compute_dtype
from xattn._core.options import ESTIMATORS, check_nonnegative_int, lara_num_samples
from xattn._estimators.lara_causal import check_lara_causal_options
from xattn._integrations.hf_cache import StateLayer, XattnCache, continue_state, take_pending
from xattn._integrations.hf_calibration import calibrate, load_features, save_features
from xattn._integrations.hf_masks import AttentionMask, attention_mask, mask_from_tensor
from xattn._integrations.hf_refinement import RefinementReport, refine
from xattn._integrations.layers import LayerCore, attend, draw_features, learned_proposal_means
from xattn.random import Generator, TorchDefaultGenerator, TorchGenerator

_active_collector: Any
try:  # the per-forward record of the outputs a model collects through hooks (transformers 5)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - an older or later layout: the keyword is checked
    _active_collector = None

__all__ = ["ESTIMATORS", "AttentionMask", "RefinementReport", "StateLayer", "XattnAttention",
           "XattnCache", "attention_mask", "calibrate", "load_features", "refine", "register",
           "save_features"]

# keyword arguments of an attention call that ask for something the hook cannot compute
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "position_bias")

def _attentions_collected() -> bool:
    """Whether the running forward pass collects attention weights.

    transformers 5 does not hand ``output_attentions`` to every attention function
    (GPT-2 drops it): a model's ``forward`` records which outputs it collects, from its
    keyword arguments or its config, and hooks on the attention modules then collect
    the weights they return. A collected key ending in ``attentions`` (``attentions``,
    ``cross_attentions``, ...) means the weights are asked for.
    """
    if _active_collector is None:
        return False
    collected = _active_collector.get()
    return isinstance(collected, dict) and any(
        isinstance(key, str) and key.endswith("attentions") for key in collected)


class XattnAttention:
    """An attention function of transformers' ``AttentionInterface`` running an xattn
    estimator; made and registered by :func:`register` (see there and the module
    documentation for its behaviour).

    Attributes
    ----------
    name : str
        The ``attn_implementation`` name it is registered under.
    estimator : str
        One of ``"softmax"``, ``"rfa"``, ``"ra"``, ``"lara"``.
    options : dict
        The estimator options.
    seed : int
        The seed of the evaluation-mode RFA features.
    generator : torch.Generator or None
        The source of training-mode draws (None: torch's default generator).
    """

    def __init__(self, name: str, estimator: str, options: dict[str, Any], seed: int,
                 generator: torch.Generator | None) -> None:
        self.name = name
        self.estimator = estimator
        self.options = dict(options)
        self.seed = seed
        self.generator = generator
        self._cores: dict[int, LayerCore] = {}
        self._core(8)  # checks the estimator and its options (the layers' probe)
        self._features: weakref.WeakKeyDictionary[Any, dict[Any, torch.Tensor]] = (
            weakref.WeakKeyDictionary())
        self._unnumbered: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        #: RFA samples fitted by :func:`calibrate` (or loaded by :func:`load_features`):
        #: ``(heads, num_features, head_dim)`` per layer (:meth:`module_layer`), used in
        #: evaluation mode in place of the random draw.
        self.fitted: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"XattnAttention(name={self.name!r}, estimator={self.estimator!r}, "
                f"seed={self.seed}, options={self.options})")

    def _core(self, head_dim: int) -> LayerCore:
        if head_dim not in self._cores:
            core = LayerCore()
            core._setup_estimator(head_dim=head_dim, estimator=self.estimator,
                                  redraw_interval=None, options=self.options)
            self._cores[head_dim] = core
        return self._cores[head_dim]

    def _random(self) -> Generator:
        if self.generator is not None:
            return TorchGenerator(self.generator)
        return TorchDefaultGenerator()

    def module_layer(self, module: Any) -> int:
        """``module``'s ``layer_idx`` (or, without one, ``-1 - n`` for the n-th such
        module seen)."""
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            if module not in self._unnumbered:
                self._unnumbered[module] = len(self._unnumbered)
            layer = -1 - self._unnumbered[module]
        return layer

    def module_seed(self, module: Any) -> int:
        """The integer seed of ``module``'s evaluation-mode RFA features:
        ``SeedSequence([seed, layer, crc32(class name)])``, ``layer`` its
        :meth:`module_layer`."""
        layer = self.module_layer(module)
        entropy = [self.seed, layer % 2 ** 32, zlib.crc32(type(module).__name__.encode())]
        return int(np.random.SeedSequence(entropy).generate_state(1)[0])

    def clear_feature_cache(self) -> None:
        """Forget the features made so far (after the fitted samples changed)."""
        self._features = weakref.WeakKeyDictionary()

    def features(self, module: Any, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: Any = "cpu") -> torch.Tensor:
        """The evaluation-mode RFA features of ``module``: its fitted samples
        ``(heads, num_features, head_dim)`` if :attr:`fitted` has its layer, else
        :meth:`random_features`."""
        fitted = self.fitted.get(self.module_layer(module))
        if fitted is None:
            return self.random_features(module, head_dim, dtype=dtype, device=device)
        cache = self._features.setdefault(module, {})
        key = ("fitted", dtype, str(device))
        if key not in cache:
            cache[key] = fitted.to(device=device, dtype=dtype)
        return cache[key]

    def random_features(self, module: Any, head_dim: int, *,
                        dtype: torch.dtype = torch.float32, device: Any = "cpu") -> torch.Tensor:
        """The random RFA features of ``module``, ``(num_features, head_dim)``, drawn once
        from :meth:`module_seed` (the same values on every device)."""
        core = self._core(head_dim)
        if core.num_features is None:
            raise ValueError(f"features are those of estimator='rfa', not {self.estimator!r}")
        cache = self._features.setdefault(module, {})
        key = (head_dim, dtype, str(device))
        if key not in cache:
            xp = array_api_compat.array_namespace(torch.empty(0))
            cache[key] = draw_features(self.module_seed(module), core.num_features, head_dim,
                                       self.options, xp=xp, dtype=dtype, device=device)
        return cache[key]

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """Attention of ``query (B, H, L, d)`` to ``key (B, Hk, S, d)`` and ``value
        (B, Hk, S, dv)``, Hk dividing H; returns ``(output (B, L, H, dv), None)``."""
        training = bool(getattr(module, "training", False))
        self._check_call(kwargs, dropout, training)
        layer = take_pending(key)  # an XattnCache's layer returned these keys: continue it
        if layer is not None:
            return continue_state(self, layer, module, query, key, value, attention_mask,
                                  kwargs, scaling, training)
        key, value = _repeat_kv(query, key, value)
        mask = self._mask(module, attention_mask, kwargs, query.shape[-2], key.shape[-2])
        key_mask = None if mask.key_mask is None else mask.key_mask[:, None, :]
        if mask.causal:
            self.check_causal()
        start, length = mask.query_start, query.shape[-2]
        if mask.causal:
            if start + length > key.shape[-2]:
                raise ValueError(f"{length} queries from position {start} need "
                                 f"{start + length} keys, got {key.shape[-2]}")
            # keys past the last query are never attended (e.g. empty static-cache slots)
            key, value = key[..., :start + length, :], value[..., :start + length, :]
            key_mask = None if key_mask is None else key_mask[..., :start + length]
            if start:  # earlier positions: empty queries whose rows are dropped
                query = torch.cat([query.new_zeros((*query.shape[:2], start, query.shape[-1])),
                                   query], dim=-2)
        options, omega = self._call_options(module, query, scaling, training)
        out = attend(self.estimator, query, key, value, options=options, key_mask=key_mask,
                     causal=mask.causal, training=training, omega=omega,
                     rng=self._random() if training else None)
        out = out[..., start:, :] if mask.causal else out
        return out.transpose(1, 2).contiguous(), None

    def proposal_means(self, module: Any, head_dim: int, *, dtype: torch.dtype = torch.float32,
                       device: Any = "cpu") -> torch.Tensor:
        """The LARA proposal means of ``module`` with ``proposal="learned"``, ``(num_samples,
        head_dim)``, shared by its heads: standard normal draws from :meth:`module_seed`
        (the initial means of an xattn layer; fixed here, the model has no parameter to
        train them), drawn once, the same values on every device."""
        if self.estimator != "lara" or self.options.get("proposal") != "learned":
            raise ValueError(f"proposal means are those of estimator='lara' with "
                             f"proposal='learned', not of {self.name!r}")
        cache = self._features.setdefault(module, {})
        key = ("means", head_dim, dtype, str(device))
        if key not in cache:
            means = learned_proposal_means(self.module_seed(module), 1,
                                           lara_num_samples(self.options), head_dim)[0]
            cache[key] = torch.from_numpy(means).to(device=device, dtype=dtype)
        return cache[key]

    def check_causal(self) -> None:
        """``ValueError`` if the estimator has no causal form with these options: LARA's
        must not look ahead (``proposal="learned"``, ``"standard"`` or ``defensive`` =
        ``num_samples``; ``weighting`` ``"query_proposal"`` or ``"balance"``; no grid)."""
        if self.estimator != "lara":
            return
        learned = self.options.get("proposal") == "learned"
        num_samples = lara_num_samples(self.options)
        try:
            check_lara_causal_options(
                proposal=self.options.get("proposal", "segment"), supplied=learned,
                defensive=min(self.options.get("defensive", 0), num_samples),
                num_samples=num_samples,
                grid=self.options.get("grid"), weighting=self.options.get(
                    "weighting", "query_proposal" if learned else "decoupled"))
        except ValueError as problem:
            raise ValueError(
                f"xattn attention {self.name!r} runs in a causal (decoder) attention, but its "
                f"LARA options have no causal form: {problem}. Register LARA with "
                "proposal='learned' (fixed means drawn per module) for decoders") from None

    def _call_options(self, module: Any, query: torch.Tensor, scaling: float | None,
                      training: bool) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The estimator options of a call (the model's ``scaling`` as ``scale``) and RFA's
        features (drawn afresh in training mode, the module's fixed ones in evaluation) or
        LARA's fixed proposal means (``proposal="learned"``)."""
        options = dict(self.options)
        if scaling is not None:
            options["scale"] = float(scaling)
        omega = None
        if self.estimator == "rfa":
            dtype = compute_dtype(array_api_compat.array_namespace(query), query.dtype)
            if training:
                core = self._core(query.shape[-1])
                assert core.num_features is not None
                omega = draw_features(self._random(), core.num_features, query.shape[-1],
                                      self.options, xp=array_api_compat.array_namespace(query),
                                      dtype=dtype, device=query.device)
            else:
                omega = self.features(module, query.shape[-1], dtype=dtype, device=query.device)
        elif self.estimator == "lara" and self.options.get("proposal") == "learned":
            dtype = compute_dtype(array_api_compat.array_namespace(query), query.dtype)
            omega = self.proposal_means(module, query.shape[-1], dtype=dtype, device=query.device)
            self._core(query.shape[-1])
        else:
            self._core(query.shape[-1])  # the options hold for this head size
        return options, omega

    def _check_call(self, kwargs: dict[str, Any], dropout: float, training: bool) -> None:
        for name in _UNSUPPORTED_KWARGS:
            if kwargs.get(name) is not None:
                raise ValueError(f"xattn attention ({self.name!r}) does not support {name}="
                                 f"{kwargs[name]!r}; use the model's own attention")
        if kwargs.get("output_attentions") or _attentions_collected():
            raise ValueError(f"output_attentions=True is not supported by xattn attention "
                             f"({self.name!r}): its estimators form no attention weights")
        if training and dropout:
            raise ValueError(
                f"attention dropout {dropout} in training mode is not supported by xattn "
                f"attention ({self.name!r}): dropout acts on attention weights, which the "
                "estimators never form; set the model's attention dropout to 0 (e.g. "
                "attention_probs_dropout_prob=0.0 for BERT, attn_pdrop=0.0 for GPT-2)")

    def _mask(self, module: Any, mask: Any, kwargs: dict[str, Any], q_length: int,
              kv_length: int) -> AttentionMask:
        if isinstance(mask, AttentionMask):
            if mask.kv_length != kv_length:
                raise ValueError(f"the attention mask was made for {mask.kv_length} keys, the "
                                 f"attention has {kv_length}")
            if mask.q_length is not None and mask.q_length != q_length:
                raise ValueError(f"the attention mask was made for {mask.q_length} queries, "
                                 f"the attention has {q_length}")
            return mask
        if isinstance(mask, torch.Tensor):
            return mask_from_tensor(mask, q_length, kv_length)
        if mask is not None:
            raise ValueError(f"xattn attention ({self.name!r}) takes padding and causal masks "
                             f"only, got a {type(mask).__name__}")
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        return AttentionMask(None, causal, kv_length - q_length if causal else 0, kv_length,
                             q_length)


def _repeat_kv(query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query key and value heads repeated to the query heads (transformers'
    ``repeat_kv``)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads == kv_heads:
        return key, value
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"the query heads ({heads}) must be a multiple of the key and "
                         f"value heads ({kv_heads})")
    return (key.repeat_interleave(heads // kv_heads, dim=1),
            value.repeat_interleave(heads // kv_heads, dim=1))


def register(name: str, estimator: str = "rfa", *, seed: int = 0,
             generator: torch.Generator | None = None, **options: Any) -> XattnAttention:
    r"""Register an xattn estimator as the transformers attention implementation ``name``.

    Adds an :class:`XattnAttention` to transformers' ``AttentionInterface`` and the mask
    function :func:`attention_mask` to its ``AttentionMaskInterface``, both under
    ``name``; then ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` runs the model's attention
    ``softmax(scaling * q k^T) v`` through the estimator, with the model's padding and
    causal masks applied exactly (see :mod:`xattn.transformers` for training and
    evaluation modes, generation and what is not supported). Registering a name again
    replaces the earlier xattn function.

    Parameters
    ----------
    name : str
        The ``attn_implementation`` name, e.g. ``"xattn_rfa"``; not one of transformers'
        own implementations (``"eager"``, ``"sdpa"``, ...) and without ``"/"`` (which
        transformers reads as a Hub kernel).
    estimator : {"rfa", "softmax", "ra", "lara"}
        The estimator (default ``"rfa"``).
    seed : int
        Seed of the evaluation-mode RFA features and of LARA's ``proposal="learned"``
        means (default 0); each attention module draws its own from it and its layer
        index.
    generator : torch.Generator, optional
        Source of the training-mode draws; default torch's default generator.
    **options
        Estimator options, as the layers take them (e.g. ``num_features``, ``window``,
        ``sinks``, ``feature_map`` for ``"rfa"``; ``num_samples``, ``proposal``,
        ``weighting`` for ``"lara"``; ``num_samples`` for ``"ra"``); ``scale`` is the
        model's and cannot be given. LARA's ``proposal="learned"`` takes the means that an
        xattn layer starts with (standard normal draws, one ``(num_samples, head_dim)``
        set per attention module from ``seed`` and its layer index, shared by its heads),
        fixed, since the model has no parameter to learn them; it is the proposal that
        gives LARA a causal form with non-zero samples in evaluation mode (decoders and
        :class:`XattnCache`; weighting ``"query_proposal"`` by default).

    Returns
    -------
    XattnAttention
        The registered attention function.

    Raises
    ------
    TypeError
        ``name`` not a str, ``generator`` not a :class:`torch.Generator`, ``seed`` not an
        int, an option the estimator does not take or of the wrong type.
    ValueError
        An empty name, one with ``"/"`` or of transformers' own implementations; an
        unknown estimator; ``scale``; an option value the estimator refuses.

    Examples
    --------
    >>> import torch
    >>> import xattn.transformers
    >>> from transformers import BertConfig, BertModel
    >>> _ = xattn.transformers.register("xattn_rfa_doc", estimator="rfa", num_features=16)
    >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                     num_attention_heads=4, intermediate_size=64)
    >>> _ = torch.manual_seed(0)
    >>> model = BertModel(config, add_pooling_layer=False).eval()
    >>> model.set_attn_implementation("xattn_rfa_doc")
    >>> ids = torch.randint(100, (2, 12))
    >>> padding = torch.ones(2, 12, dtype=torch.long)
    >>> padding[1, 8:] = 0  # the second sequence has 8 tokens
    >>> out = model(ids, attention_mask=padding).last_hidden_state
    >>> out.shape
    torch.Size([2, 12, 32])
    >>> bool(torch.equal(out, model(ids, attention_mask=padding).last_hidden_state))
    True
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    if not name or "/" in name:
        raise ValueError(f"name must be a non-empty str without '/' (transformers reads "
                         f"'org/repo' as a Hub kernel), got {name!r}")
    existing = AttentionInterface._global_mapping.get(name)
    if name == "eager" or (existing is not None and not isinstance(existing, XattnAttention)) or (
            name in AttentionMaskInterface._global_mapping
            and AttentionMaskInterface._global_mapping[name] is not attention_mask):
        raise ValueError(f"name {name!r} is one of transformers' own attention "
                         "implementations; choose another (e.g. 'xattn_rfa')")
    seed = check_nonnegative_int(seed, "seed")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}")
    if "scale" in options:
        raise ValueError("scale is not an option here: the model passes its own scaling, "
                         "which becomes xattn's scale")
    function = XattnAttention(name, estimator, options, seed, generator)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, attention_mask)
    return function
