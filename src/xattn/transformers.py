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
runs its biased deterministic form and LARA its deterministic form. In training mode
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
for RFA: of fixed size, O(S d) per token), the prefill and each new token run the
estimator with ``state=`` and ``return_state=True`` over the new tokens only, and the
logits are again those of a forward pass over the whole sequence, to rounding; beam
search, ``num_return_sequences`` and left-padded batches work with it (see
:class:`XattnCache` for what it refuses). ``generate`` makes an :class:`XattnCache` only
when given one. LARA has no causal form here (its proposals would look ahead):
causal attention with ``estimator="lara"`` raises ``ValueError``. A static cache
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

import dataclasses
import threading
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import array_api_compat
import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
)

from xattn._array import compute_dtype
from xattn._layers import LayerCore, attend, draw_features
from xattn._options import ESTIMATORS, check_nonnegative_int
from xattn._state import LARAState, RFAState, _KeyValueCache
from xattn._torch_layer import DefaultTorchGenerator
from xattn.random import Generator, TorchGenerator

_active_collector: Any
try:  # the per-forward record of the outputs a model collects through hooks (transformers 5)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - an older or later layout: the keyword is checked
    _active_collector = None

__all__ = ["ESTIMATORS", "AttentionMask", "StateLayer", "XattnAttention", "XattnCache",
           "attention_mask", "register"]

# keyword arguments of an attention call that ask for something the hook cannot compute
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "position_bias")


@dataclass(frozen=True)
class AttentionMask:
    """The mask an xattn attention function receives: key padding, and causal or not.

    Built by :func:`attention_mask` (the mask function :func:`register` adds to
    transformers' ``AttentionMaskInterface``) in place of a 4-D mask tensor, and
    passed by transformers where that tensor would go. It stands for the
    ``(batch, 1, L, S)`` mask: ``ndim`` is 4 and ``shape`` is that shape, so that model
    code and transformers' mask functions take it as an already prepared mask, as they
    do a 4-D tensor. ``model.generate`` with a static cache
    (``cache_implementation="static"``) builds the masks before each forward pass and
    hands them to the model as its ``attention_mask`` in this way.

    Attributes
    ----------
    key_mask : torch.Tensor of bool, shape (batch, S), or None
        True = the key takes part (None: every key does).
    causal : bool
        Query ``i`` attends the keys ``j <= query_start + i`` only.
    query_start : int
        The key position of the first query: the number of tokens a cache held before
        the queries (0 without a cache).
    kv_length : int
        S, the number of keys the mask was made for: with a static cache, all its slots,
        the filled ones and the empty ones after them.
    q_length : int or None
        L, the number of queries the mask was made for (None: not recorded).
    batch_size : int or None
        The batch size the mask was made for (None: not recorded).
    ndim : int
        4, the number of dimensions of the mask tensor this object stands for.
    """

    key_mask: torch.Tensor | None
    causal: bool
    query_start: int
    kv_length: int
    q_length: int | None = None
    batch_size: int | None = None
    ndim: ClassVar[int] = 4

    @property
    def shape(self) -> tuple[int | None, int, int | None, int]:
        """``(batch, 1, L, S)``, the shape of the mask tensor this object stands for."""
        batch = self.batch_size
        if batch is None and self.key_mask is not None:
            batch = int(self.key_mask.shape[0])
        return (batch, 1, self.q_length, self.kv_length)

    def dim(self) -> int:
        """4, as ``torch.Tensor.dim`` of the mask tensor this object stands for."""
        return self.ndim


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                   kv_offset: Any = 0, mask_function: Any = causal_mask_function,
                   attention_mask: torch.Tensor | AttentionMask | None = None,
                   **kwargs: Any) -> AttentionMask:
    """The mask function of an xattn attention (transformers' ``AttentionMaskInterface``
    protocol, as ``sdpa_mask``): the model's 2-D padding mask and its causal or
    bidirectional pattern as an :class:`AttentionMask`, without forming the
    ``(batch, 1, L, S)`` tensor.

    Parameters
    ----------
    batch_size, q_length, kv_length : int
        Batch size, number of queries L and of keys S.
    q_offset, kv_offset : int or 0-d tensor
        Positions of the first query and the first key in the sequence.
    mask_function : callable
        transformers' ``causal_mask_function`` or ``bidirectional_mask_function``;
        anything else (sliding window, chunks, packed sequences, overlays) raises.
    attention_mask : torch.Tensor or AttentionMask, optional
        The 2-D padding mask, shape (batch, >= kv_offset + kv_length), True / 1 =
        token; or an :class:`AttentionMask` made earlier for this call (``generate``
        with a static cache makes the masks before the forward pass), returned as it
        is, as transformers returns a prepared 4-D mask.
    **kwargs
        The other arguments of the protocol (dtype, device, flags): unused.

    Returns
    -------
    AttentionMask

    Raises
    ------
    TypeError
        An ``attention_mask`` neither a tensor nor an :class:`AttentionMask`.
    ValueError
        A mask pattern other than causal or bidirectional (plus padding); an
        ``attention_mask`` tensor that is not 2-D.

    Examples
    --------
    >>> import torch
    >>> from xattn.transformers import attention_mask
    >>> padding = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    >>> mask = attention_mask(2, 4, 4, attention_mask=padding)  # causal by default
    >>> mask.causal, mask.key_mask.tolist()
    (True, [[True, True, True, False], [True, True, True, True]])
    """
    if mask_function is causal_mask_function:
        causal = True
    elif mask_function is bidirectional_mask_function:
        causal = False
    else:
        pattern = getattr(mask_function, "__qualname__", mask_function)
        raise ValueError(
            f"xattn attention takes causal or bidirectional masks with padding only; this "
            f"model asks for another pattern ({pattern}): sliding-window, chunked, "
            "packed-sequence (position_ids restarting within a row) or overlaid masks cannot "
            "be applied by the linear estimators")
    if isinstance(attention_mask, AttentionMask):  # prepared earlier (static-cache generate)
        return attention_mask
    query_start = int(q_offset) - int(kv_offset)
    if query_start < 0:
        raise ValueError(f"the queries start before the keys (q_offset {int(q_offset)} < "
                         f"kv_offset {int(kv_offset)}): not a mask xattn can apply")
    key_mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, an AttentionMask or None, "
                            f"got {type(attention_mask).__name__}")
        if attention_mask.ndim != 2:
            raise ValueError(f"attention_mask must be the 2-D padding mask (batch, length), got "
                             f"shape {tuple(attention_mask.shape)}")
        padding = prepare_padding_mask(attention_mask.bool(), kv_length, int(kv_offset))
        assert padding is not None
        key_mask = padding[:, int(kv_offset):int(kv_offset) + kv_length]
    return AttentionMask(key_mask, causal, query_start, kv_length, q_length, batch_size)


