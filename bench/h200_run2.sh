#!/usr/bin/env bash
# Second H200 call: GPU tests, bench, calibration (the guard run came back from the first call).
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
[ -d .git ] || { git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base; }
CAND=tasks/k3_moe_dispatch/fixtures/good/triton-cuda
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu --format=csv
stage gpu tests
timeout 100 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider > "$OUT/pytest_gpu.txt" 2>&1; tail -3 "$OUT/pytest_gpu.txt"
stage bench
timeout ${BENCH_TIMEOUT:-200} python3 -m workbench bench k3_moe_dispatch --candidate "$CAND" --out "$OUT"
stage calibration
timeout ${CAL_TIMEOUT:-240} python3 -m guards.perf_calibration collect k3_moe_dispatch "$OUT/cal_raw.json" --aa ${CAL_AA:-40} --planted ${CAL_PLANTED:-20}
stage done
ls -la "$OUT"
