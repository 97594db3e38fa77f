r"""Causal LARA: proposals that do not look ahead, prefix sums over the keys.

LARA's estimator (eq. 28 of Zheng et al., 2022) for query :math:`n`,

.. math::

    y_n = \frac{\sum_c \alpha'_{nc}\, \xi(\hat q_n, \omega_c) A_c(n)}
               {\sum_c \alpha'_{nc}\, \xi(\hat q_n, \omega_c) b_c(n)}, \qquad
    A_c(n) = \sum_{m \le n} \xi(\hat k_m, \omega_c) v_m, \quad
    b_c(n) = \sum_{m \le n} \xi(\hat k_m, \omega_c),

is causal when nothing in it depends on a position after :math:`n`: the samples
:math:`\omega_c = \mu_c + \epsilon_c` do not when the means :math:`\mu_c` do not depend on
the sequence (caller-supplied, ``"standard"`` or defensive), and the weights
:math:`\alpha'_{nc} = \alpha_{nc} N(\omega_c; 0, I) / q_c(\omega_c)` do not when
:math:`\alpha_{nc}` uses only :math:`q_n` and the proposals: the balance heuristic
:math:`w_c`, or the ``"query_proposal"`` correction :math:`w_c + \beta (r_{nc} - 1/C)`
with :math:`r_{nc} = \operatorname{softmax}_c(\hat q_n \cdot \mu_c)`. The paper's
decoupled and coupled weightings take :math:`r_{nc}` as a softmax over all queries
:math:`n`, which looks ahead. Every such :math:`\alpha_{nc}` sums to 1 over :math:`c` (the
correction sums to zero), which keeps the self-normalized estimate consistent.

The query factor :math:`\alpha'_{nc} \xi(\hat q_n, \omega_c)` is RFA's positive feature
with the log weight added to its logit, so the prefix sums are RFA's causal scan
(:func:`xattn._estimators.rf_scan.scan_partials`): the same blocks, stabilizer and cost,
O(N C D).
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from xattn._core.array import Array
from xattn._core.inputs import AttentionInputs
from xattn._core.state import (
    IMPORTANCE_FEATURES,
    LARAState,
    empty_rfa_state,
    refuse,
)
from xattn._estimators.feature_maps import PositiveMap
from xattn._estimators.importance import importance_weights, own_proposal_weights
from xattn._estimators.rf_scan import PAIR_BLOCK, block_positions, causal_scan
from xattn._estimators.sequence import continue_sequence

__all__ = ["CAUSAL_WEIGHTINGS", "ImportanceMap", "causal_lara",
           "check_lara_causal_options", "query_proposal_affinity", "state_options",
           "with_defensive"]

#: The weightings that use only q_n and the proposals.
CAUSAL_WEIGHTINGS = ("balance", "query_proposal")


def check_lara_causal_options(*, proposal: str, supplied: bool, defensive: int,
                              num_samples: int, weighting: str, grid: Any) -> None:
    """Raise a ValueError naming the first option of a causal LARA call that looks ahead."""
    if not supplied and proposal != "standard" and defensive < num_samples:
        raise ValueError(
            f"lara(causal=True): proposal={proposal!r} looks ahead (its means come from "
            f"segments of the whole sequence); pass proposal_means=, proposal='standard' or "
            f"defensive=num_samples")
    if weighting not in CAUSAL_WEIGHTINGS:
        raise ValueError(
            f"lara(causal=True): weighting={weighting!r} looks ahead (its query affinity is "
            f"a softmax over all queries); use one of {CAUSAL_WEIGHTINGS}")
    if grid is not None:
        raise ValueError("lara(causal=True): grid= looks ahead (2-D segments of the whole "
                         "image); leave it None")


def with_defensive(xp: Any, proposal_means: Array, count: int) -> Array:
    """The means with their last ``count`` rows zero: those proposals are N(0, I)."""
    kept = proposal_means[..., : proposal_means.shape[-2] - count, :]
    nominal = xp.zeros((*proposal_means.shape[:-2], count, proposal_means.shape[-1]),
                       dtype=proposal_means.dtype, device=array_api_compat.device(proposal_means))
    return xp.concat([kept, nominal], axis=-2)


def query_proposal_affinity(xp: Any, q_hat: Array, proposal_means: Array) -> Array:
    r""":math:`r_{nc} = \operatorname{softmax}_c(\hat q_n \cdot \mu_c)`, (..., N, C)."""
    scores = q_hat @ xp.matrix_transpose(proposal_means)
    scores = scores - xp.max(scores, axis=-1, keepdims=True)
    exponential = xp.exp(scores)
    return exponential / xp.sum(exponential, axis=-1, keepdims=True)


class ImportanceMap(PositiveMap):
    r"""RFA's positive map with LARA's log weights in the query logits:
    :math:`p_{nc} = \omega_c \cdot \hat q_n + \log \alpha_{nc} + \log N(\omega_c; 0, I) -
    \log q_c(\omega_c)` (the key side is RFA's, :math:`a_{mc}`)."""

    def __init__(self, inputs: AttentionInputs, omega: Array, proposal_means: Array, *,
                 weighting: str, beta: float, pair_block: int = PAIR_BLOCK) -> None:
        xp = inputs.xp
        super().__init__(xp, omega, pair_block)
        self.num_samples = omega.shape[-2]  # omega is (..., C, D)
        # log N(omega_c; 0, I) - log q_c(omega_c) and w_c (eq. 36), each (..., 1, C)
        self.log_ratio, own_weight = own_proposal_weights(xp, omega, proposal_means)
        self.proposal_means, self.own_weight = proposal_means, own_weight[..., 0, :]
        self.weighting, self.beta = weighting, beta

    log_mean = 0.0  # the weights alpha_nc are the mixture's normalization

    def queries(self, q_hat: Array) -> Array:
        return q_hat @ self.omega_t + self.query_offset(q_hat)

    def step_offset(self, q: Array, root_scale: float) -> Array:
        xp = self.xp
        if self.weighting == "query_proposal":
            return self.query_offset(root_scale * q)[..., 0, :]
        # the balance heuristic: alpha_c = w_c, the same for every query, a row (..., C)
        return self.log_ratio[..., 0, :] + xp.log(importance_weights(
            xp, self.own_weight, None, "balance", self.beta, as_row=True))

    def query_offset(self, q_hat: Array) -> Array:
        r""":math:`\log \alpha_{nc} + \log N(\omega_c; 0, I) - \log q_c(\omega_c)`,
        (..., N, C) (N = 1 for the balance heuristic, the same for every query)."""
        xp = self.xp
        affinity = None
        if self.weighting == "query_proposal":  # (r_nc, rho = 1): the decoupled formula
            affinity = (query_proposal_affinity(xp, q_hat, self.proposal_means),
                        xp.ones_like(self.own_weight)[..., None, :])
        weights = importance_weights(xp, self.own_weight, affinity,
                                     "balance" if affinity is None else "decoupled", self.beta)
        # the weights are floored at WEIGHT_FLOOR > 0, so their logs are finite
        return self.log_ratio + xp.log(weights)

    def query_constant(self, q_hat: Array) -> Array:
        xp = self.xp
        return -0.5 * xp.sum(q_hat * q_hat, axis=-1, keepdims=True)



def causal_lara(inputs: AttentionInputs, omega: Array, proposal_means: Array, *,
                weighting: str, beta: float, chunk_size: int, working_memory: int,
                stateful: bool = False, state: LARAState | None = None,
                sequence_parallel: Any = None) -> Any:
    """Causal LARA with the samples ``omega`` (..., C, D) of the proposals
    ``proposal_means``: the output (..., N, Dv), masked queries 0; with ``stateful``, the
    pair ``(out, LARAState)`` continuing ``state`` (None: a new sequence). The scan's
    blocks are as long as ``working_memory`` bytes allow
    (:func:`~xattn._estimators.rf_scan.block_positions`)."""
    xp = inputs.xp
    block_size = block_positions(
        length=inputs.num_queries, batch_size=math.prod(inputs.batch_shape),
        num_features=omega.shape[-2], width=inputs.v.shape[-1] + 1,
        itemsize=xp.finfo(inputs.compute_dtype).bits // 8, working_memory=working_memory)
    mapping = ImportanceMap(inputs, omega, proposal_means, weighting=weighting,
                            beta=beta, pair_block=min(PAIR_BLOCK, block_size,
                                                      max(inputs.num_queries, 1)))
    if stateful:
        features = (state.features if state is not None
                    else empty_rfa_state(inputs, mapping, omega, IMPORTANCE_FEATURES, 0, 0))
        # sequence_parallel: this device's piece of one sequence (xattn._estimators.sequence)
        out, _, features = continue_sequence(xp, inputs, mapping, features, sequence_parallel,
                                             estimator="lara", block_size=block_size,
                                             chunk_size=chunk_size, guard=False)
    else:
        out, _ = causal_scan(xp, inputs, mapping, block_size, chunk_size, guard=False)
    if inputs.query_mask is not None:
        out = xp.where(inputs.query_mask[..., None], out, 0.0)
    if not stateful:
        return out
    return out, LARAState(features, proposal_means, weighting, beta)


def state_options(state: LARAState, num_samples: int, *, weighting: str | None,
                  beta: float | None) -> tuple[Array, Array, str, float]:
    """The samples, proposal means, weighting and beta that ``state`` continues with; an
    option given explicitly must equal the state's (``ValueError`` naming it), as with
    :func:`xattn.rfa`'s ``state=`` (the means are compared by :func:`xattn.lara`)."""
    omega = state.features.omega
    if num_samples != omega.shape[-2]:
        raise ValueError(f"num_samples={num_samples} differs from the state's C = "
                         f"{omega.shape[-2]} proposals")
    if weighting is not None and weighting != state.weighting:
        refuse("weighting", weighting, state.weighting)
    if beta is not None and float(beta) != state.beta:
        refuse("beta", beta, state.beta)
    return omega, state.proposal_means, state.weighting, state.beta
