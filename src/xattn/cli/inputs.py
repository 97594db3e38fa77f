"""Reading and validating the inputs of ``xattn compare`` (``--input`` files and the default).

An ``.npz`` file is read member by member with :mod:`zipfile`, and each ``.npy`` header is
checked before any data is read: a hostile file (a header that declares a huge shape, an
unsupported compression method, an encrypted member, a text file) is a usage error with
one line, never a MemoryError or a traceback. Values are validated *after* the cast to
the dtype of the run: finite values that overflow the dtype, or that are so large that
the estimators' squared norms overflow, are refused with the largest value and the limit.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from typing import Any

import numpy as np

from xattn.cli import memory
from xattn.cli.common import CommandError
from xattn.cli.memory import format_size
from xattn.diagnostics import check_attention_inputs

__all__ = ["largest_safe_value", "load_inputs", "validate_inputs"]

_NAMES = ("q", "k", "v")
_READABLE_COMPRESSION = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                         zipfile.ZIP_LZMA)
_NPZ_HINT = "save one with numpy.savez(path, q=q, k=k, v=v)"


def load_inputs(path: str, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read ``q``, ``k``, ``v`` from an ``.npz`` file, cast to ``dtype`` and validate them.

    Raises CommandError (one line) for every way the file can fail to load.
    """
    try:
        is_zip = zipfile.is_zipfile(path)
    except OSError as error:
        raise CommandError(f"{path}: cannot read it as an .npz file "
                           f"({error.strerror or type(error).__name__})") from None
    if not is_zip:
        try:
            with open(path, "rb"):
                pass
        except OSError as error:
            raise CommandError(f"{path}: cannot read it as an .npz file "
                               f"({error.strerror or type(error).__name__})") from None
        raise CommandError(f"{path}: not an .npz archive ({_NPZ_HINT})")
    try:
        with zipfile.ZipFile(path) as archive:
            members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
            missing = [name for name in _NAMES if name not in members]
            if missing:
                raise CommandError(f"{path}: missing array(s) {', '.join(missing)}; expected "
                                   f"q, k, v, found {', '.join(members) or 'none'}")
            arrays = [_read_member(path, archive, members[name], name) for name in _NAMES]
    except CommandError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError,
            RuntimeError, MemoryError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CommandError(f"{path}: cannot read it as an .npz file ({reason})") from None
    q, k, v = arrays
    return validate_inputs(q, k, v, dtype, path)


def _read_member(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo,
                 name: str) -> np.ndarray:
    where = f"{path}: array {name} ({info.filename})"
    if info.flag_bits & 0x1:
        raise CommandError(f"{where} is encrypted; save the arrays unencrypted ({_NPZ_HINT})")
    if info.compress_type not in _READABLE_COMPRESSION:
        # zipfile.compressor_names exists at runtime but typeshed leaves it out (undocumented)
        method = zipfile.compressor_names.get(  # type: ignore[attr-defined]
            info.compress_type, "unknown")
        raise CommandError(f"{where} uses compression method {info.compress_type} "
                           f"({method}), which cannot be read; use numpy.savez or "
                           "numpy.savez_compressed")
    with archive.open(info) as member:
        try:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(member)
            else:
                raise ValueError(f".npy format version {version} is not supported")
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error):
            raise  # the archive itself is damaged: reported by load_inputs
        except Exception as error:  # any parse error of a hostile header
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CommandError(f"{where} is not a valid .npy array ({reason})") from None
        header_bytes = member.tell()
        if dtype.hasobject:
            raise CommandError(f"{where} holds pickled (object) data; save real numbers")
        if dtype.kind not in "fiu":
            raise CommandError(f"{where} must be real numbers, got dtype {dtype}")
        data_bytes = math.prod(shape) * dtype.itemsize
        if data_bytes != info.file_size - header_bytes:
            raise CommandError(f"{where} declares shape {shape} and dtype {dtype} "
                               f"({format_size(data_bytes)}), but the file holds "
                               f"{format_size(max(info.file_size - header_bytes, 0))} of data")
        available = memory.host_memory_available()
        if available is not None and 2 * data_bytes > available:
            raise CommandError(f"{where} declares shape {shape} ({format_size(data_bytes)}), "
                               f"more than the memory available ({format_size(available)})")
    with archive.open(info) as member:
        return np.lib.format.read_array(member, allow_pickle=False)


def largest_safe_value(dtype: str, length: int) -> float:
    """The largest |value| accepted in ``dtype`` for sums over ``length`` terms.

    The estimators square the scaled inputs and sum products over D, M and the values,
    and the error figures square the residuals: every element squared, times the
    number of terms summed, must stay finite, with a margin of :math:`2^{40}` so that the
    error figures and the plot's log axis stay far from the largest float.

    Examples
    --------
    >>> from xattn.cli.inputs import largest_safe_value
    >>> f"{largest_safe_value('float32', 1024):.2e}"
    '5.50e+11'
    """
    return math.sqrt(float(np.finfo(dtype).max) / (2.0**40 * max(length, 1)))


def validate_inputs(q: Any, k: Any, v: Any, dtype: str,
                    source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cast NumPy ``q``, ``k``, ``v`` to ``dtype``; check shapes and values after it.

    The shapes are checked as every estimator checks its inputs (the errors listed
    under :func:`xattn.softmax_attention`), with ``source`` in front of the message.
    """
    arrays = {"q": q, "k": k, "v": v}
    for name, array in arrays.items():
        if array.dtype.kind not in "fiu":
            raise CommandError(f"{source}: array {name} must be real numbers, got dtype "
                               f"{array.dtype}")
    with np.errstate(over="ignore"):
        cast = {name: array.astype(dtype, copy=False) for name, array in arrays.items()}
    try:
        check_attention_inputs(cast["q"], cast["k"], cast["v"])
    except (ValueError, TypeError) as error:
        raise CommandError(f"{source}: {error}") from None
    for name, array in arrays.items():
        if array.size == 0:
            raise CommandError(f"{source}: array {name} is empty (shape {array.shape})")
        if not np.all(np.isfinite(array)):
            raise CommandError(f"{source}: array {name} contains NaN or inf")
    limit = largest_safe_value(dtype, max(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]))
    for name, array in arrays.items():
        largest = float(np.max(np.abs(array.astype(np.float64, copy=False))))
        if not np.all(np.isfinite(cast[name])):
            raise CommandError(f"{source}: array {name} overflows {dtype} (largest "
                               f"|value| {largest:.3g}, {dtype} holds up to "
                               f"{float(np.finfo(dtype).max):.3g}); rescale the inputs "
                               f"or use --dtype float64")
        if largest > limit:
            raise CommandError(f"{source}: array {name} holds values up to "
                               f"{largest:.3g}, too large for {dtype} (squared norms "
                               f"and sums overflow above about {limit:.3g} at these "
                               "sizes); rescale the inputs")
    return cast["q"], cast["k"], cast["v"]
