"""``xattn bench --decode``: per-token decoding time and state bytes against the position.

A model that generates runs one attention call per new token, continuing the sequence
from a state (``state=``, ``return_state=True``). For each position P of ``--lengths``,
the state of a causal call on P tokens is built (by prefill calls of at most
:data:`PREFILL_CHUNK` tokens, which continue one another), then single-token steps from
that state are timed: the median of ``--decode-steps`` steps, each from the same state,
after one warm-up step (on JAX the step is ``jax.jit``-compiled; the warm-up compiles it).
The state's bytes are the sum of its arrays' bytes.

Measured: RFA (``--samples`` features), RFA with ``--window`` and ``--sinks`` (exact
attention on the band and the sinks, random features for the rest), and exact softmax with
its key-value cache. RFA's state is of fixed size; the cache grows with P, and so does
the time of a softmax step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import xattn
from xattn.cli.common import advance, format_bytes, format_table, progress_bar
from xattn.cli.measure import Backend

__all__ = ["DECODE_SAMPLES", "DEFAULT_POSITIONS", "PREFILL_CHUNK", "DecodeVariant",
           "add_decode_options", "bracket", "decode_variants", "measure_decode",
           "overtaking_position", "overtaking_verdict", "plot_decode", "print_decode_table",
           "rfa_decode_bytes", "run_decode", "state_bytes"]

#: Positions measured by default.
DEFAULT_POSITIONS = (1024, 4096, 16384, 65536)
#: RFA's features unless ``--samples`` says otherwise.
DECODE_SAMPLES = 256
#: Most tokens one prefill call takes (the state is built by calls that continue it).
PREFILL_CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class DecodeVariant:
    """One attention that decodes: a name, its function and its keyword options."""

    name: str
    function: Callable[..., Any]
    options: dict[str, Any]
    #: On torch, the timed step is ``torch.compile(step, fullgraph=True)`` (the first,
    #: untimed step compiles it); elsewhere the variant is skipped.
    torch_compile: bool = False


def decode_variants(samples: int, window: int, sinks: int, seed: int, *,
                    torch_compile: bool = False) -> list[DecodeVariant]:
    """Exact softmax with its key-value cache, RFA, and RFA with a window and sinks; with
    ``torch_compile``, RFA's step compiled by ``torch.compile(fullgraph=True)`` too."""
    rfa_options = {"num_features": samples, "rng": seed}
    variants = [DecodeVariant("softmax (KV cache)", xattn.softmax_attention, {}),
                DecodeVariant("rfa", xattn.rfa, rfa_options),
                DecodeVariant(f"rfa+window {window}, {sinks} sink" + ("s" * (sinks != 1)),
                              xattn.rfa, {**rfa_options, "window": window, "sinks": sinks})]
    if torch_compile:
        variants.append(DecodeVariant("rfa (torch.compile)", xattn.rfa, rfa_options,
                                      torch_compile=True))
    return variants


def rfa_decode_bytes(*, heads: int, head_dim: int, samples: int, window: int, sinks: int,
                     position: int, itemsize: int) -> int:
    """Memory of decoding with causal RFA up to ``position`` (``window`` and ``sinks`` 0 for
    plain RFA), estimated from the sizes (an upper bound, checked against tracemalloc in
    tests/test_cli.py): the state, held twice while a call makes the next one (``S (Dv +
    2)`` feature sums and maxima per head, ``(w + K)(D + Dv)`` window and sink buffers, the
    ``(S, D)`` samples), and the largest call, a prefill piece of ``c = min(position,
    PREFILL_CHUNK)`` tokens: per head its samples' features (the chunked scan's
    intermediates, at most the CPU's working memory) and their ``(S, D)`` work, ``c``
    tokens' keys, values and outputs, the window buffer joined to them, the exact band
    in chunks (``c (C + 2w + K)`` scores, C = max(16, w) rounded up to a power of two),
    the sink slots' update (a ``(K, min(K, c))`` selection, ``(K, D)`` keys and values),
    and the host's float64 draws of the inputs."""
    dim = head_dim  # D = Dv in the command
    piece = min(position, PREFILL_CHUNK)
    state = (itemsize * heads * (samples * (dim + 2) + (window + sinks) * 2 * dim)
             + heads * (window + sinks) + itemsize * samples * dim)
    per_sample = (min(itemsize * heads * samples * 40 * piece,
                      xattn.default_working_memory(np.zeros(0)))
                  + itemsize * heads * samples * 40 * dim)
    tokens = itemsize * heads * piece * (8 * 2 * dim + 32) + 8 * 3 * heads * piece * dim
    buffers = itemsize * heads * 8 * window * 2 * dim
    # the band in chunks of a power of two >= max(w, 16) queries against their keys
    chunk = max(16, 1 << max(window - 1, 0).bit_length())
    band = (4 * itemsize * heads * piece * (chunk + 2 * window + sinks) if window or sinks
            else 0)
    landing = min(sinks, piece)
    sink_update = 2 * itemsize * heads * sinks * dim + (itemsize + 1) * sinks * landing
    return 2 * state + per_sample + tokens + buffers + band + sink_update


