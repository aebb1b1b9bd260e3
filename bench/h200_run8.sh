#!/usr/bin/env bash
# Single-H200 call (session 2): the distributed benchmark's machinery at world size 1 (NCCL group of
# one, CUDA-graph capture with the collective path, freshness check) and the allreduce guards on a
# one-GPU machine (W = 1 runs; W = 2/4/8 cannot, so a kernel claiming TP 2/4 must be rejected).
#   bash bench/h200_run8.sh   (repo root; results flat in $OUT)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/log8.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
# a fresh repository of exactly this tree: a .git left on the machine from an earlier call has an older
# HEAD, and candidate worktrees are made from HEAD (seen in call 8: a stale base without the new op)
rm -rf .git .workbench && git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base
CAND=tasks/k3_allreduce_rmsnorm/fixtures/good/triton-nccl-cuda
stage bench world size 1
timeout 200 python3 -m workbench bench k3_allreduce_rmsnorm -c "$CAND" --world-size 1 --repetitions 100 --out "$OUT"
stage workbench run on one GPU
timeout 200 python3 -m workbench run k3_allreduce_rmsnorm -c "$CAND" --device cuda --seed 41 --no-queue
cp "$(ls -t .workbench/results/*.json | head -1)" "$OUT/k3_allreduce_rmsnorm_triton-nccl-cuda_1gpu_run.json" 2>/dev/null
stage done
ls -la "$OUT"
