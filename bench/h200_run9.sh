#!/usr/bin/env bash
# H200 run 9 (issue 12): the judge's timing on CUDA (guards/judge.py: baseline child on the base tree,
# candidate child, the judge's wall clock per call, CUDA events as a second opinion), both Triton
# fixtures judged end to end, and the judged A/A + planted-slowdown calibration on one moe workload.
#   source .device/activate.sh && bash bench/h200_run9.sh      (from a copy of the repository root)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log9.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
PY=python3
if ! $PY -I -c "import pydantic" 2>/dev/null; then
  SP=$(python3 -I -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import sys; sys.path.insert(0, '/tmp/site')" > "$SP/zz_wb_device.pth" 2>/dev/null || echo "site-packages $SP not writable"
fi
if ! $PY -I -c "import pydantic" 2>/dev/null; then
  TS=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
  python3 -m venv --without-pip /tmp/wbvenv && PY=/tmp/wbvenv/bin/python3
  VSP=$($PY -I -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  printf "import sys; sys.path.insert(0, '/tmp/site')\nimport site; site.addsitedir('%s')\n" "$TS" > "$VSP/zz_wb_device.pth"
fi
rm -rf .git .workbench && git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base
$PY -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,temperature.gpu --format=csv
for t in k3_moe_dispatch k3_dspark_verify; do
  stage run $t
  t0=$(date +%s)
  timeout ${RUN_TIMEOUT:-200} $PY -m workbench run $t --candidate tasks/$t/fixtures/good/triton-cuda --device cuda --seed 9 --no-queue
  echo "verdict wall: $(( $(date +%s) - t0 )) s"
  cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/${t}_triton-cuda_run9.json" 2>/dev/null
done
stage calibration
timeout ${CAL_TIMEOUT:-150} $PY -m guards.perf_calibration collect-judged k3_moe_dispatch "$OUT/perf_calibration_judged_raw.json" --device cuda --aa ${AA:-40} --planted ${PL:-20} --workload k3_t8
$PY -m guards.perf_calibration evaluate "$OUT/perf_calibration_judged_raw.json" "$OUT/perf_calibration_judged.json"
stage done
ls -la "$OUT"
