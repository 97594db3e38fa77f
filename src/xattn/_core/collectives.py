r"""The collectives of sequence (context) parallelism: a JAX mesh axis or a torch process group.

A causal call with ``sequence_parallel=`` (:func:`xattn.rfa`, :func:`xattn.lara`) holds one
contiguous piece of the sequence on each device and exchanges only fixed-size states
(:mod:`xattn._estimators.sequence`, the scheme of LASP: W. Sun et al., "Linear Attention
Sequence Parallelism", 2024, https://arxiv.org/abs/2404.02882). This module turns the
argument into a :class:`Group`: the device's index, the number of devices, the pieces'
lengths and a differentiable all-gather.

* **JAX**: the name of a mesh axis (a string, or a tuple of names) of an enclosing
  ``jax.shard_map`` over which the sequence axis is sharded; the gather is
  :func:`jax.lax.all_gather` to an array invariant over the axis, cast to device-varying
  where a device's own rows use it (the cast's transpose, one all-reduce of the gathered
  array's gradient, carries the gradients), the index :func:`jax.lax.axis_index`. The
  pieces have equal lengths (shard_map's blocks).
* **torch**: a :class:`torch.distributed.ProcessGroup` (``torch.distributed.group.WORLD``
  for all processes, once ``torch.distributed.init_process_group`` has run: before it,
  ``WORLD`` is ``None``, which :data:`NOT_GIVEN` tells apart from leaving the argument
  out); rank ``r`` of the group holds the ``r``-th piece. The pieces'
  lengths are exchanged first (one small all-gather of integers), so they may differ; the
  gather is :func:`torch.distributed.all_gather` in an autograd function whose backward
  all-reduces the gradient of the gathered array and keeps the rank's part.

JAX and torch are imported here only when such an argument is given, never when xattn is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xattn._core.array import Array, library_name

__all__ = ["NOT_GIVEN", "Group", "refuse_world_before_init", "resolve_group"]


class _NotGiven:
    """The type of :data:`NOT_GIVEN`: one instance, kept by copies and pickles."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<not given>"

    def __reduce__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN = _NotGiven()
"""The default of ``sequence_parallel``: left out, no sequence parallelism. Not ``None``,
because ``None`` is also what ``torch.distributed.group.WORLD`` is before
``torch.distributed.init_process_group``: a ``None`` given explicitly with torch tensors
while torch.distributed is not initialized is refused (:func:`refuse_world_before_init`)
rather than run as if each process's piece were the whole sequence."""


def refuse_world_before_init(sequence_parallel: Any, q: Any, estimator: str) -> None:
    """``ValueError`` for ``sequence_parallel=None`` given explicitly with torch tensors
    while ``torch.distributed`` is available but not initialized: then
    ``torch.distributed.group.WORLD`` is ``None`` as well, and the call cannot tell "no
    sequence parallelism" from "all processes" (one meant for many processes would run
    silently as if its piece were the whole sequence). Elsewhere an explicit ``None``
    means no sequence parallelism, as leaving the argument out does. Imports nothing."""
    if sequence_parallel is not None or not type(q).__module__.startswith("torch"):
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or dist.is_initialized():
        return
    raise ValueError(
        f"{estimator}(sequence_parallel=None): torch.distributed is not initialized; call "
        "torch.distributed.init_process_group first (before it, "
        "torch.distributed.group.WORLD is None, and this call would run as if this "
        "process's piece were the whole sequence). For no sequence parallelism leave "
        "sequence_parallel out, or pass False")


@dataclass(frozen=True)
class Group:
    """The devices that share one sequence, as the estimators use them."""

    rank: Any
    """This device's piece: an int (torch) or an integer scalar array (JAX, traced)."""
    size: int
    """The number of devices (pieces), at least 2."""
    lengths: tuple[int, ...]
    """The pieces' lengths, in order."""
    gather: Callable[[Array], Array]
    """``x`` (...) of every device, stacked in device order: (size, ...); differentiable.
    The same on every device (JAX: invariant over the axis)."""
    varying: Callable[[Array], Array]
    """A gathered array to be combined with what differs per device (JAX: cast to
    device-varying, so that its gradient is summed over the devices once, one all-reduce
    of the whole gathered array, not once per use); torch: the array itself."""
    described: str
    """The group in words, for error messages."""


