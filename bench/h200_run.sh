#!/usr/bin/env bash
# One call on the lent H200 (or any CUDA machine): GPU tests, the guards on the Triton candidate,
# the decode-batch benchmark and the perf-guard calibration; results land flat in $OUT.
#   bash bench/h200_run.sh            (from the repository root; OUT defaults to ./bench/out)
set -u
OUT=${OUT:-$PWD/bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
[ -d .git ] || { git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base; }
CAND=tasks/k3_moe_dispatch/fixtures/good/triton-cuda
stage env
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu --format=csv
stage gpu tests
timeout 150 python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider > "$OUT/pytest_gpu.txt" 2>&1; tail -5 "$OUT/pytest_gpu.txt"
stage workbench run
t0=$(date +%s)
timeout 200 python3 -m workbench run k3_moe_dispatch --candidate "$CAND" --device cuda --seed 3
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/run_result.json" 2>/dev/null
stage bench
timeout ${BENCH_TIMEOUT:-240} python3 -m workbench bench k3_moe_dispatch --candidate "$CAND" --out "$OUT"
stage calibration
timeout ${CAL_TIMEOUT:-150} python3 -m guards.perf_calibration collect k3_moe_dispatch "$OUT/cal_raw.json" --aa ${CAL_AA:-80} --planted ${CAL_PLANTED:-30}
stage done
ls -la "$OUT"
