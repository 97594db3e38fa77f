#!/usr/bin/env bash
# A wheel that works: build the sdist and the wheel (python -m build), check their file
# lists (.ci/check_wheel_contents.py), install the wheel (not editable) with the cli and
# torch extras into a fresh virtual environment, and run the installed `xattn` from a
# folder outside the repository: --version, `compare` on a small input, and a short
# `train` on the digits task (its data ship in the wheel). Everything it writes goes to a
# temporary folder that is removed at the end; the repository gets only the ignored
# src/xattn.egg-info of the sdist build. About half a minute with the wheels at hand.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${PYTHON:-python3}
start=$SECONDS

work=$(mktemp -d "${TMPDIR:-/tmp}/xattn-wheel-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH PYTHONHOME
step() { printf '\n== wheel check: %s (%d s)\n' "$1" $((SECONDS - start)); }

step "build the sdist and the wheel"
"$python" -m venv "$work/build-env"
"$work/build-env/bin/python" -m pip install -q -c "$repo/constraints.txt" build
"$work/build-env/bin/python" -m build --outdir "$work/dist" "$repo"

step "check their file lists"
"$work/build-env/bin/python" .ci/check_wheel_contents.py "$work/dist"
version=$("$work/build-env/bin/python" .ci/check_wheel_contents.py --print-version)
wheel=$(ls "$work"/dist/xattn-*.whl)

step "install the wheel into a fresh virtual environment"
"$python" -m venv "$work/venv"
py=$work/venv/bin/python
"$py" -m pip install -q --no-compile -c "$repo/constraints.txt" "$wheel[cli,torch]"
"$py" -m pip check
xattn=$work/venv/bin/xattn

step "run the installed package from outside the repository"
mkdir "$work/run"
cd "$work/run"
fail() { echo "wheel check: $*" >&2; exit 1; }

out=$("$xattn" --version)
[[ $out == "xattn $version" ]] || fail "xattn --version printed '$out', expected 'xattn $version'"
"$py" - "$version" <<'EOF'
import importlib.metadata
import sys
import sysconfig
from pathlib import Path

import xattn

site = Path(sysconfig.get_paths()["purelib"]).resolve()
module = Path(xattn.__file__).resolve()
print(f"xattn {xattn.__version__} imported from {module}")
assert module.is_relative_to(site), f"xattn imported from {module}, not from {site}"
assert xattn.__version__ == importlib.metadata.version("xattn") == sys.argv[1]
EOF

# compare: 2 heads, N = M = 32, D = 8; two sample counts, two draws per cell
"$py" -c "
import numpy as np
rng = np.random.default_rng(0)
np.savez('small.npz', **{name: rng.normal(size=(2, 32, 8)) for name in 'qkv'})"
"$xattn" compare --input small.npz --samples 4,8 --draws 2 --out compare --no-progress
# train: digits (the packaged digits.npz), LARA through the torch layer, one seed, 5 steps
"$xattn" train --framework torch --task digits --estimators lara --seeds 0 --steps 5 \
    --threads 1 --out train --no-progress
"$py" - <<'EOF'
import json
import math
from pathlib import Path

compare = json.loads(Path("compare/compare.json").read_text())
assert compare, "compare.json is empty"
assert Path("compare/compare.png").stat().st_size > 0
train = json.loads(Path("train/train.json").read_text())
runs = train["runs"]
assert runs, "train.json has no run"
for run in runs:
    assert run["task"] == "digits" and run["estimator"] == "lara" and run["steps"] == 5, run
    assert 0 <= run["test_accuracy"] <= 1 and math.isfinite(run["final_train_loss"]), run
print(f"compare.json written; train.json: {len(runs)} digits runs")
EOF

step "passed"
