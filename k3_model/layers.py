"""K3 layers as pure functions: weights in, activations out, state passed explicitly.

Every function takes its weights as a small dataclass of tensors (names as in the HF checkpoint),
its activations as ``(N, H)`` rows or ``(B, T, H)`` sequences, and mutates only the state object it is
handed (the KDA recurrent + conv state, the MLA latent cache). Nothing is global, so a serving engine
(the vLLM plugin) can call them with its own batching and its own cache storage.

Numerics: RMSNorm variance, AttnRes logits and softmax, SiTU, attention softmax, KDA gates and the
KDA state are fp32 whatever the activation dtype (k3_architecture.md §4.5, §4.6; fp32 state per §4.2).

Source: shared/reference/k3_architecture.md §4.1 (AttnRes), §4.2 (KDA), §4.3 (gated NoPE MLA),
§4.4 (LatentMoE), §4.5 (SiTU-GLU), §4.6 (norms); kernel_targets.md §5.1 (KDA recurrence).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from k3_model.ops.kda_decode import kda_decode, kda_gate, l2_normalize
from k3_model.ops.lse_merge import lse_merge
from k3_model.ops.moe_dispatch import align_capacity, moe_route_dispatch, selection_scores
from k3_model.ops.small_m_gemm import small_m_gemm

MOE_ALIGN_BLOCK = 16
"""Block size the model asks ``moe_route_dispatch`` to align to (rows of a Triton expert tile)."""

SPLIT_KV_MIN_PAGES = 2
"""The absorbed (decode) MLA step over an :class:`MLACache` holding at least this many pages splits the
attention by page (one chunk of ``page_tokens`` keys each, flash-decoding style) and merges the chunks'
partial outputs with the ``lse_merge`` op (:func:`split_kv_pages`). Two pages: the model eval's contexts
(1024 + 129 and 2048 + 256 tokens in pages of 256; 192 + 64 in pages of 64 in its bfloat16 leg) all
cross it, so every decode step there merges 4-9 chunks.
Source: issue 14 item 2 (split-KV MLA decode once the context passes a threshold); kernel_targets.md §4."""


# ---------------------------------------------------------------------------------------------
# norms and activations


def in_proj(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An attention input projection ``F.linear(x, w)``; a decode step (T == 1) runs the dispatched
    ``small_m_gemm`` op over its B rows (the standard path is bit for bit ``F.linear``), a prefill chunk
    ``F.linear`` itself.

    Args:
        x: (B, T, H) the attention input (or a projection of it); contiguous in the model (RMSNorm outputs),
            where the decode step's result is ``F.linear``'s bits (F.linear over a strided (B, 1, H) view takes
            torch's batched-GEMV path instead, whose last bits differ).
        w: (N, H) contiguous, x's dtype (nn.Linear layout).

    Returns:
        (B, T, N) in ``x``'s dtype.

    Source: kernel_targets.md §6.1 (vLLM's K3 routes these projections to its low-latency GEMMs at decode).
    """
    B, T, H = x.shape
    if T != 1:
        return F.linear(x, w)
    rows = x.reshape(B, H)  # a view of the model's contiguous inputs; a copy of a strided one
    out = torch.empty(B, w.shape[0], dtype=x.dtype, device=x.device)
    small_m_gemm(rows, w, out=out)
    return out.view(B, 1, w.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis with fp32 variance.

    Args:
        x: (..., D) any float dtype.
        weight: (D,) float.
        eps: added to the mean square (absolute).

    Returns:
        (..., D) in ``x``'s dtype: ``x / sqrt(mean(x^2) + eps) * weight``.

    Source: k3_architecture.md §4.6 (fp32 variance, eps = rms_norm_eps).
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU: ``[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]``, computed in fp32.

    Args:
        gate: (..., F) the gate branch (``gate_proj`` / ``w1``).
        up: (..., F) the linear branch (``up_proj`` / ``w3``).
        beta: b1 = ``activation_situ_beta`` (4.0 in K3).
        linear_beta: b2 = ``activation_situ_linear_beta`` (25.0 in K3).

    Returns:
        (..., F) in ``gate``'s dtype. As b1, b2 -> inf it tends to ``SiLU(g) * u``.

    Source: k3_architecture.md §4.5 (tech report Eq. 12).
    """
    g, u = gate.float(), up.float()
    y = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    return y.to(gate.dtype)


@dataclasses.dataclass
class MLPWeights:
    """A SiTU-GLU MLP (layer-0 dense MLP, fused shared experts).

    Attributes:
        gate_proj: (F, H). up_proj: (F, H). down_proj: (H, F). nn.Linear layout (out, in).
    """

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


def situ_mlp(w: MLPWeights, x: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """``down(SiTU-GLU(gate(x), up(x)))``.

    Args:
        w: the MLP's weights.
        x: (N, H) activations, the weights' dtype.
        beta, linear_beta: SiTU betas (dimensionless).

    Returns:
        (N, H).

    Source: k3_architecture.md §4.5 (SiTU in all FFNs), §2 (dense L0 and shared expert shapes).
    """
    return F.linear(situ_glu(F.linear(x, w.gate_proj), F.linear(x, w.up_proj), beta, linear_beta), w.down_proj)


# ---------------------------------------------------------------------------------------------
# AttnRes


def attn_res_mix(sources: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Attention over depth: a softmax-weighted sum of the stored block vectors and the current prefix.

    One scalar logit per source, ``logit(v) = dot(v, norm_w * proj_w) / sqrt(mean(v^2) + eps)``
    (= ``res_proj(RMSNorm(v))``), softmax over the sources in fp32, and the RAW (un-normalized) source
    vectors mixed with those weights. With ``proj_w == 0`` every source weighs ``1/S``.

    Args:
        sources: (N, S, H): blocks in write order, then the current prefix last.
        norm_w: (H,) ``*_res_norm.weight``.
        proj_w: (H,) or (1, H) ``*_res_proj.weight``.
        eps: RMSNorm epsilon.

    Returns:
        (N, H) in ``sources``' dtype (one source: that source unchanged).

    Source: k3_architecture.md §4.1 ``mix``.
    """
    if sources.shape[1] == 1:
        return sources[:, 0]
    v = sources.float()
    w_eff = norm_w.float() * proj_w.float().reshape(-1)
    logits = (v @ w_eff) * torch.rsqrt(v.pow(2).mean(-1) + eps)  # (N, S)
    p = torch.softmax(logits, dim=-1)
    return (p.unsqueeze(-1) * v).sum(1).to(sources.dtype)


# ---------------------------------------------------------------------------------------------
# KDA


@dataclasses.dataclass
class KDAWeights:
    """One KDA layer (HF checkpoint names; P = heads x head_dim, R = f_a rank, nh = heads, d = head_dim).

    Attributes:
        q_proj, k_proj, v_proj: (P, H).
        q_conv1d, k_conv1d, v_conv1d: (P, 1, C) float32 causal depthwise conv taps (C = 4), no bias.
        f_a_proj: (R, H); f_b_proj: (P, R): low-rank decay logits.
        A_log: (>= nh,) float32, per-head log scale, zero-padded (K3 stores [128] for 96 heads).
        dt_bias: (P,) float32.
        b_proj: (nh, H): beta logits.
        g_proj: (P, H): full-rank sigmoid output gate.
        o_norm: (d,) float32, RMSNorm weight shared by all heads.
        o_proj: (H, P).
    """

    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    q_conv1d: torch.Tensor
    k_conv1d: torch.Tensor
    v_conv1d: torch.Tensor
    f_a_proj: torch.Tensor
    f_b_proj: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    b_proj: torch.Tensor
    g_proj: torch.Tensor
    o_norm: torch.Tensor
    o_proj: torch.Tensor


@dataclasses.dataclass
class KDAState:
    """Per-sequence decode state of one KDA layer (the caller owns it; KDA functions update it in place).

    Attributes:
        recurrent: (B, nh, d_v, d_k) float32, vLLM's V-first layout: ``S[b, h] @ k`` is ``S k``.
        conv: (B, 3, P, C-1) float32: the last C-1 pre-conv q, k, v projections per channel, oldest first.
        slots: (B + 1, nh, d_v, d_k) float32 or ``None``: the slot pool the ``kda_decode`` op indexes
            (slot 0 is the null slot; sequence b is slot b + 1), of which ``recurrent`` is the view
            ``slots[1:]``. :meth:`zeros` allocates it; a state built from other tensors has none, and its
            decode steps copy through a temporary pool (:meth:`decode_pool`).
        positions: ``None``, or a list that a speculative verification step fills (:meth:`track_positions`):
            ``(recurrent, conv)`` copies after each of its tokens, so :meth:`rewind` can keep any prefix.
    """

    recurrent: torch.Tensor
    conv: torch.Tensor
    slots: torch.Tensor | None = None
    positions: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def track_positions(self) -> None:
        """Keep a copy of the state after every token of the next forward (a verification step of 1 + D
        tokens runs them one at a time, each a ``kda_decode`` step, as the vLLM plugin does:
        ``k3_model/vllm_plugin/model.py`` ``K3KDALayer``), until :meth:`rewind`."""
        self.positions = []

    def rewind(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the tracked forward: restore the state after its token
        ``keep`` (1-based) in place (``recurrent`` stays the view of ``slots``) and stop tracking.

        Raises:
            ValueError: not tracking, or ``keep`` outside [1, tokens tracked].
        """
        if self.positions is None or not 1 <= keep <= len(self.positions):
            held = "not tracking" if self.positions is None else f"{len(self.positions)} tracked"
            raise ValueError(f"KDAState.rewind: keep must lie in [1, tokens tracked]; got {keep} ({held}). "
                             "Call track_positions() before the verification forward.")
        recurrent, conv = self.positions[keep - 1]
        self.recurrent.copy_(recurrent)
        self.conv.copy_(conv)
        self.positions = None

    @classmethod
    def zeros(cls, batch: int, heads: int, head_dim: int, conv_width: int, device: torch.device | str) -> KDAState:
        """A fresh state (no tokens seen): zeros, so the conv sees zero padding before the first token."""
        P = heads * head_dim
        slots = torch.zeros(batch + 1, heads, head_dim, head_dim, dtype=torch.float32, device=device)
        return cls(slots[1:], torch.zeros(batch, 3, P, conv_width - 1, dtype=torch.float32, device=device), slots)

    def decode_pool(self) -> tuple[torch.Tensor, bool]:
        """The pool a decode step hands the ``kda_decode`` op, sequence b in slot b + 1.

        Returns:
            ``(pool, copied)``: :attr:`slots` itself when ``recurrent`` is its view ``slots[1:]``
            (``copied`` False); else a fresh (B + 1)-slot copy (``copied`` True: the caller copies
            ``pool[1:]`` back into ``recurrent``).
        """
        s, r = self.slots, self.recurrent
        if (s is not None and s.shape[0] == r.shape[0] + 1 and s.is_contiguous() and r.is_contiguous()
                and s.shape[1:] == r.shape[1:] and s[1:].data_ptr() == r.data_ptr()):
            return s, False
        return torch.cat([torch.zeros_like(r[:1]), r]), True


def _causal_conv_silu(x: torch.Tensor, taps: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over a chunk, continuing from ``state``.

    Args:
        x: (B, T, P) pre-conv projections.
        taps: (P, 1, C) conv weights; tap ``C-1`` multiplies the current token.
        state: (B, P, C-1) the previous C-1 inputs, oldest first.

    Returns:
        ``(y, new_state)``: y (B, T, P) in fp32, new_state (B, P, C-1) fp32 (the last C-1 inputs).
    """
    xx = torch.cat([state, x.float().transpose(1, 2)], dim=2)  # (B, P, C-1+T)
    C = taps.shape[-1]
    # windows[b, p, t, j] = xx[b, p, t + j]: tap j multiplies the input C-1-j steps back
    y = (xx.unfold(2, C, 1) * taps.float().view(1, -1, 1, C)).sum(-1)  # (B, P, T)
    return F.silu(y).transpose(1, 2), xx[:, :, xx.shape[2] - state.shape[2]:]


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   S: torch.Tensor) -> torch.Tensor:
    """The gated delta rule, one token at a time, in fp32; updates ``S`` in place.

    Per head: ``S <- S * exp(g)`` on the key axis; ``u = beta (v - S k)``; ``S <- S + u k^T``; ``o = S q``.

    Args:
        q: (B, T, nh, d) L2-normalized and scaled by d^-1/2. k: (B, T, nh, d) L2-normalized.
        v: (B, T, nh, d). g: (B, T, nh, d) log-decays <= 0. beta: (B, T, nh) in (0, 1).
        S: (B, nh, d_v, d_k) float32 state (V-first), modified in place.

    Returns:
        o: (B, T, nh, d_v) float32.

    Source: k3_architecture.md §4.2; kernel_targets.md §5.1 (``S = (I - b k k^T) Diag(e^g) S + b k v^T``
    in K-first form).
    """
    B, T, nh, K = k.shape
    Vd = v.shape[-1]
    if not S.is_contiguous():
        raise ValueError("kda_recurrence: the state must be contiguous (it is updated in place through a view).")
    Sf = S.view(B * nh, Vd, K)
    tm = lambda x: x.float().transpose(0, 1).reshape(T, B * nh, *x.shape[3:])  # noqa: E731  (T, B*nh, ...)
    kt, qt, vt = tm(k), tm(q), tm(v)
    decay = torch.exp(tm(g)).unsqueeze(2)  # (T, BH, 1, K)
    bt = beta.float().transpose(0, 1).reshape(T, B * nh, 1)
    kq = torch.stack([kt, qt], dim=-1)  # (T, BH, K, 2): one matmul gives S k and S q
    k_dot_q = (kt * qt).sum(-1, keepdim=True)  # (T, BH, 1)
    out = torch.empty(T, B * nh, Vd, dtype=torch.float32, device=S.device)
    for t in range(T):
        Sf.mul_(decay[t])  # decay the key channels
        sk_sq = torch.bmm(Sf, kq[t])  # (BH, V, 2): S k, S q with the decayed S
        u = bt[t] * (vt[t] - sk_sq[..., 0])  # delta rule
        out[t] = sk_sq[..., 1] + u * k_dot_q[t]  # (S + u k^T) q
        Sf.baddbmm_(u.unsqueeze(-1), kt[t].unsqueeze(1))  # S += u k^T
    return out.view(T, B, nh, Vd).transpose(0, 1)


def kda_forward(w: KDAWeights, x: torch.Tensor, state: KDAState, *, heads: int, head_dim: int,
                lower_bound: float, eps: float) -> torch.Tensor:
    """One KDA layer over a chunk of tokens per sequence (prefill chunk or a decode step), state carried.

    Args:
        w: the layer's weights.
        x: (B, T, H) the normalized attention input (``input_layernorm`` output).
        state: the sequences' state, updated in place (conv window and recurrent state).
        heads, head_dim: nh and d.
        lower_bound: ``gate_lower_bound``.
        eps: ``rms_norm_eps`` for the per-head output norm.

    Returns:
        (B, T, H) in ``x``'s dtype.

    Raises:
        ValueError: ``state`` does not match the batch or the layer's width.

    Source: k3_architecture.md §4.2.
    """
    B, T, _ = x.shape
    P = heads * head_dim
    if state.recurrent.shape != (B, heads, head_dim, head_dim) or state.conv.shape[:3] != (B, 3, P):
        raise ValueError(
            f"kda_forward: state recurrent {tuple(state.recurrent.shape)} / conv {tuple(state.conv.shape)} does not "
            f"match batch {B}, {heads} heads x {head_dim}; allocate it with KDAState.zeros(B, nh, d, C)."
        )
    q, cq = _causal_conv_silu(in_proj(x, w.q_proj), w.q_conv1d, state.conv[:, 0])
    k, ck = _causal_conv_silu(in_proj(x, w.k_proj), w.k_conv1d, state.conv[:, 1])
    v, cv = _causal_conv_silu(in_proj(x, w.v_proj), w.v_conv1d, state.conv[:, 2])
    state.conv.copy_(torch.stack([cq, ck, cv], dim=1))
    q, k, v = (t.view(B, T, heads, head_dim) for t in (q, k, v))
    raw_g = F.linear(in_proj(x, w.f_a_proj), w.f_b_proj).view(B, T, heads, head_dim)
    raw_beta = in_proj(x, w.b_proj).float()  # (B, T, nh)
    if T == 1:  # a decode step: the dispatched kda_decode op (L2 norms, gate, beta and the step)
        pool, copied = state.decode_pool()
        o = torch.empty(B, heads, head_dim, dtype=torch.float32, device=x.device)
        kda_decode(q[:, 0].contiguous(), k[:, 0].contiguous(), v[:, 0].contiguous(), raw_g[:, 0].float().contiguous(),
                   raw_beta[:, 0].contiguous(), w.A_log[:heads].float().contiguous(), w.dt_bias.float().contiguous(),
                   pool, torch.arange(1, B + 1, dtype=torch.int32, device=x.device), lower_bound=lower_bound, out=o)
        if copied:
            state.recurrent.copy_(pool[1:])
        o = o.view(B, T, heads, head_dim)
    else:  # prefill chunk: the token loop, the same per-token float32 math
        q = l2_normalize(q) * head_dim ** -0.5
        k = l2_normalize(k)
        g = kda_gate(raw_g, w.A_log, w.dt_bias, lower_bound)
        o = kda_recurrence(q, k, v, g, torch.sigmoid(raw_beta), state.recurrent)  # (B, T, nh, d) fp32
    o = rms_norm(o, w.o_norm, eps)
    gate = torch.sigmoid(F.linear(x, w.g_proj).float()).view(B, T, heads, head_dim)
    return F.linear((o * gate).reshape(B, T, P).to(x.dtype), w.o_proj)


# ---------------------------------------------------------------------------------------------
# gated NoPE MLA


@dataclasses.dataclass
class MLAWeights:
    """One gated NoPE MLA layer (HF names; nh heads, n = qk_nope, r = qk_rope, dv = v_head_dim, L = kv_lora).

    Attributes:
        q_a_proj: (q_lora, H). q_a_layernorm: (q_lora,). q_b_proj: (nh*(n+r), q_lora).
        kv_a_proj_with_mqa: (L + r, H). kv_a_layernorm: (L,). kv_b_proj: (nh*(n+dv), L).
        g_proj: (nh*dv, H) sigmoid output gate. o_proj: (H, nh*dv).
    """

    q_a_proj: torch.Tensor
    q_a_layernorm: torch.Tensor
    q_b_proj: torch.Tensor
    kv_a_proj_with_mqa: torch.Tensor
    kv_a_layernorm: torch.Tensor
    kv_b_proj: torch.Tensor
    g_proj: torch.Tensor
    o_proj: torch.Tensor


class MLACache:
    """The latent KV cache of one MLA layer for B sequences of equal length, in pages.

    Per token it stores ``kv_lora_rank + qk_rope_head_dim`` values (the RMS-normed latent ``c`` and the
    raw, never rotated ``k_pe``: 512 + 64 = 576 in K3 and K3-mini). Storage grows a page
    (``page_tokens`` tokens) at a time; ``max_tokens`` is the declared limit.

    Attributes:
        latent: (B, capacity, L) the compute dtype. k_pe: (B, capacity, r). length: tokens stored.

    Source: k3_architecture.md §4.3 (cache = 576 values/token, k_pe raw).
    """

    def __init__(self, batch: int, kv_lora_rank: int, rope_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str, page_tokens: int = 64, max_tokens: int = 4096) -> None:
        if page_tokens < 1 or max_tokens < 1:
            raise ValueError(f"MLACache: page_tokens ({page_tokens}) and max_tokens ({max_tokens}) must be >= 1.")
        self.page_tokens, self.max_tokens = page_tokens, max_tokens
        self.length = 0
        self.latent = torch.zeros(batch, 0, kv_lora_rank, dtype=dtype, device=device)
        self.k_pe = torch.zeros(batch, 0, rope_dim, dtype=dtype, device=device)
        self.pages_allocated = 0

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store T new tokens per sequence.

        Args:
            latent: (B, T, L) normed latents. k_pe: (B, T, r).

        Raises:
            ValueError: the cache would exceed ``max_tokens`` (the declared limit).
        """
        T = latent.shape[1]
        need = self.length + T
        if need > self.max_tokens:
            raise ValueError(f"MLACache: {need} tokens exceed the declared limit max_tokens={self.max_tokens}; "
                             "raise max_tokens (at most max_position_embeddings).")
        if need > self.latent.shape[1]:
            pages = -(-need // self.page_tokens)
            grow = pages * self.page_tokens - self.latent.shape[1]
            B = self.latent.shape[0]
            self.latent = torch.cat([self.latent, self.latent.new_zeros(B, grow, self.latent.shape[2])], dim=1)
            self.k_pe = torch.cat([self.k_pe, self.k_pe.new_zeros(B, grow, self.k_pe.shape[2])], dim=1)
            self.pages_allocated = pages
        self.latent[:, self.length:need] = latent.to(self.latent.dtype)
        self.k_pe[:, self.length:need] = k_pe.to(self.k_pe.dtype)
        self.length = need

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latent (B, S, L), k_pe (B, S, r))`` of the S = ``length`` stored tokens."""
        return self.latent[:, :self.length], self.k_pe[:, :self.length]

    def truncate(self, length: int) -> None:
        """Forget the tokens past ``length`` (a speculative step's rejected drafts); their slots are
        rewritten by the next :meth:`append`.

        Raises:
            ValueError: ``length`` outside [0, tokens stored].
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"MLACache.truncate: length must lie in [0, {self.length}] (tokens stored); got {length}.")
        self.length = length

    def visible(self, T: int) -> torch.Tensor:
        """Causal mask of the T tokens appended last over the S = ``length`` stored ones.

        Returns:
            (T, S) bool: query t (position S - T + t) sees stored token s iff s <= S - T + t.
        """
        S, dev = self.length, self.latent.device
        pos_q = torch.arange(S - T, S, device=dev).view(T, 1)
        return torch.arange(S, device=dev).view(1, S) <= pos_q


class StaticMLACache:
    """The latent KV cache of one MLA layer in fixed storage, for a decode step captured as a CUDA graph.

    Same role and layout as :class:`MLACache`, but storage for ``capacity`` tokens is allocated up front
    and the write position lives on the device (``position``), so a step reads and writes the same
    addresses every time and never asks the host how long the sequences are (no synchronisation, no
    data-dependent shape): :meth:`view` returns all ``capacity`` slots and :meth:`visible` masks the
    ones past the position. A step of T tokens costs attention over ``capacity`` slots, so size it to
    the longest context the caller reaches, not more. Writing past ``capacity`` is an index error
    (a device-side assert on CUDA): the caller plans its steps (``workbench bench-model`` does).
    Attention over it equals attention over an :class:`MLACache` with the same tokens up to rounding
    (the reductions run over ``capacity`` slots, the masked ones adding exactly 0: ~1 ulp).

    Attributes:
        latent: (B, capacity, L) the compute dtype, zeros where nothing was written (a masked slot
            then weighs exactly 0). k_pe: (B, capacity, r). position: (1,) int64, tokens stored.

    Source: PyTorch "CUDA Graphs" notes (static addresses, no host sync inside capture);
    k3_architecture.md §4.3 (576 cached values per token).
    """

    def __init__(self, batch: int, kv_lora_rank: int, rope_dim: int, *, capacity: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"StaticMLACache: capacity must be >= 1 token; got {capacity}.")
        self.capacity = capacity
        self.latent = torch.zeros(batch, capacity, kv_lora_rank, dtype=dtype, device=device)
        self.k_pe = torch.zeros(batch, capacity, rope_dim, dtype=dtype, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self._slots = torch.arange(capacity, device=device).view(1, capacity)

    def append(self, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store T new tokens per sequence at the device-side position, then advance it by T.

        Args:
            latent: (B, T, L) normed latents. k_pe: (B, T, r).
        """
        T = latent.shape[1]
        idx = self.position + torch.arange(T, device=self.position.device)  # (T,) on the device
        self.latent.index_copy_(1, idx, latent.to(self.latent.dtype))
        self.k_pe.index_copy_(1, idx, k_pe.to(self.k_pe.dtype))
        self.position += T

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latent (B, capacity, L), k_pe (B, capacity, r))``: every slot (see :meth:`visible`)."""
        return self.latent, self.k_pe

    def visible(self, T: int) -> torch.Tensor:
        """(T, capacity) bool: query t (position ``position - T + t``) sees slots up to its own position."""
        first = self.position - T  # (1,): the first of the T tokens appended last
        pos_q = first + torch.arange(T, device=first.device).view(T, 1)
        return self._slots <= pos_q


def split_kv_pages(cache: MLACache | StaticMLACache) -> int:
    """Pages the decode step splits the attention into: the pages holding ``cache.length`` tokens when
    that is at least :data:`SPLIT_KV_MIN_PAGES` (an :class:`MLACache`), else 0 (one unsplit softmax; a
    :class:`StaticMLACache` never splits: its length lives on the device)."""
    if not isinstance(cache, MLACache):
        return 0
    pages = -(-cache.length // cache.page_tokens)
    return pages if pages >= SPLIT_KV_MIN_PAGES else 0


def _split_kv_latent(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: MLACache, pages: int, *,
                     scale: float) -> torch.Tensor:
    """Absorbed MLA attention split by cache page, merged by log-sum-exp (the ``lse_merge`` op).

    Page n holds stored tokens ``[n P, (n + 1) P)``, P = ``cache.page_tokens``; slots past the length
    are masked like future tokens. Each page gives its partial latent output (softmax over the page's
    visible keys, fp32) and its LSE (base e); a page with no visible key (only when T > 1) has LSE -inf
    and a NaN partial output, which the merge weighs 0.

    Args:
        q_lat: (B, T, nh, L) absorbed queries. q_pe: (B, T, nh, r) rope parts.
        cache: the layer's cache, the T new tokens appended; its storage spans at least ``pages`` pages.
        pages: N chunks (:func:`split_kv_pages`).
        scale: the softmax scale 1 / sqrt(n + r).

    Returns:
        (B, T, nh, L) float32: ``sum_s p(s) c(s)`` over every visible stored token.

    Source: kernel_targets.md §4.2 (per-chunk LSE and partial output, merged); issue 14 item 2.
    """
    B, T, nh, L = q_lat.shape
    P, S = cache.page_tokens, cache.length
    c = cache.latent[:, :pages * P].float()  # (B, N*P, L), zeros past the length
    k_pe = cache.k_pe[:, :pages * P].float()
    scores = (torch.einsum("bthl,bsl->bhts", q_lat.float(), c) + torch.einsum("bthr,bsr->bhts", q_pe.float(), k_pe)) * scale
    pos_q = torch.arange(S - T, S, device=c.device).view(T, 1)
    visible = torch.arange(pages * P, device=c.device).view(1, -1) <= pos_q  # (T, N*P): causal, and s < S
    scores = scores.masked_fill(~visible, float("-inf")).view(B, nh, T, pages, P)
    lse = torch.logsumexp(scores, dim=-1)  # (B, nh, T, N)
    p = torch.exp(scores - lse.unsqueeze(-1))
    outs = torch.einsum("bhtnp,bnpl->nbthl", p, c.view(B, pages, P, L)).reshape(pages, B * T, nh, L).contiguous()
    lses = lse.permute(3, 0, 2, 1).reshape(pages, B * T, nh).contiguous()
    out = torch.empty(B * T, nh, L, dtype=torch.float32, device=c.device)
    out_lse = torch.empty(B * T, nh, dtype=torch.float32, device=c.device)
    lse_merge(outs, lses, base_e=True, out=out, out_lse=out_lse)
    return out.view(B, T, nh, L)


def mla_forward(w: MLAWeights, x: torch.Tensor, cache: MLACache | StaticMLACache, *, heads: int, nope: int, rope: int, v_dim: int,
                kv_lora_rank: int, eps: float, absorbed: bool) -> torch.Tensor:
    """One gated NoPE MLA layer over T new tokens per sequence, attending to everything cached so far.

    ``score_h(s) = (q_nope_h . k_nope_h(s) + q_pe_h . k_pe(s)) / sqrt(n + r)``, causal softmax,
    ``o_h = sum_s p_h(s) v_h(s)``, ``out = o_proj(o * sigmoid(g_proj(x)))``. No rotary embedding.
    ``absorbed`` computes the same thing in the latent space (decode form: ``W_UK`` folded into the
    query, ``W_UV`` applied after attention); otherwise keys and values are expanded per head (prefill form).
    The absorbed form over an :class:`MLACache` of at least :data:`SPLIT_KV_MIN_PAGES` pages attends page by
    page and merges the pages with the dispatched ``lse_merge`` op (split-KV decode; equal to the unsplit
    softmax up to fp32 rounding).

    Args:
        w: the layer's weights.
        x: (B, T, H) the normalized attention input.
        cache: the layer's cache (:class:`MLACache`, or :class:`StaticMLACache` for a captured step); the
            T new tokens are appended first, and it says which stored tokens each query sees.
        heads, nope, rope, v_dim, kv_lora_rank: nh, n, r, dv, L.
        eps: RMSNorm epsilon of ``q_a_layernorm`` / ``kv_a_layernorm`` (rms_norm_eps, as vLLM).
        absorbed: weight-absorbed (decode) or expanded (prefill) form.

    Returns:
        (B, T, H) in ``x``'s dtype.

    Source: k3_architecture.md §4.3 (and §8.1: eps 1e-5 as vLLM).
    """
    B, T, _ = x.shape
    q = in_proj(rms_norm(in_proj(x, w.q_a_proj), w.q_a_layernorm, eps), w.q_b_proj).view(B, T, heads, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv = in_proj(x, w.kv_a_proj_with_mqa)
    cache.append(rms_norm(kv[..., :kv_lora_rank], w.kv_a_layernorm, eps), kv[..., kv_lora_rank:])
    c, k_pe = cache.view()  # (B, S, L), (B, S, r)
    wkv = w.kv_b_proj.view(heads, nope + v_dim, kv_lora_rank)
    w_uk, w_uv = wkv[:, :nope], wkv[:, nope:]  # (nh, n, L), (nh, dv, L)
    scale = (nope + rope) ** -0.5
    pages = split_kv_pages(cache) if absorbed else 0
    if pages:  # decode over >= SPLIT_KV_MIN_PAGES pages: per-page attention, merged by LSE
        q_lat = torch.einsum("bthn,hnl->bthl", q_nope, w_uk)
        o_lat = _split_kv_latent(q_lat, q_pe, cache, pages, scale=scale)
        return _mla_output(w, x, torch.einsum("bthl,hvl->bthv", o_lat, w_uv.float()), heads * v_dim)
    if absorbed:
        q_lat = torch.einsum("bthn,hnl->bthl", q_nope, w_uk)
        scores = torch.einsum("bthl,bsl->bhts", q_lat.float(), c.float())
    else:
        k_nope = torch.einsum("bsl,hnl->bshn", c, w_uk)
        scores = torch.einsum("bthn,bshn->bhts", q_nope.float(), k_nope.float())
    scores = (scores + torch.einsum("bthr,bsr->bhts", q_pe.float(), k_pe.float())) * scale
    visible = cache.visible(T)  # (T, S) causal
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    if absorbed:
        o_lat = torch.einsum("bhts,bsl->bthl", p, c.float())
        o = torch.einsum("bthl,hvl->bthv", o_lat, w_uv.float())
    else:
        v = torch.einsum("bsl,hvl->bshv", c, w_uv)
        o = torch.einsum("bhts,bshv->bthv", p, v.float())
    return _mla_output(w, x, o, heads * v_dim)


def _mla_output(w: MLAWeights, x: torch.Tensor, o: torch.Tensor, width: int) -> torch.Tensor:
    """``o_proj(o * sigmoid(g_proj(x)))`` for per-head outputs ``o`` (B, T, nh, dv) float32."""
    B, T, _ = x.shape
    o = o.reshape(B, T, width) * torch.sigmoid(F.linear(x, w.g_proj).float())
    return F.linear(o.to(x.dtype), w.o_proj)


# ---------------------------------------------------------------------------------------------
# LatentMoE


@dataclasses.dataclass
class LatentMoEWeights:
    """One LatentMoE layer (E experts, Z = routed_expert_hidden_size latent, F = moe_intermediate_size).

    Attributes:
        gate: (E, H) router weight (``gate.weight``). e_score_correction_bias: (E,) float32.
        routed_expert_down_proj: (Z, H). routed_expert_norm: (Z,). routed_expert_up_proj: (H, Z).
        w1: (E, F, Z) expert gate; w3: (E, F, Z) expert up; w2: (E, Z, F) expert down
            (``experts.{e}.w{1,3,2}.weight`` stacked).
        shared: the fused shared experts (2 x F wide), on the full hidden width.
    """

    gate: torch.Tensor
    e_score_correction_bias: torch.Tensor
    routed_expert_down_proj: torch.Tensor
    routed_expert_norm: torch.Tensor
    routed_expert_up_proj: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    shared: MLPWeights


@dataclasses.dataclass(frozen=True)
class RoutingSettings:
    """Routing parameters passed to ``moe_route_dispatch`` (from the text config)."""

    top_k: int
    n_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float
    block_size: int = MOE_ALIGN_BLOCK


@dataclasses.dataclass(frozen=True)
class RoutingRecord:
    """One LatentMoE layer's routing of one forward, as :func:`record_routing` keeps it.

    Attributes:
        scores: (N, E) float32 selection scores on the standard formula
            (:func:`k3_model.ops.moe_dispatch.selection_scores`: sigmoid + bias, -inf outside kept groups),
            computed from the router logits this forward produced, whichever implementation routed.
        ids: (N, K) int64 experts the op picked per token, ascending (slot order is free in the contract).
    """

    scores: torch.Tensor
    ids: torch.Tensor


_ROUTING_LOG: contextvars.ContextVar[list[RoutingRecord] | None] = contextvars.ContextVar("k3_routing_log",
                                                                                        default=None)


@contextlib.contextmanager
def record_routing() -> Iterator[list[RoutingRecord]]:
    """Keep a :class:`RoutingRecord` per LatentMoE layer call made inside the block, in call order.

    The model-eval guard uses it to tell a greedy divergence that starts at a routing near tie (the
    candidate's run, a few ULP away from the standard's, picks the other of two experts whose scores are
    within rounding) from a wrong routing (guards/model_eval.py, "Routing near ties"). Eager form only
    (the records copy to the host); the CUDA-graph step never records.

    Yields:
        The list the records are appended to.
    """
    log: list[RoutingRecord] = []
    token = _ROUTING_LOG.set(log)
    try:
        yield log
    finally:
        _ROUTING_LOG.reset(token)


def route(logits: torch.Tensor, bias: torch.Tensor, r: RoutingSettings) -> dict[str, torch.Tensor]:
    """Run the dispatcher's ``moe_route_dispatch`` op (standard path or a merged kernel in scope).

    Args:
        logits: (N, E) float32 router logits. bias: (E,) float32.
        r: routing settings.

    Returns:
        The op's five outputs: ``topk_weights`` (N, K) fp32, ``topk_ids`` (N, K) int32,
        ``sorted_token_ids``, ``expert_ids``, ``num_tokens_post_padded`` (see the op's docstring).
    """
    N, E = logits.shape
    cap, nblocks = align_capacity(N, r.top_k, E, r.block_size)
    dev = logits.device
    outs = {
        "topk_weights": torch.empty(N, r.top_k, dtype=torch.float32, device=dev),
        "topk_ids": torch.empty(N, r.top_k, dtype=torch.int32, device=dev),
        "sorted_token_ids": torch.empty(cap, dtype=torch.int32, device=dev),
        "expert_ids": torch.empty(nblocks, dtype=torch.int32, device=dev),
        "num_tokens_post_padded": torch.empty(1, dtype=torch.int32, device=dev),
    }
    moe_route_dispatch(logits.contiguous(), bias.float().contiguous(), torch.ones(N, dtype=torch.bool, device=dev),
                       top_k=r.top_k, n_group=r.n_group, topk_group=r.topk_group, renormalize=r.renormalize,
                       routed_scaling_factor=r.routed_scaling_factor, block_size=r.block_size, **outs)
    return outs


GATHER_MAX_ROWS = 256
"""Up to this many dispatched rows (decode batches) the experts run as one gathered batched matmul;
above it (prefill) as one matmul per expert segment. Each phase always takes the same form."""


def dispatch_rows(routing: dict[str, torch.Tensor], num_tokens: int, top_k: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read the block-aligned dispatch layout back into dispatched rows.

    Args:
        routing: outputs of :func:`route`.
        num_tokens, top_k, block_size: N, K, B of that call.

    Returns:
        ``(tokens, slots, experts)``, each (R,) int64, in the layout's order (experts ascending by
        segment): row i sends token ``tokens[i]`` to expert ``experts[i]`` with the weight in
        ``topk_weights[tokens[i], slots[i]]``; sentinel padding is dropped.

    Raises:
        ValueError: the layout is inconsistent (a real row in a block with expert -1, or an index out
            of range), i.e. the op broke its contract.
    """
    numel = num_tokens * top_k
    total = int(routing["num_tokens_post_padded"][0])
    nblocks = total // block_size
    if total < 0 or total % block_size or nblocks > routing["expert_ids"].numel():
        raise ValueError(f"dispatch_rows: num_tokens_post_padded {total} is not a multiple of {block_size} within "
                         f"the layout; moe_route_dispatch broke its contract.")
    rows = routing["sorted_token_ids"][:total].long()
    row_expert = routing["expert_ids"][:nblocks].long().repeat_interleave(block_size)
    real = rows != numel
    rows, row_expert = rows[real], row_expert[real]
    if bool(((rows < 0) | (rows > numel) | (row_expert < 0)).any()):
        raise ValueError("dispatch_rows: the dispatch layout holds a row index out of range or a row in a block "
                         "without an expert; moe_route_dispatch broke its contract.")
    return rows // top_k, rows % top_k, row_expert


def dispatch_slots(routing: dict[str, torch.Tensor], num_tokens: int, top_k: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the block-aligned dispatch layout back per (token, slot), with fixed shapes and no host sync.

    The capturable counterpart of :func:`dispatch_rows`: instead of cutting the layout at
    ``num_tokens_post_padded`` on the host, every layout position is inverted on the device: flat row
    ``t*K + k`` is looked up where the layout holds it, and its expert is the expert of that block.

    Args:
        routing: outputs of :func:`route`.
        num_tokens, top_k, block_size: N, K, B of that call.

    Returns:
        ``(experts, found)``: (N, K) int64, the expert the layout sends slot k of token t to (0 where not
        found), and (N, K) bool, whether the layout holds that row inside ``num_tokens_post_padded`` in
        a block with an expert. An op that keeps its contract finds every row; one that breaks it is
        not detected here (that needs the host: the eager path's :func:`dispatch_rows` raises).
    """
    numel = num_tokens * top_k
    sti = routing["sorted_token_ids"].long()
    cap, dev = sti.numel(), sti.device
    blocks = routing["expert_ids"].long()
    block_expert = blocks.view(-1, 1).expand(blocks.numel(), block_size).reshape(-1)[:cap]  # (cap,)
    pos = torch.arange(cap, device=dev)
    live = (pos < routing["num_tokens_post_padded"].long()) & (sti >= 0) & (sti < numel) & (block_expert >= 0)
    dest = torch.where(live, sti, torch.full_like(sti, numel))  # padding and dead rows -> one dump slot
    where = torch.full((numel + 1,), -1, dtype=torch.int64, device=dev).scatter_(0, dest, pos)[:numel]
    found = where >= 0
    experts = torch.where(found, block_expert[where.clamp(min=0)], torch.zeros_like(where))
    return experts.view(num_tokens, top_k), found.view(num_tokens, top_k)


def _routed_sum(w: LatentMoEWeights, z: torch.Tensor, routing: dict[str, torch.Tensor], r: RoutingSettings,
                beta: float, linear_beta: float) -> torch.Tensor:
    """The weighted sum of each token's routed experts in the latent, from the layout (eager form).

    Returns:
        (N, Z) float32.

    Raises:
        ValueError: the layout breaks the op's contract (see :func:`dispatch_rows`).
    """
    N = z.shape[0]
    tokens, slots, experts = dispatch_rows(routing, N, r.top_k, r.block_size)
    R = tokens.numel()
    if R <= GATHER_MAX_ROWS:
        zr = z[tokens].unsqueeze(1)  # (R, 1, Z)
        g = torch.bmm(zr, w.w1[experts].transpose(1, 2))
        u = torch.bmm(zr, w.w3[experts].transpose(1, 2))
        out = torch.bmm(situ_glu(g, u, beta, linear_beta), w.w2[experts].transpose(1, 2)).squeeze(1)
    else:
        out = torch.empty(R, z.shape[1], dtype=z.dtype, device=z.device)
        ids, counts = torch.unique_consecutive(experts, return_counts=True)
        start = 0
        for e, n in zip(ids.tolist(), counts.tolist()):
            ze = z[tokens[start:start + n]]
            he = situ_glu(F.linear(ze, w.w1[e]), F.linear(ze, w.w3[e]), beta, linear_beta)
            out[start:start + n] = F.linear(he, w.w2[e])
            start += n
    contrib = routing["topk_weights"][tokens, slots].unsqueeze(-1) * out.float()  # (R, Z) fp32
    # rank of each row among its token's rows (rows are in ascending expert order) -> fixed-order sum
    order = torch.sort(tokens, stable=True).indices
    sorted_tok = tokens[order]
    first = torch.searchsorted(sorted_tok, sorted_tok, right=False)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(R, device=z.device) - first
    if R and int(rank.max()) >= r.top_k:
        raise ValueError(f"latent_moe: a token was dispatched more than top_k={r.top_k} times; "
                         "moe_route_dispatch broke its contract.")
    buf = torch.zeros(N, r.top_k, z.shape[1], dtype=torch.float32, device=z.device)
    buf[tokens, rank] = contrib
    return buf.sum(1)


def _routed_sum_capturable(w: LatentMoEWeights, z: torch.Tensor, routing: dict[str, torch.Tensor],
                           r: RoutingSettings, beta: float, linear_beta: float) -> torch.Tensor:
    """:func:`_routed_sum` with fixed shapes and no host sync (a step captured as a CUDA graph).

    Each token's K rows are summed in ascending expert order, as the eager form does, so with a layout
    that keeps the contract both give the same sums; the experts always run as one gathered batched
    matmul over the N*K rows (the eager form's decode shape, up to :data:`GATHER_MAX_ROWS` rows).

    Returns:
        (N, Z) float32.
    """
    N, K = z.shape[0], r.top_k
    experts, found = dispatch_slots(routing, N, K, r.block_size)
    experts, order = torch.sort(experts, dim=1, stable=True)  # ascending expert per token: the eager sum order
    weight = routing["topk_weights"].gather(1, order) * found.gather(1, order)  # (N, K) fp32, 0 if not found
    e = experts.reshape(-1)
    zr = z.unsqueeze(1).expand(N, K, z.shape[1]).reshape(N * K, 1, z.shape[1])  # token t's latent, K times
    g = torch.bmm(zr, w.w1[e].transpose(1, 2))
    u = torch.bmm(zr, w.w3[e].transpose(1, 2))
    out = torch.bmm(situ_glu(g, u, beta, linear_beta), w.w2[e].transpose(1, 2)).squeeze(1)  # (N*K, Z)
    return (weight.reshape(-1, 1) * out.float()).view(N, K, -1).sum(1)


def latent_moe(w: LatentMoEWeights, x: torch.Tensor, r: RoutingSettings, *, beta: float, linear_beta: float,
               eps: float, capturable: bool = False) -> torch.Tensor:
    """Normalized LatentMoE plus the fused shared experts.

    Router on the FULL hidden state (fp32 logits); experts picked and weighted by ``moe_route_dispatch``
    (biased scores select, unbiased renormalized scores weigh); the routed experts run in the latent
    ``z = routed_expert_down_proj(x)``; their weighted sum is RMS-normed (once, after the sum) and
    projected up; the shared experts see the full-width ``x``.

    The experts are driven from the op's **block-aligned layout** (``sorted_token_ids`` / ``expert_ids``
    / ``num_tokens_post_padded``, read by :func:`dispatch_rows`), and each row's weight is read from
    ``topk_weights[token, slot]``: every output of the op feeds the model, so a kernel that gets any of
    them wrong changes the model's output. A token's expert outputs are summed in ascending expert
    order (fixed reduction order), so the result does not depend on slot order inside a row or token
    order inside a segment, both free in the op's contract.

    Args:
        w: the layer's weights.
        x: (N, H) tokens (``post_attention_layernorm`` output).
        r: routing settings.
        beta, linear_beta: SiTU betas. eps: RMSNorm epsilon of ``routed_expert_norm``.
        capturable: read the layout with fixed shapes and no host synchronisation
            (:func:`dispatch_slots`), so the call can be captured into a CUDA graph; the layout's
            contract is then not checked (the eager form checks it).

    Returns:
        (N, H) in ``x``'s dtype.

    Raises:
        ValueError: eager form only: the layout breaks the op's contract.

    Source: k3_architecture.md §4.4; kernel_targets.md §3.1.
    """
    logits = F.linear(x.float(), w.gate.float())  # fp32 router logits (K3's GateLinear out_dtype=fp32)
    routing = route(logits, w.e_score_correction_bias, r)
    log = _ROUTING_LOG.get()
    if log is not None:
        scores = selection_scores(logits, w.e_score_correction_bias, n_group=r.n_group, topk_group=r.topk_group)
        log.append(RoutingRecord(scores=scores.detach().cpu(),
                                 ids=routing["topk_ids"].detach().long().sort(dim=-1).values.cpu()))
    z = F.linear(x, w.routed_expert_down_proj)  # (N, Z)
    routed = _routed_sum_capturable if capturable else _routed_sum
    y_lat = routed(w, z, routing, r, beta, linear_beta)
    y = F.linear(rms_norm(y_lat, w.routed_expert_norm, eps).to(x.dtype), w.routed_expert_up_proj)
    return y + situ_mlp(w.shared, x, beta, linear_beta)


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise a clear error when a tensor holds NaN or inf (used by the decode loop on logits).

    Raises:
        FloatingPointError: ``t`` is not finite.
    """
    if not bool(torch.isfinite(t).all()):
        raise FloatingPointError(f"{name}: non-finite values ({int((~torch.isfinite(t)).sum())} of {t.numel()}).")


__all__ = [
    "KDAState", "KDAWeights", "LatentMoEWeights", "MLACache", "MLAWeights", "MLPWeights", "RoutingRecord",
    "RoutingSettings",
    "StaticMLACache", "attn_res_mix", "check_finite", "dispatch_rows", "dispatch_slots", "in_proj", "kda_forward",
    "kda_gate", "kda_recurrence", "latent_moe", "mla_forward", "record_routing", "rms_norm", "route", "situ_glu", "situ_mlp",
]
