"""xattn train: the tasks (ListOps evaluator, MQAR invariants, digits), the schedule, a
short training run per framework and estimator, and the command's bad input."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys

import numpy as np
import pytest

from xattn.cli import main
from xattn.training.loop import ModelConfig, RunSpec, learning_rate, train_run
from xattn.training.tasks import Dataset, get_task, listops, mqar
from xattn.training.tasks import digits as digits_task

ESTIMATORS = ("softmax", "rfa", "ra", "lara")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread, as ``xattn train`` uses by default (tiny models: more threads
    only contend); the caller's setting is restored."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------
# tasks
# --------------------------------------------------------------------------------------


def _python_value(tokens: np.ndarray) -> int:
    """Python's own evaluation of the expression's source text."""
    functions = {"MAX": lambda *a: max(a), "MIN": lambda *a: min(a),
                 "MED": lambda *a: int(np.median(a)), "SM": lambda *a: sum(a) % 10}
    return eval(listops.to_python(tokens), {"__builtins__": {}}, functions)


def test_listops_evaluator_matches_python_evaluation():
    tokens, labels = listops.generate(300, seed=3, max_length=96, min_length=8)
    assert tokens.shape == (300, 96) and labels.shape == (300,)
    assert set(np.unique(labels)) <= set(range(10))
    for row, label in zip(tokens, labels, strict=True):
        assert listops.evaluate(row) == label == _python_value(row)
    lengths = np.sum(tokens != listops.PAD, axis=1)
    assert lengths.min() >= 8 and lengths.max() <= 96
    # even-length medians round down, as LRA's int(np.median(...))
    med = listops.OPERATOR_IDS["MED"]
    assert listops.evaluate([med, 1, 4, listops.CLOSE]) == 2
    assert listops.evaluate([med, 1, 3, 8, 9, listops.CLOSE]) == 5


def test_listops_generator_is_seeded_and_evaluator_rejects_malformed():
    first, second = listops.generate(20, seed=5, max_length=64), listops.generate(
        20, seed=5, max_length=64)
    np.testing.assert_array_equal(first[0], second[0])
    assert not np.array_equal(first[0], listops.generate(20, seed=6, max_length=64)[0])
    maximum = listops.OPERATOR_IDS["MAX"]
    for bad in ([maximum, 1, 2], [maximum, 1, 2, listops.CLOSE, 3], [listops.CLOSE],
                [maximum, listops.CLOSE], [99]):
        with pytest.raises(ValueError):
            listops.evaluate(bad)


@pytest.mark.parametrize("num_queries", [6, None])  # None: every key queried
def test_mqar_invariants(num_queries):
    num_pairs, num_values, length = 8, 12, 48
    options = {"length": length, "num_pairs": num_pairs, "num_queries": num_queries,
               "num_keys": 20, "num_values": num_values}
    tokens, targets = mqar.generate(50, seed=0, **options)
    marker = mqar.query_value_field(num_values)
    for sequence, target in zip(tokens, targets, strict=True):
        queries = np.flatnonzero(sequence[:, 1] == marker)
        assert np.array_equal(queries, np.flatnonzero(target >= 0))
        assert len(queries) == (num_queries or num_pairs)
        assert len(set(sequence[queries, 0])) == len(queries)  # distinct queried keys
        for position in queries:
            key = sequence[position, 0]
            before = sequence[:position]
            holding = np.flatnonzero((before[:, 0] == key) & (before[:, 1] < num_values))
            assert len(holding) == 1  # the key appears exactly once before its query...
            assert holding[0] < num_pairs
            assert target[position] == before[holding[0], 1]  # ...paired with the target
        assert len(set(sequence[:num_pairs, 0])) == num_pairs
    again = mqar.generate(50, seed=0, **options)
    np.testing.assert_array_equal(tokens, again[0])
    np.testing.assert_array_equal(targets, again[1])
    other = mqar.generate(50, seed=1, **options)
    assert not np.array_equal(tokens, other[0])


def test_digits_split_and_task_shapes():
    (train_x, train_y), (test_x, test_y) = digits_task.split()
    assert train_x.shape == (1437, 64) and test_x.shape == (360, 64)
    assert set(np.unique(train_y)) == set(range(10)) == set(np.unique(test_y))
    assert train_x.min() >= 0 and train_x.max() == 16
    task = get_task("digits")
    assert (task.length, task.grid, task.num_classes) == (64, (8, 8), 10)
    train, test = task.datasets(0, 0)
    assert train.tokens.shape == (1437, 64, 1) and test.mask is None
    listops_task = get_task("listops", 64)
    train, test = listops_task.datasets(10, 5)
    assert train.tokens.shape == (10, 64, 1) and train.mask.shape == (10, 64)
    mqar_task = get_task("mqar", 64)
    train, _ = mqar_task.datasets(4, 2)
    assert mqar_task.per_token and train.tokens.shape == (4, 64, 2)


@pytest.mark.parametrize(("name", "length"), [("mqar", 31), ("listops", 16),
                                              ("digits", 65), ("images", None)])
def test_bad_task_length(name, length):
    with pytest.raises(ValueError, match=name):
        get_task(name, length)


def test_schedule_warmup_then_cosine_and_same_in_optax():
    spec = RunSpec(get_task("digits"), "softmax", "softmax", {}, 0, steps=100, batch_size=4,
                   peak_lr=1e-3)
    rates = [learning_rate(step, spec) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert rates[10] == pytest.approx(1e-3) and rates[-1] < 1e-6
    assert all(a >= b for a, b in itertools.pairwise(rates[10:]))
    train_flax = pytest.importorskip("xattn.training.encoder_flax")
    schedule = train_flax.schedule(spec)
    np.testing.assert_allclose([float(schedule(step)) for step in range(100)], rates,
                               rtol=1e-5, atol=1e-6 * spec.peak_lr)  # float32


# --------------------------------------------------------------------------------------
# training: 20 steps per framework and estimator
# --------------------------------------------------------------------------------------

TINY = ModelConfig(dim=16, ffn=32, heads=2, layers=1)
SMOKE_OPTIONS = {"softmax": {}, "rfa": {"num_features": 8, "orthogonal": False,
                                        "redraw_interval": 1},
                 "ra": {"num_samples": 1}, "lara": {"num_samples": 4}}


def _smoke(framework: str, estimator: str):
    module = pytest.importorskip(f"xattn.training.encoder_{framework}")
    task = get_task("digits")
    train, test = task.datasets(0, 0)
    train = train.take(np.arange(16))  # one batch, seen 20 times
    test = Dataset(test.tokens[:64], test.targets[:64])
    spec = RunSpec(task, estimator, estimator, SMOKE_OPTIONS[estimator], seed=0, steps=20,
                   batch_size=16, peak_lr=3e-2, warmup_fraction=0.05, eval_points=4,
                   curve_test_size=64, model=TINY)
    # XLA's optimization level 0 compiles about 3 times faster (the steps run slower)
    options = {"compiler_options": {"xla_backend_optimization_level": 0}} if (
        framework == "flax") else {}
    return train_run(spec, module.Trainer(spec, **options), train, test)


@pytest.mark.parametrize("framework", ["torch", "flax"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_twenty_steps_lower_the_training_loss(framework, estimator):
    result = _smoke(framework, estimator)
    losses = [point["train_loss"] for point in result.curve]  # means over 5 steps each
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses
    assert 0.0 <= result.test_accuracy <= 1.0 and result.ms_per_step > 0
    assert result.peak_memory_bytes is None or result.peak_memory_bytes > 0


# --------------------------------------------------------------------------------------
# the framework's own layer (--estimators native): the baseline of the softmax row
# --------------------------------------------------------------------------------------


def _native_and_softmax(framework: str, model: ModelConfig = TINY):
    """Trainers of the native row and of the softmax row (seed 0) on ListOps at length 32,
    whose padding gives every layer a key mask, and a batch source (one batch of 8
    sequences, over and over, so that 10 steps lower the loss)."""
    module = pytest.importorskip(f"xattn.training.encoder_{framework}")
    from xattn.training.loop import NATIVE, batches
    task = get_task("listops", 32)
    train, _ = task.datasets(8, 1)
    options = {"compiler_options": {"xla_backend_optimization_level": 0}} if (
        framework == "flax") else {}
    trainers = [module.Trainer(RunSpec(task, name, name, {}, seed=0, steps=10, batch_size=8,
                                       peak_lr=3e-3, model=model), **options)
                for name in (NATIVE, "softmax")]
    assert not train.mask.all()  # padded sequences: the masks are exercised
    return trainers, batches(train, 8, seed=0)


def _parameters(framework: str, trainer) -> dict[str, np.ndarray]:
    """Every trainable parameter by its path, as NumPy."""
    if framework == "torch":
        return {name: value.detach().cpu().numpy()
                for name, value in trainer.model.named_parameters()}
    from flax import nnx
    model, _ = nnx.merge(trainer.graphdef, trainer.state)
    return {"/".join(map(str, path)): np.asarray(value)
            for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("framework", ["torch", "flax"])
@pytest.mark.parametrize("equal_query_key_init", [True, False])
def test_native_layer_starts_from_the_parameters_of_softmax(framework, equal_query_key_init):
    """The same seed gives the framework's own layer and the xattn layer the same
    parameters, under the same names, bit for bit; equal_query_key_init copies the query
    projection into the key projection in both."""
    model = ModelConfig(dim=16, ffn=32, heads=2, layers=2,
                        equal_query_key_init=equal_query_key_init)
    (native, softmax), _ = _native_and_softmax(framework, model)
    first, second = _parameters(framework, native), _parameters(framework, softmax)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    for layer in range(model.layers):
        if framework == "torch":
            packed = first[f"blocks.{layer}.attention.in_proj_weight"]
            query, key = packed[:model.dim], packed[model.dim:2 * model.dim]
        else:
            query, key = (first[f"blocks/{layer}/attention/{name}/kernel"]
                          for name in ("query", "key"))
        assert np.array_equal(query, key) is equal_query_key_init


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_native_layer_trains_as_softmax(framework):
    """Step by step on the same batches, the framework's own layer gives the losses of
    the xattn layer with estimator="softmax" to float32 rounding, with padding masks,
    and the loss goes down."""
    (native, softmax), source = _native_and_softmax(framework)
    native_losses, softmax_losses = [], []
    for _ in range(10):
        batch = next(source)
        native_losses.append(native.step(batch, 3e-3)[0])
        softmax_losses.append(softmax.step(batch, 3e-3)[0])
    np.testing.assert_allclose(native_losses, softmax_losses, rtol=1e-5)
    assert statistics.fmean(native_losses[-3:]) < native_losses[0], native_losses
    _, test = get_task("listops", 32).datasets(1, 64)
    assert native.accuracy(test) == pytest.approx(softmax.accuracy(test), abs=1 / 64)


def test_native_row_is_named_after_the_layer_and_resumes(tmp_path, monkeypatch, capsys):
    """--estimators native runs the framework's own layer under its name, with the
    memory estimate of softmax; --resume takes its runs over like any other row."""
    pytest.importorskip("torch")
    from xattn.cli import build_parser
    from xattn.cli import train as train_command
    from xattn.training.loop import NATIVE_LAYERS
    needs: list[tuple[str, int]] = []
    with monkeypatch.context() as patch:
        patch.setattr(train_command, "require_memory",
                      lambda items, available, where: needs.extend(items))
        for framework, layer in NATIVE_LAYERS.items():
            args = build_parser().parse_args(["train", "--framework", framework, "--task",
                                              "mqar", "--estimators", "softmax,native"])
            jobs = train_command.plan_jobs([get_task("mqar", 4096)], [0], args,
                                           has_grid=True)
            assert [(job.spec.name, job.spec.estimator) for job in jobs] == [
                ("softmax", "softmax"), (layer, "native")]
            needs.clear()
            train_command.check_jobs(jobs, 1, "cpu", None)
            assert needs[0][1] == needs[1][1] > 0  # softmax's estimate
    trained = []
    monkeypatch.setattr(train_command, "_execute", fake_execute(trained))
    arguments = ["train", "--task", "digits", "--estimators", "softmax,native", "--steps", "2",
                 "--batch-size", "4", "--no-progress", "--out", str(tmp_path)]
    assert main([*arguments, "--seeds", "0"]) == 0
    assert "torch.nn.MultiheadAttention" in capsys.readouterr().out
    payload = json.loads((tmp_path / "train.json").read_text())
    assert [(run["name"], run["estimator"]) for run in payload["runs"]] == [
        ("softmax", "softmax"), ("torch.nn.MultiheadAttention", "native")]
    assert "own layer" in payload["evaluation_modes"]["native"]
    trained.clear()
    assert main([*arguments, "--seeds", "0,1", "--resume"]) == 0
    assert trained == [1, 1] and "2 taken over" in capsys.readouterr().out
    resumed = json.loads((tmp_path / "train.json").read_text())
    assert [(run["name"], run["seed"]) for run in resumed["runs"]] == [
        ("softmax", 0), ("torch.nn.MultiheadAttention", 0), ("softmax", 1),
        ("torch.nn.MultiheadAttention", 1)]


def test_evaluation_is_deterministic_for_random_estimators():
    torch_trainer = pytest.importorskip("xattn.training.encoder_torch")
    task = get_task("digits")
    _, test = task.datasets(0, 0)
    for estimator in ("rfa", "ra", "lara"):
        spec = RunSpec(task, estimator, estimator, SMOKE_OPTIONS[estimator], seed=0,
                       steps=1, batch_size=8, peak_lr=1e-3, model=TINY)
        trainer = torch_trainer.Trainer(spec)
        part = test.take(np.arange(40))
        assert trainer.accuracy(part) == trainer.accuracy(part)


# --------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------


def test_command_writes_table_json_and_png(tmp_path, capsys):
    train_torch = pytest.importorskip("xattn.training.encoder_torch")
    pytest.importorskip("matplotlib")
    code = main(["train", "--task", "digits", "--estimators", "lara", "--steps", "6",
                 "--seeds", "0", "--samples", "4", "--batch-size", "8", "--no-progress",
                 "--out", str(tmp_path)])
    assert code == 0
    table = capsys.readouterr().out
    assert "lara-1d" in table and "test accuracy" in table
    payload = json.loads((tmp_path / "train.json").read_text())
    rows = {row["name"] for row in payload["summary"]}
    if train_torch.supports_grid():  # layers with grid=: LARA with 2-D segments too
        assert rows == {"lara-2d", "lara-1d"}
        grid_run = next(run for run in payload["runs"] if run["name"] == "lara-2d")
        assert grid_run["options"] == {"num_samples": [2, 2], "grid": [8, 8]}
    else:
        assert rows == {"lara-1d"}
    assert payload["config"]["lara_2d_segments"] is train_torch.supports_grid()
    assert payload["evaluation_modes"]["lara"].startswith("deterministic")
    assert payload["environment"]["torch"] and payload["config"]["interrupted"] is False
    assert all(len(run["curve"]) >= 1 for run in payload["runs"])
    assert (tmp_path / "train.png").stat().st_size > 0


def test_ctrl_c_keeps_the_finished_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from xattn.training import runs  # the command trains through it
    finished = []

    def interrupt_second(*args, **kwargs):
        if finished:
            raise KeyboardInterrupt
        finished.append(train_run(*args, **kwargs))
        return finished[-1]

    monkeypatch.setattr(runs, "train_run", interrupt_second)
    code = main(["train", "--task", "digits", "--estimators", "softmax,rfa", "--steps", "2",
                 "--seeds", "0", "--batch-size", "4", "--no-progress", "--out",
                 str(tmp_path)])
    assert code == 130
    payload = json.loads((tmp_path / "train.json").read_text())
    assert payload["config"]["interrupted"] is True
    assert [run["name"] for run in payload["runs"]] == ["softmax"]
    assert "interrupted" in capsys.readouterr().err

    # --resume takes the finished run over and trains only the missing one
    trained = []

    def record(spec, *args, **kwargs):
        trained.append(spec.name)
        return train_run(spec, *args, **kwargs)

    monkeypatch.setattr(runs, "train_run", record)
    arguments = ["train", "--task", "digits", "--estimators", "softmax,rfa", "--steps", "2",
                 "--seeds", "0", "--batch-size", "4", "--no-progress", "--out",
                 str(tmp_path), "--resume"]
    assert main(arguments) == 0
    assert trained == ["rfa"]
    assert "1 taken over" in capsys.readouterr().out
    resumed = json.loads((tmp_path / "train.json").read_text())
    assert [run["name"] for run in resumed["runs"]] == ["softmax", "rfa"]
    assert resumed["runs"][0] == payload["runs"][0]
    assert resumed["config"]["resumed_runs"] == 1 and not resumed["config"]["interrupted"]

    # other settings: one line naming what differs, exit code 2, the file untouched
    assert main([*arguments, "--samples", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--resume" in err and "samples" in err and len(err.splitlines()) == 1
    assert json.loads((tmp_path / "train.json").read_text()) == resumed


@pytest.mark.parametrize("arguments", [
    ["--task", "imagenet"],
    ["--framework", "jax"],
    ["--estimators", "softmax,nystrom"],
    ["--steps", "0"],
    ["--task", "mqar", "--length", "16"],
    ["--task", "listops", "--length", "8"],
    ["--task", "digits", "--length", "128"],
    ["--seeds", "x"],
])
def test_bad_input_is_one_line_and_exit_code_2(arguments, tmp_path, capsys):
    code = main(["train", *arguments, "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # rejected before any work


def test_missing_framework_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flax", None)  # import flax -> ImportError
    for name in ("xattn.training.encoder_flax", "xattn.flax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    code = main(["train", "--framework", "flax", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "pip install -e '.[flax]'" in err and len(err.splitlines()) == 1


def test_summary_mean_and_std_over_seeds():
    from xattn.cli.train_report import summarize
    from xattn.training.loop import RunResult

    def result(seed, accuracy):
        return RunResult("digits", "rfa", "rfa", {}, seed, 10, final_train_loss=1.0,
                         ms_per_step=5.0, peak_memory_bytes=None, peak_memory_method="n/a",
                         wall_s=1.0, curve=[], test_accuracy=accuracy)

    (row,) = summarize([result(0, 0.5), result(1, 0.7), result(2, 0.9)])
    assert row["test_accuracy_mean"] == pytest.approx(0.7)
    assert row["test_accuracy_std"] == pytest.approx(statistics.stdev([0.5, 0.7, 0.9]))


# --------------------------------------------------------------------------------------
# reliability: --resume with a damaged train.json, runs kept on disk, sizes, seeds
# --------------------------------------------------------------------------------------

RESUME_ARGUMENTS = ["train", "--task", "digits", "--estimators", "softmax", "--steps", "2",
                    "--batch-size", "4", "--no-progress"]


@pytest.fixture(scope="module")
def one_seed_file(tmp_path_factory):
    """The text of a real train.json: one softmax run on digits, seed 0."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("one-seed")
    assert main([*RESUME_ARGUMENTS, "--seeds", "0", "--out", str(out)]) == 0
    return (out / "train.json").read_text()


