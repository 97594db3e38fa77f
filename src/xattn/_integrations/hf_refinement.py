"""Refining calibrated samples on the whole model: every layer's fitted RFA samples
trained together, the model frozen, so that the converted model's hidden states follow
the exact model's. Re-exported and documented by :mod:`xattn.transformers`
(:func:`~xattn.transformers.refine`, :class:`~xattn.transformers.RefinementReport`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from xattn._core.options import check_finite_real, check_positive_int
from xattn._integrations.hf_calibration import check_batch, exact_attention

__all__ = ["RefinementReport", "refine"]


@dataclass(frozen=True)
class RefinementReport:
    """What :func:`xattn.transformers.refine` did, measured on the sequences it did not
    train on.

    The error is the hidden-state error of the converted model against the exact one:
    the mean, over the model's layers and the sequences' tokens (padding left out), of
    :math:`1 - \\cos(h, h^{\\mathrm{exact}})` between a token's hidden states after the
    layer with the fitted samples and with exact softmax attention (0: the same
    directions), plus, with ``embedding_weight``, that weight times the mean over
    sequences of ``1 - cos`` between the token means of the last layer's hidden states.

    Attributes
    ----------
    heldout_error_before, heldout_error_after : float
        Held-out error of the starting samples and of the returned ones (never larger:
        the samples of the lowest held-out error are returned).
    steps : int
        Adam steps taken (fewer than asked if the held-out error stopped improving for
        ``patience`` steps).
    best_step : int
        The step whose samples were returned (0: the start).
    seconds : float
        Wall time, the exact model's targets and the evaluations included.
    sequences, heldout_sequences : int
        Sequences given, and how many of them were held out.
    """

    heldout_error_before: float
    heldout_error_after: float
    steps: int
    best_step: int
    seconds: float
    sequences: int
    heldout_sequences: int

    def to_json(self) -> dict[str, Any]:
        """The report as a dict of JSON values."""
        return asdict(self)


def _rows(batch: Mapping[str, Any], rows: torch.Tensor, size: int) -> dict[str, Any]:
    """The ``rows`` of every tensor of ``batch`` whose first dimension is the batch's
    ``size``; other values as they are."""
    return {name: value[rows] if isinstance(value, torch.Tensor) and value.ndim
            and value.shape[0] == size else value for name, value in batch.items()}


def _split(batches: list[Mapping[str, Any]], holdout: float, seed: int
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Train and held-out parts of ``batches``: a share ``holdout`` of all sequences (at
    least one, at most all but one), drawn with ``seed``."""
    sizes = [int(batch["input_ids"].shape[0]) if "input_ids" in batch
             else next(int(value.shape[0]) for value in batch.values()
                       if isinstance(value, torch.Tensor) and value.ndim)
             for batch in batches]
    total = sum(sizes)
    if total < 2:
        raise ValueError(f"refine holds sequences out: give at least 2, got {total}")
    count = min(total - 1, max(1, round(holdout * total)))
    held = np.zeros(total, dtype=bool)
    held[np.random.default_rng(seed).permutation(total)[:count]] = True
    train: list[dict[str, Any]] = []
    heldout: list[dict[str, Any]] = []
    start = 0
    for batch, size in zip(batches, sizes, strict=True):
        flags = torch.from_numpy(held[start:start + size])
        start += size
        for part, rows in ((train, ~flags), (heldout, flags)):
            if bool(rows.any()):
                part.append(_rows(batch, rows.nonzero()[:, 0], size))
    return train, heldout, count


