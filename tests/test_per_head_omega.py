"""Per-head samples: ``rfa(..., omega=)`` of shape ``(..., H, S, D)`` (one matrix per head,
or per layer and head) equals ``H`` calls, each with its head's ``(S, D)`` matrix.

Outputs on every backend (against the float64 NumPy reference of the per-head calls and,
in float32, against the backend's own per-head calls to 1e-6), and the gradients (q, k, v
and omega) on torch and JAX; causal or not, with a window and sinks, in blocks and groups
of a small working memory, through a state (a prefill, a piece, single decode steps),
split across devices (``sequence_parallel=``: JAX ``shard_map`` and torch ``gloo`` in
subprocesses), compiled whole by ``torch.compile(fullgraph=True)``; LARA's
``proposal_means`` of shape ``(H, C, D)`` likewise; and the refused shapes.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import xattn
from conftest import selected_backends

lazy_xp_modules = [xattn]  # JIT-compiled on JAX, no hidden compute on Dask (conftest)

B, H, N, D, DV, S = 2, 3, 13, 8, 5, 8
FEATURE_MAPS = ("positive", "hyperbolic", "trigonometric")

#: name -> options of the call (the sequence-level ones; omega is added)
CASES = {
    "plain": {},
    "groups": dict(chunk_size=4),  # keys and queries in groups of 4 rows
    "causal": dict(causal=True),
    "causal_blocks": dict(causal=True, block_size=4),
    "window_sinks": dict(window=2, sinks=1),
    "causal_window_sinks": dict(causal=True, window=2, sinks=1),
    "causal_window_sinks_blocks": dict(causal=True, window=2, sinks=1, working_memory=1 << 12),
}

AUTODIFF = ("torch", "torch-cuda", "jax", "jax-gpu")


def _data(seed: int = 0, spread: float = 0.6) -> list[np.ndarray]:
    """q, k (spread: their entries' scale), v and omega (H, S, D)."""
    rng = np.random.default_rng(seed)
    q, k = (spread * rng.normal(size=(B, H, N, D)) for _ in range(2))
    v = rng.normal(size=(B, H, N, DV))
    omega = rng.normal(size=(H, S, D))
    return [q, k, v, omega]


def _per_head(call, q, k, v, omega, xp):
    """``call`` once per head with that head's (S, D) samples, stacked on the head axis."""
    return xp.stack([call(q[:, h, ...], k[:, h, ...], v[:, h, ...], omega[h, ...])
                     for h in range(q.shape[1])],
                    axis=1)


def _rfa(feature_map, options):
    def call(q, k, v, omega):
        return xattn.rfa(q, k, v, omega=omega, feature_map=feature_map, **options)
    return call


def _assert_close_to_per_head(backend, out, per_head, reference, dtype):
    """``out`` equals the float64 reference to the dtype's tolerance and, in float32, the
    backend's own per-head calls to 1e-6 (relative to the largest entry)."""
    backend.check(out, reference, dtype=dtype)
    scale = max(1.0, float(np.max(np.abs(reference))))
    np.testing.assert_allclose(backend.to_numpy(out), backend.to_numpy(per_head),
                               rtol=0, atol=1e-6 * scale)


def _gradients(backend, call, arrays, weights):
    """The output and the gradients of ``sum(out * weights)`` with respect to ``arrays``
    (q, k, v, omega) on torch or JAX (under ``jax.jit``)."""
    if backend.name.startswith("torch"):
        import torch

        leaves = [x.detach().clone().requires_grad_(True) for x in arrays]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", xattn.TrigonometricDenominatorWarning)
            out = call(*leaves)
        grads = torch.autograd.grad((out * weights).sum(), leaves)
        return out, grads
    import jax
    import jax.numpy as jnp

    def loss(*leaves):
        out = call(*leaves)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        *arrays)
    return out, grads


