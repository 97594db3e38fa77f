"""The foundation every estimator stands on: arrays, options, primitives and states.

- :mod:`~xattn._core.array`: the Array API namespace of the inputs, dtypes, devices,
  index helpers and the working-memory budget;
- :mod:`~xattn._core.inputs`: the checks of ``q, k, v`` and the masks
  (:func:`~xattn._core.inputs.prepare_attention`) and of samples and proposal means;
- :mod:`~xattn._core.delegation`: native fast paths of single operations (QR, the
  non-finite probes, the fused softmax kernels), each with its portable form;
- :mod:`~xattn._core.docstrings`: docstring text that several functions share, filled in
  at import;
- :mod:`~xattn._core.options`: the checks of every scalar option and the shared defaults;
- :mod:`~xattn._core.primitives`: stable shifts, the online-softmax merge, quarantine of
  non-finite rows;
- :mod:`~xattn._core.state`: the states that continue a causal sequence.

May import: the standard library, NumPy, array-api-compat and array-api-extra, and
nothing else of xattn. Backend-specific branches (torch, JAX, Dask, CuPy) live here in
``array``, ``inputs`` and ``delegation``, and in :mod:`xattn.random`; a concrete library
is only ever reached through the arrays it is given.
"""

__all__ = ["array", "delegation", "docstrings", "inputs", "options", "primitives", "state"]
