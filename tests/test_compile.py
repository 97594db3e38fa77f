"""``torch.compile(fullgraph=True)`` of every estimator's paths equals eager, values and
gradients, with every kind of ``rng`` and in every dtype.

Each path is compiled whole (``fullgraph=True`` raises at any graph break) at ragged
lengths (70 positions: not a multiple of the causal scan's or the band's chunks), with two
batch elements and three heads, inputs that require grad, and the backward pass taken.

Most cases compile with the ``aot_eager`` backend: dynamo and AOTAutograd trace the whole
forward and backward graph (a graph break, a Python scalar whose dtype must be inferred,
NumPy on the host, a generator's return value lost are all caught there) and run torch's
own kernels, so they equal eager to rounding. A few compile with inductor, which generates
code: the window band with a gradient once gave wrong values there (inductor's scan of
``torch.cummax`` in a tracked graph), and the random draws of a seed or a
``torch.Generator`` must be the eager call's numbers in generated code too.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import xattn

torch = pytest.importorskip("torch")
from torch._dynamo.utils import counters  # noqa: E402

#: (batch, heads, N, D): 70 positions, a ragged last chunk everywhere
SHAPE = (2, 3, 70, 16)
#: working memory small enough to split every call of SHAPE into several blocks
SMALL_MEMORY = 1 << 14

#: tolerance of compiled against eager: float32 rounding (aot_eager runs the same kernels,
#: inductor fuses them: reductions reassociate), half precision one unit of its rounding
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
             torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _means(q):
    return 0.3 * q[..., :4, :].detach().float()


#: name -> the call; ``rng`` is an int seed, a torch.Generator or (rfa) the samples ``omega``
PATHS = {
    "rfa": lambda q, k, v, rng: xattn.rfa(q, k, v, num_features=32, rng=rng),
    "rfa-hyperbolic": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, feature_map="hyperbolic"),
    "rfa-trigonometric": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, feature_map="trigonometric"),
    "causal-rfa": lambda q, k, v, rng: xattn.rfa(q, k, v, num_features=32, rng=rng,
                                                 causal=True),
    "causal-rfa-hyperbolic": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, feature_map="hyperbolic", causal=True),
    "causal-rfa-trigonometric": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, feature_map="trigonometric", causal=True),
    "causal-rfa-key-mask": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, causal=True,
        key_mask=torch.arange(q.shape[-2]) % 5 != 3),
    "causal-rfa-window-sinks": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, causal=True, window=8, sinks=2),
    "rfa-window": lambda q, k, v, rng: xattn.rfa(q, k, v, num_features=32, rng=rng, window=8),
    "rfa-window-sinks-key-mask": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, window=8, sinks=1,
        key_mask=torch.arange(q.shape[-2]) % 7 != 0),
    "causal-rfa-prefill": lambda q, k, v, rng: xattn.rfa(
        q, k, v, num_features=32, rng=rng, causal=True, window=8, sinks=1,
        return_state=True)[0],
    "causal-rfa-continued": lambda q, k, v, rng: _continued(q, k, v, rng),
    "lara": lambda q, k, v, rng: xattn.lara(q, k, v, num_samples=4, rng=rng),
    "causal-lara": lambda q, k, v, rng: xattn.lara(
        q, k, v, num_samples=4, proposal_means=_means(q), weighting="query_proposal",
        causal=True, rng=rng),
    "ra": lambda q, k, v, rng: xattn.ra(q, k, v, num_samples=2, rng=rng),
    "causal-ra": lambda q, k, v, rng: xattn.ra(q, k, v, num_samples=2, rng=rng, causal=True),
    "softmax": lambda q, k, v, rng: xattn.softmax_attention(q, k, v),
    "causal-softmax": lambda q, k, v, rng: xattn.softmax_attention(q, k, v, causal=True),
}

#: the paths that draw (the others take no rng)
RANDOM = sorted(name for name in PATHS if "softmax" not in name)


def _continued(q, k, v, rng):
    """A sequence continued from a state: 50 positions, then the 20 after them."""
    first, state = xattn.rfa(q[..., :50, :], k[..., :50, :], v[..., :50, :], num_features=32,
                             rng=rng, causal=True, window=8, sinks=1, return_state=True)
    rest = xattn.rfa(q[..., 50:, :], k[..., 50:, :], v[..., 50:, :], causal=True, state=state)
    return torch.cat([first, rest], dim=-2)


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [torch.asarray(rng.normal(size=SHAPE), dtype=dtype).requires_grad_()
            for _ in range(3)]


def _rng(kind, dtype=torch.float32):
    """A fresh rng of ``kind`` (the same numbers each time it is made)."""
    if kind == "seed":
        return 7
    if kind == "generator":
        return torch.Generator().manual_seed(7)
    assert kind == "omega"
    return torch.asarray(np.random.default_rng(7).normal(size=(32, SHAPE[-1])),
                         dtype=torch.float32)


def _values_and_grads(function, arrays, rng, **options):
    with warnings.catch_warnings():
        # dynamo's notes on lru_cache wrappers; the trigonometric map's clamped rows
        warnings.simplefilter("ignore", UserWarning)
        out = function(*arrays, rng, **options)
    # a mean: the trigonometric map's clamped rows have large gradients (beyond float16's
    # range with a sum of squares, in eager as compiled)
    grads = torch.autograd.grad((out.float() ** 2).mean(), arrays)
    return out, grads


def check_compiled_equals_eager(function, dtype, kind, backend, **options):
    """``function(q, k, v, rng)`` compiled whole equals eager, values and gradients."""
    eager = _values_and_grads(function, _inputs(dtype), _rng(kind), **options)
    torch._dynamo.reset()
    compiled_function = torch.compile(function, fullgraph=True, backend=backend)
    compiled = _values_and_grads(compiled_function, _inputs(dtype), _rng(kind), **options)
    assert compiled[0].dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(compiled[0], eager[0], **tolerance)
    # the gradients relative to their largest entry. In half precision AOTAutograd's
    # backward rounds some intermediate products differently: the compiled gradients are
    # as close to the float32 call's as the eager ones are (twice their largest error, at
    # least a few units of rounding)
    exact = (eager if dtype == torch.float32
             else _values_and_grads(function, _inputs(torch.float32), _rng(kind), **options))
    for compiled_grad, eager_grad, exact_grad in zip(compiled[1], eager[1], exact[1],
                                                     strict=True):
        scale = float(exact_grad.abs().max())
        eager_error = float((eager_grad.float() - exact_grad).abs().max()) / scale
        if dtype == torch.float32:
            torch.testing.assert_close(compiled_grad / scale, eager_grad / scale, **tolerance)
        else:
            compiled_error = float((compiled_grad.float() - exact_grad).abs().max()) / scale
            assert compiled_error <= max(6 * torch.finfo(dtype).eps, 2 * eager_error), (
                compiled_error, eager_error)


@pytest.mark.parametrize("kind", ["seed", "generator"])
@pytest.mark.parametrize("name", sorted(PATHS))
def test_fullgraph_compile_equals_eager(name, kind):
    if name not in RANDOM and kind != "seed":
        pytest.skip("draws nothing: one rng kind is enough")
    check_compiled_equals_eager(PATHS[name], torch.float32, kind, "aot_eager")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(PATHS))
def test_fullgraph_compile_of_half_inputs_equals_eager(name, dtype):
    kind = "generator" if dtype == torch.float16 else "seed"
    check_compiled_equals_eager(PATHS[name], dtype, kind, "aot_eager")


@pytest.mark.parametrize("name", sorted(PATHS))
def test_other_lengths_compile_whole(name):
    """One compiled function called at 70 positions, then at 90 and 103: dynamo compiles
    the second length with the length symbolic (automatic dynamic shapes), as a user's
    batches of several lengths meet it. Whole graphs, equal to eager (a ``divmod`` and a
    clip to the length once broke ``lara`` and ``ra`` there)."""
    torch._dynamo.reset()
    compiled_function = torch.compile(PATHS[name], fullgraph=True, backend="aot_eager")
    for length in (70, 90, 103):
        rng = np.random.default_rng(length)
        arrays = [torch.asarray(rng.normal(size=(*SHAPE[:2], length, SHAPE[-1])),
                                dtype=torch.float32).requires_grad_() for _ in range(3)]
        eager = _values_and_grads(PATHS[name], arrays, _rng("seed"))
        compiled = _values_and_grads(compiled_function, arrays, _rng("seed"))
        torch.testing.assert_close(compiled[0], eager[0], **TOLERANCE[torch.float32])
        for compiled_grad, eager_grad in zip(compiled[1], eager[1], strict=True):
            scale = float(eager_grad.abs().max())
            torch.testing.assert_close(compiled_grad / scale, eager_grad / scale,
                                       **TOLERANCE[torch.float32])


@pytest.mark.parametrize("name", ["causal-rfa", "causal-rfa-window-sinks", "rfa-window",
                                  "lara", "causal-lara", "causal-ra"])
def test_fullgraph_compile_in_several_blocks_equals_eager(name):
    """A working memory that splits the call into blocks: the block scan compiles whole."""
    # RA's steps hold (query, sample) rows against every key: three steps of 48 rows
    options = {"working_memory": 1 << 19 if name.endswith("ra") else SMALL_MEMORY}
    check_compiled_equals_eager(lambda q, k, v, rng, **o: _with_options(name, q, k, v, rng, o),
                                torch.float32, "seed", "aot_eager", **options)


def _with_options(name, q, k, v, rng, options):
    call = {"rfa": xattn.rfa, "lara": xattn.lara, "ra": xattn.ra}
    estimator = next(key for key in call if key in name)
    extra = {"rfa": {"num_features": 32}, "lara": {"num_samples": 4},
             "ra": {"num_samples": 2}}[estimator]
    if "window" in name:
        extra.update(window=8, sinks=2 if "sinks" in name else 0)
    if name == "causal-lara":
        extra.update(proposal_means=_means(q), weighting="query_proposal")
    return call[estimator](q, k, v, rng=rng, causal=name.startswith("causal"), **extra,
                           **options)


@pytest.mark.parametrize(("name", "dtype", "kind"), [
    ("causal-rfa-window-sinks", torch.float32, "omega"),
    ("rfa-window", torch.float32, "generator"),
    ("causal-rfa", torch.bfloat16, "seed"),
])
def test_inductor_compile_equals_eager(name, dtype, kind):
    """Generated code: the window band's ragged chunks with a gradient to track (wrong by
    up to 1.5 in the forward and 45 % in the gradients before), and the draws of a seed
    and of a ``torch.Generator`` (the eager numbers, not inductor's own generator's)."""
    def function(q, k, v, rng):
        if kind == "omega":
            return xattn.rfa(q, k, v, omega=rng, causal=True, window=8, sinks=2)
        return PATHS[name](q, k, v, rng)

    check_compiled_equals_eager(function, dtype, kind, "inductor")


@pytest.mark.parametrize("window", [16, 64])
def test_window_layouts_of_ragged_lengths_compile_whole(window):
    """A causal window at ragged lengths, one compiled function called at 130 and then 150
    positions (the second compilation with the length symbolic, dynamo's automatic
    dynamic shapes): the band and the scan in equal chunks
    (xattn._estimators.window.window_layout; two band chunks of 75 at window 64 and 150
    positions) traced whole and equal to eager, values and gradients. The choice of the
    layout once took a ``min`` of a list of costs, which dynamo refused with a symbolic
    length."""
    generator = torch.Generator().manual_seed(3)
    omega = torch.randn(32, SHAPE[-1], generator=generator)

    def function(q, k, v):
        return xattn.rfa(q, k, v, omega=omega, causal=True, window=window, sinks=1)

    torch._dynamo.reset()
    compiled_function = torch.compile(function, fullgraph=True, backend="aot_eager")
    for length in (130, 150):
        inputs = [torch.randn(2, 3, length, SHAPE[-1], generator=generator).requires_grad_()
                  for _ in range(3)]
        eager = function(*inputs)
        eager_grads = torch.autograd.grad(eager.square().mean(), inputs)
        compiled = compiled_function(*inputs)
        compiled_grads = torch.autograd.grad(compiled.square().mean(), inputs)
        torch.testing.assert_close(compiled, eager, **TOLERANCE[torch.float32])
        for compiled_grad, eager_grad in zip(compiled_grads, eager_grads, strict=True):
            scale = float(eager_grad.abs().max())
            torch.testing.assert_close(compiled_grad / scale, eager_grad / scale,
                                       **TOLERANCE[torch.float32])


def test_a_new_seed_at_every_step_compiles_at_most_twice():
    """The seed is an input of the graph after its first change (dynamo's automatic
    dynamic), and each compiled call draws the eager call's numbers for its seed."""
    q, k, v = (x.detach() for x in _inputs(torch.float32))

    def attend(q, k, v, seed):
        return xattn.rfa(q, k, v, num_features=32, rng=seed, causal=True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    for seed in range(10):
        torch.testing.assert_close(compiled(q, k, v, seed), attend(q, k, v, seed),
                                   rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("estimator", ["rfa", "lara", "ra"])
def test_a_layer_training_step_compiles_whole_and_at_most_twice(estimator):
    """``torch.compile(layer, fullgraph=True)``: ten training steps (forward, backward,
    optimizer step), new features drawn from the layer's torch.Generator every step, the
    losses of the eager layer, at most two compilations."""
    options = {"rfa": {"num_features": 16, "redraw_interval": 1},
               "lara": {"num_samples": 8}, "ra": {"num_samples": 2}}[estimator]
    x = torch.asarray(np.random.default_rng(1).normal(size=(2, 37, 64)), dtype=torch.float32)

    def train(compiled):
        torch.manual_seed(0)
        layer = xattn.torch.MultiheadAttention(64, 4, estimator=estimator, batch_first=True,
                                               generator=torch.Generator().manual_seed(3),
                                               **options)
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
        forward = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
        losses = []
        for _ in range(10):
            out, _ = forward(x, x, x, need_weights=False, is_causal=estimator == "rfa",
                             attn_mask=None)
            loss = (out ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        return losses

    eager = train(False)
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        compiled = train(True)
    np.testing.assert_allclose(compiled, eager, rtol=1e-5)
    assert len(set(eager)) == 10  # the steps trained
    assert counters["stats"]["unique_graphs"] <= 2


def test_a_hugging_face_prefill_and_decode_steps_compile_whole():
    """A GPT-2 through ``xattn.transformers`` with its ``XattnCache``: the prefill and each
    decode step compiled whole give the eager logits; the later steps compile no more."""
    transformers = pytest.importorskip("transformers")
    import inspect

    import xattn.transformers as xt

    config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=128, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation(xt.register("test_compile_rfa", estimator="rfa",
                                              num_features=16, window=3, sinks=1).name)
    cache_name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                  else "past_key_values")
    prompt = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))

    def logits(ids, cache):
        return model(ids, **{cache_name: cache}, use_cache=True).logits

    def generate(function):
        cache, ids, steps = xt.XattnCache(), prompt, []
        for _ in range(5):
            out = function(ids, cache)
            steps.append(out)
            ids = out[:, -1:].argmax(-1)
        return steps

    with torch.no_grad():
        eager = generate(logits)
        torch._dynamo.reset()
        counters.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            compiled = generate(torch.compile(logits, fullgraph=True, backend="aot_eager"))
    for compiled_step, eager_step in zip(compiled, eager, strict=True):
        torch.testing.assert_close(compiled_step, eager_step, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 3  # the prefill, a step, a dynamic step


def test_the_draw_operations_exist_when_torch_is_imported_after_xattn():
    """xattn imports no torch; the graph operations through which a compiled call draws
    are defined right after torch's import completes (a definition cannot be traced), and
    a JAX state made before JAX is imported is still a pytree."""
    script = (
        "import sys, xattn\n"
        "assert 'torch' not in sys.modules and 'jax' not in sys.modules\n"
        "import torch\n"
        "assert torch.ops.xattn.seeded_draw.default is not None\n"
        "assert torch.ops.xattn.generator_draw.default is not None\n"
        "out = torch.ops.xattn.seeded_draw(3, [3, 0, 2, 2])\n"
        "import numpy as np\n"
        "assert np.array_equal(out.numpy(), np.random.default_rng(3).standard_normal((2, 2)))\n"
        "x = np.ones((1, 5, 4))\n"
        "_, state = xattn.rfa(x, x, x, num_features=4, rng=0, causal=True, "
        "return_state=True)\n"
        "import jax\n"
        "assert len(jax.tree_util.tree_leaves(state)) > 1\n"
    )
    _run_in_a_fresh_process(script, timeout=120)


def test_compiling_raises_no_warning_about_cached_helpers():
    """array-api-compat's helpers are ``functools.lru_cache`` around pure functions; Dynamo
    traces them but warned at every call site (about twenty warnings on a first
    compilation). xattn marks them as safe once torch is imported (imported here after
    xattn, in a fresh process, where no warning was shown yet)."""
    script = (
        "import warnings, xattn, torch\n"
        "q = torch.randn(2, 3, 70, 16, requires_grad=True)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for dtype in (torch.float32, torch.bfloat16):\n"
        "        x = q.to(dtype)\n"
        "        for call in (lambda a: xattn.rfa(a, a, a, causal=True, rng=0),\n"
        "                     lambda a: xattn.lara(a, a, a, num_samples=8, rng=0)):\n"
        "            torch.compile(call, fullgraph=True, backend='aot_eager')(x)"
        ".float().sum().backward()\n"
        "cached = [str(w.message) for w in caught if 'lru_cache' in str(w.message)]\n"
        "assert not cached, cached\n"
    )
    _run_in_a_fresh_process(script, timeout=300)


def _run_in_a_fresh_process(script, timeout):
    """Run ``script`` with this Python in a new process (its own imports and warnings);
    fail with its standard error if it fails."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
