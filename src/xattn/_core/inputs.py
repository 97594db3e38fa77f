"""The checks of an attention call's arrays: ``q, k, v``, the masks, the samples and the
proposal means, with messages that name the argument and the expected shape or dtype.
:func:`prepare_attention` gives the estimators their inputs as an :class:`AttentionInputs`
(namespace, device, compute dtype, leading dims); the checks of the scalar options are in
:mod:`xattn._core.options`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from xattn._core.array import (
    Array,
    array_namespace,
    compute_dtype,
    has_half_products,
    is_real_floating,
    result_dtype,
)
from xattn._core.options import check_bool, check_scale

__all__ = ["AttentionInputs", "check_attention_inputs", "check_device", "check_proposal_means",
           "check_samples", "prepare_attention"]


@dataclass(frozen=True)
class AttentionInputs:
    """Validated attention inputs, cast to the compute dtype.

    Attributes
    ----------
    xp : namespace
        The Array API namespace of the inputs.
    q, k, v : arrays
        ``(..., N, D)``, ``(..., M, D)``, ``(..., M, Dv)`` in :attr:`compute_dtype` (in
        :attr:`dtype`, half precision, where the estimator asked to keep it).
    key_mask, query_mask : arrays or None
        Boolean, broadcast to ``(..., M)`` / ``(..., N)`` in their last axis.
    scale : float
        The score scale (``1/sqrt(D)`` unless given).
    dtype : dtype
        The dtype of the result (that of the inputs).
    compute_dtype : dtype
        float32 for half-precision inputs, else :attr:`dtype`.
    device : device
        The device of ``q``, where the result lives.
    batch_shape : tuple of int
        The broadcast leading dims of q, k, v and the masks.
    """

    xp: Any
    q: Array
    k: Array
    v: Array
    key_mask: Array | None
    query_mask: Array | None
    scale: float
    dtype: Any
    compute_dtype: Any
    device: Any
    batch_shape: tuple[int, ...]

    @property
    def num_queries(self) -> int:
        return self.q.shape[-2]

    @property
    def num_keys(self) -> int:
        return self.k.shape[-2]

    @property
    def is_empty(self) -> bool:
        """True when the result has no element (N = 0 or a leading dim of size 0)."""
        return self.num_queries == 0 or 0 in self.batch_shape

    def empty_result(self) -> Array:
        """The ``(..., N, Dv)`` result of size 0, in the input dtype.

        Built from the inputs rather than by ``xp.zeros``: Dask cannot create (or reduce)
        some zero-size arrays, and a product of size-0 slices stays lazy and cheap.
        """
        shape = (*self.batch_shape, self.num_queries, self.v.shape[-1])
        if self.num_keys == 0:  # a call that continues a sequence with no new token
            return self.finish(self.xp.zeros(shape, dtype=self.compute_dtype,
                                             device=self.device))
        empty = self.q[..., :1] @ self.v[..., :1, :]  # (..., N, Dv) with size 0
        return self.finish(self.xp.broadcast_to(empty, shape))

    def finish(self, out: Array) -> Array:
        """Cast an estimator's result back to the input dtype."""
        if out.dtype == self.dtype:
            return out
        return self.xp.astype(out, self.dtype)

def _check_mask(xp: Any, mask: Any, name: str, length: int, length_name: str) -> Array | None:
    if mask is None:
        return None
    if mask.dtype != xp.bool:
        raise TypeError(f"{name} must be a boolean array of shape (..., {length_name}), "
                        f"got dtype {mask.dtype}")
    if mask.ndim < 1 or mask.shape[-1] not in (1, length):
        raise ValueError(
            f"{name} must have shape (..., {length_name}) with {length_name} = {length} "
            f"(or 1 to broadcast), got shape {tuple(mask.shape)}"
        )
    if mask.shape[-1] != length:
        mask = xp.broadcast_to(mask, (*mask.shape[:-1], length))
    return mask

