"""One causal sequence split across devices: ``sequence_parallel=`` of ``rfa`` and ``lara``.

* JAX, in subprocesses with 8 forced host CPU devices (the device count must be set
  before JAX starts): under ``jax.shard_map``, outputs, gradients and the returned state
  equal one device's call (float64; float32 in a second subprocess), a NaN reaches
  exactly the rows that attend it, the state after the whole sequence is the same on
  every device, and (a third subprocess) the program's collectives move a fixed number
  of bytes whatever N (counted in the lowered HLO, forward and backward). Each
  subprocess is its own test, so pytest-xdist spreads them over its workers; they keep
  the XLA flags of ``conftest.py`` (quick compiles: a third of the time without them).
* torch, 4 ``gloo`` processes on 127.0.0.1, started directly (no launcher importing
  torch): each rank's slice of the one-process outputs and gradients (pieces of equal
  and of unequal lengths, and as short as allowed), the state, a NaN, the refused setups,
  a sub-group of 3 (its members compute, the rank outside is told it is not a member),
  ``dist.group.WORLD`` before ``init_process_group`` refused.
* The refused setups, in this process where they can be.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import xattn
from conftest import selected_backends

needs_jax = pytest.mark.skipif("jax" not in selected_backends(),
                               reason="jax is not among the selected backends")
needs_torch = pytest.mark.skipif("torch" not in selected_backends(),
                                 reason="torch is not among the selected backends")

# the tolerances of one device's call against the pieces: relative to the largest entry
RTOL = {"float64": {"out": 1e-10, "grad": 1e-10}, "float32": {"out": 1e-5, "grad": 1e-4}}

CASES = {  # name -> options of the causal call (every case with a key mask)
    "rfa_positive": dict(estimator="rfa", num_features=16, rng=3),
    "rfa_trigonometric": dict(estimator="rfa", num_features=16, rng=3,
                              feature_map="trigonometric"),
    "rfa_hyperbolic": dict(estimator="rfa", num_features=8, rng=3, feature_map="hyperbolic"),
    "rfa_window_sinks": dict(estimator="rfa", num_features=16, rng=3, window=5, sinks=3),
    "rfa_trigonometric_window_sinks": dict(estimator="rfa", num_features=16, rng=3,
                                           feature_map="trigonometric", window=4, sinks=2),
    "lara": dict(estimator="lara", num_samples=6, rng=3, weighting="query_proposal",
                 proposal_means="means"),
}

JAX_SCRIPT = textwrap.dedent("""
    import json, os, re, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import xattn

    CASES = json.loads(os.environ["SP_CASES"])
    PART = sys.argv[1]
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Auto,))
    rows, seq = P(None, None, "sp", None), P(None, None, "sp")
    rng = np.random.default_rng(0)
    B, H, N, D, DV = 1, 2, 64, 8, 5
    data = [0.7 * rng.normal(size=(B, H, N, d)) for d in (D, D, DV)]
    mask = rng.random((B, H, N)) > 0.2
    means = 0.3 * rng.normal(size=(6, D))
    weights = np.cos(np.arange(N * DV)).reshape(N, DV)

    def call(options, q, k, v, key_mask, **extra):
        options = dict(options)
        estimator = getattr(xattn, options.pop("estimator"))
        if options.get("proposal_means") == "means":
            options["proposal_means"] = jnp.asarray(means, q.dtype)
        return estimator(q, k, v, key_mask=key_mask, causal=True, return_state=True,
                         **options, **extra)

    def loss_of(function, w):
        def loss(q, k, v, m):
            out, state = function(q, k, v, m)
            return jnp.sum(out * w), (out, state)
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.size == 0:
            return 0.0
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))

    JAX_CASES = ["rfa_window_sinks", "lara"]  # with the float32 case, every path
    compiled = {}

    def programs(name, dtype):  # compiled once per case and dtype (the NaN run reuses them)
        if (name, dtype) in compiled:
            return compiled[name, dtype]
        options = CASES[name]

        def piece(q, k, v, m):
            out, state = call(options, q, k, v, m, sequence_parallel="sp")
            return out, jax.tree.map(lambda x: x[None], state)  # one copy per device
        parallel = jax.shard_map(piece, mesh=mesh, in_specs=(rows, rows, rows, seq),
                                 out_specs=(rows, P("sp")))
        w = jnp.asarray(weights, dtype)
        compiled[name, dtype] = (jax.jit(loss_of(lambda *a: call(options, *a), w)),
                                 jax.jit(loss_of(parallel, jax.device_put(
                                     w, NamedSharding(mesh, P("sp", None))))))
        return compiled[name, dtype]

    def run(name, dtype, inputs):
        q, k, v = (jnp.asarray(x, dtype) for x in inputs)
        m = jnp.asarray(mask)
        whole, parallel = programs(name, dtype)
        (_, (ref, ref_state)), ref_grads = whole(q, k, v, m)
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        args = (put(q, rows), put(k, rows), put(v, rows), put(m, seq))
        (_, (out, states)), grads = parallel(*args)
        ref_leaves = jax.tree.leaves(ref_state)
        state_err = 0.0
        for device in range(8):
            for mine, theirs in zip(jax.tree.leaves(states), ref_leaves):
                mine, theirs = np.asarray(mine[device]), np.asarray(theirs)
                if mine.dtype == bool or mine.dtype.kind == "i":
                    state_err = max(state_err, float(np.any(mine != theirs)))
                else:
                    state_err = max(state_err, rel(mine, theirs))
        return {"out": rel(out, ref),
                "grad": max(rel(a, b) for a, b in zip(grads, ref_grads)),
                "state": state_err, "nan_rows_equal": bool(np.array_equal(
                    np.isnan(np.asarray(out)), np.isnan(np.asarray(ref)))),
                "finite_out": rel(np.nan_to_num(np.asarray(out)),
                                  np.nan_to_num(np.asarray(ref)))}

    report = {"devices": jax.device_count()}
    if PART == "float64":
        for name in JAX_CASES:
            report[name + "/float64"] = run(name, jnp.float64, data)
        poisoned = [x.copy() for x in data]
        poisoned[1][0, 1, 37, 2] = np.nan  # a key of piece 4, head 1 (unmasked: see below)
        mask[0, 1, 37] = True
        report["nan"] = run("rfa_window_sinks", jnp.float64, poisoned)  # the same programs

        # pieces of 8 positions cannot hold a window of 9 (refused while tracing)
        try:
            jax.eval_shape(jax.shard_map(
                lambda q, k, v: xattn.rfa(q, k, v, num_features=4, rng=0, causal=True,
                                          window=9, sequence_parallel="sp"),
                mesh=mesh, in_specs=(rows,) * 3, out_specs=rows), *data)
            report["short_window_error"] = ""
        except ValueError as error:
            report["short_window_error"] = str(error)

    if PART == "float32":
        report["rfa_trigonometric_window_sinks/float32"] = run(
            "rfa_trigonometric_window_sinks", jnp.float32, data)

    if PART == "bytes":
        # communication: the bytes of the collectives' results in the HLO
        collective = re.compile(r"\\b(all-reduce|all-gather|all-to-all|collective-permute|"
                                r"reduce-scatter)(-start)?\\(")
        shape = re.compile(r"\\b(f64|f32|s64|s32|pred)\\[([\\d,]*)\\]")
        size = {"f64": 8, "f32": 4, "s64": 8, "s32": 4, "pred": 1}

        def moved(text):
            total = count = 0
            for line in text.splitlines():
                found = collective.search(line)
                if found:
                    count += 1
                    for dtype, dims in shape.findall(line[:found.start()].split("=", 1)[-1]):
                        total += size[dtype] * int(np.prod([int(d) for d in dims.split(",")
                                                            if d]))
            return total, count

        S, DC = 16, 16
        for label, extra in (("plain", {}), ("window", dict(window=32, sinks=4))):
            def f(q, k, v, extra=extra):
                return xattn.rfa(q, k, v, num_features=S, rng=0, causal=True,
                                 sequence_parallel="sp", **extra)
            sm = jax.shard_map(f, mesh=mesh, in_specs=(rows,) * 3, out_specs=rows)
            grad = jax.grad(lambda q, k, v: jnp.sum(sm(q, k, v) ** 2), argnums=(0, 1, 2))
            for length in (4096, 32768):
                x = jax.ShapeDtypeStruct((1, 2, length, DC), jnp.float32,
                                         sharding=NamedSharding(mesh, rows))
                # the collectives are in the lowered program already (explicit under
                # shard_map): compiling it (the slow part, at 32k) is not needed to count
                report[f"bytes/{label}/{length}"] = {
                    "forward": moved(jax.jit(sm).lower(x, x, x).as_text("hlo")),
                    "forward_backward": moved(jax.jit(grad).lower(x, x, x).as_text("hlo"))}
    print("REPORT" + json.dumps(report))
