"""Namespace, device, dtype and array-validation helpers shared by every estimator.

This is the only module (with :mod:`xattn.random`) that knows about concrete array
libraries. Everything here is thin: it resolves the Array API namespace of the inputs
with :func:`array_api_compat.array_namespace`, checks shapes and dtypes with messages
that name the argument, and picks the dtype in which an estimator computes. The checks
of the scalar options (flags, counts, choices, the score scale) are in
:mod:`xattn._core.options`.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import operator
import sys
from dataclasses import dataclass
from typing import Any

import array_api_compat
import array_api_extra as xpx
import numpy as np

from xattn._core.options import check_bool, check_scale

__all__ = ["CPU_WORKING_MEMORY", "GPU_WORKING_MEMORY", "AttentionInputs", "append_ones_column",
           "array_namespace",
           "check_device", "check_proposal_means", "check_samples", "chunked_like",
           "compute_dtype", "concrete_count", "cumulative_max", "default_working_memory",
           "has_native_attention", "host_namespace", "host_to_device", "index_sizes",
           "is_real_floating", "library_name", "nan_to_num", "native_attention",
           "nonfinite_probe", "nonfinite_rows", "one_chunk_along", "prepare_attention", "qr",
           "register_pytree", "sequence_positions", "split_rows", "stop_gradient",
           "stream_bounds", "take", "take_rows", "written_in_place"]

Array = Any


def library_name(x: Any) -> str:
    """Name of the array library that owns ``x`` (``"numpy"``, ``"torch"``, ...)."""
    if array_api_compat.is_numpy_array(x):
        return "numpy"
    if array_api_compat.is_torch_array(x):
        return "torch"
    if array_api_compat.is_jax_array(x):
        return "jax"
    if array_api_compat.is_cupy_array(x):
        return "cupy"
    if array_api_compat.is_dask_array(x):
        return "dask"
    module = type(x).__module__.split(".")[0]
    return module or type(x).__name__


def array_namespace(*arrays: Any, names: tuple[str, ...] | None = None) -> Any:
    """Array API namespace shared by ``arrays`` (``None`` entries are ignored).

    Raises
    ------
    TypeError
        If an argument is not an array, or the arrays come from two libraries; the
        message names the arguments and their libraries.
    """
    names = names or tuple(f"argument {i}" for i in range(len(arrays)))
    present = [(name, a) for name, a in zip(names, arrays, strict=True) if a is not None]
    for name, a in present:
        if isinstance(a, np.ma.MaskedArray):
            raise TypeError(
                f"{name} is a numpy.ma.MaskedArray, whose mask array libraries ignore; pass "
                f"a plain array ({name}.filled(0.0)) and the mask as key_mask / query_mask"
            )
        if not array_api_compat.is_array_api_obj(a):
            raise TypeError(
                f"{name} must be an array (NumPy, CuPy, PyTorch, JAX, Dask or any Array API "
                f"library), got {type(a).__module__}.{type(a).__qualname__}"
            )
    try:
        return array_api_compat.array_namespace(*(a for _, a in present))
    except TypeError:
        libraries = ", ".join(f"{name} is a {library_name(a)} array" for name, a in present)
        raise TypeError(
            f"all arrays must come from one array library, but {libraries}; "
            "convert them to one library first"
        ) from None


def is_real_floating(xp: Any, dtype: Any) -> bool:
    """True if ``dtype`` is a real floating dtype of namespace ``xp`` (False, not an
    error, for anything that is not a dtype of ``xp``)."""
    try:
        return bool(xp.isdtype(dtype, "real floating"))
    except (TypeError, ValueError):
        return False


def compute_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype an estimator computes in: float32 for half precision, else ``dtype``."""
    if dtype == xp.float64 or dtype == xp.float32:
        return dtype
    return xp.float32


