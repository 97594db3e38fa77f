"""Generation with the layers: ``xattn.torch.MultiheadAttention.step`` and the cache of
``xattn.flax.MultiHeadAttention`` (``init_cache``, ``decode=True``).

The property under test: a sequence given to a layer in pieces (a prompt, single tokens,
a chunk) gets the outputs of one causal call on the whole sequence, 1e-5 relative in
float32, for softmax, RFA (plain, with window and sinks, with more sinks than the prompt),
RA (evaluation mode: its biased deterministic form) and causal LARA with learned proposals
(evaluation mode: the means as samples), in evaluation mode and, where the estimator draws
nothing per call (softmax, RFA), in training mode; under ``nnx.jit`` a
decoding step traces once. Then what is reproducible of RA's training mode (the prompt),
gradients through the torch state, and the errors of misuse.
"""

from __future__ import annotations

import numpy as np
import pytest

import xattn

torch = pytest.importorskip("torch")
xtorch = pytest.importorskip("xattn.torch")
jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
xflax = pytest.importorskip("xattn.flax")
jnp = jax.numpy

EMBED_DIM, NUM_HEADS, LENGTH = 16, 4, 12
PIECES = ((0, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 12))  # prompt, tokens, a chunk
CASES = {
    "softmax": ("softmax", {}),
    "rfa": ("rfa", {"num_features": 16}),
    "rfa-window-sinks": ("rfa", {"num_features": 16, "window": 2, "sinks": 2}),
    "rfa-sinks-past-prompt": ("rfa", {"num_features": 16, "window": 1, "sinks": 7}),
    "ra": ("ra", {"num_samples": 2}),
    "lara-learned": ("lara", {"num_samples": 6, "proposal": "learned"}),
    "lara-learned-balance": ("lara", {"num_samples": 6, "proposal": "learned",
                                      "weighting": "balance", "defensive": 2}),
}
# training mode draws per call for RA and LARA: only softmax and RFA are reproducible token
# by token
MODES = [(case, mode) for case in CASES for mode in ("eval", "train")
         if mode == "eval" or CASES[case][0] not in ("ra", "lara")]


def eval_samples(means, options, shape):
    """LARA's samples in evaluation mode, broadcast to ``shape``: the means (h, C, d), the
    last ``defensive`` of them 0 (N(0, I) proposals)."""
    means = np.asarray(means)
    kept = np.arange(means.shape[-2]) < means.shape[-2] - options.get("defensive", 0)
    return np.broadcast_to(np.where(kept[:, None], means, 0.0), shape)


def assert_close(out, expected):
    out, expected = np.asarray(out), np.asarray(expected)
    np.testing.assert_allclose(out, expected, rtol=1e-5,
                               atol=1e-5 * float(np.max(np.abs(expected))))


# -- torch: step(query, state) -> (output, state) ------------------------------------------

def torch_layer(estimator, options, seed=0, **kwargs):
    torch.manual_seed(seed)  # parameter init, as for torch.nn.MultiheadAttention
    return xtorch.MultiheadAttention(EMBED_DIM, NUM_HEADS, estimator=estimator,
                                     generator=torch.Generator().manual_seed(seed),
                                     **options, **kwargs)


