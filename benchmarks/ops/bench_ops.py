"""Operations dispatched per call (the proxy for GPU kernel launches), bytes written, FLOPs.

Each call is run once under :class:`OpCounter`, a ``TorchDispatchMode`` that counts every
aten operation torch dispatches (below autograd, so the backward's operations count too):
nothing is excluded. Beside that count, the "compute" count leaves out the operations
that only make a new view or alias of a tensor (:data:`VIEW_OPS`: ``view``,
``transpose``, ``slice``, ...), which launch no kernel. The counts depend on the code
path, not on the values or the machine: the same on every run (on torch's CPU backend by
default; ``--backends torch-cuda`` counts on a CUDA device, where a few operations, SDPA's
kernel for one, have other names).

xattn's causal estimators run the chunkwise-parallel scan: the whole sequence is one
block while its intermediates fit the working-memory budget, so a call dispatches the
same number of operations at every length up to it; torch's
``scaled_dot_product_attention`` dispatches one. The causal calls and ra are counted
under a GPU's budget (``--working-memory``, default 1 GiB: the count is then a GPU's number
of kernel launches; ``device`` uses each device's default, 64 MiB on a CPU, where the blocks
are shorter and the count grows past it). Shape (B, H, N, D) = (1, 2, N, 64),
float32. Rows (forward, and forward plus backward where the row has one: q, k, v
requiring gradients, ``out.sum().backward()`` counted with the call):

- ``xattn.softmax_attention`` non-causal and causal; SDPA causal (the reference);
- ``xattn.rfa`` S = 64, non-causal and causal, with a fixed ``omega`` (drawn once,
  outside the count), and causal with ``num_features=64, rng=0`` (the draw counted);
- ``xattn.rfa`` S = 16, causal, ``window=64, sinks=1``;
- ``xattn.lara`` non-causal C = 64 (its samples drawn in the call), and causal C = 16
  (fixed ``proposal_means``, ``weighting="balance"``);
- ``xattn.ra`` S = 1, non-causal, forward only, under the same budget (one step of all
  N rows while they fit it; quadratic: a length whose predicted time under the counter
  exceeds ``--row-limit`` seconds is skipped);
- decoding: one new token after a prefill of N tokens (``return_state=True``; only the
  step is counted): RFA S = 64, RFA S = 64 with a window of 64 and 1 sink, softmax with
  its key-value cache, causal LARA C = 16.

Beside the counts, each call records the **bytes it writes** (``bytes_written``: every
tensor returned by an operation that is not a view, :data:`VIEW_OPS`, or an allocation
or shape change, :data:`NO_WRITE_OPS`; in-place and ``out=`` operations return what they
write), also in units of |q| = B·H·N·D·4 bytes, one float32 tensor of the query's shape
whatever the input dtype (``bytes_per_q``; a decoding step: of the new token's query),
with the operations that write most (``top_bytes_per_q``); and the **FLOPs of its matrix
products** (``matmul_flops``: 2·M·K·N per product of ``mm``, ``bmm``, ``addmm``,
``baddbmm``, ``addbmm``, ``mv``, ``dot``, and ``matmul`` or a two-operand ``einsum`` if
they reach the dispatcher; torch's fused attention kernels, ``_scaled_dot_product_*``,
count as their products with no causal discount, forward 4·B·H·N·M·D and backward
10·B·H·N·M·D, also in ``attention_flops``) by the dtype of their operands, with
``half_flops_share``, the fraction computed with float16 or bfloat16 operands.

**The traffic table** (default; ``--traffic-lengths ''`` leaves it out,
``--traffic-only`` runs it alone) measures these at a long-context training shape:
(B, H, N, D) = (1, 8, N, 64), ``working_memory=1 << 30`` (``--working-memory``), N = 4096
and 16384 (``--traffic-lengths``), forward and forward plus backward, with float32,
bfloat16 and float16 inputs (``--traffic-dtypes``), for causal ``xattn.rfa`` with a fixed
float32 ``omega`` of 64 samples (drawn outside the count), the same with ``window=64,
sinks=1``, non-causal ``rfa`` (same ``omega``), non-causal ``xattn.lara`` with
``num_samples=64, rng=0`` and torch's ``scaled_dot_product_attention(is_causal=True)``.
A call that raises records its error. A cell whose time predicted from the previous
length exceeds ``--traffic-limit`` seconds (default 60; 0: none) is skipped: on a CPU
that is SDPA's half-precision backward at N = 16384 (about 2 and 3 minutes)::

    python benchmarks/ops/bench_ops.py --traffic-only --traffic-limit 0   # the table alone

**Ragged lengths** (``--ragged-lengths``): each traffic row's bytes per |q| in float32 at
lengths that are not multiples of 64 and at the next multiple, and their ratio::

    python benchmarks/ops/bench_ops.py --lengths '' --traffic-lengths '' \
        --ragged-lengths 70,150,200,1000,1100,3000,4000 --out benchmarks/results/ops_ragged_cpu.json

**Inductor's kernels** (``--kernels``): for each row of the traffic table, the kernels
inductor generates for one ``torch.compile(fullgraph=True)`` of its forward plus backward
(``torch._inductor.metrics.generated_kernel_count``), at ``--kernel-lengths`` (4096 and
16384) in ``--kernel-dtypes`` (float32 and bfloat16). Beside it, ``kernels_in_code``:
the kernels the generated code holds, each once. They differ on the CPU, where inductor
tries to fuse the outer loops of a few kernels with a local buffer and, when that fails,
generates the same kernels again; ``generated_kernel_count`` counts the attempt, the
merged kernel and the retry (``outer_loop_recounts``, their excess). On a GPU (Triton)
there is no such retry and the two agree. ``cpp_kernel_functions``: the C++ functions of
the CPU's generated code, the kernel calls of one step (the C++ backend puts several
loop nests, each a kernel of the counts above, in one function)::

    python benchmarks/ops/bench_ops.py --lengths '' --traffic-lengths '' --kernels

Opt-in, because they are slow: ``--jax-compile`` times ``jax.jit(jax.grad(...))`` of
causal RFA forward plus backward (``.lower(...)`` and ``.compile()`` separately; the
number of StableHLO operations beside them), ``--torch-compile`` one
``torch.compile(fullgraph=True)`` of causal RFA forward at N = 2048 on the CPU (its first
call, inductor's caches disabled: compile and run, or the error it raises)::

    python benchmarks/ops/bench_ops.py                         # counts and traffic, 4 minutes
    python benchmarks/ops/bench_ops.py --jax-compile --torch-compile
    python benchmarks/ops/bench_ops.py --lengths 1024 --out /tmp/ops.json

Writes ``benchmarks/results/ops_results.json`` (after each row, so an interrupted run keeps what
it finished).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import xattn
from xattn.cli.common import environment, write_json
from xattn.cli.measure import load_backend
from xattn.features import sample_omega

GPU_BUDGET = 2**30  # xattn.default_working_memory on a GPU

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
SHAPE = (1, 2, 64)  # B, H, D; N from --lengths
FEATURES = 64
TOP_OPS = 8  # the most frequent operations, per row and length, in the JSON
WARM_UP_LENGTH = 128  # each row and mode runs once at this length before it is counted
TRAFFIC_SHAPE = (1, 8, 64)  # B, H, D of the traffic table; N from --traffic-lengths
TRAFFIC_DTYPES = "float32,bfloat16,float16"

#: Operations that make a view or an alias of their input (no kernel, no copy).
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "t", "transpose",
    "permute", "slice", "select", "unsqueeze", "squeeze", "alias", "detach", "diagonal",
    "unbind", "split", "split_with_sizes", "unfold", "view_as_real", "view_as_complex",
    "real", "imag", "lift_fresh",
})

#: Operations beside the views that write no element: allocations (their memory is written
#: by the operation that fills it, ``copy_`` for one, which counts) and in-place changes of
#: a tensor's shape or strides. They count as operations, not as bytes written.
NO_WRITE_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
    "new_empty_strided", "resize_", "resize_as_", "set_", "as_strided_", "squeeze_",
    "unsqueeze_", "t_", "transpose_", "detach_",
})

#: Matrix products, with the names of their two factors in the operation's schema: FLOPs
#: 2·M·K·N per product (times the batch; the bias of addmm and the like left out).
PRODUCTS = {
    "mm": ("self", "mat2"), "bmm": ("self", "mat2"), "addmm": ("mat1", "mat2"),
    "baddbmm": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"), "mv": ("self", "vec"),
    "addmv": ("mat", "vec"), "dot": ("self", "tensor"), "vdot": ("self", "other"),
    "matmul": ("self", "other"),
}
HALF_DTYPES = frozenset({"float16", "bfloat16"})


def _named_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An operation's arguments by their names in its schema."""
    names = [argument.name for argument in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def product_flops(a: Any, b: Any) -> int:
    """FLOPs of ``matmul(a, b)`` from the two shapes: 2·M·K·N times the broadcast batch
    (a 1-D factor is a row or a column, as in ``matmul``)."""
    a, b = list(a), list(b)
    if len(a) == 1:
        a = [1, *a]
    if len(b) == 1:
        b = [*b, 1]
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
    return 2 * math.prod(batch) * a[-2] * a[-1] * b[-1]


def einsum_flops(equation: str, operands: Any) -> int | None:
    """FLOPs of a two-operand ``einsum`` (2 × the product of every index's size), None for
    another form."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(inputs) != 2 or "..." in equation or len(operands) != 2:
        return None
    sizes: dict[str, int] = {}
    for term, operand in zip(inputs, operands, strict=True):
        sizes.update(zip(term, operand.shape, strict=True))
    return 2 * math.prod(sizes.values())


def attention_flops(name: str, arguments: dict[str, Any]) -> int:
    """FLOPs of a fused attention kernel (``aten._scaled_dot_product_*``), counted as its
    matrix products with no discount for a causal mask: forward 2·B·H·N·M·(D + Dv), the
    scores and the weighted values (4·B·H·N·M·D); backward 2·B·H·N·M·(3·D + 2·Dv), the
    scores recomputed and the four gradient products (10·B·H·N·M·D)."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    rows = math.prod(query.shape[:-2])
    n, d, m, dv = query.shape[-2], query.shape[-1], key.shape[-2], value.shape[-1]
    if name.endswith("_backward"):
        return 2 * rows * n * m * (3 * d + 2 * dv)
    return 2 * rows * n * m * (d + dv)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _tensors(part)]
    return []


