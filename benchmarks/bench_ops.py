"""Array operations dispatched per call: the proxy for GPU kernel launches, on torch.

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

Opt-in, because they are slow: ``--jax-compile`` times ``jax.jit(jax.grad(...))`` of
causal RFA forward plus backward (``.lower(...)`` and ``.compile()`` separately; the
number of StableHLO operations beside them), ``--torch-compile`` one
``torch.compile(fullgraph=True)`` of causal RFA forward at N = 2048 on the CPU (its first
call, inductor's caches disabled: compile and run, or the error it raises)::

    python benchmarks/bench_ops.py                         # counts, about a minute
    python benchmarks/bench_ops.py --jax-compile --torch-compile
    python benchmarks/bench_ops.py --lengths 1024 --out /tmp/ops.json

Writes ``benchmarks/results/ops_results.json`` (after each row, so an interrupted run keeps what
it finished).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
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

HERE = Path(__file__).parent
SHAPE = (1, 2, 64)  # B, H, D; N from --lengths
FEATURES = 64
TOP_OPS = 8  # the most frequent operations, per row and length, in the JSON
WARM_UP_LENGTH = 128  # each row and mode runs once at this length before it is counted

#: Operations that make a view or an alias of their input (no kernel, no copy).
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "t", "transpose",
    "permute", "slice", "select", "unsqueeze", "squeeze", "alias", "detach", "diagonal",
    "unbind", "split", "split_with_sizes", "unfold", "view_as_real", "view_as_complex",
    "real", "imag", "lift_fresh",
})


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while the mode is active.

    ``count`` is every operation (nothing excluded), ``compute`` those not in
    :data:`VIEW_OPS`, ``ops`` a :class:`collections.Counter` by operation name
    (``aten.mm``, the overload left out).

    Examples
    --------
    >>> x = torch.ones(3)
    >>> with OpCounter() as counter:
    ...     _ = torch.add(x, x)
    >>> counter.count, counter.compute, dict(counter.ops)
    (1, 1, {'aten.add': 1})
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.compute = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.count += 1
        if name not in VIEW_OPS:
            self.compute += 1
        self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def count_ops(call: Callable[[], Any], sync: Callable[[], Any] | None = None,
              ) -> dict[str, Any]:
    """``call()`` once under :class:`OpCounter`: the counts, the most frequent operations
    and the time it took (the counter's overhead included; ``sync()`` after the call, not
    counted, waits for a device)."""
    started = time.perf_counter()
    with OpCounter() as counter:
        call()
    if sync is not None:
        sync()
    seconds = time.perf_counter() - started
    return {"ops": counter.count, "compute_ops": counter.compute,
            "seconds_counted": round(seconds, 3),
            "top_ops": dict(counter.ops.most_common(TOP_OPS))}


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
    if mode == "step":
        state = row.setup(q, k, v)
        token = [to_backend(rng.normal(size=(batch, heads, 1, dim))) for _ in range(3)]
        return count_ops(lambda: row.call(*token, state), sync)
    if mode == "forward":
        return count_ops(lambda: row.call(q, k, v, None), sync)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    return count_ops(lambda: row.call(*leaves, None).sum().backward(), sync)


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


def print_table(rows: dict[str, dict[str, dict[str, Any]]], lengths: list[int]) -> None:
    """Operations per call, ``all (compute)``, one line per row and mode."""
    header = f"{'row':38} {'mode':16}" + "".join(f"{f'N={n}':>18}" for n in lengths)
    print(header)
    print("-" * len(header))
    for name, modes in rows.items():
        for mode, cells in modes.items():
            text = []
            for n in lengths:
                cell = cells.get(str(n))
                if cell is None:
                    text.append(f"{'':>18}")
                elif "ops" not in cell:
                    text.append(f"{'skipped':>18}")
                else:
                    counts = f"{cell['ops']} ({cell['compute_ops']})"
                    text.append(f"{counts:>18}")
            print(f"{name:38} {mode:16}" + "".join(text))
    print("cells: all operations (without views)")


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
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ops_results.json")
    args = parser.parse_args(argv)
    working_memory = None if args.working_memory == "device" else int(args.working_memory)
    from bench_scaling import source_state  # here: this module imports without benchmarks/
    lengths = [int(item) for item in args.lengths.split(",")]
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
        "command": "python benchmarks/bench_ops.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": threads},
        "xattn": xattn.__version__, "source": source_state(), "dtype": "float32",
        "shape": {"batch": batch, "heads": heads, "head_dim": dim}, "lengths": lengths,
        "features": FEATURES, "view_ops": sorted(VIEW_OPS),
        "working_memory": args.working_memory,
        "counted": "every aten operation dispatched (TorchDispatchMode); compute_ops "
                   "leaves out view_ops",
        "backends": {}, "skipped_backends": skipped}
    for name in names:
        if name not in devices:
            continue
        backend = load_backend("torch", devices[name], "float32")
        rows = make_rows(backend.namespace, backend.to_backend(np.zeros(1)).device,
                         working_memory)
        if args.rows:
            wanted = args.rows.split(",")
            rows = [row for row in rows if any(part in row.name for part in wanted)]
        entry = {"environment": environment(backend), "rows": {}}
        sync = torch.cuda.synchronize if devices[name] == "cuda" else None
        report["backends"][name] = entry
        print(f"{backend.describe()}: (B, H, N, D) = ({batch}, {heads}, N, {dim}), float32")
        for row in rows:
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
        print_table(entry["rows"], lengths)
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