def state_bytes(state: Any) -> int:
    """Bytes of the arrays a state holds (its dataclass fields that have ``nbytes`` or a
    shape and a dtype).

    Examples
    --------
    >>> import numpy as np, xattn
    >>> from xattn.cli.decode import state_bytes
    >>> x = np.ones((1, 4, 8), dtype=np.float32)
    >>> _, cache = xattn.softmax_attention(x, x, x, causal=True, return_state=True)
    >>> state_bytes(cache)  # keys and values (2 x 128 bytes) and 4 validity flags
    260
    """
    total = 0
    for item in dataclasses.fields(state):
        value = getattr(state, item.name)
        if value is None or not hasattr(value, "shape"):
            continue
        nbytes = getattr(value, "nbytes", None)
        if nbytes is None:  # torch tensors: element size times count
            nbytes = value.element_size() * value.numel()
        total += int(nbytes)
    return total


def _step_function(variant: DecodeVariant, *, jit: bool,
                   torch_compile: bool = False) -> Callable[..., Any]:
    """``step(q, k, v, state) -> (out, state)``; with ``jit``, compiled by jax.jit, with
    ``torch_compile`` by ``torch.compile(fullgraph=True)``."""
    def step(q: Any, k: Any, v: Any, state: Any) -> Any:
        options = {name: value for name, value in variant.options.items()
                   if state is None or name not in ("num_features", "rng")}
        return variant.function(q, k, v, causal=True, state=state, return_state=True,
                                **options)

    if torch_compile:
        import torch
        return torch.compile(step, fullgraph=True)
    if not jit:
        return step
    import jax
    return jax.jit(step)


def _synced(backend: Backend, result: Any) -> Any:
    if backend.name == "jax":
        import jax
        return jax.block_until_ready(result)
    backend.sync(result[0])
    return result


def measure_decode(backend: Backend, variants: list[DecodeVariant], positions: list[int], *,
                   heads: int, head_dim: int, steps: int, seed: int,
                   progress: bool | None = False) -> dict[str, list[dict[str, Any]]]:
    """Per-token decode time and state bytes of each variant at each position.

    Returns ``{name: [{"position", "ms_per_token", "all_ms", "state_bytes"}, ...]}``.
    """
    host = np.random.default_rng(seed)
    positions = sorted(set(positions))
    variants = [variant for variant in variants
                if not variant.torch_compile or backend.name == "torch"]

    def tokens(count: int) -> tuple[Any, Any, Any]:
        return tuple(backend.to_backend(host.normal(size=(heads, count, head_dim)))
                     for _ in range(3))

    new_token = tokens(1)
    results: dict[str, list[dict[str, Any]]] = {variant.name: [] for variant in variants}
    with progress_bar(len(variants) * len(positions), "xattn bench --decode",
                      progress) as bar:
        for variant in variants:
            # prefill pieces run eagerly (their shapes differ); the timed step is jitted
            prefill = _step_function(variant, jit=False)
            step = _step_function(variant, jit=backend.name == "jax",
                                  torch_compile=variant.torch_compile)
            state, seen = None, 0
            for position in positions:
                while seen < position:
                    count = min(PREFILL_CHUNK, position - seen)
                    _, state = _synced(backend, prefill(*tokens(count), state))
                    seen += count
                _synced(backend, step(*new_token, state))  # warm-up (compiles on JAX)
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    _synced(backend, step(*new_token, state))
                    times.append(time.perf_counter() - start)
                results[variant.name].append({
                    "position": position, "ms_per_token": 1e3 * statistics.median(times),
                    "all_ms": [1e3 * value for value in times],
                    "state_bytes": state_bytes(state)})
                advance(bar, f"{variant.name} at {position}")
            del state
    return results


