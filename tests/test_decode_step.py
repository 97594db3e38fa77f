"""The decoding step: one new token from a state, a short fixed sequence of operations.

A call with ``state=`` and one token takes the step of :func:`xattn._estimators.decode.step_rfa`
(RFA, every feature map, ``window`` and ``sinks``; causal LARA through it) or
:func:`xattn._estimators.decode.append_token` (softmax's key-value cache with a fused kernel). Token
by token from the first, the outputs equal one causal call on the whole sequence; a
non-finite token makes its row and every later one NaN and no earlier one; a masked one
reaches no row. On torch a step dispatches the same operations at every position, and
``torch.compile(fullgraph=True)`` of a step equals the eager step.
"""

from __future__ import annotations

import warnings

import array_api_compat
import numpy as np
import pytest

import xattn
from op_counting import op_counter
from xattn import TrigonometricDenominatorWarning

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

LENGTH, HEAD_DIM, VALUE_DIM, NUM_FEATURES = 10, 8, 3, 16
OPTIONS = {
    "positive": {},
    "hyperbolic": {"feature_map": "hyperbolic"},
    "trigonometric": {"feature_map": "trigonometric"},
    "window-sinks": {"window": 3, "sinks": 2},
    "window": {"window": 4},
    "sinks": {"sinks": 2},
    "trigonometric-window-sinks": {"feature_map": "trigonometric", "window": 3, "sinks": 2},
}


def sequence(rng, masked):
    q, k = (0.5 * rng.normal(size=(2, 3, LENGTH, HEAD_DIM)) for _ in range(2))
    v = rng.normal(size=(2, 3, LENGTH, VALUE_DIM))
    key_mask = rng.random((2, 1, LENGTH)) < 0.75 if masked else None
    return q, k, v, key_mask


def token_by_token(backend, function, arrays, key_mask, later=None, **first_options):
    """The outputs (NumPy, (..., N, Dv)) of one call per token, the first without state
    (with ``first_options``), the others with it (and ``later``)."""
    outputs, state = [], None
    for n in range(arrays[0].shape[-2]):
        piece = [backend.asarray(a[..., n:n + 1, :]) for a in arrays]
        mask = None if key_mask is None else backend.asarray(key_mask[..., n:n + 1])
        options = first_options if state is None else {"state": state, **(later or {})}
        out, state = function(*piece, key_mask=mask, causal=True, return_state=True, **options)
        # Dask: the output computed with the state (one graph run, not two)
        out, state = backend.settled((out, state))
        outputs.append(backend.to_numpy(out))
    return np.concatenate(outputs, axis=-2)


def quiet(function):
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
            return function(*args, **kwargs)
    return call


@pytest.mark.thin(name=("positive", "trigonometric-window-sinks"), masked=(True,))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_rfa_token_by_token_equals_one_call(backend, rng, name, masked):
    q, k, v, key_mask = sequence(rng, masked)
    omega = rng.normal(size=(NUM_FEATURES, HEAD_DIM))
    rfa = quiet(xattn.rfa)
    steps = token_by_token(backend, rfa, (q, k, v), key_mask, omega=backend.asarray(omega),
                           **OPTIONS[name])
    whole = rfa(*(backend.asarray(a) for a in (q, k, v)), omega=backend.asarray(omega),
                key_mask=None if key_mask is None else backend.asarray(key_mask), causal=True,
                **OPTIONS[name])
    np.testing.assert_allclose(steps, backend.to_numpy(whole), rtol=1e-9, atol=1e-11)


