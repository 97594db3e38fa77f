"""xattn.torch.MultiheadAttention: a drop-in for torch.nn.MultiheadAttention."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import xattn
from layer_cases import (
    BAD_GRID_OPTIONS,
    BAD_OPTION_CASES,
    BAD_OPTION_VALUES,
    ESTIMATORS,
    PASS_THROUGH_CASES,
    SMALL_OPTIONS,
    bool_options,
    constructor_bool_cases,
    direct_error,
    estimator_call,
)
from xattn._integrations import layers as _layers

torch = pytest.importorskip("torch")
xtorch = pytest.importorskip("xattn.torch")

EMBED_DIM, NUM_HEADS = 16, 4


def make_layer(estimator, seed=0, **kwargs):
    torch.manual_seed(seed)  # parameter init, as for torch.nn.MultiheadAttention
    options = {**SMALL_OPTIONS[estimator], **kwargs}
    return xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator=estimator,
                                     generator=torch.Generator().manual_seed(seed), **options)


def inputs(shape=(2, 12, EMBED_DIM), seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "unbatched"])
def test_forward_shape_dtype_and_backward(estimator, layout):
    layer = make_layer(estimator, batch_first=layout == "batch_first")
    shape = {"seq_first": (12, 2, EMBED_DIM), "batch_first": (2, 12, EMBED_DIM),
             "unbatched": (12, EMBED_DIM)}[layout]
    x = inputs(shape)
    memory_shape = {"seq_first": (9, 2, EMBED_DIM), "batch_first": (2, 9, EMBED_DIM),
                    "unbatched": (9, EMBED_DIM)}[layout]
    memory = inputs(memory_shape, seed=2)  # cross attention: 9 keys for 12 queries
    out, weights = layer(x, memory, memory)
    assert weights is None
    assert out.shape == x.shape and out.dtype == torch.float32
    out.square().sum().backward()
    names = [name for name, _ in layer.named_parameters()]
    assert set(names) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("implementation", [None, "native", "xattn"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_softmax_equals_torch_multihead_attention(batch_first, implementation):
    """estimator="softmax" with torch's weights reproduces torch.nn.MultiheadAttention,
    through SDPA (the default) and through xattn's portable loop."""
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=batch_first)
    with torch.no_grad():  # non-zero biases, so that every parameter is compared
        reference.in_proj_bias.normal_()
        reference.out_proj.bias.normal_()
    layer = xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator="softmax",
                                      batch_first=batch_first, implementation=implementation)
    layer.load_state_dict(reference.state_dict())  # strict
    x = inputs((2, 12, EMBED_DIM) if batch_first else (12, 2, EMBED_DIM))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 8:] = True
    float_padding = torch.where(padding, -torch.inf, 0.0)
    causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(12)
    cases = [
        ({}, {}),
        ({"key_padding_mask": padding}, {"key_padding_mask": padding}),
        ({"attn_mask": causal_mask, "is_causal": True}, {"is_causal": True}),
        ({"attn_mask": causal_mask}, {"attn_mask": torch.isinf(causal_mask)}),
        ({"attn_mask": causal_mask, "key_padding_mask": float_padding},
         {"attn_mask": causal_mask, "key_padding_mask": float_padding}),
    ]
    for reference_kwargs, kwargs in cases:
        expected, _ = reference(x, x, x, need_weights=False, **reference_kwargs)
        out, _ = layer(x, x, x, **kwargs)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_softmax_equals_torch_unbatched_with_padding():
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS)
    layer = xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator="softmax")
    layer.load_state_dict(reference.state_dict())
    x = inputs((12, EMBED_DIM))
    padding = torch.arange(12) >= 9
    expected, _ = reference(x, x, x, key_padding_mask=padding, need_weights=False)
    out, _ = layer(x, x, x, key_padding_mask=padding)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_softmax_equals_torch_with_kdim_vdim():
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, kdim=6, vdim=5)
    layer = xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator="softmax", kdim=6,
                                      vdim=5)
    layer.load_state_dict(reference.state_dict())
    assert layer.in_proj_weight is None and layer.k_proj_weight.shape == (EMBED_DIM, 6)
    x, key, value = inputs((7, 3, EMBED_DIM)), inputs((9, 3, 6), 2), inputs((9, 3, 5), 3)
    expected, _ = reference(x, key, value, need_weights=False)
    torch.testing.assert_close(layer(x, key, value)[0], expected, rtol=1e-5, atol=1e-5)


