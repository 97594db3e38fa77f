#!/usr/bin/env bash
# One command for a lent GPU machine (no network): the GPU test selection, then the GPU
# benchmarks, everything written to OUTDIR, in under 10 minutes.
#
#     benchmarks/gpu/fetch_gpu_wheels.sh     # beforehand, on a machine with the package index
#     benchmarks/gpu/run_gpu.sh OUTDIR [PYTEST_ARGUMENTS...]   # on the GPU machine
#
# Setup: the wheels of benchmarks/wheels/ are installed (--no-deps, offline) into a
# temporary folder, which goes on PYTHONPATH with the working tree's src/. Then each
# stage runs under its own time limit (SIGTERM, then SIGKILL 10 s later; for pytest
# SIGINT, so that it can print its summary, and SIGKILL 20 s later), its output in
# OUTDIR/<stage>.log; a failing or stopped stage does not stop the next. OUTDIR/stages.tsv
# has each stage's exit status (124: stopped at its limit) and seconds. The tests also
# write OUTDIR/test_outcomes.txt (one line per finished test) and OUTDIR/tests_summary.txt
# (counts per GPU backend and the failures, also after a cut-off). The exit status is
# nonzero only when the setup fails. The limits (seconds) can be changed through the
# environment: TESTS_S, BENCH_TORCH_S, CAUSAL_S, BENCH_CUPY_S, BENCH_JAX_S, DECODE_S, OPS_S
# (0 skips that benchmark stage); the
# number of pytest workers through WORKERS (default 12), the test stage's backends through
# TEST_BACKENDS (default cupy,torch-cuda,jax-gpu). Arguments after OUTDIR go to
# pytest (for example -m "not slow").
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: benchmarks/gpu/run_gpu.sh OUTDIR [PYTEST_ARGUMENTS...]" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd) || exit 2
shift
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
WORKERS=${WORKERS:-12}
# the limits in seconds, the stages' including the time before SIGKILL: setup 25 (pip)
# + 20 (import check) + 10 (nvidia-smi) + 30 (versions), tests 220, benchmarks 65 + 45
# + 110 (compiled) + 25 + 35 + 70 + 30 (10 of them for bench_ops.py --help), summary 10:
# 575 in all
TESTS_S=${TESTS_S:-100}
BENCH_TORCH_S=${BENCH_TORCH_S:-65}
CAUSAL_S=${CAUSAL_S:-45}
COMPILED_S=${COMPILED_S:-110}
BENCH_CUPY_S=${BENCH_CUPY_S:-25}
BENCH_JAX_S=${BENCH_JAX_S:-35}
DECODE_S=${DECODE_S:-70}
OPS_S=${OPS_S:-30}
GPU_BACKENDS=cupy,torch-cuda,jax-gpu
TEST_BACKENDS=${TEST_BACKENDS:-$GPU_BACKENDS}  # the backends of the test stage

export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the pytest workers share the GPU
export PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
STAMP=$(mktemp) || exit 2
printf 'stage\tstatus\tseconds\n' > "$OUT/stages.tsv"

# stage NAME LIMIT COMMAND...: run COMMAND with at most LIMIT seconds (the signal
# STAGE_SIGNAL, default TERM, at LIMIT - STAGE_GRACE, default 10, then SIGKILL), its
# output shown and written to OUT/NAME.log
stage() {
    local name=$1 limit=$2 begin=$SECONDS status grace=${STAGE_GRACE:-10}
    shift 2
    echo "== $name (at most $limit s): $*"
    timeout -s "${STAGE_SIGNAL:-TERM}" -k "$grace" $((limit - grace)) "$@" 2>&1 \
        | tee "$OUT/$name.log"
    status=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$status" $((SECONDS - begin)) >> "$OUT/stages.tsv"
    echo "== $name: exit status $status after $((SECONDS - begin)) s"
    return "$status"
}

