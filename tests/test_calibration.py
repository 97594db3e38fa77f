"""Calibrated samples (:func:`xattn.calibrate_omega`) and the conversion of a Hugging Face
model (:func:`xattn.transformers.calibrate`, ``save_features``, ``load_features``).

The fits run on small synthetic heads whose queries and keys share a preferred direction
(as a trained head's do, and unlike N(0, I) inputs, for which random features are
already what a fit could find), with fixed seeds: the held-out error after the fit is
deterministic, and the thresholds below sit well inside what it measures (a ratio of
about 0.5 to 0.7 after 20 steps where the test asks for less than 0.8)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import xattn

torch = pytest.importorskip("torch")


def heads(batch=8, heads=2, length=32, dim=8, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    shift = 1.5 * torch.randn(1, heads, 1, dim, generator=generator, dtype=dtype)
    q = torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) + shift
    k = torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype) + shift
    v = torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype)
    return q, k, v


SETTINGS = {"window_sink": {"window": 4, "sinks": 1}, "causal": {"causal": True},
            "hyperbolic": {"feature_map": "hyperbolic"}}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_fit_lowers_the_heldout_error(setting):
    q, k, v = heads()
    omega, report = xattn.calibrate_omega(q, k, v, num_features=8, steps=20, seed=0,
                                          learning_rate=0.05, **SETTINGS[setting])
    assert omega.shape == (2, 8, 8) and omega.dtype == q.dtype
    assert report.heldout_error_after < 0.8 * report.heldout_error_before
    assert all(after <= before for before, after in
               zip(report.head_errors_before, report.head_errors_after, strict=True))
    assert report.sequences == 8 and report.heldout_sequences == 2
    assert report.heldout_rows == 2 * 32 and report.train_rows == 6 * 32
    assert report.library == "torch" and 0 < report.steps <= 20


def test_reported_error_is_that_of_the_returned_samples():
    q, k, v = heads()
    omega, report = xattn.calibrate_omega(q, k, v, num_features=8, steps=10,
                                          window=4, sinks=1)
    # the held-out sequences are not named by the report; the fitted and held-out rows
    # together are all rows, so the overall error is their row-weighted mean
    exact = xattn.softmax_attention(q, k, v)
    error = ((xattn.rfa(q, k, v, omega=omega, window=4, sinks=1) - exact) ** 2).sum(-1)
    variance = ((exact - exact.mean(dim=(0, 2), keepdim=True)) ** 2).sum(-1).mean(dim=(0, 2))
    overall = (error.mean(dim=(0, 2)) / variance).mean()
    rows = report.train_rows + report.heldout_rows
    mixed = (report.train_error_after * report.train_rows
             + report.heldout_error_after * report.heldout_rows) / rows
    # per-head means of ratios against the ratio of means: equal up to the head weights
    assert float(overall) == pytest.approx(mixed, rel=0.05)


def test_never_worse_than_the_start():
    q, k, v = heads(seed=1)
    omega0, report0 = xattn.calibrate_omega(q, k, v, num_features=8, steps=0)
    # a step size far too large: the fit only gets worse, so the start comes back
    omega, report = xattn.calibrate_omega(q, k, v, num_features=8, steps=8,
                                          learning_rate=50.0, patience=4)
    assert report.heldout_error_after <= report.heldout_error_before
    assert report.heldout_error_before == pytest.approx(report0.heldout_error_before)
    for head, step in enumerate(report.best_steps):
        if step == 0:
            assert torch.equal(omega[head], omega0[head])


def test_a_single_sequence_holds_rows_out():
    q, k, v = heads(batch=1)
    _, report = xattn.calibrate_omega(q[0], k[0], v[0], num_features=8, steps=2)
    assert report.sequences == 1 and report.heldout_sequences == 0
    assert report.heldout_rows == 8 and report.train_rows == 24


def test_batches_and_head_dims():
    q, k, v = heads(batch=4, heads=6)
    layered = [x.unflatten(1, (2, 3)) for x in (q, k, v)]  # (B, L, H, N, D)
    omega, report = xattn.calibrate_omega(*layered, num_features=4, steps=3, head_dims=2)
    assert omega.shape == (2, 3, 4, 8) and len(report.head_errors_after) == 6
    batches = [(q[:2], k[:2], v[:2]), (q[2:, :, :20], k[2:, :, :20], v[2:, :, :20])]
    omega, report = xattn.calibrate_omega(batches, num_features=4, steps=4)
    assert omega.shape == (6, 4, 8) and report.sequences == 4


def test_torch_and_jax_have_the_same_objective():
    jnp = pytest.importorskip("jax.numpy")
    pytest.importorskip("optax")
    q, k, v = heads()  # float32 (JAX's default)
    mask = torch.ones(8, 1, 32, dtype=torch.bool)
    mask[:, :, 28:] = False
    results = {}
    for name, convert in (("torch", lambda x: x), ("jax", lambda x: jnp.asarray(x.numpy()))):
        arrays = [convert(x) for x in (q, k, v, mask)]
        results[name] = xattn.calibrate_omega(
            *arrays[:3], key_mask=arrays[3], query_mask=arrays[3], num_features=8,
            window=3, sinks=1, steps=0, seed=5)
    (omega_t, report_t), (omega_j, report_j) = results["torch"], results["jax"]
    np.testing.assert_allclose(np.asarray(omega_j), omega_t.numpy(), rtol=1e-6)
    for field in ("heldout_error_before", "train_error_before"):  # float32 rounding
        assert getattr(report_j, field) == pytest.approx(getattr(report_t, field), rel=1e-5)
    assert report_t.heldout_rows == report_j.heldout_rows == 2 * 28


def test_dense_form_equals_rfa():
    from xattn._integrations.calibration_dense import dense_rfa

    q, k, v = heads(batch=3, length=24, dtype=torch.float64)
    omega = torch.randn(2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mask = torch.rand(3, 1, 24, generator=torch.Generator().manual_seed(3)) > 0.3
    for feature_map in ("positive", "hyperbolic"):
        for causal in (False, True):
            for window, sinks in ((None, None), (3, 1), (None, 2)):
                expected = xattn.rfa(q, k, v, omega=omega, feature_map=feature_map,
                                     window=window, sinks=sinks, causal=causal, key_mask=mask)
                got = dense_rfa(q, k, v, omega, key_mask=mask, feature_map=feature_map,
                                window=window, sinks=sinks, causal=causal,
                                scale=1 / math.sqrt(8))
                torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_bad_input():
    q, k, v = heads(batch=2)
    with pytest.raises(TypeError, match="q must be a torch or JAX array"):
        xattn.calibrate_omega(q.numpy(), k.numpy(), v.numpy(), num_features=4)
    with pytest.raises(TypeError, match="one library"):
        xattn.calibrate_omega(q, k.numpy(), v, num_features=4)
    with pytest.raises(ValueError, match="omega must have shape"):
        xattn.calibrate_omega(q, k, v, num_features=4, omega=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="omega must be finite"):
        xattn.calibrate_omega(q, k, v, num_features=4,
                              omega=torch.full((2, 4, 8), math.nan))
    with pytest.raises(ValueError, match="holdout"):
        xattn.calibrate_omega(q, k, v, num_features=4, holdout=1.5)
    with pytest.raises(ValueError, match="num_features"):
        xattn.calibrate_omega(q, k, v, num_features=0)
    with pytest.raises(TypeError, match="k and v together"):
        xattn.calibrate_omega(q, k, num_features=4)
    with pytest.raises(ValueError, match="every batch's q"):
        xattn.calibrate_omega([(q, k, v), (q[:, :1], k[:, :1], v[:, :1])], num_features=4)


# -- converting a Hugging Face model ---------------------------------------------------------

def _gpt2(transformers):
    config = transformers.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_conversion_end_to_end(tmp_path):
    transformers = pytest.importorskip("transformers")
    import xattn.transformers as xt

    options = {"num_features": 8, "window": 4, "sinks": 1}
    attention = xt.register("xattn_calibration_test", **options)
    model = _gpt2(transformers)
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(60, (4, 24), generator=generator)}
               for _ in range(2)]
    reports = xt.calibrate(model, batches, attention, steps=6)
    assert sorted(reports) == [0, 1] and attention.fitted[0].shape == (4, 8, 8)
    assert all(r.heldout_error_after <= r.heldout_error_before for r in reports.values())
    assert model.config._attn_implementation != "xattn_calibration_capture"  # restored
    model.set_attn_implementation("xattn_calibration_test")
    ids = torch.randint(60, (2, 10), generator=generator)
    converted = model(ids).logits
    # the fitted samples are used: another registration (random features) differs
    xt.register("xattn_calibration_random", **options)
    model.set_attn_implementation("xattn_calibration_random")
    assert not torch.allclose(model(ids).logits, converted)

    model.save_pretrained(tmp_path)
    assert xt.save_features(attention, tmp_path) == tmp_path / "xattn_features.safetensors"
    loaded_attention = xt.register("xattn_calibration_loaded", **options)
    xt.load_features(loaded_attention, tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, attn_implementation="xattn_calibration_loaded").eval()
    torch.testing.assert_close(loaded(ids).logits, converted)
    cached = loaded.generate(ids, max_new_tokens=5, do_sample=False,
                             cache=xt.XattnCache())
    plain = loaded.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(cached, plain)

    other = xt.register("xattn_calibration_other", num_features=8)
    with pytest.raises(ValueError, match="fitted for"):
        xt.load_features(other, tmp_path)
    with pytest.raises(ValueError, match="no fitted samples"):
        xt.save_features(other, tmp_path)


def test_conversion_of_a_padded_encoder():
    transformers = pytest.importorskip("transformers")
    import xattn.transformers as xt

    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    attention = xt.register("xattn_calibration_bert", num_features=8)
    padding = torch.ones(4, 20, dtype=torch.long)
    padding[2:, 12:] = 0
    batch = {"input_ids": torch.randint(60, (4, 20)), "attention_mask": padding}
    reports = xt.calibrate(model, [batch], attention, steps=3)
    assert reports[0].heldout_rows + reports[0].train_rows == 2 * 20 + 2 * 12
    # refine splits the padded batch's rows, its attention_mask with them
    refined = xt.refine(model, [batch], attention, steps=2, evaluate_every=1)
    assert (refined.sequences, refined.heldout_sequences) == (4, 1)
    assert refined.heldout_error_after <= refined.heldout_error_before
    with pytest.raises(ValueError, match="fits RFA's samples"):
        xt.calibrate(model, [batch], xt.register("xattn_calibration_sm", estimator="softmax"))


def test_flax_attention_fn_takes_fitted_samples():
    jnp = pytest.importorskip("jax.numpy")
    nnx = pytest.importorskip("flax.nnx")
    pytest.importorskip("optax")
    import xattn.flax

    q, k, v = (jnp.asarray(x.numpy()) for x in heads(batch=2, length=16))
    omega, _ = xattn.calibrate_omega(q, k, v, num_features=8, steps=2)
    function = xattn.flax.attention_fn("rfa", num_features=8, deterministic=True,
                                       rngs=nnx.Rngs(0), omega=omega)
    out = function(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)))  # (batch, length, heads, d)
    expected = jnp.swapaxes(xattn.rfa(q, k, v, omega=omega), 1, 2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="omega"):
        xattn.flax.attention_fn("ra", omega=omega)


def test_refine_lowers_the_heldout_error_and_leaves_the_model_alone():
    transformers = pytest.importorskip("transformers")
    import xattn.transformers as xt

    attention = xt.register("xattn_refine_test", num_features=8)
    model = _gpt2(transformers)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.lm_head.weight.requires_grad_(True)
    generator = torch.Generator().manual_seed(2)
    batches = [{"input_ids": torch.randint(60, (4, 24), generator=generator)}
               for _ in range(2)]
    with pytest.raises(ValueError, match="no fitted samples"):
        xt.refine(model, batches, attention)
    xt.calibrate(model, batches, attention, steps=6)
    calibrated = {layer: omega.clone() for layer, omega in attention.fitted.items()}
    measured = []
    report = xt.refine(model, batches, attention, steps=20, evaluate_every=5,
                       learning_rate=3e-2, patience=None,
                       progress=lambda step, error: measured.append((step, error)))
    assert [step for step, _ in measured] == [0, 5, 10, 15, 20]
    assert report.heldout_error_before == measured[0][1]
    assert report.heldout_error_after == min(error for _, error in measured)
    # 20 steps on 6 sequences lower the held-out error of a random model's 2 layers
    assert report.heldout_error_after < report.heldout_error_before
    assert report.best_step > 0 and report.steps == 20
    assert (report.sequences, report.heldout_sequences) == (8, 2)
    assert all(not torch.equal(attention.fitted[layer], calibrated[layer])
               for layer in calibrated)
    assert all(not omega.requires_grad for omega in attention.fitted.values())
    for name, parameter in model.named_parameters():  # unchanged, requires_grad put back
        assert torch.equal(parameter, weights[name]), name
        assert parameter.requires_grad
    assert model.config._attn_implementation != "xattn_refine_test" and not model.training

    # the report's error is that of the samples in use: measured again, it is the same
    again = xt.refine(model, batches, attention, steps=1, evaluate_every=1,
                      learning_rate=1e-12)
    assert again.heldout_error_before == pytest.approx(report.heldout_error_after, rel=1e-5)


def test_refine_error_sums_match_their_formulas():
    from xattn._integrations.hf_refinement import _error_sums, _objective

    generator = torch.Generator().manual_seed(3)
    hidden, exact = (torch.randn(3, 2, 5, 4, generator=generator) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    sums = _error_sums(hidden, exact, {"attention_mask": mask}).double().numpy()
    h, e, m = hidden.double().numpy(), exact.double().numpy(), mask.double().numpy()
    cos = (h * e).sum(-1) / np.linalg.norm(h, axis=-1) / np.linalg.norm(e, axis=-1)
    assert sums[0] == pytest.approx(((1 - cos) * m).sum(), rel=1e-6)
    assert sums[1] == 3 * m.sum()
    means = [(x[-1] * m[..., None]).sum(-2) / m.sum(-1)[:, None] for x in (h, e)]
    embedding = (means[0] * means[1]).sum(-1) / np.prod(
        [np.linalg.norm(x, axis=-1) for x in means], axis=0)
    assert sums[2] == pytest.approx((1 - embedding).sum(), rel=1e-6)
    assert sums[3] == 2
    total = torch.as_tensor(sums)
    assert float(_objective(total, 0.0)) == pytest.approx(sums[0] / sums[1])
    assert float(_objective(total, 2.5)) == pytest.approx(sums[0] / sums[1]
                                                          + 2.5 * sums[2] / sums[3])


def test_refine_with_the_embedding_term():
    transformers = pytest.importorskip("transformers")
    import xattn.transformers as xt

    attention = xt.register("xattn_refine_embedding", num_features=8)
    model = _gpt2(transformers)
    generator = torch.Generator().manual_seed(2)
    batches = [{"input_ids": torch.randint(60, (4, 24), generator=generator)}
               for _ in range(2)]
    xt.calibrate(model, batches, attention, steps=6)
    calibrated = {layer: omega.clone() for layer, omega in attention.fitted.items()}
    # the held-out objective of the same samples: the hidden-state error plus the weight
    # times a positive embedding error
    before = []
    for weight in (0.0, 1.0, 3.0):
        attention.fitted.update({layer: omega.clone() for layer, omega in calibrated.items()})
        before.append(xt.refine(model, batches, attention, steps=1, learning_rate=1e-12,
                                embedding_weight=weight).heldout_error_before)
    assert before[1] > before[0]
    assert before[2] - before[0] == pytest.approx(3 * (before[1] - before[0]), rel=1e-4)
    attention.fitted.update(calibrated)
    report = xt.refine(model, batches, attention, steps=20, evaluate_every=5,
                       learning_rate=3e-2, patience=None, embedding_weight=1.0)
    assert report.heldout_error_before == pytest.approx(before[1], rel=1e-6)
    assert report.heldout_error_after < report.heldout_error_before


def test_refine_refuses_bad_input():
    transformers = pytest.importorskip("transformers")
    import xattn.transformers as xt

    model = _gpt2(transformers)
    batch = {"input_ids": torch.randint(60, (2, 8))}
    attention = xt.register("xattn_refine_bad", num_features=8)
    xt.calibrate(model, [batch], attention, steps=1)
    with pytest.raises(ValueError, match="trains RFA's samples"):
        xt.refine(model, [batch], xt.register("xattn_refine_sm", estimator="softmax"))
    with pytest.raises(TypeError, match="mappings"):
        xt.refine(model, [batch["input_ids"]], attention)
    with pytest.raises(ValueError, match="at least 2"):
        xt.refine(model, [{"input_ids": batch["input_ids"][:1]}], attention)
    for option, value in (("holdout", 1.0), ("steps", 0), ("learning_rate", 0.0),
                          ("evaluate_every", 0), ("patience", 0), ("embedding_weight", -1.0),
                          ("embedding_weight", float("nan"))):
        with pytest.raises(ValueError, match=option):
            xt.refine(model, [batch], attention, **{option: value})