def torch_inputs(shape=(2, LENGTH, EMBED_DIM), seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def torch_steps(layer, x, pieces=PIECES, dim=1, **kwargs):
    outputs, state = [], None
    for start, stop in pieces:
        out, state = layer.step(x[:, start:stop] if dim == 1 else x[start:stop], state,
                                **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=dim), state


STATE_CLASSES = {"softmax": xattn.SoftmaxState, "rfa": xattn.RFAState, "ra": xattn.RAState,
                 "lara": xattn.LARAState}


@pytest.mark.parametrize(("case", "mode"), MODES)
def test_torch_step_equals_causal_forward(case, mode):
    estimator, options = CASES[case]
    layer = torch_layer(estimator, options, batch_first=True).train(mode == "train")
    x = torch_inputs()
    with torch.no_grad():
        out, state = torch_steps(layer, x)
        whole, _ = layer(x, x, x, is_causal=True)
    assert out.shape == whole.shape
    assert_close(out, whole)
    assert type(state) is STATE_CLASSES[estimator]
    if estimator == "lara":  # evaluation mode's samples: the learned means (defensive: 0)
        omega = np.asarray(state.features.omega)
        assert np.array_equal(omega, eval_samples(layer.proposal_means.detach(), options,
                                                  omega.shape))
        state = state.features
    assert int(state.position) == LENGTH
    if estimator == "rfa":  # the layer's features, kept by the sequence
        assert torch.equal(state.omega, layer.features)
        assert layer.steps_since_redraw == (1 if mode == "train" else 0)  # forward's only


@pytest.mark.parametrize("case", ["softmax", "rfa-window-sinks", "ra"])
def test_torch_step_sequence_first_unbatched_and_padding(case):
    """``batch_first=False`` with a ``key_padding_mask`` per piece (masked tokens never
    attended, now or later), and unbatched inputs."""
    estimator, options = CASES[case]
    layer = torch_layer(estimator, options).eval()
    x = torch_inputs((LENGTH, 2, EMBED_DIM))
    padding = torch.zeros(2, LENGTH, dtype=torch.bool)
    padding[0, [1, 6, 8]] = True
    padding[1, 0] = True
    with torch.no_grad():
        outputs, state = [], None
        for start, stop in PIECES:
            out, state = layer.step(x[start:stop], state,
                                    key_padding_mask=padding[:, start:stop])
            outputs.append(out)
        whole, _ = layer(x, x, x, key_padding_mask=padding, is_causal=True)
        assert_close(torch.cat(outputs), whole)
        single, _ = torch_steps(layer, x[:, 1], dim=0)  # unbatched (L, E)
        assert_close(single, layer(x[:, 1], x[:, 1], x[:, 1], is_causal=True)[0])


def test_torch_step_key_and_value_inputs():
    """Other key and value inputs (kdim, vdim) at the same positions."""
    layer = torch_layer("rfa", {"num_features": 16}, kdim=6, vdim=5, batch_first=True).eval()
    x, key, value = torch_inputs(), torch_inputs((2, LENGTH, 6), 2), torch_inputs((2, LENGTH, 5), 3)
    with torch.no_grad():
        outputs, state = [], None
        for start, stop in PIECES:
            out, state = layer.step(x[:, start:stop], state, key=key[:, start:stop],
                                    value=value[:, start:stop])
            outputs.append(out)
        assert_close(torch.cat(outputs, dim=1), layer(x, key, value, is_causal=True)[0])


@pytest.mark.parametrize("case", ["softmax", "rfa-window-sinks"])
def test_torch_step_gradients_equal_the_forward(case):
    """Autograd flows through the state: the gradient of the last token's output after a
    prompt and two steps is that of the causal forward's last row."""
    estimator, options = CASES[case]
    layer = torch_layer(estimator, options, batch_first=True).eval()
    x = torch_inputs((2, 8, EMBED_DIM))
    out, _ = torch_steps(layer, x, pieces=((0, 6), (6, 7), (7, 8)))
    step_grads = torch.autograd.grad(out[:, -1].square().sum(), list(layer.parameters()))
    whole, _ = layer(x, x, x, is_causal=True)
    forward_grads = torch.autograd.grad(whole[:, -1].square().sum(), list(layer.parameters()))
    for step_grad, forward_grad in zip(step_grads, forward_grads, strict=True):
        assert_close(step_grad, forward_grad)


def test_torch_ra_training_prompt_uses_the_forward_draws():
    """RA in training mode draws per call: the prompt, drawn as one causal forward draws,
    equals it for the same generator state; a later step draws afresh (not the eval form)."""
    layer = torch_layer("ra", {"num_samples": 2}, batch_first=True).train()
    x = torch_inputs()
    with torch.no_grad():
        layer.generator.manual_seed(5)
        prompt, state = layer.step(x)
        layer.generator.manual_seed(5)
        whole, _ = layer(x, x, x, is_causal=True)
        assert torch.equal(prompt, whole)
        token, _ = layer.step(x[:, :1], state)
        evaluation, _ = layer.eval().step(x[:, :1], state)
    assert not torch.allclose(token, evaluation)


def test_torch_step_misuse():
    x = torch_inputs()
    with pytest.raises(ValueError, match="step continues a causal sequence, but the LARA "
                                         "layer's options have no causal form: "
                                         r"lara\(causal=True\): proposal='segment' looks ahead"):
        torch_layer("lara", {"num_samples": 4}, batch_first=True).step(x)
    with pytest.raises(ValueError, match="weighting='decoupled' looks ahead"):
        torch_layer("lara", {"num_samples": 4, "proposal": "standard"}, batch_first=True).step(x)
    layer = torch_layer("rfa", {"num_features": 16}, batch_first=True).eval()
    _, state = layer.step(x[:, :5])
    with pytest.raises(TypeError, match=r"state must be an xattn.RFAState.*got SoftmaxState"):
        layer.step(x[:, 5:6], torch_layer("softmax", {}, batch_first=True).step(x[:, :5])[1])
    with pytest.raises(TypeError, match=r"state must be an xattn\.RFAState.*got Tensor"):
        layer.step(x[:, 5:6], state.omega)
    with pytest.raises(ValueError, match=r"state was made for .* = \(2, 4, 4, 4\), but these "
                                         r"tokens have \(3, 4, 4, 4\)"):
        layer.step(torch_inputs((3, 1, EMBED_DIM)), state)
    with pytest.raises(ValueError, match=r"state was made for .* \(2, 4, 4, 4\), but these "
                                         r"tokens have \(2, 2, 8, 8\)"):
        two_heads = xtorch.MultiheadAttention(EMBED_DIM, 2, estimator="rfa", num_features=16,
                                              batch_first=True)
        two_heads.step(x[:, 5:6], state)
    with pytest.raises(ValueError, match="same new tokens; got 1 queries and 2 keys"):
        layer.step(x[:, 5:6], state, key=x[:, 5:7])
    layer.redraw_features()  # a sequence keeps its features: refused, never mixed
    with pytest.raises(ValueError, match="state holds other RFA features than the layer"):
        layer.step(x[:, 5:6], state)
    other = torch_layer("rfa", {"num_features": 16}, seed=3, batch_first=True)
    layer.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="redrawn or loaded after the sequence began"):
        layer.step(x[:, 5:6], state)
    layer.step(x[:, 5:6])  # a new sequence begins with the layer's features


