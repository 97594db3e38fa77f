"""Random-number adapter: one small protocol over every array library's generators.

Every randomized estimator in xattn draws through a :class:`Generator`, which makes
normal and uniform draws of a given shape and dtype in a given namespace and device.
The ``rng`` argument of the estimators accepts:

* ``None``: fresh entropy from the operating system (a :class:`HostGenerator`);
* an ``int`` seed: a :class:`SeedGenerator` (a :class:`HostGenerator` seeded with it).
  It draws on the host with NumPy in float64 and moves the numbers to the arrays'
  device, so **the same seed gives the same numbers on every backend** (exactly in
  float64, up to the rounding of the cast in lower precision), inside
  ``torch.compile(fullgraph=True)`` too;
* an xattn :class:`Generator` (for example from :func:`default_rng`, or
  :class:`TorchDefaultGenerator`, torch's global generator);
* a native generator, which draws where it lives: a :class:`numpy.random.Generator`, a
  :class:`torch.Generator` (on its device; inside ``torch.compile`` too), a JAX PRNG
  key (split for every draw; the way to draw inside :func:`jax.jit`), a
  ``cupy.random.Generator``, or a Dask ``dask.array.random.Generator``.

Inside ``torch.compile(fullgraph=True)`` an int seed and a ``torch.Generator`` draw
through two graph operations, ``xattn::seeded_draw`` and ``xattn::generator_draw``
(defined when torch is imported), that give the eager call's numbers; ``None`` draws from
torch's default generator there.

Array libraries are detected lazily: nothing here imports torch, JAX, CuPy or Dask
unless an object of theirs is passed in.
"""

from __future__ import annotations

import sys
from typing import Any

import array_api_compat
import numpy as np

from xattn._core.array import Array, compute_dtype, host_to_device, torch_compiling
from xattn._core.draws import NORMAL, UNIFORM, host_draw, torch_ops

__all__ = [
    "CupyGenerator",
    "DaskGenerator",
    "Generator",
    "HostGenerator",
    "JaxGenerator",
    "SeedGenerator",
    "TorchDefaultGenerator",
    "TorchGenerator",
    "as_generator",
    "default_rng",
]



class Generator:
    """Protocol of an xattn random-number generator.

    Subclasses implement :meth:`normal` and :meth:`uniform`. Both return an array of
    namespace ``xp``, of the given ``shape`` and real floating ``dtype``, on ``device``.
    """

    def normal(self, xp: Any, shape: tuple[int, ...], *, dtype: Any, device: Any = None) -> Array:
        """Standard normal draws N(0, 1)."""
        raise NotImplementedError

    def uniform(self, xp: Any, shape: tuple[int, ...], *, dtype: Any,
                device: Any = None) -> Array:
        """Uniform draws on [0, 1)."""
        raise NotImplementedError

    def _require(self, xp: Any, library: str, check: Any) -> None:
        if not check(xp):
            raise TypeError(
                f"rng is a {library} generator but the arrays come from {xp.__name__}; "
                "pass an int seed (portable across libraries) or a generator of the arrays' "
                "library"
            )


