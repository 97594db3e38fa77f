"""Reading and validating the ``--input`` file of ``xattn compare``."""

from __future__ import annotations

import zipfile

import numpy as np

from xattn._array import broadcast_shapes
from xattn.cli.common import CommandError

__all__ = ["load_inputs"]


def load_inputs(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read and validate ``q``, ``k``, ``v`` from an ``.npz`` file (raises CommandError)."""
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise CommandError(f"{path}: not an .npz archive (save one with "
                               "numpy.savez(path, q=q, k=k, v=v))")
        with archive:
            missing = [name for name in ("q", "k", "v") if name not in archive.files]
            if missing:
                raise CommandError(f"{path}: missing array(s) {', '.join(missing)}; expected "
                                   f"q, k, v, found {', '.join(archive.files) or 'none'}")
            q, k, v = (archive[name] for name in ("q", "k", "v"))
    except CommandError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CommandError(f"{path}: cannot read it as an .npz file ({reason})") from None
    for name, array, shape in (("q", q, "(..., N, D)"), ("k", k, "(..., M, D)"),
                               ("v", v, "(..., M, Dv)")):
        if array.dtype.kind not in "fiu":
            raise CommandError(f"{path}: array {name} must be real numbers, got dtype "
                               f"{array.dtype}")
        if array.ndim < 2:
            raise CommandError(f"{path}: array {name} must have shape {shape} (rank >= 2), "
                               f"got shape {array.shape}")
        if array.size == 0:
            raise CommandError(f"{path}: array {name} is empty (shape {array.shape})")
        if not np.all(np.isfinite(array)):
            raise CommandError(f"{path}: array {name} contains NaN or inf")
    if q.shape[-1] != k.shape[-1]:
        raise CommandError(f"{path}: q and k must have the same last dim D, got shapes "
                           f"{q.shape} and {k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise CommandError(f"{path}: k and v must have the same number of keys M, got "
                           f"shapes {k.shape} and {v.shape}")
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise CommandError(f"{path}: the leading dims of q {q.shape}, k {k.shape} and "
                           f"v {v.shape} do not broadcast") from None
    return q, k, v
