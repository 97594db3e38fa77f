"""xattn train --task shakespeare: the vendored text and its split, nanoGPT's schedule, a
short run per framework and attention, sampling with the generation state against
sampling by recomputation, and the command's bad input. (tests/test_train.py holds the
classification tasks.)"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings

import numpy as np
import pytest

from xattn.cli import main
from xattn.training.lm import (
    RFA_SINKS,
    RFA_WINDOW,
    GPTConfig,
    LMSpec,
    generate,
    lm_learning_rate,
    random_windows,
    train_lm_run,
)
from xattn.training.tasks import get_task, shakespeare

#: Every row of the task: (row name, layer estimator, options), tiny sizes.
ROWS = [("softmax", "softmax", {}), ("native", "native", {}),
        ("rfa", "rfa", {"num_features": 8, "orthogonal": False, "redraw_interval": 1}),
        ("rfa-window", "rfa", {"num_features": 8, "orthogonal": False, "redraw_interval": 1,
                               "window": 3, "sinks": 2}),
        ("ra", "ra", {"num_samples": 1}),
        ("lara-learned", "lara", {"num_samples": 4, "proposal": "learned"}),
        ("lara-defensive", "lara", {"num_samples": 4, "proposal": "learned", "defensive": 1})]
TINY = GPTConfig(layers=1, heads=2, dim=16)


@pytest.fixture(autouse=True)
def one_torch_thread():
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_vendored_text_is_tiny_shakespeare():
    text = shakespeare.load_text()
    assert len(text) == shakespeare.NUM_CHARACTERS == 1_115_394
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == shakespeare.SHA256
    symbols = shakespeare.vocabulary()
    assert len(symbols) == shakespeare.VOCABULARY_SIZE == 65 and list(symbols) == sorted(symbols)
    assert symbols[0] == "\n" and symbols[1] == " "  # nanoGPT's ids: the sorted characters
    sample = text[:1000]
    assert shakespeare.decode(shakespeare.encode(sample)) == sample
    with pytest.raises(ValueError, match="vocabulary"):
        shakespeare.encode("caf\u00e9 #")


def test_split_is_the_first_90_and_the_last_10_percent():
    train, val = shakespeare.split()
    assert (len(train), len(val)) == (1_003_854, 111_540)
    assert train.dtype == val.dtype == np.uint8 and int(max(train.max(), val.max())) == 64
    whole = shakespeare.encode(shakespeare.load_text())
    np.testing.assert_array_equal(np.concatenate([train, val]), whole)
    assert shakespeare.decode(val[:12]) == shakespeare.load_text()[1_003_854:1_003_866]


def test_random_windows_are_next_character_pairs():
    train, _ = shakespeare.split()
    inputs, targets = random_windows(train, 16, 5, np.random.default_rng(0))
    assert inputs.shape == targets.shape == (5, 16)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


def test_nanogpt_schedule_and_the_same_in_optax():
    spec = LMSpec("softmax", "softmax", {}, 0)
    assert lm_learning_rate(0, spec) == pytest.approx(1e-3 / 101)
    assert lm_learning_rate(99, spec) == pytest.approx(1e-3 * 100 / 101)
    assert lm_learning_rate(100, spec) == pytest.approx(1e-3)
    assert lm_learning_rate(1050, spec) == pytest.approx(5.5e-4)
    assert lm_learning_rate(2000, spec) == pytest.approx(1e-4)
    train_lm_flax = pytest.importorskip("xattn.training.lm_flax")
    schedule = train_lm_flax.lm_schedule(spec)
    steps = [0, 50, 99, 100, 500, 1999, 2000]
    np.testing.assert_allclose([float(schedule(step)) for step in steps],
                               [lm_learning_rate(step, spec) for step in steps], rtol=1e-5)


def test_rfa_runs_also_with_a_window_and_sinks_and_lara_is_left_out():
    from xattn.training.runs import attention_variants
    rows = attention_variants(get_task("shakespeare"), ["softmax", "rfa"], 16, False)
    assert [name for name, _, _ in rows] == ["softmax", "rfa", "rfa-window"]
    assert rows[2][1] == "rfa" and (rows[2][2]["window"], rows[2][2]["sinks"]) == (
        RFA_WINDOW, RFA_SINKS)


def test_lara_variants_are_causal_on_shakespeare_and_segments_elsewhere():
    from xattn.training.runs import attention_variants
    variants = ["lara-learned", "lara-defensive"]
    causal = attention_variants(get_task("shakespeare"), variants, 16, False)
    assert causal == [("lara-learned", "lara", {"num_samples": 16, "proposal": "learned"}),
                      ("lara-defensive", "lara", {"num_samples": 16, "proposal": "learned",
                                                  "defensive": 4})]
    bidirectional = attention_variants(get_task("mqar"), variants, 16, False)
    assert bidirectional[1] == ("lara-defensive", "lara", {"num_samples": 16, "defensive": 4})


def _trainer(framework: str, name: str, estimator: str, options: dict, **sizes):
    module = pytest.importorskip(f"xattn.training.lm_{framework}")
    spec = LMSpec(name, estimator, options, seed=0, model=TINY, **{
        "steps": 4, "length": 8, "batch_size": 2, "warmup": 1, "eval_interval": 2,
        "eval_iters": 2, "final_eval_iters": 2, "sample_length": 12, **sizes})
    options = {"compiler_options": {"xla_backend_optimization_level": 0}} if (
        framework == "flax") else {}
    return spec, module.Trainer(spec, **options)


@pytest.mark.parametrize("framework", ["torch", "flax"])
@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_a_short_run_trains_evaluates_and_samples(framework, row):
    """A short run's figures, then, on the model it trained, sampling with the state
    equals recomputation: the same logits token by token (through two context restarts)
    and the same characters, at a fixed seed and greedy-like temperature and at
    temperature 1. One run serves both checks (they were two tests, each training its
    own model: most of the time of a Flax case is compiling)."""
    spec, trainer = _trainer(framework, *row, length=16)
    result = train_lm_run(spec, trainer)
    assert np.isfinite(result.val_loss) and 0 < result.val_loss < 6
    assert result.val_bits_per_char == pytest.approx(result.val_loss / np.log(2))
    assert [point["step"] for point in result.curve] == [2, 4]
    assert len(result.sample) == len(spec.prompt) + spec.sample_length
    assert set(result.sample) <= set(shakespeare.vocabulary())
    assert result.sample_tokens_per_s_recompute > 0
    if row[1] == "native":  # the framework's own layer: no generation state here
        assert result.sample_tokens_per_s_state is None
        return
    assert result.sample_tokens_per_s_state > 0 and result.sample_same_as_recompute

    sampler = trainer.state_sampler()
    # a prompt of half the context: the length that each restart below prefills (on Flax
    # a prefill traces once per length)
    prompt = shakespeare.encode("To be or")
    assert len(prompt) == spec.length // 2
    tokens = list(prompt)
    np.testing.assert_allclose(sampler.prefill(prompt), trainer.next_logits(prompt),
                               rtol=1e-4, atol=1e-5)
    for token in shakespeare.encode(" not to"):
        tokens.append(int(token))
        np.testing.assert_allclose(sampler.advance(int(token)),
                                   trainer.next_logits(np.asarray(tokens)), rtol=1e-4,
                                   atol=1e-5)
    for temperature in (0.05, 1.0):  # 8 + 30 tokens: the context restarts three times
        drawn = [generate(trainer, prompt, 30, spec.length, seed=3, temperature=temperature,
                          use_state=use_state)[0] for use_state in (True, False)]
        np.testing.assert_array_equal(*drawn)


@pytest.mark.parametrize("arguments, says", [
    (["--task", "shakespeare,digits"], "runs alone"),
    (["--task", "shakespeare", "--estimators", "softmax,lara"],
     "lara's segment proposals look ahead; use lara-learned"),
    (["--task", "shakespeare", "--resume"], "--resume"),
    (["--task", "shakespeare", "--jobs", "2"], "--jobs"),
    (["--task", "shakespeare", "--length", "1"], "--length 1"),
    (["--task", "shakespeare", "--estimators", "nystrom"], "--estimators"),
])
def test_bad_options_are_one_line_and_exit_code_2(arguments, says, tmp_path, capsys):
    code = main(["train", *arguments, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_command_prints_the_table_and_sample_and_writes_json(tmp_path, capsys):
    pytest.importorskip("torch")
    code = main(["train", "--task", "shakespeare", "--estimators", "softmax", "--seeds", "0",
                 "--steps", "2", "--length", "8", "--batch-size", "2", "--quick",
                 "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "bits/char" in out and "tok/s state" in out
    payload = json.loads((tmp_path / "train.json").read_text())
    run = payload["runs"][0]
    assert run["task"] == "shakespeare" and run["steps"] == 2 and run["sample"] in out
    assert run["sample_same_as_recompute"] is True and len(run["sample"]) == 301
    assert payload["config"]["length"] == 8 and payload["config"]["weight_decay"] == 0.1
    assert (tmp_path / "train.png").exists()


@pytest.mark.parametrize("row", [row for row in ROWS if row[1] in ("rfa", "lara")],
                         ids=[row[0] for row in ROWS if row[1] in ("rfa", "lara")])
def test_linear_attention_builds_no_length_by_length_tensor(row):
    """A training step of the torch GPT with RFA (with or without a window and sinks) or
    causal LARA makes no tensor of L x L entries or more (no causal mask: the layer is
    told is_causal=True), forward and backward: its memory grows linearly with L."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    length = 1024  # L x L = 1M entries; the largest tensor here: the logits, 1024 x 65
    _, trainer = _trainer("torch", *row, length=length, batch_size=1)
    largest: list[tuple[int, str]] = []

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for item in (out if isinstance(out, tuple | list) else [out]):
                if isinstance(item, torch.Tensor):
                    largest.append((item.numel(), f"{func} {tuple(item.shape)}"))
            return out

    inputs, targets = random_windows(shakespeare.split()[0], length, 1,
                                     np.random.default_rng(0))
    with Largest():
        trainer.step(inputs, targets, 1e-3)
    numel, where = max(largest)
    assert numel < length * length, (numel, where)