def written_bytes(func: Any, out: Any) -> int:
    """Bytes of the tensors an operation returns (numel × element size): its new outputs,
    or the tensors it writes in place or into ``out=``. A result that its schema marks as
    a read-only alias of an input (a view missing from :data:`VIEW_OPS`) counts 0."""
    returns = func._schema.returns
    several = len(returns) > 1 and isinstance(out, (list, tuple))
    values = list(out) if several else [out]
    total = 0
    for index, value in enumerate(values):
        alias = returns[index].alias_info if index < len(returns) else None
        if alias is not None and not alias.is_write:
            continue
        total += sum(t.numel() * t.element_size() for t in _tensors(value))
    return total


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while the mode is active, the bytes they
    write and the FLOPs of their matrix products.

    ``count`` is every operation (nothing excluded), ``compute`` those not in
    :data:`VIEW_OPS`, ``ops`` a :class:`collections.Counter` by operation name
    (``aten.mm``, the overload left out). ``bytes_written``: the bytes of every tensor
    returned by an operation that is neither in :data:`VIEW_OPS` nor in
    :data:`NO_WRITE_OPS` (an in-place or ``out=`` operation returns what it writes);
    ``bytes_by_op`` the same by operation. ``flops``: the FLOPs of the matrix products
    (:data:`PRODUCTS`, ``einsum`` if it reaches the dispatcher, and the fused attention
    kernels, :func:`attention_flops`), by the dtype of their operands;
    ``attention_flops`` the part in fused attention kernels; ``unmodelled`` the products
    whose FLOPs are not known (an ``einsum`` of another form).

    Examples
    --------
    >>> x = torch.ones(3)
    >>> with OpCounter() as counter:
    ...     _ = torch.add(x, x)
    >>> counter.count, counter.compute, dict(counter.ops), counter.bytes_written
    (1, 1, {'aten.add': 1}, 12)
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.compute = 0
        self.ops: Counter[str] = Counter()
        self.bytes_written = 0
        self.bytes_by_op: Counter[str] = Counter()
        self.flops: Counter[str] = Counter()
        self.attention_flops = 0
        self.unmodelled: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.count += 1
        if name not in VIEW_OPS:
            self.compute += 1
        self.ops[f"aten.{name}"] += 1
        out = func(*args, **kwargs)
        if name not in VIEW_OPS and name not in NO_WRITE_OPS:
            written = written_bytes(func, out)
            if written:
                self.bytes_written += written
                self.bytes_by_op[f"aten.{name}"] += written
        self._count_flops(func, name, args, kwargs)
        return out

    def _count_flops(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        if name in PRODUCTS:
            arguments = _named_arguments(func, args, kwargs)
            first, second = (arguments[key] for key in PRODUCTS[name])
            flops = product_flops(first.shape, second.shape)
        elif name == "einsum":
            arguments = _named_arguments(func, args, kwargs)
            first = arguments["tensors"][0]
            flops = einsum_flops(arguments["equation"], arguments["tensors"])
        elif name.startswith("_scaled_dot_product_") and "attention" in name:
            arguments = _named_arguments(func, args, kwargs)
            first = arguments.get("query")
            flops = None if first is None else attention_flops(name, arguments)
            if flops is not None:
                self.attention_flops += flops
        else:
            return
        if flops is None:
            self.unmodelled[f"aten.{name}"] += 1
            return
        self.flops[str(first.dtype).removeprefix("torch.")] += flops


def count_ops(call: Callable[[], Any], sync: Callable[[], Any] | None = None,
              unit_bytes: int | None = None) -> dict[str, Any]:
    """``call()`` once under :class:`OpCounter`: the counts, the most frequent operations,
    the bytes written and the matrix products' FLOPs, and the time it took (the counter's
    overhead included; ``sync()`` after the call, not counted, waits for a device).
    ``unit_bytes``: the bytes of |q| (one float32 tensor of the query's shape), for
    ``bytes_per_q`` and ``top_bytes_per_q`` (the operations that write the most)."""
    started = time.perf_counter()
    with OpCounter() as counter:
        call()
    if sync is not None:
        sync()
    seconds = time.perf_counter() - started
    total_flops = sum(counter.flops.values())
    half = sum(flops for dtype, flops in counter.flops.items() if dtype in HALF_DTYPES)
    result = {"ops": counter.count, "compute_ops": counter.compute,
              "seconds_counted": round(seconds, 3),
              "top_ops": dict(counter.ops.most_common(TOP_OPS)),
              "bytes_written": counter.bytes_written}
    if unit_bytes:
        result["bytes_per_q"] = round(counter.bytes_written / unit_bytes, 3)
        result["top_bytes_per_q"] = {op: round(written / unit_bytes, 3) for op, written
                                     in counter.bytes_by_op.most_common(TOP_OPS)}
    result.update({
        "matmul_flops": total_flops, "matmul_flops_by_dtype": dict(counter.flops),
        "half_flops_share": round(half / total_flops, 4) if total_flops else None,
        "attention_flops": counter.attention_flops})
    if counter.unmodelled:
        result["unmodelled_products"] = dict(counter.unmodelled)
    return result


@dataclass
class Row:
    """One measured call. ``call(q, k, v, setup)`` makes the output; ``setup(q, k, v)``
    (outside the count) what it needs beside the inputs, such as a decoding state.
    ``modes``: "forward", "forward+backward" or "step" (one decoded token). ``power``:
    the call's time grows as N ** power (for the skip of ``--row-limit``)."""

    name: str
    call: Callable[..., Any]
    modes: tuple[str, ...] = ("forward", "forward+backward")
    setup: Callable[..., Any] | None = None
    power: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)


