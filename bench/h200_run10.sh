#!/usr/bin/env bash
# H200 run 10 (issue 12): host cost of a call with and without the runtime hooks (bench/judge_overhead.py),
# then the judged A/A + planted-slowdown calibration on one moe workload (guards/perf_calibration.py).
#   source .device/activate.sh && bash bench/h200_run10.sh      (from a copy of the repository root)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log10.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
PY=python3
if ! $PY -I -c "import pydantic" 2>/dev/null; then
  SP=$(python3 -I -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import sys; sys.path.insert(0, '/tmp/site')" > "$SP/zz_wb_device.pth" 2>/dev/null || echo "site-packages $SP not writable"
fi
rm -rf .git .workbench && git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base
stage overhead
timeout 120 $PY bench/judge_overhead.py "$OUT/judge_overhead_cuda.json" cuda
[ -n "${ONLY_OVERHEAD:-}" ] && exit 0
stage calibration
timeout ${CAL_TIMEOUT:-400} $PY -m guards.perf_calibration collect-judged k3_moe_dispatch "$OUT/perf_calibration_judged_raw.json" --device cuda --aa ${AA:-20} --planted ${PL:-10} --workload k3_t8
$PY -m guards.perf_calibration evaluate "$OUT/perf_calibration_judged_raw.json" "$OUT/perf_calibration_judged.json"
stage done
