"""The transformers cache of estimator states (:class:`xattn.transformers.XattnCache`).

Tiny randomly initialized decoders built from configs (GPT-2 with n_embd 64, 2 layers, 4
heads; Llama with 4 query heads and 2 key-value heads, hidden 64): greedy generation
through the cache gives, at every step, the logits of a forward pass over the whole
sequence (evaluation mode, fixed features) for RFA, RFA with a window and a sink, softmax,
RA and causal LARA (``proposal="learned"``: fixed means per module), left-padded batches
included; the states of RFA and LARA have the same size after prompts of 64 and 400
tokens; with grouped-query attention the states are held per key-value head (half the
bytes of 4 key-value heads with 2); beam search and ``num_return_sequences`` reorder and repeat the
states (the tokens of transformers' own cache); what the cache cannot do raises an error
that names it.
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import xattn.transformers as xt  # noqa: E402
from xattn._integrations.hf_cache import map_batch  # noqa: E402

VOCAB = 100
# transformers' name for the cache argument: ``cache`` (5.2x and later; ``past_key_values``
# still accepted there), ``past_key_values`` before (5.17 for one)
CACHE = ("cache" if "cache" in inspect.signature(transformers.GPT2LMHeadModel.forward).parameters
         else "past_key_values")
RELATIVE_TOLERANCE = 1e-4  # float32
NEW_TOKENS = 6


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=512, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama(kv_heads=2):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


DECODERS = {"gpt2": gpt2, "llama": llama}

ATTENTIONS = {
    "rfa": {"estimator": "rfa", "num_features": 16},
    "rfa_window_sinks": {"estimator": "rfa", "num_features": 16, "window": 3, "sinks": 1},
    "softmax": {"estimator": "softmax"},
    "ra": {"estimator": "ra", "num_samples": 4},
    "lara": {"estimator": "lara", "num_samples": 8, "proposal": "learned"},
}


@pytest.fixture(scope="module")
def names():
    """One registered attention per configuration (names of this test module)."""
    return {key: xt.register(f"test_hf_cache_{key}", **options).name
            for key, options in ATTENTIONS.items()}


def tokens(batch, length, seed=1):
    return torch.randint(1, VOCAB, (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def relative_error(actual, expected):
    return float((actual - expected).abs().max() / expected.abs().max())


def check_steps_against_full_forward(model, generated, prompt_length, padding=None):
    """Each step's logits equal the last-position logits of a forward pass over the whole
    sequence up to that step."""
    sequence = generated.sequences
    mask = positions = None
    if padding is not None:  # the positions generate gives: counted over the tokens
        extra = torch.ones(sequence.shape[0], sequence.shape[1] - padding.shape[1],
                           dtype=padding.dtype)
        mask = torch.cat([padding, extra], dim=1)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        full = model(sequence, attention_mask=mask, position_ids=positions).logits
    assert len(generated.logits) == NEW_TOKENS
    for step, logits in enumerate(generated.logits):
        expected = full[:, prompt_length + step - 1]
        assert relative_error(logits, expected) < RELATIVE_TOLERANCE, step


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_greedy_steps_give_the_logits_of_the_full_forward_pass(names, decoder, attention):
    model = DECODERS[decoder]()
    model.set_attn_implementation(names[attention])
    prompt = tokens(2, 9)
    cache = xt.XattnCache()
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), **{CACHE: cache},
                               max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    assert cache.get_seq_length() == 9 + NEW_TOKENS - 1
    assert len(cache.layers) == 2 and cache.batch_size == 2
    state_class = {"softmax": "SoftmaxState", "ra": "RAState", "lara": "LARAState"}.get(
        attention, "RFAState")
    assert type(cache.layers[0].state).__name__ == state_class
    check_steps_against_full_forward(model, generated, 9)


@pytest.mark.parametrize("attention", ["rfa", "rfa_window_sinks", "lara"])
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_left_padded_batch_gives_the_logits_of_the_full_forward_pass(names, decoder,
                                                                     attention):
    model = DECODERS[decoder]()
    model.set_attn_implementation(names[attention])
    prompt = tokens(2, 8, seed=2)
    padding = torch.ones_like(prompt)
    padding[1, :3] = 0  # the second prompt has 5 tokens, left-padded
    prompt[1, :3] = 0
    generated = model.generate(prompt, attention_mask=padding, **{CACHE: xt.XattnCache()},
                               max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    check_steps_against_full_forward(model, generated, 8, padding)


@pytest.mark.parametrize("attention", ["rfa", "rfa_window_sinks", "lara"])
def test_rfa_and_lara_state_bytes_do_not_grow_with_the_prompt(names, attention):
    model = gpt2()
    model.set_attn_implementation(names[attention])
    sizes = []
    for length in (64, 400):
        cache = xt.XattnCache()
        with torch.no_grad():
            model(tokens(1, length), **{CACHE: cache})
        assert cache.get_seq_length() == length
        sizes.append(cache.nbytes)
    assert sizes[0] == sizes[1] > 0


def per_head_bytes(cache):
    """The bytes of the state arrays that have the batch and head dimensions (not the
    features or means shared by the heads), and the head counts of those arrays."""
    total, heads = 0, set()

    def count(array):
        nonlocal total
        total += array.numel() * array.element_size()
        heads.add(tuple(array.shape[1:3]))
        return array

    for layer in cache.layers:
        map_batch(layer.state, count)
    return total, heads


@pytest.mark.parametrize("attention", ["rfa_window_sinks", "softmax", "lara"])
def test_grouped_query_states_are_stored_per_key_value_head(names, attention):
    """Llama with 4 query heads: 2 key-value heads hold half the per-head bytes of 4 (one
    state per key-value head, not repeated to the query heads)."""
    sizes = {}
    for kv_heads in (2, 4):
        model = llama(kv_heads)
        model.set_attn_implementation(names[attention])
        cache = xt.XattnCache()
        with torch.no_grad():
            model(tokens(2, 20), **{CACHE: cache})
        sizes[kv_heads] = per_head_bytes(cache)
        assert sizes[kv_heads][1] == {(kv_heads, 1)}  # (key-value heads, one per group)
    assert sizes[2][0] * 2 == sizes[4][0] > 0


def test_softmax_state_grows_with_the_prompt(names):
    model = gpt2()
    model.set_attn_implementation(names["softmax"])
    sizes = []
    for length in (16, 32):
        cache = xt.XattnCache()
        with torch.no_grad():
            model(tokens(1, length), **{CACHE: cache})
        sizes.append(cache.nbytes)
    assert sizes[1] == 2 * sizes[0]


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_beam_search_and_return_sequences_give_the_tokens_of_the_dynamic_cache(names,
                                                                               decoder):
    """Beam search reorders the states and num_return_sequences repeats them: the tokens
    are those of transformers' own cache with the hook recomputing the prefix."""
    model = DECODERS[decoder]()
    model.set_attn_implementation(names["rfa_window_sinks"])
    prompt = tokens(2, 7, seed=3)
    options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                   do_sample=False, num_beams=3, num_return_sequences=2)
    expected = model.generate(prompt, **options)
    actual = model.generate(prompt, **{CACHE: xt.XattnCache()}, **options)
    assert torch.equal(actual, expected)


