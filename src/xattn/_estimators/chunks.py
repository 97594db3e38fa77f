r"""The chunkwise-parallel causal prefix: chunks of positions carried as a batch axis.

Causal random-feature attention needs, for every query :math:`n`, sums over the keys
:math:`m \le n`. Walking the positions one block at a time costs a number of array
operations that grows with the sequence (a kernel launch each on a GPU). The
chunkwise-parallel form (Katharopoulos et al., 2020; Hua et al., 2022; Yang et al., 2023)
cuts the sequence into chunks of ``b`` positions, carried as an axis ``(..., J, b, ·)``,
and needs a fixed number of operations for all of them:

1. **Per-chunk statistics**, one product for all chunks: the chunk's largest key
   shift :math:`K^j` and its sums :math:`A^j` (S, Dv + 1) rescaled by it (one maximum
   per chunk for the positive map, whose features are at most 1).
2. **The state before each chunk**, an exclusive prefix over the chunk axis
   (:func:`exclusive_prefix`). Its stabilizer may depend only on earlier chunks, so there
   is no one global frame: the prefix merges (maximum, rescaled sums) pairs,
   :math:`P_j = \max_{i < j} K^i` and :math:`H_j = \sum_{i < j} e^{K^i - P_j} A^i`,
   every weight at most 1 and from earlier chunks only, through a lower-triangular
   selection (a matrix product). Up to :data:`PREFIX_GROUP` parts this is
   one selection; more parts are merged in groups, recursively: the groups' own
   statistics, the prefix over the groups, then the prefix inside each group. The number
   of operations grows with :math:`\log_g J` (g = :data:`PREFIX_GROUP`), the work stays
   :math:`O(J g)` per sum.
3. **The exact pairs inside each chunk**, for all chunks at once: with a rank-one
   stabilizer (one shift per query and one per key, each from the tokens at or before
   it) every pair's term is a product of a query feature, a key feature and a factor
   that are all at most 1, so the pairs of a chunk are one (b, S) (S, b) matrix product
   times a (b, b) factor that is zero above the diagonal
   (:meth:`~xattn._estimators.feature_maps.PositiveMap.block`).

No stabilizer of a query depends on a key it does not attend, and masked entries are
selected away with ``where`` before any exponential, so no later key reaches an earlier
row's output or gradient.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from xattn._core.array import Array, one_chunk_along
from xattn._core.delegation import stop_gradient
from xattn._core.primitives import finite_shift

__all__ = ["PAIR_BLOCK", "PREFIX_GROUP", "PREFIX_GROUP_MAX", "chunk_layout",
           "exclusive_prefix", "padded_length", "prefix_group", "prefix_parts"]

PAIR_BLOCK = 64
"""The most positions per chunk: their query-key pairs are computed exactly, the
chunks before a query come to it through the prefix state. A block whose length is not a
multiple of it is cut into equal chunks a little shorter (:func:`chunk_layout`). 64, as
the head dimension of most models: the states before the chunks, S x (Dv + 1) numbers
per chunk, then weigh about as much as the inputs (Yang et al., 2023, chose the same for
their chunks)."""

PREFIX_GROUP = 8
"""Parts merged by one lower-triangular selection in :func:`exclusive_prefix` (fewest)."""

PREFIX_GROUP_MAX = 64
"""The largest group of parts :func:`exclusive_prefix` merges by one selection."""


def _merge_parts(xp: Any, part_max: Array, part_sums: Array, rows: int,
                 strict: bool = False) -> tuple[Array, Array]:
    """The statistics of the parts ``c <= j`` (``c < j`` if ``strict``) for ``j < rows``:
    parts along the last axis of ``part_max`` (..., P) and axis -2 of ``part_sums`` (...,
    P, E); returns (..., rows) and (..., rows, E), by
    :func:`~xattn._core.primitives.merge_maxima`'s rule through a lower-triangular selection
    (one matrix product per leading index). A row without parts has maximum ``-inf`` and
    sums 0."""
    device = array_api_compat.device(part_max)
    parts, row = xp.arange(part_max.shape[-1], device=device), xp.arange(rows, device=device)
    taken = (parts[None, :] < row[:, None]) if strict else (parts[None, :] <= row[:, None])
    taken_max = xp.where(taken, part_max[..., None, :], -xp.inf)  # (..., rows, P)
    merged_max = xp.max(taken_max, axis=-1)
    return merged_max, xp.exp(taken_max - finite_shift(xp, merged_max)[..., None]) @ part_sums


def prefix_group(num_parts: int) -> int:
    r"""The parts per group of :func:`exclusive_prefix` over ``num_parts`` parts (more than
    :data:`PREFIX_GROUP`): the smallest size from :math:`\lceil\sqrt{P}\,\rceil` (at least
    :data:`PREFIX_GROUP`) to :data:`PREFIX_GROUP_MAX` that divides P, so the parts are
    grouped without padding; when none does, :math:`\lceil\sqrt{P}\,\rceil` (the parts
    padded to whole groups)."""
    smallest = min(max(PREFIX_GROUP, math.isqrt(num_parts - 1) + 1), PREFIX_GROUP_MAX)
    for group in range(smallest, PREFIX_GROUP_MAX + 1):
        if num_parts % group == 0:
            return group
    return smallest


def prefix_parts(num_parts: int) -> int:
    """The fewest parts, at least ``num_parts``, that :func:`exclusive_prefix` groups without
    padding at every level (:func:`prefix_group`): a block padded to this many chunks
    (at most about 1 + 1/g more, g about the square root of the count) costs no copy of its
    chunks' sums inside the prefix."""
    parts = num_parts
    while parts > PREFIX_GROUP:
        group = prefix_group(parts)
        if parts % group == 0 and (parts // group <= group
                                   or prefix_parts(parts // group) == parts // group):
            return parts
        parts += 1
    return parts


def padded_length(length: int, chunk: int, multiple: int = 1) -> int:
    """The fewest positions, at least ``length``, in whole chunks of ``chunk`` positions
    (and a multiple of ``multiple``; both powers of two) whose chunks
    :func:`exclusive_prefix` groups without padding (:func:`prefix_parts`): the length a
    block is padded to, once, as its rows are read."""
    step = max(chunk, multiple)
    padded = -(-max(length, 1) // step) * step
    while prefix_parts(padded // chunk) != padded // chunk:
        padded += step
    return padded


def chunk_layout(length: int, largest: int) -> tuple[int, int]:
    """``(chunk, count)``: ``length`` positions in ``count`` chunks of ``chunk`` positions,
    none longer than ``largest``, padded by fewer than ``count`` positions.

    ``count`` is the fewest chunks of at most ``largest`` positions that
    :func:`exclusive_prefix` groups without padding (:func:`prefix_parts`) and ``chunk =
    ceil(length / count)``, so a length that is not a multiple of ``largest`` costs what
    its own positions cost, not those of a whole chunk more: 70 positions are two chunks
    of 35, 4,096 are 64 chunks of 64. The layout of ``chunk * count`` positions is the
    same one (the padded block is laid out as its unpadded length was).

    Examples
    --------
    >>> chunk_layout(70, 64), chunk_layout(4096, 64), chunk_layout(1, 64)
    ((35, 2), (64, 64), (1, 1))
    """
    count = prefix_parts(-(-max(length, 1) // largest))
    return -(-max(length, 1) // count), count


def _in_groups(xp: Any, x: Array, axis: int, group: int, fill: float) -> Array:
    """``x`` with its axis ``axis`` padded by ``fill`` to a multiple of ``group`` and split
    into (groups, group)."""
    axis = axis % x.ndim
    padding = -x.shape[axis] % group
    if padding:
        shape = list(x.shape)
        shape[axis] = padding
        x = one_chunk_along(xp.concat(
            [x, xp.full(tuple(shape), fill, dtype=x.dtype, device=array_api_compat.device(x))],
            axis=axis), axis)
    shape = list(x.shape)
    shape[axis:axis + 1] = [shape[axis] // group, group]
    return xp.reshape(x, tuple(shape))


def exclusive_prefix(xp: Any, carried: tuple[Array, Array] | None, part_max: Array,
                     part_sums: Array, single: int = PREFIX_GROUP,
                     ) -> tuple[Array, Array, tuple[Array, Array]]:
    r"""The (maximum, sums) state before each of P parts, and after all of them.

    Parameters
    ----------
    xp : namespace
    carried : (array (..., F), array (..., F, E)) or None
        The state before the first part: per feature its raw maximum (``-inf`` for no key)
        and its sums rescaled by it; None: no key before the first part.
    part_max : array (..., F, P)
        Each part's raw maximum per feature.
    part_sums : array (..., F, P, E)
        Each part's sums, rescaled by its maximum.
    single : int
        Up to this many parts, one selection.

    Returns
    -------
    before_max : array (..., F, P)
    before_sums : array (..., F, P, E)
        The merged state of ``carried`` and the parts ``i < j``, for every part ``j``.
    after : (array (..., F), array (..., F, E))
        The state after the last part.

    Notes
    -----
    Up to ``single`` parts, one selection over the P + 1 parts (``carried`` first). More
    parts are cut into groups of g parts (:func:`prefix_group`: the smallest divisor of P
    from :math:`\sqrt{P}` to :data:`PREFIX_GROUP_MAX`, :math:`\lceil\sqrt{P}\,\rceil`
    with the parts padded when none divides; at least :data:`PREFIX_GROUP`): their
    statistics, the prefix
    over the groups (this function again, on at most g parts: one selection while
    :math:`P \le` ``PREFIX_GROUP_MAX`` :sup:`2`), then inside each group one selection
    over the state before the group and the group's parts. So up to 4,096 parts (262,144
    positions in chunks of 64) the prefix is two selections, a fixed number of
    operations, and its work :math:`O(P g)` stays below the readout's.
    """
    num_parts = part_max.shape[-1]
    if num_parts <= single:
        if carried is None:  # row j: the parts i < j
            merged_max, merged_sums = _merge_parts(xp, part_max, part_sums, num_parts + 1,
                                                   strict=True)
        else:  # the carried state is part 0, part i is part i + 1: row j takes c <= j
            merged_max, merged_sums = _merge_parts(
                xp, xp.concat([carried[0][..., None], part_max], axis=-1),
                xp.concat([carried[1][..., None, :], part_sums], axis=-2), num_parts + 1)
        return (merged_max[..., :num_parts], merged_sums[..., :num_parts, :],
                (merged_max[..., num_parts], merged_sums[..., num_parts, :]))
    group = prefix_group(num_parts)
    grouped_max = _in_groups(xp, part_max, -1, group, -math.inf)  # (..., F, G, g)
    grouped_sums = _in_groups(xp, part_sums, -2, group, 0.0)  # (..., F, G, g, E)
    # the groups' own statistics (their maxima are constants: stabilizers)
    group_max = stop_gradient(xp.max(grouped_max, axis=-1))  # (..., F, G)
    group_weights = xp.exp(grouped_max - finite_shift(xp, group_max)[..., None])
    group_sums = (group_weights[..., None, :] @ grouped_sums)[..., 0, :]  # (..., F, G, E)
    before_group_max, before_group_sums, after = exclusive_prefix(
        xp, carried, group_max, group_sums, group)
    # inside each group: part 0 is the state before the group, part i + 1 its part i
    within_max, within_sums = _merge_parts(
        xp, xp.concat([before_group_max[..., None], grouped_max], axis=-1),
        xp.concat([before_group_sums[..., None, :], grouped_sums], axis=-2), group)
    lead, width = within_max.shape[:-2], within_sums.shape[-1]
    padded = within_max.shape[-2] * group
    before_max = xp.reshape(within_max, (*lead, padded))[..., :num_parts]
    before_sums = xp.reshape(within_sums, (*lead, padded, width))[..., :num_parts, :]
    return before_max, before_sums, after
