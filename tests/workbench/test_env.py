"""workbench.env: the environment block of result files names the kernel toolchains' versions.

Source: DESIGN.md "Result file"; issue 13 (the CUTLASS DSL version recorded).
"""

from __future__ import annotations

import importlib.metadata

from workbench import env


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_environment_records_cutlass_dsl_and_its_launcher_versions():
    """The keys are always there; each value is the installed version or None (never a guess)."""
    e = env.collect("cpu")
    for key, dist in (("nvidia_cutlass_dsl", "nvidia-cutlass-dsl"), ("apache_tvm_ffi", "apache-tvm-ffi"),
                      ("cuda_bindings", "cuda-bindings"), ("triton", "triton"), ("torch", "torch")):
        assert key in e
        assert e[key] == _installed(dist)
