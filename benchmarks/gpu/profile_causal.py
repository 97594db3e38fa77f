"""The CUDA kernels of one causal ``xattn.rfa`` training step (forward, then backward of
the output's sum) at (B, H, N, D) = (4, 8, 16384, 64), S = 64, in float32 and bfloat16,
beside causal SDPA's: ``torch.profiler`` tables sorted by CUDA time, and the sum of the
CUDA kernels' times per call.

    python benchmarks/gpu/profile_causal.py [--length 16384]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import xattn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--length", type=int, default=16384)
parser.add_argument("--rows", type=int, default=18)
args = parser.parse_args()
device = torch.device("cuda")
sdpa = torch.nn.functional.scaled_dot_product_attention


def step(call, leaves):
    """One training step: the call, then the backward of its output's sum."""
    for leaf in leaves:
        leaf.grad = None
    call(*leaves).sum().backward()


for dtype in (torch.float32, torch.bfloat16):
    generator = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(4, 8, args.length, 64, device=device, generator=generator,
                          dtype=dtype).requires_grad_() for _ in range(3)]
    calls = {"xattn.rfa(causal=True, num_features=64)":
             lambda q, k, v: xattn.rfa(q, k, v, num_features=64, rng=0, causal=True),
             "sdpa(is_causal=True)": lambda q, k, v: sdpa(q, k, v, is_causal=True)}
    for name, call in calls.items():
        for _ in range(3):
            step(call, leaves)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step(call, leaves)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernel_events = [event for event in events if event.device_type.name == "CUDA"]
        kernels = sum(event.self_device_time_total for event in kernel_events) / 1e3
        launches = sum(event.count for event in kernel_events)
        print(f"== {name}, {str(dtype).removeprefix('torch.')}, N = {args.length}: "
              f"CUDA kernels {kernels:.2f} ms in {launches} launches")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows,
                           max_name_column_width=55))
