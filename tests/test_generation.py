"""Generation: a causal sequence given in pieces (``return_state=True``, then ``state=``).

The property under test, on every backend: for random splits of a sequence into a
prefill and continuation calls (empty calls and single tokens included), the outputs and
the final state equal those of one causal call on the whole sequence, 1e-10 in float64
and 1e-5 relative in float32. RFA with every feature map, with window and sinks, with
masks and with scores that need the stabilizer; softmax attention and RA with their
key-value caches (RA's random forms against the float64 reference with the draws each
piece makes). Then: the decode loop under jax.jit and jax.lax.scan, torch autograd through
the state, the fixed size of RFA's state, masked keys, and the errors of misuse.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import xattn
from xattn import TrigonometricDenominatorWarning
from xattn.random import HostGenerator

import reference

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

PIECE_LENGTHS = (0, 1, 1, 2, 5, 9)  # the pieces that random splits are made of


def random_pieces(seed, total, choices=PIECE_LENGTHS):
    """Lengths of the pieces of a sequence of ``total`` tokens: an empty prefill, random
    pieces of ``choices`` (empty calls and single tokens among them), and a tail of
    single tokens with an empty call, as a decode loop makes."""
    rng = np.random.default_rng(seed)
    lengths = [0]
    while sum(lengths) < total - 3:
        lengths.append(min(int(rng.choice(choices)), total - 3 - sum(lengths)))
    return [*lengths, 1, 0, 1, 1]


def costly(backend):
    """JAX compiles each new length of a piece and Dask builds and computes a graph per
    call."""
    return backend.name.startswith(("jax", "dask"))


def length_for(backend):
    """The length of the sequences split by :func:`pieces_for`: 23, and on JAX and Dask
    21, which its pieces of 9 fill with no other length left over (each new length is one
    more compile, one more graph); neither is a multiple of RFA's blocks of 4 and 8 or of
    softmax attention's chunks of 4."""
    return 21 if costly(backend) else 23


def pieces_for(backend, seed, total=None):
    """:func:`random_pieces` of ``total`` tokens (default :func:`length_for`) for
    ``backend``: on JAX and Dask the pieces are of 9 tokens (and the rest), an empty
    prefill and the decode loop's tail of single tokens and an empty call; the random mix
    of every length runs on NumPy, array-api-strict and torch."""
    total = length_for(backend) if total is None else total
    if costly(backend):
        return random_pieces(seed, total, (9,))
    return random_pieces(seed, total)


def make_sequence(rng, batch=(2, 3), length=23, head_dim=8, value_dim=3, spread=0.5):
    q = spread * rng.normal(size=(*batch, length, head_dim))
    k = spread * rng.normal(size=(*batch, length, head_dim))
    v = rng.normal(size=(*batch, length, value_dim))
    return q, k, v


def key_mask_for(rng, batch, length):
    """Random masked keys, broadcast over the heads; a batch row's first keys all masked
    (queries without keys: zero rows)."""
    mask = rng.random((batch[0], 1, length)) < 0.75
    mask[0, 0, :3] = False
    return mask


def in_pieces(function, backend, arrays, lengths, key_mask=None, dtype=None, first=None,
              **options):
    """Call ``function`` on consecutive pieces of ``arrays`` (q, k, v as NumPy arrays),
    the first with ``first`` options and ``return_state=True``, the others with the
    state; returns the joined outputs (NumPy) and the final state."""
    outputs, state = [], None
    start = 0
    for length in lengths:
        piece = [backend.asarray(a[..., start:start + length, :], dtype=dtype) for a in arrays]
        mask = None if key_mask is None else backend.asarray(key_mask[..., start:start + length])
        extra = dict(first or {}) if state is None else {"state": state}
        out, state = function(*piece, key_mask=mask, causal=True, return_state=True,
                              **extra, **options)
        # Dask: the output computed with the state (one graph run, not two)
        out, state = backend.settled((out, state))
        assert out.dtype == piece[0].dtype
        assert tuple(out.shape[-2:]) == (length, arrays[2].shape[-1])
        outputs.append(backend.to_numpy(out))
        start += length
    assert start == arrays[0].shape[-2]
    return np.concatenate(outputs, axis=-2), state


def whole(function, backend, arrays, key_mask=None, dtype=None, **options):
    """One causal call on the whole sequence: the output (NumPy) and its state."""
    out, state = function(*(backend.asarray(a, dtype=dtype) for a in arrays),
                          key_mask=None if key_mask is None else backend.asarray(key_mask),
                          causal=True, return_state=True, **options)
    # Dask: the output and every array of the state computed in one run of the graph
    # (each read of a lazy state's array would run the whole call again)
    return backend.settled((out, state))


