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

    python benchmarks/bench_causal_rfa.py
    python benchmarks/bench_causal_rfa.py --lengths 256 --repeats 1 --output /tmp/x.json
    python benchmarks/bench_causal_rfa.py --block-sizes 64,256      # extra causal rows

On a GPU (the targets of the causal-chunk issue: causal RFA S = 64, forward plus
backward, <= causal SDPA at N >= 4096 in float32 and bfloat16, <= 0.3x at 16k), each
call ends with ``torch.cuda.synchronize()``::

    python benchmarks/bench_causal_rfa.py --device cuda --dtypes float32,bfloat16 \
        --shape 4,8,64 --features 64 --lengths 1024,4096,16384 --runs 1 \
        --output benchmarks/results/gpu_causal_rfa.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

from _common import interleaved_best_wall_and_cpu_times

import xattn

RESULTS = Path(__file__).parent / "results" / "causal_rfa_results.json"
TARGETS = {1024: 0.6, 2048: 0.35}  # causal RFA / SDPA causal
NONCAUSAL_TARGET = 2.0  # causal RFA / non-causal RFA


def measure(length, repeats, block_sizes, batch=32, heads=2, head_dim=32, features=16,
            device="cpu", dtype="float32"):
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
    if length in TARGETS and device == "cpu":
        row["target_causal_over_sdpa"] = TARGETS[length]
        row["target_causal_over_noncausal"] = NONCAUSAL_TARGET
    return row


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
    args = parser.parse_args()
    import torch

    batch, heads, head_dim = (int(x) for x in args.shape.split(","))
    settings = {"batch": batch, "heads": heads, "head_dim": head_dim,
                "features": args.features, "device": args.device}

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
        for ratio in ("causal_over_sdpa", "causal_over_noncausal"):
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
              f"{max(row['causal_over_noncausal_range']):.2f})")
    result = {"machine": platform.platform(), "processor": platform.processor(),
              "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                         else "cpu"),
              "torch_threads": args.threads, "repeats": args.repeats, "runs": args.runs,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "xattn": xattn.__version__, "rows": rows}
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
