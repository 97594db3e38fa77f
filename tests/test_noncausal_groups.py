"""rfa and lara without ``causal``: keys and queries in groups as long as ``working_memory``
allows (``xattn._core.primitives.group_rows``).

Below the budget a call is one group: the same number of array operations at any length
(counted on torch, as ``benchmarks/ops/bench_ops.py`` counts them). Above it the groups
are merged (a running maximum per sample, the online softmax over queries of LARA's
affinities): the result does not depend on the budget, nor on an explicit ``chunk_size``
that caps the groups, beyond rounding.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import xattn
from op_counting import op_counter
from xattn import TrigonometricDenominatorWarning

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

NUM_QUERIES, NUM_KEYS, HEAD_DIM, VALUE_DIM, NUM_FEATURES = 13, 11, 6, 3, 8
# bytes: one row per group (1), groups of a few rows, of about half the rows, all rows
BUDGETS = (1, 3000, 12000, 2**30)
# on JAX and Dask: one budget that splits the call, and the whole (chunk_size=4 besides)
THIN_BUDGETS = (3000, 2**30)

RFA_CASES = {
    "positive": {},
    "hyperbolic": {"feature_map": "hyperbolic"},
    "trigonometric": {"feature_map": "trigonometric"},
    "key-mask": {"key_mask": True},
}
LARA_CASES = {
    "decoupled": {},
    "balance": {"weighting": "balance"},
    "coupled": {"weighting": "coupled"},
    "query-proposal": {"weighting": "query_proposal"},
    "masks": {"key_mask": True, "query_mask": True},
}


def arrays(rng):
    q = rng.normal(size=(2, NUM_QUERIES, HEAD_DIM))
    k = rng.normal(size=(2, NUM_KEYS, HEAD_DIM))
    v = rng.normal(size=(2, NUM_KEYS, VALUE_DIM))
    return q, k, v


def masks(options, backend):
    """``key_mask``/``query_mask`` True in ``options`` become masks with a key or query
    left out in each batch element, and batch element 1 without any allowed key."""
    options = dict(options)
    if options.get("key_mask"):
        mask = np.arange(NUM_KEYS) % 4 != 1
        options["key_mask"] = backend.asarray(np.stack([mask, np.zeros_like(mask)]))
    if options.get("query_mask"):
        options["query_mask"] = backend.asarray(np.arange(NUM_QUERIES) % 5 != 2)
    return options


@pytest.mark.parametrize("case", list(RFA_CASES))
def test_rfa_result_does_not_depend_on_working_memory(backend, rng, case):
    q, k, v = (backend.asarray(x) for x in arrays(rng))
    omega = backend.asarray(rng.normal(size=(NUM_FEATURES, HEAD_DIM)))
    options = masks(RFA_CASES[case], backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        outputs = [backend.to_numpy(xattn.rfa(q, k, v, omega=omega, working_memory=budget,
                                              **options))
                   for budget in backend.thin(BUDGETS, kept=THIN_BUDGETS)]
        capped = backend.to_numpy(xattn.rfa(q, k, v, omega=omega, chunk_size=4, **options))
    for out in [*outputs[:-1], capped]:
        np.testing.assert_allclose(out, outputs[-1], rtol=1e-10, atol=1e-12)
    if "key_mask" in options:  # no allowed key: a zero row, never NaN
        assert np.all(outputs[-1][1] == 0)
    assert np.all(np.isfinite(outputs[-1]))


# JAX, Dask: the masks (with the default weighting) and the query proposal (its own pass
# over the queries); the other weightings change the weights, not the grouping
@pytest.mark.thin(case=("masks", "query-proposal"))
@pytest.mark.parametrize("case", list(LARA_CASES))
def test_lara_result_does_not_depend_on_working_memory(backend, rng, case):
    q, k, v = (backend.asarray(x) for x in arrays(rng))
    options = masks(LARA_CASES[case], backend)
    outputs = [backend.to_numpy(xattn.lara(q, k, v, num_samples=4, rng=3,
                                           working_memory=budget, **options))
               for budget in backend.thin(BUDGETS, kept=THIN_BUDGETS)]
    capped = backend.to_numpy(xattn.lara(q, k, v, num_samples=4, rng=3, chunk_size=4,
                                         **options))
    for out in [*outputs[:-1], capped]:
        np.testing.assert_allclose(out, outputs[-1], rtol=1e-10, atol=1e-12)
    assert np.all(np.isfinite(outputs[-1]))


COUNTED_CALLS = {
    "rfa": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega),
    "rfa-hyperbolic": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega,
                                                       feature_map="hyperbolic"),
    "rfa-trigonometric": lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega,
                                                          feature_map="trigonometric"),
    "lara": lambda q, k, v, omega: xattn.lara(q, k, v, num_samples=16, rng=0),
    "lara-balance": lambda q, k, v, omega: xattn.lara(q, k, v, num_samples=16, rng=0,
                                                      weighting="balance"),
}


def count(call, length, backward=False, **options):
    """Aten operations of one call on torch (CPU, float32, (1, 2, length, 16))."""
    import torch

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, 16, generator=generator, requires_grad=backward)
               for _ in range(3))
    omega = torch.randn(16, 16, generator=generator)
    with warnings.catch_warnings(), op_counter() as counter:
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        out = call(q, k, v, omega, **options)
        if backward:
            out.sum().backward()
    return counter.count


@pytest.mark.parametrize("name", list(COUNTED_CALLS))
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_operations_do_not_grow_with_the_sequence_below_the_budget(name, backward):
    """One group at both lengths (the CPU's 64 MiB hold both); chunks of 1,024 rows
    would add operations per chunk."""
    pytest.importorskip("torch")
    assert count(COUNTED_CALLS[name], 509, backward) == count(COUNTED_CALLS[name], 4093,
                                                               backward)


def test_a_smaller_budget_makes_groups():
    """Above the budget the keys and queries go in groups (more operations), and an
    explicit ``chunk_size`` caps them the same way."""
    pytest.importorskip("torch")

    def rfa(q, k, v, omega, **options):
        return xattn.rfa(q, k, v, omega=omega, **options)

    whole = count(rfa, 512)
    grouped = count(rfa, 512, working_memory=2**16)
    assert grouped > whole
    assert count(rfa, 512, chunk_size=64) > whole
