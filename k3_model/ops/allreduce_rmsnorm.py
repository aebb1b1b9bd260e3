"""K3 tensor-parallel all-reduce + residual add + RMSNorm, in place (vLLM's ``fused_add_rms_norm`` contract).

Each TP rank holds a partial sum ``x`` (the row-parallel o_proj / MoE output shard) and the same
``residual``. After the call, on every rank and with identical bits:

    A         = bf16( sum over ranks r = 0..W-1 of float(x_r) )        fp32 accumulate, one rounding
    residual <- bf16( float(A) + float(residual) )                     the new residual R'
    x        <- bf16( float(R') * rsqrt(mean_D(float(R')^2) + eps) * float(weight) )

The standard path is the unfused sequence: ``torch.distributed.all_reduce`` of the partials in fp32
(bf16 accumulation rounds W - 1 times: sglang issue 34603), the residual add, then RMSNorm in fp32
with one rounding at the end. A latency-specialized kernel (``k3_model/kernels/allreduce_rmsnorm/``)
fuses them (one-shot for small messages, two-shot reduce-scatter + all-gather for large).

K3 itself mixes AttnRes blocks where a plain residual add stands here (k3_architecture.md; kernel_targets.md
§1.1 "Kimi-K3 deviation"); this op is the fused-add-RMSNorm flow of Kimi-Linear and K2, and the
all-reduce + residual half is what K3's o_proj / MoE outputs go through before the mix.

Source: shared/reference/kernel_targets.md §1.1 (contract: in place on both tensors, residual
contiguous, weight [hidden], eps from the config), §1.2 (reference math), §1.5 (bitwise identical on
every rank).
"""

from __future__ import annotations

import torch

from k3_model import dispatch

OP = "allreduce_rmsnorm"
SHAPE_DOMAIN = {"D": {"min": 1, "max": 7168}}
"""The shapes ``tasks/k3_allreduce_rmsnorm`` judges (its ``[domain.axes.D]``, kept equal by
tests/k3_model/test_dispatch_shapes.py): a call outside them never runs a latency-specialized kernel
(:func:`k3_model.dispatch.route`). D is the hidden size; T (batch) and W (TP size) are scope fields."""
dispatch.register_op_shapes(OP, SHAPE_DOMAIN)


def world_size(group=None) -> int:
    """Ranks in ``group`` (the default group when ``None``); 1 when ``torch.distributed`` is not initialised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _check_args(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    where = "k3_model.ops.allreduce_rmsnorm.allreduce_add_rmsnorm"
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be (T, D); got shape {tuple(x.shape)}. Flatten tokens first.")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"{where}: residual must match x {tuple(x.shape)} {x.dtype}; got "
                         f"{tuple(residual.shape)} {residual.dtype} (no fp32 residual: kernel_targets.md §1.1).")
    if not residual.is_contiguous() or not x.is_contiguous():
        raise ValueError(f"{where}: x and residual must be contiguous (row-major (T, D)); call .contiguous().")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"{where}: weight must be ({x.shape[1]},) {x.dtype}; got {tuple(weight.shape)} {weight.dtype} "
                         "(mixed fp32 norm weights corrupted the fused path: vLLM issue 48324).")
    if x.device != residual.device or x.device != weight.device:
        raise ValueError(f"{where}: x, residual and weight must be on one device; got {x.device}, "
                         f"{residual.device}, {weight.device}.")
    if not eps > 0:
        raise ValueError(f"{where}: eps must be > 0 (K3: rms_norm_eps 1e-5); got {eps}.")


def allreduce_add_rmsnorm_standard(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                                   group=None) -> None:
    """The standard path: fp32 all-reduce, residual add, RMSNorm; in place on ``x`` and ``residual``.

    Args and effect: see :func:`allreduce_add_rmsnorm`.
    """
    acc = x.float()
    if world_size(group) > 1:
        import torch.distributed as dist

        dist.all_reduce(acc, group=group)
    r = (acc.to(x.dtype).float() + residual.float()).to(residual.dtype)
    residual.copy_(r)
    rf = r.float()
    x.copy_((rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype))


def allreduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                          group=None) -> None:
    """All-reduce ``x`` over the TP group, add it to ``residual``, RMS-normalise; in place on both.

    Args:
        x: (T, D) bfloat16 (or float32), row-major; this rank's partial sum. Overwritten with the
            normalised output ``bf16(R' * rsqrt(mean(R'^2) + eps) * weight)``.
        residual: (T, D), same dtype, contiguous; the same on every rank. Overwritten with
            ``R' = bf16(allreduce(x) + residual)``.
        weight: (D,) RMSNorm weight, same dtype as ``x``.
        eps: RMSNorm epsilon (dimensionless; K3: 1e-5).
        group: the ``torch.distributed`` TP group (``None``: the default group; no group initialised:
            world size 1, no communication).

    Raises:
        ValueError: shapes, dtypes, devices or layout outside the contract (message names what and how to fix).
        DispatchError: a merged latency-specialized kernel is malformed.

    Every rank must call it with the same shapes (a collective). T is the decode batch for dispatch.

    Source: kernel_targets.md §1.1-1.2.
    """
    _check_args(x, residual, weight, eps)
    fn = dispatch.select(
        OP,
        "allreduce_add_rmsnorm",
        allreduce_add_rmsnorm_standard,
        rows=x.shape[0],
        device=x.device.type,
        dtype=str(x.dtype).removeprefix("torch."),
        shapes={"D": x.shape[1]},
    )
    fn(x, residual, weight, eps=eps, group=group)