def test_the_memory_estimate_counts_the_native_causal_mask_and_stays_linear_for_rfa():
    """The framework's own layer needs an (L, L) causal mask in each block: the estimate
    of a native row is softmax's plus the masks. RFA's (also with a window and sinks)
    grows linearly with L."""
    from xattn.cli.train_lm_report import lm_step_bytes
    from xattn.training.runs import attention_variants
    native, softmax = (lm_step_bytes(LMSpec(name, name, {}, seed=0, length=4096,
                                            batch_size=3)) for name in ("native", "softmax"))
    assert native - softmax == GPTConfig().layers * 2 * 3 * 4096**2
    for name, estimator, options in attention_variants(get_task("shakespeare"), ["rfa"], 16,
                                                        False):
        short, long = (lm_step_bytes(LMSpec(name, estimator, options, seed=0, length=length,
                                            batch_size=1)) for length in (10_000, 100_000))
        assert 9 < long / short < 10, name


@pytest.mark.parametrize("attention", ["softmax", "native", "rfa", "ra", "lara-learned",
                                       "lara-defensive"])
def test_the_memory_estimate_covers_a_measured_training_step(attention):
    """The estimate up front is at least the peak that torch's CPU allocator reports for a
    training step of the command's model (its options, context 1024, batch 1)."""
    pytest.importorskip("torch")
    from xattn.cli.train_lm_report import lm_step_bytes
    from xattn.training.lm_torch import TorchLMTrainer
    from xattn.training.runs import attention_variants
    inputs, targets = random_windows(shakespeare.split()[0], 1024, 1,
                                     np.random.default_rng(0))
    for name, estimator, options in attention_variants(get_task("shakespeare", 1024),
                                                        [attention], 16, False):
        spec = LMSpec(name, estimator, options, seed=0, length=1024, batch_size=1)
        trainer = TorchLMTrainer(spec)
        trainer.step(inputs, targets, 1e-3)  # the optimizer's moments exist from here on
        _, peak = trainer.step(inputs, targets, 1e-3, measure_memory=True)
        assert peak is not None and 0 < peak < lm_step_bytes(spec), (name, peak)