def test_lara_token_by_token_equals_one_call(backend, rng):
    q, k, v, key_mask = sequence(rng, masked=True)
    means = backend.asarray(0.3 * rng.normal(size=(4, HEAD_DIM)))
    options = {"num_samples": 4, "proposal_means": means, "weighting": "balance", "rng": 3}
    steps = token_by_token(backend, xattn.lara, (q, k, v), key_mask,
                           later={"num_samples": 4}, **options)
    whole = xattn.lara(*(backend.asarray(a) for a in (q, k, v)), causal=True,
                       key_mask=backend.asarray(key_mask), **options)
    np.testing.assert_allclose(steps, backend.to_numpy(whole), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("masked", [False, True])
def test_softmax_cache_token_by_token_equals_one_call(backend, rng, masked):
    q, k, v, key_mask = sequence(rng, masked)
    steps = token_by_token(backend, xattn.softmax_attention, (q, k, v), key_mask)
    whole = xattn.softmax_attention(
        *(backend.asarray(a) for a in (q, k, v)), causal=True,
        key_mask=None if key_mask is None else backend.asarray(key_mask))
    np.testing.assert_allclose(steps, backend.to_numpy(whole), rtol=1e-9, atol=1e-11)


MEANS = np.linspace(-0.4, 0.4, 4 * HEAD_DIM).reshape(4, HEAD_DIM)  # LARA's proposals


def _like(x, array):
    """``array`` (NumPy) in the library and on the device of ``x``."""
    xp = array_api_compat.array_namespace(x)
    return xp.asarray(array, device=array_api_compat.device(x))


def _rfa_case(**options):
    return quiet(lambda q, k, v, **o: xattn.rfa(q, k, v, num_features=NUM_FEATURES, rng=0,
                                               **options, **o))


STEP_CASES = {
    "rfa": _rfa_case(),
    "rfa-hyperbolic": _rfa_case(feature_map="hyperbolic"),
    "rfa-trigonometric": _rfa_case(feature_map="trigonometric"),
    "rfa-window-sinks": _rfa_case(window=3, sinks=1),
    "rfa-window": _rfa_case(window=3),
    "rfa-sinks": _rfa_case(sinks=2),
    "softmax": lambda q, k, v, **o: xattn.softmax_attention(q, k, v, **o),
    "lara": lambda q, k, v, **o: xattn.lara(
        q, k, v, num_samples=4, proposal_means=_like(q, MEANS), weighting="balance", rng=3,
        **o),
}
# looked up at each call, as in STEP_CASES: the estimators the backend fixture wraps (JIT
# on JAX, where the function object itself ran eagerly, one compile per operation and
# length; no hidden compute on Dask)
CONTINUE = {"softmax": lambda q, k, v, **o: xattn.softmax_attention(q, k, v, **o),
            "lara": lambda q, k, v, **o: xattn.lara(q, k, v, num_samples=4, **o)}


PREFILL = 4  # the tokens before the steps: two steps before the one at position 6,
# (LENGTH: three after it)


def steps_with(backend, name, q, k, v, key_mask=None, last_piece=1):
    """A prefill of :data:`PREFILL` tokens, then one call per token
    (``STEP_CASES[name]``); the last ``last_piece`` tokens in one call."""
    function = STEP_CASES[name]
    singles = range(PREFILL, LENGTH if last_piece == 1 else LENGTH - last_piece)
    pieces = [(0, PREFILL), *((n, n + 1) for n in singles)]
    if last_piece > 1:
        pieces.append((LENGTH - last_piece, LENGTH))
    # each token once (the last piece once repeated the token before it)
    assert [start for start, _ in pieces] == [0, *(stop for _, stop in pieces[:-1])]
    assert pieces[-1][1] == LENGTH
    outputs, state = [], None
    for start, stop in pieces:
        piece = [backend.asarray(a[..., start:stop, :]) for a in (q, k, v)]
        mask = None if key_mask is None else backend.asarray(key_mask[..., start:stop])
        if state is None:
            out, state = function(*piece, key_mask=mask, causal=True, return_state=True)
        else:
            out, state = quiet(CONTINUE.get(name, xattn.rfa))(
                *piece, key_mask=mask, causal=True, state=state, return_state=True)
        # Dask: the output computed with the state (one graph run, not two)
        out, state = backend.settled((out, state))
        outputs.append(backend.to_numpy(out))
    return np.concatenate(outputs, axis=-2)


# on JAX and Dask one case of each kind of step: the positive maps' (with window and
# sinks), the general one (trigonometric), softmax's cache and causal LARA's
STEP_KINDS = ("rfa-window-sinks", "rfa-trigonometric", "softmax", "lara")


@pytest.mark.thin(name=STEP_KINDS, masked=(True,))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(STEP_CASES))
def test_a_nonfinite_token_reaches_its_row_and_the_later_ones(backend, rng, name, masked):
    """Without ``key_mask`` the row's stabilizer is its largest logit as it is; with one
    (every key valid here) the query is probed and the stabilizer guarded. Each kind of
    non-finite entry against one clean run (computed once: these were five tests, each
    with its own clean run)."""
    q, k, v, _ = sequence(rng, masked=False)
    key_mask = np.ones((2, 1, LENGTH), bool) if masked else None
    clean = steps_with(backend, name, q, k, v, key_mask)
    position = 6
    kinds = [("key", np.nan), ("key", -np.inf), ("value", np.inf), ("query", np.nan),
             ("query", np.inf)]
    # Dask computes with NumPy: a key that taints the later rows, a query its own row
    for which, bad in backend.thin(kinds, kept=[kinds[1], kinds[3]], on=("dask",)):
        inputs = {"key": k.copy(), "value": v.copy(), "query": q.copy()}
        inputs[which][..., position, 1] = bad
        out = steps_with(backend, name, inputs["query"], inputs["key"], inputs["value"],
                         key_mask)
        np.testing.assert_array_equal(out[..., :position, :], clean[..., :position, :],
                                      err_msg=f"{which} = {bad}")
        if which == "query":  # a query taints its own row only
            assert np.all(np.isnan(out[..., position, :])), (which, bad)
            np.testing.assert_array_equal(out[..., position + 1:, :],
                                          clean[..., position + 1:, :], err_msg=f"{bad}")
        else:
            assert np.all(np.isnan(out[..., position:, :])), (which, bad)


