"""Latency-specialized TP all-reduce + residual add + RMSNorm for CPU ranks (gloo), in place.

Two schedules, chosen by message size (bytes of one rank's partial):

- **one-shot** (small messages): every rank gathers the bf16 partials of all ranks and reduces all of them itself, in rank order, in fp32, fused with
  the residual add and the norm. Every rank runs the same arithmetic on the same data: identical bits.
- **two-shot** (large messages, T >= W): the tokens are split into W contiguous slices; an
  all-to-all sends slice s of every partial to rank s (the reduce-scatter), rank s reduces its tokens
  in rank order and adds the residual, one all-gather of R' gives every rank all tokens, and each
  rank normalises them itself (the same arithmetic on the same bits: identical outputs). Bytes per
  rank: 4 (W-1)/W T D against the standard fp32 ring all-reduce's 8 (W-1)/W T D.

Per token the math is the standard path's: A = bf16(sum_r float(x_r)), R' = bf16(float(A) + residual),
out = bf16(float(R') * rsqrt(mean(float(R')^2) + eps) * float(weight)).

Source: kernel_targets.md §1.1 (one-shot / two-shot, rank-order fp32 reduction, vLLM custom
all-reduce size rule), §1.4 (two-shot illegal when T <= W: the one-shot path serves those).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3_model.dispatch import OpScope

SCOPE = OpScope(devices=("cpu",), phases=("decode",), tp_sizes=(1, 2, 4, 8), dtypes=("bfloat16",),
                requests_min=1, requests_max=64)

ONE_SHOT_MAX_BYTES = 256 * 1024
"""Largest partial (bytes per rank) sent one-shot. One-shot moves (W-1) T D bf16 per rank, two-shot
2 (W-1)/W T D in two all-to-alls; on gloo the second collective costs about what the extra bytes
do at 256 KiB (README.md of this package)."""


def one_shot(world: int, nbytes: int, tokens: int) -> bool:
    """Whether a partial of ``nbytes`` bytes per rank goes one-shot: small messages, or fewer tokens
    than ranks (two-shot splits tokens, so it needs T >= W).

    Source: kernel_targets.md §1.4 (two-shot illegal for T <= W).
    """
    return nbytes <= ONE_SHOT_MAX_BYTES or tokens < world


def _add_norm(acc: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(R', out) for fp32 sums ``acc`` [t, D] and bf16 ``residual`` [t, D]."""
    r = (acc.to(residual.dtype).float() + residual.float()).to(residual.dtype)
    rf = r.float()
    out = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(residual.dtype)
    return r, out


def _gather(t: torch.Tensor, world: int, group) -> torch.Tensor:
    """All-gather ``t`` [n, D] from every rank as [world, n, D] through one all-to-all (gloo's fastest
    collective here: bench figures in this package's README)."""
    out = torch.empty((world * t.shape[0], t.shape[1]), dtype=t.dtype)
    dist.all_to_all_single(out, t.repeat(world, 1), group=group)
    return out.view(world, *t.shape)


def _one_shot(x, residual, weight, eps, group, world):
    parts = _gather(x, world, group)
    acc = parts[0].float()
    for r in range(1, world):  # rank order on every rank
        acc += parts[r].float()
    r_new, out = _add_norm(acc, residual, weight, eps)
    residual.copy_(r_new)
    x.copy_(out)


def _two_shot(x, residual, weight, eps, group, world, rank):
    T, D = x.shape
    sizes = [T // world + (1 if s < T % world else 0) for s in range(world)]
    starts = [sum(sizes[:s]) for s in range(world)]
    mine = sizes[rank]
    recv = torch.empty((world * mine, D), dtype=x.dtype)
    # rank s receives slice s of every rank's partial (reduce-scatter by tokens)
    dist.all_to_all_single(recv, x, output_split_sizes=[mine] * world, input_split_sizes=sizes, group=group)
    recv = recv.view(world, mine, D)
    acc = recv[0].float()
    for r in range(1, world):
        acc += recv[r].float()
    lo = starts[rank]
    r_mine = (acc.to(x.dtype).float() + residual[lo:lo + mine].float()).to(x.dtype)
    # gather R' alone (slices padded to the largest); every rank then normalises all tokens itself
    # with the same arithmetic, so the outputs agree bit for bit
    most = sizes[0]
    packed = torch.zeros((most, D), dtype=x.dtype)
    packed[:mine] = r_mine
    gathered = _gather(packed, world, group)
    for s in range(world):
        residual[starts[s]:starts[s] + sizes[s]] = gathered[s, :sizes[s]]
    rf = residual.float()
    x.copy_((rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype))


def allreduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                          group=None) -> None:
    """Same contract as ``k3_model.ops.allreduce_rmsnorm.allreduce_add_rmsnorm`` (in place on both).

    Raises:
        RuntimeError: a collective failed or timed out (a peer died).
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        r_new, out = _add_norm(x.float(), residual, weight, eps)
        residual.copy_(r_new)
        x.copy_(out)
    elif one_shot(world, x.numel() * x.element_size(), x.shape[0]):
        _one_shot(x, residual, weight, eps, group, world)
    else:
        _two_shot(x, residual, weight, eps, group, world, dist.get_rank(group))
