#!/usr/bin/env bash
# Every benchmark, one after another (never two at once: they share the 2 cores).
# Usage: bench/run_all.sh [OUT_DIR]   (results as .txt and .json in OUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
run() { name=$1; shift; echo "== $name: $*"; "$py" "bench/$name.py" "$@" --json "$out/$name.json" 2>&1 | tee "$out/$name.txt"; }
run save_overhead
run training_slowdown
run coordination_scale
run recovery
run reshard_planner
run recovery_reshard
run persistent
# On a machine with CUDA: the GPU benches too (they need no other setup).
if "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "== gpu"; "$py" bench/gpu.py --out "$out/gpu.json" 2>&1 | tee "$out/gpu.txt"
    echo "== gpu_overlap"; "$py" bench/gpu_overlap.py --out "$out/gpu_overlap.json" 2>&1 | tee "$out/gpu_overlap.txt"
fi
