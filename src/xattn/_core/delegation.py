"""Native fast paths of single operations, each beside its portable Array API form.

As array-api-extra's delegation layer: a function here computes one thing (a QR
factorization, the probes that find non-finite rows, a running maximum, exact attention by
the library's fused kernel, ...) with the library's own function where it has one (torch,
JAX, CuPy, Dask) and with the standard otherwise, and gives the same result either way.
The estimators call these and never branch on the library themselves."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import math
from typing import Any

import array_api_compat
import array_api_extra as xpx
import numpy as np

from xattn._core import torch_autograd
from xattn._core.array import Array, one_chunk_along, torch_compiling
from xattn._core.inputs import AttentionInputs
from xattn._core.torch_autograd import neighbour_slices

__all__ = ["append_column", "append_ones_column", "clip_below", "cumulative_max",
           "has_native_attention", "ignore_invalid", "matmul_add",
           "nan_to_num",
           "native_attention", "neighbour_scores", "neighbour_sums", "nonfinite_probe",
           "nonfinite_rows", "qr",
           "ratio_to_last_column", "squared_norms",
           "stop_gradient"]


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

def append_ones_column(x: Array, rows_after: int = 0) -> Array:
    """``x`` (..., F) with a column of ones appended, (..., F + 1), and ``rows_after`` rows
    of ones after its rows (axis -2; the padding of a block to whole chunks, values of
    keys that take no part): torch's own ``pad`` on torch (one operation, which
    ``torch.compile`` traces without a warning), elsewhere a concatenation with
    ``ones_like`` of a column of ``x`` (on Dask chunked like ``x``;
    :func:`array_api_extra.pad` builds one block there)."""
    return append_column(x, 1.0, rows_after)


def append_column(x: Array, value: bool | float, rows_after: int = 0) -> Array:
    """``x`` (..., F) with a column of ``value`` appended, (..., F + 1), in ``x``'s dtype
    (a boolean ``x`` takes ``True``/``False``), and ``rows_after`` rows of ``value``
    after its rows: as :func:`append_ones_column`."""
    if array_api_compat.is_torch_array(x):
        import torch

        return torch.nn.functional.pad(x, (0, 1, 0, rows_after), value=float(value))
    xp = array_api_compat.array_namespace(x)
    column = xp.zeros_like(x[..., :1]) if not value else xp.ones_like(x[..., :1])
    return _zero_rows_after(xp.concat([x, column], axis=-1), rows_after, value)

def stop_gradient(x: Array) -> Array:
    """``x`` held constant by autograd (torch, JAX): a stabilizing shift, which cancels.
    A torch tensor that autograd does not track is returned as it is (no operation)."""
    if array_api_compat.is_jax_array(x):
        import jax

        return jax.lax.stop_gradient(x)
    if array_api_compat.is_torch_array(x) and x.requires_grad:
        return x.detach()
    return x

def matmul_add(x: Array, matrix: Array, addend: Array) -> Array:
    """``x @ matrix + addend``: ``x`` (..., N, D), ``matrix`` (D, S) or (..., D, S),
    ``addend`` (..., N or 1, S or 1) or (N or 1, S or 1), the first two with the leading
    dims of ``x``. torch: one
    ``baddbmm``, which writes the (N, S) result once (a product and an addition write it
    twice); elsewhere the two operations, which XLA fuses."""
    lead = tuple(x.shape[:-2])
    if (array_api_compat.is_torch_array(x) and x.ndim >= 3
            and tuple(addend.shape[:-2]) in (lead, ())
            and (matrix.ndim == 2 or tuple(matrix.shape[:-2]) == lead)):
        import torch

        batch = math.prod(lead)
        matrices = (matrix.expand(batch, *matrix.shape) if matrix.ndim == 2
                    else matrix.reshape(batch, *matrix.shape[-2:]))
        out = torch.baddbmm(addend.reshape(-1 if addend.ndim > 2 else 1, *addend.shape[-2:]),
                            x.reshape(batch, *x.shape[-2:]), matrices)
        return out.reshape(*lead, x.shape[-2], matrix.shape[-1])
    return x @ matrix + addend


def _tracks_gradients(*arrays: Array | None) -> bool:
    """torch tensors of which one needs a gradient, outside ``torch.compile`` (which fuses
    the portable form itself)."""
    import torch

    return (any(x is not None and x.requires_grad for x in arrays)
            and not torch.compiler.is_compiling())


def _writes_in_place_safely(x: Array) -> bool:
    """Whether a write in place into the new array ``x`` is seen by every later reader:
    NumPy, and eager torch when autograd does not track ``x``."""
    if array_api_compat.is_numpy_array(x):
        return True
    if array_api_compat.is_torch_array(x):
        import torch

        return not (x.requires_grad or torch.compiler.is_compiling())
    return False


def _portable_neighbour_scores(queries: Array, keys: Array, neighbours: tuple[int, ...],
                               biases: tuple[Array | None, ...], period: int) -> tuple[Array, ...]:
    """:func:`neighbour_scores` by the standard's slices and products; the pairs across
    two sequences set to ``-inf`` in place where nothing can reorder the write (NumPy, and
    eager torch with no gradient to track), elsewhere by a ``where`` on the chunks'
    positions, which a compiler fuses into the product's consumer (no write in place
    into an array that autograd or a compiled graph may still read)."""
    xp = array_api_compat.array_namespace(queries, keys)
    scores = []
    for neighbour, bias in zip(neighbours, biases, strict=True):
        rows, key_rows = neighbour_slices(queries.shape[0], neighbour)
        product = (queries[rows, ...], xp.matrix_transpose(keys[key_rows, ...]))
        piece = product[0] @ product[1] if bias is None else matmul_add(*product, bias)
        if neighbour:  # chunk (l + 1) * period - 1 of the piece pairs two sequences
            if _writes_in_place_safely(piece):
                piece[period - 1::period, ...] = -math.inf  # a new array: written in place
            else:
                chunk = xp.arange(piece.shape[0], device=array_api_compat.device(piece))
                crosses = xp.reshape(chunk % period == period - 1, (-1, 1, 1))
                piece = xp.where(crosses, xp.asarray(-math.inf, dtype=piece.dtype), piece)
        scores.append(piece)
    return tuple(scores)


def neighbour_scores(queries: Array, keys: Array, neighbours: tuple[int, ...],
                     biases: tuple[Array | None, ...], period: int) -> tuple[Array, ...]:
    """Each chunk's queries against the keys of a neighbouring chunk.

    ``queries`` and ``keys`` (C, s, D) are sequences of ``period`` chunks one after
    another. For each ``d`` of ``neighbours`` (0 first) and its ``bias`` ((s, s) or None):
    the scores ``queries[c] @ keys[c + d].T + bias`` of the chunks ``c`` whose neighbour
    ``c + d`` is one of the ``C`` chunks, ``(C - |d|, s, s)``, ``-inf`` where ``c + d``
    is in another sequence than ``c`` (no value of another sequence, not even an
    overflow, reaches a row). torch, with a gradient to track: one operation whose
    backward writes the gradients of ``queries`` and ``keys`` once, adding each
    neighbour's rows in place (autograd would write each slice's gradient again in full,
    and add them); elsewhere the slices and the products."""
    if array_api_compat.is_torch_array(queries) and _tracks_gradients(queries, keys):
        return torch_autograd.neighbour_functions()[0].apply(queries, keys, neighbours, period,
                                                     *biases)
    return _portable_neighbour_scores(queries, keys, neighbours, biases, period)


def neighbour_sums(weights: tuple[Array, ...], values: Array, neighbours: tuple[int, ...],
                   base: Array | None) -> Array:
    """``base + sum_d weights_d @ values[c + d]`` over the chunks' neighbours.

    ``weights`` as :func:`neighbour_scores` gives the scores (``d = 0`` first, covering
    every chunk), ``values`` (C, s, F), ``base`` (C, s, F) or None: (C, s, F). torch, with
    a gradient to track: one operation that adds each neighbour's products in place,
    forward and backward (autograd would join the rows and write each slice's gradient
    in full); elsewhere the products, added and joined."""
    if array_api_compat.is_torch_array(values) and _tracks_gradients(values, base, *weights):
        return torch_autograd.neighbour_functions()[1].apply(values, base, neighbours, *weights)
    xp = array_api_compat.array_namespace(values)
    out = weights[0] @ values if base is None else matmul_add(weights[0], values, base)
    compiling = array_api_compat.is_torch_array(values) and torch_compiling()
    for neighbour, piece in zip(neighbours[1:], weights[1:], strict=True):
        rows, key_rows = neighbour_slices(values.shape[0], neighbour)
        if compiling:  # padded to every chunk and added: one pass that inductor fuses,
            # where joining the rows copies each piece in a kernel of its own
            widths = [(rows.start, values.shape[0] - rows.stop), (0, 0), (0, 0)]
            out = out + xpx.pad(piece @ values[key_rows, ...], widths, xp=xp)
            continue
        added = matmul_add(piece, values[key_rows, ...], out[rows, ...])
        out = xp.concat([out[:rows.start, ...], added, out[rows.stop:, ...]], axis=0)
    return out


def squared_norms(x: Array, dtype: Any = None, *, factor: float = 1.0) -> Array:
    """(..., L, 1): ``factor`` times the squared Euclidean norms of the rows of ``x``
    (..., L, F), in ``dtype`` (None: that of ``x``). torch, eagerly: ``linalg.vector_norm``
    (one pass writing one number per row; its gradient at a zero row is 0), squared and
    scaled; under ``torch.compile``: ``sum(square(x) * factor)``, one reduction (inductor's
    C++ backend cannot join a norm's square root, square and scale, kernels over the rows,
    to the reduction's loop); elsewhere ``factor * sum(x * x)``, which XLA fuses."""
    xp = array_api_compat.array_namespace(x)
    is_torch = array_api_compat.is_torch_array(x)
    if is_torch and not torch_compiling():
        import torch

        norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=dtype)
        return norms * norms if factor == 1.0 else (norms * norms) * factor
    if dtype is not None and x.dtype != dtype:
        x = xp.astype(x, dtype)
    if is_torch:  # compiling
        return xp.sum(x.square() * factor, axis=-1, keepdims=True)
    sums = xp.sum(x * x, axis=-1, keepdims=True)
    return sums if factor == 1.0 else factor * sums


