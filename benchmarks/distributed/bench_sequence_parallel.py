"""Communication and memory of one causal sequence split across devices (``sequence_parallel=``).

On P simulated host devices (``--xla_force_host_platform_device_count``), q, k, v of
shape (1, 2, N, 64), float32, S = 64 features, for N = 4,096 to 32,768:

- **causal** ``xattn.rfa`` under :func:`jax.shard_map` with ``sequence_parallel="sp"``
  (plain, and ``window=64, sinks=4``) and causal ``xattn.lara``: the collectives of the
  compiled program (forward, and forward with the gradients of q, k and v) with their
  operand and result bytes, and the program's temporary bytes per device
  (``memory_analysis()``) against those of a one-device call on N / P positions;
- the same causal ``xattn.rfa`` left to the compiler (GSPMD: ``jax.jit`` of the plain call
  on inputs sharded along N with a ``NamedSharding``), for comparison;
- **non-causal** ``xattn.rfa`` and ``xattn.lara`` under GSPMD: what the compiler makes of
  the key statistics (no ``sequence_parallel`` argument there).

Counts from the compiled HLO, not timings: the figures do not depend on the machine's load.
::

    python benchmarks/distributed/bench_sequence_parallel.py               # about two minutes
    python benchmarks/distributed/bench_sequence_parallel.py --devices 4 --lengths 4096,8192

Writes ``benchmarks/results/sequence_parallel.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|"
                        r"reduce-scatter)(-start)?\(")
SHAPE = re.compile(r"\b(f64|f32|f16|bf16|s64|s32|u32|s8|u8|pred)\[([\d,]*)\]")
ITEMSIZE = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1,
            "u8": 1, "pred": 1}


def _bytes(text: str) -> int:
    total = 0
    for dtype, dims in SHAPE.findall(text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * ITEMSIZE[dtype]
    return total


def collectives(hlo: str) -> dict[str, int]:
    """The cross-device collectives of a compiled HLO text: how many, and the bytes of
    their results, per device (what a device receives: an all-gather's result is P times
    its operand, an all-reduce's equals it; the larger of the two is counted)."""
    count = result = 0
    for line in hlo.splitlines():
        found = COLLECTIVE.search(line)
        if found:
            count += 1
            result += _bytes(line[:found.start()].split("=", 1)[-1])
    return {"collectives": count, "bytes": result}


def measure(devices: int, lengths: list[int]) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xattn

    # Auto axes: jax.jit's GSPMD partitions the one-device calls as it would by default
    mesh = jax.make_mesh((devices,), ("sp",), axis_types=(AxisType.Auto,))
    spec = P(None, None, "sp", None)
    features, means = 64, 0.1 * np.random.default_rng(1).normal(size=(64, 64))
    calls = {
        "rfa": dict(estimator=xattn.rfa, num_features=features, rng=0),
        "rfa_window": dict(estimator=xattn.rfa, num_features=features, rng=0, window=64,
                           sinks=4),
        "lara": dict(estimator=xattn.lara, num_samples=features, rng=0,
                     proposal_means=jnp.asarray(means, jnp.float32),
                     weighting="query_proposal"),
    }

    def call_of(options: dict, **extra: object):
        options = dict(options)
        estimator = options.pop("estimator")
        return lambda q, k, v: estimator(q, k, v, **options, **extra)

    def programs(function, args):
        def loss(q, k, v):
            return jnp.sum(function(q, k, v) ** 2)
        forward = jax.jit(function).lower(*args).compile()
        backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        return forward, backward

    def summary(forward, backward) -> dict:
        return {"forward": collectives(forward.as_text()),
                "forward_backward": collectives(backward.as_text()),
                "temp_bytes_forward": forward.memory_analysis().temp_size_in_bytes,
                "temp_bytes_forward_backward": backward.memory_analysis().temp_size_in_bytes}

    report: dict = {"devices": devices, "shape": "(1, 2, N, 64)", "dtype": "float32",
                    "features": features, "lengths": lengths, "causal": {}, "gspmd": {}}
    for length in lengths:
        shaped = jax.ShapeDtypeStruct((1, 2, length, 64), jnp.float32)
        local = jax.ShapeDtypeStruct((1, 2, length // devices, 64), jnp.float32)
        sharded = jax.ShapeDtypeStruct((1, 2, length, 64), jnp.float32,
                                       sharding=NamedSharding(mesh, spec))
        for name, options in calls.items():
            parallel = jax.shard_map(call_of(options, causal=True, sequence_parallel="sp"),
                                     mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
            entry = summary(*programs(parallel, (sharded,) * 3))
            one = summary(*programs(call_of(options, causal=True), (local,) * 3))
            for key in ("temp_bytes_forward", "temp_bytes_forward_backward"):
                entry[f"one_device_{key}_at_N_over_P"] = one[key]
            report["causal"].setdefault(name, {})[str(length)] = entry
            print(name, length, entry, file=sys.stderr)
        for name, options in (("rfa_causal", dict(calls["rfa"], causal=True)),
                              ("rfa", calls["rfa"]),
                              ("lara", dict(estimator=xattn.lara, num_samples=features,
                                            rng=0))):
            entry = summary(*programs(call_of(options), (sharded,) * 3))
            report["gspmd"].setdefault(name, {})[str(length)] = entry
            print("gspmd", name, length, entry, file=sys.stderr)
        del shaped
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--lengths", default="4096,32768")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"
                                             / "sequence_parallel.json"))
    args = parser.parse_args()
    report = measure(args.devices, [int(n) for n in args.lengths.split(",")])
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