def test_a_context_longer_than_the_validation_split_is_refused_before_training(
        tmp_path, monkeypatch, capsys):
    """--length must leave a window in the validation split (111,540 characters: at most
    111,539): longer is one line naming --length, exit 2, before any training."""
    from xattn.cli import train_lm_report

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(train_lm_report, "host_memory_available", lambda: 2**60)
    monkeypatch.setattr(train_lm_report, "train_lm_run", started)
    arguments = ["train", "--task", "shakespeare", "--estimators", "rfa", "--seeds", "0",
                 "--steps", "1", "--batch-size", "1", "--no-progress"]
    for length in (111_540, 120_000, 10**9):
        out = tmp_path / f"out-{length}"
        code = main([*arguments, "--length", str(length), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and f"--length {length}" in err and "111539" in err.replace(",", "")
        assert len(err.strip().splitlines()) == 1 and not out.exists()
    pytest.importorskip("torch")
    with pytest.raises(Started):  # the longest context plans and starts
        main([*arguments, "--length", "111539", "--out", str(tmp_path / "longest")])


def test_the_flax_model_builds_without_warnings_in_jax_64_bit_mode():
    """With JAX's 64-bit mode on (common in scientific JAX code) the initial weights are
    drawn in the weights' dtype: no FutureWarning of a float64 draw scattered into a
    float32 weight (an error in later JAX releases). The mode is restored afterwards."""
    jax = pytest.importorskip("jax")
    lm_flax = pytest.importorskip("xattn.training.lm_flax")
    from flax import nnx

    was_on = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            model = lm_flax.GPT(TINY, 8, "rfa", {"num_features": 8}, rngs=nnx.Rngs(0))
    finally:
        jax.config.update("jax_enable_x64", was_on)
    assert model.token.embedding[...].dtype == jax.numpy.float32
    assert jax.config.jax_enable_x64 == was_on
