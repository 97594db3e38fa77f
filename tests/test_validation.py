"""Bad input gets a clear error naming the argument and the expected shape or dtype."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import xattn
from layer_cases import bool_options
from xattn.features import sample_omega
from xattn.mrf import log_partition_rf


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
    "rfa": lambda q, k, v, **o: xattn.rfa(q, k, v, num_features=4, rng=0, **o),
    "ra": lambda q, k, v, **o: xattn.ra(q, k, v, rng=0, **o),
    "lara": lambda q, k, v, **o: xattn.lara(q, k, v, num_samples=2, rng=0, **o),
}


MASKED_ARGUMENT_CASES = [*((estimator, name) for estimator in ESTIMATORS
                           for name in ("q", "k", "v", "key_mask")), ("lara", "query_mask")]


@pytest.mark.parametrize("estimator,name", MASKED_ARGUMENT_CASES)
def test_masked_array_is_rejected_naming_the_argument(estimator, name):
    """A NumPy masked array as q, k, v, key_mask or query_mask (its mask would be
    silently ignored) is a TypeError naming the argument, whatever the estimator and the
    masked entries (none, some)."""
    q, k, v = good_inputs()
    arguments = {"q": q, "k": k, "v": v}
    if name in ("key_mask", "query_mask"):
        mask = np.ones((2, (k if name == "key_mask" else q).shape[-2]), dtype=bool)
        mask[:, -1] = False
        ESTIMATORS[estimator](**arguments, **{name: mask})  # the plain array is fine
        arguments[name] = mask
    for hidden in (np.zeros(arguments[name].shape, dtype=bool), arguments[name] != 0):
        masked = {**arguments, name: np.ma.masked_array(arguments[name], mask=hidden)}
        with pytest.raises(TypeError, match=rf"^{name} is a numpy\.ma\.MaskedArray"):
            ESTIMATORS[estimator](**masked)


def _bool_option_calls():
    q, k, v = good_inputs()
    embeddings = 0.3 * np.random.default_rng(1).normal(size=(4, 3, 4))
    return {
        xattn.softmax_attention: lambda **o: xattn.softmax_attention(q, k, v, **o),
        xattn.rfa: lambda **o: xattn.rfa(q, k, v, num_features=4, rng=0, **o),
        # deterministic=True needs biased=True: both flags are tried on the biased form
        xattn.ra: lambda **o: xattn.ra(q, k, v, rng=0, **({"biased": True} | o)),
        xattn.lara: lambda **o: xattn.lara(q, k, v, num_samples=2, rng=0, **o),
        sample_omega: lambda **o: sample_omega(0, 4, 4, xp=np, dtype=np.float64, **o),
        log_partition_rf: lambda **o: log_partition_rf(embeddings, num_features=8, rng=0, **o),
    }


BOOL_OPTION_CALLS = _bool_option_calls()
BOOL_OPTION_CASES = [pytest.param(function, option, id=f"{function.__name__}-{option}")
                     for function in BOOL_OPTION_CALLS for option in bool_options(function)]


@pytest.mark.parametrize("function", list(BOOL_OPTION_CALLS), ids=lambda f: f.__name__)
def test_bool_options_are_found_by_their_annotation(function):
    """The annotation finds every option with a bool default (so none is left out), and
    every function has one."""
    found = bool_options(function)
    defaults = [name for name, parameter in inspect.signature(function).parameters.items()
                if isinstance(parameter.default, bool)]
    assert found and set(defaults) <= set(found), (found, defaults)


@pytest.mark.parametrize("function,option", BOOL_OPTION_CASES)
def test_numpy_bools_are_accepted_like_python_bools(function, option):
    """Every bool option takes np.True_ / np.False_ and gives the Python-bool result;
    anything else (a str, an int) is a TypeError naming the option."""
    call = BOOL_OPTION_CALLS[function]
    for flag in (True, False):
        try:
            expected = call(**{option: flag})
        except ValueError as error:  # a value the function refuses (lara's causal=True)
            with pytest.raises(ValueError) as with_numpy:
                call(**{option: np.bool_(flag)})
            assert str(with_numpy.value) == str(error)
            continue
        np.testing.assert_array_equal(call(**{option: np.bool_(flag)}), expected)
    for bad in ("x", 1, np.int64(0), None):
        with pytest.raises(TypeError, match=rf"^{option} must be a bool, got "):
            call(**{option: bad})


def test_numpy_scalar_beta_is_accepted():
    q, k, v = good_inputs()
    options = dict(num_samples=2, rng=0, weighting="decoupled")
    np.testing.assert_array_equal(xattn.lara(q, k, v, beta=np.float32(2.0), **options),
                                  xattn.lara(q, k, v, beta=2.0, **options))