def overtaking_position(results: dict[str, list[dict[str, Any]]], name: str,
                        reference: str = "softmax (KV cache)") -> int | None:
    """The smallest measured position from which on ``name``'s step is faster than the
    ``reference``'s at every larger measured position; None if it never is.

    Examples
    --------
    >>> from xattn.cli.decode import overtaking_position
    >>> rows = lambda times: [{"position": p, "ms_per_token": t}
    ...                       for p, t in zip([1, 2, 4], times)]
    >>> overtaking_position({"softmax (KV cache)": rows([1, 2, 4]), "rfa": rows([3, 1, 1])},
    ...                     "rfa")
    2
    """
    found = None
    for row, reference_row in zip(reversed(results[name]), reversed(results[reference]),
                                  strict=True):
        if row["ms_per_token"] >= reference_row["ms_per_token"]:
            break
        found = row["position"]
    return found


def bracket(rows: list[dict[str, Any]], found: int | None,
            key: str = "position") -> list[int | None] | None:
    """``[before, found]``: the measured value (position or length) just before ``found``
    and ``found``, the smallest from which an estimator is faster at every larger one. The
    crossing lies between them: values between two measured ones were not measured.
    ``[None, found]`` when it is faster from the first; None when ``found`` is None.

    Examples
    --------
    >>> from xattn.cli.decode import bracket
    >>> rows = [{"position": p} for p in (1024, 16384, 65536)]
    >>> bracket(rows, 65536), bracket(rows, 1024), bracket(rows, None)
    ([16384, 65536], [None, 1024], None)
    """
    if found is None:
        return None
    values = [row[key] for row in rows]
    index = values.index(found)
    return [values[index - 1] if index else None, found]


def overtaking_verdict(span: list[int | None] | None, last: int) -> str:
    """The sentence of a :func:`bracket` of the overtaking position (``last``: the largest
    measured position)."""
    if span is None:
        return ("not faster per token than softmax's cache at the measured positions (up to "
                f"{last:,})")
    before, found = span
    if before is None:
        return f"faster per token than softmax's cache at every measured position ({found:,} on)"
    return (f"faster per token than softmax's cache from a position between {before:,} and "
            f"{found:,} on (slower at {before:,}; positions between them were not measured)")


def print_decode_table(results: dict[str, list[dict[str, Any]]]) -> None:
    """Per-token time and state MiB of each variant, a row per position."""
    columns = [("position", ">8")]
    for name in results:
        header = f"{name} [ms/token]"
        columns += [(header, f">{max(13, len(header))}"), ("[MiB]", ">8")]
    positions = [row["position"] for row in next(iter(results.values()))]
    rows = []
    for index, position in enumerate(positions):
        cells = [str(position)]
        for name_rows in results.values():
            row = name_rows[index]
            cells += [f"{row['ms_per_token']:.3f}", format_bytes(row["state_bytes"])]
        rows.append(cells)
    print(format_table(columns, rows, rule=False))


