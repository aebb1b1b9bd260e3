"""The judging process's heap: freed tensor memory is kept for reuse instead of being returned to the OS.

A judgment handles the same large tensors many times in the process that runs the guards: the correctness
guard's inputs (a k3_small_m_gemm weight is 2112 x 7168 float32, 61 MB), their float64 copies for the
reference and the tolerance scale, the digests of the inputs after every call, the clones handed to the
reference. glibc's malloc serves every block over its mmap threshold (32 MiB at most, by default) with a
fresh ``mmap`` and unmaps it on ``free``, so each of those tensors faults its pages in again, zeroed by
the kernel: 6.3 M minor page faults and 26 s of system time in one 42 s judgment of a k3_small_m_gemm
fixture on the 2-core machine (``bench/judge_speed.py``, ``bench/results/cpu/judge_speed_session18.json``).

:func:`keep_freed_memory` raises the mmap and trim thresholds of this process, so such blocks come from
the heap and go back to it. It changes this process only: the guards' children (where candidates run and
are timed) start from the same environment as before, the same for every child and every candidate; a
child whose allocator depended on the mode it runs in would let a candidate tell the judge's children
apart.

Source: glibc ``mallopt(3)`` (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``, ``M_TOP_PAD``; the parameter
is a C ``int``, so each value stays below 2**31); the constants are those of glibc's ``<malloc.h>``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""glibc's ``<malloc.h>`` parameter numbers for ``mallopt``."""

MMAP_THRESHOLD_BYTES = 1 << 30
"""Blocks below this (bytes) come from the heap, so a freed one is reused (default: 128 KiB, growing to 32 MiB)."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the top of the heap kept before it is returned to the OS (bytes)."""
TOP_PAD_BYTES = 64 << 20
"""Extra bytes asked of the OS each time the heap grows (fewer, larger ``brk`` calls)."""

_applied: bool | None = None
_libc = None
"""The C library whose ``mallopt`` took the settings (``malloc_trim`` is called on the same one)."""


def keep_freed_memory() -> bool:
    """Set this process's glibc malloc to keep freed blocks below 1 GiB for reuse; once per process.

    Returns:
        True when the settings are in force (glibc accepted the mmap threshold); False elsewhere (another
        C library, or an older glibc that refuses it), where the default allocator stays. Either way the
        outcome is logged once at INFO, and nothing raises. :func:`give_back_freed_memory` returns the
        kept memory at the end of a judgment.
    """
    global _applied, _libc
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux"):
        logger.info("judge heap: %s is not Linux; the default allocator stays", sys.platform)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        logger.info("judge heap: no glibc mallopt (%s); the default allocator stays", exc)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: a glibc that refuses it (before 2.35 the limit is 32 MiB) keeps every default,
    # since the trim and top-pad settings alone would switch off its self-adjusting threshold
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        logger.info("judge heap: mallopt refused an mmap threshold of %d MiB; the default allocator stays",
                    MMAP_THRESHOLD_BYTES >> 20)
        return False
    refused = [p for p, v in ((M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, TOP_PAD_BYTES)) if mallopt(p, v) != 1]
    if refused:
        logger.info("judge heap: mallopt refused parameter(s) %s (kept at their defaults)", refused)
    _applied, _libc = True, libc
    logger.info("judge heap: freed blocks up to %d MiB are kept for reuse (mmap and trim thresholds)",
                MMAP_THRESHOLD_BYTES >> 20)
    return True


def give_back_freed_memory() -> None:
    """Return the heap's free memory to the OS (glibc ``malloc_trim(0)``), e.g. at the end of a judgment in a
    process that lives on (an agent loop, a pool worker): :func:`keep_freed_memory` keeps the largest
    judgment's memory otherwise (1.2 GiB held against 0.2 GiB after 16 freed 64 MiB tensors, in session 18's
    review). Nothing when the settings are not in force."""
    if not _applied:
        return
    trim = getattr(_libc, "malloc_trim", None)
    if trim is None:  # pragma: no cover - glibc has it whenever mallopt took the settings
        logger.info("judge heap: no malloc_trim in the C library; freed memory stays with the process")
        return
    trim(0)
