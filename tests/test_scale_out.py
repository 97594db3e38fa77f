"""Scaling out: Dask arrays chunked along the sequence, and JAX arrays sharded over devices.

* Dask: inputs chunked along N and M go through ``softmax_attention``, ``rfa`` and
  ``lara`` and must equal the NumPy results, on the synchronous scheduler and on a
  2-worker ``distributed.LocalCluster`` on loopback. A structural test runs the graph
  task by task and checks that no task ever holds more than two input chunks of the
  sequence (nothing gathers a whole sequence on one worker) and that the output stays
  chunked like the queries.
* JAX: in a subprocess with 4 forced host CPU devices, ``jax.jit`` of ``rfa`` and ``lara``
  on q, k, v sharded along the sequence equals the one-device result, comes back
  sharded the same way, and its compiled program moves no sequence-sized array between
  devices.

These tests run when "dask" (respectively "jax") is among the selected backends
(``XATTN_BACKENDS``, see ``conftest.py``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import xattn
from conftest import selected_backends

needs_dask = pytest.mark.skipif("dask" not in selected_backends(),
                                reason="dask is not among the selected backends")
needs_jax = pytest.mark.skipif("jax" not in selected_backends(),
                               reason="jax is not among the selected backends")

BATCH, NUM_QUERIES, NUM_KEYS, HEAD_DIM, VALUE_DIM = 2, 600, 500, 8, 5
QUERY_CHUNK, KEY_CHUNK = 100, 125  # 6 query chunks, 4 key chunks

# float64 throughout: the only differences to NumPy are the order of the chunked sums
RTOL, ATOL = 1e-10, 1e-12

# name -> call; every estimator gets its randomness from an int seed, an explicit
# omega or the deterministic mode, so NumPy and Dask see the same samples
OMEGA = np.random.default_rng(7).normal(size=(16, HEAD_DIM))
CALLS = {
    "softmax": lambda q, k, v, **kw: xattn.softmax_attention(q, k, v, chunk_size=200, **kw),
    "rfa_seed": lambda q, k, v, **kw: xattn.rfa(q, k, v, num_features=16, rng=3, **kw),
    "rfa_omega": lambda q, k, v, **kw: xattn.rfa(q, k, v, omega=_like(q, OMEGA), **kw),
    "lara_seed": lambda q, k, v, **kw: xattn.lara(q, k, v, num_samples=6, rng=5, **kw),
    "lara_deterministic": lambda q, k, v, **kw: xattn.lara(q, k, v, num_samples=6,
                                                           deterministic=True, **kw),
    # causal: blocks of positions as long as the query chunks keep the graph small
    "softmax_causal": lambda q, k, v, **kw: xattn.softmax_attention(
        q, k, v, causal=True, chunk_size=QUERY_CHUNK, **kw),
    "rfa_causal": lambda q, k, v, **kw: xattn.rfa(q, k, v, num_features=16, rng=3, causal=True,
                                                  block_size=QUERY_CHUNK, **kw),
}


def _like(q, host):
    """``host`` (NumPy) as an array of q's library, in one chunk for Dask."""
    if isinstance(q, np.ndarray):
        return host
    import dask.array as da

    return da.from_array(host)


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = 0.7 * rng.normal(size=(BATCH, NUM_QUERIES, HEAD_DIM))
    k = 0.7 * rng.normal(size=(BATCH, NUM_KEYS, HEAD_DIM))
    v = rng.normal(size=(BATCH, NUM_KEYS, VALUE_DIM))
    key_mask = rng.random((BATCH, NUM_KEYS)) < 0.9
    query_mask = rng.random((BATCH, NUM_QUERIES)) < 0.9
    return q, k, v, key_mask, query_mask


def chunked(q, k, v, key_mask=None, query_mask=None):
    """Dask arrays chunked along the sequence axes (batch and feature axes whole)."""
    import dask.array as da

    out = [da.from_array(q, chunks=(BATCH, QUERY_CHUNK, HEAD_DIM)),
           da.from_array(k, chunks=(BATCH, KEY_CHUNK, HEAD_DIM)),
           da.from_array(v, chunks=(BATCH, KEY_CHUNK, VALUE_DIM))]
    masks = {}
    if key_mask is not None:
        masks["key_mask"] = da.from_array(key_mask, chunks=(BATCH, KEY_CHUNK))
    if query_mask is not None:
        masks["query_mask"] = da.from_array(query_mask, chunks=(BATCH, QUERY_CHUNK))
    return out, masks


