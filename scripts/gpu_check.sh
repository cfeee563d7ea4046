#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA and torch already installed:
# tests/gpu, the restore sweep, then bench/gpu.py within a time budget. Results go to $OUT (default ./gpu-out):
# pytest's log and JUnit XML, the bench's JSON and log. Exits with the tests' status.
#   OUT=/tmp/gpu-out scripts/gpu_check.sh   (caps: tests 150 s + sweep 60 s + bench 240+60 s = 510 s,
#   under a device command's 10 minutes; each stage is stopped with SIGINT, so its cleanup of
#   /dev/shm still runs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
BUDGET_S="${BUDGET_S:-240}"
TESTS_S="${TESTS_S:-150}"
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.txt" 2>&1 || true
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())" > "$OUT/torch.txt" 2>&1
{ free -g; df -h /dev/shm; nproc; } >> "$OUT/nvidia-smi.txt" 2>&1 || true
timeout -s INT -k 15 "$TESTS_S" python3 -m pytest -q tests/gpu -p no:cacheprovider -o timeout=90 --junitxml="$OUT/tests-gpu.xml" 2>&1 | tee "$OUT/tests-gpu.log"
rc=${PIPESTATUS[0]}
# Which bounce-buffer shape restores fastest (the real read path, several shapes; ~30 s)
timeout -s INT -k 15 "${SWEEP_S:-60}" python3 bench/gpu_restore_sweep.py --out "$OUT/restore-sweep.json" 2>&1 | tee "$OUT/restore-sweep.log"
timeout -s INT -k 15 $((BUDGET_S + 60)) python3 bench/gpu.py --budget-s "$BUDGET_S" --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu-bench.log"
echo "tests/gpu rc=$rc; bench rc=${PIPESTATUS[0]}"
exit "$rc"
