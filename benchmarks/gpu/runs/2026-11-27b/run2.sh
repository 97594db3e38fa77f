#!/usr/bin/env bash
# The second device call: generation in a Hugging Face model (the cache passed under the
# installed transformers' name), the Hugging Face tests under the machine's transformers,
# the decode benchmark again (torch.compile without warnings) and a kernel profile of
# the non-causal forward against performer-pytorch.
#     benchmarks/gpu/runs/2026-11-27b/run2.sh OUTDIR      (carry benchmarks/wheels)
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/../../../.."
export PYTHONDONTWRITEBYTECODE=1
SITE=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$SITE" benchmarks/wheels/*.whl \
    > /dev/null 2>&1
export PYTHONPATH="$PWD/src:$SITE"
python3 -c "import transformers; print('transformers', transformers.__version__)"
timeout 80 python3 benchmarks/models/bench_hf_generate.py --device cuda --width 512 \
    --layers 4 --heads 8 --lengths 256,2048,8192,32768 --new-tokens 256 --repeats 1 \
    --time-budget 60 --output "$OUT/hf_generate_cuda.json" > "$OUT/hf_generate_cuda.txt" 2>&1
tail -16 "$OUT/hf_generate_cuda.txt"
timeout 90 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_hf_cache.py \
    tests/test_transformers_hook.py > "$OUT/hf_tests.txt" 2>&1
tail -12 "$OUT/hf_tests.txt"
timeout 60 python3 benchmarks/models/bench_decode.py --backends torch --device cuda \
    --positions 1024,4096,16384,65536 --steps 15 --out "$OUT/decode_torch-cuda.json" \
    > "$OUT/decode_torch-cuda.txt" 2>&1
grep -c Warning "$OUT/decode_torch-cuda.txt"; tail -9 "$OUT/decode_torch-cuda.txt"
timeout 60 python3 benchmarks/gpu/profile_noncausal.py > "$OUT/profile.txt" 2>&1
grep -v "^-" "$OUT/profile.txt" | cut -c1-150 | head -70
