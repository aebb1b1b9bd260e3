"""Regression test for vllm-cpu 0.32.0's spec-decoding expand bug and the plugin's fix (marker ``vllm``).

vLLM's real ``rejection_sampler.expand_batch_to_tokens`` is run, after the CPU platform registered its
Triton fallbacks, in a fresh process: with the plugin's fix the per-token temperatures are right; with
``K3_PATCH_CPU_EXPAND=0`` (the fix reverted) they are not, which is the bug this guards against.

Source: shared/reference/vllm_cpu.md §5.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("tests marked vllm: vllm is not installed but CI=true; run .ci/install-vllm.sh.")
    pytest.skip("vllm is not installed", allow_module_level=True)

PROBE = r"""
import json, torch
import k3_model.vllm_plugin as plugin
plugin.register()                      # what vLLM does first in every worker ...
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()   # ... then this (worker_base.py)
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
temps = torch.tensor([0.8, 0.5, 1.3], dtype=torch.float32)
cu = torch.tensor([3, 5, 8], dtype=torch.int32)
topk = torch.tensor([40, 7, 1], dtype=torch.int32)
out = []
for _ in range(5):   # fresh garbage each time: new_empty memory
    out.append([expand_batch_to_tokens(temps, cu, 8, replace_from=0, replace_to=1).tolist(),
                expand_batch_to_tokens(topk, cu, 8).tolist()])
print("RESULT", json.dumps(out))
"""

WANT_T = [0.8, 0.8, 0.8, 0.5, 0.5, 1.3, 1.3, 1.3]
WANT_K = [40, 40, 40, 7, 7, 1, 1, 1]


def _probe(patch: str) -> list:
    env = {**os.environ, "K3_PATCH_CPU_EXPAND": patch}
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stderr[-3000:]
    return json.loads(line[0][7:])


@pytest.mark.slow
def test_expand_fix_gives_per_token_values():
    for temps, topk in _probe("1"):
        assert temps == pytest.approx(WANT_T)
        assert topk == WANT_K


@pytest.mark.slow
def test_expand_without_fix_is_wrong():
    runs = _probe("0")
    assert any(temps != pytest.approx(WANT_T) or topk != WANT_K for temps, topk in runs), (
        "vLLM's CPU expand now gives right values without the plugin's fix: the bug is fixed upstream; "
        "drop k3_model.vllm_plugin.patches and this test."
    )
