#!/usr/bin/env bash
# The second device call: run.sh on the working tree (the new scan), the causal training
# benchmark again on the baseline source (BASELINE_SRC, carried; interleaved with the new
# one: new, baseline, new), then the GPU test selection (CuPy and torch CUDA, the whole
# suite; JAX GPU, the causal scan's files), each under its own limit, tarred into
# OUTDIR/benchmarks.tgz and OUTDIR/tests.tgz.
#     benchmarks/gpu/runs/2026-11-28/run_after.sh OUTDIR BASELINE_SRC
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
BASELINE=$(cd "$2" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../../.."
LOGS=$(mktemp -d)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
CAUSAL_S=60 PROFILE_S=35 NONCAUSAL_S=60 CUPY_S=35 JAX_S=40 DECODE_S=35 \
    bash "$HERE/run.sh" "$LOGS/new" > "$LOGS/run_new.txt" 2>&1
grep -E "^== |N = 16384|ratio|causal / SDPA" "$LOGS/run_new.txt" | head -40
SITE=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$SITE" benchmarks/wheels/*.whl \
    > /dev/null 2>&1
causal() {  # causal SRC NAME
    PYTHONPATH="$1:$SITE" timeout -k 5 60 python3 benchmarks/ops/bench_causal_rfa.py \
        --device cuda --dtypes float32,bfloat16 --shape 4,8,64 --features 64 \
        --lengths 4096,8192,16384 --runs 1 --repeats 3 --output "$LOGS/$2.json" \
        > "$LOGS/$2.txt" 2>&1
    echo "== $2: exit $?"; grep "median" "$LOGS/$2.txt"
}
causal "$BASELINE" causal_baseline_rerun
causal "$PWD/src" causal_new_rerun
tar -czf "$OUT/benchmarks.tgz" -C "$LOGS" .  # in case the tests run out of time
export PYTHONPATH="$PWD/src:$SITE"
XATTN_BACKENDS=cupy,torch-cuda timeout -s INT -k 20 110 python3 -m pytest -n 16 -q \
    -p no:cacheprovider > "$LOGS/tests_cupy_torch.txt" 2>&1
echo "== tests cupy, torch-cuda: exit $?"; tail -4 "$LOGS/tests_cupy_torch.txt"
XATTN_BACKENDS=jax-gpu timeout -s INT -k 20 80 python3 -m pytest -n 16 -q -p no:cacheprovider \
    tests/test_rfa.py tests/test_chunks.py tests/test_precision.py \
    > "$LOGS/tests_jax.txt" 2>&1
echo "== tests jax-gpu: exit $?"; tail -4 "$LOGS/tests_jax.txt"
tar -czf "$OUT/tests.tgz" -C "$LOGS" tests_cupy_torch.txt tests_jax.txt
