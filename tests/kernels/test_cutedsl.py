"""kernels.cutedsl: the compile cache and key rules (CPU, no cutlass needed), the lazy import's error.

Source: kernels/cutedsl.py; issue 13 item 1 (compile once per key, compile time reported, importable
without CUDA or cutlass).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from kernels import cutedsl
from kernels.cutedsl import CompileCache, CompileKeyError, CuteDSLUnavailable, check_key

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None


def test_importing_needs_neither_cuda_nor_cutlass():
    """A fresh interpreter imports the module without importing cutlass, tvm_ffi or CUDA."""
    code = ("import sys; import kernels.cutedsl; "
            "print(sorted(m for m in ('cutlass', 'tvm_ffi', 'cuda') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cache_compiles_once_per_key_and_records_the_time():
    builds = []

    def build(key):
        builds.append(key)
        return lambda x: (key, x)

    cache = CompileCache("test.once", build)
    k1, k2 = (896, 16, 1, 1, 16, True), (32, 4, 1, 1, 16, False)
    f = cache.get(k1)
    assert f(3) == (k1, 3)
    assert cache.get(k1) is f  # no second compile
    cache.get(k2)
    cache.get(k2)
    assert builds == [k1, k2]
    assert len(cache) == 2 and k1 in cache and (1, 2) not in cache
    assert [r.key for r in cache.records] == [k1, k2]
    assert all(r.compile_s >= 0 for r in cache.records)
    assert cache.compile_s == pytest.approx(sum(r.compile_s for r in cache.records))


def test_compile_report_lists_every_cache():
    cache = CompileCache("test.report", lambda key: object())
    cache.get((7, torch.float32))
    rep = cutedsl.compile_report()
    mine = [c for c in rep["compiles"] if c["cache"] == "test.report"]
    assert mine == [{"cache": "test.report", "key": repr((7, torch.float32)), "compile_s": mine[0]["compile_s"]}]
    assert rep["compile_s"] >= mine[0]["compile_s"]
    assert "nvidia_cutlass_dsl" in rep


@pytest.mark.parametrize("key", [(896, 16), ("k", True, None, 2.5), (torch.float32, (16, 32)), (), (int,)])
def test_plain_keys_are_accepted(key):
    assert check_key(key) == key


@pytest.mark.parametrize("key, why", [
    ((torch.zeros(2),), "Tensor"),
    ((1, [2, 3]), "list"),
    (896, "use a tuple"),
    ((object(),), "object"),
])
def test_keys_that_could_identify_a_call_are_refused(key, why):
    """A tensor (or any object that could stand for one call's data) never becomes a compile key."""
    with pytest.raises(CompileKeyError, match=why):
        check_key(key)
    cache = CompileCache("test.refused", lambda k: object())
    with pytest.raises(CompileKeyError):
        cache.get(key)
    assert len(cache) == 0


def test_a_failing_build_caches_nothing():
    calls = []

    def build(key):
        calls.append(key)
        raise RuntimeError("compile failed")

    cache = CompileCache("test.fail", build)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="compile failed"):
            cache.get((1,))
    assert calls == [(1,), (1,)] and len(cache) == 0 and cache.records == ()


@pytest.mark.skipif(HAS_CUTLASS, reason="cutlass is installed here")
def test_use_without_cutlass_names_the_install_command():
    with pytest.raises(CuteDSLUnavailable, match="pip install nvidia-cutlass-dsl"):
        cutedsl.require()
    with pytest.raises(CuteDSLUnavailable, match="pip install nvidia-cutlass-dsl"):
        cutedsl.env_stream()
    assert cutedsl.available() is False
    assert cutedsl.version() is None


def test_version_and_availability_never_raise():
    assert cutedsl.available() in (True, False)
    assert cutedsl.tvm_ffi_available() in (True, False)
    v = cutedsl.version()
    assert v is None or isinstance(v, str)
