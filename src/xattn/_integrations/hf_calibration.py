"""Converting a Hugging Face model to random features with calibrated samples: every
attention layer's queries, keys and values captured from the model's own forward passes
(exact softmax attention, the model frozen), RFA's samples fitted per layer and head by
:func:`xattn.calibrate_omega`, stored in a file beside the model's weights and loaded
back by the hook. Re-exported and documented by :mod:`xattn.transformers`
(:func:`~xattn.transformers.calibrate`, :func:`~xattn.transformers.save_features`,
:func:`~xattn.transformers.load_features`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from xattn._estimators.softmax import softmax_attention
from xattn._integrations.calibration import CalibrationReport, calibrate_omega
from xattn._integrations.hf_masks import AttentionMask, attention_mask, mask_from_tensor

__all__ = ["FEATURES_FILE", "calibrate", "check_batch", "exact_attention", "load_features",
           "save_features"]

#: The file name of the fitted samples in a model's directory.
FEATURES_FILE = "xattn_features.safetensors"
_CAPTURE = "xattn_calibration_capture"
# the options that decide what the samples were fitted for
_FITTED_FOR = ("num_features", "feature_map", "window", "sinks")


class _Capture:
    """An attention function that records each layer's q, k, v (key and value heads
    repeated to the query heads), its key padding and causality, and returns exact
    softmax attention."""

    def __init__(self, attention: Any, record: bool = True) -> None:
        self.attention = attention
        self.record = record
        self.records: dict[int, list[tuple[Any, ...]]] = {}
        self.modules: dict[int, Any] = {}

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads != kv_heads:
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        if isinstance(attention_mask, torch.Tensor):
            attention_mask = mask_from_tensor(attention_mask, query.shape[-2], key.shape[-2])
        if attention_mask is None:
            is_causal = kwargs.get("is_causal")
            causal = bool(getattr(module, "is_causal", True) if is_causal is None
                          else is_causal)
            key_mask = None
        elif isinstance(attention_mask, AttentionMask):
            causal, key_mask = attention_mask.causal, attention_mask.key_mask
        else:
            raise ValueError(f"calibration takes padding and causal masks only, got a "
                             f"{type(attention_mask).__name__}")
        if query.shape[-2] != key.shape[-2]:
            raise ValueError("calibration runs forward passes without a cache: the queries "
                             "must be the keys' positions")
        mask = None if key_mask is None else key_mask[:, None, :]
        if self.record:
            layer = self.attention.module_layer(module)
            self.modules[layer] = module
            self.records.setdefault(layer, []).append(
                (query.detach(), key.detach(), value.detach(), mask, causal, scaling))
        out = softmax_attention(query, key, value, scale=scaling, key_mask=mask, causal=causal)
        return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def exact_attention(model: Any, attention: Any, *, record: bool = False
                    ) -> Iterator[_Capture]:
    """Within the block, ``model`` runs exact softmax attention in evaluation mode (the
    masks as the hook reads them), recording each layer's q, k, v if ``record``; its
    attention implementation and training mode are put back after."""
    capture = _Capture(attention, record)
    AttentionInterface.register(_CAPTURE, capture)
    AttentionMaskInterface.register(_CAPTURE, attention_mask)
    previous = model.config._attn_implementation
    was_training = model.training
    model.eval()
    model.set_attn_implementation(_CAPTURE)
    try:
        yield capture
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)


def check_batch(batch: Any) -> Mapping[str, Any]:
    """``batch`` if it is a mapping of the model's inputs, else a ``TypeError``."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"batches must be mappings of the model's inputs (e.g. a "
                        f"tokenizer's output), got a {type(batch).__name__}")
    return batch


def _capture(model: Any, batches: Iterable[Mapping[str, Any]], attention: Any) -> _Capture:
    with exact_attention(model, attention, record=True) as capture, torch.no_grad():
        for batch in batches:
            model(**check_batch(batch), use_cache=False)
    if not capture.records:
        raise ValueError("the model ran no attention layer on the batches (no batch given?)")
    return capture


