r"""Linear randomized attention (LARA): multiple-importance sampling with C proposals.

LARA (Zheng et al., ICML 2022, §4 and Appendix G.3) estimates softmax
attention with C Gaussian proposals :math:`q_c(\omega) = N(\omega; \mu_c, I)`, one sample
:math:`\omega_c \sim q_c` each, combined per query by multiple-importance weights
:math:`\alpha_{nc}` and self-normalized (eq. 10, 28):

.. math::

    y_n = \frac{\sum_c \alpha'_{nc}\, \xi(\hat q_n, \omega_c) A_c}
               {\sum_c \alpha'_{nc}\, \xi(\hat q_n, \omega_c) b_c}, \qquad
    \alpha'_{nc} = \alpha_{nc} \frac{N(\omega_c; 0, I)}{q_c(\omega_c)},

with :math:`A_c = \sum_m \xi(\hat k_m, \omega_c) v_m`, :math:`b_c = \sum_m \xi(\hat k_m,
\omega_c)` as in RFA. The key statistics are computed once per proposal and shared by all
queries, so the cost is O((N + M) C D) in time and O((N + M) C) in memory.

The proposals are built from C contiguous segments of the queries and of the keys
(Appendix G.3.1), their means :math:`\tilde q_c`, :math:`\tilde k_c` ("landmarks"), and the
weights from the balance heuristic plus a query-specific correction (Appendix G.3.2).
"""

from __future__ import annotations

import math
from typing import Any

from xattn._core.array import Array, default_working_memory
from xattn._core.inputs import check_proposal_means, prepare_attention
from xattn._core.options import (
    DEFAULT_CHUNK_SIZE,
    check_bool,
    check_choice,
    check_finite_real,
    check_noise_scale,
    check_nonnegative_int,
    check_positive_int,
    check_segments,
)
from xattn._core.primitives import (
    mark_tainted,
    quarantine,
)
from xattn._core.state import (
    LARAState,
    check_state_array,
    check_state_call,
    check_state_inputs,
)
from xattn._estimators.importance import (
    WEIGHTINGS,
)
from xattn._estimators.lara_causal import (
    CAUSAL_WEIGHTINGS,
    causal_lara,
    check_lara_causal_options,
    state_options,
    with_defensive,
)
from xattn._estimators.lara_sampling import (
    build_proposals,
    draw_samples,
    query_pass,
    query_pass_half,
)
from xattn._estimators.rf_groups import (
    lara_group_rows,
)
from xattn._estimators.sequence import NOT_GIVEN, check_parallel_call

__all__ = ["PROPOSALS", "lara"]


PROPOSALS = ("segment", "key_attention", "landmark_attention", "standard")


