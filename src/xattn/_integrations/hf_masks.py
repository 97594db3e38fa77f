"""The masks of xattn's transformers hook: key padding and causal or not, in place of
transformers' ``(batch, 1, L, S)`` mask tensors.

:func:`attention_mask` is the mask function that :func:`xattn.transformers.register` adds
to transformers' ``AttentionMaskInterface``; :class:`AttentionMask` is what it returns and
what the xattn attention function receives; :func:`mask_from_tensor` reads a prepared 4-D
mask tensor as one, if it is a padding mask (causal or not). Re-exported by
:mod:`xattn.transformers`, where they are documented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
)

__all__ = ["AttentionMask", "attention_mask", "mask_from_tensor"]


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


def mask_from_tensor(mask: torch.Tensor, q_length: int, kv_length: int) -> AttentionMask:
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
