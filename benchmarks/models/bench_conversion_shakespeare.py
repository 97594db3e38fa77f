"""A causal model converted to random features without fine-tuning: the character-level
Shakespeare GPT with random and with calibrated (fitted) samples.

The model is the GPT of ``xattn train --task shakespeare`` (nanoGPT's pre-norm blocks,
:class:`xattn.training.lm_torch.GPT`), kept small so that it trains in minutes on 2 CPU
cores: 2 layers, width 64, 4 heads of 16 dimensions, context 64, trained with exact
softmax attention (``--steps``, default 2,000, nanoGPT's schedule and AdamW). Its weights
are then frozen and its attention replaced by ``xattn.rfa`` with S = 64 positive
orthogonal features, with no window and with a window of 16 plus 1 sink, in two ways:

* **random** samples: one orthogonal draw per layer (the layer's own features), and
* **fitted** samples: :func:`xattn.calibrate_omega` per layer and head (``(H, S, D)``), on
  the layer's queries, keys and values captured from the exact model on
  ``--calibration-windows`` training windows, starting from the same orthogonal draw.

Each layer is calibrated on the inputs of the *exact* model (every layer sees what it
saw during training). The figure is the validation loss (nats per character, the last
10 % of the text, the same 200 batches of 12 windows for every row) against the softmax
model's; random-sample rows are averaged over ``--draws`` draws.

Run::

    python benchmarks/models/bench_conversion_shakespeare.py          # trains, converts, writes
    python benchmarks/models/bench_conversion_shakespeare.py --quick  # a smoke test

The trained softmax model is kept at ``--checkpoint`` and reused when it exists.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import xattn
from xattn.training.lm import GPTConfig, LMSpec, estimate_loss, lm_learning_rate, random_windows
from xattn.training.lm_torch import GPT, TorchLMTrainer
from xattn.training.tasks import shakespeare

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
OUTPUT = HERE / "results" / "conversion_shakespeare.json"
MODEL = GPTConfig(layers=2, heads=4, dim=64)


def train_softmax(spec: LMSpec, checkpoint: Path) -> tuple[TorchLMTrainer, float]:
    """The softmax model, trained (or loaded from ``checkpoint``); its training seconds."""
    trainer = TorchLMTrainer(spec)
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        trainer.model.load_state_dict(saved["model"])
        return trainer, float(saved["train_s"])
    train, _ = shakespeare.split()
    rng = np.random.default_rng(spec.seed)
    tic = time.perf_counter()
    for step in range(spec.steps):
        loss, _ = trainer.step(*random_windows(train, spec.length, spec.batch_size, rng),
                               lm_learning_rate(step, spec))
        if step % 250 == 0:
            print(f"step {step}: training loss {loss:.3f}", flush=True)
    train_s = time.perf_counter() - tic
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": trainer.model.state_dict(), "train_s": train_s}, checkpoint)
    return trainer, train_s


def captured(model: GPT, windows: np.ndarray) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's per-head q, k, v ``(B, H, L, d)`` in the exact model on ``windows``."""
    layers = []
    with torch.no_grad():
        tokens = torch.as_tensor(windows, dtype=torch.long)
        x = model.token(tokens) + model.position.weight[:tokens.shape[1]]
        for block in model.blocks:
            attention = block.attention
            normed = block.attention_norm(x)
            heads = attention.num_heads
            qkv = torch.nn.functional.linear(normed, attention.in_proj_weight,
                                             attention.in_proj_bias)
            layers.append(tuple(part.unflatten(-1, (heads, -1)).transpose(1, 2)
                                for part in qkv.chunk(3, dim=-1)))
            x = block(x)
    return layers


