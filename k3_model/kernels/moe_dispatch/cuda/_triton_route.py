"""The Triton kernel behind the CUDA moe_dispatch path (see ``__init__.py`` for the design).

Workspace layout (int32, per device and stream, zero between calls):
``[0]`` done counter, ``[1 : 1+MAX_E]`` per-expert cursors, ``[1+MAX_E : 1+2*MAX_E]`` segment starts.

Source: kernel_targets.md §3.1 (grouped_topk semantics, moe_align_block_size contract), §3.4 (-1 tail
blocks, padding rows); the "last block" completion pattern of the CUDA threadFenceReduction sample
(written anew here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_E = 4096
"""Largest expert count (and T*K) one program handles; the workspace is sized for it."""
CHUNK = 1024
"""Elements per store in the fill loops."""

_WORKSPACES: dict[tuple[int, int], torch.Tensor] = {}


def _np2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


@triton.jit
def _route_align_kernel(
    logits_ptr, bias_ptr, valid_ptr,
    w_ptr, ids_ptr, sorted_ptr, eids_ptr, ntp_ptr, ws_ptr,
    T, CAP, NBLOCKS, MAXB, scale,
    E: tl.constexpr, K: tl.constexpr, G: tl.constexpr, TG: tl.constexpr, PG: tl.constexpr,
    G_PAD: tl.constexpr, PG_PAD: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    N_PAD: tl.constexpr, B: tl.constexpr, RENORM: tl.constexpr, WS_E: tl.constexpr, CHUNK_: tl.constexpr,
):
    t = tl.program_id(0)
    # ---- routing of token t: c = sigmoid(x) + bias on a [G_PAD, PG_PAD] tile (expert e = g*PG + j)
    g_offs = tl.arange(0, G_PAD)
    j_offs = tl.arange(0, PG_PAD)
    e2 = g_offs[:, None] * PG + j_offs[None, :]
    m2 = (g_offs[:, None] < G) & (j_offs[None, :] < PG)
    x = tl.load(logits_ptr + t * E + e2, mask=m2, other=0.0)
    b = tl.load(bias_ptr + e2, mask=m2, other=0.0)
    c = tl.where(m2, 1.0 / (1.0 + tl.exp(-x)) + b, float("-inf"))
    if G > 1:
        top1 = tl.max(c, axis=1)
        arg1 = tl.argmax(c, axis=1, tie_break_left=True)
        if PG > 1:
            gscore = top1 + tl.max(tl.where(j_offs[None, :] == arg1[:, None], float("-inf"), c), axis=1)
        else:
            gscore = top1
        gscore = tl.where(g_offs < G, gscore, float("-inf"))
        keep = g_offs < 0
        for _ in range(TG):
            gi = tl.argmax(gscore, axis=0, tie_break_left=True)
            keep = keep | (g_offs == gi)
            gscore = tl.where(g_offs == gi, float("-inf"), gscore)
        c = tl.where(keep[:, None] & m2, c, float("-inf"))
    # top-k on the 2-D tile itself: the best group row first, then the best column in it (the lowest
    # expert index on exact ties, as a row-major argmax would give). No reshape to 1-D: the flat
    # position of a reshaped register tile need not be g * PG_PAD + j (with PG < PG_PAD that picked
    # the wrong expert, or a padding column: found by the random domain draws, E = 160 and 896 at G = 2)
    k_offs = tl.arange(0, K_PAD)
    k_mask = k_offs < K
    ids = tl.full([K_PAD], 0, tl.int32)
    for k in range(K):
        gi = tl.argmax(tl.max(c, axis=1), axis=0, tie_break_left=True)
        row = tl.max(tl.where(g_offs[:, None] == gi, c, float("-inf")), axis=0)
        ji = tl.argmax(row, axis=0, tie_break_left=True)
        ids = tl.where(k_offs == k, gi * PG + ji, ids)
        c = tl.where((g_offs[:, None] == gi) & (j_offs[None, :] == ji), float("-inf"), c)
    xw = tl.load(logits_ptr + t * E + ids, mask=k_mask, other=0.0)
    w = tl.where(k_mask, 1.0 / (1.0 + tl.exp(-xw)), 0.0)  # UNBIASED scores of the chosen experts
    if RENORM:
        w = w / tl.sum(w, axis=0)
    w = w * scale
    valid = tl.load(valid_ptr + t) != 0
    ids = tl.where(valid, ids, -1)
    w = tl.where(valid, w, 0.0)
    tl.store(ids_ptr + t * K + k_offs, ids, mask=k_mask)
    tl.store(w_ptr + t * K + k_offs, w, mask=k_mask)

    # ---- the last program to finish aligns the whole batch
    tl.debug_barrier()
    done = tl.atomic_add(ws_ptr, 1, sem="acq_rel", scope="gpu")
    if done == T - 1:
        numel = T * K
        n_offs = tl.arange(0, N_PAD)
        nm = n_offs < numel
        fid = tl.load(ids_ptr + n_offs, mask=nm, other=-1, cache_modifier=".cg")
        ok = nm & (fid >= 0) & (fid < E)
        fid = tl.where(ok, fid, 0)
        slot = tl.atomic_add(ws_ptr + 1 + fid, tl.where(ok, 1, 0), mask=ok, sem="relaxed", scope="gpu")
        tl.debug_barrier()
        e_offs = tl.arange(0, E_PAD)
        em = e_offs < E
        cnt = tl.load(ws_ptr + 1 + e_offs, mask=em, other=0, cache_modifier=".cg")
        nblk = (cnt + (B - 1)) // B
        padded = nblk * B
        seg_start = tl.cumsum(padded, axis=0) - padded
        total = tl.sum(padded, axis=0)
        tl.store(ws_ptr + 1 + WS_E + e_offs, seg_start, mask=em)
        tl.store(ws_ptr + 1 + e_offs, tl.zeros([E_PAD], tl.int32), mask=em)  # cursors back to zero
        for p0 in range(0, CAP, CHUNK_):
            offs = p0 + tl.arange(0, CHUNK_)
            tl.store(sorted_ptr + offs, tl.full([CHUNK_], 0, tl.int32) + numel, mask=offs < CAP)
        for p0 in range(0, NBLOCKS, CHUNK_):
            offs = p0 + tl.arange(0, CHUNK_)
            tl.store(eids_ptr + offs, tl.full([CHUNK_], -1, tl.int32), mask=offs < NBLOCKS)
        tl.debug_barrier()  # fills land before the scatters below overwrite parts of them
        start = tl.load(ws_ptr + 1 + WS_E + fid, mask=ok, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + start + slot, n_offs, mask=ok)
        blk0 = seg_start // B
        for j in range(0, MAXB):
            tl.store(eids_ptr + blk0 + j, e_offs, mask=em & (j < nblk))
        tl.store(ntp_ptr, total)
        tl.store(ws_ptr, 0)  # done counter back to zero


def _workspace(device: torch.device) -> torch.Tensor:
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = torch.zeros(1 + 2 * MAX_E, dtype=torch.int32, device=device)
        _WORKSPACES[key] = ws
    return ws


def launch(router_logits, e_score_correction_bias, token_valid, *, top_k, n_group, topk_group, renormalize,
           routed_scaling_factor, block_size, topk_weights, topk_ids, sorted_token_ids, expert_ids,
           num_tokens_post_padded) -> None:
    """Launch the fused route + align kernel (grid: one program per token).

    Args: as ``k3_model.ops.moe_dispatch.moe_route_dispatch`` (already validated there).

    Raises:
        ValueError: E or T*K above ``MAX_E``.
    """
    T, E = router_logits.shape
    K = int(top_k)
    if E > MAX_E or T * K > MAX_E:
        raise ValueError(f"moe_dispatch triton kernel: E={E} and T*K={T * K} must be <= {MAX_E}; "
                         "larger batches are outside the declared scope.")
    logits = router_logits.contiguous()
    bias = e_score_correction_bias.contiguous()
    valid = token_valid.contiguous().view(torch.uint8)
    G, TG = int(n_group), int(topk_group)
    PG = E // G
    B = int(block_size)
    cap = sorted_token_ids.numel()
    nblocks = expert_ids.numel()
    _route_align_kernel[(T,)](
        logits, bias, valid, topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded,
        _workspace(logits.device), T, cap, nblocks, -(-T // B), float(routed_scaling_factor),
        E=E, K=K, G=G, TG=TG, PG=PG, G_PAD=_np2(G, 1), PG_PAD=_np2(PG, 16), K_PAD=_np2(K), E_PAD=_np2(E),
        N_PAD=_np2(T * K), B=B, RENORM=bool(renormalize), WS_E=MAX_E, CHUNK_=CHUNK, num_warps=4,
    )