@pytest.mark.thin(feature_map=("hyperbolic",), case=("plain", "causal_window_sinks_blocks"))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_per_head_omega_equals_per_head_calls(backend, feature_map, case):
    """Outputs (every backend) and gradients (torch, JAX) of one call with (H, S, D)
    samples equal H calls with (S, D) samples."""
    options = CASES[case]
    call = _rfa(feature_map, options)
    # small scores for the trigonometric map: its estimated normalizer stays away from 0
    # (where float32 and float64 clamp differently)
    data = _data(spread=0.3 if feature_map == "trigonometric" else 0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", xattn.TrigonometricDenominatorWarning)
        reference = _per_head(call, *data, np)
        arrays = [backend.asarray(x, backend.ns.float32) for x in data]
        out = call(*arrays)
        per_head = _per_head(call, *arrays, backend.ns)
    _assert_close_to_per_head(backend, out, per_head, reference, backend.ns.float32)
    if backend.name not in AUTODIFF:
        return
    weights = backend.asarray(np.cos(np.arange(N * DV)).reshape(N, DV), backend.ns.float32)
    _, grads = _gradients(backend, call, arrays, weights)
    _, separate = _gradients(backend, lambda *a: _per_head(call, *a, backend.ns), arrays,
                             weights)
    wide = [backend.asarray(x) for x in data]  # float64: the reference gradients
    _, exact = _gradients(backend, lambda *a: _per_head(call, *a, backend.ns), wide,
                          backend.asarray(np.cos(np.arange(N * DV)).reshape(N, DV)))
    for name, grad, one, best in zip("qkvw", grads, separate, exact, strict=True):
        grad, one, best = (backend.to_numpy(x) for x in (grad, one, best))
        scale = max(1.0, float(np.max(np.abs(best))))
        np.testing.assert_allclose(grad, one, rtol=0, atol=1e-6 * scale, err_msg=name)
        np.testing.assert_allclose(grad, best, rtol=0, atol=5e-5 * scale, err_msg=name)


@pytest.mark.thin(layout=("(1, H, S, D)",))
@pytest.mark.parametrize("layout", ["(1, H, S, D)", "(B, H, S, D)", "(B, 1, S, D)",
                                    "(S, D)"])
def test_leading_dims_broadcast_like_the_batch(backend, layout):
    """One matrix per head, per batch element and head, per batch element, or shared:
    each (b, h) uses the matrix its leading dims broadcast to."""
    q, k, v, _ = _data()
    rng = np.random.default_rng(1)
    shape = {"(1, H, S, D)": (1, H, S, D), "(B, H, S, D)": (B, H, S, D),
             "(B, 1, S, D)": (B, 1, S, D), "(S, D)": (S, D)}[layout]
    omega = rng.normal(size=shape)
    full = np.broadcast_to(omega, (B, H, S, D))
    options = dict(causal=True, window=2, sinks=1)
    reference = np.stack([np.stack([xattn.rfa(q[b, h], k[b, h], v[b, h], omega=full[b, h],
                                              **options) for h in range(H)])
                          for b in range(B)])
    q, k, v, omega = (backend.asarray(x) for x in (q, k, v, omega))
    out = xattn.rfa(q, k, v, omega=omega, **options)
    backend.check(out, reference, dtype=backend.ns.float64)


@pytest.mark.thin(feature_map=("positive",))
@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_state_and_decode_steps_with_per_head_omega(backend, feature_map, window):
    """A prefill with ``return_state``, a piece of 3 and single decode steps through
    ``state=`` equal one causal call of H per-head calls; the state keeps (H, S, D)."""
    q, k, v, omega = _data(2, spread=0.3 if feature_map == "trigonometric" else 0.6)
    options = dict(causal=True, feature_map=feature_map, window=window, sinks=1)
    reference = _per_head(_rfa(feature_map, dict(causal=True, window=window, sinks=1)),
                          q, k, v, omega, np)
    xq, xk, xv, xw = (backend.asarray(x, backend.ns.float32) for x in (q, k, v, omega))
    pieces = [(0, 6), (6, 9), *((n, n + 1) for n in range(9, N))]
    outs, state = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", xattn.TrigonometricDenominatorWarning)
        for start, stop in pieces:
            given = dict(omega=xw, **options) if state is None else dict(state=state,
                                                                         causal=True)
            out, state = xattn.rfa(xq[..., start:stop, :], xk[..., start:stop, :],
                                   xv[..., start:stop, :], return_state=True, **given)
            outs.append(out)
            state = backend.settled(state)
    assert tuple(state.omega.shape) == (H, S, D)
    backend.check(backend.ns.concat(outs, axis=-2), reference, dtype=backend.ns.float32)


@pytest.mark.thin(causal=(True,))
@pytest.mark.parametrize("causal", [False, True])
def test_lara_per_head_proposal_means_equal_per_head_calls(backend, causal):
    """LARA's ``proposal_means`` (H, C, D) already is per head: one call equals H calls
    with each head's (C, D) means (deterministic: the means are the samples)."""
    q, k, v, _ = _data(3)
    means = 0.3 * np.random.default_rng(4).normal(size=(H, 4, D))
    options = dict(num_samples=4, deterministic=True, causal=causal,
                   weighting="query_proposal" if causal else "decoupled")

    def call(q, k, v, mu):
        return xattn.lara(q, k, v, proposal_means=mu, **options)

    reference = _per_head(call, q, k, v, means, np)
    out = call(*(backend.asarray(x) for x in (q, k, v, means)))
    backend.check(out, reference, dtype=backend.ns.float64)


# ---- refused shapes -------------------------------------------------------------------

@pytest.mark.parametrize("shape, message", [
    ((4, S, D), r"omega must have shape \(S, D\) or \(\.\.\., S, D\) with leading dims that "
                r"broadcast against the leading \(batch, head\) dims \(2, 3\).*\(4, 8, 8\)"),
    ((B, H, 1, S, D), r"broadcast against the leading \(batch, head\) dims \(2, 3\)"),
    ((H, S, D + 1), r"omega must have shape \(S, D\) = \(S, 8\) or \(\.\.\., S, 8\)"),
    ((H, S, D), r"omega must have shape \(S, D\) = \(5, 8\) or \(\.\.\., 5, 8\)"),
    ((S,), r"omega must have shape \(S, D\)"),
])
def test_refused_shapes_name_omega_and_the_expected_shape(shape, message):
    q, k, v, _ = _data()
    extra = dict(num_features=5) if shape == (H, S, D) else {}
    with pytest.raises(ValueError, match=message):
        xattn.rfa(q, k, v, omega=np.ones(shape), **extra)
    with pytest.raises(ValueError, match=message):  # the causal path checks it too
        xattn.rfa(q, k, v, omega=np.ones(shape), causal=True, return_state=True, **extra)


def test_state_refuses_other_per_head_samples():
    q, k, v, omega = _data()
    _, state = xattn.rfa(q[..., :4, :], k[..., :4, :], v[..., :4, :], omega=omega,
                         causal=True, return_state=True)
    with pytest.raises(ValueError, match="omega"):
        xattn.rfa(q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], omega=omega[0], causal=True,
                  state=state)


