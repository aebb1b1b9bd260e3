#!/usr/bin/env bash
# H200 run 6 (issue 3, the missing part): the split-vocabulary k3_dspark_verify Triton kernel and the
# k3_moe_dispatch fill attempt (rejected in call 2 and reverted: the moe stages now judge the accepted
# kernel). Microbenchmark and checks (bench/dspark_micro.py), both guard verdicts (timed), both
# decode-batch benchmarks. Results land flat in $OUT (8 files at most).
#   source .device/activate.sh && bash bench/h200_run6.sh      (from a copy of the repository root)
# Guard children start with `python -I` and the bench child with its own PYTHONPATH, so the carried
# packages k3_model imports (pydantic, in /tmp/site after .device/activate.sh) must be on python3's
# path without PYTHONPATH: a .pth in its site-packages puts /tmp/site first; if that folder is not
# writable, a venv of the base interpreter does the same and adds the image's site-packages.
# (Call 1 of this script used `pip install` there: it landed outside the -I path.)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
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
$PY -I -c "import pydantic, torch, triton; print('python -I sees pydantic', pydantic.VERSION, 'torch', torch.__version__)"
[ -d .git ] || { git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base; }
DS=tasks/k3_dspark_verify/fixtures/good/triton-cuda
MOE=tasks/k3_moe_dispatch/fixtures/good/triton-cuda
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu --format=csv
stage micro
timeout ${MICRO_TIMEOUT:-60} $PY bench/dspark_micro.py "$OUT/micro.json" ${MICRO_REPS:-30}
stage run k3_dspark_verify
t0=$(date +%s)
timeout ${RUN_TIMEOUT:-120} $PY -m workbench run k3_dspark_verify --candidate "$DS" --device cuda --seed 6 --no-queue
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/dspark_run.json" 2>/dev/null
stage bench k3_dspark_verify
timeout ${BENCH_TIMEOUT:-100} $PY -m workbench bench k3_dspark_verify --candidate "$DS" --out "$OUT" --repetitions ${REPS:-60} --no-compile
stage run k3_moe_dispatch
t0=$(date +%s)
timeout ${MOE_RUN_TIMEOUT:-110} $PY -m workbench run k3_moe_dispatch --candidate "$MOE" --device cuda --seed 6 --no-queue
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/moe_run.json" 2>/dev/null
stage bench k3_moe_dispatch
timeout ${MOE_BENCH_TIMEOUT:-60} $PY -m workbench bench k3_moe_dispatch --candidate "$MOE" --out "$OUT" --repetitions ${MOE_REPS:-100} --no-compile
stage done
ls -la "$OUT"