def fake_execute(trained):
    """Stands in for one training run: records the job, returns a plausible result."""
    from xattn.training.loop import RunResult

    def execute(job, device, progress, position=None):
        trained.append(job.spec.seed)
        spec = job.spec
        return RunResult(spec.task.name, spec.name, spec.estimator, spec.options, spec.seed,
                         spec.steps, final_train_loss=2.0, ms_per_step=1.0,
                         peak_memory_bytes=1024, peak_memory_method="fake", wall_s=0.1,
                         curve=[{"step": spec.steps, "test_accuracy": 0.5,
                                 "train_loss": 2.0}],
                         test_accuracy=0.5)
    return execute


BAD_VALUES = [None, "text", [0], {"a": 1}, True, -1, float("nan"), float("inf"), 1e308,
              2**70, 0.5]
RUN_FIELDS = ["task", "name", "estimator", "options", "seed", "steps", "final_train_loss",
              "ms_per_step", "peak_memory_bytes", "peak_memory_method", "wall_s", "curve",
              "test_accuracy", "sampled_test_accuracy"]


def test_run_fields_are_the_result_fields():
    from dataclasses import fields

    from xattn.training.loop import RunResult
    assert [field.name for field in fields(RunResult)] == RUN_FIELDS


def mutations():
    """(label, function changing the parsed file) for every entry --resume reads: each
    field of a run and of a curve point, config.wall_s, and the file's structure."""
    def set_run(field, value):
        return lambda payload: payload["runs"][0].__setitem__(field, value)

    def set_point(field, value):
        return lambda payload: payload["runs"][0]["curve"][-1].__setitem__(field, value)

    def set_config(field, value):
        return lambda payload: payload["config"].__setitem__(field, value)

    cases = []
    for value in BAD_VALUES:
        cases += [(f"runs[0].{field}={value!r}", set_run(field, value)) for field in RUN_FIELDS]
        cases += [(f"curve.{field}={value!r}", set_point(field, value))
                  for field in ("step", "test_accuracy", "train_loss")]
        cases += [(f"config.{field}={value!r}", set_config(field, value))
                  for field in ("wall_s", "tasks")]
        cases += [(f"top.{key}={value!r}", lambda payload, key=key, value=value:
                   payload.__setitem__(key, value)) for key in ("config", "runs")]
        cases.append((f"runs=[{value!r}]", lambda payload, value=value:
                      payload.__setitem__("runs", [value])))
    cases += [
        ("extra key in a run", set_run("color", "red")),
        ("missing key in a run", lambda payload: payload["runs"][0].pop("ms_per_step")),
        ("no runs", lambda payload: payload.pop("runs")),
        ("no config", lambda payload: payload.pop("config")),
        ("seed [0]", set_run("seed", [0])),
        ("extra key in a curve point", set_point("note", 1)),
        ("empty curve", set_run("curve", [])),
    ]
    return cases