@dataclass(frozen=True)
class AttentionInputs:
    """Validated attention inputs, cast to the compute dtype.

    Attributes
    ----------
    xp : namespace
        The Array API namespace of the inputs.
    q, k, v : arrays
        ``(..., N, D)``, ``(..., M, D)``, ``(..., M, Dv)`` in :attr:`compute_dtype`.
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
) -> AttentionInputs:
    """Validate ``q, k, v`` and the masks of an attention call.

    Checks: all arrays from one library; ranks >= 2; ``D`` of q equals ``D`` of k;
    ``M`` of k equals ``M`` of v; real floating dtypes; boolean masks of shape
    ``(..., M)`` / ``(..., N)``; leading dims that broadcast. Half-precision inputs are
    cast to float32 for the computation (:meth:`AttentionInputs.finish` casts back).
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
    check_device(q, k=k, v=v, key_mask=key_mask, query_mask=query_mask)

    dtype = xp.result_type(q, k, v)
    work = compute_dtype(xp, dtype)
    q, k, v = (x if x.dtype == work else xp.astype(x, work) for x in (q, k, v))
    return AttentionInputs(
        xp=xp, q=q, k=k, v=v, key_mask=key_mask, query_mask=query_mask,
        scale=check_scale(scale, q.shape[-1]), dtype=dtype, compute_dtype=work,
        device=device, batch_shape=batch_shape,
    )


def check_device(q: Array, **arrays: Array | None) -> None:
    """Raise a ValueError naming the first of ``arrays`` (skipping None) that is not on the
    device of ``q``; traced JAX arrays have no device (None), so nothing is compared."""
    device = array_api_compat.device(q)
    for name, x in arrays.items():
        if x is None or device is None or array_api_compat.device(x) is None:
            continue
        if array_api_compat.device(x) != device:
            raise ValueError(f"{name} is on device {array_api_compat.device(x)} but q is on "
                             f"{device}; move them to one device")


def check_samples(xp: Any, q: Array, omega: Any, num_features: int | None, head_dim: int,
                  work: Any) -> Array:
    """RFA's explicit samples ``omega``: an ``(S, D)`` real floating array of the library of
    ``q`` (``S = num_features`` when given), returned in the compute dtype ``work``."""
    array_namespace(q, omega, names=("q", "omega"))
    expected_rows = "S" if num_features is None else str(num_features)
    shape = tuple(omega.shape)
    if (len(shape) != 2 or shape[1] != head_dim or shape[0] < 1
            or (num_features is not None and shape[0] != num_features)):
        raise ValueError(
            f"omega must have shape (S, D) = ({expected_rows}, {head_dim}) (one sample per "
            f"row, D the last dim of q), got shape {shape}"
        )
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


_PYTREES: list[tuple[type, tuple[str, ...], tuple[str, ...]]] = []
"""The dataclasses to register as JAX pytrees, with their data and static fields."""


def register_pytree(cls: type, data_fields: tuple[str, ...],
                    meta_fields: tuple[str, ...]) -> None:
    """Make the dataclass ``cls`` a JAX pytree (its arrays the ``data_fields``, the static
    ``meta_fields`` hashable), whenever JAX is imported, before or after xattn.

    Importing xattn never imports JAX: if JAX is already imported, ``cls`` is registered
    now; otherwise an import hook registers it right after ``import jax`` completes, so
    that an instance made before JAX was imported is a pytree too when it reaches
    :func:`jax.jit` or :func:`jax.lax.scan`.
    """
    _PYTREES.append((cls, data_fields, meta_fields))
    if not _register_pending():
        _watch_jax_import()


def _register_pending() -> bool:
    """Register the pending pytrees if JAX is imported; whether it is."""
    jax = sys.modules.get("jax")
    tree_util = getattr(jax, "tree_util", None)
    if tree_util is None:
        return False
    while _PYTREES:
        cls, data_fields, meta_fields = _PYTREES.pop(0)
        tree_util.register_dataclass(cls, data_fields=list(data_fields),
                                     meta_fields=list(meta_fields))
    return True


