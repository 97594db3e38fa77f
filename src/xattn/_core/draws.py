"""Host draws as requests, and the torch operators through which a compiled graph draws.

An int seed draws on the host (:class:`xattn.random.SeedGenerator`): each draw is a
*request*, a tuple of ints whose first number is its kind (:data:`NORMAL`,
:data:`UNIFORM`, or a kind that another module adds with :func:`add_host_kind`, such as
:mod:`xattn.features`' orthogonal samples), so that a compiled graph can carry it.
Inside ``torch.compile`` two operators draw (defined when torch is imported, since a
definition cannot be traced):

* ``xattn::seeded_draw(seed, requests)``: the last request's numbers from the seed,
  after the call's earlier requests replayed on the host: the eager call's numbers;
* ``xattn::generator_draw(handle, after, ...)``: draws of a ``torch.Generator`` (found by
  a number, as a generator cannot be a graph input), ordered after the draw ``after``,
  tagged ``nondeterministic_seeded`` so that the compiler neither merges nor recomputes
  them.

Only :mod:`xattn.random` uses this module; torch is imported by nobody here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from xattn._core.array import when_imported

__all__ = ["NORMAL", "UNIFORM", "add_host_kind", "host_draw", "request_shape",
           "torch_ops"]

NORMAL = 0
"""The kind of a request for standard normal draws, ``(NORMAL, *shape)``."""
UNIFORM = 1
"""The kind of a request for uniform draws on [0, 1), ``(UNIFORM, *shape)``."""

_HOST_KINDS: dict[int, tuple[Callable[[np.random.Generator, tuple[int, ...]], np.ndarray],
                             Callable[[tuple[int, ...]], tuple[int, ...]]]] = {}


def add_host_kind(kind: int, draw: Callable[[np.random.Generator, tuple[int, ...]],
                                            np.ndarray],
                  shape: Callable[[tuple[int, ...]], tuple[int, ...]]) -> None:
    """Add a kind of request: ``draw(generator, params)`` makes its float64 numbers from a
    NumPy generator, ``shape(params)`` their shape (``params``: the request after its
    kind)."""
    _HOST_KINDS[kind] = (draw, shape)


def host_draw(generator: np.random.Generator, request: tuple[int, ...]) -> np.ndarray:
    """One request's float64 numbers from the host ``generator``."""
    kind, *params = request
    if kind == NORMAL:
        return generator.standard_normal(tuple(params))
    if kind == UNIFORM:
        return generator.random(tuple(params))
    return _HOST_KINDS[kind][0](generator, tuple(params))


def request_shape(request: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a request's numbers."""
    kind, *params = request
    if kind in (NORMAL, UNIFORM):
        return tuple(params)
    return _HOST_KINDS[kind][1](tuple(params))


def _replay(seed: int, flat_requests: list[int]) -> np.ndarray:
    """The last of the requests (each its length, then itself) drawn from ``seed`` after
    the others, as the eager calls drew them."""
    generator = np.random.default_rng(seed)
    requests = _unflattened(flat_requests)
    for request in requests[:-1]:
        host_draw(generator, request)
    return host_draw(generator, requests[-1])


def _unflattened(flat_requests: list[int]) -> list[tuple[int, ...]]:
    """The requests of a flat list: each its length, then itself."""
    requests, index = [], 0
    while index < len(flat_requests):
        length = flat_requests[index]
        requests.append(tuple(flat_requests[index + 1:index + 1 + length]))
        index += 1 + length
    return requests


_GENERATORS: dict[int, Any] = {}
"""The ``torch.Generator`` objects drawn from inside ``torch.compile``, by ``id``: the graph
operation ``xattn::generator_draw`` names its generator by this number (a generator cannot
be an input of a graph). Held for the life of the process, so that a number is never
reused by another generator."""

_OPS: Any = None


def torch_ops() -> Any:
    """The torch operators through which a compiled graph draws."""
    if _OPS is None:
        raise RuntimeError(
            "xattn could not define its random-draw operators for torch.compile on this "
            f"torch ({_OPS_ERROR}); pass omega= (or proposal_means=), or draw with "
            "rng=xattn.random.TorchDefaultGenerator() inside the compiled function")
    return _OPS


_OPS_ERROR = "torch was not imported"


def _define_torch_ops(torch: Any) -> None:
    """Define the operators of :func:`_torch_ops`, once torch is imported (before any
    graph is traced: a definition cannot be traced). A torch that cannot define them
    (an old one) is left as it is: ``import torch`` never fails for xattn's sake."""
    global _OPS_ERROR
    try:
        _define_torch_ops_now(torch)
    except Exception as error:
        _OPS_ERROR = f"{type(error).__name__}: {error}"


def _define_torch_ops_now(torch: Any) -> None:
    global _OPS
    import types

    from torch.library import custom_op

    # explicit schemas: this module's annotations are strings (postponed evaluation)
    @custom_op("xattn::seeded_draw", mutates_args=(),
               schema="(SymInt seed, int[] requests) -> Tensor")
    def seeded_draw(seed: int, requests: list[int]) -> torch.Tensor:
        """The last request's float64 numbers from ``seed`` (:func:`_replay`)."""
        return torch.from_numpy(np.ascontiguousarray(_replay(seed, requests)))

    @seeded_draw.register_fake
    def _(seed, requests):
        shape = request_shape(_unflattened(requests)[-1])
        return torch.empty(shape, dtype=torch.float64)

    @custom_op("xattn::generator_draw", mutates_args=(),
               schema="(int handle, Tensor? after, bool uniform, int[] shape, ScalarType dtype, "
                      "Device device) -> Tensor",
               tags=(torch.Tag.nondeterministic_seeded,))
    def generator_draw(handle: int, after: torch.Tensor | None, uniform: bool,
                       shape: list[int], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """Draws of ``torch.Generator`` ``handle`` (``after`` the draw it follows), as
        :class:`xattn.random.TorchGenerator` draws them."""
        generator = _GENERATORS[handle]
        sample = torch.rand if uniform else torch.randn
        values = sample(tuple(shape), generator=generator,
                        dtype=dtype if dtype in (torch.float32, torch.float64) else torch.float32,
                        device=generator.device)
        return values.to(device=device, dtype=dtype)

    @generator_draw.register_fake
    def _(handle, after, uniform, shape, dtype, device):
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    # run when the graph is traced (dynamo calls it with the real generator; the number
    # it returns is a constant of the graph, which is guarded on the generator)
    register = torch._dynamo.assume_constant_result(_register_generator)
    _OPS = types.SimpleNamespace(seeded_draw=seeded_draw, generator_draw=generator_draw,
                                 register=register)


def _register_generator(generator: Any) -> int:
    """The number of ``generator`` in :data:`_GENERATORS`, where it is kept from now on."""
    _GENERATORS[id(generator)] = generator
    return id(generator)


when_imported("torch", _define_torch_ops)
