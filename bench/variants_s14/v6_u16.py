"""The CuTe DSL kernels behind the CUDA dspark_verify path (see ``__init__.py`` for the design).

Two launches on torch's current stream (TVM-FFI), each compiled once per (draft probabilities given,
V even) by ``kernels.cutedsl.CompileCache``; B, D and V are run-time values.

1. :class:`VerifyRows`, one CTA of ``THREADS`` threads per verified position ``r = b * (D+1) + i``
   (positions past ``n_b`` return at once). bf16 logits are read as raw 16-bit patterns, two per 32-bit
   word when V is even (one per 16-bit load otherwise); thread ``t`` owns the words ``t + k * THREADS``
   in that fixed order, ``U`` loads issued before any use. ``key(bits)`` maps a pattern to an int in
   [0, 65535] whose order is the value order (-0.0 folded onto +0.0), so "strictly more probable"
   means "larger key" and equal keys are equal values.

   * sweep 1: the row max ``m`` and lowest-id argmax (greedy rows stop here: accept iff the draft is it);
   * sweep 2 (sampled rows): ``Z = sum_t w(t)``, ``w(t) = exp2((x_t - m) * log2(e) / T)``; rows with top-k
     or top-p also build a 256-bin histogram of ``key >> 8`` (counts, and for top-p approximate masses in
     fixed point, ``round(w * 2^16)``: integer shared atomics only, 16 copies; the masses only guess the
     top-p bin, which the exact step below checks and corrects);
   * top-k (``0 < k < V``): the bin holding the k-th largest key from the counts, then one sweep
     counting the 256 exact keys of that bin and summing ``w`` above it (a fixed-order block sum): the
     exact k-th largest key ``Kk`` (ties kept: keep ``key >= Kk``) and ``Z' = sum_{key >= Kk} w``;
   * top-p (``top_p < 1``): keep a key iff the mass of strictly larger keys is ``< top_p * Z'``. The
     guessed bin's exact keys are counted in one more sweep (with the mass above it as a fixed-order
     sum); the first key from the top where that mass plus the bin's inclusive sum reaches the target
     is the lowest kept key; if the bin holds no crossing (the guess was off by rounding) the next
     non-empty bin up or down is tried. Masses of exact keys are ``count * w(key)``, so every number a
     decision uses is computed in a fixed order: a request gets the same bits wherever it sits;
   * accept test of draft ``d`` at ``i < n_b`` (thread 0): ``q(d) > 0 and (u < p(d) / q(d) or (u == 0
     and d is kept))`` with ``p(d) = w(d) / Z''`` for a kept ``d`` (the second clause: p(d) > 0 exactly
     even where fp32 ``w`` underflows); the row's ``m``, ``1 / Z''``, threshold key, argmax and flag go to
     a per-device workspace.

2. :class:`Race`, grid ``(B, NC)``: each CTA finds the request's first rejected position ``s`` from the
   flags (``n_b`` if none); a sampled request runs the exponential race ``argmax_t w'(t) / E(t)`` over its
   chunk of V at ``s`` (``w' = max(p - q, 0)``, or ``p`` with the draft zeroed for one-hot drafts, and
   ``p`` at the bonus position or where the residual is all zero; lowest id on ties); the last CTA of the
   request (a done counter per request, reset by it) merges the chunk winners and writes the output row
   (drafts before ``s``, the token at ``s``, -1 after) and ``num_accepted_tokens``.

Source: k3_model/ops/dspark_verify.py (the contract); kernel_targets.md §2.1-2.5; the "last block"
completion pattern of the CUDA threadFenceReduction sample (written anew here, as in the k3_moe_dispatch
CuTe DSL fixture); kernels/cutedsl.py (compile cache, TVM-FFI launch on torch's stream).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as _T
from cutlass.cutlass_dsl import dsl_user_op

from kernels.cutedsl import CompileCache, compile_options, env_stream, fake_tensor, sym_dim

THREADS = 512
"""Threads per CTA of the row kernel (16 warps); one CTA per verified position."""
NWARPS = THREADS // 32
U = 16
"""Words each thread loads before using any (row kernel): 16 KB of logits per CTA in flight."""
NBIN = 256
"""Bins per histogram level: ``key >> 8``, then the 256 exact keys of one bin."""
COPIES = 16
"""Copies of the level-1 histograms, bin-major with the copy (lane % 16) minor: two lanes of a warp
share an address only when they also share a bin."""
RACE_THREADS = 256
RACE_WARPS = RACE_THREADS // 32
RU = 4
"""Words each race thread loads (with their noise and draft probabilities) before using any."""
MAX_B = 64
"""Largest batch (the task's scope, batch_max)."""
MAX_D = 8
"""Most drafts per request (the task's domain, D <= 8)."""
MAX_R = MAX_B * (MAX_D + 1)
MAX_NC = 32
"""Race chunks per request at most (one warp merges them)."""
RACE_CTAS = 264
"""Race CTAs aimed at per call (two per SM of an H200)."""
RF = 4  # floats per row in the workspace: m, 1/Z''
RI = 4  # ints per row: accept flag, argmax, threshold key, sweeps over the row (diagnostics)
LOG2E = 1.4426950408889634
NEG_INF = float("-inf")
BIG = 1 << 30
FIX = 65536.0
"""Fixed-point scale of the approximate bin masses (a copy holds at most V / 16 * 2^16 < 2^31 at V 163840)."""
MAX_TRIES = 64
"""Top-p bins tried at most (the first guess is right unless a bin edge lies within rounding)."""


@dsl_user_op
def _as_f32(bits: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of the bf16 pattern in the low 16 bits of ``bits`` (bits << 16, reinterpreted)."""
    v = Int32(bits << 16)
    return Float32(llvm.bitcast(_T.f32(), v.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _word_type(epw: int):
    """The load type holding ``epw`` bf16 values (1, 2 or 4)."""
    return {1: cutlass.Int16, 2: Int32, 4: cutlass.Int64}[epw]


def _part(word, e: int, epw: int):
    """The ``e``-th 16-bit pattern of a word (int32 in [0, 65535]); little-endian: lower address first."""
    if epw == 1:
        return word
    if epw == 2:
        return (word >> (16 * e)) & 0xFFFF
    return Int32((word >> (16 * e)) & 0xFFFF)


def _key(bits):
    """16-bit bf16 pattern (int32 in [0, 65535]) -> order-preserving key (-0.0 folded onto +0.0)."""
    return cutlass.select_(bits == 0x8000, Int32(0x8000),
                           cutlass.select_(bits >= 0x8000, Int32(0xFFFF) - bits, bits | 0x8000))


def _unkey(key):
    """Inverse of :func:`_key` (the folded -0.0 comes back as +0.0): the fp32 value of that pattern."""
    return _as_f32(cutlass.select_(key >= 0x8000, key - 0x8000, Int32(0xFFFF) - key))


class VerifyRows:
    """Launch 1: per verified position, the argmax, the thresholds, ``1 / Z''`` and the accept flag.

    Args:
        has_q: draft probabilities given (read ``q(d)``); epw: bf16 values per load (4 when V % 4 == 0:
            8-byte loads; 2 when V is even; else 1).
    """

    def __init__(self, has_q: bool, epw: int) -> None:
        self.has_q, self.epw = has_q, epw

    @cute.jit
    def __call__(self, mL: cute.Tensor, mDr: cute.Tensor, mN: cute.Tensor, mQ: cute.Tensor, mT: cute.Tensor,
                 mK: cute.Tensor, mP: cute.Tensor, mU: cute.Tensor, mRowF: cute.Tensor, mRowI: cute.Tensor,
                 D: Int32, V: Int32, stream):
        R = mL.shape[0]
        self.kernel(mL, mDr, mN, mQ, mT, mK, mP, mU, mRowF, mRowI, D, V).launch(
            grid=[R, 1, 1], block=[THREADS, 1, 1], stream=stream)

    # ------------------------------------------------------------------------------------ helpers

    @cute.jit
    def load_word(self, mL: cute.Tensor, r: Int32, w: Int32):
        """Word ``w`` of row ``r`` (``epw`` bf16 patterns; 16-bit loads widened to int32)."""
        if const_expr(self.epw == 1):
            return Int32(mL[r, w]) & 0xFFFF
        else:
            return mL[r, w]

    @cute.jit
    def elem(self, mode: cutlass.Constexpr, bits: Int32, idx: Int32, rF: cute.Tensor, rI: cute.Tensor,
             sH1: cute.Tensor, sM1: cute.Tensor, sC2: cute.Tensor, m: Float32, c: Float32, filt: cutlass.Boolean,
             topp: cutlass.Boolean, h: Int32, copy: Int32):
        x = _as_f32(bits)
        if const_expr(mode == 0):
            if x > rF[0]:
                rF[0] = x
                rI[0] = idx
        elif const_expr(mode == 1):
            w = cute.arch.exp2((x - m) * c)
            rF[1] = rF[1] + w
            if filt:
                hb = _key(bits) >> 8
                cute.arch.atomic_add(sH1.iterator + (hb * COPIES + copy), Int32(1), scope="cta")
                if topp:
                    # fixed point, integer atomics (a float add on shared memory is a compare-and-swap loop)
                    cute.arch.atomic_add(sM1.iterator + (hb * COPIES + copy), Int32(w * Float32(FIX) + Float32(0.5)),
                                         scope="cta")
        else:
            k = _key(bits)
            hb = k >> 8
            if hb == h:
                cute.arch.atomic_add(sC2.iterator + (k & 0xFF), Int32(1), scope="cta")
            elif hb > h:
                rF[2] = rF[2] + cute.arch.exp2((x - m) * c)

    @cute.jit
    def sweep(self, mode: cutlass.Constexpr, mL: cute.Tensor, r: Int32, tidx: Int32, lane: Int32,
              rF: cute.Tensor, rI: cute.Tensor, sH1: cute.Tensor, sM1: cute.Tensor, sC2: cute.Tensor,
              m: Float32, c: Float32, filt: cutlass.Boolean, topp: cutlass.Boolean, h: Int32):
        """One pass over row ``r`` in the fixed per-thread order (words ``tidx + k * THREADS``, ascending)."""
        NW = mL.shape[1]
        step = THREADS * U
        nfull = NW // step
        copy = lane & (COPIES - 1)
        if const_expr(mode != 0):
            rI[1] = rI[1] + 1  # sweeps of this row (diagnostics: the workspace's fourth int)
        E = self.epw
        rW = cute.make_rmem_tensor(cute.make_layout(U), Int32 if const_expr(E == 1) else _word_type(E))
        for it in cutlass.range(nfull, unroll=1):
            base = it * step + tidx
            for u in cutlass.range_constexpr(U):
                rW[u] = self.load_word(mL, r, base + u * THREADS)
            for u in cutlass.range_constexpr(U):
                w = base + u * THREADS
                for e in cutlass.range_constexpr(E):
                    self.elem(mode, _part(rW[u], e, E), E * w + e, rF, rI, sH1, sM1, sC2, m, c, filt, topp, h, copy)
        base = nfull * step + tidx
        for u in cutlass.range_constexpr(U):
            w = base + u * THREADS
            rW[u] = rW.element_type(0)
            if w < NW:
                rW[u] = self.load_word(mL, r, w)
        for u in cutlass.range_constexpr(U):
            w = base + u * THREADS
            if w < NW:
                for e in cutlass.range_constexpr(E):
                    self.elem(mode, _part(rW[u], e, E), E * w + e, rF, rI, sH1, sM1, sC2, m, c, filt, topp, h, copy)

    @cute.jit
    def block_sum(self, v: Float32, lane: Int32, warp: Int32, sRedF: cute.Tensor) -> Float32:
        """Sum over the CTA in a fixed order (butterfly in each warp, then warps in index order)."""
        for s in cutlass.range_constexpr(5):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> s)
        cute.arch.sync_threads()
        if lane == 0:
            sRedF[warp] = v
        cute.arch.sync_threads()
        tot = sRedF[0]
        for j in cutlass.range_constexpr(1, NWARPS):
            tot = tot + sRedF[j]
        return tot

    @cute.jit
    def find(self, sV: cute.Tensor, base: Float32, target: Float32, lane: Int32, sS: cute.Tensor,
             sI: cute.Tensor):
        """Warp 0 only: the first entry of ``sV[255], sV[254], ...`` (from the top) where ``base`` plus the
        inclusive sum reaches ``target``. Writes ``sI[4]`` = found (0/1), ``sI[5]`` = index,
        ``sS[4]`` = base + inclusive sum there, ``sS[5]`` = base + the whole sum."""
        rV = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        s = Float32(0.0)
        for j in cutlass.range_constexpr(8):
            rV[j] = sV[255 - (lane * 8 + j)]
            s = s + rV[j]
        incl = s
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(incl, offset=1 << k)
            if lane >= (1 << k):
                incl = incl + y
        excl = cute.arch.shuffle_sync_up(incl, offset=1)
        if lane == 0:
            excl = Float32(0.0)
        total = cute.arch.shuffle_sync(incl, offset=31)
        below = cute.arch.vote_ballot_sync(base + incl < target)
        L = cute.arch.popc(below)
        if lane == 0:
            sI[4] = Int32(0)
            sS[5] = base + total
        if L < 32:
            if lane == L:
                run = base + excl
                hit = Int32(-1)
                last = Int32(-1)
                at = Float32(0.0)
                at_last = Float32(0.0)
                for j in cutlass.range_constexpr(8):
                    nxt = run + rV[j]
                    if rV[j] > Float32(0.0):
                        last = Int32(j)
                        at_last = nxt
                    if hit < 0 and nxt >= target:
                        hit = Int32(j)
                        at = nxt
                    run = nxt
                if hit < 0:  # rounding: the lane's sum reached the target, its walk did not
                    hit = last
                    at = at_last
                sI[4] = Int32(1)
                sI[5] = 255 - (lane * 8 + hit)
                sS[4] = at

    # ------------------------------------------------------------------------------------ kernel

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mDr: cute.Tensor, mN: cute.Tensor, mQ: cute.Tensor, mT: cute.Tensor,
               mK: cute.Tensor, mP: cute.Tensor, mU: cute.Tensor, mRowF: cute.Tensor, mRowI: cute.Tensor,
               D: Int32, V: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        smem = cutlass.utils.SmemAllocator()
        sH1 = smem.allocate_tensor(Int32, cute.make_layout(NBIN * COPIES), byte_alignment=16)
        sM1 = smem.allocate_tensor(Int32, cute.make_layout(NBIN * COPIES), byte_alignment=16)
        sC1 = smem.allocate_tensor(Float32, cute.make_layout(NBIN), byte_alignment=16)
        sMa = smem.allocate_tensor(Float32, cute.make_layout(NBIN), byte_alignment=16)
        sC2 = smem.allocate_tensor(Int32, cute.make_layout(NBIN), byte_alignment=16)
        sV2 = smem.allocate_tensor(Float32, cute.make_layout(NBIN), byte_alignment=16)
        sVk = smem.allocate_tensor(Float32, cute.make_layout(NBIN), byte_alignment=16)
        sRedF = smem.allocate_tensor(Float32, cute.make_layout(NWARPS), byte_alignment=16)
        sRedI = smem.allocate_tensor(Int32, cute.make_layout(NWARPS), byte_alignment=16)
        sS = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        sI = smem.allocate_tensor(Int32, cute.make_layout(8), byte_alignment=16)

        D1 = D + 1
        b = r // D1
        i = r - b * D1
        n = mN[b]
        if i <= n:
            Tb = mT[b]
            rF = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            rI = cute.make_rmem_tensor(cute.make_layout(2), Int32)
            rF[0] = Float32(NEG_INF)
            rI[0] = Int32(BIG)
            rI[1] = Int32(1)
            fls = cutlass.Boolean(False)
            self.sweep(0, mL, r, tidx, lane, rF, rI, sH1, sM1, sC2, Float32(0.0), Float32(0.0), fls, fls, Int32(0))
            # CTA argmax: larger value, then lower index
            bv = rF[0]
            bi = rI[0]
            for s in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(bv, offset=16 >> s)
                oi = cute.arch.shuffle_sync_bfly(bi, offset=16 >> s)
                if ov > bv or (ov == bv and oi < bi):
                    bv = ov
                    bi = oi
            if lane == 0:
                sRedF[warp] = bv
                sRedI[warp] = bi
            cute.arch.sync_threads()
            m = sRedF[0]
            arg = sRedI[0]
            for j in cutlass.range_constexpr(1, NWARPS):
                ov = sRedF[j]
                oi = sRedI[j]
                if ov > m or (ov == m and oi < arg):
                    m = ov
                    arg = oi

            thr_key = Int32(0)
            invz = Float32(0.0)
            c = Float32(0.0)
            if Tb != Float32(0.0):
                c = Float32(LOG2E) / Tb
                kk = mK[b]
                tp = mP[b]
                topk_on = kk > 0 and kk < V
                topp_on = tp < Float32(1.0)
                filt = topk_on or topp_on
                if filt:
                    for j in cutlass.range(tidx, NBIN * COPIES, THREADS, unroll=1):
                        sH1[j] = Int32(0)
                        sM1[j] = Int32(0)
                cute.arch.sync_threads()
                rF[1] = Float32(0.0)
                self.sweep(1, mL, r, tidx, lane, rF, rI, sH1, sM1, sC2, m, c, filt, topp_on, Int32(0))
                z2 = self.block_sum(rF[1], lane, warp, sRedF)
                if filt:
                    cute.arch.sync_threads()
                    for h in cutlass.range(tidx, NBIN, THREADS, unroll=1):
                        cs = Int32(0)
                        ms = Float32(0.0)
                        for j in cutlass.range_constexpr(COPIES):
                            cs = cs + sH1[h * COPIES + j]
                            ms = ms + Float32(sM1[h * COPIES + j]) * Float32(1.0 / FIX)
                        sC1[h] = Float32(cs)
                        sMa[h] = ms
                    cute.arch.sync_threads()
                    hk = Int32(0)
                    s_a = Float32(0.0)
                    if topk_on:
                        # the bin of the k-th largest key, then its exact keys
                        if warp == 0:
                            self.find(sC1, Float32(0.0), Float32(kk), lane, sS, sI)
                        cute.arch.sync_threads()
                        hk = sI[5]
                        above_cnt = sS[4] - sC1[hk]  # exact integers
                        for j in cutlass.range(tidx, NBIN, THREADS, unroll=1):
                            sC2[j] = Int32(0)
                        cute.arch.sync_threads()
                        rF[2] = Float32(0.0)
                        self.sweep(2, mL, r, tidx, lane, rF, rI, sH1, sM1, sC2, m, c, filt, topp_on, hk)
                        s_a = self.block_sum(rF[2], lane, warp, sRedF)
                        for j in cutlass.range(tidx, NBIN, THREADS, unroll=1):
                            sV2[j] = Float32(sC2[j])
                        cute.arch.sync_threads()
                        if warp == 0:
                            self.find(sV2, above_cnt, Float32(kk), lane, sS, sI)
                        cute.arch.sync_threads()
                        lo_k = sI[5]
                        thr_key = hk * 256 + lo_k
                        for j in cutlass.range(tidx, NBIN, THREADS, unroll=1):
                            mk = Float32(0.0)
                            if j >= lo_k:
                                mk = Float32(sC2[j]) * cute.arch.exp2((_unkey(hk * 256 + j) - m) * c)
                            sVk[j] = mk
                        cute.arch.sync_threads()
                        if warp == 0:
                            self.find(sVk, s_a, Float32(float("inf")), lane, sS, sI)
                        cute.arch.sync_threads()
                        z2 = sS[5]  # s_a + the kept keys of bin hk
                        cute.arch.sync_threads()
                    if topp_on:
                        target = tp * z2
                        # first guess: the approximate masses (bins under hk dropped; hk's exact kept part)
                        for j in cutlass.range(tidx, NBIN, THREADS, unroll=1):
                            if j < hk:
                                sMa[j] = Float32(0.0)
                                sC1[j] = Float32(0.0)
                        cute.arch.sync_threads()
                        if topk_on:
                            if tidx == 0:
                                sMa[hk] = z2 - s_a
                            cute.arch.sync_threads()
                        if warp == 0:
                            self.find(sMa, Float32(0.0), target, lane, sS, sI)
                        cute.arch.sync_threads()
                        h = hk
                        if sI[4] != 0:
                            h = sI[5]
                        cute.arch.sync_threads()
                        done = Int32(0)
                        for _t in cutlass.range(MAX_TRIES, unroll=1):
                            if done == 0:
                                cbase = s_a
                                if topk_on and h == hk:
                                    if warp == 0:
                                        self.find(sVk, cbase, target, lane, sS, sI)
                                else:
                                    for j in cutlass.range(tidx, NBIN, THREADS, unroll=1):
                                        sC2[j] = Int32(0)
                                    cute.arch.sync_threads()
                                    rF[2] = Float32(0.0)
                                    self.sweep(2, mL, r, tidx, lane, rF, rI, sH1, sM1, sC2, m, c, filt, topp_on, h)
                                    cbase = self.block_sum(rF[2], lane, warp, sRedF)
                                    for j in cutlass.range(tidx, NBIN, THREADS, unroll=1):
                                        sV2[j] = Float32(sC2[j]) * cute.arch.exp2((_unkey(h * 256 + j) - m) * c)
                                    cute.arch.sync_threads()
                                    if warp == 0:
                                        self.find(sV2, cbase, target, lane, sS, sI)
                                cute.arch.sync_threads()
                                found = sI[4]
                                if cbase >= target:
                                    # every key of bin h has at least the target above it: look higher
                                    nh = h
                                    if tidx == 0:
                                        nh2 = Int32(-1)
                                        for j in cutlass.range(h + 1, NBIN, unroll=1):
                                            if nh2 < 0 and sC1[j] > Float32(0.0):
                                                nh2 = j
                                        sI[6] = nh2
                                    cute.arch.sync_threads()
                                    nh = sI[6]
                                    if nh < 0:  # cannot happen (the top bin has nothing above it)
                                        done = Int32(1)
                                    else:
                                        h = nh
                                elif found == 0:
                                    # the whole bin is kept: look lower (never under hk)
                                    if tidx == 0:
                                        nh2 = Int32(-1)
                                        for j in cutlass.range(h, unroll=1):
                                            jj = h - 1 - j
                                            if nh2 < 0 and jj >= hk and sC1[jj] > Float32(0.0):
                                                nh2 = jj
                                        sI[6] = nh2
                                    cute.arch.sync_threads()
                                    nh = sI[6]
                                    if nh < 0:  # the lowest eligible bin: everything eligible is kept
                                        z2 = sS[5]
                                        done = Int32(1)
                                    else:
                                        h = nh
                                else:
                                    thr_key = h * 256 + sI[5]
                                    z2 = sS[4]
                                    done = Int32(1)
                                cute.arch.sync_threads()
                invz = Float32(1.0) / z2

            if tidx == 0:
                flag = Int32(0)
                if i < n:
                    d = mDr[b, i]
                    if Tb == Float32(0.0):
                        if d == arg:
                            flag = Int32(1)
                    else:
                        bits = Int32(0)
                        if const_expr(self.epw == 1):
                            bits = Int32(mL[r, d]) & 0xFFFF
                        elif const_expr(self.epw == 2):
                            bits = (mL[r, d >> 1] >> ((d & 1) * 16)) & 0xFFFF
                        else:
                            bits = Int32((mL[r, d >> 2] >> cutlass.Int64((d & 3) * 16)) & 0xFFFF)
                        kept = _key(bits) >= thr_key
                        p_d = Float32(0.0)
                        if kept:
                            p_d = cute.arch.exp2((_as_f32(bits) - m) * c) * invz
                        q_d = Float32(1.0)
                        if const_expr(self.has_q):
                            q_d = mQ[b * D + i, d]
                        u = mU[b, i]
                        if q_d > Float32(0.0):
                            if u < p_d / q_d or (u == Float32(0.0) and kept):
                                flag = Int32(1)
                mRowF[r * RF + 0] = m
                mRowF[r * RF + 1] = invz
                mRowI[r * RI + 0] = flag
                mRowI[r * RI + 1] = arg
                mRowI[r * RI + 2] = thr_key
                mRowI[r * RI + 3] = rI[1]


class Race:
    """Launch 2: the first rejection, the one exponential race per sampled request, the output rows.

    Args:
        has_q: draft probabilities given; epw: bf16 values per load (as :class:`VerifyRows`).
    """

    def __init__(self, has_q: bool, epw: int) -> None:
        self.has_q, self.epw = has_q, epw

    @cute.jit
    def __call__(self, mL: cute.Tensor, mDr: cute.Tensor, mN: cute.Tensor, mQ: cute.Tensor, mT: cute.Tensor,
                 mE: cute.Tensor, mRowF: cute.Tensor, mRowI: cute.Tensor, mPF: cute.Tensor, mPI: cute.Tensor,
                 mCnt: cute.Tensor, mOut: cute.Tensor, mAcc: cute.Tensor, D: Int32, CHW: Int32, NC: Int32,
                 stream):
        B = mN.shape[0]
        self.kernel(mL, mDr, mN, mQ, mT, mE, mRowF, mRowI, mPF, mPI, mCnt, mOut, mAcc, D, CHW).launch(
            grid=[B, NC, 1], block=[RACE_THREADS, 1, 1], stream=stream)

    @cute.jit
    def elem(self, bits: Int32, t: Int32, e: Float32, qv: Float32, thr: Int32, m: Float32, c: Float32,
             invz: Float32, resid: cutlass.Boolean, d: Int32, rF: cute.Tensor, rI: cute.Tensor):
        p = Float32(0.0)
        if _key(bits) >= thr:
            p = cute.arch.exp2((_as_f32(bits) - m) * c) * invz
        sp = p / e
        if sp > rF[0]:
            rF[0] = sp
            rI[0] = t
        if resid:
            rr = Float32(0.0)
            if const_expr(self.has_q):
                rr = cute.arch.fmax(p - qv, Float32(0.0))
            else:
                if t != d:
                    rr = p
            if rr > Float32(0.0):
                rI[2] = Int32(1)
            sr = rr / e
            if sr > rF[1]:
                rF[1] = sr
                rI[1] = t

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mDr: cute.Tensor, mN: cute.Tensor, mQ: cute.Tensor, mT: cute.Tensor,
               mE: cute.Tensor, mRowF: cute.Tensor, mRowI: cute.Tensor, mPF: cute.Tensor, mPI: cute.Tensor,
               mCnt: cute.Tensor, mOut: cute.Tensor, mAcc: cute.Tensor, D: Int32, CHW: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        b, ch, _ = cute.arch.block_idx()
        _, nc, _ = cute.arch.grid_dim()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.utils.SmemAllocator()
        sF = smem.allocate_tensor(Float32, cute.make_layout(2 * RACE_WARPS), byte_alignment=16)
        sX = smem.allocate_tensor(Int32, cute.make_layout(3 * RACE_WARPS), byte_alignment=16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)

        D1 = D + 1
        n = mN[b]
        Tb = mT[b]
        stop = n
        for j in cutlass.range(n, unroll=1):
            if stop == n and mRowI[(b * D1 + j) * RI] == 0:
                stop = j
        r = b * D1 + stop
        NW = mL.shape[1]
        if Tb != Float32(0.0):
            m = mRowF[r * RF + 0]
            invz = mRowF[r * RF + 1]
            thr = mRowI[r * RI + 2]
            c = Float32(LOG2E) / Tb
            resid = stop < n
            d = Int32(-1)
            if resid:
                d = mDr[b, stop]
            qr = b * D + stop
            rF = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            rI = cute.make_rmem_tensor(cute.make_layout(3), Int32)
            rF[0] = Float32(-1.0)
            rF[1] = Float32(-1.0)
            rI[0] = Int32(BIG)
            rI[1] = Int32(BIG)
            rI[2] = Int32(0)
            lo = ch * CHW
            hi = lo + CHW
            if hi > NW:
                hi = NW
            EW = self.epw
            rW = cute.make_rmem_tensor(cute.make_layout(RU), Int32 if const_expr(EW == 1) else _word_type(EW))
            rE = cute.make_rmem_tensor(cute.make_layout(RU * EW), Float32)
            rQ = cute.make_rmem_tensor(cute.make_layout(RU * EW), Float32)
            step = RACE_THREADS * RU
            for base in cutlass.range(lo + tidx, hi, step, unroll=1):
                for u in cutlass.range_constexpr(RU):
                    w = base + u * RACE_THREADS
                    rW[u] = rW.element_type(0)
                    for e in cutlass.range_constexpr(EW):
                        rE[u * EW + e] = Float32(1.0)
                        rQ[u * EW + e] = Float32(0.0)
                    if w < hi:
                        if const_expr(EW == 1):
                            rW[u] = Int32(mL[r, w]) & 0xFFFF
                        else:
                            rW[u] = mL[r, w]
                        for e in cutlass.range_constexpr(EW):
                            rE[u * EW + e] = mE[b, w * EW + e]
                            if const_expr(self.has_q):
                                if resid:
                                    rQ[u * EW + e] = mQ[qr, w * EW + e]
                for u in cutlass.range_constexpr(RU):
                    w = base + u * RACE_THREADS
                    if w < hi:
                        for e in cutlass.range_constexpr(EW):
                            self.elem(_part(rW[u], e, EW), EW * w + e, rE[u * EW + e], rQ[u * EW + e], thr, m, c,
                                      invz, resid, d, rF, rI)
            # CTA winners: larger score, then lower id
            bp = rF[0]
            ap = rI[0]
            br = rF[1]
            ar = rI[1]
            anyr = rI[2]
            for s in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(bp, offset=16 >> s)
                oi = cute.arch.shuffle_sync_bfly(ap, offset=16 >> s)
                if ov > bp or (ov == bp and oi < ap):
                    bp = ov
                    ap = oi
                ov2 = cute.arch.shuffle_sync_bfly(br, offset=16 >> s)
                oi2 = cute.arch.shuffle_sync_bfly(ar, offset=16 >> s)
                if ov2 > br or (ov2 == br and oi2 < ar):
                    br = ov2
                    ar = oi2
                anyr = anyr | cute.arch.shuffle_sync_bfly(anyr, offset=16 >> s)
            if lane == 0:
                sF[warp * 2 + 0] = bp
                sF[warp * 2 + 1] = br
                sX[warp * 3 + 0] = ap
                sX[warp * 3 + 1] = ar
                sX[warp * 3 + 2] = anyr
            cute.arch.sync_threads()
            if tidx == 0:
                for j in cutlass.range_constexpr(1, RACE_WARPS):
                    ov = sF[j * 2 + 0]
                    oi = sX[j * 3 + 0]
                    if ov > bp or (ov == bp and oi < ap):
                        bp = ov
                        ap = oi
                    ov2 = sF[j * 2 + 1]
                    oi2 = sX[j * 3 + 1]
                    if ov2 > br or (ov2 == br and oi2 < ar):
                        br = ov2
                        ar = oi2
                    anyr = anyr | sX[j * 3 + 2]
                pq = b * MAX_NC + ch
                mPF[pq * 2 + 0] = bp
                mPF[pq * 2 + 1] = br
                mPI[pq * 3 + 0] = ap
                mPI[pq * 3 + 1] = ar
                mPI[pq * 3 + 2] = anyr

        last = Int32(0)
        if nc == 1:
            cute.arch.sync_threads()
            last = Int32(1)
        else:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                done = cute.arch.atomic_add(mCnt.iterator + b, Int32(1), sem="acq_rel", scope="gpu")
                sFlag[0] = done
            cute.arch.sync_threads()
            if sFlag[0] == nc - 1:
                cute.arch.fence_acq_rel_gpu()
                last = Int32(1)
        if last != 0:
            if warp == 0:
                tok = mRowI[r * RI + 1]  # greedy: the argmax at the stop
                if Tb != Float32(0.0):
                    bp = Float32(-2.0)
                    br = Float32(-2.0)
                    ap = Int32(BIG)
                    ar = Int32(BIG)
                    anyr = Int32(0)
                    if lane < nc:
                        pq = b * MAX_NC + lane
                        bp = mPF[pq * 2 + 0]
                        br = mPF[pq * 2 + 1]
                        ap = mPI[pq * 3 + 0]
                        ar = mPI[pq * 3 + 1]
                        anyr = mPI[pq * 3 + 2]
                    for s in cutlass.range_constexpr(5):
                        ov = cute.arch.shuffle_sync_bfly(bp, offset=16 >> s)
                        oi = cute.arch.shuffle_sync_bfly(ap, offset=16 >> s)
                        if ov > bp or (ov == bp and oi < ap):
                            bp = ov
                            ap = oi
                        ov2 = cute.arch.shuffle_sync_bfly(br, offset=16 >> s)
                        oi2 = cute.arch.shuffle_sync_bfly(ar, offset=16 >> s)
                        if ov2 > br or (ov2 == br and oi2 < ar):
                            br = ov2
                            ar = oi2
                        anyr = anyr | cute.arch.shuffle_sync_bfly(anyr, offset=16 >> s)
                    tok = ap
                    if stop < n and anyr != 0:
                        tok = ar
                if lane < D1:
                    o = Int32(-1)
                    if lane < stop:
                        o = mDr[b, lane]
                    elif lane == stop:
                        o = tok
                    mOut[b, lane] = o
                if lane == 0:
                    mAcc[b] = stop
                    if nc > 1:
                        mCnt[b] = Int32(0)  # the done counter back to zero for the next call


def _build_rows(key: tuple):
    has_q, epw = key
    R, NW, B, D, BD, VQ = sym_dim(), sym_dim(), sym_dim(), sym_dim(), sym_dim(), sym_dim()
    args = (
        fake_tensor(_word_type(epw), (R, NW)), fake_tensor(Int32, (B, D)), fake_tensor(Int32, (B,)),
        fake_tensor(Float32, (BD, VQ)), fake_tensor(Float32, (B,)), fake_tensor(Int32, (B,)),
        fake_tensor(Float32, (B,)), fake_tensor(Float32, (B, D)), fake_tensor(Float32, (MAX_R * RF,)),
        fake_tensor(Int32, (MAX_R * RI,)), Int32(1), Int32(2), env_stream(),
    )
    return cute.compile(VerifyRows(has_q, epw), *args, options=compile_options())


def _build_race(key: tuple):
    has_q, epw = key
    R, NW, B, D, BD, VQ, V, D1 = (sym_dim() for _ in range(8))
    args = (
        fake_tensor(_word_type(epw), (R, NW)), fake_tensor(Int32, (B, D)), fake_tensor(Int32, (B,)),
        fake_tensor(Float32, (BD, VQ)), fake_tensor(Float32, (B,)), fake_tensor(Float32, (B, V)),
        fake_tensor(Float32, (MAX_R * RF,)), fake_tensor(Int32, (MAX_R * RI,)),
        fake_tensor(Float32, (MAX_B * MAX_NC * 2,)), fake_tensor(Int32, (MAX_B * MAX_NC * 3,)),
        fake_tensor(Int32, (MAX_B,)), fake_tensor(Int32, (B, D1)), fake_tensor(Int32, (B,)),
        Int32(1), Int32(1), Int32(1), env_stream(),
    )
    return cute.compile(Race(has_q, epw), *args, options=compile_options())


ROWS = CompileCache("dspark_verify.cute_rows", _build_rows)
"""Compiled row kernels, one per (draft probabilities given, bf16 values per load)."""
RACES = CompileCache("dspark_verify.cute_race", _build_race)
"""Compiled race kernels, one per (draft probabilities given, bf16 values per load)."""


# ------------------------------------------------------------------------------------ host side

_WORKSPACES: dict[str, dict[str, torch.Tensor]] = {}


def _workspace(device: torch.device) -> dict[str, torch.Tensor]:
    """Per-device buffers of the largest size (batch 64, D 8), made once; the done counters are zero
    between calls (the last CTA of each request resets its own). Made at the first call, which the
    callers make eagerly before any graph capture (warm-up); calls on one device must not overlap."""
    key = str(device)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = {"rowf": torch.zeros(MAX_R * RF, dtype=torch.float32, device=device),
              "rowi": torch.zeros(MAX_R * RI, dtype=torch.int32, device=device),
              "pf": torch.zeros(MAX_B * MAX_NC * 2, dtype=torch.float32, device=device),
              "pi": torch.zeros(MAX_B * MAX_NC * 3, dtype=torch.int32, device=device),
              "cnt": torch.zeros(MAX_B, dtype=torch.int32, device=device)}
        _WORKSPACES[key] = ws
    return ws


def race_split(B: int, NW: int) -> tuple[int, int]:
    """(chunk words, chunks) of the race launch: about ``RACE_CTAS`` CTAs in all, at most ``MAX_NC`` per request."""
    per = RACE_THREADS * RU
    nc = max(1, min(MAX_NC, RACE_CTAS // max(B, 1), -(-NW // per)))
    chw = -(-NW // nc)
    return chw, -(-NW // chw)


def launch(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
           uniform_draws, exponential_noise, *, max_draft_tokens, output_token_ids, num_accepted_tokens) -> None:
    """Run the two launches on torch's current stream (arguments checked by ``check_args`` first)."""
    B, D1, V = target_logits.shape
    D = int(max_draft_tokens)
    R = B * D1
    has_q = draft_probs is not None
    logits = target_logits.contiguous().view(torch.int16).reshape(R, V)
    epw = 1
    for k, dt in ((4, torch.int64), (2, torch.int32)):
        if V % k == 0 and logits.data_ptr() % (2 * k) == 0:
            logits = logits.view(dt)
            epw = k
            break
    drafts = draft_token_ids.contiguous()
    q = draft_probs.contiguous().reshape(B * D, V) if has_q else uniform_draws.contiguous()
    ws = _workspace(target_logits.device)
    chw, nc = race_split(B, logits.shape[1])
    ROWS.get((has_q, epw))(logits, drafts, num_draft_tokens.contiguous(), q, temperature.contiguous(),
                            top_k.contiguous(), top_p.contiguous(), uniform_draws.contiguous(), ws["rowf"],
                            ws["rowi"], D, V)
    RACES.get((has_q, epw))(logits, drafts, num_draft_tokens.contiguous(), q, temperature.contiguous(),
                             exponential_noise.contiguous(), ws["rowf"], ws["rowi"], ws["pf"], ws["pi"], ws["cnt"],
                             output_token_ids, num_accepted_tokens, D, chw, nc)
