"""torch autograd Functions behind the single-pass fast paths of
:mod:`xattn._core.delegation`.

Each writes what it computes once, forward and backward, where autograd's derivative of
the portable form writes the same arrays several times (slices expanded back to their
whole array, then added). Each is built on its first use (torch is imported then, never
by importing this module), and is used only while a gradient is tracked outside
``torch.compile``, which fuses the portable form itself; a graph of the backward
(``create_graph``) is traced without writes in place.
"""

from __future__ import annotations

import functools
import math
from typing import Any

__all__ = ["nan_to_num_function", "neighbour_functions", "neighbour_slices",
           "padded_nan_to_num", "ratio_to_last_column_function"]


@functools.cache
def nan_to_num_function() -> Any:
    """The autograd Function of :func:`~xattn._core.delegation.nan_to_num`."""
    import torch

    class NanToNum(torch.autograd.Function):
        @staticmethod
        def forward(x: Any, nan: float, posinf: float, neginf: float, rows_after: int) -> Any:
            return padded_nan_to_num(x, nan, posinf, neginf, rows_after)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.save_for_backward(inputs[0], output)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, out = ctx.saved_tensors
            rows = x.shape[-2]
            if out.shape[-2] != rows:  # the appended rows have no gradient to pass on
                out, grad = out[..., :rows, :], grad[..., :rows, :]
            return torch.where(out == x, grad, 0.0), None, None, None, None

    return NanToNum


def padded_nan_to_num(x: Any, nan: float, posinf: float, neginf: float,
                      rows_after: int) -> Any:
    """``torch.nan_to_num(x)`` (..., L, F) with ``rows_after`` rows of zeros appended along
    axis -2, written once: into the rows of a new array (no padded copy made after it)."""
    import torch

    if not rows_after:
        return torch.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)
    rows = x.shape[-2]
    out = x.new_empty((*x.shape[:-2], rows + rows_after, x.shape[-1]))
    torch.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf, out=out[..., :rows, :])
    out[..., rows:, :] = 0
    return out


@functools.cache
def ratio_to_last_column_function() -> Any:
    """The autograd Function of :func:`~xattn._core.delegation.ratio_to_last_column`."""
    import torch

    class RatioToLastColumn(torch.autograd.Function):
        @staticmethod
        def forward(x: Any, floor: float) -> Any:
            return x[..., :-1] / torch.clamp(x[..., -1:], min=floor)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            x, floor = inputs
            ctx.floor = floor
            ctx.save_for_backward(x, output)  # inputs and outputs: a graph of the backward too

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            x, out = ctx.saved_tensors
            last = x[..., -1:]
            divisor = torch.clamp(last, min=ctx.floor)
            if torch.is_grad_enabled():  # a graph of the backward (create_graph): traced ops
                scaled = grad / divisor
                dot = (scaled.unsqueeze(-2) @ out.unsqueeze(-1))[..., 0]
                return torch.cat([scaled, torch.where(last >= ctx.floor, -dot, 0.0)], -1), None
            grad_x = grad.new_empty((*grad.shape[:-1], grad.shape[-1] + 1))
            scaled = grad_x[..., :-1]
            torch.div(grad, divisor, out=scaled)  # d out / d x[:-1], written in place
            # d out / d x[-1] = -sum_j g_j out_j / d, where the clamp passes (last >= floor)
            dot = (scaled.unsqueeze(-2) @ out.unsqueeze(-1))[..., 0]
            grad_x[..., -1:] = torch.where(last >= ctx.floor, -dot, 0.0)
            return grad_x, None

    return RatioToLastColumn


def neighbour_slices(count: int, neighbour: int) -> tuple[slice, slice]:
    """The chunks ``c`` (first slice) whose neighbour ``c + neighbour`` (second) is one of
    ``count`` chunks."""
    return (slice(max(0, -neighbour), count - max(0, neighbour)),
            slice(max(0, neighbour), count - max(0, -neighbour)))


@functools.cache
def neighbour_functions() -> tuple[Any, Any]:
    """The autograd Functions of :func:`~xattn._core.delegation.neighbour_scores` and
    :func:`~xattn._core.delegation.neighbour_sums`."""
    import torch

    def add_product(total: Any, rows: slice, left: Any, right: Any) -> Any:
        """``total`` with ``left @ right`` added to its chunks ``rows``: in place (one
        write of those rows), or, for a graph of the backward (create_graph), traced."""
        if torch.is_grad_enabled():
            index = torch.arange(rows.start, rows.stop, device=total.device)
            return total.index_add(0, index, left @ right)
        total[rows].baddbmm_(left, right)
        return total

    class NeighbourScores(torch.autograd.Function):
        @staticmethod
        def forward(queries: Any, keys: Any, neighbours: tuple[int, ...], period: int,
                    *biases: Any) -> Any:
            scores = []
            for neighbour, bias in zip(neighbours, biases, strict=True):
                rows, key_rows = neighbour_slices(queries.shape[0], neighbour)
                product = (queries[rows], keys[key_rows].mT)
                piece = torch.bmm(*product) if bias is None else torch.baddbmm(bias, *product)
                if neighbour:  # the pairs across two sequences
                    piece[period - 1::period] = -math.inf
                scores.append(piece)
            return tuple(scores)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.neighbours, ctx.num_biases = inputs[2], len(inputs) - 4
            ctx.save_for_backward(inputs[0], inputs[1])

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            queries, keys = ctx.saved_tensors
            own = grads[0] if grads[0] is not None else queries.new_zeros(
                (queries.shape[0], queries.shape[1], keys.shape[1]))
            grad_queries, grad_keys = own @ keys, own.mT @ queries  # d = 0: every chunk
            for neighbour, grad in zip(ctx.neighbours[1:], grads[1:], strict=True):
                if grad is None:
                    continue
                rows, key_rows = neighbour_slices(queries.shape[0], neighbour)
                grad_queries = add_product(grad_queries, rows, grad, keys[key_rows])
                grad_keys = add_product(grad_keys, key_rows, grad.mT, queries[rows])
            return grad_queries, grad_keys, None, None, *(None,) * ctx.num_biases

    class NeighbourSums(torch.autograd.Function):
        @staticmethod
        def forward(values: Any, base: Any, neighbours: tuple[int, ...], *weights: Any) -> Any:
            out = (torch.bmm(weights[0], values) if base is None
                   else torch.baddbmm(base, weights[0], values))
            for neighbour, piece in zip(neighbours[1:], weights[1:], strict=True):
                rows, key_rows = neighbour_slices(values.shape[0], neighbour)
                out[rows].baddbmm_(piece, values[key_rows])
            return out

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.neighbours, ctx.has_base = inputs[2], inputs[1] is not None
            ctx.save_for_backward(inputs[0], *inputs[3:])

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            values, *weights = ctx.saved_tensors
            grad_values = weights[0].mT @ grad
            grad_weights = [grad @ values.mT]
            for neighbour, piece in zip(ctx.neighbours[1:], weights[1:], strict=True):
                rows, key_rows = neighbour_slices(values.shape[0], neighbour)
                grad_weights.append(grad[rows] @ values[key_rows].mT)
                grad_values = add_product(grad_values, key_rows, piece.mT, grad[rows])
            return grad_values, grad if ctx.has_base else None, None, *grad_weights

    return NeighbourScores, NeighbourSums