def converted(spec: LMSpec, softmax: TorchLMTrainer, options: dict, seed: int,
              omegas: list[torch.Tensor] | None = None) -> TorchLMTrainer:
    """The softmax model's weights under ``rfa`` with ``options``: the layers' own random
    features (drawn from ``seed``) or the fitted ``omegas`` (one (H, S, d) per layer)."""
    trainer = TorchLMTrainer(replace(spec, name="rfa", estimator="rfa", seed=seed,
                                     options={**options, "redraw_interval": None}))
    trainer.model.load_state_dict(softmax.model.state_dict(), strict=False)
    if omegas is not None:
        for block, omega in zip(trainer.model.blocks, omegas, strict=True):
            block.attention.features = omega.detach().clone()
    trainer.model.eval()
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--checkpoint", type=Path,
                        default=Path("xattn-out") / "shakespeare_softmax_2x64.pt")
    parser.add_argument("--train-only", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calibration-windows", type=int, default=64)
    parser.add_argument("--fit-steps", type=int, default=300)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--eval-iters", type=int, default=200)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = LMSpec(name="softmax", estimator="softmax", options={}, seed=0,
                  steps=50 if args.quick else args.steps, model=MODEL)
    trainer, train_s = train_softmax(spec, args.checkpoint)
    if args.train_only:
        return
    train, val = shakespeare.split()
    iters = 5 if args.quick else args.eval_iters
    softmax_loss = estimate_loss(trainer, val, spec, iters)
    print(f"softmax: trained in {train_s:.0f} s, validation loss {softmax_loss:.4f}", flush=True)
    windows, _ = random_windows(train, spec.length, args.calibration_windows,
                                np.random.default_rng(99))
    layers = captured(trainer.model, windows)
    rows = []
    for window in (0, 16):
        options = {"num_features": 64, **({"window": window, "sinks": 1} if window else {})}
        random_losses = [estimate_loss(converted(spec, trainer, options, seed), val, spec, iters)
                         for seed in range(1 if args.quick else args.draws)]
        start = converted(spec, trainer, options, 0)
        omegas, reports, tic = [], [], time.perf_counter()
        for block, (q, k, v) in zip(start.model.blocks, layers, strict=True):
            initial = block.attention.features.expand(q.shape[1], -1, -1).contiguous()
            omega, report = xattn.calibrate_omega(
                q, k, v, num_features=64, window=window or None, sinks=1 if window else None,
                causal=True, omega=initial, steps=10 if args.quick else args.fit_steps)
            omegas.append(omega)
            reports.append(report.to_json())
        fit_s = time.perf_counter() - tic
        fitted_loss = estimate_loss(converted(spec, trainer, options, 0, omegas), val, spec,
                                    iters)
        row = {"window": window, "sinks": 1 if window else 0, "S": 64,
               "random_val_loss": random_losses, "random_val_loss_mean":
               float(np.mean(random_losses)), "fitted_val_loss": fitted_loss,
               "fit_seconds": fit_s, "fit_report_start_seed": 0,
               "layers": [{key: value for key, value in r.items()
                           if key not in ("head_errors_before", "head_errors_after")}
                          for r in reports]}
        rows.append(row)
        print(f"rfa S=64 window {window}: random {row['random_val_loss_mean']:.4f} "
              f"(draws {', '.join(f'{x:.3f}' for x in random_losses)}), fitted "
              f"{fitted_loss:.4f} ({fit_s:.0f} s to fit)", flush=True)
    results = {"model": {"layers": MODEL.layers, "heads": MODEL.heads, "dim": MODEL.dim,
                         "context": spec.length, "steps": spec.steps,
                         "train_seconds": train_s},
               "softmax_val_loss": softmax_loss, "eval_batches": iters,
               "batch_size": spec.batch_size,
               "calibration": {"windows": args.calibration_windows, "length": spec.length,
                               "steps": args.fit_steps, "learning_rate": 1e-2,
                               "holdout": 0.25, "patience": 50},
               "rows": rows,
               "environment": {"torch": torch.__version__, "python": platform.python_version()}}
    if not args.quick:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
