"""Write the intersphinx object inventories in ``docs/_inventories``.

The documentation builds offline, so intersphinx cannot download the projects'
``objects.inv``. Instead this script writes small inventories that hold exactly the
external names the xattn docs link to, each with its address in that project's docs.
To link a new external name, add it to ``TARGETS`` and run::

    python docs/_scripts/make_inventories.py          # rewrite docs/_inventories/*.inv
    python docs/_scripts/make_inventories.py --check  # exit 1 if a committed file is stale

With ``nitpicky = True`` in ``conf.py``, a reference to a name that is missing here
fails the ``-W`` build, so a missing entry is noticed.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

INVENTORY_DIR = Path(__file__).resolve().parents[1] / "_inventories"

#: project key -> (project name, base URL used in conf.py's intersphinx_mapping)
PROJECTS = {
    "python": ("Python", "https://docs.python.org/3/"),
    "numpy": ("NumPy", "https://numpy.org/doc/stable/"),
    "torch": ("PyTorch", "https://docs.pytorch.org/docs/stable/"),
    "jax": ("JAX", "https://docs.jax.dev/en/latest/"),
    "flax": ("Flax", "https://flax.readthedocs.io/en/stable/"),
    "dask": ("Dask", "https://docs.dask.org/en/stable/"),
    "distributed": ("Dask.distributed", "https://distributed.dask.org/en/stable/"),
    "cupy": ("CuPy", "https://docs.cupy.dev/en/stable/"),
    "array-api-compat": ("array-api-compat", "https://data-apis.org/array-api-compat/"),
}

#: project key -> [(name, "domain:role", uri relative to the base URL)]; a uri ending in
#: "$" is completed with the name, as in Sphinx's own inventories.
TARGETS: dict[str, list[tuple[str, str, str]]] = {
    "python": [
        ("bool", "py:class", "library/functions.html#$"),
        ("int", "py:class", "library/functions.html#$"),
        ("float", "py:class", "library/functions.html#$"),
        ("complex", "py:class", "library/functions.html#$"),
        ("object", "py:class", "library/functions.html#$"),
        ("callable", "py:function", "library/functions.html#$"),
        ("str", "py:class", "library/stdtypes.html#$"),
        ("tuple", "py:class", "library/stdtypes.html#$"),
        ("list", "py:class", "library/stdtypes.html#$"),
        ("dict", "py:class", "library/stdtypes.html#$"),
        ("slice", "py:class", "library/functions.html#$"),
        ("None", "py:data", "library/constants.html#$"),
        ("Ellipsis", "py:data", "library/constants.html#$"),
        ("True", "py:data", "library/constants.html#$"),
        ("False", "py:data", "library/constants.html#$"),
        ("Exception", "py:exception", "library/exceptions.html#$"),
        ("ValueError", "py:exception", "library/exceptions.html#$"),
        ("TypeError", "py:exception", "library/exceptions.html#$"),
        ("ImportError", "py:exception", "library/exceptions.html#$"),
        ("NotImplementedError", "py:exception", "library/exceptions.html#$"),
        ("Warning", "py:exception", "library/exceptions.html#$"),
        ("UserWarning", "py:exception", "library/exceptions.html#$"),
        ("RuntimeWarning", "py:exception", "library/exceptions.html#$"),
        ("warnings", "py:module", "library/warnings.html#module-warnings"),
        ("warnings.warn", "py:function", "library/warnings.html#$"),
        ("warnings.catch_warnings", "py:class", "library/warnings.html#$"),
        ("warnings.simplefilter", "py:function", "library/warnings.html#$"),
        ("tracemalloc", "py:module", "library/tracemalloc.html#module-tracemalloc"),
        ("dataclasses.dataclass", "py:function", "library/dataclasses.html#$"),
        ("typing.Any", "py:data", "library/typing.html#$"),
        ("collections.abc.Callable", "py:class", "library/collections.abc.html#$"),
        ("collections.abc.Sequence", "py:class", "library/collections.abc.html#$"),
        ("pathlib.Path", "py:class", "library/pathlib.html#$"),
        ("argparse.ArgumentParser", "py:class", "library/argparse.html#$"),
        ("doctest", "py:module", "library/doctest.html#module-doctest"),
        ("multiprocessing", "py:module", "library/multiprocessing.html#module-multiprocessing"),
    ],
    "numpy": [
        ("numpy", "py:module", "reference/index.html#module-numpy"),
        ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html#$"),
        ("numpy.dtype", "py:class", "reference/generated/numpy.dtype.html#$"),
        ("numpy.float16", "py:attribute", "reference/arrays.scalars.html#$"),
        ("numpy.float32", "py:attribute", "reference/arrays.scalars.html#$"),
        ("numpy.float64", "py:attribute", "reference/arrays.scalars.html#$"),
        ("numpy.asarray", "py:function", "reference/generated/numpy.asarray.html#$"),
        ("numpy.random.Generator", "py:class", "reference/random/generator.html#$"),
        ("numpy.random.default_rng", "py:function", "reference/random/generator.html#$"),
        ("numpy.random.SeedSequence", "py:class",
         "reference/random/bit_generators/generated/numpy.random.SeedSequence.html#$"),
        ("numpy.linalg.qr", "py:function", "reference/generated/numpy.linalg.qr.html#$"),
    ],
    "torch": [
        ("torch", "py:module", "torch.html#module-torch"),
        ("torch.Tensor", "py:class", "tensors.html#$"),
        ("torch.dtype", "py:class", "tensor_attributes.html#$"),
        ("torch.device", "py:class", "tensor_attributes.html#$"),
        ("torch.Generator", "py:class", "generated/torch.Generator.html#$"),
        ("torch.manual_seed", "py:function", "generated/torch.manual_seed.html#$"),
        ("torch.compile", "py:function", "generated/torch.compile.html#$"),
        ("torch.no_grad", "py:class", "generated/torch.no_grad.html#$"),
        ("torch.nn.Module", "py:class", "generated/torch.nn.Module.html#$"),
        ("torch.nn.Module.forward", "py:method", "generated/torch.nn.Module.html#$"),
        ("torch.nn.Module.state_dict", "py:method", "generated/torch.nn.Module.html#$"),
        ("torch.nn.Module.load_state_dict", "py:method", "generated/torch.nn.Module.html#$"),
        ("torch.nn.Module.train", "py:method", "generated/torch.nn.Module.html#$"),
        ("torch.nn.Module.eval", "py:method", "generated/torch.nn.Module.html#$"),
        ("torch.nn.Module.register_buffer", "py:method", "generated/torch.nn.Module.html#$"),
        ("torch.nn.MultiheadAttention", "py:class",
         "generated/torch.nn.MultiheadAttention.html#$"),
        ("torch.nn.MultiheadAttention.forward", "py:method",
         "generated/torch.nn.MultiheadAttention.html#$"),
        ("torch.nn.Dropout", "py:class", "generated/torch.nn.Dropout.html#$"),
        ("torch.nn.Linear", "py:class", "generated/torch.nn.Linear.html#$"),
        ("torch.get_rng_state", "py:function", "generated/torch.get_rng_state.html#$"),
        ("torch.set_default_dtype", "py:function", "generated/torch.set_default_dtype.html#$"),
        ("torch.randn", "py:function", "generated/torch.randn.html#$"),
        ("torch.nn.functional.scaled_dot_product_attention", "py:function",
         "generated/torch.nn.functional.scaled_dot_product_attention.html#$"),
        ("torch.optim.Optimizer", "py:class", "optim.html#$"),
    ],
    "jax": [
        ("jax", "py:module", "jax.html#module-jax"),
        ("jax.Array", "py:class", "_autosummary/jax.Array.html#$"),
        ("jax.jit", "py:function", "_autosummary/jax.jit.html#$"),
        ("jax.grad", "py:function", "_autosummary/jax.grad.html#$"),
        ("jax.value_and_grad", "py:function", "_autosummary/jax.value_and_grad.html#$"),
        ("jax.vmap", "py:function", "_autosummary/jax.vmap.html#$"),
        ("jax.device_put", "py:function", "_autosummary/jax.device_put.html#$"),
        ("jax.random.key", "py:function", "_autosummary/jax.random.key.html#$"),
        ("jax.random.PRNGKey", "py:function", "_autosummary/jax.random.PRNGKey.html#$"),
        ("jax.random.split", "py:function", "_autosummary/jax.random.split.html#$"),
        ("jax.numpy", "py:module", "jax.numpy.html#module-jax.numpy"),
        ("jax.numpy.where", "py:function", "_autosummary/jax.numpy.where.html#$"),
        ("jax.sharding.NamedSharding", "py:class", "jax.sharding.html#$"),
        ("jax.sharding.Mesh", "py:class", "jax.sharding.html#$"),
    ],
    "flax": [
        ("flax.nnx", "py:module", "api_reference/flax.nnx/index.html#module-flax.nnx"),
        ("flax.nnx.Module", "py:class", "api_reference/flax.nnx/module.html#$"),
        ("flax.nnx.MultiHeadAttention", "py:class",
         "api_reference/flax.nnx/nn/attention.html#$"),
        ("flax.nnx.LinearGeneral", "py:class", "api_reference/flax.nnx/nn/linear.html#$"),
        ("flax.nnx.Variable", "py:class", "api_reference/flax.nnx/variables.html#$"),
        ("flax.nnx.Param", "py:class", "api_reference/flax.nnx/variables.html#$"),
        ("flax.nnx.Rngs", "py:class", "api_reference/flax.nnx/rnglib.html#$"),
        ("flax.nnx.RngStream", "py:class", "api_reference/flax.nnx/rnglib.html#$"),
        ("flax.nnx.jit", "py:function", "api_reference/flax.nnx/transforms.html#$"),
        ("flax.nnx.view", "py:function", "api_reference/flax.nnx/graph.html#$"),
        ("flax.nnx.Cache", "py:class", "api_reference/flax.nnx/variables.html#$"),
        ("flax.nnx.MultiHeadAttention.init_cache", "py:method",
         "api_reference/flax.nnx/nn/attention.html#$"),
        ("flax.nnx.Optimizer", "py:class", "api_reference/flax.nnx/training/optimizer.html#$"),
    ],
    "dask": [
        ("dask.array", "py:module", "array-api.html#module-dask.array"),
        ("dask.array.Array", "py:class", "generated/dask.array.Array.html#$"),
        ("dask.array.from_array", "py:function", "generated/dask.array.from_array.html#$"),
        ("dask.array.random.default_rng", "py:function",
         "generated/dask.array.random.default_rng.html#$"),
        ("dask.compute", "py:function", "api.html#$"),
        ("dask.persist", "py:function", "api.html#$"),
    ],
    "distributed": [
        ("distributed.Client", "py:class", "api.html#$"),
        ("distributed.LocalCluster", "py:class", "api.html#$"),
    ],
    "cupy": [
        ("cupy.ndarray", "py:class", "reference/generated/cupy.ndarray.html#$"),
        ("cupy.random.Generator", "py:class", "reference/generated/cupy.random.Generator.html#$"),
    ],
    "array-api-compat": [
        ("array_api_compat.array_namespace", "py:function", "helper-functions.html#$"),
        ("array_api_compat.device", "py:function", "helper-functions.html#$"),
    ],
}


def inventory_bytes(project: str) -> bytes:
    """The ``objects.inv`` (version 2) content for one project of ``TARGETS``."""
    name, _ = PROJECTS[project]
    header = (f"# Sphinx inventory version 2\n# Project: {name}\n# Version: \n"
              "# The remainder of this file is compressed using zlib.\n").encode()
    lines = "".join(f"{obj} {role} 1 {uri} -\n" for obj, role, uri in sorted(TARGETS[project]))
    return header + zlib.compress(lines.encode(), 9)


def main(argv: list[str]) -> int:
    check = "--check" in argv[1:]
    stale = []
    for project in TARGETS:
        path = INVENTORY_DIR / f"{project}.inv"
        content = inventory_bytes(project)
        if check:
            if not path.is_file() or path.read_bytes() != content:
                stale.append(path.name)
        else:
            INVENTORY_DIR.mkdir(exist_ok=True)
            path.write_bytes(content)
    if stale:
        print(f"stale inventories (run {Path(__file__).name}): {', '.join(stale)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
