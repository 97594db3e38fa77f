"""The torch half of :class:`xattn.torch.MultiheadAttention` that is not the layer itself.

* **Projections** (:class:`Projections`): the parameters of
  :class:`torch.nn.MultiheadAttention` under its names (``in_proj_weight`` or
  ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``, ``in_proj_bias``,
  ``out_proj``), its initialization, the split of the inputs into heads and their merge.
* **Input conventions**: the layouts of ``query``, ``key`` and ``value`` (batched or not,
  ``batch_first`` or not), ``key_padding_mask`` (True or -inf = ignore) and the one
  ``attn_mask`` the layer takes, the causal mask.

Framework code (it imports torch), kept apart from ``xattn/torch.py`` so that the layer
module stays short; loaded with :mod:`xattn.torch`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["Projections", "check_layout", "is_causal_mask",
           "key_mask"]


def _same_view(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the inputs view the same elements alike (False under :func:`torch.compile`,
    which plans its copies itself)."""
    return not torch.compiler.is_compiling() and all(
        (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
        == (query.data_ptr(), query.shape, query.stride(), query.dtype, query.device)
        for x in (key, value))


class Projections(nn.Module):
    """The projections of :class:`torch.nn.MultiheadAttention`, with its parameter names and
    initialization; a layer sets ``embed_dim``, ``kdim``, ``vdim``, ``num_heads``,
    ``head_dim`` and ``batch_first``, then calls :meth:`_create_projections`."""

    embed_dim: int
    kdim: int
    vdim: int
    num_heads: int
    head_dim: int
    batch_first: bool

    def _create_projections(self, bias: bool, factory: dict[str, Any]) -> None:
        # Parameter names follow torch.nn.MultiheadAttention, so its state_dict loads here.
        # ``_qkv_same_embed_dim`` is what torch reads to choose the fused fast paths of
        # nn.TransformerEncoderLayer / nn.TransformerEncoder, which would bypass this
        # module's forward; it is always False here, the packed layout is told by
        # ``in_proj_weight`` being set.
        self._qkv_same_embed_dim = False
        embed_dim = self.embed_dim
        if self.kdim == embed_dim and self.vdim == embed_dim:  # packed
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim),
                                                           **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # the initialization of torch.nn.MultiheadAttention
        if self.in_proj_weight is not None:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def _split_heads(self, query, key, value, key_padding_mask):
        """Checked inputs -> per-head ``q, k, v`` (N, h, L, d), the key mask and the layout
        (target length, batch, batched) that :meth:`_merge_heads` restores."""
        query, key, value, batched = check_layout(
            query, key, value, features=(self.embed_dim, self.kdim, self.vdim),
            batch_first=self.batch_first)  # now (L, N, E)
        batch = query.shape[1]
        mask = key_mask(key_padding_mask, batch if batched else None, key.shape[0])
        return (*self._project(query, key, value), mask, (query.shape[0], batch, batched))

    def _merge_heads(self, heads, layout):
        """Per-head outputs (N, h, L, d) -> ``out_proj`` of the merged heads, in the layout
        of the inputs."""
        target_length, batch, batched = layout
        merged = heads.permute(2, 0, 1, 3).reshape(target_length, batch, self.embed_dim)
        output = self.out_proj(merged)
        if not batched:
            return output[:, 0]
        return output.transpose(0, 1) if self.batch_first else output

    def _project(self, query, key, value):
        embed_dim = self.embed_dim
        if _same_view(query, key, value):  # self-attention, batch_first: views of one input
            # one (L, N, E) copy for the three products (as in torch.nn.MultiheadAttention),
            # not one each kept for the backward pass; the same copy, the same results
            query = key = value = query.contiguous()
        if self.in_proj_weight is not None:
            weights = self.in_proj_weight.split(embed_dim)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (self.in_proj_bias.split(embed_dim) if self.in_proj_bias is not None
                  else (None, None, None))
        projected = (nn.functional.linear(x, weight, bias)  # (L, N, E) each
                     for x, weight, bias in zip((query, key, value), weights, biases, strict=True))
        return [x.reshape(*x.shape[:2], self.num_heads, self.head_dim).permute(1, 2, 0, 3)
                for x in projected]


def check_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 features: tuple[int, int, int], batch_first: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The inputs in the layout ``(L, N, E)`` and whether they were batched; ``ValueError``
    for a wrong rank, feature size (``features``: E, kdim, vdim) or batch."""
    if query.dim() not in (2, 3):
        raise ValueError(f"query must be 2-D (unbatched) or 3-D, got shape "
                         f"{tuple(query.shape)}")
    if key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(f"query, key and value must have the same rank, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    batched = query.dim() == 3
    if not batched:
        query, key, value = query[:, None], key[:, None], value[:, None]
    elif batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    batch = query.shape[1]
    for name, tensor, dim in zip(("query", "key", "value"), (query, key, value), features,
                                 strict=True):
        if tensor.shape[-1] != dim:
            raise ValueError(f"{name} must have {dim} features in its last dim, got "
                             f"shape {tuple(tensor.shape)}")
    if key.shape[:2] != value.shape[:2] or key.shape[1] != batch:
        raise ValueError(f"key and value must have shapes (S, {batch}, .) matching the "
                         f"query batch, got {tuple(key.shape)} and {tuple(value.shape)}")
    return query, key, value, batched


def key_mask(key_padding_mask: torch.Tensor | None, batch: int | None,
             source_length: int) -> torch.Tensor | None:
    """torch's ``key_padding_mask`` (True / -inf = ignore) -> xattn's ``key_mask`` (True =
    use), ``(batch, 1, S)`` to broadcast over the heads (``batch`` None: unbatched)."""
    if key_padding_mask is None:
        return None
    expected = (source_length,) if batch is None else (batch, source_length)
    if tuple(key_padding_mask.shape) != expected:
        raise ValueError(
            f"key_padding_mask must have shape {expected} (batch, source length), got "
            f"{tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.dtype == torch.bool:
        mask = ~key_padding_mask
    elif key_padding_mask.is_floating_point():
        if not torch.compiler.is_compiling() and not bool(torch.all(
                (key_padding_mask == 0) | (key_padding_mask == -math.inf))):
            raise ValueError("a float key_padding_mask must hold only 0 (attend) and -inf "
                             "(ignore); other additive biases are not supported")
        mask = key_padding_mask == 0
    else:
        raise TypeError(f"key_padding_mask must be bool or float, got "
                        f"{key_padding_mask.dtype}")
    mask = mask[..., None, :]  # broadcast over heads: (batch, 1, S)
    return mask if batch is not None else mask[None]


def is_causal_mask(attn_mask: torch.Tensor, target_length: int, source_length: int) -> bool:
    """Whether ``attn_mask`` is the causal mask (True or -inf above the diagonal);
    ``ValueError`` for a mask of another shape than ``(L, S)``."""
    if tuple(attn_mask.shape) != (target_length, source_length):
        raise ValueError(
            f"attn_mask must have shape ({target_length}, {source_length}) (a causal mask);"
            f" got {tuple(attn_mask.shape)}: per-batch or per-head masks are not supported"
        )
    if torch.compiler.is_compiling():
        return True
    future = torch.ones((target_length, source_length), dtype=torch.bool,
                        device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        return bool(torch.equal(attn_mask, future))
    blocked = torch.where(future, attn_mask == -math.inf, attn_mask == 0)
    return bool(torch.all(blocked))
