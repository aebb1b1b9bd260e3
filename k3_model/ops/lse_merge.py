"""Merge per-chunk partial attention outputs by their log-sum-exp (split-KV / DCP combine).

Attention over a context split into N chunks (KV pages on one GPU, flash-decoding style; or KV shards
on N DCP ranks) gives, per chunk r and per (row b, head h), the softmax-normalised partial output
``o_r`` over that chunk's keys and its log-sum-exp ``l_r = log sum_s exp(score_s)``. The attention over
the whole context is recovered exactly (up to rounding) by

    l_r <- -inf  where l_r is NaN or +inf                  (empty chunk; FA2 returns +inf for it)
    m    = max_r l_r ;  m <- 0 where m = -inf              (all chunks empty: no -inf - -inf)
    L    = m + log sum_r exp(l_r - m)                      (-inf when every chunk is empty)
    o    = sum_r exp(l_r - L) o_r                          terms of weight 0 contribute exactly 0,
                                                           even where o_r is NaN or inf

With ``base_e = False`` the LSEs are base 2 (``l = log2 sum 2^score``, as trtllm-gen and some
FlashInfer MLA kernels emit them): ``exp``/``log`` become ``exp2``/``log2`` and ``out_lse`` is base 2 too.
A row whose chunks are all empty gets ``o = 0`` and ``L = -inf``; no NaN is ever produced.

The op writes into caller-allocated ``out`` and ``out_lse`` (destination passing, as vLLM's
``merge_attn_states(output, ..., output_lse)``), so every element a kernel must produce is checked.
K3-mini calls it from the MLA decode step (:func:`k3_model.layers.mla_forward`) once the latent cache
holds at least :data:`k3_model.layers.SPLIT_KV_MIN_PAGES` pages, one chunk per page.

Source: shared/reference/kernel_targets.md §4.1 (vLLM ``merge_attn_states`` and DCP
``_correct_attn_cp_out_kernel``: NaN/+inf LSE -> -inf, max -inf -> 0, ``out = 0 where factor == 0``,
base-2 variant ``is_lse_base_on_e``), §4.2 (reference math), §4.3 (shapes), §4.4 (edge cases).
"""

from __future__ import annotations

import torch

from k3_model import dispatch

