"""The Keras half of :class:`xattn.keras.MultiHeadAttention` that is not the layer itself.

* **The backend check** (:func:`check_backend`): the layer computes with the backend's own
  tensors through their Array API namespace, which JAX arrays and torch tensors have and
  TensorFlow tensors do not.
* **The random source** (:class:`KerasGenerator`): xattn's :class:`~xattn.random.Generator`
  protocol over ``keras.random`` with a ``keras.random.SeedGenerator``, whose state is a
  Keras variable, so that draws advance under ``jit`` in ``model.fit`` on JAX as in eager
  torch.
* **Masks** (:func:`key_padding_mask`): Keras's ``attention_mask`` ``(B, T, S)`` (True =
  attend) translated exactly into xattn's ``key_mask`` where it is one; ``ValueError`` for
  a mask that is not (where its values can be read).
* **Projections** (:func:`projection_equations`, :func:`masks_detached`): the einsum equations of
  ``keras.layers.MultiHeadAttention``'s projections, for inputs ``(B, L, dim)``.

Framework code (it imports Keras), kept apart from ``xattn/keras.py`` so that the layer
module stays short; loaded with :mod:`xattn.keras`.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator
from typing import Any

import array_api_compat
import keras

# The mask attribute of a backend tensor (in a weak dictionary for JAX arrays), which
# keras does not export: Keras's own MultiHeadAttention clears it with set_keras_mask.
from keras.src.backend import get_keras_mask, set_keras_mask

from xattn._core.array import Array, concrete_count
from xattn.random import Generator

__all__ = ["SUPPORTED_BACKENDS", "KerasGenerator", "backend_namespace", "check_backend",
           "key_padding_mask", "masks_detached", "projection_equations"]

SUPPORTED_BACKENDS = ("jax", "torch")
"""The Keras backends whose tensors have an Array API namespace."""


def check_backend(backend: str | None = None) -> str:
    """The Keras backend (default: ``keras.backend.backend()``) if the layer runs on it;
    ``ValueError`` naming the supported backends otherwise."""
    backend = keras.backend.backend() if backend is None else backend
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"xattn's Keras MultiHeadAttention runs on the Keras backends "
            f"{', '.join(map(repr, SUPPORTED_BACKENDS))}, not {backend!r}: it computes with "
            "the backend's tensors through the Python Array API, which TensorFlow tensors "
            "do not implement; set KERAS_BACKEND=jax or KERAS_BACKEND=torch before "
            "importing keras"
        )
    return backend


def backend_namespace() -> Any:
    """The Array API namespace of the current backend's tensors."""
    return array_api_compat.array_namespace(keras.ops.zeros(()))


class KerasGenerator(Generator):
    """Draws with ``keras.random`` from a ``keras.random.SeedGenerator``.

    Each draw advances the seed generator, whose state is a Keras variable: under the
    ``jit`` of ``model.fit`` on JAX the new state is carried like any other non-trainable
    variable (as for ``keras.layers.Dropout``), and on torch it is updated eagerly.

    Parameters
    ----------
    seed_generator : keras.random.SeedGenerator
        The source of the draws.
    """

    def __init__(self, seed_generator: Any):
        self.seed_generator = seed_generator

    @staticmethod
    def _place(values: Array, device: Any) -> Array:
        return values if device is None else array_api_compat.to_device(values, device)

    def normal(self, xp, shape, *, dtype, device=None):
        dtype = keras.backend.standardize_dtype(dtype)
        return self._place(keras.random.normal(tuple(shape), dtype=dtype,
                                               seed=self.seed_generator), device)

    def uniform(self, xp, shape, *, dtype, device=None):
        dtype = keras.backend.standardize_dtype(dtype)
        return self._place(keras.random.uniform(tuple(shape), dtype=dtype,
                                                seed=self.seed_generator), device)

    def __repr__(self) -> str:
        return f"KerasGenerator({self.seed_generator!r})"


def _values_readable(x: Array) -> bool:
    """False under ``torch.compile``, where reading a value would break the graph (a
    traced JAX array is told by :func:`xattn._core.array.concrete_count` itself)."""
    if array_api_compat.is_torch_array(x):
        import torch

        return not torch.compiler.is_compiling()
    return True


