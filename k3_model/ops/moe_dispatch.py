"""K3 MoE routing + dispatch: sigmoid scores, biased top-k selection, unbiased renormalized weights,
then tokens sorted by expert and aligned to the expert GEMM's block size.

The op writes into caller-allocated outputs (destination passing, as vLLM's ``moe_align_block_size``
does), so every element a kernel must produce can be checked.

Source: shared/reference/kernel_targets.md §3.1 (vLLM ``grouped_topk`` torch semantics and
``moe_align_block_size`` contract), §3.4 (edge cases: -inf group masking, -1 tail block ids, padding
rows with id -1).
"""

from __future__ import annotations

import torch

from k3_model import dispatch

OP = "moe_dispatch"
SHAPE_DOMAIN = {
    "E": {"choices": (1, 8, 16, 32, 60, 64, 128, 160, 256, 384, 896)},
    "K": {"min": 1, "max": 32},
    "G": {"choices": (1, 2, 4, 8)},
    "TG": {"min": 1, "max": 8},
    "B": {"choices": (16, 32, 64, 128)},
}
"""The shapes ``tasks/k3_moe_dispatch`` judges (its ``[domain.axes]``, kept equal by
tests/k3_model/test_dispatch_shapes.py): a call outside them never runs a latency-specialized kernel
(:func:`k3_model.dispatch.route`). Axes: E experts, K top-k, G groups, TG kept groups, B block size."""
dispatch.register_op_shapes(OP, SHAPE_DOMAIN)


def shape_axes(router_logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, block_size: int) -> dict[str, int]:
    """The call's shape axes, named as the task's: ``{"E", "K", "G", "TG", "B"}`` -> sizes."""
    return {"E": router_logits.shape[1], "K": top_k, "G": n_group, "TG": topk_group, "B": block_size}