# ---- torch.compile(fullgraph=True) -----------------------------------------------------

COMPILED = {
    "rfa": dict(),
    "causal-rfa-window-sinks": dict(causal=True, window=3, sinks=1),
    "causal-rfa-trigonometric": dict(causal=True, feature_map="trigonometric"),
}


@pytest.mark.skipif("torch" not in selected_backends(), reason="torch not selected")
@pytest.mark.parametrize("path", list(COMPILED))
def test_torch_compile_fullgraph_with_per_head_omega(path):
    """Compiled whole (``aot_eager``: dynamo and AOTAutograd trace forward and backward)
    with (H, S, D) samples: outputs and gradients (omega's too) equal eager."""
    torch = pytest.importorskip("torch")
    options = COMPILED[path]
    data = [torch.asarray(x, dtype=torch.float32) for x in _data(5)]

    def function(q, k, v, omega):
        return xattn.rfa(q, k, v, omega=omega, **options)

    def run(f):
        leaves = [x.clone().requires_grad_(True) for x in data]
        out = f(*leaves)
        return out, torch.autograd.grad((out ** 2).mean(), leaves)

    eager = run(function)
    torch._dynamo.reset()
    compiled = run(torch.compile(function, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif("torch" not in selected_backends(), reason="torch not selected")
def test_torch_compile_fullgraph_decode_step_with_per_head_omega():
    """The decode step of a state with (H, S, D) samples compiles whole and equals eager."""
    torch = pytest.importorskip("torch")
    q, k, v, omega = (torch.asarray(x, dtype=torch.float32) for x in _data(6))
    _, state = xattn.rfa(q[..., :8, :], k[..., :8, :], v[..., :8, :], omega=omega,
                         causal=True, window=2, sinks=1, return_state=True)

    def step(q, k, v, state):
        return xattn.rfa(q, k, v, causal=True, state=state, return_state=True)

    token = (q[..., 8:9, :], k[..., 8:9, :], v[..., 8:9, :])
    eager, eager_state = step(*token, state)
    torch._dynamo.reset()
    compiled, compiled_state = torch.compile(step, fullgraph=True, backend="aot_eager")(
        *token, state)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_state.feature_sums, eager_state.feature_sums,
                               rtol=1e-5, atol=1e-6)


# ---- sequence_parallel= -----------------------------------------------------------------

JAX_SCRIPT = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import xattn

    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    rows, replicated = P(None, None, "sp", None), P()
    rng = np.random.default_rng(0)
    B, H, N, D, DV, S = 1, 3, 32, 8, 5, 8
    data = [0.6 * rng.normal(size=(B, H, N, d)) for d in (D, D, DV)] + [
        rng.normal(size=(H, S, D))]
    weights = np.cos(np.arange(N * DV)).reshape(N, DV)
    report = {}
    for name, options in (("plain", {}), ("window_sinks", dict(window=3, sinks=2)),
                          ("trigonometric", dict(feature_map="trigonometric"))):
        def call(q, k, v, w, **extra):
            return xattn.rfa(q, k, v, omega=w, causal=True, **options, **extra)
        def per_head(q, k, v, w):
            return jnp.stack([call(q[:, h], k[:, h], v[:, h], w[h]) for h in range(H)], 1)
        parallel = jax.shard_map(lambda q, k, v, w: call(q, k, v, w, sequence_parallel="sp"),
                                 mesh=mesh, in_specs=(rows, rows, rows, replicated),
                                 out_specs=rows)
        def grads(f, dtype):
            w = jnp.asarray(weights, dtype)
            loss = lambda *a: jnp.sum(f(*a) * w)
            arrays = [jnp.asarray(x, dtype) for x in data]
            return jax.jit(f)(*arrays), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*arrays)
        exact_out, exact_grads = grads(per_head, jnp.float64)
        for dtype in (jnp.float32, jnp.float64):
            out, g = grads(parallel, dtype)
            scale = lambda a: max(1.0, float(np.max(np.abs(np.asarray(a)))))
            err = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64)
                                                   - np.asarray(b, np.float64)))) / scale(b)
            report[f"{name}/{np.dtype(dtype).name}"] = {
                "out": err(out, exact_out),
                "grad": max(err(a, b) for a, b in zip(g, exact_grads))}
    print("REPORT" + json.dumps(report))
