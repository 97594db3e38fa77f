"""Generation in a Hugging Face model: tokens/s and cache bytes per attention (issue 41).

A tiny randomly initialized GPT-2 (``--width`` 64, ``--layers`` 2, ``--heads`` 4; or, with
``--model llama``, a Llama with ``--kv-heads`` key-value heads: grouped-query attention,
whose XattnCache states are held per key-value head) in evaluation mode, on ``--device``
(``cpu`` or ``cuda``) in ``--dtype``, takes a prompt of each ``--lengths`` (one sequence),
then generates ``--new-tokens`` tokens greedily, one forward pass per token, with:

* ``sdpa``: transformers' own attention and key-value cache (``DynamicCache``);
* ``xattn_softmax``: xattn's softmax through :class:`xattn.transformers.XattnCache` (its
  state is a key-value cache, :class:`xattn.SoftmaxState`);
* ``rfa_S64``: RFA with 64 features through the XattnCache (:class:`xattn.RFAState`,
  fixed size);
* ``rfa_S64_window64_sink1``: the same with ``window=64, sinks=1``;
* ``rfa_S64_recompute`` (``--recompute``): RFA with transformers' ``DynamicCache``, the
  hook recomputing the prefix at every step (the path without an XattnCache).

For each, the JSON gives the prefill time, the decoding rate (new tokens over the wall
time of the steps after the prefill, best of ``--repeats``; on CUDA the device is
synchronized before each clock reading) and the cache's bytes after the prefill and
after the last token. The JSON is rewritten after every row, so a run cut short keeps
the rows it finished; ``--time-budget`` seconds stops starting new rows. xattn's softmax
forms the L x L scores of its causal prefill, so its rows are left out after prompts
longer than ``--max-softmax-length`` (default 8192). One torch thread by default
(``--threads``). The default sizes run in under a minute on two cores; the issue's
lengths::

    python benchmarks/models/bench_hf_generate.py --recompute --repeats 3   # the default --output,
    #   benchmarks/results/hf_generate_results.json
    python benchmarks/models/bench_hf_generate.py --lengths 256,2048,8192 --output \
        benchmarks/results/hf_generate_long.json
    python benchmarks/models/bench_hf_generate.py --lengths 32768 --repeats 1 \
        --attentions sdpa,rfa_S64,rfa_S64_window64_sink1 \
        --output benchmarks/results/hf_generate_32k.json

Each run also draws its figure beside the JSON (``.png``: tokens/s and cache bytes against
the prompt length; ``--plot JSON`` draws it again from a JSON). On a GPU, a 4-layer,
512-wide GPT-2 (head size 64); ``--time-budget`` stops starting rows after 150 s, so that
the run stays near two minutes
(``benchmarks/results/gpu/2026-11-27b/hf_generate_h100.json``: 32 s on an H100)::

    python benchmarks/models/bench_hf_generate.py --device cuda --width 512 --layers 4 \
        --heads 8 --lengths 256,2048,8192,32768 --new-tokens 256 --repeats 1 \
        --time-budget 150 --output benchmarks/results/hf_generate_cuda.json

The decoding rates of a tiny model are mostly Python overhead per step and move by up to
2x from run to run on a loaded machine; the cache bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "hf_generate_results.json"
ATTENTIONS = ("sdpa", "xattn_softmax", "rfa_S64", "rfa_S64_window64_sink1")


def register_attentions():
    """The xattn attention names, registered once."""
    import xattn.transformers as xt

    return {
        "xattn_softmax": xt.register("bench_xattn_softmax", estimator="softmax").name,
        "rfa_S64": xt.register("bench_xattn_rfa64", estimator="rfa", num_features=64).name,
        "rfa_S64_window64_sink1": xt.register("bench_xattn_rfa64_w64_s1", estimator="rfa",
                                              num_features=64, window=64, sinks=1).name,
    }


def cache_bytes(cache):
    """Bytes of a transformers DynamicCache (keys and values) or of an XattnCache."""
    import xattn.transformers as xt

    if isinstance(cache, xt.XattnCache):
        return cache.nbytes
    return sum(layer.keys.numel() * layer.keys.element_size()
               + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers if layer.keys is not None)


def clock(device):
    """``time.perf_counter()`` after the work queued on ``device`` is done."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def plot(report, path):
    """Tokens/s and cache bytes at the end against the prompt length, one line per
    attention (``path``: a PNG)."""
    from xattn.cli.figures import loglog_axes, new_figure

    figure, (rate_axis, bytes_axis) = new_figure(ncols=2, width=5.5, height=4.2)
    for attention in dict.fromkeys(row["attention"] for row in report["rows"]):
        rows = sorted((row for row in report["rows"] if row["attention"] == attention),
                      key=lambda row: row["prompt_length"])
        lengths = [row["prompt_length"] for row in rows]
        rate_axis.plot(lengths, [row["tokens_per_s"] for row in rows], marker="o",
                       label=attention)
        bytes_axis.plot(lengths, [max(row["cache_bytes_at_end"], 1) / 2**20 for row in rows],
                        marker="o", label=attention)
    loglog_axes(rate_axis, "prompt length (tokens)", "greedy generation (tokens/s)")
    loglog_axes(bytes_axis, "prompt length (tokens)", "cache after the last token (MiB)")
    rate_axis.legend(fontsize=8)
    model = report["model"]
    figure.suptitle(f"{model['type']} ({model['layers']} layers, width {model['width']}, "
                    f"{model['dtype']}) on {report['device_name']}", fontsize=10)
    figure.savefig(path, dpi=110)