def add_decode_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``xattn bench --decode``."""
    from xattn.cli.options import nonnegative_int, positive_int
    group = parser.add_argument_group("decoding (--decode)")
    group.add_argument("--decode", action="store_true",
                       help="measure per-token decoding from a state at each position of "
                       f"--lengths (default then: {','.join(map(str, DEFAULT_POSITIONS))}) "
                       "for softmax with its key-value cache, RFA and RFA with --window and "
                       "--sinks, instead of whole calls; --samples is RFA's features "
                       f"(default then: {DECODE_SAMPLES})")
    group.add_argument("--decode-steps", type=positive_int, default=9, metavar="N",
                       help="timed single-token steps per position (median; default: 9)")
    group.add_argument("--window", type=nonnegative_int, default=64,
                       help="the window of the rfa+window row (default: 64)")
    group.add_argument("--sinks", type=nonnegative_int, default=1,
                       help="the sinks of the rfa+window row (default: 1)")


def plot_decode(path: Any, results_by_backend: dict[str, dict[str, list[dict[str, Any]]]],
                title: str) -> None:
    """Per-token time (one line style per backend) and state MiB against the position."""
    from xattn.cli.figures import loglog_axes, new_figure, save_figure
    figure, (time_axes, memory_axes) = new_figure(ncols=2)
    styles = ("-", "--", ":", "-.")
    for style, (backend, results) in zip(styles, results_by_backend.items(), strict=False):
        for index, (name, rows) in enumerate(results.items()):
            positions = [row["position"] for row in rows]
            label = f"{name} ({backend})" if len(results_by_backend) > 1 else name
            time_axes.plot(positions, [row["ms_per_token"] for row in rows], style,
                           marker="o", color=f"C{index}", label=label, markersize=3)
            if style == styles[0]:  # the state's bytes do not depend on the backend
                memory_axes.plot(positions, [row["state_bytes"] / 2**20 for row in rows],
                                 marker="o", color=f"C{index}", label=name, markersize=3)
    loglog_axes(time_axes, "position (tokens already seen)", "time per new token [ms]")
    loglog_axes(memory_axes, "position (tokens already seen)", "state [MiB]")
    time_axes.set_title(title, fontsize="small")
    time_axes.legend(fontsize="x-small")
    memory_axes.legend(fontsize="x-small")
    save_figure(figure, path)


def run_decode(args: argparse.Namespace, backend: Backend, out_dir: Any,
               environment: dict[str, Any]) -> int:
    """``xattn bench --decode``: measure, print, write DIR/decode.json and DIR/decode.png."""
    from xattn.cli.common import write_json
    positions = sorted(set(args.lengths))
    samples = DECODE_SAMPLES if args.samples is None else int(args.samples)
    variants = decode_variants(samples, args.window, args.sinks, args.seed)
    print(f"xattn bench --decode: {backend.describe()}, {args.dtype}, {args.heads} heads, "
          f"D = {args.head_dim}, RFA S = {samples}, positions "
          f"{', '.join(map(str, positions))}")
    results = measure_decode(backend, variants, positions, heads=args.heads,
                             head_dim=args.head_dim, steps=args.decode_steps, seed=args.seed,
                             progress=args.progress)
    print_decode_table(results)
    overtaking = {variant.name: overtaking_position(results, variant.name)
                  for variant in variants[1:]}
    brackets = {name: bracket(results[name], position)
                for name, position in overtaking.items()}
    for name, span in brackets.items():
        print(f"{name}: {overtaking_verdict(span, positions[-1])}")
    write_json(out_dir / "decode.json", {
        "command": "bench --decode", "environment": environment, "dtype": args.dtype,
        "heads": args.heads, "head_dim": args.head_dim, "samples": samples,
        "window": args.window, "sinks": args.sinks, "steps": args.decode_steps,
        "seed": args.seed, "jit": backend.name == "jax", "positions": positions,
        "results": results, "overtaking_position": overtaking,
        "overtaking_bracket": brackets,
        "rule": "per-token time: the median of --decode-steps single-token steps from the "
                "state at that position (after a warm-up step); overtaking_position: the "
                "smallest measured position from which on the variant is faster per token "
                "than softmax with its key-value cache at every larger measured position; "
                "overtaking_bracket: [the measured position before it (null: it is the "
                "first), overtaking_position]: the crossing lies between the two, positions "
                "between them were not measured"})
    plot_decode(out_dir / "decode.png", {backend.name: results},
                f"xattn bench --decode: {backend.describe()}")
    print(f"wrote {out_dir / 'decode.json'} and {out_dir / 'decode.png'}")
    return 0
