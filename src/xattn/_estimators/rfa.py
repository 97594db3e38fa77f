r"""Random feature attention (RFA / Performer FAVOR+).

With samples :math:`\omega_1, \dots, \omega_S` (rows of ``omega``) and a randomized
mapping :math:`\xi` (Choromanski et al., ICLR 2021),

.. math::

    y_n = \frac{\sum_s \xi(\hat q_n, \omega_s) A_s}{\sum_s \xi(\hat q_n, \omega_s) b_s},
    \qquad A_s = \sum_m \xi(\hat k_m, \omega_s) v_m, \quad b_s = \sum_m \xi(\hat k_m, \omega_s),

which costs :math:`O((N + M) S D)` instead of softmax attention's :math:`O(N M D)`.
The positive and hyperbolic maps are evaluated in the log domain with one stabilizer per
side that cancels exactly (:func:`xattn._estimators.rf_groups.positive_key_sums` and
:func:`xattn._estimators.rf_groups.positive_readout`); the trigonometric map, which can be
negative, is evaluated with the key norms shifted by their maximum and a guarded denominator.

Without ``causal``, keys and queries go in groups as long as ``working_memory`` allows
(key statistics merged with a running per-sample maximum, read-out group by group): the
whole sequence is one group below the budget (a fixed number of array operations at any
length), and the working memory besides the output does not grow with the sequence
lengths above it; the output's groups are written into it where arrays can be written
(NumPy, CuPy) and concatenated once elsewhere (:class:`xattn._core.primitives.RowPieces`):
:mod:`xattn._estimators.rf_groups`. Causal mode and the exact band and sinks of ``window=`` /
``sinks=`` are computed by :mod:`xattn._estimators.rf_scan` and :mod:`xattn._estimators.window`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from xattn._core.array import Array, concrete_count, default_working_memory
from xattn._core.docstrings import document_estimator
from xattn._core.inputs import check_samples, prepare_attention
from xattn._core.options import (
    DEFAULT_CHUNK_SIZE,
    check_bool,
    check_choice,
    check_positive_int,
    check_window,
    default_num_features,
)
from xattn._core.primitives import mark_tainted, quarantine
from xattn._core.state import (
    RFAState,
    check_state_call,
    check_state_inputs,
    empty_rfa_state,
    rfa_state_options,
)
from xattn._estimators.feature_maps import PositiveMap, TrigonometricMap
from xattn._estimators.rf_groups import (
    positive_rfa,
    positive_rfa_half,
    rfa_group_rows,
    trigonometric_rfa,
)
from xattn._estimators.rf_scan import PAIR_BLOCK, block_positions, causal_scan
from xattn._estimators.sequence import NOT_GIVEN, check_parallel_call, continue_sequence
from xattn._estimators.window import band_width, windowed_rfa
from xattn.features import FEATURE_MAPS, SAMPLE_NORMS, sample_omega

__all__ = ["TrigonometricDenominatorWarning", "default_num_features", "rfa"]


class TrigonometricDenominatorWarning(RuntimeWarning):
    """The trigonometric estimate of a softmax normalizer vanished or was negative.

    Emitted by :func:`rfa` with ``feature_map="trigonometric"`` when, for some query, the
    estimated denominator :math:`\\hat Z_n` is not above ``sqrt(eps) * W_n`` (``W_n`` the
    total key weight, the largest value :math:`|\\hat Z_n|` can take). Those rows are
    computed with the denominator clamped to that floor: finite, but not trustworthy.
    Use more features, the positive map, or smaller scores.

    Examples
    --------
    >>> import warnings
    >>> import numpy as np
    >>> import xattn
    >>> q = k = 3.0 * np.eye(4)[None, :, :]
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     out = xattn.rfa(q, k, np.ones((1, 4, 1)), num_features=2,
    ...                     feature_map="trigonometric", rng=0)
    >>> bool(np.all(np.isfinite(out)))
    True
    >>> issubclass(xattn.TrigonometricDenominatorWarning, RuntimeWarning)
    True
    """


@document_estimator(RFAState)
def rfa(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_features: int | None = None,
    feature_map: str | None = None,
    orthogonal: bool = True,
    omega: Array | None = None,
    scale: float | None = None,
    key_mask: Array | None = None,
    causal: bool = False,
    rng: Any = None,
    block_size: int | None = None,
    chunk_size: int | None = None,
    sample_norm: str = "chi",
    check_finite: bool = False,
    window: int | None = None,
    sinks: int | None = None,
    state: RFAState | None = None,
    return_state: bool = False,
    working_memory: int | None = None,
    sequence_parallel: Any = NOT_GIVEN,
) -> Any:
    r"""Random feature attention (RFA / Performer FAVOR+), a linear-cost estimate of
    softmax attention.

    .. math::

        y_n = \frac{\sum_s \xi(\hat q_n, \omega_s)
                    \sum_m \xi(\hat k_m, \omega_s) v_m}
                   {\sum_s \xi(\hat q_n, \omega_s) \sum_m \xi(\hat k_m, \omega_s)}
        = \frac{\phi(\hat q_n)^\top (\phi(\hat K)^\top V)}{\phi(\hat q_n)^\top
          (\phi(\hat K)^\top 1)}

    over the allowed keys ``m`` (``key_mask``, and ``m <= n`` if ``causal``), with
    :math:`\hat q = \sqrt{s}\, q`, :math:`\hat k = \sqrt{s}\, k` and the maps of
    :func:`xattn.features.random_features`:

    * ``"positive"`` (FAVOR+): :math:`\xi(x, \omega) = e^{\omega \cdot x - \lVert x
      \rVert^2/2}`. Evaluated in the log domain: :math:`a_{ms} = \omega_s \cdot \hat k_m -
      \lVert \hat k_m \rVert^2/2`, :math:`K_s = \max_m a_{ms}`, :math:`c_{ns} = \omega_s
      \cdot \hat q_n + K_s`, :math:`Q_n = \max_s c_{ns}`; both shifts cancel exactly and no
      epsilon enters an exponent (see the stabilization theory page), so scores of 80 and more
      stay finite in float32.
    * ``"hyperbolic"``: the samples :math:`\omega_s` and :math:`-\omega_s` (``2S``
      features); its :math:`2^{-1/2}` factor cancels, the rest is the positive map.
    * ``"trigonometric"``: :math:`\xi(x, \omega) = e^{\lVert x \rVert^2/2} [\sin \omega
      \cdot x, \cos \omega \cdot x]` (``2S`` features). The query factor cancels; key
      weights :math:`e^{\lVert \hat k_m \rVert^2/2}` are shifted by their maximum. These
      features can be negative, so the estimated normalizer :math:`\hat Z_n =
      \sum_m w_m \frac1S \sum_s \cos(\omega_s \cdot (\hat q_n - \hat k_m))` can vanish or
      be negative. **Guard:** where :math:`\hat Z_n \le \sqrt{\epsilon}\, W_n` (``W_n =
      sum_m w_m`` bounds :math:`|\hat Z_n|`, :math:`\epsilon` the compute dtype's
      machine epsilon) the denominator is clamped to that floor, so the output is finite,
      and a :class:`TrigonometricDenominatorWarning` is emitted whenever the values can be
      read (not inside :func:`jax.jit` or for lazy Dask arrays, where only the clamp
      applies). Never inf.

    **Groups.** Without ``causal`` (and without ``window`` and ``sinks``), the keys and
    then the queries go in groups of ``G`` rows, ``G`` as many as ``working_memory``
    bytes hold (about ``5F + D + Dv`` numbers per row and batch-head, F = S features,
    2S for the hyperbolic and trigonometric maps), at most ``chunk_size`` if given. Below
    the budget (N = M = 16,384 at S = 64, D = Dv = 64 and two batch-heads on a CPU's 64
    MiB) a call is one group: one product for the keys, one for the queries, a fixed
    number of array operations at any length. Above it the key groups are merged with a
    running per-sample maximum :math:`K_s` that rescales :math:`A'_s, b'_s` as it grows
    and the queries are read out a group at a time: the working memory besides inputs
    and output is at most about ``working_memory``, independent of ``N`` and ``M`` (how
    the output itself is held: **Memory** below). Dask arrays are handed to Dask whole
    (it computes them chunk by chunk and the result keeps the chunks of ``q``).

    **Causal mode** is the chunkwise-parallel form (Katharopoulos et al., 2020; Hua et
    al., 2022; Yang et al., 2023): chunks of 64 positions carried as an axis, each
    chunk's key statistics from one product for all chunks, the ``(S, Dv)`` state before
    each chunk an exclusive prefix over the chunks (a running maximum with sums
    rescaled to it, merged through lower-triangular selections: two matrix products for
    up to 4,096 chunks), and the pairs of a chunk exactly, with a rank-one stabilizer:
    one shift per query, :math:`\alpha_n = \max_s \omega_s \cdot \hat q_n`, and one per
    key, :math:`\beta_m = \max_s a_{ms}`, so that every term :math:`e^{\omega_s \cdot
    \hat q_n + a_{ms}}` is the product of features in :math:`[0, 1]` and a factor
    :math:`e^{\beta_m - \mu_n}` with :math:`\mu_n = \max_{m' \le n} \beta_{m'}`: one
    (64, S) (S, 64) matrix product per chunk (positive and hyperbolic maps; the
    trigonometric map's chunks likewise, with one shared maximum). Half-precision
    inputs keep their dtype for the features and products on torch, JAX and CuPy,
    with the maxima and states in float32 (:doc:`/guide/05_half_precision`). The whole
    sequence is one block while its intermediates fit ``working_memory`` (1 GiB on a
    GPU, 64 MiB on a CPU): a call is then a fixed number of array operations at any
    length (:doc:`/guide/10_scaling`), longer sequences are walked in blocks of that size
    with the state carried. Each row is stabilized by :math:`\alpha_n + \mu_n`, so the
    causal result equals the non-causal formula applied to each prefix up to rounding
    while the spread of a row's terms fits the dtype's exponent range (tested for
    typical scores up to 100 in float32 and :math:`10^4` in float64; beyond, a row's
    largest terms can underflow, :doc:`/guide/03_masks_and_causal`). Memory is at most
    ``working_memory`` besides inputs and output (**Memory** below), and every
    stabilizer a query uses depends only on keys at or before it: outputs at positions
    ``<= n``, and the gradients of a loss on them, do not depend on tokens after ``n``.
    A NaN or infinite key or value ``m`` makes the rows that attend it NaN (rows ``>= m``
    in causal mode, every row otherwise) and leaves the others unchanged.

    **Window and sinks** (beyond the paper). With ``window=w`` (>= 1) the keys
    :math:`|n - m| \le w` are computed exactly, with ``sinks=K`` the keys :math:`m < K`
    too (Xiao et al., 2023); the random features estimate only the remaining keys
    (Scatterbrain's sparse + low-rank split, Chen et al., 2021):

    .. math::

        y_n = \frac{\sum_{m \in E_n} e^{\hat q_n \cdot \hat k_m} v_m
                    + \sum_{m \notin E_n} \hat\kappa(\hat q_n, \hat k_m) v_m}
                   {\sum_{m \in E_n} e^{\hat q_n \cdot \hat k_m}
                    + \sum_{m \notin E_n} \hat\kappa(\hat q_n, \hat k_m)},
        \qquad E_n = \{m : |n - m| \le w \text{ or } m < K\},

    :math:`\hat\kappa(x, y) = \phi(x) \cdot \phi(y)` the unbiased random-feature estimate
    of :math:`e^{x \cdot y}`. The remaining keys' sums are prefix and suffix sums over
    :math:`m \le n - w - 1` and :math:`m \ge n + w + 1` (never totals minus band terms, so
    nothing is counted twice and nothing cancels); the band is computed in chunks of
    queries against the keys within ``w`` of them (never an ``N x M`` mask); exact and
    random parts share one log-domain shift per query. With ``causal`` the band is
    :math:`n - w \le m \le n`. Cost ``O(N (C + 2w + K) D + (N + M) S D)`` (C the band's
    chunk, below). ``window=None`` or ``0`` with ``sinks=0`` is plain RFA (the same code
    and result).

    **Generation.** ``return_state=True`` returns the state that ``state=`` continues: a
    sequence given in pieces gets the outputs and state of one causal call on all of it,
    up to rounding. The state has a fixed size (:class:`~xattn.RFAState`); a piece of
    ``L`` tokens is scanned in blocks like a causal call, so one token costs ``O((S + w +
    K) D + S Dv)`` whatever came before, and a decode loop runs under ``jax.lax.scan``.

    **Memory.** The output is made a chunk (or block) of queries at a time. On NumPy and
    CuPy each piece is written into the result as it is made, so the output is held once:
    the peak besides the inputs is the output plus a working set that does not depend on
    ``N`` or ``M`` (the bounds above, and ``O(block_size (C + 2w + K))`` for the band, C =
    max(16, w) rounded up to a power of two). On the other libraries the pieces are
    concatenated once at the end (JAX arrays cannot be written; torch's autograd would copy
    the whole gradient for every written piece), so the peak is the output plus one copy of
    it while its pieces are joined, plus the working set. Beyond that, ``window`` without
    ``causal`` keeps three numbers per query (shift, denominator and weight of the sums over
    the keys after the band, which a pass from the last block back computes first; their
    numerators wait in the output's rows), the trigonometric map one flag per query (the
    clamped rows), and half-precision inputs their result cast back. Measured with
    :mod:`tracemalloc` (NumPy, float32, one batch-head, N = M = 32768, D = Dv = 64, S = 64,
    an 8 MiB output), the peak beyond the output is 34.1 MiB plain (one group), 40.1 MiB
    causal and 43.5 MiB with ``window=16, sinks=4`` (groups and blocks as long as the
    CPU's 64 MiB of ``working_memory`` allow: fewer, larger array operations).

    Parameters
    ----------
    {{qkv}}
    num_features : int, optional
        Number of samples ``S`` (>= 1). Default: ``omega.shape[-2]`` if ``omega`` is given,
        else ``max(D, int(D ln D))``.
    feature_map : {"positive", "hyperbolic", "trigonometric"}, optional
        The randomized mapping; None: that of ``state``, else ``"positive"``.
    orthogonal : bool
        Draw block-orthogonal samples (default) or iid Gaussian ones (see
        :func:`xattn.features.sample_omega`). Ignored when ``omega`` is given.
    omega : array, shape (S, D) or (..., S, D), optional
        Explicit samples as rows, in the namespace of ``q``: fixes the features (for
        evaluation, or a caller's redraw schedule). ``rng`` is then unused. Leading dims
        give each head (or each layer and head) its own samples: they broadcast against
        the leading dims of q, k and v without growing them, e.g. ``(H, S, D)``,
        ``(1, H, S, D)`` or ``(B, H, S, D)`` for q of shape ``(B, H, N, D)``; a call
        with ``(H, S, D)`` equals ``H`` calls, each with its head's ``(S, D)``.
    scale : float, optional
        Score scale; ``None`` means ``1/sqrt(D)``.
    key_mask : bool array, shape broadcastable to (..., M), optional
        True where the key takes part; masked keys leave numerator *and* denominator. A
        query without allowed keys gets a zero row.
    causal : bool
        If True, query ``n`` attends keys ``m <= n`` only (top-left aligned).
    rng : None, int, xattn.random.Generator or native generator
        Source of the samples. An int seed gives the same samples, hence the same output,
        on every backend; a JAX key works under :func:`jax.jit`. The samples are drawn
        in every call: a Gaussian draw, the QR of ``ceil(S / D)`` (D, D) blocks and, for
        an int seed, one transfer from the host (about 0.25 ms at S = D = 64 on a CPU,
        1.5 ms at S = 256 on an H200). For many calls with the same features, draw them
        once with :func:`xattn.features.sample_omega` and pass ``omega=`` (the layers
        keep theirs).
    block_size : int, optional
        Positions per block in causal mode and with ``window`` or ``sinks``; None (the
        default): as many as ``working_memory`` allows, the whole sequence when it fits
        (one block is a fixed number of array operations at any length).
    chunk_size : int, optional
        Without ``causal``, ``window`` and ``sinks``: at most this many keys and queries
        per group, whatever ``working_memory`` allows (a smaller working set, more array
        operations). None (the default): the groups of ``working_memory``. The causal
        scan, ``window`` and ``sinks`` use 1024 for None. The result does not depend on
        it beyond rounding.
    sample_norm : {"chi", "sqrt_dim"}
        Row norms of orthogonal samples (see :func:`xattn.features.sample_omega`).
    check_finite : bool
        Raise ``ValueError`` on NaN or infinity in q, k or v (default False: unchecked, and
        NaN propagates); see :ref:`non-finite-inputs`.
    window : int, optional
        Half-width ``w`` of the exact band :math:`|n - m| \le w`; ``None`` or 0: no band.
    sinks : int, optional
        Number ``K`` of leading keys (attention sinks) computed exactly, ``0 <= K <= M``
        (any ``K`` with ``return_state``); None: 0, or that of ``state``.
    working_memory : int, optional
        Bytes of intermediates a block of the causal scan (and of ``window``/``sinks``)
        may hold, which sets ``block_size``, and without them a group of keys or queries
        (**Groups**; ``chunk_size`` caps it). None: 1 GiB on a GPU, 64 MiB on a CPU
        (:func:`xattn.default_working_memory`).
    state : RFAState, optional
        Continue a sequence (``causal=True``): q, k, v are the ``L`` tokens after the ``P``
        that ``state`` has seen, at positions ``P .. P + L - 1`` (``N = M = L``, 0 allowed).
        The samples, feature map, ``window``, ``sinks`` and scale are the state's (``rng``,
        ``orthogonal``, ``sample_norm`` unused); one given must equal the state's.
    return_state : bool
        Return ``(out, state)``, the :class:`~xattn.RFAState` after these tokens
        (``causal=True``; ``N = M``).
    sequence_parallel : str, tuple of str or torch.distributed.ProcessGroup, optional
        Split one causal sequence across devices (LASP [5]_): a JAX mesh axis name inside
        ``jax.shard_map`` over the sequence axis, or a ``torch.distributed`` process group
        whose rank ``r`` holds the ``r``-th piece (none empty or shorter than ``w`` or
        ``K``); q, k, v are this device's piece, the samples the same on every device. The
        devices exchange fixed-size states, whatever ``N``; outputs, gradients and
        ``return_state`` are one call's on the whole sequence. Left out or False: one
        device; ``None`` (``group.WORLD`` before torch's ``init_process_group``) with torch
        tensors then: refused. :doc:`/guide/13_sequence_parallel`.

    {{returns}}

    Raises
    ------
    ValueError
        ``num_features`` < 1, ``omega`` not of shape ``(S, D)`` or ``(..., S, D)`` with
        leading dims that broadcast against those of q, k and v, unknown ``feature_map``
        or ``sample_norm``, negative ``window`` or ``sinks``, ``sinks`` > M, and the input
        errors of :func:`xattn.softmax_attention`; ``sequence_parallel`` without
        ``causal=True``, with ``state=``, a group of one device, outside its
        ``jax.shard_map``, an empty or short piece, or ``None`` before torch's init.
    TypeError
        Non-integer ``num_features``, ``block_size``, ``chunk_size``, ``window`` or
        ``sinks``, non-bool ``causal`` or ``orthogonal``, non-string ``feature_map`` or
        ``sample_norm``, ``omega`` from another library or not floating;
        ``sequence_parallel`` neither a mesh axis name nor a process group, or of another
        library than q (a mesh axis needs JAX arrays, a process group torch tensors).

    Warns
    -----
    TrigonometricDenominatorWarning
        Trigonometric map only: some estimated normalizer is not positive (see above).

    See Also
    --------
    xattn.softmax_attention : The exact attention that rfa estimates.
    xattn.lara : Input-dependent proposals and query-specific weights, also linear cost.
    xattn.features.sample_omega : The (orthogonal) sample matrix ``omega``.
    xattn.features.random_features : The feature maps on their own.
    xattn.default_num_features : The default number of features.

    References
    ----------
    .. [1] K. Choromanski, V. Likhosherstov, D. Dohan, X. Song, A. Gane, T. Sarlos,
       P. Hawkins, J. Davis, A. Mohiuddin, L. Kaiser, D. Belanger, L. Colwell,
       A. Weller, "Rethinking Attention with Performers", ICLR 2021 (FAVOR+: positive
       and hyperbolic features, orthogonal samples). https://arxiv.org/abs/2009.14794
    .. [2] H. Peng, N. Pappas, D. Yogatama, R. Schwartz, N. A. Smith, L. Kong, "Random
       Feature Attention", ICLR 2021. https://arxiv.org/abs/2103.02143
    .. [3] A. Rahimi, B. Recht, "Random Features for Large-Scale Kernel Machines",
       NIPS 2007 (the trigonometric map).
    .. [4] L. Zheng, C. Wang, L. Kong, "Linear Complexity Randomized Self-attention
       Mechanism", ICML 2022, §3.1 (RFA as self-normalized importance sampling).
       https://arxiv.org/abs/2204.04667
    .. [5] W. Sun, Z. Qin, D. Li, X. Shen, Y. Qiao, Y. Zhong, "Linear Attention Sequence
       Parallelism", 2024 (LASP: fixed-size states exchanged between devices).
       https://arxiv.org/abs/2404.02882

    Derivations: :doc:`/theory/01_random_features`,
    :doc:`/theory/02_rfa_importance_sampling`, :doc:`/theory/05_stabilization`; all
    papers: :doc:`/bibliography`.

    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> rng = np.random.default_rng(0)
    >>> q, k = 0.5 * rng.normal(size=(2, 5, 8)), 0.5 * rng.normal(size=(2, 7, 8))
    >>> v = rng.normal(size=(2, 7, 3))
    >>> out = xattn.rfa(q, k, v, num_features=256, rng=0)
    >>> out.shape
    (2, 5, 3)
    >>> exact = xattn.softmax_attention(q, k, v)
    >>> bool(np.abs(out - exact).max() < 0.1)
    True
    >>> xattn.rfa(q, k, v, num_features=64, rng=0, causal=True).shape
    (2, 5, 3)

    An exact band of 2 neighbours on each side and the first key as a sink, random
    features for the other keys; a band that covers every key is exact attention:

    >>> xattn.rfa(q, k, v, num_features=64, rng=0, window=2, sinks=1).shape
    (2, 5, 3)
    >>> bool(np.allclose(xattn.rfa(q, k, v, num_features=8, rng=0, window=7), exact))
    True

    Generation: a prefill returns the state, the next token continues it:

    >>> x = dict(num_features=64, rng=0, causal=True, window=2)
    >>> out, state = xattn.rfa(k[:, :6], k[:, :6], v[:, :6], return_state=True, **x)
    >>> out_t = xattn.rfa(k[:, 6:], k[:, 6:], v[:, 6:], causal=True, state=state)
    >>> bool(np.allclose(out_t, xattn.rfa(k, k, v, **x)[:, 6:]))
    True
    """
    causal = check_bool(causal, "causal")
    stateful = check_state_call(state, return_state, causal, RFAState)
    stateful |= check_parallel_call("rfa", sequence_parallel, causal=causal, state=state, q=q)
    if state is not None:  # the options of the sequence that the state continues
        feature_map, window, sinks, scale = rfa_state_options(
            state, num_features=num_features, feature_map=feature_map, omega=omega,
            window=window, sinks=sinks, scale=scale)
        omega = state.omega
    # RFA with positive features, causal or not, with a window and sinks too, multiplies
    # bfloat16 inputs in their own dtype (not when it continues a state; float16: float32)
    half_scan = not stateful and feature_map in (None, "positive", "hyperbolic")
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask,
                               check_finite=check_finite, continuing=stateful,
                               keep_half=half_scan)
    if state is not None:  # before the samples and the feature map are built from it
        check_state_inputs(state, inputs)
    feature_map = check_choice("positive" if feature_map is None else feature_map,
                               "feature_map", FEATURE_MAPS)
    check_choice(sample_norm, "sample_norm", SAMPLE_NORMS)
    orthogonal = check_bool(orthogonal, "orthogonal")
    if block_size is not None:
        block_size = check_positive_int(block_size, "block_size")
    working_memory = (default_working_memory(inputs.q) if working_memory is None
                      else check_positive_int(working_memory, "working_memory"))
    if chunk_size is not None:
        chunk_size = check_positive_int(chunk_size, "chunk_size")
    window, sinks = check_window(window, sinks, None if stateful else inputs.num_keys)
    if num_features is not None:
        num_features = check_positive_int(num_features, "num_features")
    xp, work, device = inputs.xp, inputs.compute_dtype, inputs.device
    head_dim = inputs.q.shape[-1]

    if omega is None:
        if num_features is None:
            num_features = default_num_features(head_dim)
        omega = sample_omega(rng, num_features, head_dim, xp=xp, dtype=work, device=device,
                             orthogonal=orthogonal, norm=sample_norm)
    elif state is None:  # a state's samples are checked with it (xattn._estimators.decode)
        omega = check_samples(xp, q, omega, num_features, head_dim, work,
                              inputs.batch_shape)
    if inputs.is_empty and not stateful:  # the block loops have no block for N = 0
        return inputs.empty_result()

    samples, trigonometric = omega, feature_map == "trigonometric"
    if feature_map == "hyperbolic":
        # xi(x, w) = 2^{-1/2} [xi+(x, w), xi+(x, -w)]: the positive map with samples +-w;
        # the 2^{-1/2} factor is common to numerator and denominator and cancels
        omega = xp.concat([omega, -omega], axis=-2)
    width, itemsize = omega.shape[-2] * (2 if trigonometric else 1), xp.finfo(work).bits // 8
    if block_size is None:
        block_size = block_positions(
            length=inputs.num_queries, batch_size=math.prod(inputs.batch_shape),
            num_features=width, width=inputs.v.shape[-1] + 1, itemsize=itemsize,
            working_memory=working_memory, band=band_width(window, sinks))
    # chunks of exact pairs no longer than the sequence (one token: no padding)
    pair_block = min(PAIR_BLOCK, block_size, max(inputs.num_queries, 1))
    grouped = not (stateful or causal or window or sinks)  # keys, then queries, in groups
    mapping: Any = (TrigonometricMap(xp, omega, pair_block) if trigonometric
                    else None if grouped else PositiveMap(xp, omega, pair_block))
    chunk_size_given = chunk_size
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size  # causal chunks

    tainted = None
    if stateful:  # a piece of a sequence (xattn._estimators.decode), the first one without state
        out, invalid, state = continue_sequence(
            xp, inputs, mapping, state or empty_rfa_state(inputs, mapping, samples, feature_map,
                                                          window, sinks),
            sequence_parallel, estimator="rfa", block_size=block_size,
            chunk_size=chunk_size, guard=trigonometric)
    else:  # non-finite rows reach exactly the rows that attend them (outputs, gradients)
        tainted, _ = quarantine(inputs, causal=causal)
        if window or sinks:
            out, invalid = windowed_rfa(xp, inputs, mapping, window=window, sinks=sinks,
                                        causal=causal, block_size=block_size,
                                        chunk_size=chunk_size, guard=trigonometric)
        elif causal:
            out, invalid = causal_scan(xp, inputs, mapping, block_size, chunk_size,
                                       trigonometric)
        else:  # non-causal: keys, then queries, in groups of this many rows
            rows = rfa_group_rows(inputs, width, itemsize, working_memory, chunk_size_given)
            out, invalid = (trigonometric_rfa(xp, inputs, mapping, rows) if trigonometric
                             else (positive_rfa(xp, inputs, omega, rows)
                                   if inputs.q.dtype == work
                                   else positive_rfa_half(xp, inputs, omega, rows), None))
        out = mark_tainted(xp, out, tainted)
    if invalid is not None:
        _warn_if_any(xp, invalid if tainted is None else invalid & ~tainted)
    return (inputs.finish(out), state) if return_state else inputs.finish(out)


def _warn_if_any(xp: Any, invalid: Array) -> None:
    """Warn about clamped trigonometric denominators when the flags can be read."""
    count = concrete_count(xp, invalid)  # None on lazy Dask or under jax.jit: clamp only
    if count:
        warnings.warn(
            f"rfa(feature_map='trigonometric'): the estimated normalizer of {count} "
            "query row(s) was not positive; their denominators were clamped to "
            "sqrt(eps) * (total key weight). Use more features or feature_map='positive'.",
            TrigonometricDenominatorWarning,
            stacklevel=3,
        )
