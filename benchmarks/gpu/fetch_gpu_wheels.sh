#!/usr/bin/env bash
# Fill benchmarks/wheels/ (git-ignored) with the pure-Python wheels that
# benchmarks/gpu/run_gpu.sh installs on a lent GPU machine, which has no network and lacks
# them: array-api-compat and array-api-extra (at the versions of constraints.txt), and
# performer-pytorch with its dependencies (optional: bench_gpu.py's comparison).
# xattn itself is not packed: run_gpu.sh puts the working tree's src/ on PYTHONPATH.
#
#     benchmarks/gpu/fetch_gpu_wheels.sh        # on a machine with the package index
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=benchmarks/wheels
mkdir -p "$WHEELS"
download() { "$PYTHON" -m pip download --no-deps --only-binary=:all: -d "$WHEELS" "$@"; }

download -c constraints.txt array-api-compat array-api-extra

# performer-pytorch 1.1.4 imports local_attention and axial_positional_embedding at import
# time; local-attention needs hyper-connections, which needs torch-einops-utils; all need
# einops (torch is on the GPU machine). It also imports distutils, which Python 3.12 has
# only where setuptools is installed; where it does not import, bench_gpu.py skips it.
if ! download performer-pytorch einops local-attention hyper-connections torch-einops-utils \
        axial-positional-embedding; then
    echo "fetch_gpu_wheels.sh: performer-pytorch or one of its dependencies is not" \
         "available; run_gpu.sh will run bench_gpu.py without performer-pytorch" >&2
fi
ls -l "$WHEELS"
