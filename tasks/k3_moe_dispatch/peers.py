"""Library peers of ``moe_route_dispatch`` for ``workbench bench`` (see ``workbench/peers.py``).

- ``quack_topk``: quack's CuTe DSL top-k (``quack.topk``) on the biased scores, the scores and the
  weights in torch: the routing half of the op only (no block alignment), ungrouped (G = 1).
- ``flashinfer_routing``: FlashInfer's fused DeepSeek-style routing (``flashinfer.fused_moe``): declared,
  no adapter yet (listed as not run, with the reason).

Source: issue 13 item 4; quack-kernels ``quack/topk.py`` (``_topk_fwd(x, k, softmax, values, indices)``:
power-of-two N <= 4096 and k <= 128, fp32 allowed); kernel_targets.md §3.1 (routing semantics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workbench.peers import Peer

QUACK_MAX_N = 4096
"""quack's top-k handles rows of at most 4096 (a power of two): quack/topk.py asserts it."""


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _quack_applies(axes: Mapping[str, int], kwargs: Mapping[str, Any]) -> str | None:
    if kwargs["n_group"] != 1:
        return "quack's top-k has no group-limited selection (G > 1)"
    if _pow2_at_least(int(axes["E"])) > QUACK_MAX_N:
        return f"E = {axes['E']} pads past quack's largest row ({QUACK_MAX_N})"
    k = int(kwargs["top_k"])
    if k & (k - 1):
        return f"quack's top-k needs a power-of-two k; got {k}"
    return None


def _quack_build(inputs: Mapping[str, Any], kwargs: Mapping[str, Any]):
    import torch
    from quack.topk import _topk_fwd

    logits, bias = inputs["router_logits"], inputs["e_score_correction_bias"]
    T, E = logits.shape
    K = int(kwargs["top_k"])
    n = _pow2_at_least(E)
    padded = torch.full((T, n), float("-inf"), dtype=torch.float32, device=logits.device)
    values = torch.empty((T, K), dtype=torch.float32, device=logits.device)
    indices = torch.empty((T, K), dtype=torch.int32, device=logits.device)
    scale = float(kwargs["routed_scaling_factor"])
    renorm = bool(kwargs["renormalize"])

    def call() -> None:
        scores = torch.sigmoid(logits)
        torch.add(scores, bias, out=padded[:, :E])
        _topk_fwd(padded, K, False, values, indices)
        w = scores.gather(1, indices.long())
        if renorm:
            w = w / w.sum(dim=1, keepdim=True)
        values.copy_(w * scale)

    return call


PEERS = [
    Peer(name="quack_topk", distribution="quack-kernels", module="quack.topk",
         covers="routing only: sigmoid + bias and the weights in torch, top-k by quack (CuTe DSL); "
                "no group-limited selection, no block alignment",
         build=_quack_build, applies=_quack_applies),
    Peer(name="flashinfer_routing", distribution="flashinfer-python", module="flashinfer.fused_moe",
         covers="FlashInfer's fused DeepSeek-style routing (top-k and weights; no block alignment)",
         build=None, note="FlashInfer never imported on the project's H200 (no package registry there; a 101 MB "
                          "wheel that JIT-compiles its kernels with nvcc on first use)"),
]
