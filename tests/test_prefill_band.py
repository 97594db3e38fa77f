"""The exact band of a windowed prefill (``return_state=True``) and of the steps after it:
the chunked band of :func:`xattn._estimators.window.exact_partial`, shared with the whole-sequence
path.

A prefill of ``P`` tokens with ``window`` and ``sinks``, then three single-token steps,
equals one causal call on the whole sequence (1e-10 in float64, one fixed ``omega``),
whatever the block length of the prefill (16, or the whole prefill as one block). On
torch the band of a prefill dispatches the same aten operations at 512 and 2048 tokens
as one block, and makes no tensor of the order of the block squared.
"""

from __future__ import annotations

import numpy as np
import pytest

import xattn
import xattn._estimators.decode
from op_counting import op_counter

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

WINDOWS = (1, 5, 20)
SINKS = (0, 1, 3)
LENGTHS = (1, 7, 40, 300)
STEPS = 3
HEAD_DIM, VALUE_DIM, NUM_FEATURES = 8, 3, 16


def make_sequence(rng, length, batch=(2, 3), masked=True):
    """q, k (2, 3, N, 8) (spread 0.5), v (2, 3, N, 3), a key mask (2, 1, N) (broadcast over
    the heads) with about a fifth of the keys masked (None unless ``masked``) and omega
    (16, 8)."""
    q = 0.5 * rng.normal(size=(*batch, length, HEAD_DIM))
    k = 0.5 * rng.normal(size=(*batch, length, HEAD_DIM))
    v = rng.normal(size=(*batch, length, VALUE_DIM))
    key_mask = (rng.random((batch[0], *(1,) * (len(batch) - 1), length)) < 0.8
                if masked else None)
    omega = rng.normal(size=(NUM_FEATURES, HEAD_DIM))
    return (q, k, v), key_mask, omega


def prefill_then_steps(backend, arrays, key_mask, omega, prefill, steps, **options):
    """The outputs (NumPy) of a prefill of ``prefill`` tokens then ``steps`` single tokens."""
    outputs, state, start = [], None, 0
    for length in (prefill, *(1,) * steps):
        piece = [backend.asarray(a[..., start:start + length, :]) for a in arrays]
        mask = None if key_mask is None else backend.asarray(key_mask[..., start:start + length])
        extra = {"omega": backend.asarray(omega), **options} if state is None else {"state": state}
        out, state = xattn.rfa(*piece, key_mask=mask, causal=True, return_state=True, **extra)
        state = backend.settled(state)
        assert tuple(out.shape[-2:]) == (length, arrays[2].shape[-1])
        outputs.append(backend.to_numpy(out))
        start += length
    return np.concatenate(outputs, axis=-2)


def one_call(backend, arrays, key_mask, omega, **options):
    """One causal call on the whole sequence (NumPy)."""
    return backend.to_numpy(xattn.rfa(
        *(backend.asarray(a) for a in arrays), omega=backend.asarray(omega), causal=True,
        key_mask=None if key_mask is None else backend.asarray(key_mask), **options))


@pytest.mark.parametrize("prefill", LENGTHS)
@pytest.mark.parametrize("sinks", SINKS)
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_and_steps_equal_one_call(backend, rng, window, sinks, prefill):
    """Blocks of 16 and the whole prefill as one block; a key mask when ``window + sinks +
    prefill`` is even (about half the cases)."""
    if backend.name not in ("numpy", "torch", "torch-cuda") and (
            prefill != 40 or (window, sinks) not in ((5, 3), (20, 1))):
        pytest.skip("the other backends run two cases of the 40-token prefill")
    masked = (window + sinks + prefill) % 2 == 0
    arrays, key_mask, omega = make_sequence(rng, prefill + STEPS, masked=masked)
    options = dict(window=window, sinks=sinks)
    expected = one_call(backend, arrays, key_mask, omega, **options)
    scale = max(1.0, float(np.max(np.abs(expected))))
    for block_size in (16, prefill):
        out = prefill_then_steps(backend, arrays, key_mask, omega, prefill, STEPS,
                                 block_size=block_size, **options)
        np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-10 * scale,
                                   err_msg=f"block_size={block_size}")


def test_sinks_longer_than_the_prefill(backend, rng):
    """Sink slots that the steps fill (K = 5 > P = 2): each sink key counted once, in its
    slot, never in the band."""
    if backend.name not in ("numpy", "torch", "torch-cuda"):
        pytest.skip("numpy and torch")
    arrays, key_mask, omega = make_sequence(rng, 2 + 6)
    options = dict(window=2, sinks=5)
    expected = one_call(backend, arrays, key_mask, omega, **options)
    out = prefill_then_steps(backend, arrays, key_mask, omega, 2, 6, block_size=16, **options)
    np.testing.assert_allclose(out, expected, rtol=1e-10,
                               atol=1e-10 * max(1.0, float(np.max(np.abs(expected)))))


@pytest.mark.parametrize(("window", "sinks"), [(5, 3), (20, 0), (1, 1), (0, 3)])
def test_torch_band_operations_do_not_grow_with_the_prefill(monkeypatch, window, sinks):
    """A prefill of 512 and of 2048 tokens as one block (``block_size`` the prefill: the
    block that the working memory allows once nothing caps it): its band (every call of
    ``exact_partial`` from ``continue_rfa``) dispatches the same aten operations, and no
    tensor of the order of the block squared (at most the chunks' scores, ``B (C + w)``,
    and the sinks' ``B K``)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    counters: list = []
    exact_partial = xattn._estimators.decode.exact_partial

    def counted(*args, **kwargs):
        with op_counter() as counter:
            result = exact_partial(*args, **kwargs)
        counters.append(counter)
        return result

    monkeypatch.setattr(xattn._estimators.decode, "exact_partial", counted)
    counts = {}
    for length in (512, 2048):
        arrays, key_mask, omega = make_sequence(rng, length, batch=(2,))
        counters.clear()
        xattn.rfa(*(torch.asarray(a) for a in arrays), key_mask=torch.asarray(key_mask),
                  omega=torch.asarray(omega), causal=True, window=window, sinks=sinks,
                  return_state=True, block_size=length)
        assert len(counters) == 1  # one block
        counter = counters[0]
        counts[length] = (counter.count, counter.ops)
        chunk = 1 << (max(window, 16) - 1).bit_length()
        assert counter.largest <= 2 * length * (chunk + window + sinks + VALUE_DIM + 1)
    assert counts[512] == counts[2048]