class _JaxImportHook(importlib.abc.MetaPathFinder):
    """Finds ``jax`` with the other finders and registers the pending pytrees once its
    module has run; then it leaves ``sys.meta_path``. (A mere lookup,
    ``importlib.util.find_spec("jax")``, runs no module: the hook stays for the import.)"""

    searching = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "jax" or self.searching:
            return None
        self.searching = True  # the other finders, not this one again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            if _register_pending() and self in sys.meta_path:
                sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _watch_jax_import() -> None:
    if not any(isinstance(finder, _JaxImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _JaxImportHook())


def host_to_device(xp: Any, host: np.ndarray, *, dtype: Any, device: Any) -> Array:
    """Move a NumPy array (drawn on the host) into namespace ``xp`` on ``device``."""
    if array_api_compat.is_torch_namespace(xp):
        import torch

        # torch cannot read float64 NumPy into bfloat16 on every device in one step; a
        # read-only array (a broadcast view) is copied first, as torch warns on one
        return torch.as_tensor(np.require(host, requirements="W"), device=device).to(dtype)
    if array_api_compat.is_jax_namespace(xp):
        import jax

        return jax.device_put(xp.asarray(host, dtype=dtype), device)
    return xp.asarray(host, dtype=dtype, device=device)


def qr(xp: Any, a: Array) -> tuple[Array, Array]:
    """Reduced QR of a stack of square matrices ``a`` (..., D, D).

    Uses ``xp.linalg.qr`` where the namespace has it for square stacks; Dask (whose
    QR is tall-and-skinny only) applies NumPy's QR lazily to these small matrices
    (``array_api_extra.lazy_apply``), so no graph is computed here.
    """
    if array_api_compat.is_dask_namespace(xp):
        return xpx.lazy_apply(np.linalg.qr, a, shape=(a.shape, a.shape),
                              dtype=(a.dtype, a.dtype), as_numpy=True, xp=xp)
    return xp.linalg.qr(a)


def index_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous segments of ``total`` items, differing by at most one."""
    base, extra = divmod(operator.index(total), operator.index(parts))
    return [base + 1 if i < extra else base for i in range(parts)]


def one_chunk_along(x: Array, axis: int) -> Array:
    """``x`` with the whole of a short ``axis`` in one chunk (Dask); other arrays unchanged.

    For small per-proposal arrays (LARA's C landmarks) that every block of the sequence
    needs: Dask would otherwise keep one chunk per landmark, and every product with a
    chunked sequence would multiply the number of tasks by C. Never use it on a sequence
    axis: it would gather the whole sequence into one block.
    """
    if array_api_compat.is_dask_array(x):
        return x.rechunk({axis % x.ndim: -1})
    return x


def chunked_like(x: Array, like: Array, axis: int) -> Array:
    """``x`` in the chunks of ``like`` along ``axis`` (Dask, where both are chunked there
    with the same length); other arrays unchanged. For per-query flags computed along the
    keys, so that combining them with a result keeps the result's chunks."""
    if (array_api_compat.is_dask_array(x) and array_api_compat.is_dask_array(like)
            and x.shape[axis] == like.shape[axis] and x.shape[axis] > 1):
        return x.rechunk({axis % x.ndim: like.chunks[axis]})
    return x


def take(x: Array, indices: list[int], axis: int) -> Array:
    """``x`` at the positions ``indices`` along ``axis`` (``xp.take``); on Dask with the
    indices in memory, so that the chunks of the result stay known."""
    if array_api_compat.is_dask_array(x):
        import dask.array as da

        return da.take(x, np.asarray(indices), axis=axis % x.ndim)
    xp = array_api_compat.array_namespace(x)
    return xp.take(x, xp.asarray(indices, device=array_api_compat.device(x)), axis=axis)


def stream_bounds(x: Array, axis: int, chunk_size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the pieces of ``x`` along ``axis`` that an estimator streams
    through one at a time (bounded working memory).

    Pieces of ``chunk_size`` for arrays computed eagerly. A Dask array is one piece: Dask
    already computes it chunk by chunk, and keeping its chunks in the result keeps it
    lazy and laid out like the inputs.
    """
    length = x.shape[axis]
    if array_api_compat.is_dask_array(x) or length <= chunk_size:
        return [(0, length)]
    return [(start, min(start + chunk_size, length)) for start in range(0, length, chunk_size)]


def sequence_positions(x: Array, axis: int = -2) -> Array:
    """Integer positions ``0 .. x.shape[axis] - 1`` on the device of ``x``.

    On Dask they are chunked like ``x`` along ``axis``, so masks built from them (causal
    masks) stay aligned with the chunks of the sequence instead of forming one block.
    """
    length = x.shape[axis]
    if array_api_compat.is_dask_array(x):
        import dask.array as da

        return da.arange(length, chunks=(x.chunks[axis],))
    xp = array_api_compat.array_namespace(x)
    return xp.arange(length, device=array_api_compat.device(x))


def concrete_count(xp: Any, flags: Array) -> int | None:
    """Number of True entries of ``flags`` if it can be read without extra work.

    Returns None for a lazy Dask array (reading it would compute the graph again) and for
    a traced JAX array (inside :func:`jax.jit` values do not exist yet).
    """
    if array_api_compat.is_dask_array(flags):
        return None
    try:
        return int(xp.sum(xp.astype(flags, xp.int32)))
    except TypeError:  # jax.errors.ConcretizationTypeError is a TypeError
        return None


def written_in_place(x: Array) -> bool:
    """Whether results like ``x`` are assembled by writing into them: NumPy and CuPy.

    Not JAX (immutable arrays: every write would copy the whole result), torch (autograd
    would record a copy of the whole gradient per written block, and ``torch.func``
    transforms reject writes of batched values into an unbatched result), Dask (a graph,
    kept lazy) or array-api-strict (a test namespace, kept on the portable path).
    """
    return array_api_compat.is_numpy_array(x) or array_api_compat.is_cupy_array(x)


def append_ones_column(x: Array) -> Array:
    """``x`` (..., F) with a column of ones appended, (..., F + 1): torch's own ``pad`` on
    torch (one operation, which ``torch.compile`` traces without a warning), elsewhere a
    concatenation with ``ones_like`` of a column of ``x`` (on Dask chunked like ``x``;
    :func:`array_api_extra.pad` builds one block there)."""
    if array_api_compat.is_torch_array(x):
        import torch

        return torch.nn.functional.pad(x, (0, 1), value=1.0)
    xp = array_api_compat.array_namespace(x)
    return xp.concat([x, xp.ones_like(x[..., :1])], axis=-1)


def stop_gradient(x: Array) -> Array:
    """``x`` held constant by autograd (torch, JAX): a stabilizing shift, which cancels.
    A torch tensor that autograd does not track is returned as it is (no operation)."""
    if array_api_compat.is_jax_array(x):
        import jax

        return jax.lax.stop_gradient(x)
    if array_api_compat.is_torch_array(x) and x.requires_grad:
        return x.detach()
    return x


CPU_WORKING_MEMORY = 64 * 2**20
"""Default working memory of one estimator call on a CPU, in bytes (64 MiB: a block of
intermediates that stays near the caches; the full-size memory bars of the estimators
leave room for it)."""

GPU_WORKING_MEMORY = 2**30
"""Default working memory of one estimator call on a GPU, in bytes (1 GiB: generous, so
that calls are a fixed, small number of kernel launches up to long sequences)."""


def default_working_memory(x: Array) -> int:
    """The working memory, in bytes, that an estimator call may use when the caller does
    not say (``working_memory=None``).

    The causal scan of :func:`xattn.rfa` and :func:`xattn.lara` (and ``window``/``sinks``)
    processes as many positions at once as this budget allows, the whole sequence when it
    fits: then one call is a fixed, small number of array operations (kernel launches on a
    GPU) at any length. Past the budget it walks the sequence in blocks, so its memory
    stays bounded.

    Parameters
    ----------
    x : array
        An input of the call; its library and device decide.

    Returns
    -------
    int
        1 GiB on a GPU (torch CUDA or ROCm, CuPy, JAX on a GPU), 64 MiB elsewhere (a
        CPU: intermediates near the caches, and room under the estimators' memory bars).

    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> xattn.default_working_memory(np.zeros(3)) // 2**20
    64
    """
    if array_api_compat.is_cupy_array(x):
        return GPU_WORKING_MEMORY
    if array_api_compat.is_torch_array(x):
        return CPU_WORKING_MEMORY if x.device.type == "cpu" else GPU_WORKING_MEMORY
    if array_api_compat.is_jax_array(x):
        import jax

        try:
            platform = next(iter(x.devices())).platform
        except Exception:  # a tracer under jax.jit has no devices: the default backend's
            platform = jax.default_backend()
        return CPU_WORKING_MEMORY if platform == "cpu" else GPU_WORKING_MEMORY
    return CPU_WORKING_MEMORY


def nan_to_num(x: Array, *, nan: float, posinf: float, neginf: float) -> Array:
    """``x`` with NaN, ``+inf`` and ``-inf`` entries replaced by ``nan``, ``posinf`` and
    ``neginf``: the library's ``nan_to_num`` where it has one (one operation, whose
    gradient is zero at the replaced entries), ``where`` elsewhere."""
    if array_api_compat.is_torch_array(x):
        import torch

        return torch.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)
    if array_api_compat.is_jax_array(x):
        import jax.numpy as jnp

        return jnp.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)
    if array_api_compat.is_numpy_array(x) or array_api_compat.is_cupy_array(x):
        module = np if array_api_compat.is_numpy_array(x) else importlib.import_module("cupy")
        return module.nan_to_num(x, copy=True, nan=nan, posinf=posinf, neginf=neginf)
    xp = array_api_compat.array_namespace(x)
    x = xp.where(xp.isnan(x), nan, x)
    return xp.where(x == xp.inf, posinf, xp.where(x == -xp.inf, neginf, x))


def nonfinite_rows(*arrays: Array) -> Array:
    """Boolean (..., L): whether row ``i`` of any of ``arrays`` (each (..., L, ·), their
    leading dims broadcasting) holds a NaN or an infinity.

    On torch and JAX: ``isnan`` of the sum over the arrays of ``sum(x * 0)`` along each
    row (:func:`nonfinite_probe`: two operations per array, then one more per array and
    one ``isnan``). Elsewhere ``not all(isfinite(x))``, whose only temporary is one
    boolean per entry (NumPy would make ``x * 0`` a float copy of the input).
    """
    xp = array_api_compat.array_namespace(*arrays)
    if all(array_api_compat.is_torch_array(x) or array_api_compat.is_jax_array(x)
           for x in arrays):
        probe = nonfinite_probe(arrays[0])
        for x in arrays[1:]:
            probe = probe + nonfinite_probe(x)
        return xp.isnan(probe[..., 0])
    bad = ~xp.all(xp.isfinite(arrays[0]), axis=-1)
    for x in arrays[1:]:
        bad = bad | ~xp.all(xp.isfinite(x), axis=-1)
    return bad


def cumulative_max(x: Array, axis: int) -> Array:
    """The running maximum of ``x`` along ``axis``: ``max(x[..., :i + 1])`` at ``i``.

    The standard has no cumulative maximum, so this delegates to the library's own where it
    has one (``torch.cummax``, ``jax.lax.cummax``, ``numpy.maximum.accumulate``), one
    operation; elsewhere (CuPy, whose ``maximum`` has no ``accumulate``; Dask,
    array-api-strict) it doubles: ``ceil(log2(L))`` steps of shift and ``maximum``. NaN
    propagates in every form.
    """
    axis = axis % x.ndim
    if array_api_compat.is_torch_array(x):
        import torch

        return torch.cummax(x, dim=axis).values
    if array_api_compat.is_jax_array(x):
        import jax

        return jax.lax.cummax(x, axis=axis)
    if array_api_compat.is_numpy_array(x):
        return np.maximum.accumulate(x, axis=axis)
    xp = array_api_compat.array_namespace(x)
    length, step = x.shape[axis], 1
    while step < length:
        shape = list(x.shape)
        shape[axis] = step
        fill = xp.full(tuple(shape), -xp.inf, dtype=x.dtype, device=array_api_compat.device(x))
        kept = [slice(None)] * x.ndim
        kept[axis] = slice(0, length - step)
        x = xp.maximum(x, xp.concat([fill, x[tuple(kept)]], axis=axis))
        step *= 2
    return one_chunk_along(x, axis)  # Dask: not a chunk per step


def split_rows(x: Array, size: int) -> list[Array]:
    """``x`` in pieces of ``size`` rows along axis -2: one operation for torch's and JAX's
    autograd (a slice's backward is a gradient of all of ``x``, zero-filled), else views."""
    if array_api_compat.is_torch_array(x):
        return list(x.split(size, dim=-2))
    bounds = list(range(size, x.shape[-2], size))
    if array_api_compat.is_jax_array(x):
        return list(array_api_compat.array_namespace(x).split(x, bounds, axis=-2))
    return [x[..., a:b, :] for a, b in zip([0, *bounds], [*bounds, x.shape[-2]], strict=True)]


def has_native_attention(inputs: AttentionInputs, *, automatic: bool = False) -> bool:
    """Whether :func:`native_attention` has a fused kernel for ``inputs``: torch tensors;
    JAX arrays with ``Dv = D`` not in float64 (jax.nn's kernel forms float32 logits), and
    with ``automatic`` not on a CPU backend."""
    q = inputs.q
    if array_api_compat.is_torch_array(q):
        return True
    if not (array_api_compat.is_jax_array(q) and inputs.v.shape[-1] == q.shape[-1]
            and inputs.compute_dtype != inputs.xp.float64):
        return False
    if automatic:
        import jax
        return jax.default_backend() != "cpu"
    return True


def host_namespace() -> Any:
    """The Array API namespace of the host's arrays (array-api-compat's NumPy)."""
    return array_api_compat.array_namespace(np.empty(0))


def nonfinite_probe(x: Array) -> Array:
    """(..., 1): 0 where the row ``x[..., i, :]`` is finite, NaN where one of its entries
    is NaN or infinite: ``sum(x * 0)``, two operations (on NumPy without its warning
    about ``inf * 0``)."""
    xp = array_api_compat.array_namespace(x)
    if array_api_compat.is_numpy_array(x):
        with np.errstate(invalid="ignore"):
            return np.sum(x * 0.0, axis=-1, keepdims=True)
    if array_api_compat.is_dask_array(x) or array_api_compat.is_array_api_strict_namespace(xp):
        # NumPy underneath, computed elsewhere: the same values without its warning
        return xp.sum(xp.where(xp.isfinite(x), xp.zeros_like(x), xp.nan), axis=-1,
                      keepdims=True)
    return xp.sum(x * 0.0, axis=-1, keepdims=True)


def native_attention(inputs: AttentionInputs, causal: bool, *, automatic: bool = False,
                     every_query_has_a_key: bool = False) -> Array | None:
    """Exact softmax attention by the array library's fused kernel, or None where it has
    none: ``torch.nn.functional.scaled_dot_product_attention`` for torch tensors,
    ``jax.nn.dot_product_attention`` for JAX arrays in float32 (it requires ``Dv = D`` and
    forms float32 logits, so float64 stays on the portable path).

    The contract of :func:`xattn.softmax_attention` holds: the masks combine (a
    ``key_mask`` stays ``(..., 1, M)``; with ``causal`` too, one ``(..., N, M)`` boolean
    mask is built), causal masking is top-left, and a query with no allowed key gets a
    zero row whose gradient is finite (it attends every key inside the kernel, and its
    row is then replaced by zeros). Half-precision inputs reach the kernel in their own
    dtype (the fused kernels accumulate in float32 themselves, and only there do torch's
    FlashAttention and cuDNN kernels run); the result is in the compute dtype.

    ``automatic`` (the choice of ``implementation=None``) also returns None for JAX on a
    CPU backend, where XLA's kernel forms the whole (N, M) score matrix and measured about
    twice the time of the portable loop (``benchmarks/bench_native_softmax.py``).
    ``every_query_has_a_key`` (the caller knows it from the shapes and options, such as
    a decoding step whose own key is unmasked) leaves out the zero rows' operations.
    """
    if not has_native_attention(inputs, automatic=automatic):
        return None
    xp, q, k, v = inputs.xp, inputs.q, inputs.k, inputs.v
    is_torch = array_api_compat.is_torch_array(q)
    batch, num_queries, num_keys = inputs.batch_shape, q.shape[-2], k.shape[-2]
    q, k, v = (x if tuple(x.shape[:-2]) == tuple(batch)
               else xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    mask = None if inputs.key_mask is None else inputs.key_mask[..., None, :]  # (..., 1, M)
    if causal and mask is not None:  # one (..., N, M) mask: the native kernels take one
        queries = xp.arange(num_queries, device=inputs.device)[:, None]
        mask = mask & (queries >= xp.arange(num_keys, device=inputs.device)[None, :])
    has_keys = None  # per query (or per batch entry): any allowed key
    if mask is not None and not every_query_has_a_key:
        has_keys = xp.any(mask, axis=-1, keepdims=True)
        mask = xp.broadcast_to(mask | ~has_keys, (*batch, mask.shape[-2], num_keys))
    # both kernels take 4-D inputs, every leading dim flattened into one batch of one head:
    # torch's fused CPU kernel runs only on 4-D inputs (other ranks fall back to forming
    # the whole score matrix), and jax.nn wants (B, T, heads, H)
    flat = math.prod(batch)
    if inputs.dtype != inputs.compute_dtype:  # half precision: exact, back to the caller's
        q, k, v = (xp.astype(x, inputs.dtype) for x in (q, k, v))
    out: Array
    # (B, H, ·, ·) is 4-D already: torch takes it as it is
    four_d = is_torch and len(batch) == 2
    flat_mask = mask if mask is None or four_d else xp.reshape(
        mask, (flat, 1, *mask.shape[-2:]))
    if is_torch:
        import torch
        if not four_d:
            q, k, v = (xp.reshape(x, (flat, 1, *x.shape[-2:])) for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=flat_mask, is_causal=causal and mask is None,
            scale=inputs.scale)
    else:
        import jax
        q, k, v = (xp.reshape(x, (flat, x.shape[-2], 1, x.shape[-1])) for x in (q, k, v))
        out = jax.nn.dot_product_attention(q, k, v, mask=flat_mask, scale=inputs.scale,
                                           is_causal=causal and mask is None)
    if not four_d:
        out = xp.reshape(out, (*batch, num_queries, v.shape[-1]))
    if out.dtype != inputs.compute_dtype:
        out = xp.astype(out, inputs.compute_dtype)
    return out if has_keys is None else xp.where(has_keys, out, xp.zeros_like(out))


def take_rows(x: Array, indices: Array) -> Array:
    """``x[indices]`` along axis 0 for nonnegative integer ``indices`` (1-D): ``xp.take``.

    On torch one ``index_select``: array_api_compat's ``take`` first maps negative indices
    (three more operations, kernel launches on a GPU, on every call).
    """
    if array_api_compat.is_torch_array(x):
        import torch

        return torch.index_select(x, 0, indices)
    return array_api_compat.array_namespace(x).take(x, indices, axis=0)
