r"""Randomized attention (RA): an unbiased Monte Carlo estimator of softmax attention.

Paper: Zheng et al., *Linear Complexity Randomized Self-attention Mechanism*, ICML 2022
§3.2, Proposition 3.2 and Appendix G.2 (Algorithm 1). With the
positive randomized mapping :math:`\xi(x, \omega) = \exp(\omega \cdot x - \lVert x
\rVert^2 / 2)`, softmax attention is an expectation over the Gaussian mixture (eqs. 5, 29)

.. math::

    p_n(\omega) = \sum_m \pi_{nm}\, N(\omega; \hat q_n + \hat k_m, I), \qquad
    \pi_{nm} = \operatorname{softmax}_m(\hat q_n \cdot \hat k_m),

of the function (eq. 6; :math:`\xi(\hat q_n, \omega)` cancels between the numerator and
the denominator)

.. math::

    f_n(\omega) = \sum_m \operatorname{softmax}_m\!\big(\omega \cdot \hat k_m
        - \lVert \hat k_m \rVert^2 / 2\big)\, v_m ,
    \qquad \mathbb{E}_{\omega \sim p_n}[f_n(\omega)] = \sum_m \pi_{nm} v_m .

Sampling :math:`\omega \sim p_n` is two steps: a component :math:`z \sim
\operatorname{Categorical}(\pi_n)` and :math:`\omega = \hat q_n + \hat k_z + \varepsilon`,
:math:`\varepsilon \sim N(0, I)` (eq. 30). The *biased* variant (the paper's practical form)
replaces the mixture by one Gaussian at its mean, :math:`\omega = \hat q_n + \sum_m
\pi_{nm} \hat k_m + \varepsilon` (eq. 31); its deterministic form (:math:`\varepsilon = 0`) is the
paper's evaluation mode.
"""

from __future__ import annotations

import math
from typing import Any

from xattn._core.array import Array, default_working_memory
from xattn._core.docstrings import EXAMPLE_INPUTS, document_estimator
from xattn._core.inputs import AttentionInputs, prepare_attention
from xattn._core.options import check_bool, check_noise_scale, check_positive_int
from xattn._core.primitives import (
    finite_inputs,
    join,
    mark_tainted,
    quarantine,
)
from xattn._core.state import RAState, check_state_call
from xattn._estimators.decode import extend_cache
from xattn._estimators.ra_sampling import (
    build_mixture,
    draw_randomness,
    key_side,
    proposal_samples,
    sample_estimates,
)
from xattn.random import as_generator

__all__ = ["ra"]


# numbers of the compute dtype a step holds per (query, sample) row and key at once (logits,
# masked and shifted, weights, cumulative weights), besides booleans (masks, inverse CDF)
_NUMBERS_PER_PAIR = 6