""")

TORCH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist

    def main(out_dir, port, rank, world=2):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
        torch.set_num_threads(1)
        import xattn
        dist.init_process_group("gloo", rank=rank, world_size=world)
        generator = torch.Generator().manual_seed(0)
        B, H, N, D, DV, S = 1, 3, 20, 8, 5, 8
        q, k, v = (0.6 * torch.randn(B, H, N, d, generator=generator, dtype=torch.float64)
                   for d in (D, D, DV))
        omega = torch.randn(H, S, D, generator=generator, dtype=torch.float64)
        weights = torch.cos(torch.arange(N * DV, dtype=torch.float64)).reshape(N, DV)
        cut = [0, 9, N]
        start, stop = cut[rank], cut[rank + 1]
        report = {}
        for name, options in (("plain", {}), ("window_sinks", dict(window=3, sinks=2))):
            def call(q, k, v, w, **extra):
                return xattn.rfa(q, k, v, omega=w, causal=True, **options, **extra)
            for dtype in (torch.float32, torch.float64):
                leaves = [x.to(dtype).detach().clone().requires_grad_(True)
                          for x in (q, k, v, omega)]
                exact = torch.stack([call(leaves[0][:, h], leaves[1][:, h], leaves[2][:, h],
                                          leaves[3][h]) for h in range(H)], 1)
                (exact * weights.to(dtype)).sum().backward()
                pieces = [x.to(dtype)[..., start:stop, :].detach().clone().requires_grad_(True)
                          for x in (q, k, v)] + [omega.to(dtype).detach().clone()
                                                 .requires_grad_(True)]
                out = call(*pieces, sequence_parallel=dist.group.WORLD)
                (out * weights.to(dtype)[start:stop]).sum().backward()
                # omega is shared: its gradient is the sum of every rank's part
                omega_grad = pieces[3].grad.clone()
                dist.all_reduce(omega_grad)
                scale = lambda a: max(1.0, float(a.abs().max()))
                err = lambda a, b: float((a.double() - b.double()).abs().max()) / scale(b)
                report[f"{name}/{str(dtype)[6:]}"] = {
                    "out": err(out, exact[..., start:stop, :]),
                    "grad": max([err(a.grad, b.grad[..., start:stop, :])
                                 for a, b in zip(pieces[:3], leaves[:3])]
                                + [err(omega_grad, leaves[3].grad)])}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(report, handle)
        dist.destroy_process_group()

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
""")