def make_rows(xp: Any, device: Any, working_memory: int | None = None) -> list[Row]:
    """The rows, with the samples they share drawn once here (not counted); the causal
    calls of rfa and lara, and ra, get ``working_memory`` (None: their device's default)."""
    dim = SHAPE[-1]
    budget = {} if working_memory is None else {"working_memory": working_memory}
    omega = sample_omega(0, FEATURES, dim, xp=xp, dtype=xp.float32, device=device)
    omega16 = omega[:16, :]
    means = xp.asarray(np.random.default_rng(1).normal(size=(16, dim)) / math.sqrt(dim),
                       dtype=xp.float32, device=device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    lara_causal = {"num_samples": 16, "proposal_means": means, "weighting": "balance",
                   "rng": 0, **budget}
    window = {"window": 64, "sinks": 1, **budget}

    def prefill(function, **options):
        def setup(q, k, v):
            return function(q, k, v, causal=True, return_state=True, **options)[1]
        return setup

    def step(function, **options):
        def call(q, k, v, state):
            return function(q, k, v, causal=True, state=state, return_state=True,
                            **options)[0]
        return call

    return [
        Row("softmax_attention", lambda q, k, v, _: xattn.softmax_attention(q, k, v),
            power=2),
        Row("softmax_attention causal",
            lambda q, k, v, _: xattn.softmax_attention(q, k, v, causal=True), power=2),
        Row("sdpa causal (torch)", lambda q, k, v, _: sdpa(q, k, v, is_causal=True),
            power=2),
        Row("rfa S=64", lambda q, k, v, _: xattn.rfa(q, k, v, omega=omega)),
        Row("rfa S=64 causal", lambda q, k, v, _: xattn.rfa(q, k, v, omega=omega,
                                                             causal=True, **budget)),
        Row("rfa S=64 causal, int seed",
            lambda q, k, v, _: xattn.rfa(q, k, v, num_features=FEATURES, rng=0, causal=True,
                                         **budget),
            modes=("forward",)),
        Row("rfa S=64 causal, trigonometric",
            lambda q, k, v, _: xattn.rfa(q, k, v, omega=omega, causal=True,
                                         feature_map="trigonometric", **budget)),
        Row("rfa S=16 causal, window=64 sinks=1",
            lambda q, k, v, _: xattn.rfa(q, k, v, omega=omega16, causal=True, **window)),
        Row("lara C=64", lambda q, k, v, _: xattn.lara(q, k, v, num_samples=64, rng=0)),
        Row("lara C=16 causal", lambda q, k, v, _: xattn.lara(q, k, v, causal=True,
                                                                   **lara_causal)),
        Row("ra S=1", lambda q, k, v, _: xattn.ra(q, k, v, num_samples=1, rng=0, **budget),
            modes=("forward",), power=2),
        Row("decode rfa S=64", step(xattn.rfa), modes=("step",),
            setup=prefill(xattn.rfa, omega=omega, **budget)),
        Row("decode rfa S=64, window=64 sinks=1", step(xattn.rfa), modes=("step",),
            setup=prefill(xattn.rfa, omega=omega, **window)),
        Row("decode softmax_attention (cache)", step(xattn.softmax_attention),
            modes=("step",), setup=prefill(xattn.softmax_attention)),
        Row("decode lara C=16 causal", step(xattn.lara, num_samples=16), modes=("step",),
            setup=prefill(xattn.lara, **lara_causal)),
    ]


def measure_row(row: Row, mode: str, length: int, to_backend: Callable[[np.ndarray], Any],
                sync: Callable[[], Any] | None = None) -> dict[str, Any]:
    """The counts of one row at one length and mode (inputs: standard normal, seed 0)."""
    rng = np.random.default_rng(0)
    batch, heads, dim = SHAPE
    q, k, v = (to_backend(rng.normal(size=(batch, heads, length, dim))) for _ in range(3))
    if mode == "step":  # |q| is the new token's query
        state = row.setup(q, k, v)
        token = [to_backend(rng.normal(size=(batch, heads, 1, dim))) for _ in range(3)]
        return count_ops(lambda: row.call(*token, state), sync, batch * heads * dim * 4)
    return count_call(row, mode, q, k, v, sync)


def count_call(row: Row, mode: str, q: Any, k: Any, v: Any,
               sync: Callable[[], Any] | None = None) -> dict[str, Any]:
    """:func:`count_ops` of ``row`` on q, k, v: "forward", or "forward+backward" (leaves
    requiring gradients, ``out.sum().backward()`` counted with the call); |q| is one
    float32 tensor of q's shape, whatever q's dtype."""
    unit_bytes = math.prod(q.shape) * 4
    if mode == "forward":
        return count_ops(lambda: row.call(q, k, v, None), sync, unit_bytes)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    return count_ops(lambda: row.call(*leaves, None).sum().backward(), sync, unit_bytes)


def make_traffic_rows(device: Any, working_memory: int | None) -> list[Row]:
    """The rows of the traffic table, at :data:`TRAFFIC_SHAPE`: every xattn call under
    ``working_memory`` (None: the device's default), RFA with a fixed float32 ``omega`` of
    :data:`FEATURES` samples (drawn here, not counted), LARA drawing its samples in the
    call (``rng=0``, counted)."""
    import array_api_compat.torch as xp

    dim = TRAFFIC_SHAPE[-1]
    budget = {} if working_memory is None else {"working_memory": working_memory}
    omega = sample_omega(0, FEATURES, dim, xp=xp, dtype=xp.float32, device=device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return [
        Row("rfa S=64 causal", lambda q, k, v, _: xattn.rfa(q, k, v, omega=omega,
                                                             causal=True, **budget)),
        Row("rfa S=64 causal, window=64 sinks=1",
            lambda q, k, v, _: xattn.rfa(q, k, v, omega=omega, causal=True, window=64,
                                         sinks=1, **budget)),
        Row("rfa S=64", lambda q, k, v, _: xattn.rfa(q, k, v, omega=omega, **budget)),
        Row("lara C=64", lambda q, k, v, _: xattn.lara(q, k, v, num_samples=64, rng=0,
                                                       **budget)),
        Row("sdpa causal (torch)", lambda q, k, v, _: sdpa(q, k, v, is_causal=True),
            power=2),
    ]


def measure_traffic(rows: list[Row], lengths: list[int], dtypes: list[str], device: Any,
                    cells: dict[str, Any], save: Callable[[], Any],
                    sync: Callable[[], Any] | None = None, limit: float = 0.0) -> None:
    """Each traffic row, mode, dtype and length counted into ``cells[row][mode][dtype][N]``
    (inputs: standard normal, seed 0, rounded to the dtype); a call that raises records
    its error instead. A cell whose time predicted from the same row, mode and dtype at
    the previous length exceeds ``limit`` seconds (0: no limit) is skipped. ``save()``
    after each length."""
    batch, heads, dim = TRAFFIC_SHAPE
    for length in lengths:
        rng = np.random.default_rng(0)
        base = [torch.asarray(rng.normal(size=(batch, heads, length, dim)),
                              dtype=torch.float32, device=device) for _ in range(3)]
        for row in rows:
            for mode in row.modes:
                for dtype in dtypes:
                    done = cells.get(row.name, {}).get(mode, {}).get(dtype, {})
                    times = [(int(n), cell["seconds_counted"]) for n, cell in done.items()
                             if "seconds_counted" in cell]
                    if limit and times:
                        n, seconds = times[-1]
                        predicted = seconds * (length / n) ** row.power
                        if predicted > limit:
                            cells[row.name][mode][dtype][str(length)] = {
                                "skipped": f"predicted {predicted:.0f} s > --traffic-limit "
                                           f"{limit:g}"}
                            print(f"  N={length} {row.name}, {mode}, {dtype}: skipped, "
                                  f"predicted {predicted:.0f} s")
                            continue
                    q, k, v = (x.to(getattr(torch, dtype)) for x in base)
                    try:
                        cell = count_call(row, mode, q, k, v, sync)
                    except Exception as error:  # the failure is the result
                        message = str(error).strip()
                        cell = {"error_type": f"{type(error).__module__}."
                                              f"{type(error).__name__}",
                                "error": message[:1000]}
                    del q, k, v
                    cells.setdefault(row.name, {}).setdefault(mode, {}).setdefault(
                        dtype, {})[str(length)] = cell
                    print(f"  N={length} {row.name}, {mode}, {dtype}: "
                          + (f"{cell['bytes_per_q']} |q|, half share "
                             f"{cell['half_flops_share']}, {cell['seconds_counted']} s"
                             if "error" not in cell else
                             f"{cell['error_type']}: {cell['error'][:160]}"), flush=True)
            save()


def jax_compile_times(lengths: list[int], working_memory: int | None) -> list[dict[str, Any]]:
    """Lowering and compile times of ``jax.jit(jax.grad(...))`` of causal RFA S = 64."""
    import jax
    import jax.numpy as jnp

    batch, heads, dim = SHAPE
    omega = sample_omega(0, FEATURES, dim, xp=jnp, dtype=jnp.float32)

    def loss(q, k, v, omega):
        return jnp.sum(xattn.rfa(q, k, v, omega=omega, causal=True,
                                 working_memory=working_memory))

    results = []
    for length in lengths:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.normal(size=(batch, heads, length, dim)), jnp.float32)
                   for _ in range(3))
        gradient = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        started = time.perf_counter()
        lowered = gradient.lower(q, k, v, omega)
        lowered_at = time.perf_counter()
        lowered.compile()
        compiled_at = time.perf_counter()
        text = lowered.as_text()
        hlo_ops = sum(1 for line in text.splitlines() if " = " in line)
        result = {"length": length, "lower_s": round(lowered_at - started, 2),
                  "compile_s": round(compiled_at - lowered_at, 2),
                  "total_s": round(compiled_at - started, 2), "stablehlo_ops": hlo_ops}
        print(f"  jax jit(grad) causal rfa N={length}: lower {result['lower_s']} s, "
              f"compile {result['compile_s']} s, {hlo_ops} StableHLO operations")
        results.append(result)
    return results