def test_drops_into_transformer_encoder_layer():
    """Swapped into nn.TransformerEncoderLayer, the layer is used even in eval (no fast path)."""
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(EMBED_DIM, NUM_HEADS, dim_feedforward=32,
                                             dropout=0.0, batch_first=True).eval()
    x = inputs()
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[0, 10:] = True
    with torch.no_grad():
        expected = block(x, src_key_padding_mask=padding)
        reference_state = block.self_attn.state_dict()
        block.self_attn = xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator="softmax",
                                                    batch_first=True)
        block.self_attn.load_state_dict(reference_state)
        block.eval()
        out = block(x, src_key_padding_mask=padding)
    torch.testing.assert_close(out[~padding], expected[~padding], rtol=1e-5, atol=1e-5)
    block.self_attn.estimator = "lara"  # a linear estimator changes the output
    with torch.no_grad():
        assert not torch.allclose(block(x, src_key_padding_mask=padding), out, atol=1e-4)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_state_dict_round_trip_reproduces_eval_output(estimator):
    layer = make_layer(estimator, seed=0, redraw_interval=1)
    x = inputs()
    for _ in range(3):  # training steps redraw the features of "rfa"
        layer(x, x, x)
    layer.eval()
    expected, _ = layer(x, x, x)
    restored = make_layer(estimator, seed=5, redraw_interval=1).eval()
    assert not torch.allclose(restored(x, x, x)[0], expected)
    restored.load_state_dict(layer.state_dict())
    torch.testing.assert_close(restored(x, x, x)[0], expected, rtol=0, atol=0)
    if estimator == "rfa":
        assert "features" in layer.state_dict()
        assert torch.equal(restored.features, layer.features)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_eval_outputs_identical_and_training_random(estimator):
    layer = make_layer(estimator, redraw_interval=1)
    x = inputs()
    first, second = layer(x, x, x)[0], layer(x, x, x)[0]
    if estimator == "softmax":
        assert torch.equal(first, second)
    else:  # training draws fresh samples (rfa: redrawn at every step here)
        assert not torch.allclose(first, second)
    layer.eval()
    outputs = [layer(x, x, x)[0] for _ in range(3)]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_rfa_features_redrawn_every_interval_in_training_only():
    interval = 3
    layer = make_layer("rfa", redraw_interval=interval)
    x = inputs()
    initial = layer.features.clone()
    assert initial.shape == (16, EMBED_DIM // NUM_HEADS)
    for _ in range(interval):  # the first `interval` training steps share the features
        layer(x, x, x)
        assert torch.equal(layer.features, initial)
    layer.eval()
    for _ in range(2 * interval):  # evaluation never redraws nor counts steps
        layer(x, x, x)
    assert torch.equal(layer.features, initial)
    layer.train()
    layer(x, x, x)  # step interval + 1 redraws
    redrawn = layer.features.clone()
    assert not torch.equal(redrawn, initial)
    for _ in range(interval - 1):
        layer(x, x, x)
    assert torch.equal(layer.features, redrawn)
    layer.redraw_features()
    assert not torch.equal(layer.features, redrawn)

    fixed = make_layer("rfa", redraw_interval=None)
    fixed_initial = fixed.features.clone()
    for _ in range(5):
        fixed(x, x, x)
    assert torch.equal(fixed.features, fixed_initial)


@pytest.mark.parametrize("estimator", ["rfa", "ra", "lara"])
def test_randomness_from_the_generator_only(estimator):
    """Same generator seed, same training outputs; with a generator, no draw (training calls,
    redraws, evaluation calls) touches torch's global RNG state."""
    x = inputs()
    outputs = []
    for _ in range(2):
        layer = make_layer(estimator, seed=3, redraw_interval=1)
        global_state = torch.random.get_rng_state()
        outputs.append(torch.stack([layer(x, x, x)[0] for _ in range(3)]))
        if estimator == "rfa":
            layer.redraw_features()
        layer.eval()
        layer(x, x, x)
        assert torch.equal(torch.random.get_rng_state(), global_state)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("estimator", ["rfa", "ra", "lara"])
def test_without_generator_draws_come_from_the_default_generator(estimator):
    """As documented: without ``generator=``, training draws come from torch's default
    generator and advance it exactly as they would advance a ``generator=`` in the same
    state; evaluation calls leave it unchanged."""
    torch.manual_seed(0)
    layer = xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator=estimator,
                                      redraw_interval=1, **SMALL_OPTIONS[estimator])
    assert layer.generator is None
    x = inputs()
    torch.manual_seed(11)
    twin = copy.deepcopy(layer)
    twin.generator = torch.Generator().manual_seed(11)
    for _ in range(3):  # rfa: a redraw at every step after the first
        out = layer(x, x, x)[0]
        torch.testing.assert_close(out, twin(x, x, x)[0], rtol=0, atol=0)
        assert torch.equal(torch.random.get_rng_state(), twin.generator.get_state())
    if estimator == "rfa":
        layer.redraw_features()
        twin.redraw_features()
        assert torch.equal(layer.features, twin.features)
    state = torch.random.get_rng_state()
    layer.eval()
    layer(x, x, x)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_one_optimisation_step_lowers_the_loss(estimator):
    """One SGD step on a training-mode loss lowers the (deterministic) evaluation loss."""
    layer = make_layer(estimator, batch_first=True, redraw_interval=1)
    x = inputs(seed=4)
    target = torch.tanh(x @ inputs((EMBED_DIM, EMBED_DIM), seed=6))  # regression target

    def eval_loss():
        layer.eval()
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(layer(x, x, x)[0], target)
        layer.train()
        return float(loss)

    before = eval_loss()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(layer(x, x, x)[0], target).backward()
    optimizer.step()
    after = eval_loss()
    assert after < before