@pytest.mark.parametrize("label, mutate", mutations(), ids=lambda item: str(item)[:40])
def test_resume_checks_the_whole_file_before_training(one_seed_file, tmp_path, monkeypatch,
                                                      capsys, label, mutate):
    """Whatever entry of train.json is changed, --resume with more seeds either refuses
    before any training (one line, exit 2, the file byte for byte as it was) or accepts
    it and ends with every run on disk and every figure finite."""
    from xattn.cli import train as train_command
    payload = json.loads(one_seed_file)
    mutate(payload)
    text = json.dumps(payload)
    (tmp_path / "train.json").write_text(text)
    trained = []
    monkeypatch.setattr(train_command, "_execute", fake_execute(trained))
    code = main([*RESUME_ARGUMENTS, "--seeds", "0,1", "--out", str(tmp_path), "--resume"])
    err = capsys.readouterr().err
    if code == 2:
        assert trained == [], label
        assert len(err.strip().splitlines()) == 1 and "--resume" in err, label
        assert (tmp_path / "train.json").read_text() == text, label
        return
    assert code == 0, (label, err)
    resumed = json.loads((tmp_path / "train.json").read_text())
    assert sorted(run["seed"] for run in resumed["runs"]) == [0, 1], label
    for run in resumed["runs"]:
        for field in ("test_accuracy", "final_train_loss", "ms_per_step", "wall_s"):
            assert math.isfinite(run[field]) and run[field] >= 0, (label, field)
        assert 0 <= run["test_accuracy"] <= 1, label
    assert math.isfinite(resumed["config"]["wall_s"]), label