# --- setup: the carried wheels, offline, into a temporary folder -----------------------
SITE=$(mktemp -d) || exit 2
shopt -s nullglob
wheels=(benchmarks/wheels/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
    if ! timeout 25 "$PYTHON" -m pip install --no-deps --no-index --no-compile \
            --disable-pip-version-check --target "$SITE" "${wheels[@]}" \
            > "$OUT/setup.log" 2>&1; then
        # no pip: a pure-Python wheel is a zip of what it installs
        echo "pip failed (see $OUT/setup.log); unpacking the wheels instead"
        for wheel in "${wheels[@]}"; do
            "$PYTHON" -m zipfile -e "$wheel" "$SITE" || exit 2
        done
    fi
else
    echo "no wheels in benchmarks/wheels (run benchmarks/gpu/fetch_gpu_wheels.sh beforehand)"
fi
export PYTHONPATH="$ROOT/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! timeout 20 "$PYTHON" -c "import array_api_compat, array_api_extra, xattn" \
        >> "$OUT/setup.log" 2>&1; then
    echo "setup failed: array-api-compat, array-api-extra or xattn does not import" >&2
    cat "$OUT/setup.log" >&2
    exit 1
fi
timeout 10 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
timeout 30 "$PYTHON" - > "$OUT/environment.txt" 2>&1 <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("xattn", "numpy", "array_api_compat", "array_api_extra", "torch", "jax",
             "cupy", "flax", "pytest", "xdist", "hypothesis", "performer_pytorch"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as error:
        print(name, "-", type(error).__name__, error)
EOF
cat "$OUT/environment.txt"
printf 'setup\t0\t%s\n' $((SECONDS - START)) >> "$OUT/stages.tsv"

# --- the GPU test selection (cupy, torch-cuda, jax-gpu), one line per finished test ----
# SIGINT stops pytest with its summary, also where the caller started this script with
# SIGINT ignored: the handler is set again before pytest starts (its workers inherit it);
# pytest-xdist then gives its workers 10 s to stop
PYTEST=(-c "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)
import pytest; sys.exit(pytest.main())")
XATTN_BACKENDS=$TEST_BACKENDS XATTN_TEST_LOG="$OUT/test_outcomes.txt" STAGE_SIGNAL=INT \
    STAGE_GRACE=20 stage tests "$TESTS_S" "$PYTHON" "${PYTEST[@]}" -n "$WORKERS" -v \
    --durations=25 -p no:cacheprovider "$@"
timeout 10 "$PYTHON" benchmarks/summarize_test_log.py "$OUT/test_outcomes.txt" \
    "$OUT/tests.log" > "$OUT/tests_summary.txt" 2>&1

# --- benchmarks: each backend in its own stage ------------------------------------------
# a stage whose limit is 0 is skipped
LENGTHS=1024,4096,16384,65536
[ "$BENCH_TORCH_S" -gt 0 ] && stage bench_gpu_torch-cuda "$BENCH_TORCH_S" "$PYTHON" \
    benchmarks/gpu/bench_gpu.py --backends torch-cuda --dtypes float32,bfloat16 \
    --lengths $LENGTHS --ra-max 4096 --repeats 3 --time-limit 0.1 \
    --out "$OUT/bench_gpu_torch-cuda.json"
# causal RFA S = 64 in training (forward + backward) against causal SDPA
[ "$CAUSAL_S" -gt 0 ] && stage causal_rfa_torch-cuda "$CAUSAL_S" "$PYTHON" \
    benchmarks/ops/bench_causal_rfa.py --device cuda --dtypes float32,bfloat16 --shape 4,8,64 \
    --features 64 --lengths 1024,4096,16384 --runs 1 --repeats 3 \
    --output "$OUT/causal_rfa_torch-cuda.json"
# the same compiled whole (torch.compile, inductor) beside eager and FlashAttention, and
# the decode step under mode="reduce-overhead" (CUDA graphs)
[ "$COMPILED_S" -gt 0 ] && stage causal_rfa_compiled_torch-cuda "$COMPILED_S" "$PYTHON" \
    benchmarks/ops/bench_causal_rfa.py --compile --device cuda --dtypes bfloat16,float32 \
    --shape 4,8,64 --features 64 --lengths 4096,16384 --runs 1 --repeats 3 \
    --output "$OUT/causal_rfa_compiled_torch-cuda.json"
[ "$BENCH_CUPY_S" -gt 0 ] && stage bench_gpu_cupy "$BENCH_CUPY_S" "$PYTHON" \
    benchmarks/gpu/bench_gpu.py --backends cupy --dtypes float32 --lengths $LENGTHS \
    --ra-max 4096 --repeats 3 --time-limit 0.1 --out "$OUT/bench_gpu_cupy.json"
[ "$BENCH_JAX_S" -gt 0 ] && stage bench_gpu_jax-gpu "$BENCH_JAX_S" "$PYTHON" \
    benchmarks/gpu/bench_gpu.py --backends jax-gpu --dtypes float32 --lengths 1024,4096,16384 \
    --ra-max 4096 --repeats 3 --time-limit 0.1 --out "$OUT/bench_gpu_jax-gpu.json"
# per-token decoding on torch-CUDA, eager and torch.compile(fullgraph=True)
[ "$DECODE_S" -gt 0 ] && stage decode_torch-cuda "$DECODE_S" "$PYTHON" \
    benchmarks/models/bench_decode.py --backends torch --device cuda --positions $LENGTHS \
    --steps 15 --out "$OUT/decode_torch-cuda.json"
if [ "$OPS_S" -gt 10 ] && [ -f benchmarks/ops/bench_ops.py ]; then
    ops_args=()
    ops_help=$(timeout 10 "$PYTHON" benchmarks/ops/bench_ops.py --help 2>&1)
    case $ops_help in *--backends*) ops_args+=(--backends "$GPU_BACKENDS") ;; esac
    case $ops_help in *--out*) ops_args+=(--out "$OUT/ops_results.json") ;; esac
    stage bench_ops $((OPS_S - 10)) "$PYTHON" benchmarks/ops/bench_ops.py \
        ${ops_args[@]+"${ops_args[@]}"}
fi

# results that a script wrote to its default place (benchmarks/results/) rather than to OUT
find benchmarks/results -maxdepth 1 -type f \( -name '*.json' -o -name '*.png' \) -newer "$STAMP" \
    -exec cp {} "$OUT/" \;
rm -rf "$STAMP" "$SITE"

echo "== tests per backend ($OUT/tests_summary.txt)"
cat "$OUT/tests_summary.txt"
echo "== stages ($OUT/stages.tsv), $((SECONDS - START)) s in all"
cat "$OUT/stages.tsv"
exit 0