def prepare_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: Any = None,
    key_mask: Any = None,
    query_mask: Any = None,
    check_finite: bool = False,
    continuing: bool = False,
    keep_half: bool = False,
) -> AttentionInputs:
    """Validate ``q, k, v`` and the masks of an attention call.

    Checks: all arrays from one library; ranks >= 2; ``D`` of q equals ``D`` of k;
    ``M`` of k equals ``M`` of v; real floating dtypes; boolean masks of shape
    ``(..., M)`` / ``(..., N)``; leading dims that broadcast. Half-precision inputs are
    cast to float32 for the computation (:meth:`AttentionInputs.finish` casts back).
    With ``keep_half`` bfloat16 q, k and v keep their dtype where the library multiplies
    half matrices with float32 accumulation (an estimator that multiplies them in half
    precision; :attr:`AttentionInputs.compute_dtype` is float32 all the same); float16,
    whose exponent range is too narrow for the features at large scores, is computed in
    float32.
    With ``continuing`` (a call with ``state=`` or ``return_state=True``) q, k and v are
    the new tokens of one sequence: ``N = M`` is required, and ``M = 0`` is allowed (the
    state holds the keys seen before).

    **Non-finite inputs.** With ``check_finite=True``, NaN or infinity anywhere in q, k
    or v (masked entries included) raises a ``ValueError`` naming the array. The check
    reads the values: it forces lazy Dask inputs and cannot run on traced arrays (inside
    :func:`jax.jit` it raises JAX's concretization error). With ``check_finite=False``
    (the default) nothing is checked and NaN reaches exactly the output rows (and the
    gradients) of the queries that attend it: its own row for a query (LARA's segment
    means: every row), the rows that attend the key for a key or value, none for a masked
    key (:func:`xattn._core.primitives.quarantine`).

    Raises
    ------
    TypeError
        Mixed libraries, non-floating inputs, non-boolean masks.
    ValueError
        Wrong ranks or shapes; the message names the argument and the expected shape.
    """
    xp = array_namespace(q, k, v, key_mask, query_mask,
                         names=("q", "k", "v", "key_mask", "query_mask"))
    for name, x, shape in (("q", q, "(..., N, D)"), ("k", k, "(..., M, D)"),
                           ("v", v, "(..., M, Dv)")):
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape {shape} (rank >= 2), "
                             f"got shape {tuple(x.shape)}")
        if not is_real_floating(xp, x.dtype):
            raise TypeError(f"{name} must have a real floating dtype (float16, bfloat16, "
                            f"float32 or float64), got {x.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dim D: q has shape "
                         f"{tuple(q.shape)} (..., N, D), k has shape {tuple(k.shape)} (..., M, D)")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of keys M: k has shape "
                         f"{tuple(k.shape)} (..., M, D), v has shape {tuple(v.shape)} (..., M, Dv)")
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    if continuing and num_queries != num_keys:
        raise ValueError(f"with state= or return_state=True, q and k are the new tokens of one "
                         f"sequence and must have as many rows (N = M): q has shape "
                         f"{tuple(q.shape)} (..., N, D), k has shape {tuple(k.shape)} (..., M, D)")
    if num_keys == 0 and not continuing:
        raise ValueError(f"k must hold at least one key (M >= 1), got shape {tuple(k.shape)}; "
                         "attention over an empty key set is undefined")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a feature dim D >= 1, got q shape {tuple(q.shape)}")
    check_finite = check_bool(check_finite, "check_finite")
    if check_finite:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not bool(xp.all(xp.isfinite(x))):
                raise ValueError(f"{name} contains NaN or infinity (check_finite=True); "
                                 "replace them first (masked entries are checked too)")
    key_mask = _check_mask(xp, key_mask, "key_mask", num_keys, "M")
    query_mask = _check_mask(xp, query_mask, "query_mask", num_queries, "N")

    leading = {"q": q.shape[:-2], "k": k.shape[:-2], "v": v.shape[:-2]}
    if key_mask is not None:
        leading["key_mask"] = key_mask.shape[:-1]
    if query_mask is not None:
        leading["query_mask"] = query_mask.shape[:-1]
    try:
        batch_shape = tuple(np.broadcast_shapes(*leading.values()))
    except ValueError:
        described = ", ".join(f"{name} {tuple(s)}" for name, s in leading.items())
        raise ValueError(f"the leading (batch) dims do not broadcast: {described}") from None

    device = array_api_compat.device(q)
    check_device(q, k=k, v=v, key_mask=key_mask, query_mask=query_mask, device=device)

    dtype = result_dtype(xp, q, k, v)
    work = compute_dtype(xp, dtype)
    # float16 is computed in float32: its exponent range (down to 6e-5, 6e-8 subnormal)
    # cannot hold the features of the estimators' shared stabilizers at large scores
    # (errors of 0.4 to 0.8 at 3-4 times standard normal q and k); bfloat16 has float32's
    if not (keep_half and q.dtype == k.dtype == v.dtype == dtype
            and has_half_products(xp, dtype)
            and xp.finfo(dtype).smallest_normal <= xp.finfo(xp.float32).smallest_normal):
        q, k, v = (x if x.dtype == work else xp.astype(x, work) for x in (q, k, v))
    return AttentionInputs(
        xp=xp, q=q, k=k, v=v, key_mask=key_mask, query_mask=query_mask,
        scale=check_scale(scale, q.shape[-1]), dtype=dtype, compute_dtype=work,
        device=device, batch_shape=batch_shape,
    )

def check_device(q: Array, device: Any = None, **arrays: Array | None) -> None:
    """Raise a ValueError naming the first of ``arrays`` (skipping None) that is not on the
    device of ``q`` (``device``, when the caller has it); traced JAX arrays have no
    device (None), so nothing is compared."""
    device = array_api_compat.device(q) if device is None else device
    if device is None:
        return
    for name, x in arrays.items():
        if x is None:
            continue
        held = array_api_compat.device(x)
        if held is not None and held != device:
            raise ValueError(f"{name} is on device {held} but q is on {device}; move them "
                             "to one device")

