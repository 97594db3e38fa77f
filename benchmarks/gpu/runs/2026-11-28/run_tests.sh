#!/usr/bin/env bash
# The third device call: the GPU test selection on the new scan, the whole suite for
# CuPy and torch CUDA, the causal scan's files for JAX GPU, each under its own limit
# (SIGINT first, so that pytest prints its summary); the logs in OUTDIR.
#     benchmarks/gpu/runs/2026-11-28/run_tests.sh OUTDIR        (carry benchmarks/wheels)
set -uo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "$0")/../../../.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONDONTWRITEBYTECODE=1
SITE=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$SITE" benchmarks/wheels/*.whl \
    > /dev/null 2>&1
export PYTHONPATH="$PWD/src:$SITE"
begin=$SECONDS
XATTN_BACKENDS=cupy,torch-cuda timeout -s INT -k 20 ${CUDA_S:-120} python3 -m pytest -n 16 -q \
    -p no:cacheprovider > "$OUT/tests_cupy_torch-cuda.txt" 2>&1
echo "== cupy, torch-cuda: exit $? after $((SECONDS - begin)) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests_cupy_torch-cuda.txt" | tail -25
begin=$SECONDS
XATTN_BACKENDS=jax-gpu timeout -s INT -k 20 ${JAX_S:-100} python3 -m pytest -n 8 -q \
    -p no:cacheprovider tests/test_rfa.py tests/test_chunks.py tests/test_precision.py \
    tests/test_nonfinite.py > "$OUT/tests_jax-gpu.txt" 2>&1
echo "== jax-gpu: exit $? after $((SECONDS - begin)) s"
grep -E "^(FAILED|ERROR)|passed|failed|node down|Unknown" "$OUT/tests_jax-gpu.txt" | tail -25