""")


def _subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess: one thread for each library (the subprocesses
    run beside the pytest-xdist workers on few cores), and the quick-compile XLA flags
    that ``conftest.py`` put in ``XLA_FLAGS`` (kept, with the devices' count added).
    XLA reads ``XLA_FLAGS`` up to its first word without ``--`` (a pytest-xdist
    worker's has one): such words go last."""
    words = [word for word in os.environ.get("XLA_FLAGS", "").split()
             if "force_host_platform_device_count" not in word]
    flags = ["--xla_force_host_platform_device_count=8",
             *sorted(words, key=lambda word: not word.startswith("--"))]
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                MKL_NUM_THREADS="1", SP_CASES=json.dumps(CASES), **extra,
                XLA_FLAGS=" ".join(flags))


def _jax_report(part: str) -> dict:
    """One part of :data:`JAX_SCRIPT` in a subprocess of 8 host devices: ``float64`` (the
    cases, the NaN, a short window), ``float32`` or ``bytes``."""
    result = subprocess.run([sys.executable, "-c", JAX_SCRIPT, part],
                            env=_subprocess_env(JAX_PLATFORMS="cpu"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT"))
    report = json.loads(line[len("REPORT"):])
    assert report["devices"] == 8
    return report


def _assert_pieces_equal_one_device(report: dict, name: str) -> None:
    entry = report[name]
    tolerance = RTOL[name.split("/")[1]]
    assert entry["out"] <= tolerance["out"], (name, entry)
    assert entry["grad"] <= tolerance["grad"], (name, entry)
    # the state after the whole sequence, on every device (positions and flags exactly)
    assert entry["state"] <= tolerance["out"], (name, entry)


@needs_jax
def test_jax_pieces_equal_one_device_float64_nan_and_short_window() -> None:
    """rfa with a window and sinks, lara (float64); a NaN reaches exactly the rows that
    attend it; pieces shorter than the window are refused."""
    report = _jax_report("float64")
    for name in ("rfa_window_sinks/float64", "lara/float64"):
        _assert_pieces_equal_one_device(report, name)
    entry = report["nan"]
    assert entry["nan_rows_equal"], entry  # rows >= 37 of head 1, as on one device
    assert entry["finite_out"] <= 1e-10, entry
    assert "at least window" in report["short_window_error"]


@needs_jax
def test_jax_pieces_equal_one_device_float32() -> None:
    """The trigonometric map with a window and sinks, in float32."""
    _assert_pieces_equal_one_device(_jax_report("float32"),
                                    "rfa_trigonometric_window_sinks/float32")


@needs_jax
def test_jax_communication_does_not_grow_with_n() -> None:
    report = _jax_report("bytes")
    devices, features, value_dim, head_dim, heads = 8, 16, 16, 16, 2
    for label in ("plain", "window"):
        bound = devices * features * (value_dim + 2) * 4  # per head: the states' bytes
        if label == "window":  # the halo (w keys, values, validity) and the sinks
            bound += devices * (32 + 4) * (head_dim + value_dim + 1) * 4
        short, long = (report[f"bytes/{label}/{n}"] for n in (4096, 32768))
        for key, calls in (("forward", 1), ("forward_backward", 2)):  # backward: transpose
            assert long[key][0] <= 1.1 * short[key][0], (label, short, long)
            assert 0 < long[key][0] <= calls * heads * bound, (label, long, bound)
            assert long[key][1] == short[key][1], (label, short, long)  # as many collectives


TORCH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import torch
    import torch.distributed as dist

    CASES = json.loads(os.environ["SP_CASES"])
    # LARA's proposal means, the same in every rank (computed at import)
    MEANS = 0.3 * torch.randn(6, 8, generator=torch.Generator().manual_seed(5),
                              dtype=torch.float64)

    def call(options, q, k, v, key_mask, **extra):
        import xattn
        options = dict(options)
        estimator = getattr(xattn, options.pop("estimator"))
        if options.get("proposal_means") == "means":
            options["proposal_means"] = MEANS
        return estimator(q, k, v, key_mask=key_mask, causal=True, return_state=True,
                         **options, **extra)

    def rel(a, b, scale=None):
        # relative to the largest entry of scale (default b): a rank's slice of a gradient
        # is measured against the whole gradient (a piece of one position whose row only
        # reads its own key has a gradient of rounding noise against an exact 0 in q)
        a, b = a.detach().double(), b.detach().double()
        scale = b if scale is None else scale.detach().double()
        return float((a - b).abs().max() / scale.abs().max().clamp_min(1e-300))

    def worker(rank, world, port, out_dir, data):
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        torch.set_num_threads(1)
        import xattn
        q, k, v, mask, weights = data
        report = {}
        # before init_process_group, dist.group.WORLD is None: refused (it ran silently as
        # if each piece were the whole sequence)
        try:
            xattn.rfa(q[..., 8 * rank:8 * rank + 8, :], k[..., 8 * rank:8 * rank + 8, :],
                      v[..., 8 * rank:8 * rank + 8, :], num_features=4, rng=0, causal=True,
                      sequence_parallel=dist.group.WORLD)
            report["before_init"] = ""
        except ValueError as error:
            report["before_init"] = str(error)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # "short": pieces as short as the docs allow, forward and backward on every rank
        # (one position without a window; exactly the window, the first holding the sinks)
        bounds = {"equal": [8 * r for r in range(5)], "unequal": [0, 5, 14, 22, 32],
                  "short": [0, 1, 2, 31, 32], "window": [0, 5, 10, 27, 32]}
        runs = [(name, "equal") for name in CASES] + [
            ("rfa_window_sinks", "unequal"), ("lara", "unequal"), ("rfa_positive", "short"),
            ("rfa_trigonometric", "short"), ("lara", "short"), ("rfa_window_sinks", "window")]
        for name, split in runs:
            start, stop = bounds[split][rank], bounds[split][rank + 1]
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            ref, ref_state = call(CASES[name], *leaves, mask)
            (ref * weights).sum().backward()
            pieces = [x[..., start:stop, :].clone().requires_grad_(True) for x in (q, k, v)]
            out, state = call(CASES[name], *pieces, mask[..., start:stop],
                              sequence_parallel=dist.group.WORLD)
            (out * weights[start:stop]).sum().backward()
            mine = state.features if hasattr(state, "features") else state
            theirs = ref_state.features if hasattr(ref_state, "features") else ref_state
            report[f"{name}/{split}"] = {
                "out": rel(out, ref[..., start:stop, :]),
                "grad": max(rel(a.grad, b.grad[..., start:stop, :], b.grad)
                            for a, b in zip(pieces, leaves)),
                "state": max(rel(mine.feature_sums, theirs.feature_sums),
                             float(int(mine.position) != int(theirs.position)),
                             float(not torch.equal(mine.window_valid, theirs.window_valid)))}
        # a NaN key at position 13 (rank 1), head 0
        poisoned = k.clone()
        poisoned[0, 0, 13, 1] = float("nan")
        keep = mask.clone()
        keep[0, 0, 13] = True
        start, stop = 8 * rank, 8 * rank + 8
        ref, _ = call(CASES["rfa_window_sinks"], q, poisoned, v, keep)
        out, _ = call(CASES["rfa_window_sinks"], q[..., start:stop, :],
                      poisoned[..., start:stop, :], v[..., start:stop, :],
                      keep[..., start:stop], sequence_parallel=dist.group.WORLD)
        ref = ref[..., start:stop, :]
        report["nan"] = {"nan_rows_equal": bool(torch.equal(out.isnan(), ref.isnan())),
                         "finite_out": rel(out.nan_to_num(), ref.nan_to_num())}
        # refused: a group of one, a piece shorter than the window
        singles = [dist.new_group([r]) for r in range(world)]
        errors = []
        # pieces [10, 1, 10, 11] with two sinks, and [10, 0, 11, 11]: refused on every
        # rank before any collective but the lengths' (they ended in a gloo size mismatch,
        # and a hang at the backward of the empty piece)
        short = [0, 10, 11, 21, 32]
        empty = [0, 10, 10, 21, 32]
        for extra, cut in ((dict(sequence_parallel=singles[rank]), (start, stop)),
                           (dict(sequence_parallel=dist.group.WORLD, window=9), (start, stop)),
                           (dict(sequence_parallel=dist.group.WORLD, sinks=2),
                            (short[rank], short[rank + 1])),
                           (dict(sequence_parallel=dist.group.WORLD, sinks=1),
                            (empty[rank], empty[rank + 1]))):
            a, b = cut
            try:
                xattn.rfa(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                          num_features=4, rng=0, causal=True, **extra)
                errors.append("")
            except ValueError as error:
                errors.append(str(error))
        report["errors"] = errors
        # a sub-group of ranks 0-2 (item 4a): its members split the sequence among them and
        # get one process's outputs and gradients; rank 3, outside it, holds new_group's
        # int sentinel and is told it is not a member (it said "got builtins.int")
        trio = dist.new_group([0, 1, 2])
        cuts = [0, 10, 21, 32]
        if rank < 3:
            start, stop = cuts[rank], cuts[rank + 1]
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            ref, _ = call(CASES["rfa_window_sinks"], *leaves, mask)
            (ref * weights).sum().backward()
            pieces = [x[..., start:stop, :].clone().requires_grad_(True) for x in (q, k, v)]
            out, _ = call(CASES["rfa_window_sinks"], *pieces, mask[..., start:stop],
                          sequence_parallel=trio)
            (out * weights[start:stop]).sum().backward()
            report["sub_group"] = {
                "out": rel(out, ref[..., start:stop, :]),
                "grad": max(rel(a.grad, b.grad[..., start:stop, :], b.grad)
                            for a, b in zip(pieces, leaves))}
        else:
            try:
                xattn.rfa(q[..., :8, :], k[..., :8, :], v[..., :8, :], num_features=4,
                          rng=0, causal=True, sequence_parallel=trio)
                report["sub_group"] = ""
            except ValueError as error:
                report["sub_group"] = str(error)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(report, handle)
        dist.destroy_process_group()

    if __name__ == "__main__":  # one rank: out_dir, port, rank (the data: the same seed)
        generator = torch.Generator().manual_seed(0)
        q, k, v = (0.7 * torch.randn(1, 2, 32, d, generator=generator, dtype=torch.float64)
                   for d in (8, 8, 5))
        mask = torch.rand(1, 2, 32, generator=generator) > 0.2
        weights = torch.cos(torch.arange(32 * 5, dtype=torch.float64)).reshape(32, 5)
        worker(int(sys.argv[3]), 4, int(sys.argv[2]), sys.argv[1], (q, k, v, mask, weights))
""")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@needs_torch
def test_torch_ranks_equal_one_process(tmp_path: Path) -> None:
    """4 ranks, each its own process (no launcher importing torch as well): every case
    (pieces of equal and of unequal lengths, pieces of one position or of exactly the
    window), a NaN, the refused setups, ``dist.group.WORLD`` before
    ``init_process_group``, a sub-group of ranks 0-2 and rank 3 outside it."""
    script = tmp_path / "ranks.py"
    script.write_text(TORCH_SCRIPT)
    env = _subprocess_env()
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path), port, str(rank)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parent) for rank in range(4)]
    try:
        outcomes = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    for rank, (_, stderr) in zip(ranks, outcomes, strict=True):
        assert rank.returncode == 0, stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    names = [f"{case}/equal" for case in CASES] + [
        "rfa_window_sinks/unequal", "lara/unequal", "rfa_positive/short",
        "rfa_trigonometric/short", "lara/short", "rfa_window_sinks/window"]
    for rank, report in enumerate(reports):
        # item 4b: before init_process_group (dist.group.WORLD is None), refused
        assert "torch.distributed is not initialized" in report["before_init"], report
        assert "sequence_parallel=None" in report["before_init"], report
        # item 4a: the sub-group's members compute, the rank outside it is told so
        if rank < 3:
            assert report["sub_group"]["out"] <= 1e-10, report["sub_group"]
            assert report["sub_group"]["grad"] <= 1e-10, report["sub_group"]
        else:
            assert "not a member of the group" in report["sub_group"], report["sub_group"]
        for name in names:
            entry = report[name]
            assert entry["out"] <= 1e-10, (name, entry)
            assert entry["grad"] <= 1e-10, (name, entry)
            assert entry["state"] <= 1e-10, (name, entry)
        assert report["nan"]["nan_rows_equal"], report["nan"]
        assert report["nan"]["finite_out"] <= 1e-10, report["nan"]
        one, short, sinks, empty = report["errors"]
        assert "one device" in one, one
        assert "at least window" in short, short
        assert "at least sinks positions" in sinks and "piece(s) [1]" in sinks, sinks
        assert "at least one position" in empty and "piece(s) [1]" in empty, empty


# ---- refused setups, in this process ------------------------------------------------

def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(2, 8, 4)), rng.normal(size=(2, 8, 4)), rng.normal(size=(2, 8, 3))


@pytest.mark.parametrize("estimator", ["rfa", "lara"])
def test_non_causal_is_refused(estimator: str) -> None:
    q, k, v = _inputs()
    options = dict(num_features=4) if estimator == "rfa" else dict(num_samples=4)
    with pytest.raises(ValueError, match="needs causal=True"):
        getattr(xattn, estimator)(q, k, v, rng=0, sequence_parallel="sp", **options)


def test_state_with_sequence_parallel_is_refused() -> None:
    q, k, v = _inputs()
    _, state = xattn.rfa(q, k, v, num_features=4, rng=0, causal=True, return_state=True)
    with pytest.raises(ValueError, match="state= is not supported"):
        xattn.rfa(q, k, v, causal=True, state=state, sequence_parallel="sp")


def test_unknown_argument_and_wrong_library_are_refused() -> None:
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="mesh axis"):
        xattn.rfa(q, k, v, num_features=4, rng=0, causal=True, sequence_parallel=3)
    with pytest.raises(TypeError, match="needs JAX arrays"):
        xattn.rfa(q, k, v, num_features=4, rng=0, causal=True, sequence_parallel="sp")


@needs_jax
def test_jax_axis_outside_shard_map_and_group_of_one() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, PartitionSpec

    q, k, v = (jnp.asarray(x) for x in _inputs())
    with pytest.raises(ValueError, match=r"no enclosing jax\.shard_map"):
        xattn.rfa(q, k, v, num_features=4, rng=0, causal=True, sequence_parallel="sp")
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(AxisType.Auto,))
    rows = PartitionSpec(None, "sp", None)
    alone = jax.shard_map(lambda q, k, v: xattn.rfa(q, k, v, num_features=4, rng=0,
                                                    causal=True, sequence_parallel="sp"),
                          mesh=mesh, in_specs=(rows,) * 3, out_specs=rows)
    with pytest.raises(ValueError, match="one device"):
        jax.eval_shape(alone, q, k, v)  # refused while tracing: nothing to run


@needs_torch
def test_a_rank_outside_a_torch_sub_group_is_told_so() -> None:
    """On a rank outside it, ``torch.distributed.new_group`` returns an int sentinel, not
    a group: the call says the rank is not a member (it said "got builtins.int")."""
    import torch
    import torch.distributed as dist

    q, k, v = (torch.asarray(x) for x in _inputs())
    with pytest.raises(ValueError, match="not a member of the group"):
        xattn.rfa(q, k, v, num_features=4, rng=0, causal=True,
                  sequence_parallel=dist.GroupMember.NON_GROUP_MEMBER)


@needs_torch
def test_torch_world_before_init_is_refused_and_leaving_it_out_is_not() -> None:
    """Before ``init_process_group``, ``dist.group.WORLD`` is ``None``: with torch tensors
    an explicit ``None`` is refused (it ran as if this piece were the whole sequence);
    left out, ``False``, or ``None`` with other arrays: one device."""
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized()
    q, k, v = (torch.asarray(x) for x in _inputs())
    for estimator, options in (("rfa", dict(num_features=4)),
                               ("lara", dict(num_samples=4, proposal="standard",
                                             weighting="balance"))):
        function = getattr(xattn, estimator)
        with pytest.raises(ValueError, match=r"torch\.distributed is not initialized; call "
                                             r"torch\.distributed\.init_process_group first"):
            function(q, k, v, rng=0, causal=True, sequence_parallel=dist.group.WORLD,
                     **options)
        alone = function(q, k, v, rng=0, causal=True, **options)
        assert torch.equal(function(q, k, v, rng=0, causal=True, sequence_parallel=False,
                                    **options), alone)
    numpy_q, numpy_k, numpy_v = _inputs()
    assert np.array_equal(
        xattn.rfa(numpy_q, numpy_k, numpy_v, num_features=4, rng=0, causal=True,
                  sequence_parallel=None),
        xattn.rfa(numpy_q, numpy_k, numpy_v, num_features=4, rng=0, causal=True))


@needs_torch
def test_torch_tensors_with_a_mesh_axis_are_refused() -> None:
    import torch

    q, k, v = (torch.asarray(x) for x in _inputs())
    with pytest.raises(TypeError, match="needs JAX arrays"):
        xattn.rfa(q, k, v, num_features=4, rng=0, causal=True, sequence_parallel="sp")
