#!/usr/bin/env bash
# Third H200 call: the benchmark, the guards again under the calibrated CUDA thresholds, more A/A trials.
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
[ -d .git ] || { git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base; }
CAND=tasks/k3_moe_dispatch/fixtures/good/triton-cuda
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu --format=csv
stage bench
timeout ${BENCH_TIMEOUT:-200} python3 -m workbench bench k3_moe_dispatch --candidate "$CAND" --out "$OUT"
stage workbench run
t0=$(date +%s)
timeout 150 python3 -m workbench run k3_moe_dispatch --candidate "$CAND" --device cuda --seed 11
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/run_result.json" 2>/dev/null
stage calibration
timeout ${CAL_TIMEOUT:-150} python3 -m guards.perf_calibration collect k3_moe_dispatch "$OUT/cal_raw2.json" --aa ${CAL_AA:-60} --planted ${CAL_PLANTED:-0}
stage done
ls -la "$OUT"