def calibrate(model: Any, batches: Iterable[Mapping[str, Any]], attention: Any, *,
              steps: int = 300, learning_rate: float = 1e-2, holdout: float = 0.25,
              patience: int | None = 50, seed: int = 0,
              progress: Any = None) -> dict[int, CalibrationReport]:
    r"""Calibrate every attention layer of a Hugging Face model: fit RFA's samples per
    layer and head to the model's own attention on ``batches`` of text.

    Runs the model (in evaluation mode, without gradients: every weight stays as it is)
    on each batch with exact softmax attention, captures each attention layer's queries,
    keys and values (key and value heads repeated to the query heads) with its padding
    and causal masks, and fits one ``(heads, num_features, head_dim)`` sample matrix per
    layer with :func:`xattn.calibrate_omega`, with the options ``attention`` was
    registered with (``num_features``, ``feature_map``, ``window``, ``sinks``), the
    model's scaling and causality, starting from the layer's own random features (so
    each head is never worse than before on the held-out sequences). The fitted samples
    are stored in ``attention.fitted`` and used by the model in evaluation mode from
    then on, in the forward pass and in ``generate`` (with an :class:`XattnCache` too);
    training mode still draws random features at each call. Save them with
    :func:`save_features` and load them back with :func:`load_features`.

    Every layer is fitted on the inputs it sees in the exact model (not those of a
    model whose earlier layers are already converted).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model (any whose attention dispatches through transformers'
        ``AttentionInterface``, as :func:`register` needs).
    batches : iterable of mappings
        The model's inputs, e.g. a tokenizer's outputs (``input_ids``,
        ``attention_mask``); a few batches of the user's own text (the layers' rows of
        all batches are fitted together, so they are held in memory).
    attention : XattnAttention
        What :func:`register` returned, with ``estimator="rfa"``.
    steps, learning_rate, holdout, patience, seed
        As in :func:`xattn.calibrate_omega` (the share ``holdout`` of the sequences is
        held out).
    progress : callable, optional
        Called as ``progress(layer, report)`` after each layer.

    Returns
    -------
    dict of int to CalibrationReport
        Per layer (its ``layer_idx``), the report of its fit.

    Raises
    ------
    ValueError
        ``attention`` is not RFA's, a mask other than padding and causal, no batch.
    TypeError
        A batch that is not a mapping.

    See Also
    --------
    xattn.calibrate_omega : The fit of one layer.

    Examples
    --------
    >>> import tempfile
    >>> import torch
    >>> import xattn.transformers
    >>> from transformers import BertConfig, BertModel
    >>> attention = xattn.transformers.register("xattn_rfa_fit_doc", num_features=8,
    ...                                         window=2, sinks=1)
    >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                     num_attention_heads=4, intermediate_size=64)
    >>> _ = torch.manual_seed(0)
    >>> model = BertModel(config, add_pooling_layer=False).eval()
    >>> batches = [{"input_ids": torch.randint(100, (4, 16))} for _ in range(2)]
    >>> reports = xattn.transformers.calibrate(model, batches, attention, steps=20)
    >>> sorted(reports), attention.fitted[0].shape
    ([0, 1], torch.Size([4, 8, 8]))
    >>> all(r.heldout_error_after <= r.heldout_error_before for r in reports.values())
    True
    >>> folder = tempfile.mkdtemp()
    >>> path = xattn.transformers.save_features(attention, folder)
    >>> path.name
    'xattn_features.safetensors'
    >>> model.set_attn_implementation("xattn_rfa_fit_doc")
    >>> out = model(batches[0]["input_ids"]).last_hidden_state
    """
    if attention.estimator != "rfa":
        raise ValueError(f"calibration fits RFA's samples: the attention {attention.name!r} "
                         f"runs {attention.estimator!r}")
    capture = _capture(model, batches, attention)
    options = attention.options
    reports = {}
    fitted = {}
    for layer in sorted(capture.records):
        records = capture.records[layer]
        query = records[0][0]
        start = attention.random_features(capture.modules[layer], query.shape[-1],
                                          dtype=torch.float32, device=query.device)
        start = start.expand(query.shape[1], *start.shape).contiguous()
        causal, scaling = records[0][4], records[0][5]
        data = [(q.float(), k.float(), v.float(), mask,
                 None if mask is None or q.shape[-2] != k.shape[-2] else mask)
                for q, k, v, mask, _, _ in records]
        omega, report = calibrate_omega(
            data, num_features=start.shape[-2], feature_map=options.get("feature_map",
                                                                        "positive"),
            window=options.get("window"), sinks=options.get("sinks"), causal=causal,
            scale=scaling, steps=steps, learning_rate=learning_rate, holdout=holdout,
            patience=patience, seed=seed, omega=start)
        fitted[layer], reports[layer] = omega, report
        if progress is not None:
            progress(layer, report)
    attention.fitted.update(fitted)
    attention.clear_feature_cache()
    return reports


def save_features(attention: Any, directory: str | os.PathLike[str]) -> Path:
    """Write the fitted samples of ``attention`` to ``directory/xattn_features.safetensors``
    (e.g. the directory of the model's own weights): one
    ``(heads, num_features, head_dim)`` float32 tensor per layer, named ``layer.<index>``,
    and the options they were fitted for (``num_features``, ``feature_map``, ``window``,
    ``sinks``) in the file's metadata.

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ValueError
        ``attention`` has no fitted samples (run :func:`calibrate` first).
    """
    if not attention.fitted:
        raise ValueError(f"the attention {attention.name!r} has no fitted samples: run "
                         "xattn.transformers.calibrate first")
    path = Path(directory) / FEATURES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"xattn": json.dumps({name: attention.options.get(name)
                                     for name in _FITTED_FOR})}
    save_file({f"layer.{layer}": omega.detach().float().cpu().contiguous()
               for layer, omega in attention.fitted.items()}, str(path), metadata=metadata)
    return path


def load_features(attention: Any, path: str | os.PathLike[str]) -> None:
    """Load samples written by :func:`save_features` into ``attention`` (in place of any
    it had), for the layers of the model it runs from then on in evaluation mode.

    Parameters
    ----------
    attention : XattnAttention
        What :func:`register` returned, registered with the options the samples were
        fitted for.
    path : str or path
        The file, or the directory that holds ``xattn_features.safetensors``.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        The file's samples were fitted for other options (``num_features``,
        ``feature_map``, ``window``, ``sinks``) than the attention's.

    Examples
    --------
    A model saved with its fitted samples is loaded back with them::

        model.save_pretrained(folder)
        xattn.transformers.save_features(attention, folder)
        ...
        attention = xattn.transformers.register("xattn_rfa", num_features=64, window=16,
                                                sinks=1)
        xattn.transformers.load_features(attention, folder)
        model = AutoModel.from_pretrained(folder, attn_implementation="xattn_rfa")
    """
    path = Path(path)
    if path.is_dir():
        path = path / FEATURES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no fitted samples at {str(path)!r}")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        saved = json.loads((file.metadata() or {}).get("xattn", "{}"))
    own = {name: attention.options.get(name) for name in _FITTED_FOR}
    if saved != own:
        raise ValueError(f"the samples in {str(path)!r} were fitted for {saved}, the "
                         f"attention {attention.name!r} has {own}")
    tensors = load_file(str(path))
    attention.fitted.clear()
    attention.fitted.update({int(name.split(".", 1)[1]): tensor
                             for name, tensor in tensors.items()})
    attention.clear_feature_cache()
