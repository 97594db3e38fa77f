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

from xattn._core.array import compute_dtype
from xattn._core.docstrings import fill_docstring
from xattn._core.options import check_bool, check_sizes, lara_num_samples
from xattn._integrations.layers import (
    DEFAULT_LARA_SAMPLES,
    ESTIMATOR_OPTIONS_DOC,
    ESTIMATORS,
    RFA_ONLY_RAISES,
    LayerCore,
    check_features_shape,
    draw_features,
    learned_proposal_means,
    module_docstring,
)
from xattn._integrations.torch_layer import Projections, is_causal_mask
from xattn.random import Generator, TorchDefaultGenerator, TorchGenerator

__all__ = ["DEFAULT_LARA_SAMPLES", "ESTIMATORS", "MultiheadAttention"]

__doc__ = module_docstring(__doc__, features_home="the buffer ``features`` (saved in the "
                                                  "``state_dict``)")


#: The first lines of every Examples section below.
_EXAMPLES_OPENING = """\
Examples
--------
>>> import torch
>>> import xattn.torch"""


@fill_docstring(examples=_EXAMPLES_OPENING, estimator_options=ESTIMATOR_OPTIONS_DOC)
class MultiheadAttention(LayerCore, Projections):
    r"""Multi-head attention with an xattn estimator, a drop-in for
    :class:`torch.nn.MultiheadAttention`.

    .. math::

        \mathrm{MultiHead}(Q, K, V) = [\mathrm{head}_1, \dots, \mathrm{head}_h] W^O,
        \quad \mathrm{head}_i = \mathrm{attention}(Q W_i^Q, K W_i^K, V W_i^V)

    where ``attention`` is the chosen estimator of softmax attention with scale
    ``1/sqrt(head_dim)``.

    **Training and evaluation.** ``estimator="rfa"``: the samples :math:`\omega`
    (buffer ``features``, shape ``(num_features, head_dim)``, shared by all heads, or
    ``(num_heads, num_features, head_dim)``, one matrix per head, when such a tensor is
    assigned to ``features`` or loaded from a ``state_dict``: fitted samples, say) are
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
    {{estimator_options}}

    Raises
    ------
    ValueError
        ``embed_dim`` not divisible by ``num_heads``, unknown ``estimator``, ``dropout``
        not 0, sizes or ``redraw_interval`` below 1, or a bad option value (checked
        here, before any forward call).
    TypeError
        An option the estimator does not take, or an argument or option of the wrong
        type (a float ``num_samples``, a non-bool ``batch_first``, ...).

    {{examples}}
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
        self._create_projections(bias, factory)

        self.steps_since_redraw = 0
        if estimator == "rfa":
            self.register_buffer("features", torch.empty((0, self.head_dim), **factory))
            self.redraw_features()
        else:
            self.register_buffer("features", None)
        self.proposal_means: torch.nn.Parameter | None = None
        if self.learned_proposals:  # LARA's means, learned: (num_heads, C, head_dim)
            device = None if self.generator is None else self.generator.device
            seed = int(torch.randint(2 ** 31, (1,), generator=self.generator, device=device))
            means = learned_proposal_means(seed, num_heads, lara_num_samples(estimator_options),
                                           self.head_dim)
            self.proposal_means = torch.nn.Parameter(torch.as_tensor(means).to(**factory))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # The RFA features are optional in a state_dict: one without them (that of
        # torch.nn.MultiheadAttention) loads strictly, and the layer keeps its own draw.
        self._resize_features_to(state_dict, prefix)  # per-head features: (h, S, d)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if self.features is not None and prefix + "features" in missing_keys:
            missing_keys.remove(prefix + "features")

    def _resize_features_to(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Per-head features in a ``state_dict``, ``(num_heads, S, head_dim)``, or a
        shared ``(S, head_dim)`` matrix where the layer holds per-head ones: the buffer
        takes the loaded shape (``ValueError`` naming ``features`` for another shape)."""
        loaded = state_dict.get(prefix + "features")
        if self.features is None or not isinstance(loaded, torch.Tensor):
            return
        shape = tuple(loaded.shape)
        if shape == tuple(self.features.shape):
            return
        check_features_shape(shape, self.head_dim, self.num_heads, "the state_dict holds")
        self.features = self.features.new_empty(shape)

    def _random(self) -> Generator:
        if self.generator is not None:
            return TorchGenerator(self.generator)
        return TorchDefaultGenerator()

    def _estimator_features(self) -> torch.Tensor | None:
        """What reaches the estimator as ``omega``: RFA's features, or LARA's learned
        proposal means (evaluation mode's samples); None for the other estimators."""
        return self.proposal_means if self.learned_proposals else self.features

    @torch.no_grad()
    @fill_docstring(examples=_EXAMPLES_OPENING, raises=RFA_ONLY_RAISES)
    def redraw_features(self) -> None:
        """Draw new RFA samples ``features`` in place of the old; ``steps_since_redraw``
        restarts at 0. Training-mode :meth:`forward` calls it every ``redraw_interval``
        steps; call it by hand at other times. It draws from the layer's ``generator`` (or
        torch's default generator) with the construction's feature options, on the device
        and in the dtype of the buffer (drawn in float32 at least).

        {{raises}}

        {{examples}}
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
        heads = tuple(self.features.shape[:-2])  # per-head features (h, S, d): h draws
        draws = [draw_features(self._random(), self.num_features, self.head_dim,
                               self.estimator_options, xp=xp, dtype=compute_dtype(xp, dtype),
                               device=device) for _ in range(math.prod(heads))]
        omega = draws[0] if not heads else torch.stack(draws).reshape(*heads, *draws[0].shape)
        self.features = omega.to(dtype)
        self.steps_since_redraw = 0

    @fill_docstring(examples=_EXAMPLES_OPENING)
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
            other than the causal mask; causal masking with ``estimator="lara"`` and
            options that look ahead (causal LARA needs ``proposal="learned"``, see
            :func:`xattn.lara`); with LARA's ``grid``, sequences of other than H W tokens.
        TypeError
            A ``key_padding_mask`` that is neither bool nor float; ``need_weights``,
            ``average_attn_weights`` or ``is_causal`` not a bool (NumPy bools are
            accepted).

        {{examples}}
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
        q, k, v, key_mask, layout = self._split_heads(query, key, value, key_padding_mask)
        causal = is_causal
        if attn_mask is not None and not causal:
            causal = is_causal_mask(attn_mask, q.shape[-2], k.shape[-2])
            if not causal:
                raise ValueError(
                    "attn_mask is not supported except as the causal mask (True or -inf "
                    "above the diagonal): linear estimators cannot apply arbitrary "
                    "(L, S) masks; use key_padding_mask and/or is_causal=True"
                )
        if self._counts_training_steps(self.training):
            redraw, steps = self._redraw_schedule(self.steps_since_redraw)
            if redraw:
                self.redraw_features()
            self.steps_since_redraw = steps
        heads = self._estimate(q, k, v, key_mask=key_mask, causal=causal,  # (N, h, L, d)
                               training=self.training,
                               features=self._estimator_features(),
                               rng=self._random() if self.training else None)
        return self._merge_heads(heads, layout), None

    @fill_docstring(examples=_EXAMPLES_OPENING)
    def step(
        self,
        query: torch.Tensor,
        state: Any = None,
        *,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        r"""Continue a causal sequence by the new tokens ``query``: generation.

        ``out, state = layer.step(prompt)`` attends the prompt causally and returns the
        state after it; ``out, state = layer.step(tokens, state)`` attends the next tokens
        (one or more) to themselves and to every token before, and returns the state
        after them. The outputs of the pieces are those of one causal :meth:`forward`
        ``(x, x, x, is_causal=True)`` on the whole sequence, up to rounding, in
        evaluation mode and, for ``"softmax"`` and ``"rfa"``, in training mode (``"ra"``
        in training mode draws for each piece: equal in distribution, not token by token;
        ``"lara"`` in training mode draws its samples in the first piece and keeps them).

        The state is the estimator's (per head, leading dims ``(N, num_heads)``):
        :class:`xattn.RFAState` for ``"rfa"``, of fixed size, holding the layer's
        ``features`` of the sequence's first piece; :class:`xattn.LARAState` for
        ``"lara"`` with ``proposal="learned"``, of fixed size, holding the samples of the
        first piece (in evaluation mode the learned means); :class:`xattn.SoftmaxState` and
        :class:`xattn.RAState`, key-value caches, for ``"softmax"`` and ``"ra"``. It is an
        immutable value: keep one to branch a sequence. Autograd flows through it. A
        ``step`` never redraws the features nor counts towards ``redraw_interval``.

        Parameters
        ----------
        query : Tensor, shape (L, N, E), (N, L, E) if ``batch_first``, or (L, E)
            The new tokens (self-attention: also the keys and values).
        state : xattn.RFAState, xattn.LARAState, xattn.SoftmaxState or xattn.RAState, optional
            The state after the tokens before, as returned by ``step``; None (the default)
            begins a sequence.
        key, value : Tensor, optional
            The keys and values of the same L new tokens (default: ``query`` and ``key``),
            with ``kdim`` and ``vdim`` features.
        key_padding_mask : Tensor, shape (N, L) or (L,), optional
            True (or -inf) marks new tokens that no query attends, now or later.

        Returns
        -------
        output : Tensor, shaped like ``query``
        state : the state after these tokens

        Raises
        ------
        ValueError
            ``estimator="lara"`` with options that look ahead (the default segment
            proposals: use ``proposal="learned"``); ``key`` or ``value`` with another
            length than ``query``; a state of other heads or another batch; ``"rfa"``
            features redrawn or loaded since the sequence began (begin a new one); the
            input errors of :meth:`forward`.
        TypeError
            A state that is not the estimator's state class.

        {{examples}}
        >>> generator = torch.Generator().manual_seed(0)
        >>> layer = xattn.torch.MultiheadAttention(16, 4, estimator="rfa", window=2,
        ...                                        batch_first=True, generator=generator)
        >>> _ = layer.eval()
        >>> x = torch.randn(2, 10, 16, generator=generator)
        >>> out, state = layer.step(x[:, :6])  # the prompt
        >>> pieces = [out]
        >>> for t in range(6, 10):  # then one token at a time
        ...     out, state = layer.step(x[:, t:t + 1], state)
        ...     pieces.append(out)
        >>> whole, _ = layer(x, x, x, is_causal=True)
        >>> bool(torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-5))
        True
        >>> type(state).__name__, int(state.position)
        ('RFAState', 10)
        """
        self._require_causal_estimator("step")
        key = query if key is None else key
        q, k, v, mask, layout = self._split_heads(query, key, key if value is None else value,
                                                  key_padding_mask)
        heads, state = self._continue(q, k, v, key_mask=mask, training=self.training,
                                      features=self._estimator_features(), state=state,
                                      rng=self._random() if self.training else None,
                                      restart="begin a new one: step(query) without state")
        return self._merge_heads(heads, layout), state

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"estimator={self.estimator!r}, redraw_interval={self.redraw_interval}, "
                f"batch_first={self.batch_first}, options={self.estimator_options}")
