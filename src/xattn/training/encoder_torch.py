"""PyTorch side of ``xattn train``: the LRA model with :class:`xattn.torch.MultiheadAttention`
(or, for the ``native`` row, :class:`torch.nn.MultiheadAttention`) and its AdamW training
step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch import nn

import xattn.torch as xtorch
from xattn.training.loop import NATIVE, ModelConfig, RunSpec, accuracy_counts
from xattn.training.peak import native_stderr_silenced, torch_memory
from xattn.training.tasks import Dataset, Task

__all__ = ["Encoder", "TorchTrainer", "TorchTrainerBase", "Trainer", "attention_layer",
           "supports_grid", "versions"]

_Model = TypeVar("_Model", bound=nn.Module)


def versions() -> dict[str, str]:
    return {"torch": torch.__version__}


def supports_grid() -> bool:
    """Whether this version's layer takes ``grid=`` (2-D LARA segments)."""
    try:
        xtorch.MultiheadAttention(2, 1, estimator="lara", num_samples=(1, 1), grid=(1, 2))
    except (TypeError, ValueError):
        return False
    return True


def attention_layer(dim: int, heads: int, estimator: str, options: dict[str, Any],
                    generator: torch.Generator, device: Any
                    ) -> nn.MultiheadAttention | xtorch.MultiheadAttention:
    """The attention of a block, batch first: :class:`torch.nn.MultiheadAttention` for
    :data:`~xattn.training.loop.NATIVE` (the xattn layer's parameters, drawn alike from
    torch's global generator), else :class:`xattn.torch.MultiheadAttention` with
    ``estimator``, its ``options`` (``redraw_interval`` 1000 unless they give one) and
    ``generator`` as its random stream."""
    if estimator == NATIVE:
        return nn.MultiheadAttention(dim, heads, batch_first=True, device=device)
    layer_options = dict(options)
    redraw = layer_options.pop("redraw_interval", 1000)
    return xtorch.MultiheadAttention(dim, heads, estimator=estimator, redraw_interval=redraw,
                                     batch_first=True, generator=generator, device=device,
                                     **layer_options)


class _Block(nn.Module):
    """Pre-norm Transformer layer: x + attention(norm(x)), then x + FFN(norm(x))."""

    def __init__(self, config: ModelConfig, estimator: str, options: dict[str, Any],
                 generator: torch.Generator, device: Any) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim, device=device)
        self.attention = attention_layer(config.dim, config.heads, estimator, options,
                                         generator, device)
        if config.equal_query_key_init:  # see ModelConfig
            with torch.no_grad():
                weight = self.attention.in_proj_weight  # packed [W_q; W_k; W_v]
                weight[config.dim:2 * config.dim].copy_(weight[:config.dim])
        self.ffn_norm = nn.LayerNorm(config.dim, device=device)
        self.ffn = nn.Sequential(nn.Linear(config.dim, config.ffn, device=device), nn.GELU(),
                                 nn.Linear(config.ffn, config.dim, device=device))

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        normed = self.attention_norm(x)
        x = x + self.attention(normed, normed, normed, key_padding_mask=padding,
                               need_weights=False)[0]
        return x + self.ffn(self.ffn_norm(x))


class Encoder(nn.Module):
    """The LRA encoder of :class:`xattn.training.loop.ModelConfig` for ``task``."""

    def __init__(self, task: Task, estimator: str, options: dict[str, Any], *,
                 config: ModelConfig, generator: torch.Generator, device: Any = None) -> None:
        super().__init__()
        self.per_token = task.per_token
        self.embeddings = nn.ModuleList(nn.Embedding(size, config.dim, device=device)
                                        for size in task.vocabulary_sizes)
        if config.token_init != "unit":  # "unit" is nn.Embedding's own N(0, 1) draw, as in 0.1
            with torch.no_grad():  # ModelConfig.token_init, from the global generator
                for embedding in self.embeddings:
                    cast(nn.Embedding, embedding).weight.normal_(0.0, config.token_std)
        # learned positions, initialized N(0, 1); none where the order carries no
        # information (mqar)
        self.position = nn.Parameter(torch.randn(task.length, config.dim, generator=generator)
                                     .to(device)) if task.positional else None
        self.blocks = nn.ModuleList(_Block(config, estimator, options, generator, device)
                                    for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim, device=device)
        self.classifier = nn.Sequential(
            nn.Linear(config.dim, config.ffn, device=device), nn.ReLU(),
            nn.Linear(config.ffn, task.num_classes, device=device))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = sum(embedding(tokens[..., field]) for field, embedding in enumerate(self.embeddings))
        if self.position is not None:
            x = x + self.position
        padding = None if mask is None else ~mask
        for block in self.blocks:
            x = block(x, padding)
        x = self.norm(x)
        if self.per_token:
            return self.classifier(x)  # (B, L, classes)
        if mask is None:
            pooled = x.mean(dim=1)
        else:
            weights = mask.to(x.dtype)[..., None]
            pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        return self.classifier(pooled)  # (B, classes)


