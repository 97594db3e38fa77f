"""The CUDA kernels of one non-causal ``xattn.rfa`` forward with a fixed omega and of
performer-pytorch's ``FastAttention`` (same S), (B, H, N, D) = (4, 8, 16384, 64),
float32, S = 256: ``torch.profiler`` tables, sorted by CUDA time."""

import numpy as np
import torch
from performer_pytorch import FastAttention
from torch.profiler import ProfilerActivity, profile

import xattn
from xattn.features import sample_omega

device = torch.device("cuda")
q, k, v = (torch.randn(4, 8, 16384, 64, device=device) for _ in range(3))
omega = sample_omega(np.random.default_rng(0), 256, 64, xp=torch, dtype=torch.float32,
                     device=device)
performer = FastAttention(dim_heads=64, nb_features=256).to(device)
calls = {"xattn.rfa (fixed omega)": lambda: xattn.rfa(q, k, v, omega=omega),
         "performer FastAttention": lambda: performer(q, k, v)}
for name, call in calls.items():
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        call()
        torch.cuda.synchronize()
    print(f"== {name}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22,
                                    max_name_column_width=60))
