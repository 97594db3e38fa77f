"""PyTorch against Flax in ``xattn train`` (issue 43): from the same weights, batch and
random numbers, the two models give the same loss and gradients, and the two trainers the
same training losses; the parameter exchange of :mod:`xattn.training.parity`."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

from xattn.training import encoder_flax as train_flax  # noqa: E402
from xattn.training import encoder_torch as train_torch  # noqa: E402
from xattn.training.loop import (  # noqa: E402
    NATIVE,
    ModelConfig,
    RunSpec,
    attention_options,
    batches,
    learning_rate,
)
from xattn.training.parity import (  # noqa: E402
    PARAMETER_GROUPS,
    flax_parameters,
    group_of,
    load_flax_parameters,
    load_torch_parameters,
    torch_parameters,
)
from xattn.training.tasks import get_task  # noqa: E402

CONFIG = ModelConfig(dim=16, ffn=32, heads=2, layers=2)
FLAX_EPSILON = 1e-6  # nnx.LayerNorm's; torch.nn.LayerNorm's default is 1e-5
NOISE_SEED = 7  # an int seed: xattn's host generator draws the same numbers in both


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _models(task, estimator, seed=0, **extra_options):
    """A PyTorch and a Flax model with the PyTorch model's weights (and features), the
    LayerNorm epsilon of Flax in both, and RA's noise drawn from one int seed."""
    options = attention_options(estimator, 8) if estimator != NATIVE else {}
    options.update(extra_options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch_model = train_torch.Encoder(
            task, estimator, options, config=CONFIG, generator=torch.Generator().manual_seed(seed)
        )
    flax_model = train_flax.Encoder(
        task, estimator, options, config=CONFIG, rngs=nnx.Rngs(params=seed + 1, attention=seed + 2)
    )
    for module in torch_model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = FLAX_EPSILON
    load_flax_parameters(flax_model, torch_parameters(torch_model))
    if estimator == "ra":
        for block in torch_model.blocks:
            block.attention._random = lambda: NOISE_SEED
        for block in flax_model.blocks:
            object.__setattr__(block.attention, "_next_key", lambda rngs: NOISE_SEED)
    return torch_model, flax_model


def _batch(task, size=4):
    train, _ = task.datasets(size, 1)
    return next(batches(train, size, 0))


@pytest.mark.parametrize(("task_name", "length"), [("mqar", 64), ("digits", None)])
@pytest.mark.parametrize("estimator", ["softmax", "rfa", "ra", NATIVE])
def test_one_training_step_gives_the_same_loss_and_gradients(task_name, length, estimator):
    task = get_task(task_name, length)
    torch_model, flax_model = _models(task, estimator)
    batch = _batch(task)
    torch_model.train()
    tokens = torch.as_tensor(batch.tokens, dtype=torch.long)
    mask = None if batch.mask is None else torch.as_tensor(batch.mask)
    logits = torch_model(tokens, mask)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        torch.as_tensor(batch.targets).reshape(-1),
        ignore_index=-1,
    )
    loss.backward()
    # compiled: one program, not eager JAX (which compiles each operation on its own)
    flax_loss, flax_gradients = nnx.jit(nnx.value_and_grad(train_flax._loss))(
        flax_model,
        jax.numpy.asarray(batch.tokens),
        None if batch.mask is None else jax.numpy.asarray(batch.mask),
        jax.numpy.asarray(batch.targets),
    )
    assert abs(float(loss.detach()) - float(flax_loss)) < 1e-5
    expected = flax_parameters(flax_model, flax_gradients)
    gradients = torch_parameters(torch_model, gradients=True)
    assert set(gradients) == set(expected)
    assert max(float(np.abs(value).max()) for value in expected.values()) > 1e-3
    for name, value in expected.items():
        np.testing.assert_allclose(gradients[name], value, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("estimator", ["rfa", "ra"])
def test_trainers_give_the_same_training_losses(estimator):
    """Three AdamW steps (schedule, clipping, weight decay) of each trainer, from the same
    weights, features and noise, on the same batches."""
    task = get_task("mqar", 64)
    # the copied features stay: a redraw would draw from each framework's own stream
    fixed = {"redraw_interval": None} if estimator == "rfa" else {}
    options = {**attention_options(estimator, 8), **fixed}
    spec = RunSpec(
        task,
        estimator,
        estimator,
        options,
        seed=0,
        steps=3,
        batch_size=4,
        peak_lr=1e-2,
        clip_norm=0.5,
        model=CONFIG,
    )
    torch_trainer = train_torch.TorchTrainer(spec)
    flax_trainer = train_flax.FlaxTrainer(spec)
    torch_model, flax_model = _models(task, estimator, **fixed)
    torch_trainer.model = torch_model
    torch_trainer.optimizer = torch.optim.AdamW(
        torch_model.parameters(), lr=spec.peak_lr, weight_decay=spec.weight_decay
    )
    _, optimizer = nnx.merge(flax_trainer.graphdef, flax_trainer.state)
    optimizer = nnx.Optimizer(flax_model, optimizer.tx, wrt=nnx.Param)
    flax_trainer.graphdef, flax_trainer.state = nnx.split((flax_model, optimizer))
    train, _ = task.datasets(12, 1)
    losses = {}
    for name, trainer in (("torch", torch_trainer), ("flax", flax_trainer)):
        source = batches(train, spec.batch_size, spec.seed)
        losses[name] = [
            trainer.step(next(source), learning_rate(step, spec))[0] for step in range(spec.steps)
        ]
    assert losses["torch"][0] != losses["torch"][-1]  # the steps changed the model
    np.testing.assert_allclose(losses["torch"], losses["flax"], atol=1e-5)


def test_parameters_round_trip_and_groups():
    task = get_task("digits")
    torch_model, flax_model = _models(task, "rfa")
    flax_own = train_flax.Encoder(
        task,
        "rfa",
        attention_options("rfa", 8),
        config=CONFIG,
        rngs=nnx.Rngs(params=5, attention=6),
    )
    copied = load_torch_parameters(torch_model, flax_parameters(flax_own), ["embeddings"])
    assert copied == ["embeddings.0.embedding", "position"]
    after = torch_parameters(torch_model)
    own = flax_parameters(flax_own)
    before = flax_parameters(flax_model)  # still the PyTorch model's first weights
    for name, value in after.items():
        expected = own[name] if group_of(name) == "embeddings" else before[name]
        # the copy casts to the PyTorch model's dtype (the Flax model's is float64 where an
        # earlier test in the same process enabled JAX's 64-bit mode)
        np.testing.assert_array_equal(value, expected.astype(value.dtype), err_msg=name)
    assert {group_of(name) for name in after} == set(PARAMETER_GROUPS)
    with pytest.raises(ValueError, match="unknown parameter groups"):
        load_flax_parameters(flax_model, after, ["projections"])
    with pytest.raises(ValueError, match="no entry"):
        load_flax_parameters(flax_model, {})


@pytest.mark.parametrize("token_init", ["scaled", "unit"])
def test_both_frameworks_draw_the_token_embeddings_alike(token_init):
    # the default ("scaled") is Flax's N(0, 1/dim) in both; "unit" is N(0, 1) in both. With
    # n = vocabulary x dim draws the sample standard deviation has relative standard error
    # 1/sqrt(2n): 8 of them bound it (dim 64, mqar's vocabulary; n ~ 10^4, bound ~ 6 %)
    config = ModelConfig(dim=64, ffn=32, heads=2, layers=1, token_init=token_init)
    task = get_task("mqar", 64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch_model = train_torch.Encoder(task, "softmax", {}, config=config,
                                          generator=torch.Generator().manual_seed(0))
    flax_model = train_flax.Encoder(task, "softmax", {}, config=config,
                                    rngs=nnx.Rngs(params=1, attention=2))
    expected = 64 ** -0.5 if token_init == "scaled" else 1.0
    assert config.token_std == expected
    embeddings = [parameters[name] for parameters in (torch_parameters(torch_model),
                                                      flax_parameters(flax_model))
                  for name in parameters if name.startswith("embeddings.")]
    assert len(embeddings) == 2 * len(task.vocabulary_sizes)
    for weights in embeddings:
        weights = np.asarray(weights, dtype=np.float64)
        assert abs(weights.mean()) < 8 / np.sqrt(weights.size) * expected
        assert abs(weights.std() / expected - 1) < 8 / np.sqrt(2 * weights.size)


def test_the_unit_start_is_torchs_own_embedding_draw():
    # "unit" draws nothing beyond nn.Embedding's own N(0, 1): the PyTorch model of 0.1,
    # every later weight from the same global random stream
    config = ModelConfig(dim=16, ffn=32, heads=2, layers=1, token_init="unit")
    task = get_task("mqar", 64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = train_torch.Encoder(task, "softmax", {}, config=config,
                                    generator=torch.Generator().manual_seed(3))
        after_model = torch.rand(4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        expected = [torch.nn.Embedding(size, 16).weight for size in task.vocabulary_sizes]
    for embedding, weight in zip(model.embeddings, expected, strict=True):
        torch.testing.assert_close(embedding.weight, weight, rtol=0, atol=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        scaled = train_torch.Encoder(task, "softmax", {}, config=ModelConfig(
            dim=16, ffn=32, heads=2, layers=1), generator=torch.Generator().manual_seed(3))
        after_scaled = torch.rand(4)
    assert not torch.equal(scaled.embeddings[0].weight, model.embeddings[0].weight)
    assert not torch.equal(after_model, after_scaled)  # the redraw takes numbers


def test_an_unknown_token_init_is_refused():
    with pytest.raises(ValueError, match="token_init must be one of scaled, unit"):
        ModelConfig(token_init="xavier")
