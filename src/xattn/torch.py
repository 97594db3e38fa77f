r"""PyTorch multi-head attention layer backed by an xattn estimator.

:class:`MultiheadAttention` is shaped after :class:`torch.nn.MultiheadAttention` (same
constructor arguments where they apply, same parameter names ``in_proj_weight``,
``in_proj_bias`` or ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``, and
``out_proj``, same input layouts and ``forward`` signature), so it drops into existing
models, and a ``state_dict`` of :class:`torch.nn.MultiheadAttention` loads into it, strict
loading included.

Randomness comes from the ``generator=`` :class:`torch.Generator` if given: then no draw
touches torch's global random state. Without it, the draws come from torch's default
generator of the device (the one :func:`torch.manual_seed` seeds), as ``torch.nn.Dropout``
does, and advance it (see the ``generator`` parameter of :class:`MultiheadAttention`).

This module needs PyTorch, so ``import xattn`` does not import it: it is loaded on the first
use of ``xattn.torch`` (or by ``import xattn.torch``).
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat
import torch
from torch import nn

from xattn._array import compute_dtype
from xattn._layers import (
    DEFAULT_LARA_SAMPLES,
    ESTIMATORS,
    LayerCore,
    draw_features,
    fill_docstring,
    module_docstring,
)
from xattn._options import check_bool, check_sizes
from xattn.random import Generator, TorchGenerator

__all__ = ["DEFAULT_LARA_SAMPLES", "ESTIMATORS", "MultiheadAttention"]

__doc__ = module_docstring(__doc__, features_home="the buffer ``features`` (saved in the "
                                                  "``state_dict``)")


class _DefaultTorchGenerator(Generator):
    """Draws with torch's default generator of the target device (the global generator
    that :func:`torch.manual_seed` seeds): each draw advances it, and so changes
    ``torch.get_rng_state()`` (or the CUDA generator's state), as ``torch.nn.Dropout``
    does."""

    def normal(self, xp, shape, *, dtype, device=None):
        return torch.randn(tuple(shape), dtype=dtype, device=device)

    def uniform(self, xp, shape, *, dtype, device=None):
        return torch.rand(tuple(shape), dtype=dtype, device=device)


def _same_view(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the inputs view the same elements alike (False under :func:`torch.compile`,
    which plans its copies itself)."""
    return not torch.compiler.is_compiling() and all(
        (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)
        == (query.data_ptr(), query.shape, query.stride(), query.dtype, query.device)
        for x in (key, value))


@fill_docstring
class MultiheadAttention(LayerCore, nn.Module):
    r"""Multi-head attention with an xattn estimator, a drop-in for
    :class:`torch.nn.MultiheadAttention`.

    .. math::

        \mathrm{MultiHead}(Q, K, V) = [\mathrm{head}_1, \dots, \mathrm{head}_h] W^O,
        \quad \mathrm{head}_i = \mathrm{attention}(Q W_i^Q, K W_i^K, V W_i^V)

    where ``attention`` is the chosen estimator of softmax attention with scale
    ``1/sqrt(head_dim)``.

    **Training and evaluation.** ``estimator="rfa"``: the samples :math:`\omega`
    (buffer ``features``, shape ``(num_features, head_dim)``, shared by all heads) are
    redrawn at the start of a training-mode ``forward`` once ``redraw_interval`` training
    steps have used them (Performer's schedule), never in evaluation mode; call
    :meth:`redraw_features` to redraw by hand. The step count ``steps_since_redraw`` is a
    plain attribute, not part of the ``state_dict``: a loaded layer keeps the loaded
    features for ``redraw_interval`` further training steps. A ``state_dict`` without
    ``features`` (that of :class:`torch.nn.MultiheadAttention`) loads, strictly too, and
    the layer keeps its own features. ``"lara"``: random samples in training
    mode, ``deterministic=True`` in evaluation mode. ``"ra"``: the unbiased random
    estimator in training mode, ``biased=True, deterministic=True`` in evaluation mode.
    Evaluation outputs are therefore deterministic for every estimator.

    **Attention weights are not materialized**: the linear estimators never form the
    ``N x M`` matrix, so ``forward`` returns ``(output, None)`` and rejects
    ``need_weights=True``. Supported masks are ``key_padding_mask`` (boolean, True =
    ignore, or float with entries 0 / -inf) and causal masking (``is_causal=True``, or an
    ``attn_mask`` equal to the causal mask); other ``attn_mask`` forms raise.

    Parameters
    ----------
    embed_dim : int
        Model dimension E (query features and output features).
    num_heads : int
        Number of heads h; ``embed_dim`` must be divisible by it.
    estimator : {"softmax", "rfa", "ra", "lara"}
        The attention estimator (default ``"lara"``).
    redraw_interval : int or None
        ``"rfa"`` only: redraw the features after this many training steps (``forward``
        calls in training mode); ``None`` keeps them fixed until :meth:`redraw_features`.
    dropout : float
        Must be 0: dropout on attention weights needs the weights, which the linear
        estimators never form (apply dropout to the output instead).
    bias : bool
        Add biases to the input and output projections.
    kdim, vdim : int, optional
        Key and value feature dimensions (default ``embed_dim``).
    batch_first : bool
        Inputs and output are ``(batch, seq, feature)`` instead of ``(seq, batch,
        feature)``.
    device, dtype : optional
        Factory arguments of the parameters and buffers.
    generator : torch.Generator, optional
        Source of all random draws: the RFA features (drawn at construction, at each
        redraw and by :meth:`redraw_features`) and the samples of ``"ra"`` and ``"lara"``
        in training mode; evaluation mode draws nothing. With a generator, these draws
        leave ``torch.get_rng_state()`` unchanged. Default ``None``: torch's default
        generator of the device of the inputs (of the features for RFA), the global
        generator that :func:`torch.manual_seed` seeds, as ``torch.nn.Dropout``
        uses; each of these draws then advances it, exactly as it would advance a
        ``generator=`` in the same state. The parameter initialization always uses the
        global generator, as in :class:`torch.nn.MultiheadAttention`. Deep copies (as
        ``nn.TransformerEncoder`` makes of its layer) copy the generator too, so the
        copies draw the same numbers; leave ``generator=None`` or give each copy its own
        generator if that matters.
    {estimator_options}

    Raises
    ------
    ValueError
        ``embed_dim`` not divisible by ``num_heads``, unknown ``estimator``, ``dropout``
        not 0, sizes or ``redraw_interval`` below 1, or a bad option value (checked
        here, before any forward call).
    TypeError
        An option the estimator does not take, or an argument or option of the wrong
        type (a float ``num_samples``, a non-bool ``batch_first``, ...).

    Examples
    --------
    >>> import torch
    >>> import xattn.torch
    >>> generator = torch.Generator().manual_seed(0)
    >>> layer = xattn.torch.MultiheadAttention(16, 4, estimator="rfa", num_features=32,
    ...                                        batch_first=True, generator=generator)
    >>> x = torch.randn(2, 10, 16, generator=generator)
    >>> out, weights = layer(x, x, x)
    >>> out.shape, weights
    (torch.Size([2, 10, 16]), None)
    >>> layer.features.shape
    torch.Size([32, 4])
    >>> _ = layer.eval()
    >>> bool(torch.equal(layer(x, x, x)[0], layer(x, x, x)[0]))
    True
    """

    features: torch.Tensor | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        estimator: str = "lara",
        redraw_interval: int | None = 1000,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
        generator: torch.Generator | None = None,
        **estimator_options: Any,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        check_sizes(embed_dim=embed_dim, num_heads=num_heads, kdim=kdim, vdim=vdim)
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        if dropout != 0:
            raise ValueError(
                f"dropout must be 0, got {dropout!r}: dropout acts on attention weights, "
                "which xattn's linear estimators never form; apply dropout to the output"
            )
        bias = check_bool(bias, "bias")
        batch_first = check_bool(batch_first, "batch_first")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__}"
            )
        self._setup_estimator(head_dim=embed_dim // num_heads, estimator=estimator,
                              redraw_interval=redraw_interval, options=estimator_options)

        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.batch_first = batch_first
        self.dropout = 0.0
        self.generator = generator
        # Parameter names follow torch.nn.MultiheadAttention, so its state_dict loads here.
        # ``_qkv_same_embed_dim`` is what torch reads to choose the fused fast paths of
        # nn.TransformerEncoderLayer / nn.TransformerEncoder, which would bypass this
        # module's forward; it is always False here, the packed layout is told by
        # ``in_proj_weight`` being set.
        self._qkv_same_embed_dim = False
        packed = self.kdim == embed_dim and self.vdim == embed_dim
        if packed:
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

        self.steps_since_redraw = 0
        if estimator == "rfa":
            self.register_buffer("features", torch.empty((0, self.head_dim), **factory))
            self.redraw_features()
        else:
            self.register_buffer("features", None)

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

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # The RFA features are optional in a state_dict: one without them (that of
        # torch.nn.MultiheadAttention) loads strictly, and the layer keeps its own draw.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if self.features is not None and prefix + "features" in missing_keys:
            missing_keys.remove(prefix + "features")

    def _random(self) -> Generator:
        if self.generator is not None:
            return TorchGenerator(self.generator)
        return _DefaultTorchGenerator()

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw new RFA samples ``features`` in place of the old; ``steps_since_redraw``
        restarts at 0. Training-mode :meth:`forward` calls it every ``redraw_interval``
        steps; call it by hand at other times. It draws from the layer's ``generator`` (or
        torch's default generator) with the construction's feature options, on the device
        and in the dtype of the buffer (drawn in float32 at least).

        Raises
        ------
        ValueError
            If the layer's estimator is not ``"rfa"``.

        Examples
        --------
        >>> import torch
        >>> import xattn.torch
        >>> layer = xattn.torch.MultiheadAttention(
        ...     16, 4, estimator="rfa", num_features=8, redraw_interval=None,
        ...     generator=torch.Generator().manual_seed(0))
        >>> before = layer.features.clone()
        >>> layer.redraw_features()
        >>> layer.features.shape, bool(torch.equal(layer.features, before))
        (torch.Size([8, 4]), False)
        >>> layer.steps_since_redraw
        0
        """
        self._require_rfa("redraw_features")
        # an "rfa" layer registers the features buffer and sets num_features
        assert self.features is not None and self.num_features is not None
        xp = array_api_compat.array_namespace(self.features)
        device, dtype = self.features.device, self.features.dtype
        omega = draw_features(self._random(), self.num_features, self.head_dim,
                              self.estimator_options, xp=xp, dtype=compute_dtype(xp, dtype),
                              device=device)
        self.features = omega.to(dtype)
        self.steps_since_redraw = 0

    def _key_mask(self, key_padding_mask: torch.Tensor | None, batch: int | None,
                  source_length: int) -> torch.Tensor | None:
        """torch's key_padding_mask (True / -inf = ignore) -> xattn's key_mask (True = use)."""
        if key_padding_mask is None:
            return None
        expected = (source_length,) if batch is None else (batch, source_length)
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(
                f"key_padding_mask must have shape {expected} (batch, source length), got "
                f"{tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.dtype == torch.bool:
            key_mask = ~key_padding_mask
        elif key_padding_mask.is_floating_point():
            if not torch.compiler.is_compiling() and not bool(torch.all(
                    (key_padding_mask == 0) | (key_padding_mask == -math.inf))):
                raise ValueError("a float key_padding_mask must hold only 0 (attend) and -inf "
                                 "(ignore); other additive biases are not supported")
            key_mask = key_padding_mask == 0
        else:
            raise TypeError(f"key_padding_mask must be bool or float, got "
                            f"{key_padding_mask.dtype}")
        return key_mask[..., None, :]  # broadcast over heads: (batch, 1, S)

    @staticmethod
    def _is_causal_mask(attn_mask: torch.Tensor, target_length: int,
                        source_length: int) -> bool:
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

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """Attend ``query`` to ``key`` / ``value`` with the layer's estimator.

        Projects the inputs to ``num_heads`` heads, runs the estimator on every head
        (training mode: random draws, and for ``"rfa"`` a redraw of the features when
        ``redraw_interval`` steps have used them; evaluation mode: deterministic), merges
        the heads and applies ``out_proj``. The signature is that of
        ``torch.nn.MultiheadAttention.forward``, but ``need_weights`` defaults to
        False and must stay False.

        Parameters
        ----------
        query : Tensor, shape (L, N, E), (N, L, E) if ``batch_first``, or (L, E)
        key : Tensor, shape (S, N, kdim), (N, S, kdim) if ``batch_first``, or (S, kdim)
        value : Tensor, shape (S, N, vdim), (N, S, vdim) if ``batch_first``, or (S, vdim)
        key_padding_mask : Tensor, shape (N, S) or (S,), optional
            True (or -inf) marks keys to **ignore**, as in torch.
        need_weights : bool
            Must be False: attention weights are not materialized.
        attn_mask : Tensor, shape (L, S), optional
            Only the causal mask (True / -inf above the diagonal) is supported.
        average_attn_weights : bool
            Accepted for compatibility; unused.
        is_causal : bool
            Causal masking (query n attends keys m <= n, top-left aligned). With
            ``attn_mask`` given too, ``attn_mask`` is taken to be the causal mask, as in
            torch.

        Returns
        -------
        output : Tensor, shape (L, N, E), (N, L, E) if ``batch_first``, or (L, E)
        weights : None
            Always None: the estimators do not form attention weights.

        Raises
        ------
        ValueError
            ``need_weights=True``; inputs of the wrong rank or feature size, or key and
            value shapes that do not match the query batch; a ``key_padding_mask`` of the
            wrong shape or with float entries other than 0 and -inf; an ``attn_mask``
            other than the causal mask; causal masking with ``estimator="lara"``; with
            LARA's ``grid``, sequences of other than H W tokens.
        TypeError
            A ``key_padding_mask`` that is neither bool nor float; ``need_weights``,
            ``average_attn_weights`` or ``is_causal`` not a bool (NumPy bools are
            accepted).

        Examples
        --------
        >>> import torch
        >>> import xattn.torch
        >>> _ = torch.manual_seed(0)
        >>> layer = xattn.torch.MultiheadAttention(16, 4, estimator="softmax",
        ...                                        batch_first=True)
        >>> x = torch.randn(2, 10, 16)
        >>> padding = torch.zeros(2, 10, dtype=torch.bool)
        >>> padding[1, 7:] = True  # the second sequence has 7 tokens
        >>> out, weights = layer(x, x, x, key_padding_mask=padding)
        >>> out.shape, weights
        (torch.Size([2, 10, 16]), None)

        With ``is_causal=True`` the first 5 outputs do not depend on the later tokens:

        >>> causal, _ = layer(x, x, x, is_causal=True)
        >>> y = x.clone()
        >>> y[:, 5:] = 0.0
        >>> bool(torch.allclose(layer(y, y, y, is_causal=True)[0][:, :5], causal[:, :5],
        ...                     atol=1e-6))
        True
        """
        need_weights = check_bool(need_weights, "need_weights")
        check_bool(average_attn_weights, "average_attn_weights")
        is_causal = check_bool(is_causal, "is_causal")
        if need_weights:
            raise ValueError(
                "need_weights=True is not supported: xattn's estimators do not materialize "
                "attention weights; call with need_weights=False (the output is returned "
                "with None for the weights)"
            )
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (unbatched) or 3-D, got shape "
                             f"{tuple(query.shape)}")
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"query, key and value must have the same rank, got shapes "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        batched = query.dim() == 3
        if not batched:
            query, key, value = query[:, None], key[:, None], value[:, None]
        elif self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        # now (L, N, E)
        target_length, batch, _ = query.shape
        source_length = key.shape[0]
        for name, tensor, dim in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                  ("value", value, self.vdim)):
            if tensor.shape[-1] != dim:
                raise ValueError(f"{name} must have {dim} features in its last dim, got "
                                 f"shape {tuple(tensor.shape)}")
        if key.shape[:2] != value.shape[:2] or key.shape[1] != batch:
            raise ValueError(f"key and value must have shapes (S, {batch}, .) matching the "
                             f"query batch, got {tuple(key.shape)} and {tuple(value.shape)}")
        key_mask = self._key_mask(key_padding_mask, batch if batched else None, source_length)
        if key_mask is not None and not batched:
            key_mask = key_mask[None]
        causal = is_causal
        if attn_mask is not None and not causal:
            causal = self._is_causal_mask(attn_mask, target_length, source_length)
            if not causal:
                raise ValueError(
                    "attn_mask is not supported except as the causal mask (True or -inf "
                    "above the diagonal): linear estimators cannot apply arbitrary "
                    "(L, S) masks; use key_padding_mask and/or is_causal=True"
                )

        q, k, v = self._project(query, key, value)  # (N, h, L, d)
        if self._counts_training_steps(self.training):
            redraw, steps = self._redraw_schedule(self.steps_since_redraw)
            if redraw:
                self.redraw_features()
            self.steps_since_redraw = steps
        heads = self._estimate(q, k, v, key_mask=key_mask, causal=causal,  # (N, h, L, d)
                               training=self.training, features=self.features,
                               rng=self._random() if self.training else None)
        merged = heads.permute(2, 0, 1, 3).reshape(target_length, batch, self.embed_dim)
        output = self.out_proj(merged)
        if not batched:
            return output[:, 0], None
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, None

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

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"estimator={self.estimator!r}, redraw_interval={self.redraw_interval}, "
                f"batch_first={self.batch_first}, options={self.estimator_options}")