class TorchTrainerBase:
    """What the PyTorch trainers share: the device and its peak-memory probe, the model
    drawn from the run's seed (:meth:`_seeded`), and the AdamW step (:meth:`_update`).

    A subclass sets ``model``, ``optimizer`` and ``clip_norm``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    clip_norm: float

    def __init__(self, device: str) -> None:
        # peak memory as xattn bench measures it: torch's CPU allocator (profiler) or CUDA
        self.backend = torch_memory(device)
        self.memory_method = self.backend.memory_method + " (one training step)"
        self.device = torch.device(self.backend.device)

    def _seeded(self, build: Callable[[torch.Generator], _Model], seed: int) -> _Model:
        """``build(generator)``, a model drawn from ``seed``: ``generator`` on the device
        and torch's global generator both seeded with it, the caller's global state kept."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        # nn.Linear / nn.Embedding draw their initialization from torch's global generator:
        # seed it inside fork_rng, which restores the caller's global state afterwards
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build(generator)

    def _update(self, loss: Callable[[], torch.Tensor], lr: float,
                measure_memory: bool) -> tuple[float, int | None]:
        """One AdamW step at learning rate ``lr`` on ``loss()`` (the model in training
        mode, the gradient norm clipped at ``clip_norm``); waits for it and returns its
        loss and, if ``measure_memory``, its peak memory in bytes (else None)."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        def update() -> float:
            value = loss()
            self.optimizer.zero_grad(set_to_none=True)
            value.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)
            self.optimizer.step()
            return float(value.detach())  # waits for the device

        if measure_memory:  # silenced: the profiler's notes on blocks allocated before it
            with native_stderr_silenced():
                return self.backend.peak_memory(update)
        return update(), None


class TorchTrainer(TorchTrainerBase):
    """AdamW steps and evaluation of an :class:`Encoder` (see ``Trainer``)."""

    model: Encoder

    def __init__(self, spec: RunSpec, device: str = "cpu") -> None:
        super().__init__(device)
        self.model = self._seeded(
            lambda generator: Encoder(spec.task, spec.estimator, spec.options,
                                      config=spec.model, generator=generator,
                                      device=self.device), spec.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.peak_lr,
                                           weight_decay=spec.weight_decay)
        self.clip_norm = spec.clip_norm

    def _inputs(self, data: Dataset) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = torch.as_tensor(data.tokens, dtype=torch.long, device=self.device)
        mask = None if data.mask is None else torch.as_tensor(data.mask, device=self.device)
        return tokens, mask

    def step(self, batch: Dataset, lr: float, *,
             measure_memory: bool = False) -> tuple[float, int | None]:
        tokens, mask = self._inputs(batch)
        targets = torch.as_tensor(batch.targets, device=self.device)

        def loss() -> torch.Tensor:
            logits = self.model(tokens, mask)
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               targets.reshape(-1), ignore_index=-1)

        return self._update(loss, lr, measure_memory)

    @torch.no_grad()
    def accuracy(self, data: Dataset, batch_size: int = 128, *,
                 sampled: bool = False) -> float:
        self.model.train(sampled)
        correct = counted = 0
        for start in range(0, len(data), batch_size):
            part = data.take(np.arange(start, min(len(data), start + batch_size)))
            logits = self.model(*self._inputs(part)).float().cpu().numpy()
            hits, total = accuracy_counts(logits, part.targets)
            correct, counted = correct + hits, counted + total
        return correct / max(counted, 1)


Trainer = TorchTrainer