#: float32 against the float64 per-head calls; float64 to rounding
PARALLEL_TOLERANCE = {"float32": 1e-5, "float64": 1e-10}


def _subprocess_env() -> dict[str, str]:
    words = [word for word in os.environ.get("XLA_FLAGS", "").split()
             if "force_host_platform_device_count" not in word]
    flags = ["--xla_force_host_platform_device_count=4",
             *sorted(words, key=lambda word: not word.startswith("--"))]
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                MKL_NUM_THREADS="1", XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")


def _check_parallel_report(report: dict) -> None:
    for name, entry in report.items():
        tolerance = PARALLEL_TOLERANCE[name.split("/")[1]]
        assert entry["out"] <= tolerance, (name, entry)
        assert entry["grad"] <= 10 * tolerance, (name, entry)


@pytest.mark.skipif("jax" not in selected_backends(), reason="jax not selected")
def test_jax_sequence_parallel_with_per_head_omega():
    """4 host devices under ``jax.shard_map``, omega (H, S, D) replicated: outputs and
    gradients (omega's too) equal the per-head calls on one device."""
    result = subprocess.run([sys.executable, "-c", JAX_SCRIPT], env=_subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT"))
    _check_parallel_report(json.loads(line[len("REPORT"):]))


@pytest.mark.skipif("torch" not in selected_backends(), reason="torch not selected")
def test_torch_sequence_parallel_with_per_head_omega(tmp_path: Path):
    """2 ``gloo`` ranks with pieces of 9 and 11 positions: each rank's outputs and
    gradients, and omega's gradient summed over the ranks, equal the per-head calls."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    script = tmp_path / "ranks.py"
    script.write_text(TORCH_SCRIPT)
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path), port, str(rank)],
                              env=_subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
             for rank in range(2)]
    try:
        outcomes = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    for rank, (_, stderr) in zip(ranks, outcomes, strict=True):
        assert rank.returncode == 0, stderr[-3000:]
    for rank in range(2):
        _check_parallel_report(json.loads((tmp_path / f"rank{rank}.json").read_text()))


# ---- layers and hooks --------------------------------------------------------------------

@pytest.mark.skipif("torch" not in selected_backends(), reason="torch not selected")
def test_torch_layer_per_head_features_assigned_loaded_redrawn_and_stepped():
    """``xattn.torch.MultiheadAttention``: features (num_heads, S, head_dim), assigned or
    loaded from a ``state_dict``, give each head its own samples (equal to the layer with
    that head's (S, head_dim)); ``step`` continues with them; a redraw keeps one matrix per
    head; a ``state_dict`` of another shape is refused naming ``features``."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    make = lambda: xattn.torch.MultiheadAttention(  # noqa: E731
        16, 4, estimator="rfa", num_features=8, batch_first=True, window=2, sinks=1).eval()
    layer, x = make(), torch.randn(2, 10, 16)
    omega = torch.randn(4, 8, 4)
    layer.features = omega
    with torch.no_grad():
        out, _ = layer(x, x, x, is_causal=True)
        q, k, v, _, _ = layer._split_heads(x, x, x, None)
        for h in range(4):  # head h equals a shared matrix omega[h]
            alone = layer._estimate(q, k, v, key_mask=None, causal=True, training=False,
                                    features=omega[h], rng=None)[:, h]
            shared = layer._estimate(q, k, v, key_mask=None, causal=True, training=False,
                                     features=omega, rng=None)[:, h]
            torch.testing.assert_close(shared, alone, rtol=0, atol=1e-6)
        first, state = layer.step(x[:, :6])
        second, state = layer.step(x[:, 6:7], state)
        third, state = layer.step(x[:, 7:], state)
    torch.testing.assert_close(torch.cat([first, second, third], 1), out, rtol=1e-5,
                               atol=1e-5)
    assert tuple(state.omega.shape) == (4, 8, 4)
    loaded = make()
    loaded.load_state_dict(layer.state_dict())
    assert torch.equal(loaded.features, omega)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, x, x, is_causal=True)[0], out)
    loaded.redraw_features()
    assert tuple(loaded.features.shape) == (4, 8, 4)
    assert not torch.equal(loaded.features[0], loaded.features[1])
    with pytest.raises(ValueError, match=r"features must have shape \(S, head_dim\)"):
        make().load_state_dict({**layer.state_dict(), "features": torch.randn(3, 8, 4)})