# -- Flax: init_cache, then calls with decode=True --------------------------------------------

def flax_layer(estimator, options, seed=0, **kwargs):
    return xflax.MultiHeadAttention(NUM_HEADS, EMBED_DIM, estimator=estimator,
                                    rngs=nnx.Rngs(seed), **options, **kwargs)


def flax_inputs(shape=(2, LENGTH, EMBED_DIM), seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype=jnp.float32)


def decode_pieces(layer, x, pieces=PIECES, call=None, **kwargs):
    call = call or (lambda layer, tokens: layer(tokens, decode=True, **kwargs))
    return jnp.concatenate([call(layer, x[:, start:stop]) for start, stop in pieces], axis=1)


# eager for these cases; the others compiled (nnx.jit: one program per piece length rather
# than one per operation), which runs the same lines of the layer
EAGER_DECODE_CASES = (("rfa", "eval"), ("rfa", "train"), ("ra", "eval"))


@pytest.mark.parametrize(("case", "mode"), MODES)
def test_flax_decode_equals_causal_call(case, mode):
    estimator, options = CASES[case]
    layer = flax_layer(estimator, options, deterministic=mode == "eval")
    x = flax_inputs()
    layer.init_cache(x.shape)
    if (case, mode) in EAGER_DECODE_CASES:
        out, whole = decode_pieces(layer, x), layer(x, is_causal=True)
    else:
        out = decode_pieces(layer, x, call=nnx.jit(
            lambda layer, tokens: layer(tokens, decode=True)))
        whole = nnx.jit(lambda layer, x: layer(x, is_causal=True))(layer, x)
    assert_close(out, whole)
    state = layer.cache.get_value()
    assert type(state) is STATE_CLASSES[estimator]
    assert int(layer.cache_index[...]) == LENGTH
    if estimator == "lara":  # fixed size: evaluation mode's samples, the learned means
        assert int(state.features.position) == LENGTH
        omega = np.asarray(state.features.omega)
        assert np.array_equal(omega, eval_samples(layer.proposal_means[...], options,
                                                  omega.shape))
    elif estimator == "rfa":  # the layer's features; decoding never redraws nor counts
        assert int(state.position) == LENGTH
        assert bool(jnp.array_equal(state.omega, layer.features[...]))
        assert int(layer.steps_since_redraw[...]) == (1 if mode == "train" else 0)
    else:  # a key-value cache of max_length slots, all filled
        assert state.keys.shape == (2, NUM_HEADS, LENGTH, EMBED_DIM // NUM_HEADS)
        assert bool(jnp.all(state.valid))


@pytest.mark.parametrize("case", ["softmax", "rfa-window-sinks", "ra", "lara-learned"])
def test_flax_decode_under_nnx_jit_traces_once_per_length(case):
    """A prompt, then single tokens: each length traces once (the cache keeps its shapes);
    with a key mask on the new tokens; a batch of shape (2, 3)."""
    estimator, options = CASES[case]
    layer = flax_layer(estimator, options, deterministic=True)
    x = flax_inputs((2, 3, LENGTH, EMBED_DIM))
    mask = np.ones((2, 3, 1, 1, LENGTH), dtype=bool)
    mask[0, 1, ..., [2, 7]] = False
    mask = jnp.asarray(mask)
    traces = []

    @nnx.jit
    def step(layer, tokens, mask):
        traces.append(tokens.shape[-2])
        return layer(tokens, mask=mask, decode=True)

    layer.init_cache((2, 3, LENGTH + 4, EMBED_DIM))  # more slots than tokens
    pieces = ((0, 4), *((t, t + 1) for t in range(4, LENGTH)))
    out = jnp.concatenate([step(layer, x[..., start:stop, :], mask[..., start:stop])
                           for start, stop in pieces], axis=-2)
    assert sorted(traces) == [1, 4]
    # the whole sequence compiled too (eager JAX compiles each operation on its own; the
    # eager call is checked in test_flax_decode_equals_causal_call)
    whole = nnx.jit(lambda layer, x, mask: layer(x, mask=mask, is_causal=True))
    assert_close(out, whole(layer, x, mask))


def test_flax_decode_training_mode_neither_redraws_nor_counts():
    """redraw_interval=1: a training call redraws the features once one call has used them;
    decoding calls never do (the outputs would not match), and leave the count alone."""
    layer = flax_layer("rfa", {"num_features": 16}, redraw_interval=1)
    x = flax_inputs()
    layer.init_cache(x.shape)
    before = layer.features[...]
    out = decode_pieces(layer, x)
    assert bool(jnp.array_equal(layer.features[...], before))
    assert int(layer.steps_since_redraw[...]) == 0
    assert_close(out, layer(x, is_causal=True))  # the first training call: no redraw yet
    layer(x)  # the second one redraws
    assert not bool(jnp.array_equal(layer.features[...], before))


def test_flax_ra_training_prompt_uses_the_call_draws():
    layer = flax_layer("ra", {"num_samples": 2})
    x = flax_inputs()
    layer.init_cache(x.shape)
    prompt = layer(x, decode=True, rngs=nnx.Rngs(attention=5))
    # the padded cache (its empty slots are masked keys) gives the same estimate
    assert_close(prompt, layer(x, is_causal=True, rngs=nnx.Rngs(attention=5)))


def test_flax_view_makes_the_cache():
    layer = flax_layer("softmax", {})
    decoder = nnx.view(layer, decode=True, deterministic=True, batch_size=2,
                       max_length=LENGTH)
    x = flax_inputs()
    out = decode_pieces(decoder, x, call=lambda layer, tokens: layer(tokens))
    assert decoder.decode and layer.cache is None  # a view: the layer itself unchanged
    assert_close(out, layer(x, is_causal=True, deterministic=True))
    with pytest.raises(TypeError, match="needs batch_size and max_length"):
        nnx.view(layer, decode=True, batch_size=2)
    rfa = nnx.view(flax_layer("rfa", {"num_features": 16}), decode=True, batch_size=(2,))
    assert type(rfa.cache.get_value()) is xattn.RFAState  # no max_length: fixed size


def test_flax_redrawn_features_under_jit_keep_the_cache_features():
    """Outside nnx.jit a decoding call refuses a cache whose features the layer no longer
    has; under nnx.jit, where they cannot be compared, it goes on with the cache's, as
    documented: never a mix of the two."""
    layer = flax_layer("rfa", {"num_features": 16}, deterministic=True)
    x = flax_inputs()
    expected = layer(x, is_causal=True)
    layer.init_cache(x.shape)
    prompt = layer(x[:, :8], decode=True)
    layer.redraw_features()
    with pytest.raises(ValueError, match="cache holds other RFA features than the layer"):
        layer(x[:, 8:9], decode=True)
    step = nnx.jit(lambda layer, tokens: layer(tokens, decode=True))
    rest = decode_pieces(layer, x, pieces=((8, 9), (9, 12)), call=step)
    assert_close(jnp.concatenate([prompt, rest], axis=1), expected)


def test_flax_decode_misuse():
    x = flax_inputs()
    with pytest.raises(ValueError, match="decode=True continues a causal sequence, but "
                                         "the LARA layer's options"):
        flax_layer("lara", {"num_samples": 4}, decode=True)
    lara = flax_layer("lara", {"num_samples": 4})
    with pytest.raises(ValueError, match="init_cache continues a causal sequence"):
        lara.init_cache(x.shape)
    with pytest.raises(ValueError, match="decode=True continues a causal sequence"):
        lara(x, decode=True)
    layer = flax_layer("softmax", {}, decode=True)
    with pytest.raises(ValueError, match=r"decode=True needs the cache: call init_cache"):
        layer(x)
    with pytest.raises(TypeError, match="decode must be a bool"):
        layer(x, decode="yes")
    for shape, error in (([2, 12.0, 16], TypeError), ((2, 12, 8), ValueError),
                         ((16,), ValueError), ((0, 12, 16), ValueError)):
        with pytest.raises(error, match="input_shape must be"):
            layer.init_cache(shape)
    layer.init_cache((2, 6, EMBED_DIM))
    with pytest.raises(ValueError, match=r"cache was made for .* \(2, 4, 4, 4\), but these "
                                         r"tokens have \(3, 4, 4, 4\)"):
        layer(flax_inputs((3, 1, EMBED_DIM)))
    with pytest.raises(ValueError, match="same new tokens; got 1 queries and 2 keys"):
        layer(x[:, :1], x[:, :2])
    layer(x[:, :5])
    with pytest.raises(ValueError, match=r"cache has 6 slots \(max_length\) and holds 5 "
                                         r"tokens: 2 more do not fit"):
        layer(x[:, 5:7])
    layer(x[:, 5:6])  # the last slot
    assert int(layer.cache_index[...]) == 6