@pytest.mark.thin(name=STEP_KINDS)
@pytest.mark.parametrize("name", [n for n in STEP_CASES if n.startswith("rfa")])
def test_a_state_tainted_by_a_step_taints_a_longer_piece(backend, rng, name):
    """A step keeps a non-finite key in its window or a sink slot (all NaN) until it joins
    the sums; a later call of several tokens reads the taint there too."""
    q, k, v, _ = sequence(rng, masked=False)
    k[..., 6, 1] = np.nan
    out = steps_with(backend, name, q, k, v, last_piece=3)  # steps 4..6, then 7..9
    assert np.all(np.isnan(out[..., 6:, :]))
    assert np.all(np.isfinite(out[..., :6, :]))


# softmax's cache compiles again at every length on JAX: its masked case runs elsewhere
@pytest.mark.thin(name=tuple(kind for kind in STEP_KINDS if kind != "softmax"))
@pytest.mark.parametrize("name", list(STEP_CASES))
def test_a_masked_nonfinite_token_reaches_no_row(backend, rng, name):
    q, k, v, _ = sequence(rng, masked=False)
    key_mask = np.ones((2, 1, LENGTH), bool)
    key_mask[..., 6] = False
    clean = steps_with(backend, name, q, k, v, key_mask)
    k[..., 6, :], v[..., 6, :] = np.nan, np.inf
    out = steps_with(backend, name, q, k, v, key_mask)
    np.testing.assert_allclose(out, clean, rtol=1e-12, atol=1e-14)


# the operations of one step on torch (CPU, (1, 2, ., 64) float32, S = 64 or C = 16), as
# benchmarks/ops/bench_ops.py counts them; a step at a later position dispatches the same
# (lara: 62 since the balance heuristic clips its exponents above and its sum below at its
# own term, 1: a key of large norm no longer makes the step NaN)
STEP_OPERATIONS = {"rfa": 40, "rfa-window-sinks": 60, "softmax": 12, "lara": 62}


def _step_call(name, torch, prefill):
    """``(q, k, v, state)`` of a step after ``prefill`` tokens and the function of a step."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, prefill + 1, 64, generator=generator) for _ in range(3))
    means = torch.randn(16, 64, generator=generator) / 8
    first = {"rfa": lambda *a, **o: xattn.rfa(*a, num_features=64, rng=0, **o),
             "rfa-window-sinks": lambda *a, **o: xattn.rfa(*a, num_features=64, rng=0,
                                                           window=64, sinks=1, **o),
             "softmax": xattn.softmax_attention,
             "lara": lambda *a, **o: xattn.lara(*a, num_samples=16, proposal_means=means,
                                                weighting="balance", rng=0, **o)}[name]
    _, state = first(q[..., :prefill, :], k[..., :prefill, :], v[..., :prefill, :],
                     causal=True, return_state=True)
    function = {"softmax": xattn.softmax_attention,
                "lara": lambda *a, **o: xattn.lara(*a, num_samples=16, **o)}.get(name, xattn.rfa)
    new = [x[..., prefill:, :].contiguous() for x in (q, k, v)]
    return new, state, function


@pytest.mark.parametrize("name", list(STEP_OPERATIONS))
def test_a_step_dispatches_the_same_few_operations_at_every_position(name):
    torch = pytest.importorskip("torch")
    counts = []
    for prefill in (100, 700):
        (q, k, v), state, function = _step_call(name, torch, prefill)
        with op_counter() as counter:
            function(q, k, v, causal=True, state=state, return_state=True)
        counts.append(counter.count)
    assert counts[0] == counts[1], counts
    assert counts[0] <= STEP_OPERATIONS[name], counts


@pytest.mark.parametrize("name", ["rfa", "rfa-window-sinks", "softmax", "lara"])
def test_torch_compile_fullgraph_of_a_step_equals_the_eager_step(name):
    torch = pytest.importorskip("torch")
    (q, k, v), state, function = _step_call(name, torch, 40)

    def step(q, k, v, state):
        return function(q, k, v, causal=True, state=state, return_state=True)

    eager, eager_state = step(q, k, v, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dynamo's notes on lru_cache wrappers
        compiled, compiled_state = torch.compile(step, fullgraph=True)(q, k, v, state)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    held = {"softmax": lambda state: state.keys,
            "lara": lambda state: state.features.feature_sums}.get(
                name, lambda state: state.feature_sums)
    torch.testing.assert_close(held(compiled_state), held(eager_state), rtol=1e-5, atol=1e-6)