def check_samples(xp: Any, q: Array, omega: Any, num_features: int | None, head_dim: int,
                  work: Any, batch_shape: tuple[int, ...] = ()) -> Array:
    """RFA's explicit samples ``omega``: an ``(S, D)`` or ``(..., S, D)`` real floating
    array of the library of ``q`` (``S = num_features`` when given) whose leading dims, one
    sample matrix per head (or per layer and head), broadcast against the batch dims
    ``batch_shape`` of the call without growing them; returned in the compute dtype
    ``work``."""
    array_namespace(q, omega, names=("q", "omega"))
    expected_rows = "S" if num_features is None else str(num_features)
    shape = tuple(omega.shape)
    if (len(shape) < 2 or shape[-1] != head_dim or shape[-2] < 1
            or (num_features is not None and shape[-2] != num_features)):
        raise ValueError(
            f"omega must have shape (S, D) = ({expected_rows}, {head_dim}) or (..., "
            f"{expected_rows}, {head_dim}) (one sample per row, D the last dim of q; leading "
            f"dims: one matrix per head), got shape {shape}"
        )
    try:
        broadcast = np.broadcast_shapes(shape[:-2], tuple(batch_shape))
    except ValueError:
        broadcast = None
    if broadcast != tuple(batch_shape):
        raise ValueError(
            f"omega must have shape (S, D) or (..., S, D) with leading dims that broadcast "
            f"against the leading (batch, head) dims {tuple(batch_shape)} of q, k and v "
            f"(one matrix per head: e.g. (H, S, D) for q of shape (B, H, N, D)); got shape "
            f"{shape}")
    if not xp.isdtype(omega.dtype, "real floating"):
        raise TypeError(f"omega must have a real floating dtype, got {omega.dtype}")
    check_device(q, omega=omega)
    return omega if omega.dtype == work else xp.astype(omega, work)

def check_proposal_means(inputs: AttentionInputs, proposal_means: Any,
                         num_proposals: int) -> Array:
    """LARA's caller-supplied proposal means: a real floating ``(..., C, D)`` array of the
    library and device of ``q`` whose leading dims broadcast against the batch dims,
    returned in the compute dtype."""
    array_namespace(inputs.q, proposal_means, names=("q", "proposal_means"))
    shape = tuple(proposal_means.shape)
    head_dim = inputs.q.shape[-1]
    expected = f"(..., C, D) = (..., {num_proposals}, {head_dim})"
    if len(shape) < 2 or shape[-2:] != (num_proposals, head_dim):
        raise ValueError(f"proposal_means must have shape {expected} (C = num_samples, D "
                         f"the last dim of q), got shape {shape}")
    try:
        broadcast = np.broadcast_shapes(shape[:-2], inputs.batch_shape)
    except ValueError:
        broadcast = None
    if broadcast != tuple(inputs.batch_shape):
        raise ValueError(f"proposal_means's leading dims {shape[:-2]} must broadcast against "
                         f"the batch dims {tuple(inputs.batch_shape)}")
    if not inputs.xp.isdtype(proposal_means.dtype, "real floating"):
        raise TypeError(f"proposal_means must have a real floating dtype, got "
                        f"{proposal_means.dtype}")
    check_device(inputs.q, proposal_means=proposal_means)
    work = inputs.compute_dtype
    return proposal_means if proposal_means.dtype == work else inputs.xp.astype(
        proposal_means, work)


def check_attention_inputs(
    q: Array,
    k: Array,
    v: Array,
    *,
    key_mask: Array | None = None,
    query_mask: Array | None = None,
    check_finite: bool = False,
) -> None:
    """Check ``q, k, v`` and the masks as every estimator checks them, computing nothing.

    The checks: all arrays from one library; ranks >= 2; ``D`` of q equals ``D`` of k;
    ``M`` of k equals ``M`` of v; real floating dtypes; boolean masks of shape
    ``(..., M)`` (``key_mask``) and ``(..., N)`` (``query_mask``); leading dims that
    broadcast. For checking inputs before a long run, or in a tool that reads them from a
    file (``xattn bench --inputs`` does).

    Parameters
    ----------
    q : array, shape (..., N, D)
    k : array, shape (..., M, D)
    v : array, shape (..., M, Dv)
    key_mask : bool array, shape broadcastable to (..., M), optional
    query_mask : bool array, shape broadcastable to (..., N), optional
    check_finite : bool
        Also read the values and refuse NaN or infinity (forces lazy Dask inputs; not
        possible on traced arrays).

    Raises
    ------
    ValueError
        For a shape that does not fit, naming the array and the expected shape (or the
        array that holds a non-finite value, with ``check_finite``).
    TypeError
        For arrays of different libraries or a dtype that is not real floating (boolean
        for the masks), naming the array.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.diagnostics import check_attention_inputs
    >>> check_attention_inputs(np.zeros((4, 8)), np.zeros((6, 8)), np.zeros((6, 2)))
    >>> check_attention_inputs(np.zeros((4, 8)), np.zeros((6, 3)),
    ...                        np.zeros((6, 2)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: q and k must have the same last dim D: q has shape (4, 8) (..., N, D), ...
    """
    prepare_attention(q, k, v, key_mask=key_mask, query_mask=query_mask,
                      check_finite=check_finite)
