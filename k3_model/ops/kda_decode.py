"""One decode step of Kimi Delta Attention (KDA) over every head and every sequence of the batch.

Per sequence b and head h, with key width K and value width V (K = V = 128 in K3, 64 in K3-mini), the
op reads the recurrent state ``S`` (V x K, V-first as vLLM's K3 kernels store it) from the slot
``state_indices[b]`` of the state pool, advances it by one token and writes it back in place:

    q <- q / sqrt(|q|^2 + 1e-6) * K^-1/2,   k <- k / sqrt(|k|^2 + 1e-6)      (L2 norm, eps inside)
    g    = lower_bound * sigmoid(exp(A_log[h]) * (raw_g + dt_bias[h]))       (per key channel, in (lb, 0))
    beta = sigmoid(raw_beta)                                                  (per head, in (0, 1))
    S <- S Diag(exp g)                       decay the key channels
    u  = beta (v - S k)                      delta rule
    S <- S + u k^T                           (= S Diag(e^g) (I - beta k k^T) + beta v k^T)
    o  = S q

A row whose slot index is <= 0 is padding (slot 0 is the null slot, -1 a CUDA-graph filler): its output
is 0 and no slot of the pool changes, not even slot 0; every other slot keeps its bits. Active slots of
one call are distinct (duplicates are undefined, as in FlashInfer). All math in float32.

K3-mini calls the op in every KDA decode step (one token per sequence) from
:func:`k3_model.layers.kda_forward`; prefill chunks keep the token loop of
:func:`k3_model.layers.kda_recurrence`. The standard path below does the same float32 operations as that
loop does for one token, so the model's numbers are the same whichever of the two runs a step.

Source: shared/reference/kernel_targets.md §5.1 (recurrence, K3 gate, L2 norm with eps inside the sqrt,
q scaled by K^-1/2), §5.2 (vLLM K3: state ``[slots, H, V, K]`` fp32, index <= 0 skips the slot and
outputs zeros; FlashInfer: null slot 0, unique indices), §5.4 (shapes), §5.5 (padding rows and untouched
slots exact); shared/reference/k3_architecture.md §4.2.
"""

from __future__ import annotations

import torch

from k3_model import dispatch

OP = "kda_decode"
L2_EPS = 1e-6
"""q/k L2-norm epsilon, added to the squared norm inside the square root (kernel_targets.md §5.1, §5.5)."""

SHAPE_DOMAIN = {
    "H": {"min": 1, "max": 128},
    "K": {"min": 1, "max": 256},
    "V": {"min": 1, "max": 256},
    "S": {"min": 2, "max": 160},
}
"""The shapes ``tasks/k3_kda_decode`` judges (its ``[domain.axes]``, kept equal by
tests/k3_model/test_dispatch_shapes.py): a call outside them never runs a latency-specialized kernel
(:func:`k3_model.dispatch.route`). Axes: H heads, K key width, V value width, S state slots (the decode
batch B is the scope's batch range)."""
dispatch.register_op_shapes(OP, SHAPE_DOMAIN)


