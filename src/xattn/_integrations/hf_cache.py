"""The cache of xattn's transformers hook: estimator states in place of keys and values.

:class:`XattnCache` (a transformers ``Cache``) holds one :class:`StateLayer` per attention
layer; a layer's ``update`` hands the new keys to the xattn attention function through a
thread-local record (:func:`take_pending`), and :func:`continue_state` runs the estimator
over the new tokens only, continuing the layer's state. Grouped-query attention keeps one
state per key-value head: the states of the query heads of a group are equal (they sum the
same keys with the same features), so one of them is stored and expanded (a view) to the
group at the next call. Re-exported by :mod:`xattn.transformers`, where the classes are
documented.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from xattn._core.state import LARAState, RFAState, _KeyValueCache
from xattn._integrations.hf_masks import AttentionMask, mask_from_tensor
from xattn._integrations.layers import attend

__all__ = ["StateLayer", "XattnCache", "continue_state", "map_batch", "state_nbytes",
           "take_pending"]

_pending = threading.local()  # the layer whose update() returned the keys last, and the keys


def take_pending(key: Any) -> StateLayer | None:
    """The layer whose ``update`` returned ``key`` (the very tensor), if it has not been
    taken yet; None otherwise (no xattn cache in this call)."""
    record = getattr(_pending, "record", None)
    if record is None or record[1] is not key:
        return None
    _pending.record = None
    layer = record[0]
    layer.pending = False
    return layer


def map_batch(state: Any, function: Any) -> Any:
    """``state`` with ``function`` applied to each of its arrays that has the batch and
    head dimensions (the leading ones); the shared samples and proposal means are kept."""
    if isinstance(state, LARAState):
        return dataclasses.replace(state, features=map_batch(state.features, function),
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
    # LARA's samples, one set per batch-head (RFA's per-head samples (kv_heads, groups, S,
    # d) have no batch dim: kept, as shared ones)
    if state.omega.ndim == state.feature_sums.ndim:
        changes["omega"] = function(state.omega)
    return dataclasses.replace(state, **changes)


def state_nbytes(state: Any) -> int:
    """The bytes of the arrays of a state (0 for None)."""
    if state is None:
        return 0
    total = 0
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif dataclasses.is_dataclass(value):
            total += state_nbytes(value)
    return total


def _one_per_group(state: Any) -> Any:
    """The state of the first query head of each group, ``(batch, kv_heads, 1, ...)``, in
    arrays of its own (a copy: the group's arrays are freed)."""
    return map_batch(state, lambda array: array[:, :, :1].clone())


def _expand_to_groups(state: Any, groups: int) -> Any:
    """A stored state ``(batch, kv_heads, 1, ...)`` as views over the ``groups`` query heads
    of each key-value head."""
    return map_batch(state, lambda array: array.expand(
        *array.shape[:2], groups, *array.shape[3:]))


def _call_mask(attention_mask: Any, name: str, length: int, seen: int) -> AttentionMask | None:
    """The mask of a call continuing a cache layer (None: none given)."""
    if isinstance(attention_mask, torch.Tensor):
        return mask_from_tensor(attention_mask, length, seen + length)
    if isinstance(attention_mask, AttentionMask) or attention_mask is None:
        return attention_mask
    raise ValueError(f"xattn attention ({name!r}) takes padding and causal masks only, got a "
                     f"{type(attention_mask).__name__}")


def continue_state(attention: Any, layer: StateLayer, module: Any, query: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                   kwargs: dict[str, Any], scaling: float | None,
                   training: bool) -> tuple[torch.Tensor, None]:
    """Attention of the new tokens (``query (B, H, L, d)``, ``key (B, Hk, L, d)``, ``value
    (B, Hk, L, dv)``) through the state of an :class:`XattnCache` layer: ``attention``
    (an :class:`xattn.transformers.XattnAttention`) continues the layer's state over them
    and the layer keeps the state it returns, one per key-value head. Returns ``(output
    (B, L, H, dv), None)``."""
    length, seen = query.shape[-2], layer.position
    if training:
        raise ValueError(f"xattn.transformers.XattnCache runs in evaluation mode only "
                         f"(model.eval()): in training mode {attention.name!r} draws afresh at "
                         "every call, which a state cannot continue")
    if layer.owner is not None and layer.owner is not attention:
        raise ValueError(f"this XattnCache layer holds the state of another attention "
                         f"({layer.owner.name!r}), not of {attention.name!r}; start a new cache")
    if key.shape[-2] != length:
        raise ValueError(f"{length} queries with {key.shape[-2]} new keys: an XattnCache "
                         "takes the queries of the new tokens with their keys")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"the query heads ({heads}) must be a multiple of the key and "
                         f"value heads ({kv_heads})")
    mask = _call_mask(attention_mask, attention.name, length, seen)
    if mask is None:
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    else:
        causal = mask.causal
    if not causal:
        raise ValueError("xattn.transformers.XattnCache continues causal attention only; "
                         "this attention is bidirectional")
    attention.check_causal()
    key_mask = None
    if mask is not None:
        if mask.kv_length != seen + length or mask.query_start != seen:
            raise ValueError(f"the attention mask was made for {mask.kv_length} keys from "
                             f"query position {mask.query_start}; the cache has seen {seen} "
                             f"tokens and {length} come")
        if mask.key_mask is not None:
            key_mask = mask.key_mask[:, None, None, seen:seen + length]
    groups = heads // kv_heads
    grouped_query = query.unflatten(1, (kv_heads, groups))  # (B, Hk, G, L, d)
    options, omega = attention._call_options(module, query, scaling, training)
    # per-head RFA samples (H, S, d) (fitted ones): as (Hk, G, S, d), and one state per
    # query head (the heads of a group read their keys through different features)
    per_head = omega is not None and omega.ndim > 2 and attention.estimator == "rfa"
    if per_head:
        omega = (omega.unflatten(-3, (kv_heads, groups)) if omega.shape[-3] == heads
                 else omega.unsqueeze(-3))
    state = (layer.state if layer.state is None or per_head
             else _expand_to_groups(layer.state, groups))
    out, state = attend(attention.estimator, grouped_query, key[:, :, None], value[:, :, None],
                        options=options, key_mask=key_mask, causal=True, training=False,
                        omega=omega, state=state, stateful=True)
    layer.store(state if per_head else _one_per_group(state), length, attention)
    return out.flatten(1, 2).transpose(1, 2).contiguous(), None


