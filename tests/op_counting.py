"""Counting the aten operations torch dispatches, for the tests that a call's count does
not grow with the sequence (as ``benchmarks/ops/bench_ops.py``'s ``OpCounter``, with the
largest tensor beside it)."""

from __future__ import annotations

from collections import Counter


def op_counter():
    """A ``TorchDispatchMode`` counting the aten operations dispatched (``count``, ``ops``
    by name) and the largest number of elements of a tensor they return (``largest``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0
            self.ops: Counter[str] = Counter()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.count += 1
            self.ops[f"aten.{func.overloadpacket.__name__}"] += 1
            for x in out if isinstance(out, tuple | list) else (out,):
                if isinstance(x, torch.Tensor):
                    self.largest = max(self.largest, x.numel())
            return out

    return OpCounter()