@pytest.mark.skipif("torch" not in selected_backends(), reason="torch not selected")
@pytest.mark.parametrize("num_beams", [1, 2])
def test_transformers_cache_with_per_head_features_and_grouped_heads(num_beams):
    """A Llama of 4 query heads and 2 key-value heads with fitted-like per-head samples
    (4, S, d) in each layer: greedy and beam-search generation through an ``XattnCache``
    (one state per query head) give, at every step, the logits of a full forward pass."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import xattn.transformers as xt

    attention = xt.register("test_per_head_omega_rfa", estimator="rfa", num_features=8,
                            window=2, sinks=1)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attention.name)
    prompt = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        shared = model(prompt).logits
    attention.fitted = {layer: 1.5 * torch.randn(4, 8, 8) for layer in range(2)}
    attention.clear_feature_cache()
    with torch.no_grad():
        assert not torch.allclose(model(prompt).logits, shared)  # the per-head samples
    cache_name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                  else "past_key_values")
    options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                   do_sample=False, num_beams=num_beams, output_logits=True,
                   return_dict_in_generate=True)
    generated = model.generate(prompt, **{cache_name: xt.XattnCache()}, **options)
    if num_beams > 1:  # the beams' states reordered along the batch: the tokens of
        # generation that recomputes every step from the whole sequence
        recomputed = model.generate(prompt, use_cache=False, **options)
        assert torch.equal(generated.sequences, recomputed.sequences)
        return
    with torch.no_grad():
        full = model(generated.sequences).logits
    for step, logits in enumerate(generated.logits):
        expected = full[:, prompt.shape[1] + step - 1]
        assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-4, step
