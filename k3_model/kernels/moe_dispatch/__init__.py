"""Latency-specialized K3 MoE routing + dispatch for decode batches (CPU, fp32).

Fewer, larger tensor ops than the standard path: one top-k on the biased scores without sorting,
the group mask only when grouping is on, padding rows handled only when present, and the alignment
built from one stable sort plus a repeat of expert ids per block (no per-block search).
Same contract as ``k3_model.ops.moe_dispatch.moe_route_dispatch``.
"""

from __future__ import annotations

import torch

from k3_model.dispatch import OpScope

SCOPE = OpScope(devices=("cpu",), phases=("decode", "spec_verify"), tp_sizes=(1,), dtypes=("float32",), requests_min=1,
                requests_max=64, query_len_min=1, query_len_max=8)
"""Decode steps of 1-64 requests and verification steps of 1-64 requests at up to 7 drafts (8-512 token rows):
1.16-1.60x the standard path on CPU at K3's sizes over 1-512 rows (bench/results/cpu/moe_lean_verification_session22/)."""


def moe_route_dispatch(router_logits, e_score_correction_bias, token_valid, *, top_k, n_group, topk_group,
                       renormalize, routed_scaling_factor, block_size, topk_weights, topk_ids,
                       sorted_token_ids, expert_ids, num_tokens_post_padded):
    """See ``k3_model.ops.moe_dispatch.moe_route_dispatch`` (shapes, dtypes, semantics)."""
    T, E = router_logits.shape
    scores = torch.sigmoid(router_logits)
    choice = scores + e_score_correction_bias
    if n_group > 1:
        g = choice.view(T, n_group, E // n_group)
        gs = g.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = torch.zeros(T, n_group, dtype=torch.bool).scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
        choice = g.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        w = w * routed_scaling_factor
    all_valid = bool(token_valid.all())
    if not all_valid:
        ids.masked_fill_(~token_valid.unsqueeze(1), -1)
        w = w.masked_fill(~token_valid.unsqueeze(1), 0.0)
    topk_weights.copy_(w)
    topk_ids.copy_(ids)

    numel = T * top_k
    flat = ids.view(-1)
    if not all_valid:
        flat = torch.where(flat < 0, E, flat)
    sorted_e, order = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E + 1)[:E]
    nblocks = (counts + (block_size - 1)).div_(block_size, rounding_mode="floor")
    padded = nblocks * block_size
    seg_end = padded.cumsum(0)
    shift = (seg_end - padded) - (counts.cumsum(0) - counts)
    n_valid = numel if all_valid else int(counts.sum())
    pos = shift[sorted_e[:n_valid]] + torch.arange(n_valid)
    sorted_token_ids.fill_(numel)
    sorted_token_ids[pos] = order[:n_valid].to(torch.int32)
    blocks = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), nblocks)
    expert_ids.fill_(-1)
    expert_ids[: blocks.numel()] = blocks
    num_tokens_post_padded.copy_(seg_end[-1:])