class StateLayer(CacheLayerMixin):
    """One layer of an :class:`XattnCache`: the estimator state of one attention module
    and the number of tokens it has seen.

    Made by the cache on the first call of its attention module (transformers'
    ``CacheLayerMixin``). Its ``update`` returns the new keys and values as they are and
    marks them for the xattn attention function, which continues ``state`` over them.

    Attributes
    ----------
    state : xattn.RFAState, xattn.LARAState, xattn.SoftmaxState, xattn.RAState or None
        The estimator's state after ``position`` tokens (None before the first), with the
        leading dimensions ``(batch, kv_heads, 1)``: one state per key-value head (the
        query heads of a group share it); ``(batch, kv_heads, groups)`` with per-head RFA
        samples, one state per query head.
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
            self.state = map_batch(self.state, function)

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
        return state_nbytes(self.state)


class XattnCache(Cache):
    """A transformers cache holding xattn estimator states, for ``model.generate`` at a
    fixed cost per token.

    Each attention layer (by its ``layer_idx``) holds the state that the causal estimator
    returns with ``return_state=True``: an :class:`xattn.RFAState` for ``"rfa"`` (fixed
    size whatever the number of tokens: the feature sums, and with ``window`` / ``sinks``
    those keys and values), an :class:`xattn.LARAState` for causal ``"lara"`` (fixed
    size too), an :class:`xattn.SoftmaxState` or :class:`xattn.RAState` (key-value
    caches) for ``"softmax"`` and ``"ra"``. With grouped-query attention each state is
    held once per key-value head, not repeated to the query heads: the query heads of a
    group attend the same keys, with features (RFA) or samples (LARA's evaluation mode)
    shared by the heads, so their states are equal; the cache is then the group factor
    smaller than with one state per query head. The prefill and each new token run
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
    decoding), LARA with options that look ahead (segment proposals, the decoupled or
    coupled weighting; use ``proposal="learned"``), the cache with an attention that is
    not xattn's, and bidirectional attention.

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
