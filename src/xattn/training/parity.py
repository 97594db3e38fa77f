"""The parameters of the ``xattn train`` model in one layout for both frameworks, to
train the PyTorch and the Flax model from the same weights (issue 43: training parity).

Both :class:`xattn.training.encoder_torch.Encoder` and :class:`xattn.training.encoder_flax.Encoder`
(with the xattn layer or the framework's own) are read into, and loaded from, a flat
dict of NumPy arrays keyed by the Flax model's parameter paths joined by dots
(``"blocks.0.attention.query.kernel"``), in Flax's layout: a PyTorch weight ``W`` of
``y = x W^T + b`` is the kernel ``W^T``, and the packed input projection
``in_proj_weight`` is split into the query, key and value kernels ``(dim, heads,
head_dim)``. RFA's features ``(S, head_dim)`` are under ``"blocks.<i>.attention.features"``.

Framework modules are imported lazily: each function needs only the framework of the
model it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

__all__ = [
    "PARAMETER_GROUPS",
    "flax_parameters",
    "group_of",
    "load_flax_parameters",
    "load_torch_parameters",
    "torch_parameters",
]

#: The groups :func:`group_of` puts each entry in, which the loaders can select.
PARAMETER_GROUPS = ("embeddings", "attention", "features", "ffn", "norms", "classifier")


def group_of(name: str) -> str:
    """The group of :data:`PARAMETER_GROUPS` of the entry ``name``: ``"embeddings"``
    (token and position embeddings), ``"attention"`` (query, key, value and output
    projections), ``"features"`` (RFA's features), ``"ffn"``, ``"norms"`` (every
    LayerNorm) or ``"classifier"`` (both layers of the classifier)."""
    parts = name.split(".")
    if parts[0] in ("embeddings", "position"):
        return "embeddings"
    if parts[0] in ("hidden", "classifier"):
        return "classifier"
    if parts[0] == "norm" or parts[-2].endswith("_norm"):
        return "norms"
    if parts[2] == "attention":
        return "features" if parts[-1] == "features" else "attention"
    return "ffn"


#: What the loaders write into: (name, where the model holds the entry, its shape there,
#: from the Flax layout to it)
_Target = tuple[str, Any, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]


# -- PyTorch -----------------------------------------------------------------------------

#: (name, torch tensor, rows of it or None for all, to Flax layout, from Flax layout)
_Slot = tuple[
    str, Any, "slice | None", Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]
]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transposed(x: np.ndarray) -> np.ndarray:
    return x.T


def _flattened(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1)


def _heads_bias(bias: np.ndarray, heads: int) -> np.ndarray:
    """(heads * head_dim,) -> (heads, head_dim)."""
    return bias.reshape(heads, -1)


def _input_kernel(weight: np.ndarray, heads: int) -> np.ndarray:
    """torch's (heads * head_dim, dim) -> Flax's (dim, heads, head_dim)."""
    return weight.T.reshape(weight.shape[1], heads, -1)


def _input_weight(kernel: np.ndarray) -> np.ndarray:
    """Flax's (dim, heads, head_dim) -> torch's (heads * head_dim, dim)."""
    return kernel.reshape(kernel.shape[0], -1).T


def _output_kernel(weight: np.ndarray, heads: int) -> np.ndarray:
    """torch's (dim, heads * head_dim) -> Flax's (heads, head_dim, dim)."""
    return weight.T.reshape(heads, -1, weight.shape[0])


def _output_weight(kernel: np.ndarray) -> np.ndarray:
    """Flax's (heads, head_dim, dim) -> torch's (dim, heads * head_dim)."""
    return kernel.reshape(-1, kernel.shape[-1]).T


def _torch_slots(model: Any) -> Iterator[_Slot]:
    """Every entry of a PyTorch ``Encoder`` (see :data:`_Slot`)."""
    dim = model.norm.normalized_shape[0]
    for index, embedding in enumerate(model.embeddings):
        yield f"embeddings.{index}.embedding", embedding.weight, None, _same, _same
    if model.position is not None:
        yield "position", model.position, None, _same, _same
    for number, block in enumerate(model.blocks):
        prefix = f"blocks.{number}."
        yield from _torch_norm(prefix + "attention_norm", block.attention_norm)
        attention = block.attention
        heads = attention.num_heads
        for row, name in enumerate(("query", "key", "value")):
            rows = slice(row * dim, (row + 1) * dim)  # of the packed [W_q; W_k; W_v]
            yield (f"{prefix}attention.{name}.kernel", attention.in_proj_weight, rows,
                   functools.partial(_input_kernel, heads=heads), _input_weight)
            yield (f"{prefix}attention.{name}.bias", attention.in_proj_bias, rows,
                   functools.partial(_heads_bias, heads=heads), _flattened)
        yield (f"{prefix}attention.out.kernel", attention.out_proj.weight, None,
               functools.partial(_output_kernel, heads=heads), _output_weight)
        yield f"{prefix}attention.out.bias", attention.out_proj.bias, None, _same, _same
        if getattr(attention, "features", None) is not None:
            yield f"{prefix}attention.features", attention.features, None, _same, _same
        yield from _torch_norm(prefix + "ffn_norm", block.ffn_norm)
        yield from _torch_linear(prefix + "ffn_in", block.ffn[0])
        yield from _torch_linear(prefix + "ffn_out", block.ffn[2])
    yield from _torch_norm("norm", model.norm)
    yield from _torch_linear("hidden", model.classifier[0])
    yield from _torch_linear("classifier", model.classifier[2])


def _torch_norm(name: str, norm: Any) -> Iterator[_Slot]:
    yield f"{name}.scale", norm.weight, None, _same, _same
    yield f"{name}.bias", norm.bias, None, _same, _same


def _torch_linear(name: str, linear: Any) -> Iterator[_Slot]:
    yield f"{name}.kernel", linear.weight, None, _transposed, _transposed
    yield f"{name}.bias", linear.bias, None, _same, _same


def torch_parameters(model: Any, *, gradients: bool = False) -> dict[str, np.ndarray]:
    """Every parameter (and RFA's features) of a PyTorch ``Encoder``, in the Flax layout.

    Parameters
    ----------
    model : xattn.training.encoder_torch.Encoder
    gradients : bool
        Read the parameters' ``.grad`` instead (after a backward pass; the features and
        parameters without a gradient are left out).

    Returns
    -------
    dict of str to numpy.ndarray
        Keyed by the Flax model's parameter paths (see the module docstring).
    """
    result = {}
    for name, tensor, rows, to_flax, _ in _torch_slots(model):
        if gradients:
            tensor = tensor.grad
            if tensor is None:
                continue
        value = tensor.detach().cpu().numpy()
        # a copy: a CPU tensor's array shares its memory, which the optimizer updates
        result[name] = np.array(to_flax(value if rows is None else value[rows]), copy=True)
    return result


def load_torch_parameters(
    model: Any, parameters: dict[str, np.ndarray], groups: Iterable[str] | None = None
) -> list[str]:
    """Copy ``parameters`` (Flax layout, :func:`flax_parameters`) into a PyTorch
    ``Encoder``, in place.

    Parameters
    ----------
    model : xattn.training.encoder_torch.Encoder
    parameters : dict of str to numpy.ndarray
    groups : iterable of str, optional
        Copy only the entries of these :data:`PARAMETER_GROUPS` (default: all).

    Returns
    -------
    list of str
        The names of the entries copied.

    Raises
    ------
    ValueError
        An unknown group, or an entry of the model missing from ``parameters`` or of
        another shape.
    """
    import torch

    def write(tensor: Any, value: np.ndarray) -> None:
        tensor.copy_(torch.tensor(value, dtype=tensor.dtype, device=tensor.device))

    with torch.no_grad():
        return _load(parameters, groups, _torch_targets(model), write)


def _torch_targets(model: Any) -> Iterator[_Target]:
    """Every entry of a PyTorch ``Encoder`` as a :data:`_Target` (the packed input
    projection's rows as views: a write goes into the packed parameter)."""
    for name, tensor, rows, _, from_flax in _torch_slots(model):
        if rows is not None:
            tensor = tensor[rows]
        yield name, tensor, tuple(tensor.shape), from_flax


# -- Flax ---------------------------------------------------------------------------------


def _flax_variables(model: Any) -> dict[str, Any]:
    """Every ``nnx.Param`` of a Flax ``Encoder``, and RFA's features, by dotted path."""
    from flax import nnx

    variables = {
        ".".join(map(str, path)): variable
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    for number, block in enumerate(model.blocks):
        features = getattr(block.attention, "features", None)
        if features is not None:
            variables[f"blocks.{number}.attention.features"] = features
    return variables


def flax_parameters(model: Any, gradients: Any = None) -> dict[str, np.ndarray]:
    """Every parameter (and RFA's features) of a Flax ``Encoder``, as NumPy arrays.

    Parameters
    ----------
    model : xattn.training.encoder_flax.Encoder
    gradients : flax.nnx.State, optional
        The gradients of ``nnx.grad`` with respect to the model's ``nnx.Param``: read
        them instead of the parameters.

    Returns
    -------
    dict of str to numpy.ndarray
        Keyed by the parameter paths joined by dots.
    """
    from flax import nnx

    if gradients is not None:
        return {
            ".".join(map(str, path)): np.asarray(value[...])
            for path, value in nnx.to_flat_state(gradients)
        }
    return {name: np.asarray(variable[...]) for name, variable in _flax_variables(model).items()}


def load_flax_parameters(
    model: Any, parameters: dict[str, np.ndarray], groups: Iterable[str] | None = None
) -> list[str]:
    """Copy ``parameters`` (:func:`torch_parameters` or :func:`flax_parameters`) into a
    Flax ``Encoder`` (:class:`xattn.training.encoder_flax.Encoder`), in place: as
    :func:`load_torch_parameters` does into a PyTorch one (the same ``groups``, result and
    errors)."""
    import jax.numpy as jnp

    def write(variable: Any, value: np.ndarray) -> None:
        variable[...] = jnp.array(value, dtype=variable[...].dtype, copy=True)

    targets = ((name, variable, tuple(variable[...].shape), _same)
               for name, variable in _flax_variables(model).items())
    return _load(parameters, groups, targets, write)


# -- both ---------------------------------------------------------------------------------

def _load(parameters: dict[str, np.ndarray], groups: Iterable[str] | None,
          targets: Iterable[_Target], write: Callable[[Any, np.ndarray], None]) -> list[str]:
    """Copy ``parameters`` into a model: ``write(place, value)`` for each target of
    ``targets`` in ``groups`` (see :func:`load_torch_parameters`); the names copied."""
    chosen = _chosen_groups(groups)
    copied = []
    for name, place, shape, convert in targets:
        value = _entry(parameters, name, chosen, shape, convert)
        if value is None:
            continue
        write(place, value)
        copied.append(name)
    return copied


def _entry(parameters: dict[str, np.ndarray], name: str, chosen: set[str],
           shape: tuple[int, ...], convert: Any) -> np.ndarray | None:
    """``convert(parameters[name])`` for a model entry of ``shape`` (None: its group is not
    ``chosen``); a missing entry or another shape raises a ``ValueError``."""
    if group_of(name) not in chosen:
        return None
    if name not in parameters:
        raise ValueError(f"parameters has no entry {name!r}")
    value = np.ascontiguousarray(convert(np.asarray(parameters[name])))
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(value.shape)} in parameters, {shape} in the "
                         "model")
    return value


def _chosen_groups(groups: Iterable[str] | None) -> set[str]:
    chosen = set(PARAMETER_GROUPS if groups is None else groups)
    unknown = chosen - set(PARAMETER_GROUPS)
    if unknown:
        raise ValueError(
            f"unknown parameter groups {sorted(unknown)}; the groups are "
            f"{', '.join(PARAMETER_GROUPS)}"
        )
    return chosen
