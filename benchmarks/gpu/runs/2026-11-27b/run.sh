#!/usr/bin/env bash
# The one device call of this run (a lent GPU, no network): the GPU test selection
# (CuPy, torch CUDA) and the decode benchmark through benchmarks/gpu/run_gpu.sh, then the
# non-causal forward against performer-pytorch and generation in a Hugging Face model.
#     benchmarks/gpu/runs/2026-11-27b/run.sh OUTDIR      (carry benchmarks/wheels)
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/../../../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONDONTWRITEBYTECODE=1
TEST_BACKENDS=cupy,torch-cuda TESTS_S=${TESTS_S:-100} WORKERS=16 BENCH_TORCH_S=0 CAUSAL_S=0 \
    BENCH_CUPY_S=0 BENCH_JAX_S=0 DECODE_S=${DECODE_S:-60} OPS_S=0 \
    bash benchmarks/gpu/run_gpu.sh "$OUT/run_gpu" > "$OUT/run_gpu.txt" 2>&1
tail -25 "$OUT/run_gpu.txt"
SITE=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$SITE" benchmarks/wheels/*.whl \
    > /dev/null 2>&1
export PYTHONPATH="$PWD/src:$SITE"
timeout 85 python3 benchmarks/gpu/bench_gpu.py --backends torch-cuda --dtypes float32,bfloat16 \
    --lengths 1024,4096,16384,65536 --methods "softmax (native),rfa (fixed omega),performer" \
    --repeats 3 --time-limit 0.2 --out "$OUT/bench_gpu_noncausal.json" \
    > "$OUT/bench_gpu_noncausal.txt" 2>&1
tail -30 "$OUT/bench_gpu_noncausal.txt"
timeout ${HF_S:-140} python3 benchmarks/models/bench_hf_generate.py --device cuda --width 512 \
    --layers 4 --heads 8 --lengths 256,2048,8192,32768 --new-tokens 256 --repeats 1 \
    --time-budget $(( ${HF_S:-140} - 25 )) --output "$OUT/hf_generate_cuda.json" \
    > "$OUT/hf_generate_cuda.txt" 2>&1
tail -20 "$OUT/hf_generate_cuda.txt"
tar -czf "$OUT/run_gpu.tgz" -C "$OUT" run_gpu && rm -rf "$OUT/run_gpu"
ls -la "$OUT"
