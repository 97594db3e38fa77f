"""Causal RFA in training: forward plus backward against SDPA and non-causal RFA, torch.

The targets (issue "Causal RFA in training", part 4), torch, (32, 2, N, 32), S = 16,
forward plus backward (the sum of the output, backward to q, k, v):

* causal RFA / ``scaled_dot_product_attention(is_causal=True)``: <= 0.35 at N = 2048 and
  <= 0.6 at N = 1024;
* causal RFA / non-causal RFA: <= 2 at both lengths.

Each round calls, in turn, SDPA (causal), ``xattn.rfa`` without and with ``causal=True``
(and ``causal=True`` at each of ``--block-sizes``, if given), so a change of load affects
all alike; the best wall time (and, beside it, the best CPU time of the process) of the
rounds is reported, after one warm-up call each. The same samples for every RFA call
(``rng=0``). The whole measurement is repeated ``--runs`` times per length (the best
times of a virtual machine's cores move by 10 to 20 % from one run to the next); the
ratios reported are the medians over the runs, with their range beside them. A full run
(N = 1024, 2048; 3 runs of 5 rounds) takes about two minutes on two cores::

    python benchmarks/ops/bench_causal_rfa.py
    python benchmarks/ops/bench_causal_rfa.py --lengths 256 --repeats 1 --output /tmp/x.json
    python benchmarks/ops/bench_causal_rfa.py --block-sizes 64,256      # extra causal rows

``--compile`` adds causal RFA compiled whole (``torch.compile(fullgraph=True)``, inductor,
the same int seed; compiled in its warm-up call) beside the eager call and SDPA, with
``compiled_causal_over_sdpa`` and ``compiled_over_eager``, and the decode step eager and
under ``mode="reduce-overhead"`` (CUDA graphs on a GPU). The CPU rows of the compiled-path
issue ((4, 8, N, 64), S = 64, default working memory, an int seed)::

    python benchmarks/ops/bench_causal_rfa.py --compile --shape 4,8,64 --features 64 \
        --lengths 4096,8192 --dtypes float32,bfloat16 --runs 2 --repeats 3 \
        --output benchmarks/results/causal_rfa_compiled_cpu.json

On a GPU (the targets of the causal-chunk issue: causal RFA S = 64, forward plus
backward, <= causal SDPA at N >= 4096 in float32 and bfloat16, <= 0.3x at 16k), each
call ends with ``torch.cuda.synchronize()``::

    python benchmarks/ops/bench_causal_rfa.py --device cuda --dtypes float32,bfloat16 \
        --shape 4,8,64 --features 64 --lengths 1024,4096,16384 --runs 1 \
        --output benchmarks/results/gpu_causal_rfa.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common
from _common import interleaved_best_wall_and_cpu_times

import xattn

RESULTS = Path(__file__).resolve().parents[1] / "results" / "causal_rfa_results.json"
TARGETS = {1024: 0.6, 2048: 0.35}  # causal RFA / SDPA causal
NONCAUSAL_TARGET = 2.0  # causal RFA / non-causal RFA


def measure(length, repeats, block_sizes, batch=32, heads=2, head_dim=32, features=16,
            device="cpu", dtype="float32", compiled=False):
    """Best times (s) of each call at one length, and the ratios of the targets."""
    import torch

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator)
               .to(device=device, dtype=getattr(torch, dtype)).requires_grad_()
               for _ in range(3))
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(function):
        for leaf in (q, k, v):
            leaf.grad = None
        function(q, k, v).sum().backward()
        synchronize()

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {
        "sdpa_causal": lambda: step(lambda a, b, c: sdpa(a, b, c, is_causal=True)),
        "rfa": lambda: step(lambda a, b, c: xattn.rfa(a, b, c, num_features=features, rng=0)),
        "rfa_causal": lambda: step(lambda a, b, c: xattn.rfa(a, b, c, num_features=features,
                                                             rng=0, causal=True)),
    }
    if compiled:  # the same call compiled whole (inductor), drawing from the same seed
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            causal_rfa = torch.compile(
                lambda a, b, c: xattn.rfa(a, b, c, num_features=features, rng=0, causal=True),
                fullgraph=True)
        calls["rfa_causal_compiled"] = lambda: step(causal_rfa)
    for size in block_sizes:
        calls[f"rfa_causal_block{size}"] = (
            lambda size=size: step(lambda a, b, c: xattn.rfa(
                a, b, c, num_features=features, rng=0, causal=True, block_size=size)))
    best = interleaved_best_wall_and_cpu_times(calls, repeats)
    wall = {name: times["wall_s"] for name, times in best.items()}
    row = {"length": length, "shape": [batch, heads, length, head_dim], "dtype": dtype,
           "num_features": features, "wall_s": wall,
           "cpu_s": {name: times["cpu_s"] for name, times in best.items()},
           "causal_over_sdpa": wall["rfa_causal"] / wall["sdpa_causal"],
           "causal_over_noncausal": wall["rfa_causal"] / wall["rfa"]}
    if compiled:
        row["compiled_causal_over_sdpa"] = wall["rfa_causal_compiled"] / wall["sdpa_causal"]
        row["compiled_over_eager"] = wall["rfa_causal_compiled"] / wall["rfa_causal"]
    if length in TARGETS and device == "cpu":
        row["target_causal_over_sdpa"] = TARGETS[length]
        row["target_causal_over_noncausal"] = NONCAUSAL_TARGET
    return row


def decode_step_times(device, dtype, features, head_dim, heads, repeats, prefill=1024,
                      steps=200):
    """Median time (ms) of one causal RFA decode step (one token, ``state=``) after a
    prefill, eager and under ``torch.compile(fullgraph=True, mode="reduce-overhead")``
    (CUDA graphs on a GPU; on a CPU the mode compiles without them)."""
    import time
    import warnings

    import torch

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, prefill + steps, head_dim, generator=generator)
               .to(device=device, dtype=getattr(torch, dtype)) for _ in range(3))
    _, state = xattn.rfa(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :],
                         num_features=features, rng=0, causal=True, return_state=True)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step(q, k, v, state):
        return xattn.rfa(q, k, v, causal=True, state=state, return_state=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    times = {}
    for name, function in (("eager", step), ("compiled", compiled)):
        current, samples = state, []
        for position in range(prefill, prefill + steps):
            rows = [x[..., position:position + 1, :].contiguous() for x in (q, k, v)]
            synchronize()
            started = time.perf_counter()
            _, current = function(*rows, current)
            synchronize()
            samples.append(time.perf_counter() - started)
            if name == "compiled":  # CUDA graphs reuse their output buffers
                current = dataclasses.replace(current, **{
                    field.name: getattr(current, field.name).clone()
                    for field in dataclasses.fields(current)
                    if field.init and isinstance(getattr(current, field.name), torch.Tensor)})
        times[name] = 1e3 * statistics.median(samples[steps // 4:])  # after the compiles
    return {"dtype": dtype, "prefill": prefill, "steps": steps, "num_features": features,
            "mode": "reduce-overhead", "eager_ms": times["eager"],
            "compiled_ms": times["compiled"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3,
                        help="measurements per length; the ratios are their medians")
    parser.add_argument("--block-sizes", default="",
                        help="extra causal rows at these block sizes (comma list)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--dtypes", default="float32", help="comma list (float32, bfloat16)")
    parser.add_argument("--shape", default="32,2,32", help="batch,heads,head_dim")
    parser.add_argument("--features", type=int, default=16, help="RFA's num_features")
    parser.add_argument("--compile", action="store_true",
                        help="also time causal rfa under torch.compile(fullgraph=True) "
                             "(inductor; compiled in the warm-up call), and a decode step "
                             "(torch.compile, mode='reduce-overhead': CUDA graphs on a GPU)")
    args = parser.parse_args()
    import torch

    batch, heads, head_dim = (int(x) for x in args.shape.split(","))
    settings = {"batch": batch, "heads": heads, "head_dim": head_dim,
                "features": args.features, "device": args.device, "compiled": args.compile}

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    block_sizes = [int(x) for x in args.block_sizes.split(",") if x]
    load_before = os.getloadavg()
    rows = []
    for dtype, length in ((dtype, length) for dtype in args.dtypes.split(",")
                          for length in lengths):
        runs = []
        for _ in range(args.runs):
            runs.append(measure(length, args.repeats, block_sizes, dtype=dtype, **settings))
            print(f"{dtype} N = {length}: " + ", ".join(f"{name} {1e3 * t:.1f} ms"
                                                for name, t in runs[-1]["wall_s"].items())
                  + f"; causal / SDPA {runs[-1]['causal_over_sdpa']:.2f}"
                  + f", causal / non-causal {runs[-1]['causal_over_noncausal']:.2f}")
        row = {key: runs[0][key] for key in ("length", "shape", "dtype", "num_features")}
        for ratio in ("causal_over_sdpa", "causal_over_noncausal", "compiled_causal_over_sdpa",
                      "compiled_over_eager"):
            if ratio not in runs[0]:
                continue
            values = [run[ratio] for run in runs]
            row[ratio] = statistics.median(values)
            row[f"{ratio}_range"] = [min(values), max(values)]
        row.update({key: value for key, value in runs[0].items() if key.startswith("target")})
        row["runs"] = runs
        rows.append(row)
        print(f"{dtype} N = {length}, median of {args.runs} runs: causal / SDPA "
              f"{row['causal_over_sdpa']:.2f}, causal / non-causal "
              f"{row['causal_over_noncausal']:.2f} (range "
              f"{min(row['causal_over_noncausal_range']):.2f} to "
              f"{max(row['causal_over_noncausal_range']):.2f})"
              + (f", compiled / SDPA {row['compiled_causal_over_sdpa']:.2f}, compiled / eager "
                 f"{row['compiled_over_eager']:.2f}" if args.compile else ""))
    decode = ([decode_step_times(args.device, dtype, args.features, head_dim, heads,
                                 args.repeats) for dtype in args.dtypes.split(",")]
              if args.compile else [])
    for entry in decode:
        print(f"{entry['dtype']} decode step after {entry['prefill']} tokens: eager "
              f"{entry['eager_ms']:.3f} ms, compiled ({entry['mode']}) "
              f"{entry['compiled_ms']:.3f} ms")
    result = {"machine": platform.platform(), "processor": platform.processor(),
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                         else "cpu"),
              "torch_threads": args.threads, "repeats": args.repeats, "runs": args.runs,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "xattn": xattn.__version__, "compile": args.compile, "rows": rows,
              "decode_step": decode}
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
