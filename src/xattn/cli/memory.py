"""Memory the command will need, estimated from its arguments, against what is available.

The estimates are deliberately simple upper-bound-style sums of the largest arrays each
estimator forms (see the estimators' docstrings for their intermediates); their purpose
is to refuse absurd sizes up front with a figure, instead of a MemoryError after minutes.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import numpy as np

import xattn
from xattn.cli.common import CommandError

__all__ = ["HOST_ITEMSIZE", "TRAINING_ATTENTION_BYTES", "Problem", "dataset_bytes",
           "format_size", "host_memory_available", "lara_bytes", "ra_bytes",
           "ra_training_bytes", "require_memory", "rfa_band_bytes", "rfa_bytes",
           "softmax_bytes", "softmax_training_bytes", "training_step_bytes"]

HOST_ITEMSIZE = 8  # the host draws (int seeds) and generated inputs are float64
# softmax's default chunk size, read from its signature (the one source)
_SOFTMAX_CHUNK = int(inspect.signature(xattn.softmax_attention).parameters["chunk_size"].default)
# the bytes of intermediates a block of RFA's causal scan, or a step of RA, may hold on a CPU
_CPU_BUDGET = xattn.default_working_memory(np.zeros(0))


@dataclass(frozen=True)
class Problem:
    """Sizes of one attention call: batch (product of leading dims), N, M, D, Dv, itemsize."""

    batch: int
    num_queries: int
    num_keys: int
    head_dim: int
    value_dim: int
    itemsize: int

    @property
    def input_bytes(self) -> int:
        """q, k and v on the device."""
        return self.itemsize * self.batch * (
            self.num_queries * self.head_dim + self.num_keys * (self.head_dim + self.value_dim))

    @property
    def output_bytes(self) -> int:
        return self.itemsize * self.batch * self.num_queries * self.value_dim


def softmax_bytes(problem: Problem, samples: int | None = None) -> int:
    """Exact softmax: N x chunk scores (chunk: its default ``chunk_size`` keys), the running
    sums, the output."""
    p = problem
    chunk = min(p.num_keys, _SOFTMAX_CHUNK)
    return p.itemsize * p.batch * p.num_queries * (3 * chunk + 2 * p.value_dim)


def rfa_bytes(problem: Problem, samples: int) -> int:
    """RFA: query and key features (N + M) x S, their logits, S x Dv sums, host omega; and
    causal RFA's chunked intermediates, which autograd keeps for the whole call: per
    position about 28 S numbers and the S x (Dv + 1) state of every chunk of 16."""
    p = problem
    device = p.itemsize * p.batch * (3 * (p.num_queries + p.num_keys) * samples
                                     + samples * p.value_dim + 2 * p.num_queries * p.value_dim
                                     + p.num_queries * (28 * samples
                                                        + 5 * samples * (p.value_dim + 1) // 16))
    return device + HOST_ITEMSIZE * samples * p.head_dim


def ra_bytes(problem: Problem, samples: int) -> int:
    """RA: steps of (query, sample) rows whose (rows, M) statistics (about six numbers and
    two booleans per row and key) fit its default ``working_memory`` (the CPU's, at most);
    the draws (N, S, D + 1) on the device and on the host."""
    p = problem
    statistics = p.batch * p.num_queries * samples * p.num_keys * (6 * p.itemsize + 2)
    device = min(statistics, _CPU_BUDGET) + p.itemsize * p.batch * (
        p.num_queries * samples * (p.head_dim + 1) + 2 * p.num_queries * p.value_dim)
    return device + HOST_ITEMSIZE * p.batch * p.num_queries * samples * (p.head_dim + 1)


def lara_bytes(problem: Problem, samples: int) -> int:
    """LARA: (N + M) x C logits and weights, C x (D + Dv) proposals and sums, host noise."""
    p = problem
    device = p.itemsize * p.batch * (3 * (p.num_queries + p.num_keys) * samples
                                     + samples * (p.head_dim + p.value_dim)
                                     + 2 * p.num_queries * p.value_dim)
    return device + HOST_ITEMSIZE * p.batch * samples * p.head_dim


def rfa_band_bytes(problem: Problem, window: int, sinks: int) -> int:
    """RFA's exact band (``window=w``, ``sinks=K``), block by block: each query's scores
    against its block, the ``2w + 1`` keys around it and the ``K`` sinks, with their
    exponentials and weights, as autograd keeps them (four arrays)."""
    p = problem
    if not window and not sinks:
        return 0
    # the band is computed in chunks of a power of two >= max(w, 16) queries against the
    # keys within w of the chunk
    chunk = max(16, 1 << max(window - 1, 0).bit_length())
    return 4 * p.itemsize * p.batch * p.num_queries * (chunk + 2 * window + 1 + sinks)


def ra_training_bytes(problem: Problem, samples: int) -> int:
    """RA under autograd: the backward pass keeps the (chunk, S, M) statistics of every
    chunk of queries, so (N, S, M) of each for the whole call; host noise (N, S, D)."""
    p = problem
    device = p.itemsize * p.batch * (4 * p.num_queries * samples * p.num_keys
                                     + 2 * p.num_queries * samples * p.head_dim
                                     + 2 * p.num_queries * p.value_dim)
    return device + HOST_ITEMSIZE * p.batch * p.num_queries * samples * (p.head_dim + 1)


def softmax_training_bytes(problem: Problem, samples: int | None = None) -> int:
    """Exact softmax under autograd: the backward pass keeps every chunk's scores and
    probabilities, so N x M of each (and the exponentials) for the whole call."""
    p = problem
    return p.itemsize * p.batch * (3 * p.num_queries * p.num_keys + 2 * p.num_queries
                                   * p.value_dim)


#: Intermediates of one attention call in a training step, by the layers' estimator name
#: (the forward estimates of the linear estimators hold every array the backward pass keeps;
#: the quadratic ones keep every chunk), and ``"native"``, the framework's own layer of
#: ``xattn train`` (exact softmax: softmax's estimate).
TRAINING_ATTENTION_BYTES = {"softmax": softmax_training_bytes, "rfa": rfa_bytes,
                            "ra": ra_training_bytes, "lara": lara_bytes,
                            "native": softmax_training_bytes}


def dataset_bytes(examples: int, length: int, fields: int, per_token: bool) -> int:
    """A task's arrays (:class:`xattn.training.tasks.Dataset`): int32 tokens (n, L, F), a bool
    mask (n, L) and int64 targets, (n, L) for per-position labels, else (n,)."""
    return examples * (length * (4 * fields + 1 + (8 if per_token else 0))
                       + (0 if per_token else 8))


def training_step_bytes(*, batch: int, length: int, dim: int, ffn: int, heads: int,
                        layers: int, estimator: str, samples: int, window: int = 0,
                        sinks: int = 0) -> int:
    """One training step of the ``xattn train`` model in float32: per layer, the
    activations autograd keeps (about 12 floats per token and model width, 4 per token
    and feed-forward width, a generous count for a pre-norm block) and the attention's
    intermediates (:data:`TRAINING_ATTENTION_BYTES`; RFA's exact band with ``window`` and
    ``sinks``, :func:`rfa_band_bytes`), with the heads as batch. No ``(L, L)`` mask: the
    xattn layers take ``is_causal=True`` (a caller that builds a mask adds it)."""
    head_dim = dim // heads
    problem = Problem(batch * heads, length, length, head_dim, head_dim, 4)
    attention = TRAINING_ATTENTION_BYTES[estimator](problem, samples)
    if estimator == "rfa":
        attention += rfa_band_bytes(problem, window, sinks)
    return layers * (4 * batch * length * (12 * dim + 4 * ffn) + attention)


def host_memory_available() -> int | None:
    """Bytes of host memory available (``MemAvailable``, else physical memory), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def format_size(value: float) -> str:
    """Bytes in binary units.

    Examples
    --------
    >>> from xattn.cli.memory import format_size
    >>> format_size(3 * 2**30), format_size(7.3e12), format_size(512)
    ('3.0 GiB', '6.6 TiB', '512 B')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def require_memory(needs: list[tuple[str, int]], available: int | None, where: str) -> None:
    """Raise CommandError naming the largest need when it exceeds ``available`` bytes.

    ``needs`` pairs a description (``"rfa with 1000000 samples"``) with its estimate.
    """
    if available is None or not needs:
        return
    label, need = max(needs, key=lambda item: item[1])
    if need > available:
        raise CommandError(f"{label} needs about {format_size(need)} (estimated from the "
                           f"sizes), more than the {format_size(available)} available on "
                           f"{where}; choose smaller sizes")
