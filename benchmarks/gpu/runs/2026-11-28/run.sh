#!/usr/bin/env bash
# One device call (a lent GPU, no network; carry benchmarks/wheels): causal RFA training
# against causal SDPA, its torch.profiler tables at 16k, the non-causal forward against
# performer-pytorch, the CuPy and JAX-GPU rows of bench_gpu.py and the decode step, each
# under its own time limit, the logs tarred into OUTDIR/run.tgz.
#     benchmarks/gpu/runs/2026-11-28/run.sh OUTDIR [SRC]
# SRC (default: the working tree's src/) is the xattn source to measure.
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../../.."
SRC=$(cd "${2:-src}" && pwd)
LOGS=$(mktemp -d)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
SITE=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$SITE" benchmarks/wheels/*.whl \
    > /dev/null 2>&1
export PYTHONPATH="$SRC:$SITE"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOGS/gpu.txt"
cat "$LOGS/gpu.txt"
step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$2 begin=$SECONDS
    shift 2
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - begin)) s"
    tail -n "${TAIL:-12}" "$LOGS/$name.txt"
}
step causal_rfa ${CAUSAL_S:-70} python3 benchmarks/ops/bench_causal_rfa.py --device cuda \
    --dtypes float32,bfloat16 --shape 4,8,64 --features 64 \
    --lengths 1024,4096,8192,16384 --runs 1 --repeats 3 --output "$LOGS/causal_rfa.json"
TAIL=60 step profile_causal ${PROFILE_S:-40} python3 benchmarks/gpu/profile_causal.py
step noncausal ${NONCAUSAL_S:-70} python3 benchmarks/gpu/bench_gpu.py --backends torch-cuda \
    --dtypes float32,bfloat16 --lengths 1024,4096,16384,65536 \
    --methods "softmax (native),rfa (fixed omega),performer" --repeats 3 --time-limit 0.2 \
    --out "$LOGS/bench_gpu_noncausal.json"
step cupy ${CUPY_S:-40} python3 benchmarks/gpu/bench_gpu.py --backends cupy --dtypes float32 \
    --lengths 1024,4096,16384 --ra-max 4096 --repeats 3 --time-limit 0.1 \
    --out "$LOGS/bench_gpu_cupy.json"
step jax ${JAX_S:-45} python3 benchmarks/gpu/bench_gpu.py --backends jax-gpu --dtypes float32 \
    --lengths 1024,4096,16384 --ra-max 4096 --repeats 3 --time-limit 0.1 \
    --out "$LOGS/bench_gpu_jax-gpu.json"
step decode ${DECODE_S:-45} python3 benchmarks/models/bench_decode.py --backends torch \
    --device cuda --positions 1024,16384,65536 --steps 15 --out "$LOGS/decode.json"
tar -czf "$OUT/run.tgz" -C "$LOGS" .