def nan_to_num(x: Array, *, nan: float, posinf: float, neginf: float,
               rows_after: int = 0) -> Array:
    """``x`` with NaN, ``+inf`` and ``-inf`` entries replaced by ``nan``, ``posinf`` and
    ``neginf``: the library's ``nan_to_num`` where it has one (one operation, whose
    gradient is zero at the replaced entries; on Dask one task per chunk), ``where``
    elsewhere. ``rows_after`` rows of zeros are appended along axis -2 (the padding of a
    block of positions to whole chunks).

    torch, eagerly: the result written once, padding rows included (no padded copy of
    it); with finite replacements and a gradient to track, a ``nan_to_num`` whose backward
    is one ``where`` on the mask ``out == x`` (true exactly at the entries kept), made in
    the backward pass; torch's own derivative forms ``isfinite(x)`` (an ``abs`` and three
    boolean passes) and a product. Under ``torch.compile``, which fuses those passes and
    the padding: ``where(isfinite(x), x, value)`` when the three replacements are one
    value (inductor computes the mask once, in the kernel that reads ``x``, where
    ``nan_to_num``'s backward asked for a kernel of its own on some paths; forward plus
    backward in float32, 1 kernel fewer in causal ``rfa``, 2 fewer with a window, 1 more
    in ``rfa`` and ``lara``, whose mask of the values becomes a kernel of its own), else
    torch's own."""
    if array_api_compat.is_torch_array(x):
        import torch

        if torch.compiler.is_compiling():
            if rows_after:
                x = torch.nn.functional.pad(x, (0, 0, 0, rows_after))
            if nan == posinf == neginf:  # one mask for the forward and the backward,
                return torch.where(torch.isfinite(x), x, nan)  # fused with its reads
            return torch.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)
        if x.requires_grad and all(math.isfinite(value) for value in (nan, posinf, neginf)):
            return torch_autograd.nan_to_num_function().apply(x, nan, posinf, neginf,
                                                              rows_after)
        return torch_autograd.padded_nan_to_num(x, nan, posinf, neginf, rows_after)
    return _zero_rows_after(_nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf), rows_after)