def cache_keyword(model):
    """The forward pass's name for the cache: ``cache`` (transformers >= 5.2x) or the
    earlier ``past_key_values``, which later versions still accept."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else (
        "past_key_values")


def generate_once(model, prompt, new_tokens, make_cache):
    """Prefill, then ``new_tokens`` greedy steps; returns the times and cache bytes."""
    import torch

    cache = make_cache()
    keyword = cache_keyword(model)
    with torch.no_grad():
        start = clock(prompt.device)
        logits = model(prompt, **{keyword: cache}).logits[:, -1]
        prefill = clock(prompt.device) - start
        prefill_bytes = cache_bytes(cache)
        start = clock(prompt.device)
        for _ in range(new_tokens):
            token = logits.argmax(-1, keepdim=True)
            logits = model(token, **{keyword: cache}).logits[:, -1]
        steps = clock(prompt.device) - start
    return prefill, steps, prefill_bytes, cache_bytes(cache)


def measure(model, attention, implementation, length, new_tokens, repeats, vocab, device):
    import torch
    from transformers import DynamicCache

    import xattn.transformers as xt

    model.set_attn_implementation(implementation)
    xattn_cache = attention not in ("sdpa", "rfa_S64_recompute")
    make_cache = xt.XattnCache if xattn_cache else (lambda: DynamicCache(config=model.config))
    prompt = torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    generate_once(model, prompt[:, :8], 2, make_cache)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best = None
    for _ in range(repeats):
        result = generate_once(model, prompt, new_tokens, make_cache)
        if best is None or result[1] < best[1]:
            best = result
    prefill, steps, prefill_bytes, final_bytes = best
    return {"attention": attention, "prompt_length": length, "new_tokens": new_tokens,
            "cache": "XattnCache" if xattn_cache else "DynamicCache",
            "prefill_s": prefill, "decode_s": steps, "tokens_per_s": new_tokens / steps,
            "cache_bytes_after_prefill": prefill_bytes, "cache_bytes_at_end": final_bytes,
            "peak_device_bytes": (torch.cuda.max_memory_allocated(device)
                                  if device.type == "cuda" else None)}


def build_model(args, vocab, max_positions):
    """The randomly initialized decoder of ``args`` (seed 0), in evaluation mode."""
    import torch
    import transformers

    if args.model == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=args.width,
                                         n_layer=args.layers, n_head=args.heads,
                                         n_positions=max_positions, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model_class = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=args.width,
                                          intermediate_size=4 * args.width,
                                          num_hidden_layers=args.layers,
                                          num_attention_heads=args.heads,
                                          num_key_value_heads=args.kv_heads or args.heads,
                                          max_position_embeddings=max_positions,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    return model_class(config).to(device=args.device, dtype=dtype).eval(), config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,256", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key-value heads of --model llama (default: --heads)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        default="float32")
    parser.add_argument("--attentions", default=",".join(ATTENTIONS),
                        help=f"comma-separated, of {', '.join(ATTENTIONS)}, rfa_S64_recompute")
    parser.add_argument("--recompute", action="store_true",
                        help="add rfa_S64_recompute (RFA with transformers' DynamicCache)")
    parser.add_argument("--max-softmax-length", type=int, default=8192,
                        help="leave xattn_softmax out after longer prompts (its causal "
                             "prefill forms the L x L scores)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; no new row starts after this (rows done are kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steps of a tiny model gain nothing "
                             "from more, and a shared machine's load moves them less)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=None, metavar="JSON",
                        help="only draw the figure of a JSON this script wrote (beside it)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    if args.kv_heads is not None and args.model != "llama":
        parser.error("--kv-heads needs --model llama")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")

    lengths = [int(length) for length in args.lengths.split(",")]
    attentions = args.attentions.split(",") + (["rfa_S64_recompute"] if args.recompute else [])
    names = register_attentions()
    names["sdpa"] = "sdpa"
    names["rfa_S64_recompute"] = names["rfa_S64"]
    unknown = [attention for attention in attentions if attention not in names]
    if unknown:
        parser.error(f"unknown attentions {unknown}; choose among {sorted(names)}")
    vocab = 100
    model, config = build_model(args, vocab, max(lengths) + args.new_tokens + 1)
    report = {"benchmark": "bench_hf_generate", "model": {
                  "type": type(model).__name__, "width": args.width, "layers": args.layers,
                  "heads": args.heads, "kv_heads": getattr(config, "num_key_value_heads",
                                                           args.heads),
                  "dtype": args.dtype},
              "device": args.device,
              "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                              else platform.processor() or platform.machine()),
              "torch_threads": torch.get_num_threads(),
              "cpu_count": os.cpu_count(), "platform": platform.platform(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "repeats": args.repeats, "complete": False, "skipped": [], "rows": []}
    started = time.perf_counter()
    for length in lengths:
        for attention in attentions:
            if attention == "xattn_softmax" and length > args.max_softmax_length:
                report["skipped"].append({"attention": attention, "prompt_length": length,
                                          "reason": "--max-softmax-length"})
                continue
            if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                report["skipped"].append({"attention": attention, "prompt_length": length,
                                          "reason": "--time-budget"})
                continue
            row = measure(model, attention, names[attention], length, args.new_tokens,
                          args.repeats, vocab, device)
            report["rows"].append(row)
            args.output.write_text(json.dumps(report, indent=2) + "\n")
            print(f"{attention:>24} prompt {length:>6}: {row['tokens_per_s']:8.1f} tokens/s, "
                  f"prefill {row['prefill_s']:.3f} s, cache {row['cache_bytes_after_prefill']}"
                  f" -> {row['cache_bytes_at_end']} bytes", flush=True)
    report["complete"] = all(skip["reason"] != "--time-budget" for skip in report["skipped"])
    report["wall_s"] = time.perf_counter() - started
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and its .png ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