def _mask_from_tensor(mask: torch.Tensor, q_length: int, kv_length: int) -> AttentionMask:
    """A prepared 4-D mask (bool, True = attend; or float, 0 = attend and -inf or the
    dtype's minimum = blocked) of shape (batch or 1, 1, L, S) as an :class:`AttentionMask`,
    if it is a padding mask, causal or not; ``ValueError`` otherwise."""
    if mask.ndim != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (q_length, kv_length):
        raise ValueError(f"a 4-D attention mask must have shape (batch, 1, {q_length}, "
                         f"{kv_length}) to be read as padding (and causal) masking; got "
                         f"{tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:
        allowed = mask[:, 0] == 0
        blocked = mask[:, 0] <= torch.finfo(mask.dtype).min / 2
        if not bool(torch.all(allowed | blocked)):
            raise ValueError("a float attention mask must hold only 0 (attend) and -inf or the "
                             "dtype's minimum (blocked): xattn applies no additive bias")
    query_start = kv_length - q_length
    key_mask = allowed[:, -1, :]  # the last query may attend every key in both patterns
    padded = key_mask[:, None, :].expand_as(allowed)
    positions = torch.arange(kv_length, device=mask.device)
    before = positions[None, :] <= positions[-q_length:, None] if q_length else padded[0]
    if bool(torch.equal(allowed, padded & before)):
        return AttentionMask(key_mask, True, query_start, kv_length, q_length)
    if bool(torch.equal(allowed, padded)):
        return AttentionMask(key_mask, False, 0, kv_length, q_length)
    raise ValueError("the attention mask is neither a padding mask nor a causal mask with "
                     "padding; xattn's estimators apply only those two patterns exactly")


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
        return DefaultTorchGenerator()

    def module_seed(self, module: Any) -> int:
        """The integer seed of ``module``'s evaluation-mode RFA features:
        ``SeedSequence([seed, layer, crc32(class name)])``, ``layer`` its ``layer_idx``
        (or, without one, ``-1 - n`` for the n-th such module seen)."""
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            if module not in self._unnumbered:
                self._unnumbered[module] = len(self._unnumbered)
            layer = -1 - self._unnumbered[module]
        entropy = [self.seed, layer % 2 ** 32, zlib.crc32(type(module).__name__.encode())]
        return int(np.random.SeedSequence(entropy).generate_state(1)[0])

    def features(self, module: Any, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: Any = "cpu") -> torch.Tensor:
        """The evaluation-mode RFA features of ``module``, ``(num_features, head_dim)``,
        drawn once from :meth:`module_seed` (the same values on every device)."""
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
        layer = _take_pending(key)  # an XattnCache's layer returned these keys: continue it
        key, value = _repeat_kv(query, key, value)
        if layer is not None:
            return self._continue(layer, module, query, key, value, attention_mask, kwargs,
                                  scaling, training)
        mask = self._mask(module, attention_mask, kwargs, query.shape[-2], key.shape[-2])
        key_mask = None if mask.key_mask is None else mask.key_mask[:, None, :]
        if mask.causal and self.estimator == "lara":
            raise ValueError("estimator='lara' runs in bidirectional (encoder) attention only: "
                             "its segment proposals look ahead, and this attention is causal; "
                             "use 'rfa', 'ra' or 'softmax' in decoder models")
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

    def _call_options(self, module: Any, query: torch.Tensor, scaling: float | None,
                      training: bool) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The estimator options of a call (the model's ``scaling`` as ``scale``) and RFA's
        features (drawn afresh in training mode, the module's fixed ones in evaluation)."""
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
        else:
            self._core(query.shape[-1])  # the options hold for this head size
        return options, omega

    def _continue(self, layer: StateLayer, module: Any, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Any, kwargs: dict[str, Any],
                  scaling: float | None, training: bool) -> tuple[torch.Tensor, None]:
        """Attention of the new tokens through the state of an :class:`XattnCache` layer:
        the estimator continues the layer's state over them and the layer keeps the state
        it returns."""
        length, seen = query.shape[-2], layer.position
        if training:
            raise ValueError(f"xattn.transformers.XattnCache runs in evaluation mode only "
                             f"(model.eval()): in training mode {self.name!r} draws afresh at "
                             "every call, which a state cannot continue")
        if layer.owner is not None and layer.owner is not self:
            raise ValueError(f"this XattnCache layer holds the state of another attention "
                             f"({layer.owner.name!r}), not of {self.name!r}; start a new cache")
        if self.estimator == "lara":
            raise ValueError("estimator='lara' runs in bidirectional (encoder) attention only: "
                             "its segment proposals look ahead, and a cache is causal; use "
                             "'rfa', 'ra' or 'softmax' with xattn.transformers.XattnCache")
        if key.shape[-2] != length:
            raise ValueError(f"{length} queries with {key.shape[-2]} new keys: an XattnCache "
                             "takes the queries of the new tokens with their keys")
        mask: AttentionMask | None
        if isinstance(attention_mask, torch.Tensor):
            mask = _mask_from_tensor(attention_mask, length, seen + length)
        elif isinstance(attention_mask, AttentionMask) or attention_mask is None:
            mask = attention_mask
        else:
            raise ValueError(f"xattn attention ({self.name!r}) takes padding and causal masks "
                             f"only, got a {type(attention_mask).__name__}")
        if mask is None:
            is_causal = kwargs.get("is_causal")
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        else:
            causal = mask.causal
        if not causal:
            raise ValueError("xattn.transformers.XattnCache continues causal attention only; "
                             "this attention is bidirectional")
        key_mask = None
        if mask is not None:
            if mask.kv_length != seen + length or mask.query_start != seen:
                raise ValueError(f"the attention mask was made for {mask.kv_length} keys from "
                                 f"query position {mask.query_start}; the cache has seen {seen} "
                                 f"tokens and {length} come")
            if mask.key_mask is not None:
                key_mask = mask.key_mask[:, None, seen:seen + length]
        options, omega = self._call_options(module, query, scaling, training)
        out, state = attend(self.estimator, query, key, value, options=options,
                            key_mask=key_mask, causal=True, training=False, omega=omega,
                            state=layer.state, stateful=True)
        layer.store(state, length, self)
        return out.transpose(1, 2).contiguous(), None

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
            return _mask_from_tensor(mask, q_length, kv_length)
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
        Seed of the evaluation-mode RFA features (default 0); each attention module draws
        its own from it and its layer index.
    generator : torch.Generator, optional
        Source of the training-mode draws; default torch's default generator.
    **options
        Estimator options, as the layers take them (e.g. ``num_features``, ``window``,
        ``sinks``, ``feature_map`` for ``"rfa"``; ``num_samples``, ``proposal``,
        ``weighting`` for ``"lara"``; ``num_samples`` for ``"ra"``); ``scale`` is the
        model's and cannot be given, nor LARA's ``proposal="learned"`` (it needs
        parameters the model does not have).

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
        unknown estimator; ``scale``; ``proposal="learned"``; an option value the
        estimator refuses.

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
    if estimator == "lara" and options.get("proposal") == "learned":
        raise ValueError("proposal='learned' needs parameters (the proposal means) that a "
                         "transformers model does not have; use xattn.torch.MultiheadAttention"
                         " or another proposal")
    function = XattnAttention(name, estimator, options, seed, generator)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, attention_mask)
    return function


_pending = threading.local()  # the layer whose update() returned the keys last, and the keys


def _take_pending(key: Any) -> StateLayer | None:
    """The layer whose ``update`` returned ``key`` (the very tensor), if it has not been
    taken yet; None otherwise (no xattn cache in this call)."""
    record = getattr(_pending, "record", None)
    if record is None or record[1] is not key:
        return None
    _pending.record = None
    layer = record[0]
    layer.pending = False
    return layer


def _map_batch(state: Any, function: Any) -> Any:
    """``state`` with ``function`` applied to each array of its batch dimension (dim 0)."""
    if isinstance(state, LARAState):
        return dataclasses.replace(state, features=_map_batch(state.features, function),
                                   proposal_means=function(state.proposal_means)
                                   if state.proposal_means.ndim > 2 else state.proposal_means)
    if isinstance(state, _KeyValueCache):
        return dataclasses.replace(state, keys=function(state.keys),
                                   values=function(state.values), valid=function(state.valid))
    assert isinstance(state, RFAState)
    changes = {name: function(getattr(state, name)) for name in (
        "feature_max", "feature_sums", "window_keys", "window_values", "window_valid",
        "sink_keys", "sink_values", "sink_valid")}
    if state.feature_weight is not None:
        changes["feature_weight"] = function(state.feature_weight)
    if state.omega.ndim > 2:  # LARA's samples, one set per batch-head
        changes["omega"] = function(state.omega)
    return dataclasses.replace(state, **changes)


def _state_nbytes(state: Any) -> int:
    """The bytes of the arrays of a state (0 for None)."""
    if state is None:
        return 0
    total = 0
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif dataclasses.is_dataclass(value):
            total += _state_nbytes(value)
    return total


class StateLayer(CacheLayerMixin):
    """One layer of an :class:`XattnCache`: the estimator state of one attention module
    and the number of tokens it has seen.

    Made by the cache on the first call of its attention module (transformers'
    ``CacheLayerMixin``). Its ``update`` returns the new keys and values as they are and
    marks them for the xattn attention function, which continues ``state`` over them.

    Attributes
    ----------
    state : xattn.RFAState, xattn.SoftmaxState, xattn.RAState or None
        The estimator's state after ``position`` tokens (None before the first).
    position : int
        The number of tokens the state has seen.

    Examples
    --------
    >>> from xattn.transformers import StateLayer
    >>> layer = StateLayer()  # before the first call: no state, no tokens
    >>> layer.state is None, layer.get_seq_length(), layer.get_mask_sizes(3)
    (True, 0, (3, 0))
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.state: Any = None
        self.position = 0
        self.pending = False
        self.owner: Any = None  # the XattnAttention that made the state

    def __repr__(self) -> str:
        kind = type(self.state).__name__ if self.state is not None else "empty"
        return f"StateLayer({kind}, position={self.position})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Mark the new keys and values as pending for the xattn attention function and
        return them as they are (the state, not the keys seen, carries the past)."""
        self._check_consumed()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = True
        _pending.record = (self, key_states)
        return key_states, value_states

    def _check_consumed(self) -> None:
        if self.pending:
            self.pending = False
            raise ValueError(
                "xattn.transformers.XattnCache holds estimator states, not keys and values: "
                "it works only with an attention implementation registered by "
                "xattn.transformers.register (this model's attention did not use the "
                "state it was given; set model.set_attn_implementation(<xattn name>) or use "
                "transformers' DynamicCache)")

    def store(self, state: Any, new_tokens: int, owner: Any) -> None:
        """Keep the state returned by the estimator after ``new_tokens`` more tokens."""
        self.state = state
        self.position += new_tokens
        self.owner = owner

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the masks: the tokens seen and the new ones, so
        that the padding mask covers the new keys at their positions."""
        return self.position + query_length, 0

    def get_seq_length(self) -> int:
        """The number of tokens the state has seen."""
        self._check_consumed()
        return self.position

    def get_max_length(self) -> int:
        """-1: no maximum length."""
        return -1

    def offload(self) -> None:  # a state is small: it stays where it is
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        """Forget the state (no tokens seen)."""
        self.state = None
        self.position = 0
        self.pending = False

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: a state cannot forget tokens (assisted and speculative decoding)."""
        if tokens_to_remove:
            raise ValueError("xattn.transformers.XattnCache cannot remove tokens (crop): an "
                             "estimator state sums the keys it has seen; assisted or "
                             "speculative decoding, which roll tokens back, are not supported")

    def _select(self, function: Any) -> None:
        if self.state is not None:
            self.state = _map_batch(self.state, function)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch of the state (beam search)."""
        self._select(lambda array: array.index_select(0, beam_idx.to(array.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each sequence of the batch ``repeats`` times."""
        self._select(lambda array: array.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` of the batch."""
        self._select(lambda array: array[indices, ...])

    @property
    def nbytes(self) -> int:
        """The bytes of the state's arrays."""
        return _state_nbytes(self.state)


class XattnCache(Cache):
    """A transformers cache holding xattn estimator states, for ``model.generate`` at a
    fixed cost per token.

    Each attention layer (by its ``layer_idx``) holds the state that the causal estimator
    returns with ``return_state=True``: an :class:`xattn.RFAState` for ``"rfa"`` (fixed
    size whatever the number of tokens: the feature sums, and with ``window`` / ``sinks``
    those keys and values), an :class:`xattn.SoftmaxState` or :class:`xattn.RAState`
    (key-value caches) for ``"softmax"`` and ``"ra"``. The prefill and each new token run
    the estimator over the new tokens only, continuing the state (``state=``); in
    evaluation mode the outputs are those of a forward pass over the whole sequence, up
    to rounding. Pass one to ``generate`` (or to the model's forward) as ``cache=``
    (transformers' earlier name ``past_key_values=`` works too) on a model whose
    attention implementation was registered by :func:`xattn.transformers.register`;
    ``generate`` does not make one by itself.

    Padding of the batch (left-padded prompts) reaches the states as the key mask:
    masked keys never enter a state. Beam search, ``num_return_sequences`` and
    contrastive search reorder, repeat or select the states along the batch.
    Not supported (``ValueError``): training mode, cropping (assisted and speculative
    decoding), LARA (whose attention is refused in causal models), the cache with an
    attention that is not xattn's, and bidirectional attention.

    Parameters
    ----------
    config : optional
        Unused; accepted so that the cache can be made as transformers makes its own
        (``XattnCache(config=model.config)``).

    Attributes
    ----------
    layers : list of StateLayer
        One per attention layer that has run, in ``layer_idx`` order.

    Examples
    --------
    >>> import torch
    >>> import xattn.transformers
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> _ = xattn.transformers.register("xattn_rfa_cache_doc", num_features=16)
    >>> config = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64,
    ...                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    >>> _ = torch.manual_seed(0)
    >>> model = GPT2LMHeadModel(config).eval()
    >>> model.set_attn_implementation("xattn_rfa_cache_doc")
    >>> cache = xattn.transformers.XattnCache()
    >>> prompt = torch.randint(50, (1, 10))
    >>> out = model.generate(prompt, cache=cache, max_new_tokens=5, do_sample=False)
    >>> out.shape, cache.get_seq_length()
    (torch.Size([1, 15]), 14)
    >>> type(cache.layers[0].state).__name__
    'RFAState'
    """

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(layer_class_to_replicate=StateLayer)

    def _state_layers(self) -> list[StateLayer]:
        return [layer for layer in self.layers if isinstance(layer, StateLayer)]

    @property
    def nbytes(self) -> int:
        """The bytes of all the layers' states."""
        return sum(layer.nbytes for layer in self._state_layers())

    @property
    def batch_size(self) -> int:
        """The batch size of the states (-1 before the first forward pass)."""
        for layer in self._state_layers():
            if layer.state is not None:
                state = layer.state.features if isinstance(layer.state, LARAState) else layer.state
                array = state.keys if isinstance(state, _KeyValueCache) else state.feature_sums
                return int(array.shape[0])
        return -1
