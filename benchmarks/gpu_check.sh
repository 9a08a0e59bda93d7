#!/usr/bin/env bash
# The GPU check of issue 21 on a lent device (run from the repository root, carrying .gpu from
# `python -m benchmarks.gpu_prepare`): installs the carried wheels beside the image's torch and triton, then runs
# benchmarks/gpu_check.py, writing $OUT/gpu_check.json (and kvquant.json, loadgen.json) after each part.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .gpu/wheels ]; then
    python3 -m pip install --quiet --no-index --no-deps --target /tmp/tsukimi-deps .gpu/wheels/*.whl
    export PYTHONPATH="/tmp/tsukimi-deps:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="/tmp/tsukimi-deps/bin:$PATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONUNBUFFERED=1 timeout 480 python3 -m benchmarks.gpu_check --out "$OUT/gpu_check.json" "$@"
