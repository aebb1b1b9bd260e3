#!/usr/bin/env bash
# H200 call for k3_dspark_verify: GPU tests, the guards on the Triton candidate, the decode-batch
# benchmark; results land flat in $OUT.   bash bench/h200_run5.sh   (from the repository root)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
[ -d .git ] || { git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base; }
CAND=tasks/k3_dspark_verify/fixtures/good/triton-cuda
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu --format=csv
stage gpu tests
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/tasks/test_k3_dspark_verify_triton.py -p no:cacheprovider > "$OUT/pytest_gpu.txt" 2>&1; tail -15 "$OUT/pytest_gpu.txt"
stage workbench run
t0=$(date +%s)
timeout ${RUN_TIMEOUT:-200} python3 -m workbench run k3_dspark_verify --candidate "$CAND" --device cuda --seed 5 --no-queue
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/run_result.json" 2>/dev/null
stage bench
timeout ${BENCH_TIMEOUT:-200} python3 -m workbench bench k3_dspark_verify --candidate "$CAND" --out "$OUT" --repetitions ${REPS:-100}
stage done
ls -la "$OUT"