def _hidden_states(model: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """The model's hidden states after each layer, ``(layers, batch, length, width)``."""
    outputs = model(**batch, output_hidden_states=True, use_cache=False)
    return torch.stack(outputs.hidden_states[1:]).float()


def _error_sums(hidden: torch.Tensor, exact: torch.Tensor, batch: Mapping[str, Any]
                ) -> torch.Tensor:
    """``[token error, tokens, embedding error, sequences]`` of one batch: the sum of
    ``1 - cos`` over layers and tokens (``attention_mask`` 0 left out) and the number of
    its terms; the sum over sequences of ``1 - cos`` between the token means of the last
    layer's hidden states (padding left out) and the number of sequences."""
    cosine = torch.nn.functional.cosine_similarity(hidden, exact, dim=-1)
    weights = batch.get("attention_mask")
    if not isinstance(weights, torch.Tensor) or weights.shape != cosine.shape[1:]:
        weights = torch.ones(cosine.shape[1:], device=cosine.device)
    weights = weights.to(cosine.dtype)
    # the token means' cosine: the sums' (a positive factor per sequence does not count)
    embedding = torch.nn.functional.cosine_similarity(
        (hidden[-1] * weights[..., None]).sum(-2), (exact[-1] * weights[..., None]).sum(-2),
        dim=-1)
    return torch.stack([((1 - cosine) * weights).sum(), weights.sum() * cosine.shape[0],
                        (1 - embedding).sum(), cosine.new_tensor(float(embedding.shape[0]))])


def _objective(sums: torch.Tensor, embedding_weight: float) -> torch.Tensor:
    """The hidden-state error of summed :func:`_error_sums`, plus ``embedding_weight``
    times their embedding error."""
    error = sums[0] / sums[1]
    return error + embedding_weight * sums[2] / sums[3] if embedding_weight else error


def refine(model: Any, batches: Iterable[Mapping[str, Any]], attention: Any, *,
           steps: int = 200, learning_rate: float = 1e-2, holdout: float = 0.25,
           patience: int | None = 30, evaluate_every: int = 10, seed: int = 0,
           embedding_weight: float = 0.0, progress: Any = None) -> RefinementReport:
    r"""Refine the calibrated samples of every attention layer together, on the whole
    model: minimize the converted model's hidden-state error against the exact model's,
    with every model weight frozen.

    :func:`calibrate` fits each layer alone, on the inputs it sees in the exact model;
    the converted model then feeds each layer the slightly different outputs of the
    converted layers before it, and the errors add up along the depth. This second stage
    trains all layers' samples ``attention.fitted`` together, by Adam on the mean over
    layers and tokens of :math:`1 - \cos(h, h^{\mathrm{exact}})` between each layer's
    hidden states with the fitted samples and with exact softmax attention (the model's
    ``output_hidden_states``; padding left out), plus ``embedding_weight`` times the mean
    over sequences of :math:`1 - \cos(\bar h, \bar h^{\mathrm{exact}})` between the means
    over tokens of the last layer's hidden states (the sentence embedding of a
    mean-pooling encoder). A share ``holdout`` of the sequences is
    held out: the error is measured on them every ``evaluate_every`` steps, the samples
    of its lowest value are kept (never worse than the start) and the fit stops after
    ``patience`` steps without improvement. Each step is one forward and backward pass
    of the model on one training batch, in turn.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model, as given to :func:`calibrate` (its weights are not changed: their
        ``requires_grad`` is switched off during the fit and put back after).
    batches : iterable of mappings
        The model's inputs (``input_ids`` and, with padding, ``attention_mask``); the
        exact model's hidden states of all of them are held in memory.
    attention : XattnAttention
        What :func:`register` returned, with ``estimator="rfa"``, after
        :func:`calibrate` (or :func:`load_features`): its ``fitted`` samples are the
        start and are replaced by the refined ones.
    steps : int
        Adam steps at most.
    learning_rate : float
        Adam's learning rate.
    holdout : float
        The share of the sequences held out, in (0, 1).
    patience : int or None
        Stop after this many steps without a lower held-out error; None: never.
    evaluate_every : int
        Steps between two measures of the held-out error.
    seed : int
        Seed of the choice of the held-out sequences.
    embedding_weight : float
        Weight, >= 0, of the embedding term of the objective (0: the hidden states
        alone). For a sentence encoder that mean-pools its last hidden states (as
        all-MiniLM-L6-v2 does), 1 fits what the encoder is used for as well: on
        all-MiniLM-L6-v2 with S = 64 and a window of 16 plus a sink, 150 steps with
        ``patience=None`` lift the embedding cosine on unseen passages to 0.971 (0.969
        with the hidden states alone and the defaults).
    progress : callable, optional
        Called as ``progress(step, heldout_error)`` at each measure.

    Returns
    -------
    RefinementReport
        The held-out errors before and after, the steps, the time.

    Raises
    ------
    ValueError
        ``attention`` is not RFA's or has no fitted samples, fewer than 2 sequences, an
        option out of range.
    TypeError
        A batch that is not a mapping.

    See Also
    --------
    calibrate : The per-layer fit that gives the start.

    Notes
    -----
    The objective is the converted model's agreement with the exact one, as in the
    attention-transfer stage of LoLCATs [1]_, here on the samples alone and on all
    layers at once. Measured on all-MiniLM-L6-v2 (guide "Converting a pretrained
    model"), it lifts the sentence-embedding cosine of plain ``rfa`` S = 64 from 0.917
    (per-layer calibration) to 0.932 on passages never used for fitting.

    References
    ----------
    .. [1] M. Zhang et al., "LoLCATs: On Low-Rank Linearizing of Large Language Models",
       ICLR 2025. https://arxiv.org/abs/2410.10254

    Examples
    --------
    >>> import torch
    >>> import xattn.transformers
    >>> from transformers import BertConfig, BertModel
    >>> _ = torch.manual_seed(0)
    >>> model = BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                              num_attention_heads=4, intermediate_size=64),
    ...                   add_pooling_layer=False).eval()
    >>> attention = xattn.transformers.register("xattn_rfa_refine_doc", num_features=8)
    >>> text = [{"input_ids": torch.randint(100, (8, 16))}]
    >>> _ = xattn.transformers.calibrate(model, text, attention, steps=20)
    >>> report = xattn.transformers.refine(model, text, attention, steps=20)
    >>> report.heldout_error_after <= report.heldout_error_before, report.heldout_sequences
    (True, 2)
    >>> model.set_attn_implementation("xattn_rfa_refine_doc")
    >>> out = model(text[0]["input_ids"]).last_hidden_state
    """
    if attention.estimator != "rfa":
        raise ValueError(f"refine trains RFA's samples: the attention {attention.name!r} "
                         f"runs {attention.estimator!r}")
    if not attention.fitted:
        raise ValueError(f"the attention {attention.name!r} has no fitted samples to "
                         "refine: run xattn.transformers.calibrate first")
    steps = check_positive_int(steps, "steps")
    evaluate_every = check_positive_int(evaluate_every, "evaluate_every")
    learning_rate = check_finite_real(learning_rate, "learning_rate")
    holdout = check_finite_real(holdout, "holdout")
    if learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must be in (0, 1), got {holdout}")
    embedding_weight = check_finite_real(embedding_weight, "embedding_weight")
    if embedding_weight < 0:
        raise ValueError(f"embedding_weight must be >= 0, got {embedding_weight}")
    if patience is not None:
        patience = check_positive_int(patience, "patience")
    tic = time.perf_counter()
    train, heldout, heldout_count = _split([check_batch(b) for b in batches], holdout, seed)
    with exact_attention(model, attention), torch.no_grad():
        train_targets = [_hidden_states(model, batch) for batch in train]
        heldout_targets = [_hidden_states(model, batch) for batch in heldout]

    samples = {layer: omega.detach().float().clone().requires_grad_(True)
               for layer, omega in attention.fitted.items()}
    optimizer = torch.optim.Adam(list(samples.values()), lr=learning_rate)
    frozen = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    best_samples = {layer: omega.detach().clone() for layer, omega in samples.items()}
    previous, was_training = model.config._attn_implementation, model.training

    def heldout_error() -> float:
        with torch.no_grad():
            sums = torch.stack([_error_sums(_hidden_states(model, batch), target, batch)
                                for batch, target in zip(heldout, heldout_targets,
                                                         strict=True)]).sum(0)
        return float(_objective(sums, embedding_weight))

    def use(chosen: dict[int, torch.Tensor]) -> None:
        attention.fitted.update(chosen)
        attention.clear_feature_cache()

    try:
        for parameter, _ in frozen:
            parameter.requires_grad_(False)
        model.eval()
        model.set_attn_implementation(attention.name)
        use(samples)
        before = best = heldout_error()
        best_step = step = 0
        if progress is not None:
            progress(0, before)
        while step < steps and (patience is None or step - best_step < patience):
            batch, target = train[step % len(train)], train_targets[step % len(train)]
            optimizer.zero_grad()
            _objective(_error_sums(_hidden_states(model, batch), target, batch),
                       embedding_weight).backward()
            optimizer.step()
            attention.clear_feature_cache()  # a cast of the samples is of the last step
            step += 1
            if step % evaluate_every == 0 or step == steps:
                error = heldout_error()
                if progress is not None:
                    progress(step, error)
                if error < best and math.isfinite(error):
                    best, best_step = error, step
                    best_samples = {layer: omega.detach().clone()
                                    for layer, omega in samples.items()}
    finally:
        for parameter, requires_grad in frozen:
            parameter.requires_grad_(requires_grad)
        model.set_attn_implementation(previous)
        model.train(was_training)
        use(best_samples)  # also after an error: never the samples of a half step
    return RefinementReport(heldout_error_before=before, heldout_error_after=best,
                            steps=step, best_step=best_step,
                            seconds=time.perf_counter() - tic, sequences=sum(
                                len(t[0]) for t in train_targets) + heldout_count,
                            heldout_sequences=heldout_count)
