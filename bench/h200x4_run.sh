#!/usr/bin/env bash
# One call on a multi-GPU H200 machine (nvidia-h200-x4): the k3_allreduce_rmsnorm guards with NCCL at
# world sizes 1, 2 and 4 (8 needs 8 GPUs), the TP 2 / TP 4 decode sweep, then single-GPU extras on GPU 0
# if a script for them is present. Results land flat in $OUT.  bash bench/h200x4_run.sh  (repo root)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/log_x4.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
# a fresh repository of exactly this tree: a .git left on the machine from an earlier call has an older
# HEAD, and candidate worktrees are made from HEAD (seen in call 8: a stale base without the new op)
rm -rf .git .workbench && git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base
CAND=tasks/k3_allreduce_rmsnorm/fixtures/good/triton-nccl-cuda
stage env
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu --format=csv
nvidia-smi topo -m
stage workbench run
t0=$(date +%s)
timeout ${RUN_TIMEOUT:-300} python3 -m workbench run k3_allreduce_rmsnorm --candidate "$CAND" --device cuda --seed 21 --no-queue
echo "verdict wall: $(( $(date +%s) - t0 )) s"
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/k3_allreduce_rmsnorm_triton-nccl-cuda_run.json" 2>/dev/null
stage bench
timeout ${BENCH_TIMEOUT:-300} python3 -m workbench bench k3_allreduce_rmsnorm --candidate "$CAND" --out "$OUT" \
  --world-size 2 --world-size 4 --repetitions ${REPS:-100}
if [ -f bench/h200_exploits.sh ] && [ -z "${SKIP_EXPLOITS:-}" ]; then
  stage exploits on GPU 0   # at most 8 files come back: the exploit outputs travel as one archive
  mkdir -p /tmp/exploits_out
  OUT=/tmp/exploits_out CUDA_VISIBLE_DEVICES=0 timeout ${EXPLOIT_TIMEOUT:-360} bash bench/h200_exploits.sh
  tar -C /tmp/exploits_out -czf "$OUT/exploits_h200.tar.gz" .
fi
stage done
ls -la "$OUT"
