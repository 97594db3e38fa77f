"""The operation counter of ``benchmarks/bench_ops.py``: one dispatched aten operation
for one torch operation, and for the forward of ``scaled_dot_product_attention``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "bench_ops.py"


@pytest.fixture(scope="module")
def bench_ops():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("bench_ops", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ops"] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_ops", None)


def test_one_torch_add_is_one_operation(bench_ops):
    import torch
    x = torch.ones(3)
    with bench_ops.OpCounter() as counter:
        out = torch.add(x, x)
    assert (counter.count, counter.compute) == (1, 1)
    assert dict(counter.ops) == {"aten.add": 1}
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_sdpa_forward_is_one_operation_and_views_are_told_apart(bench_ops):
    import torch
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    counts = bench_ops.count_ops(lambda: sdpa(q, k, v, is_causal=True))
    assert (counts["ops"], counts["compute_ops"]) == (1, 1)
    with bench_ops.OpCounter() as counter:
        q.transpose(-1, -2).sum()
    assert (counter.count, counter.compute) == (2, 1)
