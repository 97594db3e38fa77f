"""Docstring text that several functions share, and the decorator that fills it in.

A docstring names a shared fragment by a line that holds only the marker ``{{name}}``,
indented as the text it stands for; :func:`fill_docstring` replaces that line by the
fragment, each of its lines indented alike, when the module is imported. ``__doc__``, which
:func:`help`, Sphinx and the doctests read, therefore holds the whole text. The double
braces on a line of their own cannot be mistaken for the LaTeX groups of the raw
docstrings, and the text is replaced as it is (no :meth:`str.format`), so braces, ``%`` and
backslashes in the fragments stay as they are.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from typing import TypeVar

__all__ = ["EXAMPLE_INPUTS", "KEY_VALUE_CACHE_ATTRIBUTES", "QKV_PARAMETERS",
           "SELF_ATTENTION_EXAMPLE_INPUTS", "document_estimator", "fill_docstring",
           "returns_with_state"]

_Documented = TypeVar("_Documented")

_MARKER = re.compile(r"^(?P<indent> *)\{\{(?P<name>\w+)\}\}$", re.MULTILINE)

#: The ``q``, ``k``, ``v`` entries of an estimator's Parameters section.
QKV_PARAMETERS = """\
q : array, shape (..., N, D)
    Queries. Real floating dtype; bfloat16 keeps its dtype for the features and products
    on torch, JAX and CuPy, the maxima and sums across chunks in float32, and float16 is
    computed in float32 (:doc:`/guide/05_half_precision`); the output is in the input
    dtype.
k : array, shape (..., M, D)
    Keys.
v : array, shape (..., M, Dv)
    Values."""


#: The Attributes section of a key-value cache (:class:`~xattn.SoftmaxState`,
#: :class:`~xattn.RAState`).
KEY_VALUE_CACHE_ATTRIBUTES = """\
Attributes
----------
keys : array, shape (..., P, D)
    The keys seen, in the compute dtype; zeros where ``valid`` is False.
values : array, shape (..., P, Dv)
    The values seen.
valid : bool array, shape (..., P)
    False for masked keys (``key_mask``), which no later query attends."""


def _example_inputs(num_keys: int) -> str:
    """The first lines of an Examples section: 2 batch-heads of 5 queries, ``num_keys``
    keys of dimension 4 and values of dimension 3, from a seeded NumPy generator."""
    return f"""\
Examples
--------
>>> import numpy as np
>>> import xattn
>>> rng = np.random.default_rng(0)
>>> q = rng.normal(size=(2, 5, 4))
>>> k, v = rng.normal(size=(2, {num_keys}, 4)), rng.normal(size=(2, {num_keys}, 3))"""


#: The opening of an estimator's Examples: ``q`` of shape (2, 5, 4) attending 7 keys.
EXAMPLE_INPUTS = _example_inputs(num_keys=7)

#: The opening of a state's Examples: 5 tokens, whose queries attend their own keys.
SELF_ATTENTION_EXAMPLE_INPUTS = _example_inputs(num_keys=5)


def returns_with_state(state_class: type) -> str:
    """The Returns section of an estimator whose ``return_state=True`` adds its state, of
    ``state_class``, to the output."""
    return f"""\
Returns
-------
array, shape (..., N, Dv), or (array, {state_class.__name__})
    In the namespace, device and dtype of the inputs; leading dims broadcast. With
    ``return_state``, the pair ``(out, state)``."""


def fill_docstring(**fragments: str) -> Callable[[_Documented], _Documented]:
    """Decorator: replace each marker line ``{{name}}`` of the docstring by
    ``fragments[name]``, indented as the marker.

    A marker without a fragment, or a fragment without a marker, is a ``ValueError`` at
    import. A missing docstring (``python -OO``) is left alone.

    Examples
    --------
    >>> from xattn._core.docstrings import fill_docstring
    >>> @fill_docstring(more="Second line.\\nThird line.")
    ... def f():
    ...     '''First line.
    ...
    ...     {{more}}
    ...     '''
    >>> print(f.__doc__.rstrip())
    First line.
    <BLANKLINE>
        Second line.
        Third line.
    """
    def fill(documented: _Documented) -> _Documented:
        text = documented.__doc__
        if text is None:
            return documented
        where = getattr(documented, "__qualname__", repr(documented))
        unused = set(fragments)

        def fragment(marker: re.Match[str]) -> str:
            name = marker["name"]
            if name not in fragments:
                raise ValueError(f"the docstring of {where} names {{{{{name}}}}}, which "
                                 "fill_docstring was not given")
            unused.discard(name)
            return textwrap.indent(fragments[name], marker["indent"])

        filled = _MARKER.sub(fragment, text)
        if unused:
            raise ValueError(f"the docstring of {where} has no marker for "
                             f"{', '.join(sorted(unused))}")
        documented.__doc__ = filled
        return documented
    return fill


def document_estimator(state_class: type, **fragments: str
                       ) -> Callable[[_Documented], _Documented]:
    """:func:`fill_docstring` with the sections every estimator shares: ``{{qkv}}``
    (:data:`QKV_PARAMETERS`) and ``{{returns}}`` (:func:`returns_with_state` of
    ``state_class``); ``fragments`` fill its other markers (``examples=EXAMPLE_INPUTS``)."""
    return fill_docstring(qkv=QKV_PARAMETERS, returns=returns_with_state(state_class),
                          **fragments)