def mask_options(name, key_mask, query_mask):
    """The masks each estimator takes (LARA also takes query_mask)."""
    options = {"key_mask": key_mask}
    if name.startswith("lara"):
        options["query_mask"] = query_mask
    return options


@pytest.fixture(scope="module")
def dask_client():
    """A 2-worker LocalCluster on loopback, one thread each; closed after the module."""
    distributed = pytest.importorskip("distributed")
    environ = dict(os.environ)
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                                       dashboard_address=None, memory_limit="1GiB",
                                       processes=True)
    # not the default scheduler: other test modules keep computing locally
    client = distributed.Client(cluster, set_as_default=False)
    # the nannies set variables for the worker processes they started (PYTHONHASHSEED,
    # MALLOC_TRIM_THRESHOLD_, __DASK_PARENT_PID): this process's environment as it was
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)
    yield client
    client.close()
    cluster.close()


@needs_dask
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_dask_chunked_equals_numpy_sync(name, masked):
    q, k, v, key_mask, query_mask = make_inputs()
    options = mask_options(name, key_mask, query_mask) if masked else {}
    expected = CALLS[name](q, k, v, **options)
    (dq, dk, dv), dask_masks = chunked(q, k, v, **options)
    out = CALLS[name](dq, dk, dv, **dask_masks)
    assert out.chunks[-2] == dq.chunks[-2], "the output is not chunked like the queries"
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, rtol=RTOL, atol=ATOL)


@needs_dask
@pytest.mark.parametrize("name", sorted(CALLS))
def test_dask_chunked_equals_numpy_local_cluster(dask_client, name):
    q, k, v, key_mask, query_mask = make_inputs(seed=1)
    options = mask_options(name, key_mask, query_mask) if name.startswith("lara") else {}
    expected = CALLS[name](q, k, v, **options)
    (dq, dk, dv), dask_masks = chunked(q, k, v, **options)
    out = dask_client.compute(CALLS[name](dq, dk, dv, **dask_masks)).result()
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)


@needs_dask
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_dask_never_gathers_a_sequence(name, masked):
    """Run the graph task by task and record the shape of every intermediate block.

    The sequence axes are N = 600 and M = 500 long, split into chunks of 100 and 125;
    every other axis is at most 16 long. A block longer than two chunks along any axis
    would mean that some task gathered (a large part of) a sequence.
    """
    from dask.callbacks import Callback

    class BlockShapes(Callback):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def _posttask(self, key, result, dsk, state, worker_id):
            if hasattr(result, "shape"):
                self.shapes.append((key, tuple(result.shape)))

    q, k, v, key_mask, query_mask = make_inputs()
    options = mask_options(name, key_mask, query_mask) if masked else {}
    (dq, dk, dv), dask_masks = chunked(q, k, v, **options)
    out = CALLS[name](dq, dk, dv, **dask_masks)
    with BlockShapes() as recorder:
        persisted = out.persist(scheduler="sync")  # blocks stay apart: no final concatenate
    assert len(recorder.shapes) > 2 * len(dq.chunks[-2])  # the recorder did see the tasks
    largest = 2 * KEY_CHUNK
    too_large = [(key, shape) for key, shape in recorder.shapes if max(shape) > largest]
    assert not too_large, f"tasks with blocks longer than {largest}: {too_large[:5]}"
    assert persisted.chunks[-2] == dq.chunks[-2]
    assert max(persisted.chunks[-2]) == QUERY_CHUNK


