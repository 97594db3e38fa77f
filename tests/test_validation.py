"""Bad input gets a clear error naming the argument and the expected shape or dtype."""

from __future__ import annotations

import numpy as np
import pytest

import xattn


def good_inputs(batch=(2,), num_queries=5, num_keys=6, head_dim=4, value_dim=3):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(*batch, num_queries, head_dim)),
            rng.normal(size=(*batch, num_keys, head_dim)),
            rng.normal(size=(*batch, num_keys, value_dim)))


def test_mixed_namespaces_name_both_libraries():
    torch = pytest.importorskip("torch")
    q, k, v = good_inputs()
    with pytest.raises(TypeError, match=r"q is a numpy array.*k is a torch array"):
        xattn.softmax_attention(q, torch.as_tensor(k), v)


def test_not_an_array():
    q, k, v = good_inputs()
    with pytest.raises(TypeError, match="v must be an array"):
        xattn.softmax_attention(q, k, v.tolist())


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((5, 4), (6, 3), (6, 3)), r"q and k must have the same last dim D"),
        (((5, 4), (6, 4), (7, 3)), r"k and v must have the same number of keys M"),
        (((4,), (6, 4), (6, 3)), r"q must have shape \(\.\.\., N, D\) \(rank >= 2\)"),
        (((2, 5, 4), (3, 6, 4), (3, 6, 3)), r"leading \(batch\) dims do not broadcast: q \(2,\)"),
    ],
)
def test_mismatched_shapes(shapes, match):
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        xattn.softmax_attention(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_integer_dtype(name):
    arrays = dict(zip("qkv", good_inputs(), strict=True))
    arrays[name] = arrays[name].astype(np.int64)
    with pytest.raises(TypeError, match=rf"{name} must have a real floating dtype.*got int64"):
        xattn.softmax_attention(arrays["q"], arrays["k"], arrays["v"])


def test_complex_dtype():
    q, k, v = good_inputs()
    with pytest.raises(TypeError, match="q must have a real floating dtype"):
        xattn.softmax_attention(q.astype(np.complex128), k, v)


@pytest.mark.parametrize(
    "mask,error,match",
    [
        (np.ones((2, 5), dtype=bool), ValueError,
         r"key_mask must have shape \(\.\.\., M\) with M = 6"),
        (np.ones((3, 6), dtype=bool), ValueError, r"leading \(batch\) dims do not broadcast"),
        (np.ones((2, 6)), TypeError, r"key_mask must be a boolean array"),
    ],
)
def test_wrong_mask(mask, error, match):
    with pytest.raises(error, match=match):
        xattn.softmax_attention(*good_inputs(), key_mask=mask)


@pytest.mark.parametrize("scale,error", [(-1.0, ValueError), (float("nan"), ValueError),
                                         ("1", TypeError)])
def test_bad_scale(scale, error):
    with pytest.raises(error, match="scale must be"):
        xattn.softmax_attention(*good_inputs(), scale=scale)


def test_bad_causal_and_chunk_size():
    with pytest.raises(TypeError, match="causal must be a bool"):
        xattn.softmax_attention(*good_inputs(), causal="yes")
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        xattn.softmax_attention(*good_inputs(), chunk_size=0)


def test_empty_key_set_is_an_error_and_empty_query_set_is_empty():
    q, k, v = good_inputs()
    with pytest.raises(ValueError, match=r"k must hold at least one key \(M >= 1\)"):
        xattn.softmax_attention(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match=r"feature dim D >= 1"):
        xattn.softmax_attention(q[..., :0], k[..., :0], v)
    assert xattn.softmax_attention(q[:, :0], k, v).shape == (2, 0, 3)
    assert xattn.softmax_attention(q[:, :0], k, v, causal=True).shape == (2, 0, 3)


ESTIMATORS = {
    "softmax": xattn.softmax_attention,
    "rfa": lambda q, k, v: xattn.rfa(q, k, v, num_features=4, rng=0),
    "ra": lambda q, k, v: xattn.ra(q, k, v, rng=0),
    "lara": lambda q, k, v: xattn.lara(q, k, v, num_samples=2, rng=0),
}


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("position", [0, 1, 2])
def test_masked_array_is_rejected_naming_the_argument(estimator, position):
    """A NumPy masked array as q, k or v (its mask would be silently ignored) is a
    TypeError naming the argument, whatever the estimator and its mask."""
    arrays = list(good_inputs())
    arrays[position] = np.ma.masked_array(arrays[position], mask=arrays[position] > 1.0)
    name = "qkv"[position]
    with pytest.raises(TypeError, match=rf"^{name} is a numpy\.ma\.MaskedArray"):
        ESTIMATORS[estimator](*arrays)


@pytest.mark.parametrize("option", ["causal", "check_finite"])
@pytest.mark.parametrize("estimator", ["softmax", "rfa", "ra"])
def test_numpy_bools_are_accepted_like_python_bools(estimator, option):
    """Every bool option takes np.True_ / np.False_ and gives the Python-bool result."""
    q, k, v = good_inputs()
    function = {"softmax": xattn.softmax_attention,
                "rfa": lambda *a, **o: xattn.rfa(*a, num_features=4, rng=0, **o),
                "ra": lambda *a, **o: xattn.ra(*a, rng=0, **o)}[estimator]
    for flag in (True, False):
        np.testing.assert_array_equal(function(q, k, v, **{option: np.bool_(flag)}),
                                      function(q, k, v, **{option: flag}))
    with pytest.raises(TypeError, match=f"{option} must be a bool, got int"):
        function(q, k, v, **{option: 1})


def test_numpy_scalar_beta_is_accepted():
    q, k, v = good_inputs()
    options = dict(num_samples=2, rng=0, weighting="decoupled")
    np.testing.assert_array_equal(xattn.lara(q, k, v, beta=np.float32(2.0), **options),
                                  xattn.lara(q, k, v, beta=2.0, **options))