class HostGenerator(Generator):
    """Draws on the host with a :class:`numpy.random.Generator` and moves the result.

    Numbers are drawn in float64 and cast, so a given seed yields the same values in
    every namespace and on every device.

    Parameters
    ----------
    generator : numpy.random.Generator
        The host generator to draw from.

    Examples
    --------
    >>> import numpy as np
    >>> from xattn.random import HostGenerator
    >>> rng = HostGenerator(np.random.default_rng(0))
    >>> rng.normal(np, (2, 3), dtype=np.float64).shape
    (2, 3)
    """

    def __init__(self, generator: np.random.Generator):
        self.generator = generator

    def normal(self, xp, shape, *, dtype, device=None):
        return self.draw(xp, (NORMAL, *shape), dtype=dtype, device=device)

    def uniform(self, xp, shape, *, dtype, device=None):
        return self.draw(xp, (UNIFORM, *shape), dtype=dtype, device=device)

    def on_host(self, xp: Any) -> bool:
        """Whether draws for arrays of ``xp`` are made on the host (so that a composite
        draw, such as orthogonal samples, is best made there whole)."""
        return True

    def draw(self, xp: Any, request: tuple[int, ...], *, dtype: Any, device: Any = None) -> Array:
        """The host's float64 draw of ``request`` (a tuple of ints, its kind first, then
        the shape or the kind's parameters), in ``xp`` on ``device`` in ``dtype``."""
        host = host_draw(self.generator, request)
        return host_to_device(xp, host, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"HostGenerator({self.generator!r})"


class SeedGenerator(HostGenerator):
    """The generator of an int seed (or of ``None``, fresh entropy): a
    :class:`HostGenerator` on ``numpy.random.default_rng(seed)``, made at the first draw.

    Inside ``torch.compile`` a seed's draws are the same numbers, made by one graph
    operation per draw (``xattn::seeded_draw``): it replays the traced call's earlier
    requests from the seed on the host and returns the new one, so the graph holds no
    NumPy, and a seed that changes from call to call is an input of the graph (compiled
    once more, then never again), not a constant. (The int seed of each call makes a new
    generator; one generator object kept across compiled calls would draw the numbers of
    its first call again: pass the seed, not the object.) ``None`` there draws from torch's default
    generator (:class:`TorchDefaultGenerator`), fresh numbers as the eager call's are.

    Parameters
    ----------
    seed : int or None
        The seed of NumPy's ``default_rng``.
    """

    def __init__(self, seed: int | None):
        self.seed = seed
        self._generator: np.random.Generator | None = None
        self._requests: list[tuple[int, ...]] = []

    @property
    def generator(self) -> np.random.Generator:  # type: ignore[override]
        if self._generator is None:
            self._generator = np.random.default_rng(self.seed)
        return self._generator

    def on_host(self, xp: Any) -> bool:
        return not (self.seed is None and array_api_compat.is_torch_namespace(xp)
                    and torch_compiling())

    def draw(self, xp, request, *, dtype, device=None):
        if array_api_compat.is_torch_namespace(xp) and torch_compiling():
            if self.seed is None:  # fresh numbers: torch's own
                assert request[0] in (NORMAL, UNIFORM), "sample_omega asks on_host first"
                generator = TorchDefaultGenerator()
                sample = generator.normal if request[0] == NORMAL else generator.uniform
                return sample(xp, request[1:], dtype=dtype, device=device)
            self._requests.append(tuple(request))
            flat = [number for past in self._requests for number in (len(past), *past)]
            return torch_ops().seeded_draw(self.seed, flat).to(device=device, dtype=dtype)
        return super().draw(xp, request, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"SeedGenerator({self.seed!r})"


class TorchGenerator(Generator):
    """Draws with a :class:`torch.Generator` on its own device."""

    def __init__(self, generator: Any):
        self.generator = generator
        self._last: Any = None  # the last draw inside torch.compile: the next follows it

    def _draw(self, sample: Any, xp, shape, dtype, device):
        self._require(xp, "torch", array_api_compat.is_torch_namespace)
        if torch_compiling():  # a graph operation that draws from the generator
            handle = torch_ops().register(self.generator)
            import torch

            self._last = torch_ops().generator_draw(
                handle, self._last, sample is torch.rand, list(shape), dtype,
                self.generator.device if device is None else torch.device(device))
            return self._last
        draw_dtype = compute_dtype(xp, dtype)
        values = sample(tuple(shape), generator=self.generator, dtype=draw_dtype,
                        device=self.generator.device)
        return values.to(device=device, dtype=dtype)

    def normal(self, xp, shape, *, dtype, device=None):
        import torch

        return self._draw(torch.randn, xp, shape, dtype, device)

    def uniform(self, xp, shape, *, dtype, device=None):
        import torch

        return self._draw(torch.rand, xp, shape, dtype, device)

    def __repr__(self) -> str:
        return f"TorchGenerator(device={self.generator.device})"


class TorchDefaultGenerator(Generator):
    """Draws with torch's default generator of the target device (the global generator
    that :func:`torch.manual_seed` seeds): each draw advances it, and so changes
    ``torch.get_rng_state()`` (or the CUDA generator's state), as ``torch.nn.Dropout``
    does. The torch layers draw with it.

    Inside ``torch.compile`` inductor draws these numbers with its own generator (the
    eager numbers with ``torch._inductor.config.fallback_random = True``); an int seed or
    a :class:`torch.Generator` compiles to the eager numbers.

    Examples
    --------
    >>> import torch
    >>> import xattn
    >>> q = k = v = torch.ones(1, 8, 4)
    >>> attend = torch.compile(lambda q, k, v: xattn.ra(
    ...     q, k, v, rng=xattn.random.TorchDefaultGenerator()), fullgraph=True,
    ...     backend="aot_eager")
    >>> tuple(attend(q, k, v).shape)
    (1, 8, 4)
    """

    def normal(self, xp, shape, *, dtype, device=None):
        import torch

        self._require(xp, "torch", array_api_compat.is_torch_namespace)
        return torch.randn(tuple(shape), dtype=dtype, device=device)

    def uniform(self, xp, shape, *, dtype, device=None):
        import torch

        self._require(xp, "torch", array_api_compat.is_torch_namespace)
        return torch.rand(tuple(shape), dtype=dtype, device=device)

    def __repr__(self) -> str:
        return "TorchDefaultGenerator()"


class JaxGenerator(Generator):
    """Draws with a JAX PRNG key, splitting it for every draw (functional randomness).

    The adapter holds the current key and replaces it by a fresh split after each draw,
    so a key passed as an argument of a :func:`jax.jit`-compiled function is traced like
    any other input. Both typed keys (:func:`jax.random.key`) and raw ``uint32[2]`` keys
    (:func:`jax.random.PRNGKey`) are accepted.
    """

    def __init__(self, key: Any):
        self.key = key

    def _next_key(self, xp):
        import jax

        self._require(xp, "JAX", array_api_compat.is_jax_namespace)
        self.key, subkey = jax.random.split(self.key)
        return subkey

    def _place(self, values, device):
        import jax

        return values if device is None else jax.device_put(values, device)

    def normal(self, xp, shape, *, dtype, device=None):
        import jax

        return self._place(jax.random.normal(self._next_key(xp), tuple(shape), dtype), device)

    def uniform(self, xp, shape, *, dtype, device=None):
        import jax

        return self._place(jax.random.uniform(self._next_key(xp), tuple(shape), dtype), device)

    def __repr__(self) -> str:
        return "JaxGenerator(key)"


class CupyGenerator(Generator):
    """Draws with a ``cupy.random.Generator`` on the current CUDA device."""

    def __init__(self, generator: Any):
        self.generator = generator

    def _finish(self, values, dtype, device):
        import cupy

        with cupy.cuda.Device(device.id if device is not None else None):
            return cupy.asarray(values).astype(dtype, copy=False)

    def normal(self, xp, shape, *, dtype, device=None):
        self._require(xp, "CuPy", array_api_compat.is_cupy_namespace)
        draw_dtype = compute_dtype(xp, dtype)
        values = self.generator.standard_normal(tuple(shape), dtype=draw_dtype)
        return self._finish(values, dtype, device)

    def uniform(self, xp, shape, *, dtype, device=None):
        self._require(xp, "CuPy", array_api_compat.is_cupy_namespace)
        draw_dtype = compute_dtype(xp, dtype)
        values = self.generator.random(tuple(shape), dtype=draw_dtype)
        return self._finish(values, dtype, device)

    def __repr__(self) -> str:
        return "CupyGenerator()"


class DaskGenerator(Generator):
    """Draws lazily with a Dask ``Generator`` (or ``RandomState``), chunked by Dask."""

    def __init__(self, generator: Any, chunks: Any = "auto"):
        self.generator = generator
        self.chunks = chunks

    def normal(self, xp, shape, *, dtype, device=None):
        self._require(xp, "Dask", array_api_compat.is_dask_namespace)
        values = self.generator.standard_normal(size=tuple(shape), chunks=self.chunks)
        return values.astype(dtype)

    def uniform(self, xp, shape, *, dtype, device=None):
        self._require(xp, "Dask", array_api_compat.is_dask_namespace)
        values = self.generator.random(size=tuple(shape), chunks=self.chunks)
        return values.astype(dtype)

    def __repr__(self) -> str:
        return "DaskGenerator()"


def _is_jax_key(rng: Any) -> bool:
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(rng, jax.Array):
        return False
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return True
    return rng.dtype == np.uint32 and tuple(rng.shape) == (2,)


def _module_of(obj: Any) -> str:
    return type(obj).__module__.split(".")[0]


def as_generator(rng: Any) -> Generator:
    """Turn any accepted ``rng`` value into an xattn :class:`Generator`.

    This is the single entry point the estimators use. See the module docstring for
    the accepted values.

    Raises
    ------
    TypeError
        For anything else, naming the type received and the accepted ones.
    """
    if isinstance(rng, Generator):
        return rng
    if rng is None or (isinstance(rng, int | np.integer) and not isinstance(rng, bool)):
        if rng is not None and rng < 0:
            raise ValueError(f"rng seed must be a non-negative int, got {rng}")
        return SeedGenerator(rng if rng is None or isinstance(rng, int) else int(rng))
    if isinstance(rng, np.random.Generator):
        return HostGenerator(rng)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(rng, torch.Generator):  # traced by torch.compile
        return TorchGenerator(rng)
    module = _module_of(rng)
    if _is_jax_key(rng):
        return JaxGenerator(rng)
    if module == "cupy" and hasattr(rng, "standard_normal"):
        return CupyGenerator(rng)
    if module == "dask" and hasattr(rng, "standard_normal"):
        return DaskGenerator(rng)
    raise TypeError(
        "rng must be None, an int seed, an xattn.random.Generator, a numpy.random.Generator, "
        "a torch.Generator, a JAX PRNG key, a cupy.random.Generator or a Dask Generator; "
        f"got {type(rng).__module__}.{type(rng).__qualname__}"
    )


def default_rng(seed: int | None = None, *, like: Any = None) -> Generator:
    """Create an xattn random-number generator.

    Parameters
    ----------
    seed : int or None
        Seed; ``None`` takes fresh entropy from the operating system.
    like : array, optional
        Without ``like`` the generator is a portable :class:`HostGenerator`: it draws on
        the host, so a seed gives the same numbers on every backend. With an array
        ``like``, the generator is native to that array's library and device (a
        ``torch.Generator`` on the tensor's device, a JAX key, a CuPy or Dask generator),
        which avoids host transfers but gives library-specific streams. For NumPy and
        any other Array API library the host generator is used.

    Returns
    -------
    Generator

    Examples
    --------
    >>> import numpy as np
    >>> import xattn
    >>> rng = xattn.random.default_rng(0)
    >>> a = rng.normal(np, (3,), dtype=np.float64)
    >>> b = xattn.random.default_rng(0).normal(np, (3,), dtype=np.float64)
    >>> bool(np.all(a == b))
    True
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if array_api_compat.is_torch_array(like):
        import torch

        generator = torch.Generator(device=like.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(int(seed))
        return TorchGenerator(generator)
    if array_api_compat.is_jax_array(like):
        import jax

        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0])
        return JaxGenerator(jax.random.key(int(seed)))
    if array_api_compat.is_cupy_array(like):
        import cupy

        return CupyGenerator(cupy.random.default_rng(seed))
    if array_api_compat.is_dask_array(like):
        import dask.array

        return DaskGenerator(dask.array.random.default_rng(seed))
    if like is None or array_api_compat.is_array_api_obj(like):
        return as_generator(seed)  # NumPy and other libraries: draw on the host
    raise TypeError(
        "like must be an array (NumPy, PyTorch, JAX, CuPy, Dask, ...) or None, got "
        f"{type(like).__module__}.{type(like).__qualname__}"
    )
