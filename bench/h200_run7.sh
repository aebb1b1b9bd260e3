#!/usr/bin/env bash
# Single-H200 call (session 2): the allreduce Triton kernel on the GPU, the distributed benchmark's
# machinery at world size 1 (NCCL, graph capture, freshness check), and the GPU-only exploit corpus.
#   bash bench/h200_run7.sh   (repo root; results flat in $OUT)
set -u
OUT=${OUT:-$PWD/bench/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee -a "$OUT/log7.txt") 2>&1
stage() { echo "== $(date +%T) $*"; }
# a fresh repository of exactly this tree: a .git left on the machine from an earlier call has an older
# HEAD, and candidate worktrees are made from HEAD (seen in call 8: a stale base without the new op)
rm -rf .git .workbench && git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base
stage env
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
stage allreduce gpu test
timeout 120 python3 -m pytest -q -m gpu tests/tasks/test_k3_allreduce_rmsnorm.py -p no:cacheprovider 2>&1 | tail -5
stage allreduce bench at world size 1
timeout 150 python3 -m workbench bench k3_allreduce_rmsnorm -c tasks/k3_allreduce_rmsnorm/fixtures/good/triton-nccl-cuda \
  --world-size 1 --batch 1 --batch 8 --batch 64 --repetitions 50 --out "$OUT"
stage exploits
mkdir -p /tmp/exploits_out
OUT=/tmp/exploits_out timeout 360 bash bench/h200_exploits.sh
cp /tmp/exploits_out/*.json /tmp/exploits_out/*.txt "$OUT"/ 2>/dev/null
stage done
ls -la "$OUT"
