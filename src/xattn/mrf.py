r"""Partition functions of linear-chain Markov random fields, exact and linearized.

A linear-chain MRF over variables :math:`x_0, \dots, x_{T-1} \in \mathcal X` with
embeddings :math:`e_t(x) \in \mathbb R^n` has pairwise potentials only,

.. math::

    p(x) \propto \prod_{t=1}^{T-1} \psi_t(x_{t-1}, x_t), \qquad
    \psi_t(a, b) = \exp\big(e_{t-1}(a) \cdot e_t(b)\big), \qquad
    Z = \sum_{x_0, \dots, x_{T-1}} \prod_{t=1}^{T-1} \psi_t(x_{t-1}, x_t),

with no unary potentials and no initial distribution (every :math:`x_0` has weight 1).
The user guide, :doc:`/guide/mrf`, derives everything below from this model.

* :func:`log_partition` computes :math:`\log Z` exactly by a log-space forward pass in
  :math:`O(T |\mathcal X|^2 n)`.
* :func:`log_partition_rf` replaces every potential by positive random features,
  :math:`\psi_t(a, b) \approx \phi(e_{t-1}(a)) \cdot \phi(e_t(b))` with
  :math:`\phi(e) = \exp(\omega e - \lVert e \rVert^2 / 2) / \sqrt d`
  (Choromanski et al., ICLR 2021; random features of the exponential kernel as in
  Rawat et al., NeurIPS 2019), and reorders the sums, since an interior :math:`x_t`
  appears in two potentials and the ends in one:

  .. math::

      Z \approx \Big(\sum_{x_0} \phi(e_0(x_0))\Big)^{\!\top}
      \prod_{t=1}^{T-2} \Big(\sum_{x_t} \phi(e_t(x_t)) \phi(e_t(x_t))^{\top}\Big)
      \Big(\sum_{x_{T-1}} \phi(e_{T-1}(x_{T-1}))\Big).

  Evaluated right to left as a forward pass of feature-space messages this costs
  :math:`O(T |\mathcal X| d)` (``method="sequential"``); as a product of :math:`d \times d`
  matrices combined by a pairwise (log-depth) reduction it costs :math:`O(T |\mathcal X|
  d^2)` work but only :math:`O(\log T)` sequential matrix products (``method="parallel"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import array_api_compat

from xattn._core.array import (
    Array,
    array_namespace,
    compute_dtype,
    is_real_floating,
)
from xattn._core.options import check_choice, check_positive_int
from xattn._core.primitives import logsumexp, nonzero_divisor
from xattn.features import log_positive_features, sample_omega
from xattn.random import as_generator

__all__ = ["SAMPLES", "log_partition", "log_partition_rf"]

#: The sampling schemes of :func:`log_partition_rf`: independent samples per potential
#: (unbiased estimate of Z) or one matrix shared by every position.
SAMPLES = ("per_edge", "shared")


_SHAPE = "(..., T, |X|, n)"


def _prepare_embeddings(embeddings: Any) -> tuple[Any, Array, Any]:
    """Validate ``embeddings``; return ``(xp, embeddings in the compute dtype, input dtype)``.

    A sequence of ``T`` arrays of shape ``(..., |X|, n)`` is stacked along axis ``-3``.
    """
    if isinstance(embeddings, Sequence) and not isinstance(embeddings, str):
        steps = list(embeddings)
        if len(steps) < 2:
            raise ValueError(f"embeddings must hold T >= 2 positions, got a sequence of "
                             f"{len(steps)} arrays")
        xp = array_namespace(*steps, names=tuple(f"embeddings[{t}]" for t in range(len(steps))))
        shapes = [tuple(step.shape) for step in steps]
        if any(len(shape) < 2 for shape in shapes) or len(set(shapes)) > 1:
            raise ValueError(
                "embeddings given as a sequence must be T arrays of one shape (..., |X|, n); "
                f"got shapes {', '.join(map(str, shapes))}"
            )
        embeddings = xp.stack(steps, axis=-3)
    else:
        xp = array_namespace(embeddings, names=("embeddings",))
    if embeddings.ndim < 3:
        raise ValueError(f"embeddings must have shape {_SHAPE} (rank >= 3), got shape "
                         f"{tuple(embeddings.shape)}")
    num_steps, num_states = embeddings.shape[-3], embeddings.shape[-2]
    if num_steps < 2:
        raise ValueError(f"embeddings must have T >= 2 positions (axis -3 of {_SHAPE}), "
                         f"got shape {tuple(embeddings.shape)}")
    if num_states < 1 or embeddings.shape[-1] < 1:
        raise ValueError(f"embeddings must have |X| >= 1 states and n >= 1 dims {_SHAPE}, "
                         f"got shape {tuple(embeddings.shape)}")
    if not is_real_floating(xp, embeddings.dtype):
        raise TypeError(f"embeddings must have a real floating dtype (float16, bfloat16, "
                        f"float32 or float64), got {embeddings.dtype}")
    dtype = embeddings.dtype
    work = compute_dtype(xp, dtype)
    if work != dtype:
        embeddings = xp.astype(embeddings, work)
    return xp, embeddings, dtype


def _finish(xp: Any, out: Array, dtype: Any) -> Array:
    return out if out.dtype == dtype else xp.astype(out, dtype)


def log_partition(embeddings: Array) -> Array:
    r"""Exact log-partition function of a linear-chain MRF.

    .. math::

        \log Z = \log \sum_{x_0, \dots, x_{T-1}} \prod_{t=1}^{T-1}
        \exp\big(e_{t-1}(x_{t-1}) \cdot e_t(x_t)\big)

    (no unary potentials, weight 1 for every :math:`x_0`; the model of :doc:`/guide/mrf`),
    by the forward recursion in log space, :math:`\log\alpha_0 = 0`,

    .. math::

        \log\alpha_t(b) = \operatorname{logsumexp}_a\big(\log\alpha_{t-1}(a)
        + e_{t-1}(a) \cdot e_t(b)\big), \qquad
        \log Z = \operatorname{logsumexp}_b \log\alpha_{T-1}(b),

    every log-sum-exp shifted by its max. Cost :math:`O(T |\mathcal X|^2 n)` time,
    :math:`O(T |\mathcal X|^2)` memory.

    Parameters
    ----------
    embeddings : array, shape (..., T, |X|, n), or a sequence of T arrays (..., |X|, n)
        :math:`e_t(x)` for position ``t`` and state ``x``; real floating dtype. Leading
        dims are batch dims. Half precision is computed in float32.

    Returns
    -------
    array, shape (...)
        :math:`\log Z` in the dtype of ``embeddings``, same namespace and device.

    Raises
    ------
    ValueError
        Rank below 3, ``T < 2``, an empty state or embedding axis, or a sequence of arrays
        of different shapes.
    TypeError
        Non-floating dtype, or not an array.

    See Also
    --------
    log_partition_rf : The random-feature estimate, linear in the number of states.

    References
    ----------
    .. [1] L. R. Rabiner, "A Tutorial on Hidden Markov Models and Selected Applications
       in Speech Recognition", Proceedings of the IEEE 77(2), 1989 (the forward
       recursion). https://doi.org/10.1109/5.18626

    The construction and its cost are derived in :doc:`/guide/mrf`; all papers:
    :doc:`/bibliography`.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.mrf import log_partition
    >>> embeddings = np.zeros((3, 2, 4))  # T = 3, |X| = 2: every potential is 1
    >>> bool(np.isclose(log_partition(embeddings), 3 * np.log(2)))  # 2**3 paths
    True
    >>> log_partition(np.ones((5, 3, 2, 4))).shape
    (5,)
    """
    xp, embeddings, dtype = _prepare_embeddings(embeddings)
    num_steps = embeddings.shape[-3]
    # scores[..., t - 1, a, b] = e_{t-1}(a) . e_t(b) = log psi_t(a, b)
    scores = embeddings[..., :-1, :, :] @ xp.matrix_transpose(embeddings[..., 1:, :, :])
    log_alpha = xp.zeros_like(embeddings[..., 0, :, 0])  # (..., |X|): log alpha_0 = 0
    for step in range(1, num_steps):
        log_alpha = logsumexp(xp, log_alpha[..., :, None] + scores[..., step - 1, :, :],
                               axis=-2)
    return _finish(xp, logsumexp(xp, log_alpha, axis=-1), dtype)


def _sequential_log_partition(xp: Any, log_out: Array, log_in: Array) -> Array:
    r"""Forward pass of feature-space messages, all in log space: :math:`O(T|X|d)`.

    ``log_out[..., t, x, k]`` is :math:`\log \phi^{(t+1)}_k(e_t(x))`, the features of
    position ``t`` for the potential :math:`\psi_{t+1}` on its right, and
    ``log_in[..., t - 1, x, k]`` is :math:`\log \phi^{(t)}_k(e_t(x))`, those for the
    potential :math:`\psi_t` on its left (the same features when all potentials share one
    :math:`\omega`). The message :math:`\beta_t \in \mathbb R^d` (the product of feature
    sums of :func:`log_partition_rf`, read left to right) is kept as :math:`\log \beta_t`,
    so every feature tracks its scale:

    .. math::

        \log\beta_0(k) = \operatorname{logsumexp}_x \log\phi^{(1)}_k(e_0(x)), \quad
        \log w_t(x) = \operatorname{logsumexp}_k\big(\log\beta_{t-1}(k)
        + \log\phi^{(t)}_k(e_t(x))\big),
        \\
        \log\beta_t(k) = \operatorname{logsumexp}_x\big(\log w_t(x)
        + \log\phi^{(t+1)}_k(e_t(x))\big),
        \quad \log Z = \operatorname{logsumexp}_x \log w_{T-1}(x).
    """
    num_steps = log_out.shape[-3] + 1
    log_message = logsumexp(xp, log_out[..., 0, :, :], axis=-2)  # (..., d)
    for step in range(1, num_steps):
        # log w_t(x): log of beta_{t-1} . phi^(t)(e_t(x)), the summed potential into state x
        log_weights = logsumexp(xp, log_message[..., None, :] + log_in[..., step - 1, :, :],
                                axis=-1)
        if step == num_steps - 1:
            return logsumexp(xp, log_weights, axis=-1)
        # beta_t = sum_x w_t(x) phi^(t+1)(e_t(x)) = beta_{t-1} M_t
        log_message = logsumexp(xp, log_weights[..., :, None] + log_out[..., step, :, :],
                                axis=-2)
    raise AssertionError("unreachable: T >= 2 is validated")


def _normalized(xp: Any, matrices: Array, log_scales: Array) -> tuple[Array, Array]:
    """Rescale each matrix to max entry 1, moving the factor into its log-scale."""
    peak = xp.max(matrices, axis=(-2, -1), keepdims=True)
    peak = nonzero_divisor(xp, peak)
    return matrices / peak, log_scales + xp.log(peak[..., 0, 0])


def _parallel_log_partition(xp: Any, log_out: Array, log_in: Array) -> Array:
    r"""Product of :math:`d \times d` matrices by a pairwise reduction over ``T``.

    Each middle factor :math:`M_t = \sum_x \phi^{(t)}(e_t(x)) \phi^{(t+1)}(e_t(x))^\top`
    (``log_in`` and ``log_out`` as in :func:`_sequential_log_partition`) is stored as a
    matrix with max entry 1 and a log-scale, :math:`M_t = e^{s_t} N_t`. Neighbouring
    pairs are multiplied, :math:`N_{2i} N_{2i+1}` with log-scale
    :math:`s_{2i} + s_{2i+1}`, and renormalized, halving the count each round
    (:math:`\lceil \log_2 T \rceil` rounds of batched matrix products, static loop).
    """
    num_steps, dim = log_out.shape[-3] + 1, log_out.shape[-1]
    # end vectors sum_x phi^(1)(e_0(x)) and sum_x phi^(T-1)(e_{T-1}(x)), in log space
    log_first = logsumexp(xp, log_out[..., 0, :, :], axis=-2)  # (..., d)
    log_last = logsumexp(xp, log_in[..., -1, :, :], axis=-2)  # (..., d)
    if num_steps == 2:
        return logsumexp(xp, log_first + log_last, axis=-1)

    # positions 1 .. T-2: features for the potential on the left (rows) and right (columns)
    middle_in, middle_out = log_in[..., :-1, :, :], log_out[..., 1:, :, :]
    shift_in = xp.max(middle_in, axis=(-2, -1))  # (..., T - 2)
    shift_out = xp.max(middle_out, axis=(-2, -1))
    matrices = (xp.matrix_transpose(xp.exp(middle_in - shift_in[..., None, None]))
                @ xp.exp(middle_out - shift_out[..., None, None]))  # (..., T - 2, d, d)
    matrices, log_scales = _normalized(xp, matrices, shift_in + shift_out)
    count = num_steps - 2
    while count > 1:  # static: shapes only
        if count % 2:  # pad with the identity, log-scale 0
            eye = xp.eye(dim, dtype=matrices.dtype, device=array_api_compat.device(matrices))
            eye = xp.broadcast_to(eye, (*matrices.shape[:-3], 1, dim, dim))
            matrices = xp.concat([matrices, eye], axis=-3)
            log_scales = xp.concat([log_scales, xp.zeros_like(log_scales[..., :1])], axis=-1)
            count += 1
        matrices, log_scales = _normalized(
            xp,
            matrices[..., 0::2, :, :] @ matrices[..., 1::2, :, :],
            log_scales[..., 0::2] + log_scales[..., 1::2],
        )
        count //= 2
    product, log_scale = matrices[..., 0, :, :], log_scales[..., 0]
    # log Z = s + log(beta_0^T N gamma), with beta_0, gamma shifted by their maxima
    first_max = xp.max(log_first, axis=-1, keepdims=True)
    last_max = xp.max(log_last, axis=-1, keepdims=True)
    first = xp.exp(log_first - first_max)
    last = xp.exp(log_last - last_max)
    total = xp.sum((first[..., None, :] @ product)[..., 0, :] * last, axis=-1)
    return log_scale + first_max[..., 0] + last_max[..., 0] + xp.log(total)


def log_partition_rf(
    embeddings: Array,
    *,
    num_features: int | None = None,
    rng: Any = None,
    method: str = "sequential",
    orthogonal: bool = True,
    omega: Array | None = None,
    samples: str = "per_edge",
) -> Array:
    r"""Random-feature (linearized) estimate of the log-partition function of a linear chain.

    Every potential is replaced by positive random features,

    .. math::

        \psi_t(a, b) = e^{e_{t-1}(a) \cdot e_t(b)} \approx \phi(e_{t-1}(a)) \cdot \phi(e_t(b)),
        \qquad \phi_k(e) = \frac{1}{\sqrt d} \exp\big(\omega_k \cdot e - \lVert e \rVert^2/2\big),
        \quad \omega_k \sim N(0, I_n),

    drawn by :func:`xattn.features.sample_omega` (block-orthogonal rows with chi norms by
    default, so every row is marginally :math:`N(0, I_n)`). With ``samples="per_edge"``
    (default) every potential :math:`\psi_t` gets its own independent matrix
    :math:`\omega^{(t)}` (features :math:`\phi^{(t)}`); with ``samples="shared"`` one
    matrix serves every position. The sums are then reordered, since an interior
    :math:`x_t` appears in two potentials and the ends in one (derived in
    :doc:`/guide/mrf`; shown for shared features, per edge
    :math:`M_t = \sum_x \phi^{(t)}(e_t(x)) \phi^{(t+1)}(e_t(x))^\top` and the end vectors
    use :math:`\phi^{(1)}`, :math:`\phi^{(T-1)}`):

    .. math::

        Z_{\mathrm{rf}} = \beta_0^\top M_1 \cdots M_{T-2}\, \gamma, \quad
        \beta_0 = \sum_x \phi(e_0(x)), \quad M_t = \sum_x \phi(e_t(x)) \phi(e_t(x))^\top,
        \quad \gamma = \sum_x \phi(e_{T-1}(x)).

    **Bias.** Per edge, :math:`Z_{\mathrm{rf}}` is a sum over paths of products of
    independent unbiased factors, so :math:`\mathbb E[Z_{\mathrm{rf}}] = Z` exactly, for
    every ``T``. Shared features make every path's product a product of dependent factors:
    unbiased for ``T = 2`` only, consistent (bias :math:`O(1/d)`) for longer chains. In
    both cases :math:`\log Z_{\mathrm{rf}}` is biased low by Jensen's inequality, and its
    error shrinks like :math:`1/\sqrt d`. Measured errors of both: the MRF guide.

    Parameters
    ----------
    embeddings : array, shape (..., T, |X|, n), or a sequence of T arrays (..., |X|, n)
        :math:`e_t(x)`; real floating dtype, ``T >= 2``. Half precision is computed in
        float32.
    num_features : int, optional
        ``d``, the number of random features (>= 1). Required unless ``omega`` is given.
    rng : None, int, xattn or native generator, optional
        Where ``omega`` is drawn from (see :mod:`xattn.random`); an int seed gives the same
        features on every backend. Ignored when ``omega`` is given.
    method : {"sequential", "parallel"}
        ``"sequential"``: forward pass of feature-space messages :math:`\beta_t =
        \beta_{t-1} M_t`, kept entirely in log space (every feature carries its own
        log-scale), :math:`O(T |\mathcal X| d)` time. ``"parallel"``: the matrices
        :math:`M_t` (each with max entry 1 and a log-scale) multiplied by a pairwise
        reduction, :math:`O(T |\mathcal X| d^2 + T d^3)` work in :math:`\lceil \log_2 T
        \rceil` rounds of batched products: for long chains on parallel hardware.
    orthogonal : bool
        Draw block-orthogonal samples (default, lower variance) or iid normal rows.
        Ignored when ``omega`` is given.
    omega : array, shape (..., T - 1, d, n) or (..., d, n), optional
        Explicit samples as rows, to fix the features across calls (leading dims broadcast
        against those of ``embeddings``): one ``(d, n)`` matrix per potential
        (``samples="per_edge"``, axis -3 of length ``T - 1``) or one for all
        (``samples="shared"``).
    samples : {"per_edge", "shared"}
        ``"per_edge"`` (default): an independent sample matrix for each of the ``T - 1``
        potentials, so the estimate of :math:`Z` is unbiased. ``"shared"``: one matrix for
        every position (the product above as written, with one :math:`\phi`). Drawn from
        ``rng`` in order of the potentials (for ``"shared"``, exactly the draws of earlier
        versions).

    Returns
    -------
    array, shape (...)
        The estimate of :math:`\log Z`, in the dtype of ``embeddings`` (broadcast with the
        leading dims of ``omega`` if it has any).

    Raises
    ------
    ValueError
        Bad ``embeddings`` (see :func:`log_partition`), ``num_features < 1``, ``omega``
        whose last dim is not ``n``, whose row count disagrees with ``num_features`` or
        (per edge) whose axis -3 is not ``T - 1``, an unknown ``method`` or ``samples``.
    TypeError
        Non-integer ``num_features``, non-string ``method`` or ``samples``, non-floating
        dtypes, arrays from two libraries.

    See Also
    --------
    log_partition : The exact log-partition function (forward recursion).
    xattn.features.sample_omega : The (orthogonal) sample matrices.

    References
    ----------
    .. [1] A. S. Rawat, J. Chen, F. X. Yu, A. T. Suresh, S. Kumar, "Sampled Softmax with
       Random Fourier Features", NeurIPS 2019. https://arxiv.org/abs/1907.10747
    .. [2] K. Choromanski et al., "Rethinking Attention with Performers", ICLR 2021
       (positive random features). https://arxiv.org/abs/2009.14794
    .. [3] J. T. Chiu, Y. Deng, A. M. Rush, "Low-Rank Constraints for Fast Inference in
       Structured Models", NeurIPS 2021 (the same idea for HMMs).
       https://arxiv.org/abs/2201.02715

    The construction and its bias are derived in :doc:`/guide/mrf`; all papers:
    :doc:`/bibliography`.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.mrf import log_partition, log_partition_rf
    >>> embeddings = 0.3 * np.random.default_rng(0).normal(size=(6, 5, 4))
    >>> exact = log_partition(embeddings)
    >>> estimate = log_partition_rf(embeddings, num_features=512, rng=0)
    >>> bool(abs(estimate - exact) < 0.4)  # the RMS error is about 2 / sqrt(d) = 0.09 here
    True
    >>> parallel = log_partition_rf(embeddings, num_features=512, rng=0, method="parallel")
    >>> bool(np.isclose(parallel, estimate, rtol=1e-10))
    True
    >>> shared = log_partition_rf(embeddings, num_features=512, rng=0, samples="shared")
    >>> bool(abs(shared - exact) < 0.4)
    True
    """
    xp, embeddings, dtype = _prepare_embeddings(embeddings)
    check_choice(method, "method", ("sequential", "parallel"))
    check_choice(samples, "samples", SAMPLES)
    num_steps, embed_dim = embeddings.shape[-3], embeddings.shape[-1]
    work = embeddings.dtype
    per_edge = samples == "per_edge"
    omega_shape = "(..., T - 1, d, n)" if per_edge else "(..., d, n)"
    if omega is None:
        if num_features is None:
            raise TypeError("num_features is required (an int >= 1) unless omega is given")
        num_features = check_positive_int(num_features, "num_features")
        device = array_api_compat.device(embeddings)
        if per_edge:  # T - 1 independent matrices, drawn in order of the potentials
            generator = as_generator(rng)
            omega = xp.stack([sample_omega(generator, num_features, embed_dim, xp=xp,
                                           dtype=work, device=device, orthogonal=orthogonal)
                              for _ in range(num_steps - 1)], axis=0)
        else:
            omega = sample_omega(rng, num_features, embed_dim, xp=xp, dtype=work,
                                 device=device, orthogonal=orthogonal)
    else:
        array_namespace(embeddings, omega, names=("embeddings", "omega"))
        if omega.ndim < (3 if per_edge else 2) or omega.shape[-1] != embed_dim:
            raise ValueError(f"omega must have shape {omega_shape} with n = {embed_dim} (the "
                             f"last dim of embeddings) for samples={samples!r}, got shape "
                             f"{tuple(omega.shape)}")
        if per_edge and omega.shape[-3] != num_steps - 1:
            raise ValueError(f"omega must have shape (..., T - 1, d, n) with T - 1 = "
                             f"{num_steps - 1} (one matrix per potential) for "
                             f"samples='per_edge', got shape {tuple(omega.shape)}; pass "
                             "samples='shared' for one (..., d, n) matrix shared by every "
                             "position")
        if not is_real_floating(xp, omega.dtype):
            raise TypeError(f"omega must have a real floating dtype, got {omega.dtype}")
        if num_features is not None and (
            check_positive_int(num_features, "num_features") != omega.shape[-2]
        ):
            raise ValueError(f"num_features = {num_features} disagrees with omega of shape "
                             f"{tuple(omega.shape)} {omega_shape}")
        if omega.dtype != work:
            omega = xp.astype(omega, work)
    num_features = omega.shape[-2]
    # log phi_k(e_t(x)) = omega_k . e_t(x) - |e_t(x)|^2 / 2 - log(d) / 2
    log_norm = 0.5 * math.log(num_features)
    if per_edge:  # position t meets potential t (on its left) and t + 1 (on its right)
        log_out = log_positive_features(xp, embeddings[..., :-1, :, :], omega) - log_norm
        log_in = log_positive_features(xp, embeddings[..., 1:, :, :], omega) - log_norm
    else:  # (..., T, |X|, d), the same features on both sides of every position
        log_features = log_positive_features(xp, embeddings, omega[..., None, :, :]) - log_norm
        log_out, log_in = log_features[..., :-1, :, :], log_features[..., 1:, :, :]
    if method == "sequential":
        out = _sequential_log_partition(xp, log_out, log_in)
    else:
        out = _parallel_log_partition(xp, log_out, log_in)
    return _finish(xp, out, dtype)