def test_sampling_with_return_sequences_gives_the_tokens_of_the_dynamic_cache(names):
    model = gpt2()
    model.set_attn_implementation(names["rfa"])
    prompt = tokens(2, 7, seed=4)
    options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                   do_sample=True, num_return_sequences=3)
    torch.manual_seed(5)
    expected = model.generate(prompt, **options)
    torch.manual_seed(5)
    actual = model.generate(prompt, **{CACHE: xt.XattnCache()}, **options)
    assert actual.shape == (6, 7 + NEW_TOKENS)
    assert torch.equal(actual, expected)


def test_the_cache_with_another_attention_raises(names):
    model = gpt2()
    model.set_attn_implementation("sdpa")
    prompt = tokens(1, 5)
    with pytest.raises(ValueError, match=r"registered by xattn\.transformers\.register"):
        model.generate(prompt, attention_mask=torch.ones_like(prompt), **{CACHE: xt.XattnCache()},
                       max_new_tokens=3, do_sample=False)


def test_training_mode_raises(names):
    model = gpt2().train()
    model.set_attn_implementation(names["rfa"])
    with pytest.raises(ValueError, match="evaluation mode only"):
        model(tokens(1, 5), **{CACHE: xt.XattnCache()})


def prefilled_rfa(names):
    """A GPT-2 with the rfa attention and its XattnCache after a 5-token prompt."""
    model = gpt2()
    model.set_attn_implementation(names["rfa"])
    cache = xt.XattnCache()
    with torch.no_grad():
        model(tokens(1, 5), **{CACHE: cache})
    return model, cache


def test_a_state_of_another_attention_raises(names):
    model, cache = prefilled_rfa(names)
    model.set_attn_implementation(names["softmax"])
    with pytest.raises(ValueError, match="state of another attention"):
        model(tokens(1, 1), **{CACHE: cache})


def test_crop_raises_and_reset_empties(names):
    _, cache = prefilled_rfa(names)
    with pytest.raises(ValueError, match="cannot remove tokens"):
        cache.crop(-1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes == 0


def test_lara_with_look_ahead_options_raises_through_the_cache():
    model = gpt2()
    model.set_attn_implementation(xt.register("test_hf_cache_lara_segment", estimator="lara",
                                              num_samples=4).name)
    with pytest.raises(ValueError, match="no causal form"):
        model(tokens(1, 5), **{CACHE: xt.XattnCache()})



def test_generation_benchmark_runs_and_writes_its_rows(tmp_path):
    """benchmarks/models/bench_hf_generate.py with the flags of its GPU run, on the CPU at tiny
    sizes: every row is written, RFA's cache bytes do not grow, xattn's softmax is left
    out after --max-softmax-length."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "models" / "bench_hf_generate.py"
    spec = importlib.util.spec_from_file_location("bench_hf_generate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    output = tmp_path / "rows.json"
    bench.main(["--device", "cpu", "--model", "llama", "--kv-heads", "2", "--lengths", "8,24",
                "--new-tokens", "3", "--repeats", "1", "--max-softmax-length", "8",
                "--time-budget", "600", "--output", str(output)])
    report = json.loads(output.read_text())
    assert report["complete"] and report["model"]["kv_heads"] == 2
    rows = {(row["attention"], row["prompt_length"]): row for row in report["rows"]}
    assert len(rows) == 7 and ("xattn_softmax", 24) not in rows
    assert report["skipped"] == [{"attention": "xattn_softmax", "prompt_length": 24,
                                  "reason": "--max-softmax-length"}]
    assert rows["rfa_S64", 8]["cache_bytes_at_end"] == rows["rfa_S64", 24]["cache_bytes_at_end"]
    assert rows["sdpa", 8]["cache_bytes_at_end"] < rows["sdpa", 24]["cache_bytes_at_end"]
