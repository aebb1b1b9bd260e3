"""The Triton kernels behind the CUDA dspark_verify path (see ``__init__.py`` for the design).

Three launches, each spread over the vocabulary (grid rows x chunks), each closed by a "last program
of the row / request" step that merges the partial results of its siblings:

1. ``_stats_kernel`` (grid ``(B*(D+1), NC)``): per chunk the max, the lowest-id argmax and (sampled
   rows) the softmax sum relative to the chunk max; for rows with top-k or top-p also a 128-bin count
   histogram of log-probability cells (stage A, below). The last program of a row merges them: the
   row max and argmax, ``Z = sum_t exp((x_t - m) / T)``, and, for rows without filters, the accept
   flag of its draft. For filtered rows it brackets the top-k and top-p thresholds to at most two
   ranges of stage-A bins and plans their exact resolution.
2. ``_refine_kernel`` (same grid, filtered rows only): per chunk the exact mass above each planned
   range and, inside it, either an exact histogram of bf16 values (the range spans at most ``NB2``
   distinct values) or the values themselves, compacted into a per-row buffer (at most ``CAP`` of
   them). The last program of the row resolves the k-th largest value, the top-p boundary value and
   the kept mass ``Z'`` exactly, and the accept flag. A row whose bracket fits neither (or whose
   counts disagree) takes the exact serial path of the previous single-launch kernel (windows of
   ``NBINS`` values walked from the max, jumping over empty key ranges) in that last program.
3. ``_race_kernel`` (grid ``(B, NC3)``): the first rejected position ``s`` of each request from the
   flags; a sampled request runs its one exponential race ``argmax_t w(t) / E(t)`` over the residual
   (and over p, the bonus or the all-zero fallback) at ``s`` only, per chunk; the last program merges
   the chunk winners (lowest id on ties) and writes the output row and ``num_accepted_tokens``.

Stage A bins. With ``s4 = 4 log2(e) / T`` and ``g(x) = floor(x * s4)`` (quarter-units of log2
probability), bin ``j < 96`` holds ``g(x) = 4 H + 3 - j`` and bin ``96 + r`` (``r < 31``) holds
``floor(g / 4) = H - 24 - r``, where ``H = floor(g(m) / 4)``; everything lower is bin 127. A chunk
bins against its own ``H_c``; the merge shifts by the integer ``H - H_c``. A bin's probability mass
lies between count x the weights at its edges, which brackets where the cumulative mass crosses
``top_p * Z``; the bracket is also bounded through ``Z - mass(bins below)``.

bf16 logits are read as raw 16-bit patterns; ``_key`` maps a pattern to an int32 whose order is the
value order (-0.0 folded onto +0.0, so equal values share one key).

Workspace (per device, grown to the largest call; every counter is zero between calls, the last
programs reset them): per row ``rowf`` (m, threshold, Z', Z, H) and ``rowi`` (flag, argmax, state, plan), per
(row, chunk) partials, per row compaction buffers and counters, per request race partials.

Source: k3_model/ops/dspark_verify.py (the contract); kernel_targets.md §2.1 (vLLM v1 rejection
sampler: greedy / random accept tests, exponential race), §2.5 (edge cases); the "last block"
completion pattern of the CUDA threadFenceReduction sample (written anew here, as in the
k3_moe_dispatch Triton fixture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192
"""Vocabulary elements per tile of the stats launch and the chunk granularity (count); the refine
launch reads four tiles of ``BLOCK // 8`` per step (16 KB and 8 KB of logits per program in flight;
the refine tile is smaller because its exact resolution step needs the registers)."""
RACE_TILE = 2048
"""Vocabulary elements per tile of the race launch (count): 12-20 KB of logits, noise and draft
probabilities per program in flight."""
NBINS = 512
"""Distinct logit values per histogram window of the serial fallback (count)."""
NB2 = 64
"""Exact-value histogram bins of stage B (count); a planned range spanning more values is compacted."""
CAP = 512
"""Values one planned range may compact per row (count); more, and the row takes the serial path."""
TARGET_PROGRAMS = 2048
"""Programs aimed at per launch of the per-row kernels (count; 132 SMs on an H200)."""
MAX_CHUNKS = 32
"""Vocabulary chunks per row at most (count; a power of two: the merge steps are padded to it)."""
RACE_PROGRAMS = 1024
"""Programs aimed at for the race launch (count)."""
MAX_RACE_CHUNKS = 64
"""Vocabulary chunks per request in the race at most (count; a power of two, as ``MAX_CHUNKS``)."""

_RF = 8  # floats per row: m, thr, zp, zf, H
_RI = 24  # ints per row: flag, tok, state, bk, nbelow1, (j0, j1, mode, khi, cab, cnt) x 2
_PF = 8  # floats per (row, chunk): m_c, s_c, H_c, A1, A2
_LOG2E = 1.4426950408889634
_WORKSPACES: dict[tuple, dict[str, torch.Tensor]] = {}


@triton.jit
def _key(bits):
    """int32 16-bit bf16 pattern -> order-preserving int32 key (-0.0 folded onto +0.0)."""
    bits = tl.where(bits == 0x8000, 0, bits)
    return tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)


@triton.jit
def _unkey(key):
    """Inverse of ``_key``: int32 key -> fp32 value of that bf16 pattern."""
    bits = tl.where(key >= 0x8000, key - 0x8000, 0xFFFF - key)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _fkey(v):
    """fp32 value -> key of its nearest bf16 value."""
    return _key(v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)


@triton.jit
def _bits(row, idx, ok):
    """The 16-bit patterns of ``row[idx]`` as int32; masked lanes read as -inf (0xFF80)."""
    return tl.where(ok, tl.load(row + idx, mask=ok, other=0).to(tl.int32) & 0xFFFF, 0xFF80)


@triton.jit
def _f32(bits):
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _abin(x, s4, hh):
    """Stage-A bin of ``x`` (0 = top) against the cell ``hh`` (fp32, integer valued); int32 in [0, 127]."""
    g = tl.floor(x * s4)
    h = tl.floor(g * 0.25)
    qf = (4.0 * hh + 3.0) - g
    cf = tl.minimum(96.0 + ((hh - 24.0) - h), 127.0)
    return tl.where(qf < 96.0, qf, cf).to(tl.int32)


@triton.jit
def _accept(row, d, thr, m, c, zp, q_ptr, qoff, u, HAS_Q: tl.constexpr):
    """1 if draft ``d`` is accepted: ``q(d) > 0 and u < p(d) / q(d)``, p zero below ``thr``."""
    bd = tl.load(row + d).to(tl.int32) & 0xFFFF
    xd = _f32(bd)
    p_d = tl.where(xd >= thr, tl.exp2((xd - m) * c) * (1.0 / zp), 0.0)
    q_d = tl.full([], 1.0, tl.float32)
    if HAS_Q:
        q_d = tl.load(q_ptr + qoff + d)
    return ((q_d > 0.0) & (u < p_d / q_d)).to(tl.int32)


@triton.jit
def _serial_thresholds(row, V, m, c, kk, tp, topk_on, topp_on, zf, BLOCK: tl.constexpr, NBINS: tl.constexpr):
    """Exact top-k / top-p thresholds of one row by one program (the previous kernel's algorithm).

    Count histograms of exact bf16 values in ``NBINS``-value windows below the max (a bin is one
    value, so count x weight is its mass); each next window starts at the largest occupied key below
    the last one. Returns ``(lo_key, Zp)``: keep ``key(x) >= lo_key``; ``Zp`` their mass.
    """
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, NBINS)
    km = _fkey(m)
    lo_key = tl.full([], 0x7F, tl.int32)  # key of -inf: keep every finite logit
    Z = zf
    hist0 = tl.zeros([NBINS], dtype=tl.int32)
    k_w0 = tl.full([], 0, tl.int32)
    if topk_on:
        above = tl.full([], 0, tl.int32)
        zk = tl.full([], 0.0, tl.float32)
        w = tl.full([], 0, tl.int32)
        base = km
        found = tl.full([], 0, tl.int32)
        while found == 0:
            bkey = base - j
            wt = tl.where(bkey >= 0x7F, tl.exp2((_unkey(bkey) - m) * c), 0.0)
            hist = tl.zeros([NBINS], dtype=tl.int32)
            nxt = tl.full([], 0, tl.int32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                kx = _key(_bits(row, idx, idx < V))
                bn = base - kx
                hist += tl.histogram(bn, NBINS, mask=(idx < V) & (bn >= 0) & (bn < NBINS))
                nxt = tl.maximum(nxt, tl.max(tl.where((idx < V) & (bn >= NBINS), kx, 0), axis=0))
            cc = tl.cumsum(hist, axis=0) + above
            jk = tl.min(tl.where(cc >= kk, j, NBINS), axis=0)
            mass = hist.to(tl.float32) * wt
            if jk < NBINS:
                found = tl.full([], 1, tl.int32)
                lo_key = base - jk
                zk += tl.sum(tl.where(j <= jk, mass, 0.0), axis=0)
                if w == 0:
                    k_w0 = tl.full([], 1, tl.int32)
                    hist0 = tl.where(j <= jk, hist, 0)
            else:
                above += tl.sum(hist, axis=0)
                zk += tl.sum(mass, axis=0)
                w += 1
                base = nxt
        Z = zk
    Zp = Z
    if topp_on:
        target = tp * Z
        mabove = tl.full([], 0.0, tl.float32)
        w = tl.full([], 0, tl.int32)
        base = km
        done = tl.full([], 0, tl.int32)
        while done == 0:
            bkey = base - j
            wt = tl.where(bkey >= 0x7F, tl.exp2((_unkey(bkey) - m) * c), 0.0)
            nxt = tl.full([], 0, tl.int32)
            if (k_w0 == 1) & (w == 0):
                hist = hist0
            else:
                hist = tl.zeros([NBINS], dtype=tl.int32)
                for start in range(0, V, BLOCK):
                    idx = start + offs
                    kx = _key(_bits(row, idx, idx < V))
                    bn = base - kx
                    ok = (idx < V) & (kx >= lo_key)
                    hist += tl.histogram(bn, NBINS, mask=ok & (bn >= 0) & (bn < NBINS))
                    nxt = tl.maximum(nxt, tl.max(tl.where(ok & (bn >= NBINS), kx, 0), axis=0))
            mass = hist.to(tl.float32) * wt
            excl = tl.cumsum(mass, axis=0) - mass + mabove
            jd = tl.min(tl.where((excl >= target) & (bkey >= lo_key), j, NBINS), axis=0)
            if jd < NBINS:
                done = tl.full([], 1, tl.int32)
                Zp = mabove + tl.sum(tl.where(j < jd, mass, 0.0), axis=0)
                lo_key = tl.maximum(lo_key, base - jd + 1)
            else:
                mabove += tl.sum(mass, axis=0)
                w += 1
                base = nxt
                if base < lo_key:
                    done = tl.full([], 1, tl.int32)
                    Zp = mabove
    return lo_key, Zp


@triton.jit
def _range_keys(j0, j1, hh, s4):
    """Key interval holding every value of stage-A bins ``j0..j1`` (0 = top): ``(key_hi, n_keys)``.

    Two keys of margin on each side cover the rounding of ``x * s4``; the stage-B counts are checked
    against stage A's, so a value outside would send the row to the serial path, never be lost."""
    j0f = j0.to(tl.float32)
    j1f = j1.to(tl.float32)
    gtop = tl.where(j0 < 96, 4.0 * hh + 3.0 - j0f,
                    tl.where(j0 < 127, 4.0 * (hh - 24.0 - (j0f - 96.0)) + 3.0, 4.0 * (hh - 55.0) + 3.0))
    gbot = tl.where(j1 < 96, 4.0 * hh + 3.0 - j1f,
                    tl.where(j1 < 127, 4.0 * (hh - 24.0 - (j1f - 96.0)), -float("inf")))
    khi = tl.minimum(_fkey((gtop + 1.0) / s4) + 2, 0xFFFF)
    klo = tl.maximum(_fkey(gbot / s4) - 2, 0)
    return khi, khi - klo + 1


@triton.jit
def _stats_kernel(
    logits_ptr, drafts_ptr, n_ptr, q_ptr, temp_ptr, topk_ptr, topp_ptr, u_ptr,
    rowf_ptr, rowi_ptr, pf_ptr, pi_ptr, ph_ptr, cnt_ptr,
    V, CH, NC, D,
    HAS_Q: tl.constexpr, BLOCK: tl.constexpr, NC_PAD: tl.constexpr, NB2: tl.constexpr, CAP: tl.constexpr,
):
    r = tl.program_id(0)
    ch = tl.program_id(1)
    D1 = D + 1
    b = r // D1
    i = r % D1
    n = tl.load(n_ptr + b)
    if i <= n:
        T = tl.load(temp_ptr + b)
        greedy = T == 0.0
        c = 1.4426950408889634 / tl.where(greedy, 1.0, T)  # greedy rows never divide by 0
        kk = tl.load(topk_ptr + b)
        tp = tl.load(topp_ptr + b)
        topk_on = (kk > 0) & (kk < V) & (T != 0.0)
        topp_on = (tp < 1.0) & (T != 0.0)
        filt = topk_on | topp_on
        row = logits_ptr + r.to(tl.int64) * V
        offs = tl.arange(0, BLOCK)
        lo = ch * CH
        hi = tl.minimum(lo + CH, V)
        # ---- sweep 1: max, first argmax, softmax sum relative to the running max (sampled rows)
        m = tl.full([], -float("inf"), tl.float32)
        am = tl.full([], 0, tl.int32)
        s = tl.full([], 0.0, tl.float32)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            x = _f32(_bits(row, idx, idx < hi))
            bm = tl.max(x, axis=0)
            ba = tl.argmax(x, axis=0, tie_break_left=True) + start
            if T != 0.0:
                nm = tl.maximum(m, bm)
                alpha = tl.where(m == nm, 1.0, tl.exp2((m - nm) * c))
                s = s * alpha + tl.sum(tl.where(x > -float("inf"), tl.exp2((x - nm) * c), 0.0), axis=0)
            am = tl.where(bm > m, ba, am)
            m = tl.maximum(m, bm)
        # ---- sweep 2 (filtered rows): stage-A count histogram against this chunk's own cell
        hc = tl.full([], -1.0e30, tl.float32)
        if filt:
            s4 = 4.0 * c
            if m > -float("inf"):
                hc = tl.floor(tl.floor(m * s4) * 0.25)
            hist = tl.zeros([128], dtype=tl.int32)
            for start in range(lo, hi, BLOCK):
                idx = start + offs
                ok = idx < hi
                x = _f32(_bits(row, idx, ok))
                hist += tl.histogram(_abin(x, s4, hc), 128, mask=ok)
            tl.store(ph_ptr + (r * NC + ch) * 128 + tl.arange(0, 128), hist)
        pbase = (r * NC + ch) * 8
        tl.store(pf_ptr + pbase + 0, m)
        tl.store(pf_ptr + pbase + 1, s)
        tl.store(pf_ptr + pbase + 2, hc)
        tl.store(pi_ptr + r * NC + ch, am)
        # ---- the last program of the row merges the chunks
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel", scope="gpu")
        if done == NC - 1:
            cidx = tl.arange(0, NC_PAD)
            cm = cidx < NC
            pm = tl.load(pf_ptr + (r * NC + cidx) * 8 + 0, mask=cm, other=-float("inf"), cache_modifier=".cg")
            ps = tl.load(pf_ptr + (r * NC + cidx) * 8 + 1, mask=cm, other=0.0, cache_modifier=".cg")
            pa = tl.load(pi_ptr + r * NC + cidx, mask=cm, other=V, cache_modifier=".cg")
            M = tl.max(pm, axis=0)
            A = tl.min(tl.where(cm & (pm == M), pa, V), axis=0)
            flag = tl.full([], 0, tl.int32)
            zf = tl.full([], 1.0, tl.float32)
            state = tl.full([], 0, tl.int32)
            fb = r * 24
            if greedy:
                if i < n:
                    d = tl.load(drafts_ptr + b * D + i)
                    flag = (d == A).to(tl.int32)
            else:
                zf = tl.sum(tl.where(cm & (pm > -float("inf")), ps * tl.exp2((pm - M) * c), 0.0), axis=0)
                if filt:
                    state = _plan(rowi_ptr, fb, pf_ptr, ph_ptr, r, NC, M, c, kk, tp, topk_on, topp_on, zf, V,
                                  NC_PAD, NB2, CAP)
                    hg = tl.max(tl.load(pf_ptr + (r * NC + cidx) * 8 + 2, mask=cm, other=-1.0e30, cache_modifier=".cg"), axis=0)
                    tl.store(rowf_ptr + r * 8 + 4, hg)
                else:
                    if i < n:
                        d = tl.load(drafts_ptr + b * D + i)
                        u = tl.load(u_ptr + b * D + i)
                        flag = _accept(row, d, -float("inf"), M, c, zf, q_ptr, (b * D + i).to(tl.int64) * V, u, HAS_Q)
            tl.store(rowf_ptr + r * 8 + 0, M)
            tl.store(rowf_ptr + r * 8 + 1, -float("inf"))
            tl.store(rowf_ptr + r * 8 + 2, zf)
            tl.store(rowf_ptr + r * 8 + 3, zf)
            tl.store(rowi_ptr + fb + 0, flag)
            tl.store(rowi_ptr + fb + 1, A)
            tl.store(rowi_ptr + fb + 2, state)
            tl.atomic_xchg(cnt_ptr + r, 0, sem="relaxed", scope="gpu")


@triton.jit
def _plan(rowi_ptr, fb, pf_ptr, ph_ptr, r, NC, M, c, kk, tp, topk_on, topp_on, zf, V,
          NC_PAD: tl.constexpr, NB2: tl.constexpr, CAP: tl.constexpr):
    """Merge the stage-A histograms of row ``r``, bracket its thresholds, store the plan; returns the
    state (1: resolve in stage B, 2: serial path)."""
    s4 = 4.0 * c
    cidx = tl.arange(0, NC_PAD)
    cm = cidx < NC
    hcs = tl.load(pf_ptr + (r * NC + cidx) * 8 + 2, mask=cm, other=-1.0e30, cache_modifier=".cg")
    hg = tl.max(hcs, axis=0)
    dsh = tl.minimum(hg - hcs, 200.0).to(tl.int32)
    t = tl.arange(0, 128)
    t2 = t[None, :]
    d2 = dsh[:, None]
    cm2 = cm[:, None]
    base = ph_ptr + (r * NC + cidx[:, None]) * 128
    src = tl.where(t2 < 96, t2 - 4 * d2, t2 - d2)
    ok1 = cm2 & (((t2 < 96) & (src >= 0)) | ((t2 >= 96) & (t2 < 127) & (src >= 96)))
    H = tl.sum(tl.load(base + tl.where(ok1, src, 0), mask=ok1, other=0, cache_modifier=".cg"), axis=0)
    for uu in tl.static_range(4):
        qf = 4 * (t2 - 72 - d2) + uu  # chunk fine bins whose global cell is coarse bin t
        ok2 = cm2 & (t2 >= 96) & (t2 < 127) & (qf >= 0) & (qf < 96)
        H += tl.sum(tl.load(base + tl.where(ok2, qf, 0), mask=ok2, other=0, cache_modifier=".cg"), axis=0)
    H = tl.where(t == 127, V - tl.sum(tl.where(t < 127, H, 0), axis=0), H)
    Hf = H.to(tl.float32)
    # weight bounds per bin (relative to the max; 1e-6-level margins for the rounding of x * s4)
    ms = M * s4
    tf = t.to(tl.float32)
    gfine = 4.0 * hg + 3.0 - tf
    hcell = hg - 24.0 - (tf - 96.0)
    lo_g = tl.where(t < 96, gfine, 4.0 * hcell)
    hi_g = tl.where(t < 96, gfine + 1.0, tl.where(t < 127, 4.0 * hcell + 4.0, 4.0 * (hg - 54.0)))
    dl = (tl.abs(ms) + 64.0) * 4.8e-7
    wlo = tl.where(t == 127, 0.0, tl.exp2((lo_g - ms) * 0.25 - dl))
    whi = tl.minimum(tl.exp2((hi_g - ms) * 0.25 + dl), 1.0)
    # top-k: the bin holding the k-th largest value (exact counts)
    bk = tl.full([], 127, tl.int32)
    if topk_on:
        bk = tl.min(tl.where(tl.cumsum(H, axis=0) >= kk, t, 127), axis=0)
    cab_k = tl.sum(tl.where(t < bk, H, 0), axis=0)
    nk_at = (kk - cab_k).to(tl.float32)  # tokens of bin bk kept by top-k, at least
    inset = t <= bk
    mlo = tl.where(inset, tl.where(topk_on & (t == bk), nk_at * wlo, Hf * wlo), 0.0)
    mhi = tl.where(inset, Hf * whi, 0.0)
    zlo = zf * (1.0 - 1e-5)
    zhi = zf * (1.0 + 1e-5)
    if topk_on:
        zlo = tl.sum(mlo, axis=0) * (1.0 - 1e-5)
        zhi = tl.sum(mhi, axis=0) * (1.0 + 1e-5)
    # top-p: bins whose first token may (jm) / surely (js) have mass above below top_p * Z
    elo0 = tl.cumsum(mlo, axis=0) - mlo
    ehi0 = tl.cumsum(mhi, axis=0) - mhi
    elo = tl.maximum(elo0, zlo - (tl.sum(mhi, axis=0) - ehi0))
    ehi = tl.minimum(ehi0, zhi - (tl.sum(mlo, axis=0) - elo0))
    tlo = tp * zlo * (1.0 - 1e-5)
    thi = tp * zhi * (1.0 + 1e-5)
    js = tl.max(tl.where(inset & (ehi * (1.0 + 1e-6) < tlo), t, 0), axis=0)
    jm = tl.max(tl.where(inset & (elo * (1.0 - 1e-6) < thi), t, 0), axis=0)
    # ranges: 1 = top-p bracket (or the top-k bin alone), 2 = the top-k bin when apart from range 1
    j0a = bk
    j1a = bk
    j0b = tl.full([], -1, tl.int32)
    j1b = tl.full([], -2, tl.int32)
    if topp_on:
        j0a = js
        j1a = jm
        if topk_on & (jm < bk):
            j0b = bk
            j1b = bk
    lim = tl.where(topk_on, bk, 127)
    nbelow1 = tl.sum(tl.where((t > j1a) & (t <= lim), H, 0), axis=0)
    khia, nka = _range_keys(j0a, j1a, hg, s4)
    cnta = tl.sum(tl.where((t >= j0a) & (t <= j1a), H, 0), axis=0)
    caba = tl.sum(tl.where(t < j0a, H, 0), axis=0)
    modea = tl.where(nka <= NB2, 1, tl.where(cnta <= CAP, 2, 0))
    state = tl.where(modea == 0, 2, 1)
    modeb = tl.full([], 0, tl.int32)
    khib = tl.full([], 0, tl.int32)
    cntb = tl.full([], 0, tl.int32)
    cabb = tl.full([], 0, tl.int32)
    if j0b >= 0:
        khib, nkb = _range_keys(j0b, j1b, hg, s4)
        cntb = tl.sum(tl.where(t == j0b, H, 0), axis=0)
        cabb = cab_k
        modeb = tl.where(nkb <= NB2, 1, tl.where(cntb <= CAP, 2, 0))
        state = tl.where(modeb == 0, 2, state)
    tl.store(rowi_ptr + fb + 3, bk)
    tl.store(rowi_ptr + fb + 4, nbelow1)
    tl.store(rowi_ptr + fb + 5, j0a)
    tl.store(rowi_ptr + fb + 6, j1a)
    tl.store(rowi_ptr + fb + 7, modea)
    tl.store(rowi_ptr + fb + 8, khia)
    tl.store(rowi_ptr + fb + 9, caba)
    tl.store(rowi_ptr + fb + 10, cnta)
    tl.store(rowi_ptr + fb + 11, j0b)
    tl.store(rowi_ptr + fb + 12, j1b)
    tl.store(rowi_ptr + fb + 13, modeb)
    tl.store(rowi_ptr + fb + 14, khib)
    tl.store(rowi_ptr + fb + 15, cabb)
    tl.store(rowi_ptr + fb + 16, cntb)
    return state


@triton.jit
def _pairs(ikey, kf, vf, m, c, gt, ge, gtm):
    """Add, for every item key, the count of block keys ``kf`` above it, at least it, and their mass."""
    wf = tl.where(vf, tl.exp2((_unkey(kf) - m) * c), 0.0)
    gtmat = (kf[None, :] > ikey[:, None]) & vf[None, :]
    gemat = (kf[None, :] >= ikey[:, None]) & vf[None, :]
    gt += tl.sum(gtmat.to(tl.int32), axis=1)
    ge += tl.sum(gemat.to(tl.int32), axis=1)
    gtm += tl.sum(tl.where(gtmat, wf[None, :], 0.0), axis=1)
    return gt, ge, gtm


@triton.jit
def _range_items(pb_ptr, cb_ptr, cc_ptr, r, NC, slot, mode, khi, m, c,
                 NC_PAD: tl.constexpr, NB2: tl.constexpr, CAP: tl.constexpr, FB: tl.constexpr):
    """One planned range as items (key, multiplicity) with, per item, the count and the mass of the
    items with a strictly larger key, the count with a key at least as large, and its weight.

    Histogram mode: item e is the value ``khi - e`` (sorted, so exclusive prefix sums). Compact mode:
    item e is the e-th compacted value (pairwise comparisons in blocks of ``FB``)."""
    e = tl.arange(0, CAP)
    ikey = tl.full([CAP], -1, tl.int32)
    imul = tl.zeros([CAP], dtype=tl.int32)
    gt = tl.zeros([CAP], dtype=tl.int32)
    ge = tl.zeros([CAP], dtype=tl.int32)
    gtm = tl.zeros([CAP], dtype=tl.float32)
    total = tl.full([], 0, tl.int32)
    if mode == 1:
        cidx = tl.arange(0, NC_PAD)
        hh = tl.load(pb_ptr + ((r * NC + cidx[:, None]) * 2 + slot) * NB2 + e[None, :],
                     mask=(cidx < NC)[:, None] & (e < NB2)[None, :], other=0, cache_modifier=".cg")
        imul = tl.sum(hh, axis=0)
        total = tl.sum(imul, axis=0)
        ikey = tl.where(e < NB2, khi - e, -1)
        mj = imul.to(tl.float32) * tl.where(imul > 0, tl.exp2((_unkey(ikey) - m) * c), 0.0)
        ge = tl.cumsum(imul, axis=0)
        gt = ge - imul
        gtm = tl.cumsum(mj, axis=0) - mj
    if mode == 2:
        total = tl.load(cc_ptr + r * 2 + slot, cache_modifier=".cg")
        nv = tl.minimum(total, CAP)
        bufp = cb_ptr + (r * 2 + slot) * CAP
        ikey = tl.load(bufp + e, mask=e < nv, other=-1, cache_modifier=".cg")
        imul = (e < nv).to(tl.int32)
        for f0 in range(0, nv, 4 * FB):  # four blocks per step: their loads are in flight together
            fa = f0 + tl.arange(0, FB)
            kf0 = tl.load(bufp + fa, mask=fa < nv, other=-1, cache_modifier=".cg")
            kf1 = tl.load(bufp + fa + FB, mask=fa + FB < nv, other=-1, cache_modifier=".cg")
            kf2 = tl.load(bufp + fa + 2 * FB, mask=fa + 2 * FB < nv, other=-1, cache_modifier=".cg")
            kf3 = tl.load(bufp + fa + 3 * FB, mask=fa + 3 * FB < nv, other=-1, cache_modifier=".cg")
            gt, ge, gtm = _pairs(ikey, kf0, fa < nv, m, c, gt, ge, gtm)
            gt, ge, gtm = _pairs(ikey, kf1, fa + FB < nv, m, c, gt, ge, gtm)
            gt, ge, gtm = _pairs(ikey, kf2, fa + 2 * FB < nv, m, c, gt, ge, gtm)
            gt, ge, gtm = _pairs(ikey, kf3, fa + 3 * FB < nv, m, c, gt, ge, gtm)
    iw = tl.where(imul > 0, tl.exp2((_unkey(ikey) - m) * c), 0.0)
    return ikey, imul, gt, ge, gtm, iw, total


@triton.jit
def _refine_tile(bits, ok, m, c, s4, hg, j0a, j1a, modea, khia, j0b, j1b, modeb, khib, cc_ptr, cb_ptr, r,
                 a1, a2, ha, hb, NB2: tl.constexpr, CAP: tl.constexpr):
    """Stage B on one tile: masses above the ranges (per-lane sums), exact histograms or compaction
    inside them."""
    x = _f32(bits)
    kx = _key(bits)
    jx = _abin(x, s4, hg)
    w = tl.exp2((x - m) * c)
    a1 += tl.where(ok & (jx < j0a), w, 0.0)
    a2 += tl.where(ok & (jx < j0b), w, 0.0)
    ina = ok & (jx >= j0a) & (jx <= j1a)
    inb = ok & (jx >= j0b) & (jx <= j1b)
    if modea == 1:
        ix = khia - kx
        ha += tl.histogram(tl.where(ina, ix, 0), NB2, mask=ina & (ix >= 0) & (ix < NB2))
    if modea == 2:
        sl = tl.atomic_add(cc_ptr + r * 2 + 0 + kx * 0, 1, mask=ina, sem="relaxed", scope="gpu")
        tl.store(cb_ptr + (r * 2 + 0) * CAP + sl, kx, mask=ina & (sl < CAP))
    if modeb == 1:
        ix = khib - kx
        hb += tl.histogram(tl.where(inb, ix, 0), NB2, mask=inb & (ix >= 0) & (ix < NB2))
    if modeb == 2:
        sl = tl.atomic_add(cc_ptr + r * 2 + 1 + kx * 0, 1, mask=inb, sem="relaxed", scope="gpu")
        tl.store(cb_ptr + (r * 2 + 1) * CAP + sl, kx, mask=inb & (sl < CAP))
    return a1, a2, ha, hb


@triton.jit
def _refine_kernel(
    logits_ptr, drafts_ptr, n_ptr, q_ptr, temp_ptr, topk_ptr, topp_ptr, u_ptr,
    rowf_ptr, rowi_ptr, pf_ptr, pb_ptr, cb_ptr, cc_ptr, cnt_ptr,
    V, CH, NC, D,
    HAS_Q: tl.constexpr, BLOCK: tl.constexpr, NC_PAD: tl.constexpr, NB2: tl.constexpr, CAP: tl.constexpr,
    NBINS: tl.constexpr, FB: tl.constexpr,
):
    r = tl.program_id(0)
    ch = tl.program_id(1)
    D1 = D + 1
    b = r // D1
    i = r % D1
    n = tl.load(n_ptr + b)
    fb = r * 24
    state = tl.full([], 0, tl.int32)
    if i <= n:
        state = tl.load(rowi_ptr + fb + 2)
    if state != 0:
        T = tl.load(temp_ptr + b)
        c = 1.4426950408889634 / T  # sampled rows only
        s4 = 4.0 * c
        kk = tl.load(topk_ptr + b)
        tp = tl.load(topp_ptr + b)
        topk_on = (kk > 0) & (kk < V)
        topp_on = tp < 1.0
        m = tl.load(rowf_ptr + r * 8 + 0)
        zf = tl.load(rowf_ptr + r * 8 + 3)
        hg = tl.load(rowf_ptr + r * 8 + 4)
        row = logits_ptr + r.to(tl.int64) * V
        j0a = tl.load(rowi_ptr + fb + 5)
        j1a = tl.load(rowi_ptr + fb + 6)
        modea = tl.load(rowi_ptr + fb + 7)
        khia = tl.load(rowi_ptr + fb + 8)
        j0b = tl.load(rowi_ptr + fb + 11)
        j1b = tl.load(rowi_ptr + fb + 12)
        modeb = tl.load(rowi_ptr + fb + 13)
        khib = tl.load(rowi_ptr + fb + 14)
        if state == 1:
            offs = tl.arange(0, BLOCK)
            lo = ch * CH
            hi = tl.minimum(lo + CH, V)
            a1 = tl.zeros([BLOCK], dtype=tl.float32)  # per-lane sums: one reduction after the loop
            a2 = tl.zeros([BLOCK], dtype=tl.float32)
            ha = tl.zeros([NB2], dtype=tl.int32)
            hb = tl.zeros([NB2], dtype=tl.int32)
            for start in range(lo, hi, 4 * BLOCK):  # four tiles per step: all four loads in flight at once
                idx0 = start + offs
                idx1 = idx0 + BLOCK
                idx2 = idx1 + BLOCK
                idx3 = idx2 + BLOCK
                bits0 = _bits(row, idx0, idx0 < hi)
                bits1 = _bits(row, idx1, idx1 < hi)
                bits2 = _bits(row, idx2, idx2 < hi)
                bits3 = _bits(row, idx3, idx3 < hi)
                a1, a2, ha, hb = _refine_tile(bits0, idx0 < hi, m, c, s4, hg, j0a, j1a, modea, khia, j0b, j1b, modeb,
                                              khib, cc_ptr, cb_ptr, r, a1, a2, ha, hb, NB2, CAP)
                a1, a2, ha, hb = _refine_tile(bits1, idx1 < hi, m, c, s4, hg, j0a, j1a, modea, khia, j0b, j1b, modeb,
                                              khib, cc_ptr, cb_ptr, r, a1, a2, ha, hb, NB2, CAP)
                a1, a2, ha, hb = _refine_tile(bits2, idx2 < hi, m, c, s4, hg, j0a, j1a, modea, khia, j0b, j1b, modeb,
                                              khib, cc_ptr, cb_ptr, r, a1, a2, ha, hb, NB2, CAP)
                a1, a2, ha, hb = _refine_tile(bits3, idx3 < hi, m, c, s4, hg, j0a, j1a, modea, khia, j0b, j1b, modeb,
                                              khib, cc_ptr, cb_ptr, r, a1, a2, ha, hb, NB2, CAP)
            pbase = (r * NC + ch) * 8
            tl.store(pf_ptr + pbase + 3, tl.sum(a1, axis=0))
            tl.store(pf_ptr + pbase + 4, tl.sum(a2, axis=0))
            jb = tl.arange(0, NB2)
            tl.store(pb_ptr + ((r * NC + ch) * 2 + 0) * NB2 + jb, ha)
            tl.store(pb_ptr + ((r * NC + ch) * 2 + 1) * NB2 + jb, hb)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel", scope="gpu")
        if done == NC - 1:
            thr_key = tl.full([], 0x7F, tl.int32)  # key of -inf
            zp = zf
            fallback = state == 2
            if state == 1:
                cidx = tl.arange(0, NC_PAD)
                cm = cidx < NC
                a1 = tl.sum(tl.load(pf_ptr + (r * NC + cidx) * 8 + 3, mask=cm, other=0.0, cache_modifier=".cg"), axis=0)
                a2 = tl.sum(tl.load(pf_ptr + (r * NC + cidx) * 8 + 4, mask=cm, other=0.0, cache_modifier=".cg"), axis=0)
                bk = tl.load(rowi_ptr + fb + 3)
                nbelow1 = tl.load(rowi_ptr + fb + 4)
                caba = tl.load(rowi_ptr + fb + 9)
                cnta = tl.load(rowi_ptr + fb + 10)
                cabb = tl.load(rowi_ptr + fb + 15)
                cntb = tl.load(rowi_ptr + fb + 16)
                # range 1 (and the counts check)
                ka, ma, gta, gea, gtma, wa, tota = _range_items(pb_ptr, cb_ptr, cc_ptr, r, NC, 0, modea, khia, m, c,
                                                                NC_PAD, NB2, CAP, FB)
                fallback = fallback | (tota != cnta)
                # top-k: the k-th largest value, in range 2 when planned apart, else in range 1
                kvk = tl.full([], 0x7F, tl.int32)
                zk = zf
                if topk_on:
                    if j0b >= 0:
                        kb, mb, gtb, geb, gtmb, wb, totb = _range_items(pb_ptr, cb_ptr, cc_ptr, r, NC, 1, modeb, khib,
                                                                        m, c, NC_PAD, NB2, CAP, FB)
                        fallback = fallback | (totb != cntb)
                        qual = (mb > 0) & (cabb + gtb < kk) & (cabb + geb >= kk)
                        kvk = tl.max(tl.where(qual, kb, -1), axis=0)
                        zk = a2 + tl.sum(tl.where((mb > 0) & (kb >= kvk), mb.to(tl.float32) * wb, 0.0), axis=0)
                    else:
                        qual = (ma > 0) & (caba + gta < kk) & (caba + gea >= kk)
                        kvk = tl.max(tl.where(qual, ka, -1), axis=0)
                        zk = a1 + tl.sum(tl.where((ma > 0) & (ka >= kvk), ma.to(tl.float32) * wa, 0.0), axis=0)
                    fallback = fallback | (kvk < 0)
                thr_key = kvk
                zp = zk
                if topp_on:
                    target = tp * zk
                    inset = (ma > 0) & (ka >= kvk)
                    kept = inset & (a1 + gtma < target)
                    kvp = tl.min(tl.where(kept, ka, 0x10000), axis=0)
                    ebot = a1 + tl.sum(tl.where(inset, ma.to(tl.float32) * wa, 0.0), axis=0)
                    fallback = fallback | (kvp >= 0x10000) | ((ebot < target) & (nbelow1 > 0))
                    thr_key = tl.maximum(kvp, kvk)
                    zp = a1 + tl.sum(tl.where(inset & (ka >= thr_key), ma.to(tl.float32) * wa, 0.0), axis=0)
                tl.store(cc_ptr + r * 2 + 0, 0)
                tl.store(cc_ptr + r * 2 + 1, 0)
            if fallback:
                thr_key, zp = _serial_thresholds(row, V, m, c, kk, tp, topk_on, topp_on, zf, BLOCK, NBINS)
            thr = tl.where(thr_key <= 0x7F, -float("inf"), _unkey(thr_key))
            flag = tl.full([], 0, tl.int32)
            if i < n:
                d = tl.load(drafts_ptr + b * D + i)
                u = tl.load(u_ptr + b * D + i)
                flag = _accept(row, d, thr, m, c, zp, q_ptr, (b * D + i).to(tl.int64) * V, u, HAS_Q)
            tl.store(rowf_ptr + r * 8 + 1, thr)
            tl.store(rowf_ptr + r * 8 + 2, zp)
            tl.store(rowi_ptr + fb + 0, flag)
            tl.atomic_xchg(cnt_ptr + r, 0, sem="relaxed", scope="gpu")


@triton.jit
def _race_kernel(
    logits_ptr, drafts_ptr, n_ptr, q_ptr, temp_ptr, noise_ptr,
    rowf_ptr, rowi_ptr, qf_ptr, qi_ptr, cnt_ptr, out_ptr, acc_ptr,
    V, CH, NC, D,
    D1_PAD: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr, NC_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    ch = tl.program_id(1)
    D1 = D + 1
    n = tl.load(n_ptr + b)
    T = tl.load(temp_ptr + b)
    c1 = tl.arange(0, D1_PAD)
    flags = tl.load(rowi_ptr + (b * D1 + c1) * 24, mask=c1 < n, other=1)
    stop = tl.min(tl.where((c1 < n) & (flags == 0), c1, n), axis=0)
    if T != 0.0:
        c = 1.4426950408889634 / T
        r = b * D1 + stop
        m = tl.load(rowf_ptr + r * 8 + 0)
        thr = tl.load(rowf_ptr + r * 8 + 1)
        inv_z = 1.0 / tl.load(rowf_ptr + r * 8 + 2)
        is_bonus = stop == n
        d = tl.full([], -1, tl.int32)
        if stop < n:
            d = tl.load(drafts_ptr + b * D + stop)
        row = logits_ptr + r.to(tl.int64) * V
        qrow = q_ptr + (b * D + stop).to(tl.int64) * V
        erow = noise_ptr + b.to(tl.int64) * V
        offs = tl.arange(0, BLOCK)
        lo = ch * CH
        hi = tl.minimum(lo + CH, V)
        best_p = tl.full([], -1.0, tl.float32)
        arg_p = tl.full([], 0, tl.int32)
        best_r = tl.full([], -1.0, tl.float32)
        arg_r = tl.full([], 0, tl.int32)
        any_r = tl.full([], 0, tl.int32)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            ok = idx < hi
            x = _f32(_bits(row, idx, ok))
            p = tl.where(ok & (x >= thr), tl.exp2((x - m) * c) * inv_z, 0.0)
            e = tl.load(erow + idx, mask=ok, other=1.0)
            sp = tl.where(ok, p / e, -1.0)
            bmp = tl.max(sp, axis=0)
            bap = tl.argmax(sp, axis=0, tie_break_left=True) + start
            arg_p = tl.where(bmp > best_p, bap, arg_p)
            best_p = tl.maximum(best_p, bmp)
            if not is_bonus:
                if HAS_Q:
                    qv = tl.load(qrow + idx, mask=ok, other=0.0)
                    rr = tl.maximum(p - qv, 0.0)
                else:
                    rr = tl.where(idx == d, 0.0, p)
                any_r = any_r | (tl.max(rr, axis=0) > 0.0).to(tl.int32)
                sr = tl.where(ok, rr / e, -1.0)
                bmr = tl.max(sr, axis=0)
                bar = tl.argmax(sr, axis=0, tie_break_left=True) + start
                arg_r = tl.where(bmr > best_r, bar, arg_r)
                best_r = tl.maximum(best_r, bmr)
        pq = b * NC + ch
        tl.store(qf_ptr + pq * 2 + 0, best_p)
        tl.store(qf_ptr + pq * 2 + 1, best_r)
        tl.store(qi_ptr + pq * 3 + 0, arg_p)
        tl.store(qi_ptr + pq * 3 + 1, arg_r)
        tl.store(qi_ptr + pq * 3 + 2, any_r)
    # ---- the last of the request's programs merges the chunk winners and writes its output row
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
    if done == NC - 1:
        tok = tl.load(rowi_ptr + (b * D1 + stop) * 24 + 1, cache_modifier=".cg")  # greedy: the argmax
        if T != 0.0:
            cidx = tl.arange(0, NC_PAD)
            cm = cidx < NC
            pq = b * NC + cidx
            bp = tl.load(qf_ptr + pq * 2 + 0, mask=cm, other=-2.0, cache_modifier=".cg")
            br = tl.load(qf_ptr + pq * 2 + 1, mask=cm, other=-2.0, cache_modifier=".cg")
            ap = tl.load(qi_ptr + pq * 3 + 0, mask=cm, other=V, cache_modifier=".cg")
            ar = tl.load(qi_ptr + pq * 3 + 1, mask=cm, other=V, cache_modifier=".cg")
            anr = tl.max(tl.load(qi_ptr + pq * 3 + 2, mask=cm, other=0, cache_modifier=".cg"), axis=0)
            tp_ = tl.min(tl.where(cm & (bp == tl.max(bp, axis=0)), ap, V), axis=0)
            tr_ = tl.min(tl.where(cm & (br == tl.max(br, axis=0)), ar, V), axis=0)
            tok = tl.where((stop == n) | (anr == 0), tp_, tr_)
        dr = tl.load(drafts_ptr + b * D + c1, mask=c1 < stop, other=-1)
        row_out = tl.where(c1 < stop, dr, tl.where(c1 == stop, tok, -1))
        tl.store(out_ptr + b * D1 + c1, row_out, mask=c1 < D1)
        tl.store(acc_ptr + b, stop)
        tl.atomic_xchg(cnt_ptr + b, 0, sem="relaxed", scope="gpu")


def _split(V: int, rows: int, target: int, max_chunks: int, tile: int) -> tuple[int, int]:
    """(chunk length, chunk count) splitting V over about ``target / rows`` chunks of whole tiles."""
    nc = max(1, min(max_chunks, target // max(rows, 1), triton.cdiv(V, tile)))
    ch = triton.cdiv(triton.cdiv(V, nc), tile) * tile
    return ch, triton.cdiv(V, ch)


def _workspace(device: torch.device, R: int, NC: int, B: int, NC3: int) -> dict[str, torch.Tensor]:
    """Per-device buffers, grown as needed; every counter in them is zero between calls.

    Keyed by device only, not by stream: a CUDA graph is captured on a stream of its own, and a
    workspace first allocated there would put its zero-fill into every replay. Calls on one device
    must therefore not overlap in time (the op runs on one stream; a graph of it replays there)."""
    key = str(device)
    need = {"rowf": R * _RF, "rowi": R * _RI, "pf": R * NC * _PF, "pi": R * NC, "ph": R * NC * 128,
            "pb": R * NC * 2 * NB2, "cb": R * 2 * CAP, "cc": R * 2, "c1": R, "c2": R, "c3": B,
            "qf": B * NC3 * 2, "qi": B * NC3 * 3}
    ws = _WORKSPACES.get(key)
    if ws is None or any(ws[k].numel() < v for k, v in need.items()):
        ws = {k: torch.zeros(max(v, 64) * 2, dtype=torch.float32 if k in ("rowf", "pf", "qf") else torch.int32,
                             device=device) for k, v in need.items()}
        _WORKSPACES[key] = ws
    return ws


def launch(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
           uniform_draws, exponential_noise, *, max_draft_tokens, output_token_ids, num_accepted_tokens,
           stages=3):
    """Run the three verify launches (stats, refine, race).

    Args: as ``k3_model.ops.dspark_verify.dspark_verify``: ``target_logits`` (B, D+1, V) bfloat16,
    contiguous; ``draft_probs`` (B, D, V) float32 or ``None`` for one-hot drafts. Writes
    ``output_token_ids`` (B, D+1) int32 and ``num_accepted_tokens`` (B,) int32 in place.
    ``stages`` (1-3) runs only the first launches, for timing them apart (diagnostics: the outputs
    are complete only with 3).

    Raises:
        ValueError: ``target_logits`` is not bfloat16 (outside the declared scope).
    """
    if target_logits.dtype != torch.bfloat16:
        raise ValueError(f"dspark_verify Triton kernel: target_logits must be bfloat16; got {target_logits.dtype}.")
    B, D1, V = target_logits.shape
    D = max_draft_tokens
    R = B * D1
    CH, NC = _split(V, R, TARGET_PROGRAMS, MAX_CHUNKS, BLOCK)
    CH3, NC3 = _split(V, B, RACE_PROGRAMS, MAX_RACE_CHUNKS, RACE_TILE)
    ws = _workspace(target_logits.device, R, NC, B, NC3)
    has_q = draft_probs is not None
    q = draft_probs if has_q else uniform_draws  # never read without draft probabilities
    logits = target_logits.contiguous().view(torch.int16)
    # chunk counts are padded to fixed powers of two and D is a run-time argument, so one process
    # compiles each kernel once per draft-probability mode (guard children start with empty caches)
    common = dict(HAS_Q=has_q, NC_PAD=MAX_CHUNKS, num_warps=8)
    if stages >= 1:
        _stats_kernel[(R, NC)](
            logits, draft_token_ids, num_draft_tokens, q, temperature, top_k, top_p, uniform_draws,
            ws["rowf"], ws["rowi"], ws["pf"], ws["pi"], ws["ph"], ws["c1"], V, CH, NC, D,
            BLOCK=BLOCK, NB2=NB2, CAP=CAP, **common)
    if stages >= 2:
        _refine_kernel[(R, NC)](
            logits, draft_token_ids, num_draft_tokens, q, temperature, top_k, top_p, uniform_draws,
            ws["rowf"], ws["rowi"], ws["pf"], ws["pb"], ws["cb"], ws["cc"], ws["c2"], V, CH, NC, D,
            BLOCK=max(BLOCK // 8, 16), NB2=NB2, CAP=CAP, NBINS=NBINS, FB=4, **common)
    if stages >= 3:
        _race_kernel[(B, NC3)](
            logits, draft_token_ids, num_draft_tokens, q, temperature, exponential_noise,
            ws["rowf"], ws["rowi"], ws["qf"], ws["qi"], ws["c3"], output_token_ids, num_accepted_tokens,
            V, CH3, NC3, D, D1_PAD=max(8, triton.next_power_of_2(D1)), HAS_Q=has_q, BLOCK=RACE_TILE,
            NC_PAD=MAX_RACE_CHUNKS, num_warps=8)