def test_half_precision_forward():
    layer = make_layer("rfa").to(torch.bfloat16)
    x = inputs().to(torch.bfloat16)
    out, _ = layer(x, x, x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert layer.features.dtype == torch.bfloat16


def test_copy_keeps_features():
    layer = make_layer("rfa")
    clone = copy.deepcopy(layer)
    assert torch.equal(clone.features, layer.features)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(4\)"):
        xtorch.MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="estimator must be one of"):
        xtorch.MultiheadAttention(16, 4, estimator="performer")
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        xtorch.MultiheadAttention(16, 0)
    with pytest.raises(ValueError, match="dropout must be 0"):
        xtorch.MultiheadAttention(16, 4, dropout=0.1)
    with pytest.raises(ValueError, match="redraw_interval must be >= 1"):
        xtorch.MultiheadAttention(16, 4, estimator="rfa", redraw_interval=0)
    with pytest.raises(TypeError, match="does not take the option"):
        xtorch.MultiheadAttention(16, 4, estimator="rfa", num_samples=3)
    with pytest.raises(TypeError, match="does not take the option"):
        xtorch.MultiheadAttention(16, 4, estimator="lara", deterministic=True)
    with pytest.raises(ValueError, match="proposal"):
        xtorch.MultiheadAttention(16, 4, estimator="lara", proposal="uniform")
    with pytest.raises(ValueError, match="feature_map"):
        xtorch.MultiheadAttention(16, 4, estimator="rfa", feature_map="relu")
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        xtorch.MultiheadAttention(16, 4, generator=0)

    layer = make_layer("lara")
    x = inputs((12, 2, EMBED_DIM))
    with pytest.raises(ValueError, match="need_weights=True is not supported"):
        layer(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(2, 12\)"):
        layer(x, x, x, key_padding_mask=torch.zeros(12, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"only 0 \(attend\) and -inf"):
        layer(x, x, x, key_padding_mask=torch.full((2, 12), 0.5))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(12, 12\)"):
        layer(x, x, x, attn_mask=torch.zeros(8, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask is not supported except as the causal"):
        layer(x, x, x, attn_mask=torch.eye(12, dtype=torch.bool))
    segments_look_ahead = r"lara\(causal=True\): proposal='segment' looks ahead"
    with pytest.raises(ValueError, match=segments_look_ahead) as from_layer:
        layer(x, x, x, is_causal=True)
    with pytest.raises(ValueError) as from_function:  # the function's own error
        xattn.lara(*(np.ones((1, 4, 2)),) * 3, num_samples=2, causal=True)
    assert str(from_layer.value) == str(from_function.value)
    with pytest.raises(ValueError, match="query must have 16 features"):
        layer(x[..., :8], x, x)
    with pytest.raises(ValueError, match="redraw_features needs estimator='rfa'"):
        layer.redraw_features()


@pytest.mark.parametrize("sample_norm", ["chi", "sqrt_dim"])
def test_rfa_feature_options_reach_the_sampler(sample_norm):
    layer = xtorch.MultiheadAttention(16, 2, estimator="rfa", num_features=8, orthogonal=True,
                                      sample_norm=sample_norm,
                                      generator=torch.Generator().manual_seed(0))
    norms = torch.linalg.vector_norm(layer.features, dim=-1)
    if sample_norm == "sqrt_dim":  # every row rescaled to sqrt(head_dim)
        torch.testing.assert_close(norms, torch.full_like(norms, 8**0.5))
    else:  # chi(head_dim) norms differ from row to row
        assert float(norms.std()) > 1e-3


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("kdim,bias", [(None, True), (None, False), (6, True)])
def test_torch_state_dict_loads_strictly(estimator, kdim, bias):
    """A state_dict of torch.nn.MultiheadAttention loads strictly into every estimator
    (rfa keeps its own features), also as a submodule; only the features are optional."""
    reference = torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, bias=bias, kdim=kdim,
                                            vdim=kdim)
    layer = make_layer(estimator, bias=bias, kdim=kdim, vdim=kdim)
    features = None if layer.features is None else layer.features.clone()
    result = layer.load_state_dict(reference.state_dict())  # strict=True
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, tensor in reference.state_dict().items():
        assert torch.equal(layer.state_dict()[name], tensor), name
    if features is not None:
        assert torch.equal(layer.features, features)

    block = torch.nn.TransformerEncoderLayer(EMBED_DIM, NUM_HEADS, dim_feedforward=8,
                                             dropout=0.0)
    state = block.state_dict()
    block.self_attn = make_layer(estimator)
    block.load_state_dict(state)  # strict, with the prefix "self_attn."

    for missing in reference.state_dict():
        incomplete = {name: tensor for name, tensor in reference.state_dict().items()
                      if name != missing}
        with pytest.raises(RuntimeError, match=f"Missing key.*{missing}"):
            layer.load_state_dict(incomplete)


# --- bool options and flags: NumPy bools accepted, anything else a TypeError naming it ---


CONSTRUCTOR_BOOL_CASES = constructor_bool_cases(xtorch.MultiheadAttention)
FORWARD_BOOL_CASES = bool_options(xtorch.MultiheadAttention.forward)


def outcome(layer, x, **flags):
    """The output of ``layer(x, x, x, **flags)``, or the type of the error it raises."""
    try:
        return layer(x, x, x, **flags)[0]
    except (TypeError, ValueError) as error:
        return type(error)


def test_bool_arguments_are_found():
    assert {"bias", "batch_first"} <= {name for _, name in CONSTRUCTOR_BOOL_CASES}
    assert ("rfa", "orthogonal") in CONSTRUCTOR_BOOL_CASES
    assert {"need_weights", "is_causal", "average_attn_weights"} <= set(FORWARD_BOOL_CASES)


@pytest.mark.parametrize("estimator,option", CONSTRUCTOR_BOOL_CASES)
def test_constructor_bool_options_take_numpy_bools(estimator, option):
    """np.True_ / np.False_ build the layer a Python bool builds (same parameters, same
    output); a str or an int is a TypeError naming the option, at construction."""
    x = inputs()
    for flag in (True, False):
        layers = [make_layer(estimator, **{option: value}).eval()
                  for value in (np.bool_(flag), flag)]
        assert layers[0].state_dict().keys() == layers[1].state_dict().keys()
        for name, tensor in layers[1].state_dict().items():
            assert torch.equal(layers[0].state_dict()[name], tensor), name
        torch.testing.assert_close(layers[0](x, x, x)[0], layers[1](x, x, x)[0],
                                   rtol=0, atol=0)
    for bad in ("x", 1):
        with pytest.raises(TypeError, match=rf"{option} must be a bool, got "):
            make_layer(estimator, **{option: bad})


@pytest.mark.parametrize("option", FORWARD_BOOL_CASES)
@pytest.mark.parametrize("estimator", ["softmax", "rfa"])
def test_forward_bool_flags_take_numpy_bools(estimator, option):
    """Each flag of forward behaves the same with np.True_ / np.False_ as with True /
    False (the same output, or the same error: need_weights=True is refused); a str or an
    int is a TypeError naming the flag, never taken as truthy (is_causal="x" is not
    causal, need_weights="x" is not reported as need_weights=True)."""
    layer = make_layer(estimator).eval()
    x = inputs()
    for flag in (True, False):
        with_numpy = outcome(layer, x, **{option: np.bool_(flag)})
        with_python = outcome(layer, x, **{option: flag})
        if isinstance(with_python, type):
            assert with_numpy is with_python
        else:
            torch.testing.assert_close(with_numpy, with_python, rtol=0, atol=0)
    for bad in ("x", 1, None):
        with pytest.raises(TypeError, match=rf"^{option} must be a bool, got "):
            layer(x, x, x, **{option: bad})


def test_bad_option_table_covers_every_option():
    """Every option the layers pass on has bad values in the table below."""
    assert {estimator: set(options) for estimator, options in BAD_OPTION_VALUES.items()} == {
        estimator: set(options) for estimator, options in _layers.ESTIMATOR_OPTIONS.items()}


@pytest.mark.parametrize("estimator,option,value", BAD_OPTION_CASES)
def test_every_bad_option_value_fails_at_construction(estimator, option, value):
    """Whatever the value and however short the input later is, a value the estimator
    rejects is rejected at construction, with the estimator's exception type and a
    message naming the option."""
    with pytest.raises(direct_error(estimator, option, value), match=option):
        xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator=estimator, **{option: value})


@pytest.mark.parametrize("estimator,options", [
    ("softmax", {}), ("rfa", {"num_features": 2048}), ("ra", {"num_samples": 512}),
    ("lara", {"num_samples": 512}), ("lara", {"grid": (64, 64), "num_samples": (2, 2)}),
])
def test_construction_probes_a_tiny_input_whatever_the_sample_count(monkeypatch, estimator,
                                                                     options):
    """The construction-time probe runs the estimator on PROBE_LENGTH tokens, whatever the
    sample counts (RA's cost grows with length² x samples), and draws from no generator."""
    lengths = []
    real_attend = _layers.attend

    def spy(estimator, q, k, v, **kwargs):
        lengths.append((q.shape[-2], k.shape[-2]))
        return real_attend(estimator, q, k, v, **kwargs)

    monkeypatch.setattr(_layers, "attend", spy)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    layer = xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator=estimator,
                                      generator=generator, **options)
    assert lengths and max(max(pair) for pair in lengths) <= 4
    if layer.features is None:  # rfa draws its first features from the generator
        assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize("options,error,message", BAD_GRID_OPTIONS)
def test_bad_grid_options_fail_at_construction(options, error, message):
    with pytest.raises(error, match=message):
        xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator="lara", **options)


