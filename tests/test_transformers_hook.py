"""The Hugging Face transformers hook (:mod:`xattn.transformers`).

Tiny randomly initialized models built from configs (BERT, GPT-2, Llama with grouped-query
attention): softmax through the hook equals the eager model (1e-5), padding and causal
masks included; RFA, RA and LARA in evaluation mode are deterministic and equal xattn's
functions on the same inputs; training mode draws; ``generate`` gives the eager tokens
with softmax and the recomputed (full-prefix) tokens with RFA, and with a static cache the
sdpa tokens with softmax and the dynamic-cache tokens with RFA and RA; every unsupported
mask or argument (``output_attentions`` on every model) raises an error that names it.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import xattn  # noqa: E402
import xattn.transformers as xt  # noqa: E402

VOCAB = 100
TOLERANCE = 1e-5  # float32


def bert(**overrides):
    options = {"attention_probs_dropout_prob": 0.0, **overrides}
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, **options)
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def gpt2(width=32, **overrides):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=2, n_head=4,
                                     n_positions=64, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0, **overrides)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama(width=32, **overrides):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width,
                                      intermediate_size=2 * width,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                      **overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


DECODERS = {"gpt2": gpt2, "llama": llama}


@pytest.fixture(scope="module")
def names():
    """Register one attention per estimator (names of this test module)."""
    return {
        "softmax": xt.register("test_xattn_softmax", estimator="softmax").name,
        "rfa": xt.register("test_xattn_rfa", estimator="rfa", num_features=16, window=2,
                           sinks=1).name,
        "ra": xt.register("test_xattn_ra", estimator="ra", num_samples=4).name,
        "lara": xt.register("test_xattn_lara", estimator="lara", num_samples=4).name,
    }


def run(model, implementation, *args, **kwargs):
    model.set_attn_implementation(implementation)
    output = model(*args, **kwargs)
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output.logits


def tokens(batch=2, length=12, seed=1):
    return torch.randint(VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- softmax through the hook is the model's own attention ---------------------------------------

def test_softmax_equals_eager_bert_with_padding(names):
    model, ids = bert(), tokens()
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, 7:] = 0
    expected = run(model, "eager", ids, attention_mask=padding)
    actual = run(model, names["softmax"], ids, attention_mask=padding)
    torch.testing.assert_close(actual, expected, atol=TOLERANCE, rtol=TOLERANCE)
    # the padding is applied: the padded keys change nothing for the real tokens
    alone = run(model, names["softmax"], ids[1:, :7])
    torch.testing.assert_close(actual[1, :7], alone[0], atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_softmax_equals_eager_causal_with_left_padding(names, decoder):
    model, ids = DECODERS[decoder](), tokens()
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0
    expected = run(model, "eager", ids, attention_mask=padding)
    actual = run(model, names["softmax"], ids, attention_mask=padding)
    # padded positions attend no key at all: a zero row here, a uniform one in eager
    torch.testing.assert_close(actual[0], expected[0], atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(actual[1, 4:], expected[1, 4:], atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_generate_softmax_gives_the_eager_tokens(names, decoder):
    model, prompt = DECODERS[decoder](), tokens(length=5)
    model.set_attn_implementation("eager")
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    model.set_attn_implementation(names["softmax"])
    actual = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_generate_rfa_gives_the_recomputed_tokens(names, decoder):
    """With a cache each step attends the new token to the cached keys; without one the
    whole prefix is recomputed: the same greedy tokens."""
    model, prompt = DECODERS[decoder](), tokens(length=5)
    model.set_attn_implementation(names["rfa"])
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
    sequence = prompt
    with torch.no_grad():
        for _ in range(8):
            following = model(sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, following], dim=1)
    assert torch.equal(generated, sequence)


# weights 10x the default scale: the attention, the padding and the estimator then decide
# the greedy tokens of these tiny models (at the default scale GPT-2 repeats one token)
STRONG = {"width": 64, "initializer_range": 0.2}


def left_padded_prompt():
    """Two prompts of 6 and 3 tokens, the second left-padded (a padded batch for generate)."""
    prompt = tokens(length=6)
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[1, :3] = 0
    return prompt, padding


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_generate_softmax_with_a_static_cache_gives_the_sdpa_tokens(names, decoder):
    """A static cache holds more key slots than tokens; transformers' generate builds the
    masks itself and hands the model the hook's mask object, which the model must take
    as a prepared mask; the empty slots and the left padding are masked exactly."""
    model, (prompt, padding) = DECODERS[decoder](**STRONG), left_padded_prompt()
    options = {"attention_mask": padding, "max_new_tokens": 6, "do_sample": False}
    model.set_attn_implementation("sdpa")
    expected = model.generate(prompt, cache_implementation="static", **options)
    assert torch.equal(model.generate(prompt, **options), expected)  # the reference agrees
    model.set_attn_implementation(names["softmax"])
    actual = model.generate(prompt, cache_implementation="static", **options)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("estimator", ["rfa", "ra"])
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_generate_with_a_static_cache_equals_the_dynamic_cache(names, decoder, estimator):
    model, (prompt, padding) = DECODERS[decoder](**STRONG), left_padded_prompt()
    options = {"attention_mask": padding, "max_new_tokens": 6, "do_sample": False}
    model.set_attn_implementation(names[estimator])
    dynamic = model.generate(prompt, **options)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **options),
                       dynamic)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_a_prepared_attention_mask_object_is_taken_by_the_model(names, decoder):
    """The hook's own mask object passed as the model's attention_mask (as generate does
    with a static cache) is a prepared mask: the model uses it as it is."""
    model, ids = DECODERS[decoder](), tokens()
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :3] = 0
    expected = run(model, names["rfa"], ids, attention_mask=padding)
    mask = xt.attention_mask(2, 12, 12, attention_mask=padding)
    assert (mask.ndim, mask.shape) == (4, (2, 1, 12, 12))
    torch.testing.assert_close(run(model, names["rfa"], ids, attention_mask=mask), expected,
                               atol=TOLERANCE, rtol=TOLERANCE)


# -- the estimators through the hook equal xattn's functions ------------------------------------

def attention_inputs(seed=0, heads=4, kv_heads=4, queries=6, keys=6, head_dim=8):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, queries, head_dim, generator=generator)
    k = torch.randn(2, kv_heads, keys, head_dim, generator=generator)
    v = torch.randn(2, kv_heads, keys, head_dim, generator=generator)
    return q, k, v


class FakeModule(torch.nn.Module):
    def __init__(self, layer_idx=0, is_causal=False):
        super().__init__()
        self.layer_idx, self.is_causal = layer_idx, is_causal


def test_rfa_hook_equals_rfa_with_the_module_features():
    function = xt.register("test_xattn_rfa_direct", estimator="rfa", num_features=12, window=1)
    module, (q, k, v) = FakeModule().eval(), attention_inputs()
    padding = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    mask = xt.attention_mask(2, 6, 6, mask_function=transformers.masking_utils
                             .bidirectional_mask_function, attention_mask=padding)
    out, weights = function(module, q, k, v, mask, scaling=0.3)
    omega = function.features(module, 8)
    expected = xattn.rfa(q, k, v, omega=omega, scale=0.3, window=1,
                         key_mask=padding.bool()[:, None, :])
    assert weights is None
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=TOLERANCE, rtol=TOLERANCE)


def test_decoding_rows_equal_the_last_rows_of_one_causal_call():
    """Queries after a cache: the new rows equal those of the causal call on the whole
    sequence; grouped-query keys are repeated to the query heads."""
    function = xt.register("test_xattn_rfa_decode", estimator="rfa", num_features=12,
                           window=2, sinks=1)
    module, (q, k, v) = FakeModule(is_causal=True).eval(), attention_inputs(kv_heads=2)
    k_full, v_full = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    omega = function.features(module, 8)
    whole = xattn.rfa(q, k_full, v_full, omega=omega, causal=True, window=2, sinks=1)
    mask = xt.attention_mask(2, 2, 6, q_offset=4)  # two new tokens after four cached
    out, _ = function(module, q[..., 4:, :], k, v, mask)
    torch.testing.assert_close(out, whole[..., 4:, :].transpose(1, 2), atol=TOLERANCE,
                               rtol=TOLERANCE)
    # no mask at all (a model that builds none): the module's is_causal, queries last
    out, _ = function(module, q[..., 4:, :], k, v, None)
    torch.testing.assert_close(out, whole[..., 4:, :].transpose(1, 2), atol=TOLERANCE,
                               rtol=TOLERANCE)


def test_ra_and_lara_evaluation_equal_their_deterministic_forms(names):
    module, (q, k, v) = FakeModule().eval(), attention_inputs()
    mask = xt.attention_mask(2, 6, 6, mask_function=transformers.masking_utils
                             .bidirectional_mask_function)
    ra = xt.register("test_xattn_ra", estimator="ra", num_samples=4)
    out, _ = ra(module, q, k, v, mask, scaling=0.5)
    expected = xattn.ra(q, k, v, biased=True, deterministic=True, num_samples=4, scale=0.5)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=TOLERANCE, rtol=TOLERANCE)
    lara = xt.register("test_xattn_lara", estimator="lara", num_samples=4)
    out, _ = lara(module, q, k, v, mask, scaling=0.5)
    expected = xattn.lara(q, k, v, deterministic=True, num_samples=4, scale=0.5)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=TOLERANCE, rtol=TOLERANCE)


# -- evaluation is deterministic, training draws ------------------------------------------------

@pytest.mark.parametrize("estimator", ["rfa", "ra", "lara"])
def test_evaluation_is_deterministic_and_training_draws(names, estimator):
    model, ids = bert(), tokens()
    first = run(model, names[estimator], ids)
    assert torch.equal(run(model, names[estimator], ids), first)
    assert torch.equal(run(bert(), names[estimator], ids), first)  # a fresh model, same seed
    model.train()
    torch.manual_seed(1)
    drawn = run(model, names[estimator], ids)
    assert not torch.allclose(drawn, run(model, names[estimator], ids))
    torch.manual_seed(1)  # torch's default generator drives the draws
    assert torch.equal(run(model, names[estimator], ids), drawn)


def test_rfa_features_per_layer_from_the_seed():
    function = xt.register("test_xattn_rfa_seeded", estimator="rfa", num_features=8, seed=3)
    layers = [FakeModule(layer_idx=0), FakeModule(layer_idx=1)]
    first, second = (function.features(layer, 4) for layer in layers)
    assert first.shape == (8, 4)
    assert not torch.equal(first, second)
    again = xt.register("test_xattn_rfa_seeded2", estimator="rfa", num_features=8, seed=3)
    assert torch.equal(again.features(FakeModule(layer_idx=1), 4), second)
    other = xt.register("test_xattn_rfa_seeded3", estimator="rfa", num_features=8, seed=4)
    assert not torch.equal(other.features(FakeModule(layer_idx=1), 4), second)


def test_training_draws_from_the_given_generator():
    xt.register("test_xattn_rfa_generator", estimator="rfa", num_features=16,
                generator=torch.Generator().manual_seed(5))
    model, ids = bert(hidden_dropout_prob=0.0), tokens()  # no draw but the attention's
    model.train()
    state = torch.get_rng_state()
    first = run(model, "test_xattn_rfa_generator", ids)
    assert torch.equal(torch.get_rng_state(), state)  # torch's global generator untouched
    xt.register("test_xattn_rfa_generator", estimator="rfa", num_features=16,
                generator=torch.Generator().manual_seed(5))
    assert torch.equal(run(model, "test_xattn_rfa_generator", ids), first)


# -- masks: padding and causal exactly, anything else raises ----------------------------------

def test_a_prepared_padding_mask_is_read_exactly(names):
    model, ids = DECODERS["gpt2"](), tokens()
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :3] = False
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    prepared = (causal & padding[:, None, :])[:, None]  # (2, 1, 12, 12)
    expected = run(model, names["rfa"], ids, attention_mask=padding.long())
    torch.testing.assert_close(run(model, names["rfa"], ids, attention_mask=prepared),
                               expected, atol=TOLERANCE, rtol=TOLERANCE)
    additive = torch.where(prepared, 0.0, torch.finfo(torch.float32).min)
    torch.testing.assert_close(run(model, names["rfa"], ids, attention_mask=additive),
                               expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_custom_4d_mask_raises(names):
    model, ids = bert(), tokens()
    custom = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    custom[:, :, 3, 5] = False  # one blocked pair: neither padding nor causal
    with pytest.raises(ValueError, match="neither a padding mask nor a causal mask"):
        run(model, names["rfa"], ids, attention_mask=custom)
    bias = torch.zeros(2, 1, 12, 12)
    bias[:, :, 0, 0] = -1.0  # an additive bias
    with pytest.raises(ValueError, match="no additive bias"):
        run(model, names["rfa"], ids, attention_mask=bias)
    with pytest.raises(ValueError, match="shape"):
        run(model, names["rfa"], ids, attention_mask=torch.ones(2, 4, 12, 12, dtype=torch.bool))


def test_packed_sequences_and_sliding_windows_raise(names):
    model, ids = DECODERS["llama"](), tokens()
    model.set_attn_implementation(names["rfa"])
    packed = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]] * 2)  # two sequences a row
    with pytest.raises(ValueError, match="packed-sequence"):
        model(ids, position_ids=packed, use_cache=False)  # packing is found without a cache
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=4)
    mistral = transformers.MistralModel(config).eval()
    mistral.set_attn_implementation(names["softmax"])
    with pytest.raises(ValueError, match="sliding-window"):
        mistral(ids)


def test_lara_with_look_ahead_options_in_causal_attention_raises(names):
    """The default LARA (segment proposals, decoupled weighting) has no causal form."""
    model = DECODERS["gpt2"]()
    model.set_attn_implementation(names["lara"])
    with pytest.raises(ValueError, match=r"no causal form: .*proposal='segment' looks ahead"):
        model(tokens())
    lara = xt.register("test_xattn_lara_standard", estimator="lara", num_samples=4,
                       proposal="standard")  # with the default weighting, "decoupled"
    model.set_attn_implementation(lara.name)
    with pytest.raises(ValueError, match="weighting='decoupled' looks ahead"):
        model(tokens())


def test_causal_lara_equals_the_causal_function_with_the_modules_means():
    """proposal='learned' in a decoder: causal LARA with one fixed (C, d) set of means per
    module (deterministic: the means are the samples), queries after a cached prefix
    included."""
    lara = xt.register("test_xattn_lara_learned", estimator="lara", num_samples=5,
                       proposal="learned")
    module, (q, k, v) = FakeModule().eval(), attention_inputs()
    means = lara.proposal_means(module, q.shape[-1])
    assert means.shape == (5, q.shape[-1])
    assert torch.equal(lara.proposal_means(FakeModule(), q.shape[-1]), means)  # same index
    expected = xattn.lara(q, k, v, num_samples=5, proposal_means=means,
                          weighting="query_proposal", deterministic=True, causal=True,
                          scale=0.5)
    out, _ = lara(module, q, k, v, xt.attention_mask(2, 6, 6), scaling=0.5)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=TOLERANCE, rtol=TOLERANCE)
    last, _ = lara(module, q[..., 4:, :], k, v, xt.attention_mask(2, 2, 6, q_offset=4),
                   scaling=0.5)
    torch.testing.assert_close(last, expected[..., 4:, :].transpose(1, 2), atol=TOLERANCE,
                               rtol=TOLERANCE)


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_causal_lara_generates_the_tokens_of_the_full_forward_pass(decoder):
    model = DECODERS[decoder]()
    model.set_attn_implementation(xt.register("test_xattn_lara_learned", estimator="lara",
                                              num_samples=5, proposal="learned").name)
    prompt = tokens(2, 6)
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                               max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        logits = model(generated).logits
    assert torch.equal(logits[:, 5:-1].argmax(-1), generated[:, 6:])


MODELS = {"bert": bert, **DECODERS}


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_output_attentions_raises_on_every_model(names, model_name):
    """GPT-2 does not pass output_attentions to its attention function: the weights the
    model collects are checked for, not only the keyword."""
    model, ids = MODELS[model_name](), tokens()
    model.set_attn_implementation(names["softmax"])
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(ids, output_attentions=True)
    model(ids, output_attentions=False)  # not asked for: runs


def test_output_attentions_in_the_config_raises(names):
    model, ids = gpt2(output_attentions=True), tokens()
    model.set_attn_implementation(names["softmax"])
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(ids)
    assert model(ids, output_attentions=False).attentions is None  # the call's own choice


def test_dropout_and_output_attentions_raise(names):
    model, ids = bert(attention_probs_dropout_prob=0.0), tokens()
    with pytest.raises(ValueError, match="output_attentions"):
        run(model, names["rfa"], ids, output_attentions=True)
    dropping = bert(attention_probs_dropout_prob=0.1).train()
    with pytest.raises(ValueError, match=r"attention_probs_dropout_prob=0\.0"):
        run(dropping, names["rfa"], ids)
    run(dropping.eval(), names["rfa"], ids)  # evaluation has no dropout
    module, (q, k, v) = FakeModule().eval(), attention_inputs()
    function = xt.register("test_xattn_rfa_kwargs", estimator="rfa", num_features=8)
    with pytest.raises(ValueError, match="softcap"):
        function(module, q, k, v, None, softcap=30.0)
    with pytest.raises(ValueError, match="multiple of the key and value heads"):
        function(module, q, k[:, :3], v[:, :3], None)


# -- register's arguments -------------------------------------------------------------------

@pytest.mark.parametrize(("arguments", "error", "match"), [
    ({"name": 3}, TypeError, "name must be a str"),
    ({"name": ""}, ValueError, "name must be a non-empty"),
    ({"name": "org/kernel"}, ValueError, "Hub kernel"),
    ({"name": "sdpa"}, ValueError, "transformers' own"),
    ({"name": "eager"}, ValueError, "transformers' own"),
    ({"estimator": "performer"}, ValueError, "estimator must be one of"),
    ({"estimator": 1}, TypeError, "estimator must be a str"),
    ({"num_features": 2.5}, TypeError, "num_features must be an int"),
    ({"num_features": 0}, ValueError, "num_features must be >= 1"),
    ({"feature_map": "cosine"}, ValueError, "feature_map"),
    ({"window": -1}, ValueError, "window must be >= 0"),
    ({"num_samples": 4}, TypeError, r"does not take the option\(s\) \['num_samples'\]"),
    ({"scale": 0.5}, ValueError, "scale is not an option"),
    ({"estimator": "lara", "weighting": "fancy"}, ValueError, "weighting"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"generator": 7}, TypeError, "generator must be a torch.Generator"),
])
def test_register_rejects_bad_arguments(arguments, error, match):
    arguments = {"name": "test_xattn_bad", "estimator": "rfa", **arguments}
    with pytest.raises(error, match=match):
        xt.register(**arguments)


def test_importing_xattn_does_not_import_transformers():
    # (xattn.transformers itself is imported after xattn by this module; in the fresh
    # interpreter that import alone took 7 s, transformers' own)
    code = "import sys, xattn; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_mask_function_reads_offsets_and_padding():
    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = xt.attention_mask(2, 1, 5, q_offset=4, attention_mask=padding)
    assert (mask.causal, mask.query_start, mask.kv_length) == (True, 4, 5)
    np.testing.assert_array_equal(mask.key_mask.numpy(), padding.bool().numpy())
    # a static cache: more key slots than tokens so far (the padding mask is extended)
    mask = xt.attention_mask(2, 2, 8, q_offset=3, attention_mask=padding)
    assert mask.key_mask.shape == (2, 8) and mask.query_start == 3
    assert (mask.ndim, mask.dim(), mask.shape) == (4, 4, (2, 1, 2, 8))
    # a mask made earlier for the call (static-cache generate) is returned as it is
    assert xt.attention_mask(2, 2, 8, q_offset=3, attention_mask=mask) is mask
    with pytest.raises(TypeError, match=r"attention_mask must be a torch\.Tensor"):
        xt.attention_mask(2, 2, 8, attention_mask=[[1, 1]])