def _rows_per_step(inputs: AttentionInputs, num_keys: int, working_memory: int) -> int:
    """The (query, sample) rows of one step whose (..., rows, M) intermediates fit
    ``working_memory`` bytes (at least one)."""
    itemsize = inputs.xp.finfo(inputs.compute_dtype).bits // 8
    per_row = math.prod(inputs.batch_shape) * num_keys * (_NUMBERS_PER_PAIR * itemsize + 2)
    return max(1, working_memory // max(per_row, 1))


def _part(x: Array | None, axis: int, start: int, stop: int) -> Array | None:
    """``x[start:stop]`` along the (negative) ``axis``; ``x`` itself if that is all of it."""
    if x is None or (start == 0 and stop == x.shape[axis]):
        return x
    return x[(..., slice(start, stop), *(slice(None),) * (-1 - axis))]


@document_estimator(RAState, examples=EXAMPLE_INPUTS)
def ra(
    q: Array,
    k: Array,
    v: Array,
    *,
    num_samples: int = 1,
    biased: bool = False,
    deterministic: bool = False,
    noise_scale: float = 1.0,
    scale: float | None = None,
    key_mask: Array | None = None,
    causal: bool = False,
    rng: Any = None,
    chunk_size: int | None = None,
    check_finite: bool = False,
    state: RAState | None = None,
    return_state: bool = False,
    working_memory: int | None = None,
) -> Any:
    r"""Randomized attention (RA): unbiased (or biased) Monte Carlo softmax attention.

    For every query :math:`n` and each of its ``num_samples`` samples :math:`s`
    (paper Algorithm 1, eqs. 29-30, Prop. 3.2 / eq. 7):

    .. math::

        \pi_{nm} = \operatorname{softmax}_m(\hat q_n \cdot \hat k_m), \quad
        z_{ns} \sim \operatorname{Categorical}(\pi_n), \quad
        \omega_{ns} = \hat q_n + \hat k_{z_{ns}} + \varepsilon_{ns}, \quad
        \varepsilon_{ns} \sim N(0, I),

    .. math::

        y_n = \frac{1}{S} \sum_s \sum_m \operatorname{softmax}_m\!\big(
            \omega_{ns} \cdot \hat k_m - \lVert \hat k_m \rVert^2 / 2\big)\, v_m ,

    with :math:`\hat q = \sqrt{s}\, q`, :math:`\hat k = \sqrt{s}\, k` for the score scale
    :math:`s`. :math:`\mathbb{E}[y_n]` is exactly softmax attention. With
    ``biased=True``, :math:`\omega_{ns} = \hat q_n + \sum_m \pi_{nm} \hat k_m +
    \varepsilon_{ns}` (no categorical draw; biased but lower variance), and with
    ``deterministic=True`` as well, :math:`\varepsilon = 0` (the paper's evaluation mode;
    all samples coincide). Cost :math:`O(NMD\,S)` time, like exact attention.

    The component :math:`z_{ns}` is drawn by inverse CDF with one uniform per query and
    sample: :math:`z` is the number of cumulative probabilities
    :math:`\sum_{m' \le m} \pi_{nm'}` below :math:`u = 1 - U`, :math:`U \sim [0, 1)`,
    clipped to the last allowed key (rounding can leave the total just below 1).

    **Cost.** The work is organized in steps of R (query, sample) rows: ``max(1, R //
    S)`` queries with all their samples (or, when ``S > R``, one query with R of its
    samples). R is as large as ``working_memory`` allows (1 GiB on a GPU, 64 MiB on a CPU;
    about six numbers and two booleans per row and key), or ``chunk_size``. A step is a
    fixed number of array operations over all its rows, whatever R: the mixture weights,
    their cumulative sums, the inverse CDF of every sample, one gather of the drawn keys
    :math:`\hat k_z` (a one-hot product on Dask) and the estimate's two matrix products
    (:math:`\omega \cdot \hat k_m` and the read-out of v). While all of a call's ``N S``
    rows fit (``(1, 2, N, 64)`` float32 with S = 1 up to N = 4,096 on a GPU, 1,024 on a
    CPU) a call is one step: a fixed number of operations (kernel launches on a GPU) at
    any length; beyond, the steps, and the operations, grow with ``N S M``. Memory beyond
    the draws (``(..., N, S, D)`` normals) is at most ``working_memory``, whatever N or S.
    The result does not depend on R beyond rounding.

    **Gradients** with respect to ``q``, ``k`` and ``v`` flow through the continuous
    path: :math:`\pi` (biased form), :math:`\hat q_n + \hat k_z` for the drawn
    :math:`z`, and :math:`f_n(\omega)`. The discrete choice :math:`z` itself is not
    differentiated (it is a piecewise-constant function of the inputs), so the gradient
    is that of the estimate for fixed :math:`z` and :math:`\varepsilon`, not an unbiased
    gradient of softmax attention.

    Parameters
    ----------
    {{qkv}}
    num_samples : int
        Samples :math:`S` per query (>= 1), averaged; the variance falls as ``1/S``.
    biased : bool
        Use the single-Gaussian proposal centred at the mixture mean (biased RA).
    deterministic : bool
        Drop the noise (:math:`\varepsilon = 0`). Requires ``biased=True``: the unbiased
        estimator has no deterministic form. (The layers' evaluation mode, Flax's
        ``deterministic=True`` or torch's ``eval()``, calls ``ra`` with ``biased=True,
        deterministic=True``.)
    noise_scale : float
        Standard deviation :math:`\sigma` >= 0 of the noise, :math:`\omega_{ns} =
        \mu_{ns} + \sigma\,\varepsilon_{ns}`, with :math:`f_n` unchanged (the
        unit-covariance form above). The default 1.0 is the paper's estimator, unbiased
        in the unbiased form; any other value makes it biased, trading bias for variance
        (:math:`\sigma \to 0` approaches the noise-free estimate, with ``biased=True``
        the deterministic mode). ``noise_scale=D**-0.25`` reproduces the authors'
        implementation, which divides q and k by :math:`D^{1/4}` but draws unit-variance
        noise. Measured figures: the theory page on LARA.
    scale : float, optional
        Score scale; ``None`` means ``1/sqrt(D)``.
    key_mask : bool array, shape broadcastable to (..., M), optional
        True where the key takes part. It restricts both :math:`\pi` and the softmax in
        :math:`f_n`. A query whose keys are all masked gets a zero row.
    causal : bool
        If True, query ``n`` attends keys ``m <= n`` only (top-left aligned), in both
        :math:`\pi` and :math:`f_n`.
    rng : None, int, xattn.random.Generator or native generator
        Randomness (see :func:`xattn.random.as_generator`). An int seed gives the same
        output on every backend; a JAX key works under :func:`jax.jit`. Draw order:
        uniforms of shape ``(*batch, N, S)`` (unbiased form only), then standard normals
        of shape ``(*batch, N, S, D)``. Unused (nothing is drawn) when deterministic.
    chunk_size : int, optional
        Number of (query, sample) rows evaluated per step (see **Cost**); None (the
        default): as many as ``working_memory`` allows, all of them when they fit (a step
        holds ``(..., chunk_size, M)`` intermediates, which grow with M).
    check_finite : bool
        Raise ``ValueError`` on NaN or infinity in q, k or v (default False: unchecked, and
        NaN propagates); see :ref:`non-finite-inputs`.
    state : RAState, optional
        A key-value cache (``causal=True``) to continue: q, k and v are the ``L`` tokens
        after the ``P`` cached ones (``N = M = L``, 0 allowed); query ``P + j`` attends the
        cached keys and the new ones up to its own, in :math:`\pi` and :math:`f_n`. The
        call draws for its own queries from ``rng`` (the draw order above, with ``L``
        queries), so each estimate is that of one causal call over all ``P + L`` tokens
        with the same draws for that query, and stays unbiased. Deterministic mode has no
        draws: pieces equal one call up to rounding.
    return_state : bool
        Return ``(out, state)``, the :class:`~xattn.RAState` grown by these tokens
        (``causal=True``; ``N = M``).
    working_memory : int, optional
        Bytes of intermediates a step of (query, sample) rows may hold; sets
        ``chunk_size``. None: 1 GiB on a GPU, 64 MiB on a CPU
        (:func:`xattn.default_working_memory`).

    {{returns}}

    Raises
    ------
    ValueError
        ``num_samples``, ``chunk_size`` or ``working_memory`` < 1, ``deterministic=True``
        with ``biased=False``, inputs/masks of the wrong shape, ``state`` or
        ``return_state`` without ``causal``, a state of other heads.
    TypeError
        Non-bool flags, non-integer counts, wrong dtypes or mixed array libraries.

    See Also
    --------
    xattn.softmax_attention : The exact attention whose expectation ra matches.
    xattn.lara : Linear-cost variant with shared, input-dependent proposals.
    xattn.diagnostics.estimator_error : Bias, variance and MSE of an estimator over draws.

    References
    ----------
    .. [1] L. Zheng, C. Wang, L. Kong, "Linear Complexity Randomized Self-attention
       Mechanism", ICML 2022, §3.2 (randomized attention) and Proposition 3.2 (it is
       unbiased). https://arxiv.org/abs/2204.04667
    .. [2] A. B. Owen, "Monte Carlo theory, methods and examples", 2013, chapter 9
       (importance sampling). https://artowen.su.domains/mc/

    Derivation: :doc:`/theory/03_randomized_attention`; all papers:
    :doc:`/bibliography`.

    {{examples}}
    >>> xattn.ra(q, k, v, num_samples=4, rng=0).shape
    (2, 5, 3)
    >>> y = xattn.ra(q, k, v, biased=True, deterministic=True)
    >>> y.shape, y.dtype
    ((2, 5, 3), dtype('float64'))
    """
    num_samples = check_positive_int(num_samples, "num_samples")
    if chunk_size is not None:
        chunk_size = check_positive_int(chunk_size, "chunk_size")
    if working_memory is not None:
        working_memory = check_positive_int(working_memory, "working_memory")
    biased = check_bool(biased, "biased")
    deterministic = check_bool(deterministic, "deterministic")
    causal = check_bool(causal, "causal")
    stateful = check_state_call(state, return_state, causal, RAState)
    noise_scale = check_noise_scale(noise_scale)
    if deterministic and not biased:
        raise ValueError(
            "deterministic=True requires biased=True: unbiased RA draws a random mixture "
            "component per sample and has no deterministic form; use biased=True, "
            "deterministic=True for the paper's evaluation mode"
        )
    inputs = prepare_attention(q, k, v, scale=scale, key_mask=key_mask,
                               check_finite=check_finite, continuing=stateful)
    offset = 0  # the position of the first query: keys before it are in the cache
    if stateful:  # attend the cached keys and the new ones (xattn._estimators.decode)
        inputs, state, offset = extend_cache(inputs, state, RAState)
    # non-finite rows reach exactly the rows that attend them, outputs and gradients
    tainted, _ = quarantine(inputs, causal=causal, offset=offset)
    inputs = finite_inputs(inputs)  # RA holds the scaled keys whole anyway
    generator = None if deterministic else as_generator(rng)
    if inputs.is_empty:
        return (inputs.empty_result(), state) if return_state else inputs.empty_result()
    if working_memory is None:
        working_memory = default_working_memory(inputs.q)
    xp, keys = inputs.xp, key_side(inputs, biased=biased)
    num_draws = 1 if deterministic else num_samples  # deterministic: the samples coincide
    uniforms, noise = draw_randomness(inputs, generator, num_draws, biased=biased,
                                       noise_scale=noise_scale)
    q_hat = inputs.q * keys.root_scale

    # steps of (query, sample) rows: whole queries with all their samples, or samples of
    # one query; as many as working_memory allows unless chunk_size says
    rows_per_step = chunk_size or _rows_per_step(inputs, keys.k_hat.shape[-2], working_memory)
    queries_per_step = max(1, rows_per_step // num_draws)
    samples_per_step = min(num_draws, rows_per_step)
    outputs = []
    for start in range(0, inputs.num_queries, queries_per_step):
        stop = min(start + queries_per_step, inputs.num_queries)
        q_group = _part(q_hat, -2, start, stop)  # (..., B, D)
        query_positions = (xp.arange(start + offset, stop + offset, device=inputs.device)
                           if causal else None)
        mixture = build_mixture(keys, q_group, query_positions, biased=biased)
        group_uniforms = _part(uniforms, -2, start, stop)  # (..., B, S)
        group_noise = _part(noise, -3, start, stop)  # (..., B, S, D)
        total = None  # sum over the samples of f_n(omega_ns), (..., B, Dv)
        for sample_start in range(0, num_draws, samples_per_step):
            sample_stop = min(sample_start + samples_per_step, num_draws)
            omega = proposal_samples(keys, q_group, mixture,
                                      _part(group_uniforms, -1, sample_start, sample_stop),
                                      _part(group_noise, -2, sample_start, sample_stop))
            estimates = sample_estimates(keys, omega, mixture, query_positions)
            group = sample_stop - sample_start
            if group > 1:  # (..., B G, Dv) -> summed over the group's samples, (..., B, Dv)
                estimates = xp.sum(xp.reshape(estimates, (*keys.batch, stop - start, group,
                                                          estimates.shape[-1])), axis=-2)
            total = estimates if total is None else total + estimates
        assert total is not None  # num_draws >= 1: the sample loop ran
        outputs.append(total if num_draws == 1 else total / num_draws)  # mean over samples

    out = mark_tainted(xp, join(xp, outputs, axis=-2), tainted)
    out = inputs.finish(out)
    return (out, state) if return_state else out