def _image_transpose(x, grid):
    """(batch, H*W, E) tokens of an H x W image in row-major order -> the W x H image."""
    batch, _, features = x.shape
    return x.reshape(batch, *grid, features).transpose(1, 2).reshape(batch, -1, features)


def test_lara_grid_reaches_the_estimator():
    """grid=(H, W): a 1 x W grid is 1-D LARA in both modes (same generator seed); a 2-D grid
    segments the image: its evaluation output is equivariant under transposing the image
    (grid and pools swapped), which 1-D segments of the token sequence are not."""
    x = inputs((2, 12, EMBED_DIM))
    one_row = make_layer("lara", seed=2, grid=(1, 12), num_samples=(1, 4), batch_first=True)
    one_d = make_layer("lara", seed=2, num_samples=4, batch_first=True)
    for _ in range(2):  # two training steps, then evaluation
        torch.testing.assert_close(one_row(x, x, x)[0], one_d(x, x, x)[0], rtol=1e-6,
                                   atol=1e-6)
    one_row.eval()
    one_d.eval()
    torch.testing.assert_close(one_row(x, x, x)[0], one_d(x, x, x)[0], rtol=1e-6, atol=1e-6)

    grid, pools = (3, 4), (2, 2)
    image = make_layer("lara", grid=grid, num_samples=pools, batch_first=True).eval()
    transposed = make_layer("lara", grid=grid[::-1], num_samples=pools[::-1],
                            batch_first=True).eval()
    sequence = make_layer("lara", num_samples=4, batch_first=True).eval()
    with torch.no_grad():
        out = image(x, x, x)[0]
        x_t = _image_transpose(x, grid)
        torch.testing.assert_close(transposed(x_t, x_t, x_t)[0], _image_transpose(out, grid),
                                   rtol=1e-5, atol=1e-6)
        out_1d = sequence(x, x, x)[0]
        assert not torch.allclose(out_1d, out, atol=1e-3)
        x_t_1d = sequence(x_t, x_t, x_t)[0]
        assert not torch.allclose(x_t_1d, _image_transpose(out_1d, grid), atol=1e-3)
    with pytest.raises(ValueError, match=r"grid \(H, W\) = \(3, 4\) needs query and key "
                                         r"sequences of H \* W = 12 tokens"):
        image(x[:, :10], x[:, :10], x[:, :10])