@pytest.mark.parametrize("text", ["", "not json", "[" * 100_000, "[]", "null", "{}",
                                  '{"config": {}, "runs": null}', '{"config": [1], "runs": []}',
                                  '{"config": {}, "runs": [1]}', "\udcff"],
                         ids=["empty", "text", "deep", "list", "null", "no-entries",
                              "runs-null", "config-list", "runs-int", "undecodable"])
def test_resume_refuses_what_is_not_a_train_json(tmp_path, monkeypatch, capsys, text):
    pytest.importorskip("torch")
    from xattn.cli import train as train_command
    path = tmp_path / "train.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    trained = []
    monkeypatch.setattr(train_command, "_execute", fake_execute(trained))
    code = main([*RESUME_ARGUMENTS, "--seeds", "0", "--out", str(tmp_path), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and trained == []
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert path.read_bytes() == text.encode("utf-8", "surrogateescape")


def test_each_finished_run_is_on_disk_before_the_next_starts(tmp_path, monkeypatch):
    """A run that crashes (here: the third) loses none of the runs before it: each is in
    train.json, readable by --resume, as soon as it finishes."""
    pytest.importorskip("torch")
    from xattn.cli import train as train_command
    from xattn.cli.train_report import read_results
    trained = []
    execute = fake_execute(trained)

    def crash_third(job, *args, **kwargs):
        if len(trained) == 2:
            raise RuntimeError("the machine went away")
        on_disk = read_results(tmp_path / "train.json")[1] if trained else []
        assert [run.seed for run in on_disk] == trained
        return execute(job, *args, **kwargs)

    monkeypatch.setattr(train_command, "_execute", crash_third)
    with pytest.raises(RuntimeError, match="went away"):
        main([*RESUME_ARGUMENTS, "--seeds", "0,1,2", "--out", str(tmp_path)])
    config, runs = read_results(tmp_path / "train.json")
    assert [run.seed for run in runs] == [0, 1] and config["interrupted"] is True
    # --resume then trains only the missing run
    trained.clear()
    monkeypatch.setattr(train_command, "_execute", execute)
    assert main([*RESUME_ARGUMENTS, "--seeds", "0,1,2", "--out", str(tmp_path),
                 "--resume"]) == 0
    assert trained == [2]
    config, runs = read_results(tmp_path / "train.json")
    assert [run.seed for run in runs] == [0, 1, 2] and config["interrupted"] is False


def test_json_writes_are_atomic(tmp_path, monkeypatch):
    """A write that fails at any point leaves the previous file whole and no stray
    temporary file."""
    from xattn.cli import common
    path = tmp_path / "out.json"
    common.write_json(path, {"version": 1})
    before = path.read_text()

    def failing_replace(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common.os, "replace", failing_replace)
    with pytest.raises(common.CommandError, match="No space left"):
        common.write_json(path, {"version": 2})
    assert path.read_text() == before
    assert [entry.name for entry in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("size, batch_size", [(0, 1), (3, 4), (5, 5), (7, 2), (1, 1)])
def test_batches_never_search_forever(size, batch_size):
    """Either full batches of the asked size come, or a ValueError at once."""
    from xattn.training.loop import batches
    data = Dataset(np.arange(size)[:, None, None], np.arange(size))
    if batch_size > size:
        with pytest.raises(ValueError, match="batch_size"):
            batches(data, batch_size, seed=0)
        return
    source = batches(data, batch_size, seed=0)
    drawn = [next(source) for _ in range(3)]
    assert all(len(batch) == batch_size for batch in drawn)


@pytest.mark.parametrize("task", ["mqar", "listops", "digits"])
def test_every_run_has_a_full_batch_or_is_refused(task, tmp_path, capsys):
    """On every task a batch larger than the training set is refused before any work
    (one line, exit 2, no output directory) or the training set is at least one batch."""
    from xattn.cli import build_parser
    from xattn.cli.train import check_jobs, plan_jobs
    from xattn.training.tasks import get_task
    for batch_size in (1_000, 1_438, 20_000):
        args = build_parser().parse_args(["train", "--task", task, "--batch-size",
                                          str(batch_size), "--quick"])
        jobs = plan_jobs([get_task(task)], [0], args, has_grid=True)
        try:
            check_jobs(jobs, 1, "cpu", None)  # sizes only, memory not limited
        except Exception:
            assert task == "digits" and batch_size > digits_task.TRAIN_SIZE
            out = tmp_path / f"out-{batch_size}"
            code = main(["train", "--task", task, "--batch-size", str(batch_size),
                         "--out", str(out)])
            err = capsys.readouterr().err
            assert code == 2 and "--batch-size" in err and "1437" in err
            assert len(err.strip().splitlines()) == 1 and not out.exists()
        else:
            assert all(job.train_size >= batch_size for job in jobs)


@pytest.mark.parametrize("arguments", [
    ["--task", "mqar", "--length", "2000000"],
    ["--task", "listops", "--length", "2000000"],
    ["--task", "mqar", "--batch-size", "1000000"],
])
def test_too_large_sizes_are_refused_before_any_work(arguments, tmp_path, capsys):
    code = main(["train", *arguments, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "needs about" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_default_runs_fit_a_small_machine():
    """The memory estimate does not refuse the default runs (every task, estimator and
    --jobs 2) on a machine with 4 GiB free: the estimates are bounds, not alarms."""
    from xattn.cli import build_parser
    from xattn.cli.train import check_jobs, plan_jobs
    from xattn.training.tasks import CLASSIFICATION_TASKS, get_task
    for quick in ([], ["--quick"]):
        args = build_parser().parse_args(["train", *quick])
        jobs = plan_jobs([get_task(name) for name in CLASSIFICATION_TASKS], [0, 1, 2], args,
                         has_grid=True)
        check_jobs(jobs, 2, "cpu", 4 * 2**30)


@pytest.mark.parametrize("command, option", [("compare", "--seed"), ("bench", "--seed"),
                                             ("train", "--seeds")])
def test_every_command_takes_the_same_seeds(command, option, capsys):
    """0 to MAX_SEED parse in every sub-command; beyond it, one line and exit 2."""
    from xattn.cli import build_parser
    from xattn.cli.options import MAX_SEED
    parser = build_parser()
    for seed in (0, MAX_SEED):
        args = parser.parse_args([command, option, str(seed)])
        assert getattr(args, option.lstrip("-")) in (seed, [seed])
    for text in (str(MAX_SEED + 1), "99999999999999999999999", "-1"):
        code = main([command, option, text])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and option in err


def test_the_largest_seed_trains(tmp_path):
    """MAX_SEED seeds the framework's generators (no OverflowError)."""
    pytest.importorskip("torch")
    from xattn.cli.options import MAX_SEED
    assert main([*RESUME_ARGUMENTS, "--seeds", str(MAX_SEED), "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "train.json").read_text())["runs"][0]["seed"] == MAX_SEED


RESUME_DIGITS = ["train", "--task", "digits", "--steps", "2", "--batch-size", "4",
                 "--no-progress"]


def test_resume_keeps_finished_runs_the_command_does_not_plan(tmp_path, monkeypatch, capsys):
    """--resume with other --estimators or --seeds keeps every finished run of the file
    (in train.json and in the table) and trains only the planned runs it lacks."""
    pytest.importorskip("torch")
    from xattn.cli import train as train_command
    trained = []
    monkeypatch.setattr(train_command, "_execute", fake_execute(trained))
    assert main([*RESUME_DIGITS, "--estimators", "softmax,rfa", "--seeds", "0",
                 "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    trained.clear()
    assert main([*RESUME_DIGITS, "--estimators", "softmax", "--seeds", "0,1",
                 "--out", str(tmp_path), "--resume"]) == 0
    out = capsys.readouterr().out
    assert trained == [1] and "1 taken over" in out and "1 kept" in out
    payload = json.loads((tmp_path / "train.json").read_text())
    assert sorted((run["name"], run["seed"]) for run in payload["runs"]) == [
        ("rfa", 0), ("softmax", 0), ("softmax", 1)]
    assert sorted((row["name"], tuple(row["seeds"])) for row in payload["summary"]) == [
        ("rfa", (0,)), ("softmax", (0, 1))]
    assert payload["config"]["estimators"] == ["softmax", "rfa"]
    assert payload["config"]["seeds"] == [0, 1] and payload["config"]["kept_runs"] == 1
    assert "rfa" in out.split("wrote")[0]  # the table shows the kept row


@pytest.mark.parametrize("first, again", [
    (["--task", "digits", "--steps", "2"], ["--task", "digits", "--steps", "3"]),
    (["--task", "digits", "--steps", "2"], ["--task", "digits"]),
    (["--task", "digits", "--steps", "2"], ["--task", "mqar", "--steps", "2"]),
    (["--task", "mqar", "--length", "64", "--steps", "2"],
     ["--task", "mqar", "--length", "128", "--steps", "2"]),
    (["--task", "digits", "--steps", "2"],
     ["--task", "digits", "--steps", "2", "--token-init", "scaled"]),
], ids=["steps", "default-steps", "task", "length", "token-init"])
def test_resume_refuses_runs_of_other_steps_or_task_and_leaves_the_file(
        first, again, tmp_path, monkeypatch, capsys):
    """A finished run is never dropped: where the file holds runs that this command
    could not compare with its own (another --task, --steps or --length), --resume
    refuses before any training, in one line naming the option, exit 2, the file byte
    for byte as it was."""
    pytest.importorskip("torch")
    from xattn.cli import train as train_command
    trained = []
    monkeypatch.setattr(train_command, "_execute", fake_execute(trained))
    common = ["train", "--estimators", "softmax", "--seeds", "0", "--batch-size", "4",
              "--no-progress", "--out", str(tmp_path)]
    assert main([*common, *first]) == 0
    capsys.readouterr()
    before = (tmp_path / "train.json").read_bytes()
    trained.clear()
    code = main([*common, *again, "--seeds", "0,1", "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and trained == [], err
    assert len(err.strip().splitlines()) == 1 and "--resume" in err and "Traceback" not in err
    option = next(item for item in ("--steps", "--task", "--length", "--token-init")
                  if item in err)
    assert option in {item for item in [*first, *again] if item.startswith("--")}
    assert (tmp_path / "train.json").read_bytes() == before


def test_each_task_starts_its_token_embeddings_as_its_settings_say():
    """The token embeddings' start is a task setting, the same in both frameworks:
    N(0, 1) beside learned N(0, 1) positions (digits, listops), N(0, 1/width) without
    them (mqar); --token-init overrides it for every task."""
    from xattn.cli import build_parser
    from xattn.cli.train import plan_jobs
    for task_name, expected in [("digits", "unit"), ("listops", "unit"), ("mqar", "scaled")]:
        assert get_task(task_name).positional is (expected == "unit")
        for option, init in [([], expected), (["--token-init", "scaled"], "scaled"),
                             (["--token-init", "unit"], "unit")]:
            args = build_parser().parse_args(["train", "--task", task_name, *option])
            jobs = plan_jobs([get_task(task_name)], [0], args, has_grid=False)
            assert {job.spec.model.token_init for job in jobs} == {init}