def align_capacity(num_tokens: int, top_k: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """Sizes of ``sorted_token_ids`` and ``expert_ids`` (elements).

    Returns:
        ``(T*K + E*(B-1), cdiv(T*K + E*(B-1), B))``.

    Source: kernel_targets.md §3.1 (capacity ``numel + E*(block_size-1)``).
    """
    cap = num_tokens * top_k + num_experts * (block_size - 1)
    return cap, -(-cap // block_size)


def _check_args(router_logits, bias, token_valid, top_k, n_group, topk_group, block_size, outs) -> None:
    where = "k3_model.ops.moe_dispatch.moe_route_dispatch"
    if router_logits.dim() != 2:
        raise ValueError(f"{where}: router_logits must be (T, E); got shape {tuple(router_logits.shape)}.")
    T, E = router_logits.shape
    if bias.shape != (E,):
        raise ValueError(f"{where}: e_score_correction_bias must be ({E},); got {tuple(bias.shape)}.")
    if token_valid.shape != (T,) or token_valid.dtype != torch.bool:
        raise ValueError(f"{where}: token_valid must be ({T},) bool; got {tuple(token_valid.shape)} {token_valid.dtype}.")
    if E % n_group or topk_group > n_group or top_k > topk_group * (E // n_group):
        raise ValueError(
            f"{where}: E={E}, n_group={n_group}, topk_group={topk_group}, top_k={top_k} are inconsistent; "
            "need E % n_group == 0, topk_group <= n_group, top_k <= topk_group * E / n_group."
        )
    cap, nblocks = align_capacity(T, top_k, E, block_size)
    want = {
        "topk_weights": ((T, top_k), torch.float32),
        "topk_ids": ((T, top_k), torch.int32),
        "sorted_token_ids": ((cap,), torch.int32),
        "expert_ids": ((nblocks,), torch.int32),
        "num_tokens_post_padded": ((1,), torch.int32),
    }
    for name, (shape, dtype) in want.items():
        t = outs[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{where}: output {name} must be {shape} {dtype}; got {tuple(t.shape)} {t.dtype}. "
                "Allocate it with align_capacity()."
            )


def selection_scores(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor, *, n_group: int,
                     topk_group: int) -> torch.Tensor:
    """The scores the top-k selects on: ``sigmoid(router_logits) + bias``, -inf outside the kept groups.

    The standard path selects on these; the model-eval guard records them to tell a routing flip at a
    near tie from a wrong one (``k3_model.layers.record_routing``).

    Args:
        router_logits: (T, E) router logits (any float dtype; computed in float32).
        e_score_correction_bias: (E,) selection bias (steers selection only, never weighs).
        n_group: expert groups (E % n_group == 0); 1 = no grouping.
        topk_group: groups kept per token (by the sum of each group's top-2 biased scores).

    Returns:
        (T, E) float32 biased scores; experts of dropped groups are -inf.

    Source: shared/reference/kernel_targets.md §3.1 (vLLM ``grouped_topk``), §3.4 (-inf group masking).
    """
    T, E = router_logits.shape
    choice = router_logits.float().sigmoid() + e_score_correction_bias.float()  # bias steers selection only
    if n_group > 1:
        per_group = E // n_group
        grouped = choice.view(T, n_group, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        kept = group_score.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros(T, n_group, dtype=torch.bool, device=choice.device).scatter_(1, kept, True)
        expert_mask = group_mask.unsqueeze(-1).expand(T, n_group, per_group).reshape(T, E)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    return choice


def moe_route_dispatch_standard(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    token_valid: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    block_size: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
) -> None:
    """The standard path (general grouped top-k, then sort-based alignment); see :func:`moe_route_dispatch`."""
    T, E = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = selection_scores(router_logits, e_score_correction_bias, n_group=n_group, topk_group=topk_group)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    valid = token_valid.unsqueeze(1)
    topk_weights.copy_(torch.where(valid, weights, torch.zeros_like(weights)))
    topk_ids.copy_(torch.where(valid, ids, torch.full_like(ids, -1)).to(torch.int32))

    # Alignment: group the flat (token, slot) indices by expert, pad each segment to block_size.
    # No host synchronisation (no .item()/int() of device values, no bincount, no data-dependent
    # shapes), so the standard path can be captured into a CUDA graph: padding-row entries (key E)
    # are scattered to one dump slot past the end of a scratch copy instead of being cut off.
    numel = T * top_k
    cap = sorted_token_ids.numel()
    flat = topk_ids.reshape(-1).long()
    in_range = (flat >= 0) & (flat < E)
    key = torch.where(in_range, flat, torch.full_like(flat, E))
    sorted_key, order = torch.sort(key, stable=True)
    counts_all = torch.zeros(E + 1, dtype=torch.long, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts_all[:E]
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    seg_start = torch.cat([padded_end - padded, padded_end.new_full((1,), cap)])  # key E -> the dump slot
    count_start = torch.cumsum(counts_all, 0) - counts_all
    rank = torch.arange(numel, device=flat.device) - count_start[sorted_key]
    dest = torch.where(sorted_key < E, seg_start[sorted_key] + rank, torch.full_like(rank, cap))
    scratch = torch.full((cap + 1,), numel, dtype=torch.int32, device=flat.device)
    scratch[dest] = order.to(torch.int32)
    sorted_token_ids.copy_(scratch[:cap])
    total = padded_end[-1] if E else torch.zeros((), dtype=torch.long, device=flat.device)
    block_starts = torch.arange(expert_ids.numel(), device=flat.device) * block_size
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids.copy_(torch.where(block_starts < total, block_expert, torch.full_like(block_expert, -1)).to(torch.int32))
    num_tokens_post_padded.copy_(total.reshape(1))


def moe_route_dispatch(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    token_valid: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    block_size: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
) -> None:
    """Route each token to its top-k experts and lay out the expert-sorted, block-aligned dispatch.

    Selection uses ``sigmoid(logits) + bias``; with ``n_group > 1`` only experts of the
    ``topk_group`` groups with the largest top-2 biased sums are eligible (the others masked with
    -inf). Weights are the *unbiased* sigmoid scores of the chosen experts, renormalized to sum to 1
    when ``renormalize``, times ``routed_scaling_factor``. Rows with ``token_valid`` False (CUDA-graph
    padding) get ids -1 and weight 0 and are left out of the alignment.

    Args:
        router_logits: (T, E) float32 (K3's gate emits fp32 logits), contiguous.
        e_score_correction_bias: (E,) float32, added for selection only.
        token_valid: (T,) bool; False marks padding rows.
        top_k: experts per token K.
        n_group: expert groups G (E % G == 0; 1 for K3).
        topk_group: groups kept per token (<= G).
        renormalize: renormalize the chosen weights.
        routed_scaling_factor: weight multiplier (dimensionless; 1.0 for K3).
        block_size: alignment block B (rows of the expert GEMM tile).
        topk_weights: out (T, K) float32.
        topk_ids: out (T, K) int32, expert ids (order within a row is not part of the contract).
        sorted_token_ids: out (T*K + E*(B-1),) int32: flat indices ``t*K + k`` grouped by expert, each
            expert's segment padded to a multiple of B with the sentinel ``T*K``; the rest is sentinel.
        expert_ids: out (cdiv(T*K + E*(B-1), B),) int32: the expert of each block; -1 past the padded total.
        num_tokens_post_padded: out (1,) int32: sum over experts of ``ceil(count_e / B) * B``.

    Raises:
        ValueError: shapes, dtypes or group settings are inconsistent.
        k3_model.dispatch.DispatchError: a merged latency-specialized kernel is malformed.

    Source: kernel_targets.md §3.1-3.4.
    """
    outs = dict(
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        sorted_token_ids=sorted_token_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=num_tokens_post_padded,
    )
    _check_args(router_logits, e_score_correction_bias, token_valid, top_k, n_group, topk_group, block_size, outs)
    fn = dispatch.select(
        OP,
        "moe_route_dispatch",
        moe_route_dispatch_standard,
        rows=router_logits.shape[0],
        device=router_logits.device.type,
        dtype=str(router_logits.dtype).removeprefix("torch."),
        shapes=shape_axes(router_logits, top_k, n_group, topk_group, block_size),
    )
    fn(
        router_logits,
        e_score_correction_bias,
        token_valid,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        renormalize=renormalize,
        routed_scaling_factor=routed_scaling_factor,
        block_size=block_size,
        **outs,
    )