def key_padding_mask(attention_mask: Array, *, query_length: int, key_length: int,
                     causal: bool) -> Array:
    """Keras's ``attention_mask`` (True = attend) as xattn's ``key_mask`` ``(B or 1, S)``.

    The mask is accepted if it is a key padding mask: with ``causal``, after the causal
    mask is applied to it (as Keras applies ``use_causal_mask``), every query row equals
    ``key_mask & causal row``; rows that are all False (padded queries, whose outputs
    Keras leaves unspecified) are exempt. ``key_mask`` is the key's column OR over the
    query rows. Where the values cannot be read (under ``jax.jit``, ``torch.compile``), the
    mask is taken as such a mask unchecked.

    Raises
    ------
    ValueError
        A mask of another shape than ``(B or 1, T or 1, S)`` or ``(T, S)``, or (values
        readable) one that is not a key padding mask.
    TypeError
        A mask that is neither boolean nor integer (0 / 1).
    """
    xp = array_api_compat.array_namespace(attention_mask)
    shape = tuple(attention_mask.shape)
    expected = f"(batch, {query_length}, {key_length})"
    if len(shape) == 2:
        attention_mask = attention_mask[None, ...]
    if len(shape) not in (2, 3) or attention_mask.shape[-1] != key_length or (
            attention_mask.shape[-2] not in (1, query_length)):
        raise ValueError(f"attention_mask must have shape {expected} (or broadcast to it "
                         f"with 1 in the batch or query dim), got {shape}")
    if attention_mask.dtype != xp.bool:
        if not xp.isdtype(attention_mask.dtype, "integral"):
            raise TypeError(f"attention_mask must be boolean or integer (1 = attend), got "
                            f"{attention_mask.dtype}")
        attention_mask = attention_mask != 0
    device = array_api_compat.device(attention_mask)
    rows = xp.arange(query_length, device=device)[:, None]
    columns = xp.arange(key_length, device=device)[None, :]
    allowed = (columns <= rows) if causal else xp.ones((1, key_length), dtype=xp.bool,
                                                         device=device)
    attention_mask = attention_mask & allowed  # (B, T, S): the causal mask applied
    keys = xp.any(attention_mask, axis=-2)  # (B, S)
    if _values_readable(attention_mask):
        rebuilt = keys[:, None, :] & allowed
        padded_query = ~xp.any(attention_mask, axis=-1, keepdims=True)  # (B, T, 1)
        if concrete_count(xp, (attention_mask != rebuilt) & ~padded_query):
            what = "(after the causal mask of use_causal_mask=True) " if causal else ""
            raise ValueError(
                f"attention_mask {what}is not a key padding mask: xattn's estimators take "
                "a mask of keys (key m is attended by every query, or by none), and with "
                "use_causal_mask=True the causal mask; they cannot apply a general (T, S) "
                "mask. Pass a padding mask (or the Keras mask of value/key), and "
                "use_causal_mask=True instead of a causal attention_mask"
            )
    return keys


@contextlib.contextmanager
def masks_detached(*tensors: Any) -> Iterator[None]:
    """Inside the block, ``tensors`` carry no Keras mask (the projections, which do not
    support masking, would warn of one); their masks are restored after it. (Keras's own
    MultiHeadAttention clears the masks of its inputs for good.)"""
    masks = [get_keras_mask(tensor) for tensor in tensors]
    for tensor in tensors:
        set_keras_mask(tensor, None)
    try:
        yield
    finally:
        for tensor, mask in zip(tensors, masks, strict=True):
            if mask is not None:
                set_keras_mask(tensor, mask)


def projection_equations(output_rank: int) -> tuple[str, str, str, str]:
    """The einsum equations and bias axes of the projections of
    ``keras.layers.MultiHeadAttention`` for inputs ``(B, L, dim)``: ``(input equation,
    input bias axes, output equation, output bias axes)``; the output projection maps
    ``(B, T, heads, value_dim)`` to ``(B, T, *output_shape)`` (``output_rank`` dims)."""
    output = string.ascii_lowercase[4:4 + output_rank]
    return "abc,cde->abde", "de", f"abcd,cd{output}->ab{output}", output
