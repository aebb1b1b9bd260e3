"""Latency-specialized K3 MoE routing + dispatch on CUDA: one Triton launch per call.

One program per token scores its row (sigmoid + bias, optional group-limited mask), picks the top-k
by K arg-max passes, writes its ids and renormalized weights; the last program to finish (a done
counter in a small per-stream workspace) builds the whole block-aligned dispatch from the ids: a
per-expert cursor gives each (token, slot) its place in its expert's segment (order within a segment
is free in the contract), a prefix sum over the padded counts places the segments, and every element
of ``sorted_token_ids`` and ``expert_ids`` is written (sentinel / -1 fill, then the scatter). The
workspace counters are reset by that last program, so the next call starts from zero.

Triton is imported on the first call only, so this package imports on machines without it (the
dispatcher then never selects it: SCOPE is CUDA only). Same contract as
``k3_model.ops.moe_dispatch.moe_route_dispatch``.

This is ``k3_model/kernels/moe_dispatch/cuda/``, the CUDA kernel package of the op (``k3_model.dispatch.kernel_key``):
CUDA calls use it, other devices use the op's own package (the CPU kernel merged before it).
"""

from __future__ import annotations

from k3_model.dispatch import OpScope

SCOPE = OpScope(devices=("cuda",), phases=("decode",), tp_sizes=(1,), dtypes=("float32",), requests_min=1, requests_max=64)


def moe_route_dispatch(router_logits, e_score_correction_bias, token_valid, *, top_k, n_group, topk_group,
                       renormalize, routed_scaling_factor, block_size, topk_weights, topk_ids,
                       sorted_token_ids, expert_ids, num_tokens_post_padded):
    """See ``k3_model.ops.moe_dispatch.moe_route_dispatch`` (shapes, dtypes, semantics).

    Raises:
        ValueError: T*K or E beyond what one program handles (4096), outside the declared scope.
    """
    from ._triton_route import launch

    launch(router_logits, e_score_correction_bias, token_valid, top_k=top_k, n_group=n_group,
           topk_group=topk_group, renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
           block_size=block_size, topk_weights=topk_weights, topk_ids=topk_ids,
           sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
           num_tokens_post_padded=num_tokens_post_padded)