def assert_same_state(backend, state, expected, rtol):
    """Two states of one sequence: the same buffers and position, and the same
    random-feature sums once both are taken to the expected state's maxima."""
    assert type(state) is type(expected)
    if isinstance(state, xattn.RFAState):
        assert (state.feature_map, state.window, state.sinks) == (
            expected.feature_map, expected.window, expected.sinks)
        assert state.scale == pytest.approx(expected.scale, rel=1e-15)
        assert int(backend.to_numpy(state.position)) == int(backend.to_numpy(expected.position))
        maximum, expected_maximum = (backend.to_numpy(s.feature_max) for s in (state, expected))
        np.testing.assert_array_equal(np.isfinite(maximum), np.isfinite(expected_maximum))
        finite = np.isfinite(maximum)
        np.testing.assert_allclose(maximum[finite], expected_maximum[finite], rtol=rtol,
                                   atol=rtol)
        factor = np.exp(np.where(finite, maximum, 0.0) - np.where(finite, expected_maximum, 0.0))
        if maximum.ndim < state.feature_sums.ndim:  # (..., F): one factor per sample
            factor = factor[..., None]
        pairs = [(state.feature_sums, expected.feature_sums)]
        if expected.feature_weight is not None:
            pairs.append((state.feature_weight, expected.feature_weight))
        for name in ("omega", "window_keys", "window_values", "sink_keys", "sink_values"):
            np.testing.assert_allclose(backend.to_numpy(getattr(state, name)),
                                       backend.to_numpy(getattr(expected, name)), rtol=rtol)
        for name in ("window_valid", "sink_valid"):
            np.testing.assert_array_equal(backend.to_numpy(getattr(state, name)),
                                          backend.to_numpy(getattr(expected, name)))
        for sums, expected_sums in pairs:
            expected_sums = backend.to_numpy(expected_sums)
            np.testing.assert_allclose(factor * backend.to_numpy(sums), expected_sums, rtol=rtol,
                                       atol=rtol * np.max(np.abs(expected_sums), initial=1.0))
        return
    assert state.position == expected.position
    for name in ("keys", "values", "valid"):
        np.testing.assert_allclose(backend.to_numpy(getattr(state, name)),
                                   backend.to_numpy(getattr(expected, name)), rtol=rtol)