def torch_compile_time(length: int, device: Any, backend: str,
                       working_memory: int | None) -> dict[str, Any]:
    """One ``torch.compile(fullgraph=True)`` of causal RFA S = 64 forward: the time of
    its first call (compile and run), or the error it raises."""
    import torch._dynamo
    import torch._inductor.config

    batch, heads, dim = SHAPE
    rng = np.random.default_rng(0)
    q, k, v = (torch.asarray(rng.normal(size=(batch, heads, length, dim)),
                             dtype=torch.float32, device=device) for _ in range(3))
    import array_api_compat.torch as xp
    omega = sample_omega(0, FEATURES, dim, xp=xp, dtype=xp.float32, device=device)
    torch._dynamo.reset()
    def call(q, k, v):
        return xattn.rfa(q, k, v, omega=omega, causal=True, working_memory=working_memory)

    compiled = torch.compile(call, fullgraph=True, backend=backend)
    result: dict[str, Any] = {"length": length, "device": str(device), "backend": backend,
                              "fullgraph": True, "inductor_caches": "disabled"}
    started = time.perf_counter()
    try:
        # dynamo's warnings are many lines each; inductor's on-disk caches would make a
        # second run of this script time a cache hit instead of a compile
        with warnings.catch_warnings(record=True) as caught, \
                torch._inductor.config.patch(force_disable_caches=True):
            warnings.simplefilter("always")
            out = compiled(q, k, v)
        result["warnings"] = len(caught)
        result["first_call_s"] = round(time.perf_counter() - started, 2)
        reference = call(q, k, v)
        result["status"] = "compiled"
        result["max_abs_difference"] = float((out - reference).abs().max())
    except Exception as error:  # the failure is the result
        result["first_call_s"] = round(time.perf_counter() - started, 2)
        result["status"] = "failed"
        result["error_type"] = f"{type(error).__module__}.{type(error).__name__}"
        message = str(error).strip()
        result["error"] = message[:1500]
        result["error_first_line"] = message.splitlines()[0] if message else ""
        result["traceback_tail"] = "".join(traceback.format_exception(error)[-3:])[-1500:]
    print(f"  torch.compile(fullgraph=True, backend={backend!r}) causal rfa N={length}: "
          f"{result['status']} after {result['first_call_s']} s"
          + (f" ({result['error_type']}: {result['error_first_line'][:160]})"
             if result["status"] == "failed" else ""))
    torch._dynamo.reset()
    return result