def _is_axis_name(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return (isinstance(value, tuple) and len(value) > 0
            and all(isinstance(name, str) for name in value))


def _is_process_group(value: Any) -> bool:
    if not type(value).__module__.startswith("torch"):
        return False
    import torch.distributed as dist

    return isinstance(value, dist.ProcessGroup)


def _is_non_member(value: Any) -> bool:
    """Whether ``value`` is what ``torch.distributed.new_group`` returns on a rank outside
    the new group (``GroupMember.NON_GROUP_MEMBER``, an int)."""
    dist = sys.modules.get("torch.distributed")
    member = getattr(dist, "GroupMember", None)
    sentinel = getattr(member, "NON_GROUP_MEMBER", None)
    return (sentinel is not None and isinstance(value, int) and not isinstance(value, bool)
            and value == sentinel)


def resolve_group(sequence_parallel: Any, q: Array, length: int, estimator: str) -> Group:
    """The :class:`Group` of ``sequence_parallel`` for inputs like ``q`` holding ``length``
    positions of the sequence. ``TypeError`` for an argument that is neither a mesh axis
    name nor a process group, or that does not match the array library of ``q``;
    ``ValueError`` outside a ``jax.shard_map`` over that axis, for an uninitialized
    process group, and for a group of one device."""
    library = library_name(q)
    argument = f"{estimator}(sequence_parallel={sequence_parallel!r})"
    if _is_axis_name(sequence_parallel):
        if library != "jax":
            raise TypeError(f"{argument}: a mesh axis name needs JAX arrays inside jax.shard_map, "
                            f"but q is a {library} array; with torch pass a "
                            "torch.distributed ProcessGroup")
        group = _jax_group(sequence_parallel, length, argument)
    elif _is_non_member(sequence_parallel):
        raise ValueError(f"{argument}: this process is not a member of the group "
                         "(torch.distributed.new_group returned its non-member sentinel on "
                         "this rank); call the estimator only on the group's ranks")
    elif _is_process_group(sequence_parallel):
        if library != "torch":
            raise TypeError(f"{argument}: a torch.distributed ProcessGroup needs torch "
                            f"tensors, but q is a {library} array")
        group = _torch_group(sequence_parallel, q, length, argument)
    else:
        raise TypeError(
            f"{estimator}(sequence_parallel=...) takes the name of a JAX mesh axis (inside "
            "jax.shard_map) or a torch.distributed ProcessGroup, got "
            f"{type(sequence_parallel).__module__}.{type(sequence_parallel).__qualname__}")
    if group.size < 2:
        raise ValueError(f"{argument}: the group has one device; the whole sequence is on it, "
                         "leave sequence_parallel out")
    return group


def _jax_group(axis: Any, length: int, argument: str) -> Group:
    import jax

    try:
        size = int(jax.lax.axis_size(axis))
        rank = jax.lax.axis_index(axis)
    except NameError as error:
        raise ValueError(f"{argument}: no enclosing jax.shard_map has a mesh axis of that name "
                         f"({error}); call it inside jax.shard_map with the sequence axis "
                         "sharded over that mesh axis") from None

    typed = [True]  # whether this JAX has manual-axis types (invariant and varying arrays)

    def gather(x: Array) -> Array:
        # the same on every device ("invarying"): what only the gathered arrays make, the
        # state after the whole sequence, can leave shard_map replicated (out_specs P())
        try:
            return jax.lax.all_gather(x, axis, to="invarying")
        except TypeError:  # a JAX without manual-axis types: varying already
            typed[0] = False
            return jax.lax.all_gather(x, axis)

    def varying(x: Array) -> Array:
        if not typed[0]:
            return x
        cast = getattr(jax.lax, "pcast", None)
        if cast is not None:
            return cast(x, axis, to="varying")
        return jax.lax.pvary(x, axis)  # type: ignore[attr-defined]  # JAX before pcast

    return Group(rank, size, (length,) * size, gather, varying, f"mesh axis {axis!r}")


def _torch_group(group: Any, q: Array, length: int, argument: str) -> Group:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(f"{argument}: torch.distributed is not initialized "
                         "(torch.distributed.init_process_group)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{argument}: this process is not a member of the group")
    lengths: tuple[int, ...] = (length,)
    if size > 1:  # the pieces' lengths, on every rank (small, not differentiated)
        mine = torch.tensor([length], dtype=torch.int64, device=q.device)
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=group)
        lengths = tuple(int(x.item()) for x in every)

    def gather(x: Array) -> Array:
        return _TorchAllGather.apply(x, group, rank, size)

    return Group(rank, size, lengths, gather, lambda x: x, f"process group of {size} ranks")


def _torch_all_gather_class() -> Any:
    import torch
    import torch.distributed as dist

    class TorchAllGather(torch.autograd.Function):
        """All-gather stacked in rank order; backward: the all-reduced gradient's part of
        this rank (an all-reduce, which every backend has, in place of a reduce-scatter)."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any, rank: int, size: int) -> Any:
            ctx.group, ctx.rank = group, rank
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x, group=group)
            return torch.stack(parts)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
            return grad[ctx.rank], None, None, None

    return TorchAllGather


class _LazyTorchAllGather:
    """:meth:`apply` of the autograd function, defined when first used (torch imported)."""

    function: Any = None

    def apply(self, *args: Any) -> Any:
        if self.function is None:
            self.function = _torch_all_gather_class()
        return self.function.apply(*args)


_TorchAllGather = _LazyTorchAllGather()