JAX_SCRIPT = textwrap.dedent(r"""
    import json, os, re, sys
    # 4 host devices, first (XLA stops reading at a word without "--"); the caller's
    # flags kept: the suite's quick compiles (the report took 24 s without them)
    os.environ["XLA_FLAGS"] = " ".join(["--xla_force_host_platform_device_count=4", *(
        word for word in os.environ.get("XLA_FLAGS", "").split()
        if "force_host_platform_device_count" not in word)])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_enable_x64", True)  # this subprocess only; for the float64 runs
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    import xattn

    devices = jax.devices()
    sharding = NamedSharding(Mesh(np.array(devices), ("seq",)), PartitionSpec(None, "seq", None))
    rng = np.random.default_rng(0)
    host = [0.7 * rng.normal(size=(2, 256, 16)) for _ in range(3)]
    omega_host = rng.normal(size=(32, 16))
    calls = {
        "rfa_key": jax.jit(lambda q, k, v, key: xattn.rfa(q, k, v, num_features=32, rng=key)),
        "rfa_omega": jax.jit(lambda q, k, v, omega: xattn.rfa(q, k, v, omega=omega)),
        "lara_key": jax.jit(lambda q, k, v, key: xattn.lara(q, k, v, num_samples=8, rng=key)),
        "lara_deterministic": jax.jit(
            lambda q, k, v, _: xattn.lara(q, k, v, num_samples=8, deterministic=True)),
    }
    report = {"num_devices": len(devices)}
    collective = re.compile(
        r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")

    def largest_collective_dim(compiled_text):
        # longest axis of any array that a cross-device collective produces
        dims = [0]
        for line in compiled_text.splitlines():
            found = collective.search(line)
            if found:
                lhs = line[:found.start()]
                dims += [int(d) for shape in re.findall(r"\[([\d,]*)\]", lhs)
                         for d in shape.split(",") if d]
        return max(dims)

    dtype = sys.argv[1]
    one_device = [jnp.asarray(x, dtype=dtype) for x in host]
    sharded = [jax.device_put(x, sharding) for x in one_device]
    extra = {"rfa_key": jax.random.key(1), "lara_key": jax.random.key(2),
             "rfa_omega": jnp.asarray(omega_host, dtype=dtype), "lara_deterministic": 0}
    for name, call in calls.items():
        expected = np.asarray(call(*one_device, extra[name]))
        compiled = call.lower(*sharded, extra[name]).compile()  # run, and its text read
        out = compiled(*sharded, extra[name])
        report[f"{name}/{dtype}"] = {
            "max_abs_diff": float(np.max(np.abs(np.asarray(out) - expected))),
            "max_abs": float(np.max(np.abs(expected))),
            "dtype": str(out.dtype),
            "input_sharded": len(sharded[0].sharding.device_set) == len(devices),
            "same_sharding": bool(out.sharding.is_equivalent_to(sharding, out.ndim)),
            "spec": str(getattr(out.sharding, "spec", None)),
            "largest_collective_dim": largest_collective_dim(compiled.as_text()),
        }
    print("REPORT" + json.dumps(report))
""")


@functools.cache
def jax_sharded_report(dtype: str) -> dict:
    """:data:`JAX_SCRIPT`'s report for one dtype, in a subprocess of 4 host devices (one
    per dtype and pytest process: a worker runs only the dtypes of its tests)."""
    result = subprocess.run([sys.executable, "-c", JAX_SCRIPT, dtype],
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


# One-device and sharded runs differ only in how the sums over the sequence are split
# between devices: float32 rounding ~ sqrt(N) eps ~ 1e-6 relative, float64 ~ 1e-15.
JAX_TOLERANCE = {"float32": 1e-5, "float64": 1e-12}


@needs_jax
@pytest.mark.parametrize("dtype", sorted(JAX_TOLERANCE))
@pytest.mark.parametrize("name", ["rfa_key", "rfa_omega", "lara_key", "lara_deterministic"])
def test_jax_sharded_jit_equals_one_device(name, dtype):
    report = jax_sharded_report(dtype)
    assert report["num_devices"] == 4
    entry = report[f"{name}/{dtype}"]
    assert entry["input_sharded"]
    assert entry["dtype"] == dtype
    assert entry["max_abs_diff"] <= JAX_TOLERANCE[dtype] * max(1.0, entry["max_abs"]), entry
    assert entry["same_sharding"], f"output sharding {entry['spec']}, expected (None, 'seq', None)"
    # no collective moves sequence-sized data: each device holds 256 / 4 = 64 positions,
    # the collectives carry the (..., C or S, D or Dv) statistics and landmarks only
    assert 0 < entry["largest_collective_dim"] < 64, entry  # > 0: the sums do cross devices