def inductor_kernels(rows: list[Row], lengths: list[int], dtypes: list[str], device: Any,
                     cells: dict[str, Any], save: Callable[[], Any]) -> None:
    """Inductor's generated kernels for each traffic row's forward plus backward
    (``torch._inductor.metrics.generated_kernel_count`` over one compilation of
    ``torch.compile(fullgraph=True)`` and its first call with ``.sum().backward()``), at
    :data:`TRAFFIC_SHAPE` with N = each of ``lengths``, in ``cells[row][dtype][N]``, and
    ``kernels_in_code``: that count less inductor's recounts
    (:func:`outer_loop_recounts`), each kernel of the generated code counted once (on the
    CPU a loop nest: a GPU's kernel), and ``cpp_kernel_functions``: the C++ functions of
    the generated code on the CPU (:data:`CPP_KERNEL_DEFINITION`; inductor's C++
    backend puts several loop nests in one function), the calls of one step; a
    compilation that fails records its error."""
    import torch._dynamo
    import torch._inductor.config
    import torch._inductor.metrics
    from torch._inductor.utils import run_and_get_code

    batch, heads, dim = TRAFFIC_SHAPE
    for row in rows:
        for dtype_name in dtypes:
            for length in lengths:
                rng = np.random.default_rng(0)
                leaves = [torch.asarray(rng.normal(size=(batch, heads, length, dim)),
                                        dtype=getattr(torch, dtype_name),
                                        device=device).requires_grad_() for _ in range(3)]
                torch._dynamo.reset()
                torch._inductor.metrics.reset()
                compiled = torch.compile(lambda q, k, v, row=row: row.call(q, k, v, None),
                                         fullgraph=True)
                cell: dict[str, Any] = {}
                started = time.perf_counter()
                try:
                    with warnings.catch_warnings(), outer_loop_recounts() as recounts, \
                            torch._inductor.config.patch(force_disable_caches=True):
                        warnings.simplefilter("ignore")
                        _, sources = run_and_get_code(
                            lambda step=compiled, inputs=leaves:
                            step(*inputs).float().sum().backward())
                    cell["kernels"] = int(torch._inductor.metrics.generated_kernel_count)
                    cell["outer_loop_recounts"] = sum(recounts)
                    cell["kernels_in_code"] = cell["kernels"] - sum(recounts)
                    cell["cpp_kernel_functions"] = sum(
                        len(CPP_KERNEL_DEFINITION.findall(source)) for source in sources)
                except Exception as error:  # the failure is the result
                    cell["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                cell["compile_and_first_call_s"] = round(time.perf_counter() - started, 2)
                cells.setdefault(row.name, {}).setdefault(dtype_name, {})[str(length)] = cell
                print(f"  {row.name:40s} {dtype_name:9s} N={length:6d}: "
                      f"{cell.get('kernels', cell.get('error'))} kernels, "
                      f"{cell.get('kernels_in_code', '-')} in the code, "
                      f"{cell.get('cpp_kernel_functions', '-')} C++ functions "
                      f"({cell['compile_and_first_call_s']} s)", flush=True)
                save()
    torch._dynamo.reset()


#: A kernel function of inductor's C++ backend in its generated module (``cpp_fused_...
#: = async_compile.cpp_pybinding(...)``, torch 2.13; none on a GPU).
CPP_KERNEL_DEFINITION = re.compile(r"^cpp_fused_\w+ = async_compile\.", re.MULTILINE)


@contextlib.contextmanager
def outer_loop_recounts() -> Iterator[list[int]]:
    """A list that collects, while the context lasts, for each group of kernels inductor's
    CPU backend tries to fuse by their outer loops, how many more kernels
    ``generated_kernel_count`` counts than the group holds: 1 (the merged kernel) when the
    fusion succeeds, the group's size (the same kernels generated again) when it fails
    (``CppScheduling.codegen_outer_loop_node``, torch 2.13; nothing where a torch has no
    such method)."""
    import torch._inductor.metrics
    from torch._inductor.codegen import cpp

    recounts: list[int] = []
    scheduling = getattr(cpp, "CppScheduling", None)
    original = getattr(scheduling, "codegen_outer_loop_node", None)
    if original is None:
        yield recounts
        return

    def codegen_outer_loop_node(self: Any, node: Any) -> Any:
        before = torch._inductor.metrics.generated_kernel_count
        result = original(self, node)
        counted = torch._inductor.metrics.generated_kernel_count - before
        recounts.append(counted - len(node.get_outer_nodes()))
        return result

    scheduling.codegen_outer_loop_node = codegen_outer_loop_node
    try:
        yield recounts
    finally:
        scheduling.codegen_outer_loop_node = original


def selected_rows(rows: list[Row], names: str | None) -> list[Row]:
    """The rows whose name contains one of the comma-separated ``names`` (None: all)."""
    if not names:
        return rows
    return [row for row in rows if any(part in row.name for part in names.split(","))]


def ragged_bytes(rows: list[Row], lengths: list[int], device: Any, cells: dict[str, Any],
                 save: Callable[[], Any]) -> None:
    """Bytes written per |q| at each of ``lengths`` (not multiples of 64) and at the next
    multiple of 64, float32 at :data:`TRAFFIC_SHAPE`, forward and forward plus backward,
    and their ratio, in ``cells[row][mode][N]``."""
    batch, heads, dim = TRAFFIC_SHAPE
    for row in rows:
        for mode in row.modes:
            for length in lengths:
                cell: dict[str, Any] = {}
                for name, n in (("ragged", length), ("whole", -(-length // 64) * 64)):
                    rng = np.random.default_rng(0)
                    q, k, v = (torch.asarray(rng.normal(size=(batch, heads, n, dim)),
                                             dtype=torch.float32, device=device)
                               for _ in range(3))
                    counted = count_call(row, mode, q, k, v)
                    cell[name] = {"length": n, "bytes_per_q": counted["bytes_per_q"],
                                  "top_bytes_per_q": counted.get("top_bytes_per_q")}
                cell["ratio"] = round(cell["ragged"]["bytes_per_q"]
                                      / cell["whole"]["bytes_per_q"], 4)
                cells.setdefault(row.name, {}).setdefault(mode, {})[str(length)] = cell
                print(f"  {row.name:40s} {mode:17s} N={length:6d}: "
                      f"{cell['ragged']['bytes_per_q']:.2f} |q| against "
                      f"{cell['whole']['bytes_per_q']:.2f} at {cell['whole']['length']}: "
                      f"{cell['ratio']:.3f}", flush=True)
                save()


def print_table(rows: dict[str, dict[str, dict[str, Any]]], lengths: list[int]) -> None:
    """Operations per call, ``all (compute)``, then the bytes written in |q|, one line per
    row and mode."""
    def cells(key: Callable[[dict[str, Any]], str], unit: str) -> None:
        header = f"{'row':38} {'mode':16}" + "".join(f"{f'N={n}':>18}" for n in lengths)
        print(header)
        print("-" * len(header))
        for name, modes in rows.items():
            for mode, row_cells in modes.items():
                print(f"{name:38} {mode:16}" + _cells_text(row_cells, lengths, 18, key))
        print(unit)

    cells(lambda cell: f"{cell['ops']} ({cell['compute_ops']})",
          "cells: all operations (without views)")
    print()
    cells(lambda cell: f"{cell['bytes_per_q']:.2f}",
          "cells: bytes written per call in |q| = B·H·N·D·4 bytes (a decoding step: "
          "B·H·D·4)")


def _cells_text(row_cells: dict[str, Any], lengths: list[int], width: int,
                text_of: Callable[[dict[str, Any]], str]) -> str:
    """One table row's cells, right-aligned in ``width``: ``text_of(cell)`` for a measured
    cell, "error" or "skipped" for one that was not, blank for a length not run."""
    texts = []
    for n in lengths:
        cell = row_cells.get(str(n))
        if cell is None:
            text = ""
        elif "error" in cell:
            text = "error"
        elif "skipped" in cell or "ops" not in cell:
            text = "skipped"
        else:
            text = text_of(cell)
        texts.append(f"{text:>{width}}")
    return "".join(texts)


def _share(cell: dict[str, Any]) -> str:
    share = cell.get("half_flops_share")
    return "-" if share is None else f"{100 * share:.0f}%"


def print_traffic_table(rows: dict[str, Any], lengths: list[int]) -> None:
    """The traffic table: per row, mode and dtype, the bytes written in |q|, the share of
    the matrix products' FLOPs with half-precision operands, and those FLOPs (GFLOP)."""
    width = 26
    header = (f"{'row':36} {'mode':16} {'dtype':9}"
              + "".join(f"{f'N={n}: ×|q| half GFLOP':>{width}}" for n in lengths))
    print(header)
    print("-" * len(header))
    for name, modes in rows.items():
        for mode, dtypes in modes.items():
            for dtype, row_cells in dtypes.items():
                print(f"{name:36} {mode:16} {dtype:9}" + _cells_text(
                    row_cells, lengths, width,
                    lambda cell: f"{cell['bytes_per_q']:>10.2f} {_share(cell):>5} "
                                 f"{cell['matmul_flops'] / 1e9:>9.2f}"))
    print("cells: bytes written per call in |q| = B·H·N·D·4 bytes (one float32 q), the share "
          "of matrix-product FLOPs with float16/bfloat16 operands, and those FLOPs (GFLOP)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--backends", default="torch",
                        help="comma-separated: torch (CPU) and/or torch-cuda; other names "
                             "are skipped (the counter is torch's dispatcher)")
    parser.add_argument("--rows", default=None,
                        help="comma-separated substrings: only the rows whose name has one")
    parser.add_argument("--row-limit", type=float, default=20.0,
                        help="skip a length whose predicted counted time (from the row's "
                             "previous length) exceeds this many seconds")
    parser.add_argument("--jax-compile", action="store_true",
                        help="time jax.jit(jax.grad(...)) of causal rfa (slow)")
    parser.add_argument("--jax-compile-lengths", default="1024,4096")
    parser.add_argument("--torch-compile", action="store_true",
                        help="torch.compile(fullgraph=True) of causal rfa forward (slow)")
    parser.add_argument("--torch-compile-length", type=int, default=2048)
    parser.add_argument("--torch-compile-backend", default="inductor")
    parser.add_argument("--working-memory", default=str(GPU_BUDGET),
                        help="bytes the causal calls may hold (working_memory=); 'device': "
                             "each device's default. Default: a GPU's default (1 GiB), so "
                             "that the counts are a GPU's kernel launches")
    parser.add_argument("--traffic-lengths", default="4096,16384",
                        help="comma-separated lengths of the traffic table at (B, H, N, D) "
                             "= (1, 8, N, 64); '' leaves the table out")
    parser.add_argument("--traffic-dtypes", default=TRAFFIC_DTYPES,
                        help="comma-separated input dtypes of the traffic table")
    parser.add_argument("--traffic-limit", type=float, default=60.0,
                        help="skip a traffic cell whose predicted counted time (from the "
                             "same row, mode and dtype at the previous length) exceeds "
                             "this many seconds; 0: no limit (SDPA's half-precision "
                             "backward at N = 16384 takes minutes on a CPU)")
    parser.add_argument("--traffic-only", action="store_true",
                        help="only the traffic table, not the operation counts at "
                             "(1, 2, N, 64)")
    parser.add_argument("--ragged-lengths", default="",
                        help="comma-separated lengths that are not multiples of 64: bytes "
                             "written per |q| of each traffic row there and at the next "
                             "multiple of 64 (float32), and their ratio")
    parser.add_argument("--kernels", action="store_true",
                        help="also count inductor's generated kernels of each traffic row, "
                             "forward plus backward (slow: one compilation each)")
    parser.add_argument("--kernel-lengths", default="4096,16384")
    parser.add_argument("--kernel-dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ops_results.json")
    args = parser.parse_args(argv)
    working_memory = None if args.working_memory == "device" else int(args.working_memory)
    from bench_scaling import source_state  # here: this module imports without benchmarks/
    lengths = [int(item) for item in args.lengths.split(",") if item]
    traffic_lengths = [int(item) for item in args.traffic_lengths.split(",") if item]
    traffic_dtypes = [item for item in args.traffic_dtypes.split(",") if item]
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    torch.set_num_threads(threads)
    devices = {"torch": "cpu", "torch-cuda": "cuda"}
    names = [name for name in args.backends.split(",") if name]
    skipped = [name for name in names if name not in devices]
    if skipped:
        print(f"skipped backends (not torch): {', '.join(skipped)}")
    batch, heads, dim = SHAPE
    report: dict[str, Any] = {
        "description": __doc__.splitlines()[0],
        "command": "python benchmarks/ops/bench_ops.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": threads},
        "xattn": xattn.__version__, "source": source_state(), "dtype": "float32",
        "shape": {"batch": batch, "heads": heads, "head_dim": dim}, "lengths": lengths,
        "features": FEATURES, "view_ops": sorted(VIEW_OPS),
        "working_memory": args.working_memory,
        "no_write_ops": sorted(NO_WRITE_OPS),
        "counted": "every aten operation dispatched (TorchDispatchMode); compute_ops "
                   "leaves out view_ops",
        "bytes_counted": "bytes_written: the bytes (numel x element size) of every tensor "
                         "returned by an operation in neither view_ops nor no_write_ops "
                         "(in-place and out= operations return the tensors they write); "
                         "bytes_per_q: bytes_written / (B*H*N*D*4), one float32 tensor of "
                         "the query's shape whatever the input dtype (a decoding step: "
                         "B*H*1*D*4); top_bytes_per_q: the operations that write most",
        "flops_counted": "matmul_flops: 2*M*K*N per matrix product (aten.mm, bmm, addmm, "
                         "baddbmm, addbmm, mv, addmv, dot, vdot, and matmul or a "
                         "two-operand einsum if they reach the dispatcher; the bias of "
                         "addmm and the like left out) times the batch, plus the fused "
                         "attention kernels (aten._scaled_dot_product_*) as their products "
                         "with no causal discount: forward 4*B*H*N*M*D, backward "
                         "10*B*H*N*M*D (also in attention_flops); matmul_flops_by_dtype by "
                         "the dtype of the operands; half_flops_share: the fraction with "
                         "float16 or bfloat16 operands (null without a product)",
        "backends": {}, "skipped_backends": skipped}
    if traffic_lengths:
        traffic_batch, traffic_heads, traffic_dim = TRAFFIC_SHAPE
        report["traffic_settings"] = {
            "description": "bytes written and half-precision share of the matrix "
                           "products per call, at a long-context training shape; "
                           "rows in backends.<name>.traffic[row][mode][dtype][N]",
            "shape": {"batch": traffic_batch, "heads": traffic_heads,
                      "head_dim": traffic_dim},
            "lengths": traffic_lengths, "dtypes": traffic_dtypes, "features": FEATURES,
            "working_memory": args.working_memory, "limit_s": args.traffic_limit,
            "unit": "|q| = B*H*N*D*4 bytes, one float32 tensor of the query's shape, "
                    "whatever the input dtype",
            "rows": "rfa causal, rfa causal window=64 sinks=1 (fixed float32 omega of 64 "
                    "samples, drawn outside the count), rfa non-causal (same omega), lara "
                    "non-causal num_samples=64 rng=0 (drawn in the call), torch SDPA "
                    "is_causal=True; every xattn call with working_memory; inputs "
                    "standard normal (seed 0) rounded to the dtype; a call that raises "
                    "records error_type and error"}
    for name in names:
        if name not in devices:
            continue
        backend = load_backend("torch", devices[name], "float32")
        rows = selected_rows(make_rows(backend.namespace, backend.to_backend(np.zeros(1)).device,
                                       working_memory), args.rows)
        entry = {"environment": environment(backend), "rows": {}}
        sync = torch.cuda.synchronize if devices[name] == "cuda" else None
        report["backends"][name] = entry
        if not args.traffic_only:
            print(f"{backend.describe()}: (B, H, N, D) = ({batch}, {heads}, N, {dim}), "
                  "float32")
        for row in rows if not args.traffic_only else []:
            for mode in row.modes:
                cells = entry["rows"].setdefault(row.name, {}).setdefault(mode, {})
                # a warm-up at a short length, so that first-call costs (imports, caches)
                # do not enter the times that decide on --row-limit
                measure_row(row, mode, WARM_UP_LENGTH, backend.to_backend, sync)
                previous = None
                for length in lengths:
                    if previous is not None:
                        predicted = previous[1] * (length / previous[0]) ** row.power
                        if predicted > args.row_limit:
                            cells[str(length)] = {"skipped": f"predicted {predicted:.0f} s "
                                                             f"> --row-limit {args.row_limit}"}
                            continue
                    cells[str(length)] = measure_row(row, mode, length, backend.to_backend,
                                                     sync)
                    previous = (length, cells[str(length)]["seconds_counted"])
                write_json(args.out, report)
        if not args.traffic_only:
            print_table(entry["rows"], lengths)
        if traffic_lengths:
            device = backend.to_backend(np.zeros(1)).device
            traffic_rows = selected_rows(make_traffic_rows(device, working_memory), args.rows)
            print(f"traffic, {backend.describe()}: (B, H, N, D) = (1, 8, N, 64), "
                  f"dtypes {', '.join(traffic_dtypes)}")
            entry["traffic"] = {}
            measure_traffic(traffic_rows, traffic_lengths, traffic_dtypes, device,
                            entry["traffic"], lambda: write_json(args.out, report), sync,
                            args.traffic_limit)
            print_traffic_table(entry["traffic"], traffic_lengths)
        ragged_lengths = [int(item) for item in args.ragged_lengths.split(",") if item]
        if ragged_lengths:
            device = backend.to_backend(np.zeros(1)).device
            ragged_rows = selected_rows(make_traffic_rows(device, working_memory), args.rows)
            print(f"bytes at ragged lengths, {backend.describe()}: (B, H, N, D) = "
                  "(1, 8, N, 64), float32")
            entry["ragged_bytes"] = {}
            ragged_bytes(ragged_rows, ragged_lengths, device, entry["ragged_bytes"],
                         lambda: write_json(args.out, report))
        if args.kernels:
            device = backend.to_backend(np.zeros(1)).device
            kernel_rows = selected_rows(make_traffic_rows(device, working_memory), args.rows)
            print(f"inductor kernels, forward + backward, {backend.describe()}: "
                  "(B, H, N, D) = (1, 8, N, 64)")
            entry["inductor_kernels"] = {}
            inductor_kernels(kernel_rows,
                             [int(item) for item in args.kernel_lengths.split(",") if item],
                             [item for item in args.kernel_dtypes.split(",") if item],
                             device, entry["inductor_kernels"],
                             lambda: write_json(args.out, report))
    if args.jax_compile:
        print("JAX compile (CPU):")
        report["jax_compile"] = jax_compile_times(
            [int(item) for item in args.jax_compile_lengths.split(",")], working_memory)
        import jax
        report["machine"]["jax"] = jax.__version__
        write_json(args.out, report)
    if args.torch_compile:
        print("torch.compile:")
        report["torch_compile"] = torch_compile_time(args.torch_compile_length, "cpu",
                                                     args.torch_compile_backend, working_memory)
        write_json(args.out, report)
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