OP = "lse_merge"
SHAPE_DOMAIN = {
    "N": {"min": 1, "max": 16},
    "H": {"min": 1, "max": 128},
    "D": {"min": 1, "max": 1024},
}
"""The shapes ``tasks/k3_lse_merge`` judges (its ``[domain.axes]``, kept equal by
tests/k3_model/test_dispatch_shapes.py): a call outside them never runs a latency-specialized kernel
(:func:`k3_model.dispatch.route`). Axes: N chunks, H heads, D head dim (the decode batch B is the
scope's batch range)."""
dispatch.register_op_shapes(OP, SHAPE_DOMAIN)

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""dtypes of the partial outputs (and ``out``); LSEs are float32 (kernel_targets.md §4.3)."""


def _check_args(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor) -> None:
    where = "k3_model.ops.lse_merge.lse_merge"
    if outs.dim() != 4:
        raise ValueError(f"{where}: outs must be (N, B, H, D); got shape {tuple(outs.shape)}. Stack the chunks on dim 0.")
    N, B, H, D = outs.shape
    if N < 1:
        raise ValueError(f"{where}: outs holds no chunk (N = 0); merge at least one chunk.")
    if outs.dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: outs must be float32, bfloat16 or float16; got {outs.dtype}.")
    if lses.shape != (N, B, H) or lses.dtype != torch.float32:
        raise ValueError(f"{where}: lses must be ({N}, {B}, {H}) float32 (one LSE per chunk, row and head); got "
                         f"{tuple(lses.shape)} {lses.dtype}.")
    if out.shape != (B, H, D) or out.dtype != outs.dtype:
        raise ValueError(f"{where}: out must be ({B}, {H}, {D}) {outs.dtype} (outs' dtype); got {tuple(out.shape)} "
                         f"{out.dtype}. Allocate it with torch.empty_like(outs[0]).")
    if out_lse.shape != (B, H) or out_lse.dtype != torch.float32:
        raise ValueError(f"{where}: out_lse must be ({B}, {H}) float32; got {tuple(out_lse.shape)} {out_lse.dtype}.")
    for name, t in (("outs", outs), ("lses", lses), ("out", out), ("out_lse", out_lse)):
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous (row-major); call .contiguous() first.")
        if t.device != outs.device:
            raise ValueError(f"{where}: {name} is on {t.device}, outs on {outs.device}; put all four on one device.")


def lse_merge_standard(outs: torch.Tensor, lses: torch.Tensor, *, base_e: bool, out: torch.Tensor,
                       out_lse: torch.Tensor) -> None:
    """The standard path: every LSE sanitised, every term guarded, in float32; see :func:`lse_merge`."""
    exp, log = (torch.exp, torch.log) if base_e else (torch.exp2, torch.log2)
    # 0-dim tensors made on the device (no host-to-device copy: the path stays CUDA-graph capturable)
    neg_inf = torch.full((), float("-inf"), device=lses.device)
    zero = torch.zeros((), device=lses.device)
    lse = lses.float()
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), neg_inf, lse)  # empty chunks -> -inf
    m = lse.amax(dim=0)  # (B, H)
    m = torch.where(m == float("-inf"), zero, m)  # all empty: exp(-inf - 0) = 0, never -inf - -inf
    total = log(exp(lse - m).sum(dim=0)) + m  # (B, H); -inf when every chunk is empty
    weight = exp(lse - total)  # (N, B, H); NaN where total = -inf (-inf - -inf)
    weight = torch.where(torch.isnan(weight), zero, weight)
    terms = torch.where((weight > 0).unsqueeze(-1), weight.unsqueeze(-1) * outs.float(), zero)  # 0 * NaN -> 0
    out.copy_(terms.sum(dim=0))
    out_lse.copy_(total)


def shape_axes(outs: torch.Tensor) -> dict[str, int]:
    """The call's shape axes, named as the task's: ``{"N", "H", "D"}`` -> sizes."""
    N, _, H, D = outs.shape
    return {"N": N, "H": H, "D": D}


def lse_merge(outs: torch.Tensor, lses: torch.Tensor, *, base_e: bool = True, out: torch.Tensor,
              out_lse: torch.Tensor) -> None:
    """Merge N chunks' partial attention outputs into the attention over all of them.

    Args:
        outs: (N, B, H, D) float32 (or bfloat16/float16), contiguous: chunk r's softmax-normalised partial
            output for row b (a decode token) and head h; D is the value width (K3 MLA: the latent,
            kv_lora_rank 512). Rows of an empty chunk may hold anything (zeros, NaN, inf).
        lses: (N, B, H) float32, contiguous: chunk r's log-sum-exp of the scaled scores (natural log, or
            log2 when ``base_e`` is False); -inf, +inf or NaN marks an empty chunk.
        base_e: the LSE base: True for e (FlashAttention, FlashMLA), False for 2 (trtllm-gen).
        out: out (B, H, D), outs' dtype: ``sum_r exp(l_r - L) o_r``, accumulated in float32; 0 on a row
            whose chunks are all empty.
        out_lse: out (B, H) float32: the merged LSE ``L`` in the same base; -inf on an all-empty row.

    Raises:
        ValueError: shapes, dtypes, layout or devices outside the contract (the message says what to fix).
        k3_model.dispatch.DispatchError: a merged latency-specialized kernel is malformed.

    The decode batch for dispatch is B (rows).

    Source: kernel_targets.md §4.1-4.4; vLLM ``merge_attn_states`` (LSE layout there is (H, T); here
    (N, B, H), the DCP all-gather layout ``[N, B, H]`` of ``cp_lse_ag_out_rs``).
    """
    _check_args(outs, lses, out, out_lse)
    fn = dispatch.select(
        OP,
        "lse_merge",
        lse_merge_standard,
        rows=outs.shape[1],
        device=outs.device.type,
        dtype=str(outs.dtype).removeprefix("torch."),
        shapes=shape_axes(outs),
    )
    fn(outs, lses, base_e=base_e, out=out, out_lse=out_lse)
