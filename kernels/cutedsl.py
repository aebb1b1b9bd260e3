"""CuTe DSL (NVIDIA CUTLASS Python DSL) support shared by every CuTe DSL kernel of the project.

Three habits every CuTe DSL kernel here needs, in one place:

1. **Compile once per compile-time key, outside every timed window.** :class:`CompileCache` maps a
   key (dtype and shape class: expert count, top-k, block size, ...; never a tensor, a pointer or a
   batch size that changes per call) to the compiled function, compiles on the first miss and records
   how long that took (:class:`CompileRecord`; :func:`compile_report` for result files). A kernel
   compiles every key it will meet before it is timed (the guards' warm-up calls do this too).
2. **Launch on torch's current stream.** A launch that passes the default stream inside
   ``torch.cuda.graph`` capture is silently left out of the graph (measured on the H200:
   ``shared/reference/h200_peers.md``). With TVM-FFI (:func:`env_stream`) the compiled function takes
   torch tensors and reads torch's current stream itself; without it, pass :func:`current_stream`.
3. **Cheap launches.** The TVM-FFI path (``--enable-tvm-ffi``, package ``apache-tvm-ffi``) takes torch
   tensors directly, so no ``from_dlpack`` runs per call (12 us a launch with cached arguments, 38 us
   with ``from_dlpack`` per argument and call, on the H200: same source).

CuTe naming, as in quack and the CUTLASS examples: ``mX`` the whole tensor in global memory, ``gX`` a
tile of it (:func:`tile`), ``sX`` shared memory (:func:`smem_tensor`), ``rX`` registers
(:func:`reg_tensor`), ``tXgX`` a thread's partition of ``gX``.

Importing this module never needs CUDA or cutlass (CI has neither): cutlass is imported on first use,
and a use without it raises :class:`CuteDSLUnavailable`, which names ``pip install nvidia-cutlass-dsl``.

Source: issue 13 (what to build); shared/reference/h200_peers.md "CuTe DSL on this H200" (the stream
and launch-cost facts); the CUTLASS DSL documentation "TVM FFI Compilation" (``--enable-tvm-ffi``,
``make_fake_stream(use_tvm_ffi_env_stream=True)``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import threading
import time
from collections.abc import Callable, Hashable
from types import ModuleType
from typing import Any

INSTALL_HINT = "pip install nvidia-cutlass-dsl apache-tvm-ffi"
"""What to run where CuTe DSL (or its TVM-FFI launcher) is missing."""
DIST_NAME = "nvidia-cutlass-dsl"
"""The CuTe DSL distribution (its version goes into result files)."""
TVM_FFI_OPTION = "--enable-tvm-ffi"
"""``cute.compile`` option for the TVM-FFI launcher (torch tensors in, torch's stream)."""

KEY_TYPES = (bool, int, float, str, type(None))
"""Types a compile-time key may hold (and tuples of them); torch and cutlass dtypes are allowed too."""


class CuteDSLUnavailable(ImportError):
    """CuTe DSL (``cutlass``) or ``tvm_ffi`` is not importable here."""


class CompileKeyError(TypeError):
    """A compile-time key that is not a tuple of plain values (a tensor, a pointer-like object, ...)."""


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise CuteDSLUnavailable(
            f"CuTe DSL kernels need the module {name!r}, which is not importable here ({exc}); "
            f"install it with `{INSTALL_HINT}` (CUDA machines only), or select another backend.") from exc


def available() -> bool:
    """Whether ``cutlass`` and ``cutlass.cute`` import here (never raises)."""
    try:
        _import("cutlass.cute")
    except CuteDSLUnavailable:
        return False
    return True


def tvm_ffi_available() -> bool:
    """Whether the TVM-FFI launcher (package ``apache-tvm-ffi``) imports here (never raises)."""
    try:
        _import("tvm_ffi")
    except CuteDSLUnavailable:
        return False
    return True


def require() -> tuple[ModuleType, ModuleType]:
    """Import CuTe DSL.

    Returns:
        ``(cutlass, cutlass.cute)``.

    Raises:
        CuteDSLUnavailable: cutlass is not installed (the message names ``pip install nvidia-cutlass-dsl``).
    """
    cutlass = _import("cutlass")
    cute = _import("cutlass.cute")
    return cutlass, cute


def version() -> str | None:
    """The installed ``nvidia-cutlass-dsl`` version, or ``None`` (never raises, imports nothing)."""
    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------ compile cache


def _check_key_part(part: object, key: tuple) -> None:
    if isinstance(part, tuple):
        for p in part:
            _check_key_part(p, key)
        return
    if isinstance(part, KEY_TYPES):
        return
    mod = type(part).__module__ or ""
    if type(part).__name__ == "dtype" and mod.startswith("torch") or isinstance(part, type):
        return  # torch.float32, or a cutlass numeric class such as cutlass.Float32
    raise CompileKeyError(
        f"CompileCache key {key!r} holds a {type(part).__module__}.{type(part).__name__}; a compile-time key "
        "holds only numbers, strings, bools, dtypes and tuples of them (dtype and shape class), never a "
        "tensor or anything that identifies one call's data. Key by the values that change the code.")


def check_key(key: Hashable) -> tuple:
    """Validate a compile-time key.

    Args:
        key: a tuple of numbers, strings, bools, ``None``, torch dtypes or cutlass numeric types (nested
            tuples allowed).

    Returns:
        ``key`` itself.

    Raises:
        CompileKeyError: ``key`` is not a tuple, or holds anything else (a tensor, say).
    """
    if not isinstance(key, tuple):
        raise CompileKeyError(f"CompileCache key {key!r} is a {type(key).__name__}; use a tuple of plain values.")
    _check_key_part(key, key)
    return key


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One compilation: which cache, which key, how long (seconds of host wall clock)."""

    cache: str
    key: tuple
    compile_s: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the key as its ``repr``)."""
        return {"cache": self.cache, "key": repr(self.key), "compile_s": round(self.compile_s, 4)}


_CACHES: list[CompileCache] = []
_CACHES_LOCK = threading.Lock()


class CompileCache:
    """Compiled kernels of one kernel family, one per compile-time key.

    ``build(key)`` compiles (``cute.compile``) and returns the callable to launch; it runs once per key,
    under a lock, and its wall time is recorded. Calls never compile twice for one key.

    Args:
        name: the kernel family (for reports), e.g. ``"moe_dispatch.route_align"``.
        build: ``key -> compiled callable``.
    """

    def __init__(self, name: str, build: Callable[[tuple], Callable[..., Any]]) -> None:
        self.name = name
        self._build = build
        self._compiled: dict[tuple, Callable[..., Any]] = {}
        self._records: list[CompileRecord] = []
        self._lock = threading.Lock()
        with _CACHES_LOCK:
            _CACHES.append(self)

    def get(self, key: tuple) -> Callable[..., Any]:
        """The compiled callable for ``key`` (compiled now on the first request).

        Raises:
            CompileKeyError: ``key`` is not a tuple of plain values (:func:`check_key`).
            CuteDSLUnavailable: from ``build``, where cutlass is missing.
        """
        try:
            fn = self._compiled.get(key)
        except TypeError:  # unhashable: not a key at all
            fn = None
        if fn is not None:
            return fn
        check_key(key)
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                t0 = time.perf_counter()
                fn = self._build(key)
                self._records.append(CompileRecord(self.name, key, time.perf_counter() - t0))
                self._compiled[key] = fn
        return fn

    def __contains__(self, key: object) -> bool:
        return key in self._compiled

    def __len__(self) -> int:
        return len(self._compiled)

    @property
    def records(self) -> tuple[CompileRecord, ...]:
        """Every compilation so far, in order."""
        return tuple(self._records)

    @property
    def compile_s(self) -> float:
        """Total compile time of this cache so far (seconds)."""
        return sum(r.compile_s for r in self._records)


def compile_report() -> dict[str, Any]:
    """Compile times of every :class:`CompileCache` in this process, for result files.

    Returns:
        ``{"nvidia_cutlass_dsl": version, "compiles": [record dicts], "compile_s": total seconds}``.
    """
    with _CACHES_LOCK:
        recs = [r for c in _CACHES for r in c.records]
    return {"nvidia_cutlass_dsl": version(), "compiles": [r.as_dict() for r in recs],
            "compile_s": round(sum(r.compile_s for r in recs), 4)}


# ----------------------------------------------------------------------------- streams and launch


def compile_options(*, tvm_ffi: bool = True) -> str:
    """``cute.compile`` options: the TVM-FFI launcher when asked for.

    Raises:
        CuteDSLUnavailable: ``tvm_ffi`` is asked for and ``apache-tvm-ffi`` is not importable.
    """
    if tvm_ffi:
        _import("tvm_ffi")
        return TVM_FFI_OPTION
    return ""


def env_stream() -> Any:
    """The stream placeholder for a TVM-FFI compile: the launch reads torch's current stream.

    The compiled function then takes no stream argument; TVM-FFI sets the environment stream from
    torch's current stream of the first CUDA tensor argument on every call (so graph capture sees it).

    Raises:
        CuteDSLUnavailable: cutlass is missing.
    """
    _import("cutlass.cute")
    runtime = _import("cutlass.cute.runtime")
    return runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def current_stream(device: Any = None) -> Any:
    """Torch's current CUDA stream as a ``cuda.CUstream`` (for launches without TVM-FFI).

    Never pass the default stream to a launch that may be captured: it would escape the graph.

    Raises:
        CuteDSLUnavailable: ``cuda-bindings`` is missing.
    """
    import torch

    driver = _import("cuda.bindings.driver")
    return driver.CUstream(torch.cuda.current_stream(device).cuda_stream)


def sym_dim() -> Any:
    """A symbolic (run-time) extent for a fake tensor's shape, e.g. the batch axis T.

    Raises:
        CuteDSLUnavailable: cutlass is missing.
    """
    _, cute = require()
    return cute.sym_int()


def fake_tensor(dtype: Any, shape: tuple, *, divisibility: int = 1) -> Any:
    """A compact row-major fake tensor to compile against (no data; ``shape`` may hold :func:`sym_dim`).

    Args:
        dtype: a cutlass numeric type (``cutlass.Float32``, ``cutlass.Int32``, ...).
        shape: extents; ints are compile-time constants, :func:`sym_dim` values are run-time.
        divisibility: the run-time extents' known divisor (elements), for vectorised access.

    Raises:
        CuteDSLUnavailable: cutlass is missing.
    """
    require()
    runtime = _import("cutlass.cute.runtime")
    order = tuple(range(len(shape) - 1, -1, -1))  # row-major: the last mode is stride 1
    align = max(1, dtype.width // 8) * divisibility if divisibility > 1 else None  # None: one element
    return runtime.make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


# ------------------------------------------------------------------------------ naming helpers


def smem_tensor(allocator: Any, dtype: Any, n: int, *, align_bytes: int = 16) -> Any:
    """``sX``: a 1-D shared-memory tensor of ``n`` elements (call inside a ``@cute.kernel``).

    Args:
        allocator: a ``cutlass.utils.SmemAllocator`` made in the kernel.
        dtype: cutlass numeric type.
        n: elements (compile-time).
        align_bytes: alignment of the allocation (bytes).
    """
    _, cute = require()
    return allocator.allocate_tensor(dtype, cute.make_layout(n), byte_alignment=align_bytes)


def reg_tensor(dtype: Any, n: int) -> Any:
    """``rX``: a 1-D register tensor of ``n`` elements (compile-time ``n``; index it with compile-time
    indices, ``cutlass.range_constexpr``, so it stays in registers)."""
    _, cute = require()
    return cute.make_rmem_tensor(cute.make_layout(n), dtype)


def tile(mX: Any, tiler: tuple, coord: tuple) -> Any:
    """``gX``: the tile of global tensor ``mX`` at ``coord`` for tile shape ``tiler`` (``cute.local_tile``)."""
    _, cute = require()
    return cute.local_tile(mX, tiler, coord)