def lara(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_samples: int | tuple[int, int] | None = None,
    grid: tuple[int, int] | None = None,
    proposal: str = "segment",
    proposal_means: Array | None = None,
    defensive: int = 0,
    weighting: str | None = None,
    beta: float | None = None,
    deterministic: bool = False,
    noise_scale: float = 1.0,
    scale: float | None = None,
    key_mask: Array | None = None,
    query_mask: Array | None = None,
    causal: bool = False,
    rng: Any = None,
    chunk_size: int | None = None,
    check_finite: bool = False,
    state: Any = None,
    return_state: bool = False,
    working_memory: int | None = None,
    sequence_parallel: Any = NOT_GIVEN,
) -> Array:
    r"""Linear randomized attention (LARA), O((N + M) C) in time and memory.

    Splits the allowed queries and the allowed keys into C contiguous segments each
    (sizes differ by at most one) or, with ``grid=(H, W)``, into the ``c_h x c_w`` bins of
    2-D adaptive average pooling of the image grid, takes their means
    :math:`\tilde q_c, \tilde k_c` of the scaled inputs :math:`\hat q = \sqrt{s}\,q`,
    :math:`\hat k = \sqrt{s}\,k`, builds one proposal :math:`N(\mu_c, I)` per segment,
    draws :math:`\omega_c = \mu_c + \epsilon_c` and evaluates, in the stabilized form of
    the theory pages,

    .. math::

        e_{nc} = \omega_c \cdot \hat q_n + K_c - \tfrac12\lVert\omega_c\rVert^2
                 + \tfrac12\lVert\omega_c - \mu_c\rVert^2, \quad
        u_{nc} = \alpha_{nc}\, e^{e_{nc} - \max_{c'} e_{nc'}}, \quad
        y_n = \frac{\sum_c u_{nc} A'_c}{\sum_c u_{nc} b'_c},

    where :math:`K_c, A'_c, b'_c` are RFA's stabilized key statistics with the samples
    :math:`\omega_c`. The proposal means are

    - ``"segment"`` (eq. 34, default): :math:`\mu_c = \tilde q_c + \tilde k_c`;
    - ``"key_attention"`` (eq. 33): :math:`\mu_c = \tilde q_c + \sum_m
      \mathrm{softmax}_m(\tilde q_c \cdot \hat k_m)\, \hat k_m` (O(CM));
    - ``"landmark_attention"`` (eq. 35): :math:`\mu_c = \tilde q_c + \sum_{c'}
      \mathrm{softmax}_{c'}(\tilde k_c \cdot \tilde k_{c'})\, \tilde k_{c'}`;
    - ``"standard"``: :math:`\mu_c = 0` (with ``weighting="balance"`` this is exactly
      RFA with the positive map and the samples :math:`\omega_c`).

    The weights :math:`\alpha_{nc}` are :func:`lara_weights` with the balance heuristic
    :math:`w_c = q_c(\omega_c) / \sum_{c'} q_{c'}(\omega_c)` and the query affinities
    :math:`r_{nc} = \mathrm{softmax}_n(\hat q_n \cdot \tilde q_c)` (softmax over the
    allowed queries), clipped from below at :data:`WEIGHT_FLOOR` (the corrections can
    make them negative; the authors' code clips the same way).

    Parameters
    ----------
    q : array, shape (..., N, D)
    k : array, shape (..., M, D)
    v : array, shape (..., M, Dv)
        Queries, keys, values; leading dims broadcast. Half precision (one dtype for
        all three) is multiplied in that dtype without ``causal`` on torch, JAX and CuPy,
        the maxima and long sums in float32 (:doc:`/guide/05_half_precision`); elsewhere,
        and with ``causal``, computed in float32. The result is in the input dtype.
    num_samples : int or (int, int)
        C, the number of proposals (one sample each), 1 <= C <= N. Required, except with
        ``state=``, which holds it (given, it must equal the state's). C may exceed M:
        key segments without keys then have a zero mean. With N = 0 queries the result
        is empty, whatever C. With ``grid``, a pair ``(c_h, c_w)`` (1 <= c_h <= H,
        1 <= c_w <= W) and C = c_h c_w.
    grid : (int, int), optional
        ``(H, W)``: the N queries and the M keys are H x W images (patch grids) in
        row-major order, N = M = H W. The segments are then the bins of 2-D adaptive
        average pooling, as in the paper's vision models (Appendix G.3.1, H): segment
        c = i c_w + j covers the rows :math:`\lfloor iH/c_h \rfloor \dots \lceil (i+1)
        H/c_h \rceil - 1` and the matching columns, so the landmarks equal PyTorch's
        ``adaptive_avg_pool2d`` of the grid (neighbouring bins share a row or column when
        c_h does not divide H). Masked tokens belong to no bin. On a 1 x W grid with c_w
        dividing W this is 1-D LARA; otherwise the bins differ from the 1-D segments (they
        may overlap, the 1-D segments partition). See the theory page on LARA for a figure.
    proposal : {"segment", "key_attention", "landmark_attention", "standard"}
    proposal_means : array, shape (..., C, D), optional
        Caller-supplied proposal means :math:`\mu_c`, in place of ``proposal`` (leave it
        at its default), for example a layer's parameters; the leading dims broadcast
        against the batch dims. They live in the space of the scaled queries
        :math:`\hat q = \sqrt{s}\,q` that the samples multiply. The samples
        :math:`\omega_c = \mu_c + \sigma\epsilon_c` are reparameterized, so on torch and
        JAX gradients reach ``proposal_means``. The segments still give the landmarks
        :math:`\tilde q_c` of the decoupled and coupled weightings.
    defensive : int
        K, 0 <= K <= C (default 0): the last K proposals are the nominal distribution
        :math:`N(0, I)` (defensive importance sampling; Hesterberg 1995, Owen & Zhou
        2000), whatever ``proposal`` or ``proposal_means`` says for them. With
        ``weighting="balance"`` every weight is then bounded,
        :math:`\alpha_c\,N(\omega_c; 0, I)/q_c(\omega_c) = N(\omega_c; 0, I) /
        \sum_{c'} q_{c'}(\omega_c) \le 1/K`, so one sample far from every proposal
        cannot dominate (:doc:`/theory/04_lara`).
    weighting : {"decoupled", "balance", "coupled", "query_proposal"}, optional
        The multiple-importance weights; None: ``"decoupled"``, or the state's with
        ``state=``.
    beta : float, optional
        Strength of the query-specific correction of ``weighting="decoupled"`` (and
        ``"query_proposal"``); None: 2.0, or the state's with ``state=``.
    deterministic : bool
        Use the proposal means as samples, :math:`\omega_c = \mu_c` (the paper's
        evaluation mode, and the layers': Flax's ``deterministic=True``, torch's
        ``eval()``); ``rng`` is then not used.
    noise_scale : float
        Standard deviation of the sampling noise, :math:`\omega_c = \mu_c +
        \sigma\,\epsilon_c` with :math:`\sigma` = ``noise_scale`` >= 0, while the
        importance weights (:math:`w_c` and :math:`N(\omega_c; 0, I)/q_c(\omega_c)`) stay
        those of the unit-covariance proposals :math:`N(\mu_c, I)`. The default 1.0 is the
        paper's estimator. Any other value makes the weights disagree with the density the
        samples come from, so the estimator is biased even as C grows; it trades that bias
        for a lower variance (:math:`\sigma \to 0` approaches ``deterministic=True``).
        ``noise_scale=D**-0.25`` reproduces the authors' training-mode implementation, which
        divides q and k by :math:`D^{1/4}` but draws unit-variance noise. Measured figures:
        the theory page on LARA.
    scale : float, optional
        Score scale, ``1/sqrt(D)`` by default.
    key_mask : bool array, shape (..., M), optional
        True where a key takes part. Masked keys are left out of the key segments (their
        segment means and sizes), of the key statistics and of ``"key_attention"``.
        A query without allowed keys gets a zero row.
    query_mask : bool array, shape (..., N), optional
        True where a query takes part. Masked queries are left out of the query segments
        and of the softmax over queries in :math:`r_{nc}`; their output rows are zeros.
        Segments are formed over the allowed entries only, so padding queries or keys with
        masked entries changes nothing. A segment with no allowed entry (possible when
        fewer than C entries are allowed) has a zero mean; it still yields a proposal,
        never NaN.
    causal : bool
        Causal LARA (:doc:`/theory/04_lara`): allowed when nothing looks ahead (means from
        ``proposal_means``, ``"standard"`` or ``defensive=C``; ``weighting`` ``"balance"``
        or ``"query_proposal"``; no ``grid``), else ``ValueError`` naming the option.
        C may then exceed N. Computed by RFA's causal scan, O(N C D).
    state : LARAState, optional
        Continue a causal sequence, as :func:`xattn.rfa`'s ``state=``: the samples,
        proposal means, ``weighting`` and ``beta`` are the state's.
    return_state : bool
        Return ``(out, state)``, the :class:`~xattn.LARAState` after these tokens
        (``causal=True``).
    rng : None, int, xattn.random.Generator or native generator
        Source of the noise :math:`\epsilon_c \sim N(0, I)` (before ``noise_scale``),
        drawn with shape
        ``(*batch_shape, C, D)`` (an int seed gives the same draws on every backend;
        pass a JAX key under :func:`jax.jit`).
    chunk_size : int, optional
        Without ``causal``: at most this many keys and queries per group, whatever
        ``working_memory`` allows (a smaller working set, more array operations). None
        (the default): the groups of ``working_memory``; causal LARA's scan uses 1024.
        The result does not depend on it beyond rounding.
    check_finite : bool
        Raise ``ValueError`` on NaN or infinity in q, k or v (default False: unchecked, and
        NaN propagates); see :ref:`non-finite-inputs`.
    working_memory : int, optional
        Bytes of intermediates one block of the causal scan may hold, as
        :func:`xattn.rfa`'s, and without ``causal`` one group of keys or queries: the key
        statistics are accumulated a group of keys at a time with a running maximum per
        sample, as in RFA; the query side (affinities, weights, logits and the ratio of
        eq. 28) runs a group of queries at a time, after one pass that finds the maxima
        and totals of the softmax over queries in :math:`r_{nc}`. A group holds about
        ``5C + D + 2 Dv`` numbers per row and batch element (``9C + D + 2 Dv`` when there
        are several: the exponentials of the first pass are then recomputed, in one
        product of the queries with the stacked landmarks and samples, instead of kept).
        The whole sequence is one group while it fits (N = M = 16,384 at C = 64, D = Dv =
        64 and two batch-heads on a CPU's 64 MiB): a fixed number of array operations at
        any length; longer sequences keep the working memory besides the output (written
        group by group into the result on NumPy and CuPy, joined once elsewhere) at
        about this budget, whatever N and M. None: :func:`xattn.default_working_memory`.
        Dask arrays are one group (Dask computes them chunk by chunk).
    sequence_parallel : str, tuple of str or torch.distributed.ProcessGroup, optional
        With ``causal=True``: one sequence split across devices, as :func:`xattn.rfa`'s
        ``sequence_parallel`` (LASP [4]_): a JAX mesh axis name inside
        ``jax.shard_map``, or a ``torch.distributed`` process group, q, k, v being
        this device's contiguous piece. The devices exchange the fixed-size prefix sums of
        their pieces (``C (Dv + 2)`` numbers per head and device, whatever ``N``); the
        samples must be the same on every device (an int ``rng``, a replicated JAX key,
        or ``deterministic``); each piece at least one position long. Left out (or
        False): one device; an explicit ``None`` with torch tensors before
        ``torch.distributed.init_process_group`` (what ``torch.distributed.group.WORLD``
        is then) is refused. :doc:`/guide/13_sequence_parallel`.

    Returns
    -------
    array, shape (..., N, Dv)
        In the namespace, device and dtype of the inputs.

    Raises
    ------
    ValueError
        If ``num_samples < 1``, ``num_samples > N`` or ``chunk_size < 1``, or
        ``proposal`` / ``weighting`` is not one of the names above; with ``grid``, if N or
        M is not H W or a pool size exceeds its grid side; with ``causal=True``, if an option
        looks ahead (segment proposals without ``proposal_means``, the ``"decoupled"`` or
        ``"coupled"`` weighting, ``grid``); if ``proposal_means`` is not (..., C, D) with
        leading dims that broadcast against the batch, or comes with a ``proposal`` other
        than the default, or on another device than ``q``; if ``defensive`` is not in
        0..C; with ``state=``, if ``num_samples``, ``weighting``, ``beta`` or
        ``proposal_means`` is given and differs from the state's; ``sequence_parallel``
        without ``causal=True``, with ``state=``, with a group of one device or an empty
        piece, or ``None`` with torch tensors before ``torch.distributed.init_process_group``.
    TypeError
        If ``num_samples`` is not an int (a pair ``(c_h, c_w)`` without ``grid``, or an
        int with ``grid``), ``grid`` is not a pair of ints, ``proposal`` /
        ``weighting`` is not a string, a flag is not a bool, ``defensive`` is not an int,
        or ``proposal_means`` is not a real floating array of the library of ``q``;
        ``sequence_parallel`` neither a mesh axis name nor a process group.

    See Also
    --------
    xattn.rfa : Shared random features (the ``proposal="standard"`` special case).
    xattn.ra : Query-specific proposals: unbiased, quadratic cost.
    xattn.lara_weights : The multiple-importance weights on their own.
    xattn.balance_heuristic : The balance heuristic of the proposals.

    References
    ----------
    .. [1] L. Zheng, C. Wang, L. Kong, "Linear Complexity Randomized Self-attention
       Mechanism", ICML 2022, §4 and Appendix G.3 (proposals eqs. 33-35, weights
       eqs. 36-38). https://arxiv.org/abs/2204.04667
    .. [2] E. Veach, L. J. Guibas, "Optimally Combining Sampling Techniques for Monte
       Carlo Rendering", SIGGRAPH 1995 (multiple importance sampling, the balance
       heuristic). https://doi.org/10.1145/218380.218498
    .. [3] A. B. Owen, "Monte Carlo theory, methods and examples", 2013, chapter 9
       (self-normalized and multiple importance sampling).
       https://artowen.su.domains/mc/
    .. [4] W. Sun, Z. Qin, D. Li, X. Shen, Y. Qiao, Y. Zhong, "Linear Attention Sequence
       Parallelism", 2024. https://arxiv.org/abs/2404.02882

    Derivation: :doc:`/theory/04_lara`; all papers: :doc:`/bibliography`.

    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 64, 8)), rng.normal(size=(2, 48, 8)), rng.normal(
    ...     size=(2, 48, 4))
    >>> out = xattn.lara(q, k, v, num_samples=8, rng=0)
    >>> out.shape
    (2, 64, 4)
    >>> exact = xattn.softmax_attention(q, k, v)
    >>> evaluation = xattn.lara(q, k, v, num_samples=8, deterministic=True)
    >>> bool(np.mean((evaluation - exact) ** 2) < np.mean(exact ** 2))
    True

    Learned proposal means (C = 8 of them, in the scaled query space), 2 of the 8
    proposals defensive N(0, I):

    >>> means = 0.1 * rng.normal(size=(8, 8))
    >>> xattn.lara(q, k, v, num_samples=8, proposal_means=means, defensive=2,
    ...            weighting="balance", rng=0).shape
    (2, 64, 4)

    A 14 x 14 patch grid with 7 x 7 = 49 two-dimensional segments:

    >>> q, k, v = (rng.normal(size=(3, 196, 8)) for _ in range(3))
    >>> xattn.lara(q, k, v, num_samples=(7, 7), grid=(14, 14), rng=0).shape
    (3, 196, 8)
    """
    stateful = check_state_call(state, return_state, check_bool(causal, "causal"), LARAState)
    stateful |= check_parallel_call("lara", sequence_parallel, causal=causal, state=state, q=q)
    if state is None:  # the defaults (with state=: the state's)
        weighting = "decoupled" if weighting is None else weighting
        beta = 2.0 if beta is None else beta
    # non-causal LARA multiplies bfloat16 inputs in their own dtype (query_pass_half;
    # float16 inputs are computed in float32: prepare_attention)
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask, query_mask=query_mask,
                               check_finite=check_finite, continuing=stateful,
                               keep_half=not stateful and not check_bool(causal, "causal"))
    causal = check_bool(causal, "causal")
    if state is not None:  # the state's library, sizes and dtype; C is the state's
        check_state_inputs(state.features, inputs)
        if num_samples is None:
            num_samples = state.features.omega.shape[-2]
    elif num_samples is None:
        raise TypeError("lara() needs num_samples (C, the number of proposals), unless "
                        "state= continues a sequence, whose C it takes")
    pools, segmentless = None, causal or (proposal_means is not None
                                          and weighting in CAUSAL_WEIGHTINGS)
    if segmentless:  # no segments (nor landmarks): C may exceed N (a token at a time)
        num_samples = check_positive_int(num_samples, "num_samples")
    else:
        shapes = f"q shape {tuple(inputs.q.shape)}, k shape {tuple(inputs.k.shape)}"
        num_samples, grid, pools = check_segments(num_samples, grid, inputs.num_queries,
                                                  inputs.num_keys, shapes)
    check_choice(proposal, "proposal", PROPOSALS)
    defensive = check_nonnegative_int(defensive, "defensive")
    if defensive > num_samples:
        raise ValueError(f"defensive must be at most C = {num_samples} (the number of "
                         f"proposals), got {defensive}")
    if state is not None:  # the samples, means and weights of the sequence continued
        omega, state_means, weighting, beta = state_options(state, num_samples,
                                                            weighting=weighting, beta=beta)
    supplied_means = None
    if proposal_means is not None:
        if proposal != "segment":
            raise ValueError(f"proposal_means replaces proposal={proposal!r}; leave it out")
        supplied_means = check_proposal_means(inputs, proposal_means, num_samples)
    if state is not None:
        if supplied_means is not None:  # a layer's means, given again at every step:
            # compared where the values can be read (not under jax.jit, nor lazily)
            check_state_array("proposal_means", with_defensive(inputs.xp, supplied_means,
                                                               defensive),
                              state_means, strict=False)
        supplied_means = state_means
    weighting = check_choice(weighting, "weighting", WEIGHTINGS)
    beta = check_finite_real(beta, "beta")
    deterministic = check_bool(deterministic, "deterministic")
    if causal:
        check_lara_causal_options(proposal=proposal, supplied=supplied_means is not None,
                                  defensive=defensive, num_samples=num_samples,
                                  weighting=weighting, grid=grid)
    noise_scale = check_noise_scale(noise_scale)
    if chunk_size is not None:
        chunk_size = check_positive_int(chunk_size, "chunk_size")
    working_memory = (default_working_memory(inputs.q) if working_memory is None
                      else check_positive_int(working_memory, "working_memory"))
    if inputs.is_empty and not stateful:  # N = 0 or an empty batch: empty, whatever C
        return inputs.empty_result()

    tainted = None
    if not stateful:  # non-finite rows reach exactly the rows that attend them (outputs,
        # gradients); the segment means mix every query (stateful: xattn._estimators.decode)
        tainted, _ = quarantine(inputs, causal=causal, shared_queries=not segmentless)
    root_scale = math.sqrt(inputs.scale)
    # q^ = sqrt(s) q is never formed: sqrt(s) is folded into the (C, D) matrices that
    # multiply q in the query pass; k^ is formed a piece of keys at a time
    if segmentless:  # means that do not depend on the sequence: the caller's, or N(0, I)
        query_landmarks, proposal_means = None, supplied_means
        if proposal_means is None:
            proposal_means = inputs.xp.zeros((num_samples, inputs.q.shape[-1]),
                                             dtype=inputs.compute_dtype, device=inputs.device)
    else:
        query_landmarks, proposal_means = build_proposals(inputs, proposal, num_samples, grid,
                                                     pools, root_scale, supplied_means)
    if defensive and state is None:
        proposal_means = with_defensive(inputs.xp, proposal_means, defensive)
    if state is None:
        omega = draw_samples(inputs, proposal_means, num_samples, deterministic=deterministic,
                         noise_scale=noise_scale, rng=rng)
    if causal:
        result = causal_lara(inputs, omega, proposal_means, weighting=weighting, beta=beta,
                             chunk_size=DEFAULT_CHUNK_SIZE if chunk_size is None
                             else chunk_size, working_memory=working_memory,
                             stateful=stateful, state=state,
                             sequence_parallel=sequence_parallel)
        out, state = result if stateful else (result, None)
    else:  # keys, then queries, in groups as long as working_memory allows
        rows = lara_group_rows(inputs, num_samples, working_memory, chunk_size)
        half = inputs.q.dtype != inputs.compute_dtype
        out = (query_pass_half if half else query_pass)(
            inputs, query_landmarks, proposal_means, omega, weighting=weighting, beta=beta,
            root_scale=root_scale, rows=rows)
    if tainted is not None:
        out = mark_tainted(inputs.xp, out, tainted)
        if inputs.query_mask is not None:  # a masked query's row stays zero
            out = inputs.xp.where(inputs.query_mask[..., None], out, 0.0)
    return (inputs.finish(out), state) if return_state else inputs.finish(out)
