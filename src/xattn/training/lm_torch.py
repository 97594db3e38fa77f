"""PyTorch side of ``xattn train --task shakespeare``: a causal GPT (nanoGPT's model, see
:class:`xattn.training.lm.GPTConfig`) with :class:`xattn.torch.MultiheadAttention`
(``is_causal=True``, no mask: the linear estimators never form an ``(L, L)`` array) or,
for the ``native`` row, :class:`torch.nn.MultiheadAttention` (with the causal
``attn_mask`` it needs, ``(L, L)``, counted in the memory estimate), and nanoGPT's AdamW
step."""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import torch
from torch import nn

import xattn.torch as xtorch
from xattn.training.encoder_torch import TorchTrainerBase, attention_layer, versions
from xattn.training.lm import GPTConfig, LMSpec, Sampler
from xattn.training.loop import NATIVE

__all__ = ["GPT", "TorchLMTrainer", "Trainer", "versions"]


class _Block(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + MLP(norm(x)) (nanoGPT's)."""

    def __init__(self, config: GPTConfig, estimator: str, options: dict[str, Any],
                 generator: torch.Generator, device: Any) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim, bias=False, device=device)
        self.attention = attention_layer(config.dim, config.heads, estimator, options,
                                         generator, device)
        self.ffn_norm = nn.LayerNorm(config.dim, bias=False, device=device)
        self.ffn_in = nn.Linear(config.dim, config.ffn, bias=False, device=device)
        self.ffn_out = nn.Linear(config.ffn, config.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.attention_norm(x)
        if isinstance(self.attention, xtorch.MultiheadAttention):
            # the estimator masks by itself (linear ones never form an L x L array)
            out = self.attention(normed, normed, normed, is_causal=True,
                                 need_weights=False)[0]
        else:  # torch.nn.MultiheadAttention takes is_causal only as a hint to a mask
            length = x.shape[1]
            mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            out = self.attention(normed, normed, normed, attn_mask=mask, is_causal=True,
                                 need_weights=False)[0]
        x = x + out
        return x + self.ffn_out(nn.functional.gelu(self.ffn_in(self.ffn_norm(x))))

    def step(self, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """The block on new tokens after those of ``state`` (the layer's generation)."""
        attention = cast(xtorch.MultiheadAttention, self.attention)  # not the native row
        out, state = attention.step(self.attention_norm(x), state)
        x = x + out
        return x + self.ffn_out(nn.functional.gelu(self.ffn_in(self.ffn_norm(x)))), state


class GPT(nn.Module):
    """nanoGPT's character model (:class:`~xattn.training.lm.GPTConfig`) at ``length``
    positions, the head tied to the token embedding."""

    def __init__(self, config: GPTConfig, length: int, estimator: str,
                 options: dict[str, Any], *, generator: torch.Generator,
                 device: Any = None) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocabulary, config.dim, device=device)
        self.position = nn.Embedding(length, config.dim, device=device)
        self.blocks = nn.ModuleList(_Block(config, estimator, options, generator, device)
                                    for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim, bias=False, device=device)
        residual_std = 0.02 / math.sqrt(2 * config.layers)
        with torch.no_grad():  # nanoGPT's initialization
            for name, parameter in self.named_parameters():
                if parameter.ndim < 2:
                    continue
                std = residual_std if name.endswith(("out_proj.weight", "ffn_out.weight")) \
                    else 0.02
                parameter.normal_(0.0, std, generator=generator)
            for module in self.modules():
                if isinstance(module, nn.MultiheadAttention | xtorch.MultiheadAttention):
                    for bias in (module.in_proj_bias, module.out_proj.bias):
                        if bias is not None:
                            bias.zero_()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.norm(x), self.token.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position.weight[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self._head(x)

    def step(self, tokens: torch.Tensor, states: list[Any] | None,
             offset: int) -> tuple[torch.Tensor, list[Any]]:
        """Logits of new tokens at positions ``offset, ...`` after the blocks' ``states``
        (None: a new sequence), and the states after them."""
        x = self.token(tokens) + self.position.weight[offset:offset + tokens.shape[1]]
        new_states = []
        for index, block in enumerate(self.blocks):
            x, state = cast(_Block, block).step(x, None if states is None else states[index])
            new_states.append(state)
        return self._head(x), new_states


class _StateSampler:
    """:class:`xattn.training.lm.Sampler` of a :class:`GPT` (evaluation mode)."""

    def __init__(self, trainer: TorchLMTrainer) -> None:
        self.trainer = trainer
        self.states: list[Any] | None = None
        self.position = 0

    @torch.no_grad()
    def _run(self, tokens: np.ndarray) -> np.ndarray:
        inputs = torch.as_tensor(tokens, dtype=torch.long, device=self.trainer.device)[None]
        logits, self.states = self.trainer.model.step(inputs, self.states, self.position)
        self.position += len(tokens)
        return logits[0, -1].float().cpu().numpy()

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        self.trainer.model.eval()
        self.states, self.position = None, 0
        return self._run(tokens)

    def advance(self, token: int) -> np.ndarray:
        return self._run(np.asarray([token]))


class TorchLMTrainer(TorchTrainerBase):
    """nanoGPT's AdamW steps, loss estimate and sampling of a :class:`GPT`."""

    model: GPT

    def __init__(self, spec: LMSpec, device: str = "cpu") -> None:
        super().__init__(device)
        self.estimator = spec.estimator
        self.model = self._seeded(
            lambda generator: GPT(spec.model, spec.length, spec.estimator, spec.options,
                                  generator=generator, device=self.device), spec.seed)
        # nanoGPT: weight decay on every parameter of 2 or more dimensions only
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": spec.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}], lr=spec.peak_lr, betas=spec.betas)
        self.clip_norm = spec.clip_norm

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, dtype=torch.long, device=self.device)

    def _loss(self, inputs: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        logits = self.model(self._tensor(inputs))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           self._tensor(targets).reshape(-1))

    def step(self, inputs: np.ndarray, targets: np.ndarray, lr: float, *,
             measure_memory: bool = False) -> tuple[float, int | None]:
        return self._update(lambda: self._loss(inputs, targets), lr, measure_memory)

    @torch.no_grad()
    def loss(self, inputs: np.ndarray, targets: np.ndarray) -> float:
        self.model.eval()
        return float(self._loss(inputs, targets))

    @torch.no_grad()
    def next_logits(self, tokens: np.ndarray) -> np.ndarray:
        self.model.eval()
        return self.model(self._tensor(tokens)[None])[0, -1].float().cpu().numpy()

    def state_sampler(self) -> Sampler | None:
        if self.estimator == NATIVE:  # torch.nn.MultiheadAttention has no generation state
            return None
        return _StateSampler(self)


Trainer = TorchLMTrainer