def kda_gate(raw_g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """K3's bounded per-channel log-decay: ``g = lower_bound * sigmoid(exp(A_log[h]) * (raw_g + dt_bias))``.

    Args:
        raw_g: (..., nh, d) ``f_b_proj(f_a_proj(x))`` reshaped per head.
        A_log: (>= nh,) float32; entries past nh are padding and ignored (K3 stores [128] for 96 heads).
        dt_bias: (nh * d,) float32.
        lower_bound: ``gate_lower_bound`` (-5.0): g lies in (lower_bound, 0).

    Returns:
        (..., nh, d) float32 log-decays (each step multiplies the state by ``exp(g)`` per key channel).

    Source: k3_architecture.md §4.2 (bounded gate replaces Kimi-Linear's softplus form); kernel_targets.md §5.1.
    """
    nh, d = raw_g.shape[-2:]
    a = torch.exp(A_log.float()[:nh]).unsqueeze(-1)  # (nh, 1)
    return lower_bound * torch.sigmoid(a * (raw_g.float() + dt_bias.float().view(nh, d)))


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (float32 in, float32 out).

    Source: kernel_targets.md §5.1 (``use_qk_l2norm_in_kernel``: eps inside the square root).
    """
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _check_args(q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, out) -> None:
    where = "k3_model.ops.kda_decode.kda_decode"
    if q.dim() != 3:
        raise ValueError(f"{where}: q must be (B, H, K) (one token per sequence); got shape {tuple(q.shape)}.")
    B, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (B, H):
        raise ValueError(f"{where}: v must be ({B}, {H}, V) like q's batch and heads; got {tuple(v.shape)}.")
    V = v.shape[2]
    want = {"q": (q, (B, H, K)), "k": (k, (B, H, K)), "v": (v, (B, H, V)), "raw_g": (raw_g, (B, H, K)),
            "raw_beta": (raw_beta, (B, H)), "A_log": (A_log, (H,)), "dt_bias": (dt_bias, (H * K,)),
            "out": (out, (B, H, V))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"{where}: {name} must be {shape} float32; got {tuple(t.shape)} {t.dtype}. "
                             f"Cast with .float() (the op computes in float32) or fix the shape.")
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, V, K) or state.dtype != torch.float32 or state.shape[0] < 1:
        raise ValueError(f"{where}: state must be (S, {H}, {V}, {K}) float32 (a pool of S >= 1 slots, V-first: "
                         f"S[slot, h] @ k is S k); got {tuple(state.shape)} {state.dtype}.")
    if tuple(state_indices.shape) != (B,) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: state_indices must be ({B},) int32 or int64 (one slot per sequence, <= 0 for "
                         f"padding); got {tuple(state_indices.shape)} {state_indices.dtype}.")
    for name, t in (("q", q), ("k", k), ("v", v), ("raw_g", raw_g), ("raw_beta", raw_beta), ("A_log", A_log),
                    ("dt_bias", dt_bias), ("state", state), ("state_indices", state_indices), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous (row-major); call .contiguous() first.")
        if t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device}, q on {q.device}; put every tensor on one device.")
    if q.device.type == "cpu" and B and int(state_indices.max()) >= state.shape[0]:
        raise ValueError(f"{where}: state_indices holds slot {int(state_indices.max())} but the pool has "
                         f"{state.shape[0]} slots (0..{state.shape[0] - 1}); allocate a larger pool.")


def kda_decode_standard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
                        raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                        state_indices: torch.Tensor, *, lower_bound: float, out: torch.Tensor) -> None:
    """The standard path: the gate, beta and L2 norms as K3-mini's KDA layer computes them, then one
    step of :func:`k3_model.layers.kda_recurrence`'s loop on the gathered slots; no host sync (a CUDA
    graph can capture it). See :func:`kda_decode`."""
    B, H, K = q.shape
    V = v.shape[2]
    qn = l2_normalize(q) * K ** -0.5
    kn = l2_normalize(k)
    g = kda_gate(raw_g, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(raw_beta)
    active = state_indices > 0  # (B,)
    slot = state_indices.long().clamp(min=0)
    old = state[slot]  # (B, H, V, K) copies; padding rows read slot 0 and write it back unchanged
    Sf = old.clone().view(B * H, V, K)
    kt, qt = kn.reshape(B * H, K), qn.reshape(B * H, K)
    kq = torch.stack([kt, qt], dim=-1)  # (BH, K, 2): one matmul gives S k and S q
    k_dot_q = (kt * qt).sum(-1, keepdim=True)  # (BH, 1)
    Sf.mul_(torch.exp(g).reshape(B * H, 1, K))  # decay the key channels
    sk_sq = torch.bmm(Sf, kq)  # (BH, V, 2): S k, S q with the decayed S
    u = beta.reshape(B * H, 1) * (v.reshape(B * H, V) - sk_sq[..., 0])  # delta rule
    o = sk_sq[..., 1] + u * k_dot_q  # (S + u k^T) q
    Sf.baddbmm_(u.unsqueeze(-1), kt.unsqueeze(1))  # S += u k^T
    keep = active.view(B, 1, 1, 1)
    state.index_put_((slot,), torch.where(keep, Sf.view(B, H, V, K), old))
    out.copy_(torch.where(active.view(B, 1, 1), o.view(B, H, V), torch.zeros((), device=o.device)))


def shape_axes(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> dict[str, int]:
    """The call's shape axes, named as the task's: ``{"H", "K", "V", "S"}`` -> sizes."""
    _, H, K = q.shape
    return {"H": H, "K": K, "V": v.shape[2], "S": state.shape[0]}


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor, *,
               lower_bound: float = -5.0, out: torch.Tensor) -> None:
    """Advance every sequence's KDA state by one token and write the attention output.

    Args:
        q: (B, H, K) float32, contiguous: queries after the short conv and SiLU, not normalised.
        k: (B, H, K) float32, contiguous: keys, as q.
        v: (B, H, V) float32, contiguous: values.
        raw_g: (B, H, K) float32: decay logits ``f_b_proj(f_a_proj(x))`` per head and key channel.
        raw_beta: (B, H) float32: beta logits ``b_proj(x)``.
        A_log: (H,) float32: per-head log scale of the gate (slice K3's zero-padded [128] to H first).
        dt_bias: (H * K,) float32: gate bias, head-major.
        state: (S, H, V, K) float32, contiguous: the recurrent-state pool, V-first (``S[slot, h] @ k`` is
            ``S k``); slot ``state_indices[b]`` is read and overwritten in place for active rows; every
            other slot keeps its bits.
        state_indices: (B,) int32 or int64: the slot of each sequence; <= 0 marks a padding row (output
            0, no slot touched). Active slots are distinct.
        lower_bound: ``gate_lower_bound`` (K3: -5.0; any negative number): the log-decay per step lies in
            (lower_bound, 0).
        out: out (B, H, V) float32: ``o = S q`` with the updated state (q normalised and scaled by
            K^-1/2); 0 on padding rows.

    Raises:
        ValueError: shapes, dtypes, layout or devices outside the contract, or (CPU) a slot index past
            the pool (the message says what to fix).
        k3_model.dispatch.DispatchError: a merged latency-specialized kernel is malformed.

    The decode batch for dispatch is B (sequences, padding rows included).

    Source: kernel_targets.md §5.1 (algorithm, K3 gate), §5.2 (vLLM K3 state layout and index <= 0
    contract), §5.4 (shapes), §5.5 (edge cases); k3_architecture.md §4.2.
    """
    _check_args(q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, out)
    fn = dispatch.select(
        OP,
        "kda_decode",
        kda_decode_standard,
        rows=q.shape[0],
        device=q.device.type,
        dtype=str(q.dtype).removeprefix("torch."),
        shapes=shape_axes(q, v, state),
    )
    fn(q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices, lower_bound=lower_bound, out=out)
