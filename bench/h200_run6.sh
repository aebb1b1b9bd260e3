#!/usr/bin/env bash
# H200 call 6 (issue 3, the missing part): the split-vocabulary k3_dspark_verify Triton kernel and the
# k3_moe_dispatch fill change. Microbenchmark and checks (bench/dspark_micro.py), both guard verdicts
# (timed), both decode-batch benchmarks. Results land flat in $OUT (8 files at most).
#   bash bench/h200_run6.sh      (from a copy of the repository root; WHEELS: folder of the carried wheels)
# Guard children start with `python -I` (PYTHONPATH ignored), so the wheels the image lacks and
# k3_model imports (pydantic and its needs) are installed into python3's own site first.
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
WHEELS=${WHEELS:-../.device/wheels}
for w in pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
  compgen -G "$WHEELS/$w-*.whl" >/dev/null && python3 -m pip install -q --no-index --no-deps --no-compile "$WHEELS"/$w-*.whl
done
python3 -I -c "import pydantic; print('pydantic', pydantic.VERSION, 'importable without PYTHONPATH')"
[ -d .git ] || { git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base; }
DS=tasks/k3_dspark_verify/fixtures/good/triton-cuda
MOE=tasks/k3_moe_dispatch/fixtures/good/triton-cuda
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu --format=csv
stage micro
timeout ${MICRO_TIMEOUT:-100} python3 bench/dspark_micro.py "$OUT/micro.json" ${MICRO_REPS:-30}
stage run k3_dspark_verify
t0=$(date +%s)
timeout ${RUN_TIMEOUT:-140} python3 -m workbench run k3_dspark_verify --candidate "$DS" --device cuda --seed 6 --no-queue
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/dspark_run.json" 2>/dev/null
stage bench k3_dspark_verify
timeout ${BENCH_TIMEOUT:-120} python3 -m workbench bench k3_dspark_verify --candidate "$DS" --out "$OUT" --repetitions ${REPS:-60} --no-compile
stage run k3_moe_dispatch
t0=$(date +%s)
timeout ${RUN_TIMEOUT:-120} python3 -m workbench run k3_moe_dispatch --candidate "$MOE" --device cuda --seed 6 --no-queue
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/moe_run.json" 2>/dev/null
stage bench k3_moe_dispatch
timeout ${MOE_BENCH_TIMEOUT:-80} python3 -m workbench bench k3_moe_dispatch --candidate "$MOE" --out "$OUT" --repetitions ${MOE_REPS:-100} --no-compile
stage done
ls -la "$OUT"
