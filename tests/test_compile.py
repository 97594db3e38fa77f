"""``torch.compile(fullgraph=True)`` of every estimator's main paths equals eager.

Each path is compiled whole, with no graph break allowed: causal and non-causal ``rfa``
with each feature map, ``rfa`` with a window and sinks, ``lara`` (causal and not), ``ra``
and ``softmax_attention`` (the decode steps are compiled in ``test_decode_step.py``).
Dynamo's tracing is what fails when the code uses something it cannot trace (a
``functools.cached_property``'s lock on Python 3.11 broke causal ``rfa`` once), so most
paths compile with the ``aot_eager`` backend (dynamo and AOTAutograd, no code
generation); causal ``rfa``, the training path, also compiles its backward pass.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import xattn

torch = pytest.importorskip("torch")

#: (batch, heads, N, D): N = 256 is four chunks of the causal scan's 64 positions.
SHAPE = (1, 2, 256, 16)


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v = (torch.asarray(rng.normal(size=SHAPE), dtype=torch.float32) for _ in range(3))
    omega = torch.asarray(rng.normal(size=(32, SHAPE[-1])), dtype=torch.float32)
    proposal_means = 0.3 * q[..., :4, :]
    return q, k, v, omega, proposal_means


GLOBAL = xattn.random.TorchDefaultGenerator()

#: name -> the call, with the samples fixed outside it (omega) or drawn from torch's global
#: generator (dynamo traces it; not a torch.Generator object or NumPy's)
PATHS = {
    "rfa-positive": lambda q, k, v, om, mu: xattn.rfa(q, k, v, omega=om),
    "rfa-hyperbolic": lambda q, k, v, om, mu: xattn.rfa(q, k, v, omega=om,
                                                        feature_map="hyperbolic"),
    "rfa-trigonometric": lambda q, k, v, om, mu: xattn.rfa(q, k, v, omega=om,
                                                           feature_map="trigonometric"),
    "causal-rfa-positive": lambda q, k, v, om, mu: xattn.rfa(q, k, v, omega=om, causal=True),
    "causal-rfa-hyperbolic": lambda q, k, v, om, mu: xattn.rfa(
        q, k, v, omega=om, feature_map="hyperbolic", causal=True),
    "causal-rfa-trigonometric": lambda q, k, v, om, mu: xattn.rfa(
        q, k, v, omega=om, feature_map="trigonometric", causal=True),
    "causal-rfa-window-sinks": lambda q, k, v, om, mu: xattn.rfa(
        q, k, v, omega=om, causal=True, window=32, sinks=2),
    "lara": lambda q, k, v, om, mu: xattn.lara(q, k, v, num_samples=4, rng=GLOBAL),
    "causal-lara": lambda q, k, v, om, mu: xattn.lara(
        q, k, v, num_samples=4, proposal_means=mu, weighting="query_proposal", causal=True,
        rng=GLOBAL),
    "ra": lambda q, k, v, om, mu: xattn.ra(q, k, v, num_samples=2, rng=GLOBAL),
    "causal-ra": lambda q, k, v, om, mu: xattn.ra(q, k, v, num_samples=2, rng=GLOBAL,
                                                  causal=True),
    "softmax": lambda q, k, v, om, mu: xattn.softmax_attention(q, k, v),
    "causal-softmax": lambda q, k, v, om, mu: xattn.softmax_attention(q, k, v, causal=True),
}


def _compiled(function, backend):
    torch._dynamo.reset()
    return torch.compile(function, fullgraph=True, backend=backend)


@pytest.mark.parametrize("name", sorted(PATHS))
def test_fullgraph_compile_equals_eager(name):
    inputs = _inputs()
    torch.manual_seed(0)
    eager = PATHS[name](*inputs)
    torch.manual_seed(0)  # the same draws (aot_eager runs torch's own random operations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dynamo's notes on lru_cache wrappers
        compiled = _compiled(PATHS[name], "aot_eager")(*inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_causal_rfa_compiles_forward_and_backward():
    q, k, v, omega, _ = _inputs()

    def loss(q, k, v):
        return (xattn.rfa(q, k, v, omega=omega, causal=True) ** 2).sum()

    arrays = [x.clone().requires_grad_() for x in (q, k, v)]
    eager_loss = loss(*arrays)
    eager_grads = torch.autograd.grad(eager_loss, arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        compiled_loss = _compiled(loss, "aot_eager")(*arrays)
    compiled_grads = torch.autograd.grad(compiled_loss, arrays)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-4)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-5)