def _manual_forward(layer, x, function, keywords):
    """Multi-head attention written out with the layer's weights ((batch, L, E) inputs)."""
    batch, length, _ = x.shape
    weights = layer.in_proj_weight.split(EMBED_DIM)
    biases = layer.in_proj_bias.split(EMBED_DIM)
    q, k, v = (torch.nn.functional.linear(x, weight, bias).reshape(batch, length, NUM_HEADS, -1)
               .transpose(1, 2) for weight, bias in zip(weights, biases, strict=True))
    heads = function(q, k, v, **keywords)  # (batch, heads, L, head_dim)
    return layer.out_proj(heads.transpose(1, 2).reshape(batch, length, EMBED_DIM))


@pytest.mark.parametrize("estimator,options", PASS_THROUGH_CASES)
def test_layer_is_the_estimator_on_its_projections(estimator, options):
    """In both modes, with and without causal masking, the layer computes multi-head
    attention with the estimator and its options unchanged (noise_scale, grid, window,
    sinks, ...), drawing from its generator."""
    layer = xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator=estimator,
                                      batch_first=True,
                                      generator=torch.Generator().manual_seed(5), **options)
    x = inputs((2, 12, EMBED_DIM))
    causal_modes = (False,) if estimator == "lara" else (False, True)
    with torch.no_grad():
        for training in (True, False):
            for causal in causal_modes:
                layer.train(training)
                rng = torch.Generator()
                rng.set_state(layer.generator.get_state())
                function, keywords = estimator_call(estimator, options, training=training,
                                                    omega=layer.features, rng=rng)
                keywords = {**keywords, "causal": True} if causal else keywords
                expected = _manual_forward(layer, x, function, keywords)
                torch.testing.assert_close(layer(x, x, x, is_causal=causal)[0], expected,
                                           rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sinks", [12, 13, 1000])
def test_rfa_with_every_key_a_sink_is_exact_attention(sinks):
    """sinks >= the key length (capped there): every key is computed exactly, so the rfa
    layer equals the softmax layer with the same weights, in both modes and causal."""
    exact = make_layer("softmax", batch_first=True)
    layer = make_layer("rfa", batch_first=True, sinks=sinks)
    layer.load_state_dict(exact.state_dict())
    x = inputs((2, 12, EMBED_DIM))
    with torch.no_grad():
        for training in (True, False):
            layer.train(training)
            for causal in (False, True):
                torch.testing.assert_close(layer(x, x, x, is_causal=causal)[0],
                                           exact(x, x, x, is_causal=causal)[0],
                                           rtol=1e-5, atol=1e-5)