def _nan_to_num(x: Array, *, nan: float, posinf: float, neginf: float) -> Array:
    """:func:`nan_to_num` on every library but torch, without padding."""
    if array_api_compat.is_jax_array(x):
        import jax.numpy as jnp

        return jnp.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)
    if array_api_compat.is_numpy_array(x) and np.isfinite(x).all():
        # NumPy computes eagerly: a finite array (the common case) costs one read and a
        # copy, where nan_to_num makes a pass per kind of value (measured 7 + 10 against
        # 87 us on (1024, 64) float32)
        return x.copy()
    if array_api_compat.is_numpy_array(x) or array_api_compat.is_cupy_array(x):
        module = np if array_api_compat.is_numpy_array(x) else importlib.import_module("cupy")
        return module.nan_to_num(x, copy=True, nan=nan, posinf=posinf, neginf=neginf)
    if array_api_compat.is_dask_array(x):
        # one task per chunk (NumPy's, which dispatches to a chunk's own library), where
        # the ``where`` below builds six layers
        return importlib.import_module("dask.array").map_blocks(
            np.nan_to_num, x, nan=nan, posinf=posinf, neginf=neginf, dtype=x.dtype)
    xp = array_api_compat.array_namespace(x)
    x = xp.where(xp.isnan(x), nan, x)
    return xp.where(x == xp.inf, posinf, xp.where(x == -xp.inf, neginf, x))


def _zero_rows_after(x: Array, rows_after: int, fill: float = 0.0) -> Array:
    """``x`` (..., L, F) with ``rows_after`` rows of ``fill`` appended along axis -2."""
    if not rows_after:
        return x
    xp = array_api_compat.array_namespace(x)
    rows = xp.full((*x.shape[:-2], rows_after, x.shape[-1]), fill, dtype=x.dtype,
                   device=array_api_compat.device(x))
    return one_chunk_along(xp.concat([x, rows], axis=-2), -2)

