r"""Multiple-importance weights of LARA: the balance heuristic, the weightings of the LARA
paper's Appendix G.3.2 and the query affinities they use.

LARA (:mod:`xattn._estimators.lara`) combines C proposals :math:`q_c = N(\mu_c, I)` with weights
:math:`\alpha_{nc}`; this module computes them:

- :func:`balance_heuristic`: :math:`w_c = q_c(\omega_c) / \sum_{c'} q_{c'}(\omega_c)`
  (Veach & Guibas, 1995; eq. 36);
- :class:`QuerySoftmax`: the query affinities :math:`r_{nc} = \mathrm{softmax}_n(\hat q_n
  \cdot \tilde q_c)`, a softmax over all queries, kept as per-proposal statistics of a
  first pass over the queries so that a second pass reads them a piece at a time;
- :func:`lara_weights`: :math:`\alpha_{nc}` of the three weightings (eqs. 36-38), and
  :func:`importance_weights`, the same for a piece of queries, clipped at
  :data:`WEIGHT_FLOOR`.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from xattn._core.array import Array, array_namespace
from xattn._core.delegation import clip_below, matmul_add, stop_gradient
from xattn._core.options import check_choice, check_finite_real
from xattn._core.primitives import finite_shift, masked_softmax, merge_maxima, nonzero_divisor

__all__ = ["WEIGHTINGS", "WEIGHT_FLOOR", "QuerySoftmax", "balance_heuristic",
           "importance_weights", "lara_weights", "own_proposal_weights"]

WEIGHTINGS = ("balance", "decoupled", "coupled", "query_proposal")

#: Floor for the importance weights α_nc. The query-specific corrections of the
#: "decoupled" and "coupled" weightings can make α_nc negative; like the authors' code,
#: LARA clips α_nc from below at this tiny positive value. Where it acts, the weights then
#: sum to slightly more than 1 over c; the self-normalized ratio does not depend on their
#: total, and positive weights keep each output a convex combination of the per-proposal
#: estimates A'_c / b'_c (a denominator that cannot cancel to zero).
WEIGHT_FLOOR = 1e-8


def balance_heuristic(points: Array, proposal_means: Array) -> Array:
    r"""Balance-heuristic weights :math:`q_c(\omega)/\sum_{c'} q_{c'}(\omega)` at given points.

    For unit-covariance Gaussian proposals :math:`q_c = N(\mu_c, I)`,
    :math:`\log q_c(\omega) = \omega \cdot \mu_c - \lVert \mu_c \rVert^2/2 + \text{const}(\omega)`,
    so each row is a softmax over proposals (eq. 36 of the LARA paper; Veach & Guibas 1995).

    Parameters
    ----------
    points : array, shape (..., P, D)
        Points :math:`\omega_p` at which the weights are evaluated.
    proposal_means : array, shape (..., C, D)
        Means :math:`\mu_c` of the proposals.

    Returns
    -------
    array, shape (..., P, C)
        Row p holds the weights of the C proposals at :math:`\omega_p`; each row sums
        to 1. LARA uses entry (c, c), the weight of proposal c at its own sample.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn._estimators.importance import balance_heuristic
    >>> rng = np.random.default_rng(0)
    >>> weights = balance_heuristic(rng.normal(size=(3, 4)), rng.normal(size=(5, 4)))
    >>> weights.shape, np.allclose(weights.sum(axis=-1), 1.0)
    ((3, 5), True)
    """
    xp = array_namespace(points, proposal_means, names=("points", "proposal_means"))
    log_density = points @ xp.matrix_transpose(proposal_means) - 0.5 * xp.sum(
        proposal_means * proposal_means, axis=-1)[..., None, :]
    return masked_softmax(xp, log_density, None, axis=-1)


def own_proposal_weights(xp: Any, omega: Array, proposal_means: Array) -> tuple[Array, Array]:
    r"""Per proposal, at its own sample: :math:`\log N(\omega_c; 0, I) - \log
    q_c(\omega_c)` and the balance heuristic :math:`w_c` (eq. 36), both (..., 1, C).

    With :math:`\ell_{cc'} = \omega_c \cdot \mu_{c'} - \tfrac12\lVert\mu_{c'}\rVert^2`
    (:math:`\log q_{c'}(\omega_c)` up to a term of :math:`\omega_c` alone), the ratio is
    :math:`\tfrac12\lVert\omega_c - \mu_c\rVert^2 - \tfrac12\lVert\omega_c\rVert^2 =
    -\ell_{cc}` and :math:`w_c = 1 / \sum_{c'} e^{\ell_{cc'} - \ell_{cc}}`: the diagonal
    of :func:`balance_heuristic` without its (C, C) softmax. The sum is at least its term
    :math:`c' = c`, :math:`e^0 = 1`, and is clipped below at 1: that term is computed as
    the difference of two roundings of :math:`\ell_{cc}`, and a large proposal mean (a
    key of norm :math:`10^{10}` in float32) makes it :math:`e^{-\text{error}} = 0`, which
    gave :math:`w_c = 1/0` and NaN in every row. The exponents are clipped above at 64
    (:math:`w_c < e^{-64}` there, as good as its limit 0): an :math:`e^{+\infty}` term made
    its gradient :math:`0 \cdot \infty`, NaN. (An error of the other sign makes
    :math:`w_c` small, never NaN; such a proposal's own density ratio is then
    :math:`e^{-\lVert\mu_c\rVert^2/2 - \epsilon_c \cdot \mu_c}`, so its sample weighs next
    to nothing anyway.)
    """
    half_norms = 0.5 * xp.sum(proposal_means * proposal_means, axis=-1, keepdims=True)
    ratio = half_norms - xp.sum(omega * proposal_means, axis=-1, keepdims=True)  # -l_cc
    log_density = omega @ xp.matrix_transpose(proposal_means) - xp.matrix_transpose(
        half_norms)  # l_cc', (..., C, C)
    # the sum is at least its term c' = c, e^0 = 1 (see above)
    own_weight = 1.0 / clip_below(xp.sum(xp.exp(xp.clip(log_density + ratio, max=64.0)),
                                         axis=-1, keepdims=True), 1.0)
    return xp.matrix_transpose(ratio), xp.matrix_transpose(own_weight)


def lara_weights(proposal_weights: Array, query_affinity: Array, *,
                 weighting: str = "decoupled", beta: float = 2.0) -> Array:
    r"""Multiple-importance weights :math:`\alpha_{nc}` before the floor (Appendix G.3.2).

    With balance-heuristic weights :math:`w_c` and query affinities :math:`r_{nc}`:

    - ``"balance"`` (eq. 36): :math:`\alpha_{nc} = w_c`;
    - ``"decoupled"`` (eq. 38, the default): :math:`\alpha_{nc} = w_c + \beta\,(r_{nc} -
      \frac{1}{C}\sum_{c'} r_{nc'})`;
    - ``"coupled"`` (eq. 37): :math:`\alpha_{nc} = w_c + w_c\,(r_{nc} - \sum_{c'} w_{c'}
      r_{nc'})`;
    - ``"query_proposal"``: the decoupled formula, for the affinity
      :math:`r_{nc} = \operatorname{softmax}_c(\hat q_n \cdot \mu_c)` over proposals,
      which uses only :math:`q_n` and the proposals (causal LARA's).

    The corrections sum to zero over c, so whenever :math:`\sum_c w_c = 1` (the balance
    heuristic at one common point) every weighting sums to 1 over proposals, the
    condition for an unbiased multiple-importance estimate. :func:`lara` then clips the
    weights from below at :data:`WEIGHT_FLOOR`.

    Parameters
    ----------
    proposal_weights : array, shape (..., C)
        :math:`w_c` (for example a row of :func:`balance_heuristic`).
    query_affinity : array, shape (..., N, C)
        :math:`r_{nc}`; LARA uses the softmax over queries n of :math:`\hat q_n \cdot
        \tilde q_c`.
    weighting : {"balance", "decoupled", "coupled", "query_proposal"}
    beta : float
        Strength :math:`\beta` of the decoupled correction (2 in the paper's ViT runs).

    Returns
    -------
    array, shape (..., N, C)

    Examples
    --------
    >>> import numpy as np
    >>> from xattn._estimators.importance import lara_weights
    >>> w = np.array([0.5, 0.3, 0.2])
    >>> r = np.array([[0.6, 0.1, 0.3], [0.0, 0.5, 0.5]])
    >>> alpha = lara_weights(w, r, weighting="decoupled", beta=2.0)
    >>> np.round(alpha.sum(axis=-1), 12)
    array([1., 1.])
    """
    check_choice(weighting, "weighting", WEIGHTINGS)
    check_finite_real(beta, "beta")  # as lara checks it
    xp = array_namespace(proposal_weights, query_affinity,
                         names=("proposal_weights", "query_affinity"))
    weights = proposal_weights[..., None, :]
    if weighting == "balance":
        return weights + xp.zeros_like(query_affinity)
    if weighting in ("decoupled", "query_proposal"):
        correction = query_affinity - xp.mean(query_affinity, axis=-1, keepdims=True)
        return weights + (correction if beta == 1.0 else beta * correction)
    weighted_mean = xp.sum(weights * query_affinity, axis=-1, keepdims=True)
    return weights + weights * (query_affinity - weighted_mean)


class QuerySoftmax:
    r"""The query affinities :math:`r_{nc} = \mathrm{softmax}_n(s_{nc})`, :math:`s_{nc} =
    \hat q_n \cdot \tilde q_c`, over the allowed queries, for a pass a piece at a time.

    The constructor is the first pass over the query pieces: piece p takes :math:`e_{nc} =
    e^{s_{nc} - m^{(p)}_c}` with its own maximum :math:`m^{(p)}_c` over its allowed
    queries, and the pieces merge (:func:`~xattn._core.primitives.merge_maxima`, an online
    softmax along n) into :math:`m_c = \max_p m^{(p)}_c` and :math:`Z_c = \sum_p
    e^{m^{(p)}_c - m_c} \sum_{n \in p} e_{nc}`. :meth:`piece` then gives, for piece p,
    a pair :math:`(e_{nc}, \rho_c)` with :math:`r_{nc} = e_{nc} \rho_c`:

    - with ``keep_exponentials`` the first pass's :math:`e_{nc}` (released once read) and
      :math:`\rho_c = e^{m^{(p)}_c - m_c} / Z_c`: no second exponential, but (N, C)
      values held between the passes;
    - otherwise :math:`e_{nc} = e^{s_{nc} - m_c}`, recomputed from the scores the
      second pass passes in, and :math:`\rho_c = 1 / Z_c`: working memory independent
      of N.

    Masked queries and pieces without an allowed query get 0.

    Parameters
    ----------
    xp : namespace
    q : array, shape (..., N, D)
        The queries, unscaled.
    scaled_landmarks : array, shape (..., C, D)
        :math:`\sqrt{s}\,\tilde q_c`, so that ``q @ scaled_landmarks.T`` is :math:`s_{nc}`.
    query_mask : bool array, shape (..., N), or None
    pieces : list of (start, stop)
        The query pieces of both passes.
    keep_exponentials : bool
    total_dtype : dtype, optional
        For half-precision ``q`` and landmarks (the scores and :math:`e_{nc}` in their
        format): the dtype of the maxima, the totals :math:`Z_c` (summed in it) and
        :math:`\rho_c`, float32. None: the scores' dtype.
    """

    def __init__(self, xp: Any, q: Array, scaled_landmarks: Array, query_mask: Array | None,
                 pieces: list[tuple[int, int]], *, keep_exponentials: bool,
                 total_dtype: Any = None) -> None:
        self.xp, self.query_mask, self.pieces = xp, query_mask, pieces
        landmarks_t = xp.matrix_transpose(scaled_landmarks)
        kept: list[Array | None] = []
        maxima, totals = [], []
        for start, stop in pieces:
            rows = q if (start, stop) == (0, q.shape[-2]) else q[..., start:stop, :]
            scores = self._masked(rows @ landmarks_t, start, stop)  # (..., B, C)
            # a stabilizer (no gradient): it cancels in the softmax over queries
            piece_max = stop_gradient(xp.max(scores, axis=-2, keepdims=True))  # -inf: none
            if query_mask is not None:
                piece_max = finite_shift(xp, piece_max)
            exponential = xp.exp(scores - piece_max)
            kept.append(exponential if keep_exponentials else None)
            if total_dtype is None:
                maxima.append(piece_max)
                totals.append(xp.sum(exponential, axis=-2, keepdims=True))
            else:  # half scores: a long sum, and the merge, in float32
                maxima.append(xp.astype(piece_max, total_dtype))
                totals.append(xp.sum(exponential, axis=-2, keepdims=True, dtype=total_dtype))
        if len(pieces) == 1:  # its own maximum is the shift
            self.shift, self.rescales, total = maxima[0], (1.0,), totals[0]
        else:
            _, self.shift, self.rescales = merge_maxima(xp, *maxima)  # no allowed query: 0
            total = sum(rescale * piece_total
                        for rescale, piece_total in zip(self.rescales, totals, strict=True))
        # Z_c >= 1 (its largest term is e^0) unless a mask leaves no query
        self.inverse_total = 1.0 / (total if query_mask is None
                                    else nonzero_divisor(xp, total))  # 1 / Z_c
        self.keep_exponentials = keep_exponentials
        self._kept = kept

    def _masked(self, scores: Array, start: int, stop: int) -> Array:
        if self.query_mask is None:
            return scores
        return self.xp.where(self.query_mask[..., start:stop, None], scores, -self.xp.inf)

    def piece(self, index: int, scores: Array | None = None) -> tuple[Array, Array]:
        r""":math:`(e_{nc}, \rho_c)` of piece ``index`` (see the class); without
        ``keep_exponentials`` ``scores`` are its :math:`s_{nc}`, (..., B, C)."""
        if self.keep_exponentials:
            exponential, self._kept[index] = self._kept[index], None  # released once read
            assert exponential is not None, "each piece is read once"
            rescale = self.rescales[index]  # 1.0 (a float) for a single piece
            return exponential, (self.inverse_total if isinstance(rescale, float)
                                 else rescale * self.inverse_total)
        assert scores is not None, "the scores are recomputed by the second pass"
        start, stop = self.pieces[index]
        shift = self.shift  # a maximum of the scores: exact in their (half) format
        if shift.dtype != scores.dtype:
            shift = self.xp.astype(shift, scores.dtype)
        return (self.xp.exp(self._masked(scores, start, stop) - shift), self.inverse_total)


def importance_weights(xp: Any, own_weight: Array, affinity: tuple[Array, Array] | None,
                        weighting: str, beta: float, *, as_row: bool = False,
                        floor: float = WEIGHT_FLOOR) -> Array:
    r""":math:`\alpha_{nc}` of a piece of queries, clipped below at the weight floor.

    ``own_weight`` is :math:`w_c`, (..., C), or (..., 1, C) with ``as_row``.
    ``affinity`` is :meth:`QuerySoftmax.piece` (None for the balance heuristic,
    whose weights do not depend on the query: then (..., 1, C)). For the decoupled
    weighting (eq. 38) :math:`\beta r_{nc}` is :math:`e_{nc} (\beta \rho_c)` and its mean
    over proposals :math:`\frac1C \sum_c e_{nc} \beta \rho_c`. Half-precision
    :math:`e_{nc}` and :math:`w_c` (of one format) give weights in that format, the product's
    result rounded to it; ``floor`` replaces :data:`WEIGHT_FLOOR` (float16:
    its smallest subnormal number, the nearest to 1e-8 that it holds).
    """
    weights = own_weight if as_row else own_weight[..., None, :]  # w_c, (..., 1, C)
    if affinity is None:  # "balance": alpha_nc = w_c for every query
        return clip_below(weights, floor)
    exponential, rho = affinity
    if weighting == "decoupled":  # w_c + beta (r_nc - mean_c' r_nc')
        # beta r_nc - mean_c' beta r_nc' is e_n @ P with P = diag(beta rho) - (beta rho)^T
        # 1 / C, (..., C, C): with w_c, one product and its addend (torch: one pass over
        # the (B, C) weights instead of a product, a mean, a difference and a sum)
        count = exponential.shape[-1]
        identity = xp.eye(count, dtype=exponential.dtype,
                          device=array_api_compat.device(exponential))
        if isinstance(rho, float):  # one rho for every proposal
            centring = beta * rho * (identity - 1.0 / count)
        else:  # beta rho_c, (..., 1, C)
            scaled = beta * xp.broadcast_to(rho, (*exponential.shape[:-2], 1, count))
            centring = identity * scaled - xp.matrix_transpose(scaled) * (1.0 / count)
            if centring.dtype != exponential.dtype:  # float32 rho, half e_nc
                centring = xp.astype(centring, exponential.dtype)
        return clip_below(matmul_add(exponential, centring, weights), floor)
    return clip_below(lara_weights(weights[..., 0, :], exponential * rho,
                                   weighting=weighting, beta=beta), floor)