def quiet(call, *args, **kwargs):
    """Run ``call`` ignoring the trigonometric guard's warning (small S can clamp a row)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        return call(*args, **kwargs)


# RFA: pieces equal one call -------------------------------------------------------------------

# (feature_map, window, sinks, masked); JAX compiles every piece length anew and Dask
# builds a graph per piece (seconds each): they run the first four, which take every path
# (band, sinks, both; the plain causal scan is in the tests below) of every map
RFA_CASES = [
    ("positive", 4, 3, True),
    ("hyperbolic", 3, None, True),
    ("trigonometric", 4, 3, True),
    ("hyperbolic", None, 2, False),
    ("positive", None, None, True),
    ("trigonometric", None, None, False),
    ("positive", None, None, False),
    ("positive", 4, 3, False),
    ("positive", 1, 7, True),
    ("positive", 30, 0, False),
    ("hyperbolic", None, None, True),
    ("trigonometric", 0, 2, True),
]


@pytest.mark.parametrize("case", range(len(RFA_CASES)),
                         ids=["-".join(map(str, case)) for case in RFA_CASES])
def test_rfa_pieces_equal_one_call(backend, rng, case):
    feature_map, window, sinks, masked = RFA_CASES[case]
    if backend.name.startswith(("jax", "dask")) and case >= 4:
        pytest.skip("JAX, Dask: the first four cases take every path (each piece compiles)")
    if backend.name == "dask" and case == 2:
        pytest.skip("Dask: the trigonometric map's pieces are NumPy's lines (run on NumPy, "
                    "torch and JAX); the band and sinks of case 0")
    xp = backend.ns
    length = length_for(backend)
    arrays = make_sequence(rng, length=length,
                           spread=0.3 if feature_map == "trigonometric" else 0.5)
    key_mask = key_mask_for(rng, (2, 3), length) if masked else None
    options = dict(num_features=32, rng=0, feature_map=feature_map, window=window, sinks=sinks)
    out, state = quiet(in_pieces, xattn.rfa, backend, arrays, pieces_for(backend, case),
                       key_mask=key_mask, first=options, block_size=4)
    expected, expected_state = quiet(whole, xattn.rfa, backend, arrays, key_mask=key_mask,
                                     block_size=4, **options)
    # return_state does not change the output; on JAX and Dask (a compile, a graph of
    # seconds) in the first case, which takes the band and the sinks
    if case == 0 or not backend.name.startswith(("jax", "dask")):
        backend.check(expected, backend.to_numpy(quiet(
            xattn.rfa, *(backend.asarray(a) for a in arrays), causal=True, block_size=4,
            key_mask=None if key_mask is None else backend.asarray(key_mask), **options)),
            dtype=xp.float64)
    np.testing.assert_allclose(out, backend.to_numpy(expected), rtol=1e-10,
                               atol=1e-10 * np.max(np.abs(out)))
    assert_same_state(backend, state, expected_state, rtol=1e-10)


@pytest.mark.thin(window=(4,))
@pytest.mark.parametrize("window,sinks", [(None, None), (4, 3)])
def test_rfa_pieces_float32(backend, rng, window, sinks):
    xp = backend.ns
    arrays = make_sequence(rng, length=length_for(backend))
    key_mask = key_mask_for(rng, (2, 3), length_for(backend))
    options = dict(num_features=32, rng=0, window=window, sinks=sinks)
    out, state = in_pieces(xattn.rfa, backend, arrays, pieces_for(backend, 1),
                           key_mask=key_mask, dtype=xp.float32, first=options, block_size=8)
    expected, expected_state = whole(xattn.rfa, backend, arrays, key_mask=key_mask,
                                     dtype=xp.float32, block_size=8, **options)
    assert state.feature_sums.dtype == xp.float32
    np.testing.assert_allclose(out, backend.to_numpy(expected), rtol=1e-5,
                               atol=1e-5 * np.max(np.abs(out)))
    assert_same_state(backend, state, expected_state, rtol=1e-5)


@pytest.mark.thin(dtype_name=("float32",))
@pytest.mark.parametrize("feature_map,window,sinks", [("positive", None, None),
                                                      ("hyperbolic", 4, 3)])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_rfa_pieces_with_large_scores(backend, rng, feature_map, window, sinks, dtype_name):
    """q, k times 10: logits of hundreds, which only the log-domain sums and their running
    maxima keep finite; pieces still equal one call and no row is lost."""
    if backend.name.startswith("jax") and dtype_name == "float32" and window:
        pytest.skip("JAX: one float32 case (compilation takes seconds)")
    xp = backend.ns
    dtype = getattr(xp, dtype_name)
    q, k, v = make_sequence(rng, length=length_for(backend), spread=1.0)
    arrays = (10 * q, 10 * k, v)
    options = dict(num_features=32, rng=0, feature_map=feature_map, window=window, sinks=sinks)
    out, state = in_pieces(xattn.rfa, backend, arrays, pieces_for(backend, 2), dtype=dtype,
                           first=options)
    expected, expected_state = whole(xattn.rfa, backend, arrays, dtype=dtype, **options)
    expected = backend.to_numpy(expected)
    assert np.all(np.isfinite(out)) and np.all(np.abs(expected).sum(-1) > 0)
    scores = arrays[0] @ np.swapaxes(arrays[1], -1, -2) / np.sqrt(8)
    assert np.max(np.abs(scores)) > 100  # e^score is out of float32's range: stabilized
    rtol = 1e-10 if dtype_name == "float64" else 1e-5
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)))
    assert_same_state(backend, state, expected_state, rtol=rtol)


def test_rfa_half_precision_keeps_a_float32_state(backend, rng):
    xp = backend.ns
    half = backend.half_dtype()
    arrays = make_sequence(rng, batch=(2,), length=9)
    options = dict(num_features=16, rng=0, window=2, sinks=1)
    out, state = in_pieces(xattn.rfa, backend, arrays, [4, 1, 4], dtype=half, first=options)
    assert state.feature_sums.dtype == xp.float32 and state.sink_keys.dtype == xp.float32
    expected = xattn.rfa(*(backend.asarray(a, dtype=half) for a in arrays), causal=True,
                         **options)
    np.testing.assert_allclose(out, backend.to_numpy(expected), rtol=2e-2, atol=2e-2)


def test_rfa_masked_keys_never_enter_the_state(backend, rng):
    """A masked key and value (NaN here) leave no trace: the state equals that of the same
    tokens with any other masked key, and every later output is finite."""
    arrays = make_sequence(rng, batch=(2,), length=12)
    key_mask = np.ones((2, 12), dtype=bool)
    key_mask[:, [0, 5, 9, 11]] = False
    poisoned = [a.copy() for a in arrays]
    for a in poisoned[1:]:
        a[:, [0, 5, 9, 11]] = np.nan
    options = dict(num_features=16, rng=0, window=2, sinks=2)
    out, state = in_pieces(xattn.rfa, backend, poisoned, [5, 1, 6], key_mask=key_mask,
                           first=options)
    clean, clean_state = in_pieces(xattn.rfa, backend, arrays, [5, 1, 6], key_mask=key_mask,
                                   first=options)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, clean, rtol=1e-12, atol=1e-12)
    assert_same_state(backend, state, clean_state, rtol=1e-12)
    for name in ("window_keys", "window_values", "sink_keys", "sink_values", "feature_sums"):
        assert np.all(np.isfinite(backend.to_numpy(getattr(state, name))))


@pytest.mark.parametrize("window,sinks", [(None, None), (8, 4)])
def test_rfa_state_size_does_not_grow(backend, rng, window, sinks):
    """The same arrays, of the same shapes and dtypes, at position 10 and at 10,000."""
    short, long = (make_sequence(rng, batch=(1,), length=length, head_dim=4, value_dim=2)
                   for length in (10, 10_000))
    options = dict(num_features=8, rng=0, window=window, sinks=sinks, block_size=4096)
    states = []
    for arrays in (short, long):
        _, state = whole(xattn.rfa, backend, arrays, **options)
        _, after = xattn.rfa(*(backend.asarray(a[..., :1, :]) for a in arrays), causal=True,
                             state=state, return_state=True)  # one more token
        states += [state, after]
    assert [int(backend.to_numpy(s.position)) for s in states] == [10, 11, 10_000, 10_001]

    def layout(state):
        return {name: (tuple(value.shape), value.dtype) for name, value in vars(state).items()
                if hasattr(value, "shape")}

    assert all(layout(state) == layout(states[0]) for state in states)
    size = sum(int(np.prod(shape)) for shape, _ in layout(states[0]).values())
    assert size < 1_000  # numbers: S (Dv + 2) + S D + (w + K)(D + Dv + 1) + 1


# softmax attention and RA: key-value caches ----------------------------------------------------

@pytest.mark.thin(dtype_name=("float32",), masked=(True,))
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_pieces_equal_one_call(backend, rng, dtype_name, masked):
    xp = backend.ns
    dtype = getattr(xp, dtype_name)
    arrays = make_sequence(rng, length=length_for(backend), spread=1.0)
    key_mask = key_mask_for(rng, (2, 3), length_for(backend)) if masked else None
    out, cache = in_pieces(xattn.softmax_attention, backend, arrays, pieces_for(backend, 3),
                           key_mask=key_mask, dtype=dtype, chunk_size=4)
    expected = reference.softmax_attention(*arrays, key_mask=key_mask, causal=True)
    rtol = 1e-10 if dtype_name == "float64" else 1e-5
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)))
    length = length_for(backend)
    assert isinstance(cache, xattn.SoftmaxState) and cache.position == length
    assert cache.keys.dtype == dtype
    kept = np.broadcast_to(key_mask if masked else True, (2, 3, length))
    np.testing.assert_array_equal(backend.to_numpy(cache.valid), kept)
    np.testing.assert_allclose(backend.to_numpy(cache.keys),
                               np.where(kept[..., None], arrays[1], 0.0), rtol=rtol)
    _, whole_cache = whole(xattn.softmax_attention, backend, arrays, key_mask=key_mask,
                           dtype=dtype)
    assert_same_state(backend, cache, whole_cache, rtol=0.0)


@pytest.mark.thin(masked=(True,))
@pytest.mark.parametrize("masked", [False, True])
def test_ra_deterministic_pieces_equal_one_call(backend, rng, masked):
    xp = backend.ns
    arrays = make_sequence(rng, spread=1.0)  # 23: not a multiple of the chunks of 3
    key_mask = key_mask_for(rng, (2, 3), 23) if masked else None
    options = dict(biased=True, deterministic=True, chunk_size=3)
    out, cache = in_pieces(xattn.ra, backend, arrays, pieces_for(backend, 4, 23),
                           key_mask=key_mask, **options)
    expected, whole_cache = whole(xattn.ra, backend, arrays, key_mask=key_mask, **options)
    backend.check(expected, reference.randomized_attention(*arrays, biased=True,
                                                           key_mask=key_mask, causal=True),
                  dtype=xp.float64)
    np.testing.assert_allclose(out, backend.to_numpy(expected), rtol=1e-10,
                               atol=1e-10 * np.max(np.abs(out)))
    assert isinstance(cache, xattn.RAState)
    assert_same_state(backend, cache, whole_cache, rtol=0.0)


@pytest.mark.parametrize("biased", [False, True])
def test_ra_piece_is_one_call_with_the_pieces_draws(backend, rng, biased):
    """A piece draws for its own queries from its rng, in the documented order (uniforms
    (*batch, L, S), then normals (*batch, L, S, D)): its rows are those of one causal
    call over all tokens that uses these draws for them (the float64 reference)."""
    arrays = make_sequence(rng, batch=(2,), length=11, head_dim=4, spread=1.0)
    key_mask = key_mask_for(rng, (2, 1), 11)[:, 0]
    num_samples, prefix = 3, 7
    outputs, cache, uniforms, noise = [], None, [], []
    for seed, (start, stop) in enumerate([(0, prefix), (prefix, 9), (9, 10), (10, 11)]):
        piece = [backend.asarray(a[:, start:stop]) for a in arrays]
        out, cache = xattn.ra(*piece, num_samples=num_samples, biased=biased, causal=True,
                              key_mask=backend.asarray(key_mask[:, start:stop]), rng=seed,
                              state=cache, return_state=True)
        outputs.append(backend.to_numpy(out))
        draws = HostGenerator(np.random.default_rng(seed))
        shape = (2, stop - start, num_samples)
        uniforms.append(np.ones(shape) if biased else 1.0 - draws.uniform(np, shape,
                                                                           dtype=np.float64))
        noise.append(draws.normal(np, (*shape, 4), dtype=np.float64))
    expected = reference.randomized_attention(
        *arrays, np.concatenate(uniforms, axis=1), np.concatenate(noise, axis=1),
        biased=biased, key_mask=key_mask, causal=True)
    np.testing.assert_allclose(np.concatenate(outputs, axis=-2), expected, rtol=1e-10,
                               atol=1e-10)


def test_ra_pieces_stay_unbiased():
    """Unbiased RA in pieces, each with its own seed: the mean over draws is softmax
    attention (the tolerance: 5 standard errors of the mean over the draws)."""
    rng = np.random.default_rng(5)
    arrays = make_sequence(rng, batch=(1,), length=6, head_dim=4, spread=1.0)
    draws = []
    for seed in range(400):
        out, cache = xattn.ra(*(a[:, :4] for a in arrays), num_samples=4, causal=True,
                              rng=2 * seed, return_state=True)
        out_t = xattn.ra(*(a[:, 4:] for a in arrays), num_samples=4, causal=True,
                         rng=2 * seed + 1, state=cache)
        draws.append(np.concatenate([out, out_t], axis=1))
    draws = np.asarray(draws)
    error = np.abs(draws.mean(0) - reference.softmax_attention(*arrays, causal=True))
    assert np.all(error <= 5 * draws.std(0) / np.sqrt(len(draws)) + 1e-12)


# JAX: a decode loop under jit and lax.scan ---------------------------------------------------

@pytest.mark.parametrize("feature_map,window,sinks", [("positive", 3, 2),
                                                      ("trigonometric", None, None)])
def test_jax_jit_prefill_and_scan_decode_loop(rng, feature_map, window, sinks, jax_x64):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v = make_sequence(rng, batch=(2,), length=20,
                            spread=0.3 if feature_map == "trigonometric" else 0.5)
    key_mask = key_mask_for(rng, (2, 1), 20)[:, 0]
    prefix = 7
    options = dict(num_features=16, feature_map=feature_map, window=window, sinks=sinks)

    @jax.jit
    def prefill(q, k, v, key_mask, key):
        return xattn.rfa(q, k, v, key_mask=key_mask, rng=key, causal=True, return_state=True,
                         block_size=4, **options)

    @jax.jit
    def decode(state, tokens):
        def step(state, token):
            q_t, k_t, v_t, mask_t = token
            out, state = xattn.rfa(q_t[:, None], k_t[:, None], v_t[:, None], causal=True,
                                   key_mask=mask_t[:, None], state=state, return_state=True)
            return state, out[:, 0]
        return jax.lax.scan(step, state, tokens)

    key = jax.random.key(3)
    arrays = [jnp.asarray(a) for a in (q, k, v, key_mask)]
    out, state = prefill(*(a[:, :prefix] for a in arrays), key)
    tokens = tuple(jnp.moveaxis(a[:, prefix:], 1, 0) for a in arrays)  # time-major
    state, outs = decode(state, tokens)
    assert int(state.position) == 20 and isinstance(state, xattn.RFAState)
    got = np.concatenate([np.asarray(out), np.moveaxis(np.asarray(outs), 0, 1)], axis=1)
    omega = np.asarray(state.omega)  # drawn from the key by the prefill
    expected, expected_state = quiet(xattn.rfa, q, k, v, key_mask=key_mask, omega=omega,
                                     causal=True, return_state=True, **options)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10 * np.max(np.abs(got)))

    class Host:  # the NumPy side of assert_same_state
        @staticmethod
        def to_numpy(x):
            return np.asarray(x, dtype=np.float64 if np.asarray(x).dtype != bool else bool)

    assert_same_state(Host, state, expected_state, rtol=1e-10)


def test_jax_jit_softmax_cache_prefill_and_steps(rng, jax_x64):
    """The key-value cache grows: jit compiles the prefill and one step per length."""
    jax = pytest.importorskip("jax")
    q, k, v = make_sequence(rng, batch=(2,), length=9, spread=1.0)

    @jax.jit
    def attend(q, k, v, cache):
        return xattn.softmax_attention(q, k, v, causal=True, state=cache, return_state=True)

    arrays = [jax.numpy.asarray(a) for a in (q, k, v)]
    out, cache = attend(*(a[:, :6] for a in arrays), None)
    outputs = [np.asarray(out)]
    for position in range(6, 9):
        out, cache = attend(*(a[:, position:position + 1] for a in arrays), cache)
        outputs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1),
                               reference.softmax_attention(q, k, v, causal=True), rtol=1e-10)
    assert cache.position == 9


# torch: autograd through the state -------------------------------------------------------------

@pytest.mark.parametrize("estimator", ["rfa", "softmax"])
def test_torch_gradients_flow_through_the_state(rng, estimator):
    """The loss of the tokens after the prefill, differentiated through the state with
    respect to the prefill's q, k, v: the gradients of one causal call."""
    torch = pytest.importorskip("torch")
    arrays = make_sequence(rng, batch=(2,), length=10, head_dim=4, value_dim=2)
    weights = torch.as_tensor(rng.normal(size=(2, 4, 2)))
    options = (dict(num_features=8, rng=0, window=2, sinks=1) if estimator == "rfa" else {})
    function = xattn.rfa if estimator == "rfa" else xattn.softmax_attention

    def loss(pieces):
        tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
        outputs, state, start = [], None, 0
        for length in pieces:
            extra = dict(options) if state is None else {"state": state}
            out, state = function(*(t[:, start:start + length] for t in tensors), causal=True,
                                  return_state=True, **extra)
            outputs.append(out)
            start += length
        (torch.cat(outputs, dim=1)[:, 6:] * weights).sum().backward()
        return [t.grad.numpy() for t in tensors]

    split, one_call = loss([6, 1, 2, 1]), loss([10])
    for got, expected in zip(split, one_call, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    for grad in split[1:]:  # the prefill's keys and values reach the loss through the state
        assert np.all(np.abs(grad[:, :6]).sum(-1) > 0)


# misuse ------------------------------------------------------------------------------------

def _tokens(rng, length=4, head_dim=8, value_dim=3, batch=(2,)):
    return make_sequence(rng, batch=batch, length=length, head_dim=head_dim,
                         value_dim=value_dim)


LARA_MEANS = 0.1 * np.arange(16.0).reshape(2, 8) / 16


def test_misuse_names_the_argument(rng):
    q, k, v = _tokens(rng)
    _, state = xattn.rfa(q, k, v, num_features=8, rng=0, causal=True, return_state=True)
    _, trigonometric = quiet(xattn.rfa, q, k, v, num_features=8, rng=0, causal=True,
                             feature_map="trigonometric", return_state=True)
    _, windowed = xattn.rfa(q, k, v, num_features=8, rng=0, causal=True, window=2, sinks=1,
                            return_state=True)
    _, cache = xattn.softmax_attention(q, k, v, causal=True, return_state=True)
    _, ra_cache = xattn.ra(q, k, v, causal=True, rng=0, return_state=True)
    omega = xattn.features.sample_omega(1, 8, 8, xp=np, dtype=np.float64)
    _, lara_state = xattn.lara(q, k, v, num_samples=2, causal=True, rng=0,
                               proposal_means=LARA_MEANS, weighting="query_proposal",
                               return_state=True)
    cases = [
        # a state of another estimator
        (xattn.softmax_attention, dict(state=state), TypeError,
         r"state must be an xattn.SoftmaxState.*got a state of rfa\(\)"),
        (xattn.rfa, dict(state=cache), TypeError,
         r"state must be an xattn.RFAState.*got a state of softmax_attention\(\)"),
        (xattn.ra, dict(state=cache), TypeError, r"state must be an xattn.RAState"),
        (xattn.softmax_attention, dict(state=ra_cache), TypeError, r"a state of ra\(\)"),
        (xattn.rfa, dict(state={"position": 3}), TypeError, r"state must be an xattn.RFAState"),
        # another feature map, other samples, other options
        (xattn.rfa, dict(state=trigonometric, feature_map="positive"), ValueError,
         r"feature_map='positive' differs from the state's feature_map \('trigonometric'\)"),
        (xattn.rfa, dict(state=state, num_features=16), ValueError,
         r"num_features=16 differs from the state's num_features \(8\)"),
        (xattn.rfa, dict(state=state, omega=omega), ValueError, r"omega=.*differs"),
        (xattn.rfa, dict(state=state, omega=omega[:4]), ValueError,
         r"omega=<array of shape \(4, 8\)> differs"),
        (xattn.rfa, dict(state=windowed, window=3), ValueError,
         r"window=3 differs from the state's window \(2\)"),
        (xattn.rfa, dict(state=windowed, sinks=0), ValueError, r"sinks=0 differs"),
        (xattn.rfa, dict(state=state, scale=0.5), ValueError, r"scale=0.5 differs"),
        # state= and return_state=True need causal=True
        (xattn.rfa, dict(state=state, causal=False), ValueError,
         r"state= continues a causal sequence: rfa\(\) needs causal=True"),
        (xattn.softmax_attention, dict(return_state=True, causal=False), ValueError,
         r"return_state= continues a causal sequence: softmax_attention\(\) needs causal"),
        (xattn.ra, dict(state=ra_cache, causal=False), ValueError, r"ra\(\) needs causal=True"),
        (xattn.rfa, dict(return_state=1), TypeError, r"return_state must be a bool"),
        # LARA takes its own state, and causal=True
        (xattn.lara, dict(state=state, num_samples=2, causal=True), TypeError,
         r"state must be an xattn.LARAState, as returned by lara\(\.\.\., causal=True"),
        (xattn.lara, dict(return_state=True, num_samples=2), ValueError,
         r"return_state= continues a causal sequence: lara\(\) needs causal=True"),
        # the feature sums inside a LARA state are LARA's, not an RFA state
        (xattn.rfa, dict(state=lara_state.features), TypeError,
         r"state is the feature sums of an xattn.LARAState"),
        (xattn.rfa, dict(state=lara_state.features, num_features=2), TypeError,
         r"pass the LARAState itself to xattn.lara"),
        # LARA refuses conflicting options, as rfa does
        (xattn.lara, dict(state=lara_state, num_samples=2, causal=True, weighting="balance"),
         ValueError, r"weighting='balance' differs from the state's weighting "
                     r"\('query_proposal'\)"),
        (xattn.lara, dict(state=lara_state, num_samples=2, causal=True, beta=1.0), ValueError,
         r"beta=1.0 differs from the state's beta \(2.0\)"),
        (xattn.lara, dict(state=lara_state, num_samples=2, causal=True,
                          proposal_means=np.zeros((2, 8))), ValueError,
         r"proposal_means=<other values> differs"),
    ]
    for function, options, error, message in cases:
        options = {"causal": True, **options} if function is not xattn.lara else options
        with pytest.raises(error, match=message):
            function(q, k, v, **options)


@pytest.mark.parametrize("estimator", ["rfa", "softmax", "ra"])
def test_misuse_of_another_head_shape(rng, estimator):
    function = {"rfa": xattn.rfa, "softmax": xattn.softmax_attention, "ra": xattn.ra}[estimator]
    options = dict(num_features=8, rng=0, window=1) if estimator == "rfa" else {}
    q, k, v = _tokens(rng)
    _, state = function(q, k, v, causal=True, return_state=True, **options)
    for other, message in [
        (_tokens(rng, head_dim=4), r"state holds heads of D = 8, Dv = 3, but the new tokens "
                                   r"have D = 4"),
        (_tokens(rng, value_dim=5), r"Dv = 5 \(v\)"),
        (_tokens(rng, batch=(3,)), r"state has the leading \(batch, head\) dims \(2,\)"),
        (_tokens(rng, batch=(4, 2)), r"do not broadcast to"),
        ([a.astype(np.float32) for a in (q, k, v)],
         r"state holds float64 arrays but the new tokens compute in float32"),
    ]:
        with pytest.raises(ValueError, match=message):
            function(*other, causal=True, state=state)
    with pytest.raises(ValueError, match=r"q and k .* must have as many rows \(N = M\)"):
        function(q, k[:, :3], v[:, :3], causal=True, state=state)
    # leading dims that broadcast to the state's are fine
    out = function(q[:1], k[:1], v[:1], causal=True, state=state)
    assert out.shape == (2, 4, 3)


def test_omega_of_the_state_is_accepted(rng):
    q, k, v = _tokens(rng)
    _, state = xattn.rfa(q, k, v, num_features=8, rng=0, causal=True, return_state=True)
    same = xattn.rfa(q, k, v, causal=True, state=state, omega=state.omega.copy(),
                     num_features=8, feature_map="positive", window=0, sinks=0)
    np.testing.assert_array_equal(same, xattn.rfa(q, k, v, causal=True, state=state))


def test_lara_accepts_the_options_of_its_own_state(rng):
    """Options given again with state= that equal the state's are accepted; the
    continuation then equals the one without them."""
    q, k, v = _tokens(rng)
    options = dict(num_samples=2, causal=True, proposal_means=LARA_MEANS,
                   weighting="query_proposal", beta=2.0)
    _, state = xattn.lara(q[:, :3], k[:, :3], v[:, :3], rng=0, return_state=True, **options)
    again = xattn.lara(q[:, 3:], k[:, 3:], v[:, 3:], state=state, rng=1,
                       **{**options, "proposal_means": LARA_MEANS.copy()})
    bare = xattn.lara(q[:, 3:], k[:, 3:], v[:, 3:], state=state, num_samples=2, causal=True)
    np.testing.assert_array_equal(again, bare)


def test_softmax_prefill_uses_the_causal_kernel_without_a_mask(rng, monkeypatch):
    """A prefill (return_state=True) reaches torch's fused kernel as the plain causal call
    does, with is_causal and no (N, M) mask: its memory is that of the plain call."""
    torch = pytest.importorskip("torch")
    calls = []
    fused = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    q, k, v = (torch.tensor(x) for x in _tokens(rng))
    plain = xattn.softmax_attention(q, k, v, causal=True)
    prefill, cache = xattn.softmax_attention(q, k, v, causal=True, return_state=True)
    assert calls == [(None, True), (None, True)]
    torch.testing.assert_close(prefill, plain, rtol=0, atol=0)
    assert cache.keys.shape == k.shape


STATE_BEFORE_JAX = textwrap.dedent("""
    import sys
    import numpy as np
    import xattn

    assert "jax" not in sys.modules
    import importlib.util
    assert importlib.util.find_spec("jax") is not None  # a lookup, as `needs` checks do
    data = np.random.default_rng(0)
    q, k, v = (data.normal(size=(2, 5, 4)) for _ in range(3))
    _, rfa_state = xattn.rfa(q, k, v, num_features=8, rng=0, causal=True, return_state=True)
    _, cache = xattn.softmax_attention(q, k, v, causal=True, return_state=True)
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    for state in (rfa_state, cache):
        assert len(jax.tree_util.tree_leaves(state)) > 1, type(state)
    @jax.jit
    def step(state, x):
        return xattn.rfa(x, x, x, causal=True, state=state, return_state=True)
    out, after = step(jax.tree_util.tree_map(jnp.asarray, rfa_state), jnp.asarray(q[:, :1]))
    assert int(after.position) == 6, after.position
    print("ok")
""")


def test_a_state_made_before_jax_is_imported_is_a_pytree():
    """In a fresh interpreter: states made with NumPy before ``import jax`` (after a
    lookup of JAX's module spec) are pytrees (their arrays are leaves) and go through
    jax.jit."""
    result = subprocess.run([sys.executable, "-c", STATE_BEFORE_JAX], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


STARTS = {
    "rfa-positive": lambda *a, **o: xattn.rfa(*a, num_features=8, rng=0, **o),
    "rfa-trigonometric": lambda *a, **o: xattn.rfa(*a, num_features=8, rng=0,
                                                   feature_map="trigonometric", **o),
    "rfa-window-sinks": lambda *a, **o: xattn.rfa(*a, num_features=8, rng=0, window=2,
                                                  sinks=1, **o),
    "softmax": xattn.softmax_attention,
    "ra": lambda *a, **o: xattn.ra(*a, rng=0, **o),
    "lara": lambda *a, **o: xattn.lara(*a, num_samples=3, rng=0, weighting="balance",
                                       proposal_means=np.zeros((3, 4)), **o),
}
CONTINUE = {"rfa-positive": xattn.rfa, "rfa-trigonometric": xattn.rfa,
            "rfa-window-sinks": xattn.rfa, "softmax": xattn.softmax_attention,
            "ra": xattn.ra, "lara": xattn.lara}


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("name", STARTS)
def test_a_state_continued_by_another_array_library_is_named(name, tokens):
    """A NumPy state continued with torch tensors of the same dtype: before, the dtype
    check ran first and said "float64 ... torch.float64; continue a sequence in one dtype"
    (the trigonometric map failed in torch's ``swapaxes``, built before the check)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 5, 4)) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrigonometricDenominatorWarning)
        _, state = STARTS[name](q, k, v, causal=True, return_state=True)
    new = [torch.asarray(x[:, :tokens]) for x in (q, k, v)]
    with pytest.raises(ValueError, match=r"state holds arrays of numpy but q, k and v are "
                                         r"arrays of torch"):
        CONTINUE[name](*new, causal=True, state=state)
