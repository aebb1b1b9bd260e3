#!/usr/bin/env bash
# One call on a 2-GPU H200 machine (nvidia-h200-x2), issue 8: the k3_allreduce_rmsnorm guards with NCCL
# at world sizes 1 and 2 (4 and 8 need more GPUs), for the good Triton+NCCL candidate and the perf bad
# fixture, each with its SCOPE narrowed to TP 1-2 (what this machine can judge; the fixtures claimed
# TP 1/2/4 when this ran, and TP 1-2 since), then the TP 2 decode sweep.  bash bench/h200x2_run.sh  (repo root; results in $OUT)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/log_x2.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
F=tasks/k3_allreduce_rmsnorm/fixtures
mkdir -p /tmp/cands
for c in good/triton-nccl-cuda bad/perf-two-collectives-and-a-barrier; do
  n=$(basename $c)-tp2; rm -rf /tmp/cands/$n; cp -r $F/$c /tmp/cands/$n
  sed -i 's/tp_sizes=(1, 2, 4)/tp_sizes=(1, 2)/' /tmp/cands/$n/k3_model/kernels/allreduce_rmsnorm/__init__.py
  grep -n "tp_sizes" /tmp/cands/$n/k3_model/kernels/allreduce_rmsnorm/__init__.py
done
rm -rf .git .workbench && git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base
stage env
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
nvidia-smi topo -m
if [ -z "${SKIP_RUN:-}" ]; then
stage workbench run good
t0=$(date +%s)
timeout ${RUN_TIMEOUT:-240} python3 -m workbench run k3_allreduce_rmsnorm --candidate /tmp/cands/triton-nccl-cuda-tp2 --device cuda --seed 21 --no-queue
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/k3_allreduce_rmsnorm_triton-nccl-cuda-tp2_run.json"
fi
stage bench TP 2
mkdir -p /tmp/benchlogs
WORKBENCH_BENCH_LOG_DIR=/tmp/benchlogs WORKBENCH_BENCH_HANG_DUMP_S=${HANG_S:-100} timeout ${BENCH_TIMEOUT:-200} \
  python3 -m workbench bench k3_allreduce_rmsnorm --candidate /tmp/cands/triton-nccl-cuda-tp2 \
  --out "$OUT" --world-size 2 --repetitions ${REPS:-100} ${BATCHES:-}
for f in /tmp/benchlogs/*.log; do echo "--- $f"; tail -40 "$f"; done
[ -n "${SKIP_BAD:-}" ] && { stage done; ls -la "$OUT"; exit 0; }
stage workbench run perf bad fixture
timeout ${RUN_TIMEOUT:-150} python3 -m workbench run k3_allreduce_rmsnorm --candidate /tmp/cands/perf-two-collectives-and-a-barrier-tp2 --device cuda --seed 22 --no-queue
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/k3_allreduce_rmsnorm_perf-two-collectives-and-a-barrier-tp2_run.json"
stage done
ls -la "$OUT"