def ratio_to_last_column(x: Array, floor: float) -> Array:
    """``x[..., :-1] / max(x[..., -1:], floor)``: numerators over the denominator in the
    last column (the sums of an estimator's read-out, with ``floor`` a tiny positive
    bound, so a row without keys gives 0 / floor = 0).

    torch, with a gradient to track: one operation whose backward writes the gradient of
    ``x`` once (the numerators' part divided in place, the denominators' from one dot
    product per row); torch's own derivative of the two slices and the division writes
    five arrays of that size. Elsewhere, and under ``torch.compile``, which fuses them,
    the slices and the division."""
    if array_api_compat.is_torch_array(x):
        import torch

        if x.requires_grad and not torch.compiler.is_compiling():
            return torch_autograd.ratio_to_last_column_function().apply(x, floor)
    return x[..., :-1] / clip_below(x[..., -1:], floor)


def nonfinite_rows(*arrays: Array) -> Array:
    """Boolean (..., L): whether row ``i`` of any of ``arrays`` (each (..., L, ·), their
    leading dims broadcasting) holds a NaN or an infinity.

    On torch: not ``isfinite`` of the arrays' scaled row sums (one matrix product per
    array, writing one number per row). On JAX: ``isnan`` of the sum over the arrays of
    ``sum(x * 0)`` (:func:`nonfinite_probe`, which XLA fuses). Elsewhere ``not
    all(isfinite(x))``, whose only temporary is one boolean per entry (NumPy would make
    ``x * 0`` a float copy of the input).
    """
    xp = array_api_compat.array_namespace(*arrays)
    if all(array_api_compat.is_torch_array(x) for x in arrays):
        sums = _scaled_row_sums(arrays[0])
        for x in arrays[1:]:
            sums = sums + _scaled_row_sums(x)
        return ~xp.isfinite(sums)
    if all(array_api_compat.is_jax_array(x) for x in arrays):
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

    Under ``torch.compile`` torch doubles too: with ``torch.cummax`` (or a masked largest
    entry) in the chunk scan of the window band's random features, inductor's generated
    code gave wrong values for inputs that require grad at ragged lengths (torch 2.13 on
    the CPU; eager and ``aot_eager`` right), and the doubling's steps are a few
    elementwise maxima.
    """
    axis = axis % x.ndim
    if array_api_compat.is_torch_array(x):
        import torch

        if not torch.compiler.is_compiling():
            return torch.cummax(x, dim=axis).values
        length, step = x.shape[axis], 1
        while step < length:  # shifts by padding, which inductor fuses with the maxima
            pad = [0, 0] * (x.ndim - 1 - axis) + [step, 0]
            shifted = torch.nn.functional.pad(torch.narrow(x, axis, 0, length - step), pad,
                                              value=-math.inf)
            x = torch.maximum(x, shifted)
            step *= 2
        return x
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

def clip_below(x: Array, minimum: float) -> Array:
    """``max(x, minimum)`` elementwise, NaN kept: ``clip(x, min=minimum)``, one operation
    (no 0-d array made for the bound: on torch that is an operation of its own); on Dask
    ``maximum`` with a 0-d array, since Dask's ``clip`` broadcasts its bound to one block
    as long as every row of ``x``."""
    xp = array_api_compat.array_namespace(x)
    if array_api_compat.is_dask_array(x):
        return xp.maximum(x, xp.asarray(minimum, dtype=x.dtype))
    return xp.clip(x, min=minimum)


def ignore_invalid(xp: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which NumPy computes ``inf - inf`` and ``inf * 0`` as NaN, and an
    overflow as ``inf``, without its ``RuntimeWarning`` (how a non-finite input reaches
    its rows, and how a finite key's overflowing squared norm reaches
    :func:`~xattn._core.primitives.key_logits_in_range`); no operation elsewhere."""
    if array_api_compat.is_numpy_namespace(xp):
        return np.errstate(invalid="ignore", over="ignore")
    return contextlib.nullcontext()


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


def _scaled_row_sums(x: Any) -> Any:
    r"""torch (..., L): the rows' sums times the power of two :math:`2^{-k} \le 1/(2D)`, by
    one matrix product: not finite exactly where the row holds a NaN or an infinity (they
    propagate; a finite row's sum cannot overflow), and one number per row written rather
    than a copy of ``x`` (a product with zeros would not do: a BLAS may skip zero
    factors)."""
    import torch

    factor = 2.0 ** -(2 * max(x.shape[-1], 1) - 1).bit_length()
    column = torch.full((x.shape[-1], 1), factor, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        return (x @ column)[..., 0]

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
    twice the time of the portable loop (``benchmarks/ops/bench_native_softmax.py``).
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
