"""The K3 model (K3-mini and any ``kimi_k3`` config): weights, caches and one forward step.

``K3Model(config, tensors)`` holds the weights (HF checkpoint names, see :func:`weight_specs`) in a
compute dtype; ``model.new_cache(B)`` allocates the per-layer decode state (KDA recurrent + conv
state, MLA latent cache); ``model.forward(tokens, cache)`` runs T new tokens per sequence through
the layers (a prefill chunk or one decode step) and returns fp32 logits. The caller declares the
batch kind with :func:`k3_model.dispatch.forward_context` (the decode loop in
:mod:`k3_model.decode` does), so the dispatcher can pick the latency-specialized MoE routing kernel
on decode steps only.

Weight names (all under ``model.`` except ``lm_head.weight``) follow the K3 checkpoint inventory of
k3_architecture.md §2 with the ``KimiLinearForCausalLM`` prefix (``model.layers.{i}...``); experts
are unquantized (``experts.{e}.w{1,2,3}.weight``). Stored dtypes follow §2: bf16, except the KDA
conv taps, ``A_log``, ``dt_bias``, ``o_norm`` and the router's ``e_score_correction_bias`` in fp32.

Source: shared/reference/k3_architecture.md §2 (weights), §3 (layer plan), §4 (forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from k3_model.hf_config import K3HFConfig, K3TextConfig
from k3_model.layers import (
    KDAState,
    KDAWeights,
    LatentMoEWeights,
    MLACache,
    MLAWeights,
    MLPWeights,
    RoutingSettings,
    StaticMLACache,
    attn_res_mix,
    kda_forward,
    latent_moe,
    mla_forward,
    rms_norm,
    situ_mlp,
)

DISPATCHED_OPS = ("moe_dispatch", "lse_merge", "kda_decode", "small_m_gemm")
"""Dispatcher ops the model calls (``k3_model.dispatch.select``): the MoE routing of every LatentMoE
layer, the split-KV LSE merge of every MLA decode step once the latent cache holds
``layers.SPLIT_KV_MIN_PAGES`` pages (the model eval's contexts always do), and the KDA step of every KDA
layer's decode step (one token per sequence; prefill chunks keep the token loop), and the attention input
projections of every decode step (``small_m_gemm``: KDA q/k/v/f_a/b, MLA q_a/kv_a/q_b; prefill keeps
``F.linear``). ``dspark_verify`` is called by the speculative decode loop
(:func:`k3_model.decode.generate_speculative`), not by the model: :data:`SPECULATIVE_OPS`. Other tasks'
ops are not called; the model-eval guard skips those tasks, and checks this list against the trace of
every run."""

SPECULATIVE_OPS = ("dspark_verify",)
"""Dispatcher ops the speculative decode loop (:func:`k3_model.decode.generate_speculative`) calls on the
model's logits: the draft verification of every verification step. The model-eval guard judges these
tasks in that loop (guards/model_eval.py, "Speculative decoding")."""

FP32_WEIGHTS = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
"""Name suffixes of tensors stored and used in float32 (k3_architecture.md §2)."""


class K3WeightsError(ValueError):
    """A checkpoint's tensors do not match the config (missing, unexpected, wrong shape)."""


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor: name, shape, stored dtype and the init draw (for random weights).

    Attributes:
        name: HF tensor name. shape: its shape. dtype: stored dtype.
        init: ``normal`` (mean 0), ``one_plus`` (1 + normal: norm weights), ``alog`` (normal on the
            first ``valid`` entries, zero padding after), ``zeros``.
        std: standard deviation of the draw.
        valid: entries of ``alog`` that are real (KDA heads).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str
    std: float
    valid: int = 0


def _alog_len(t: K3TextConfig) -> int:
    """Stored ``A_log`` length: padded to head_dim like K3's [128] for 96 heads (§2, §9)."""
    la = t.linear_attn_config
    return max(la.num_heads, la.head_dim)


def weight_specs(cfg: K3HFConfig) -> list[WeightSpec]:
    """Every tensor of a checkpoint for ``cfg``, in a fixed order (the random init draws in this order).

    Init scales keep activations O(1) with random weights: linear layers ``N(0, 1/fan_in)``, the
    lm_head ``N(0, 4/H)`` (logits of std ~2, so greedy choices are not near-ties), norm weights
    ``1 + N(0, 0.1^2)``, AttnRes projections ``N(0, 0.25/H)`` (mix logits of std ~0.5: a non-uniform
    mix), the router bias ``N(0, 0.1^2)``, KDA ``A_log`` ``N(0, 0.5^2)`` and ``dt_bias`` ``N(0, 1)``.

    Source: k3_architecture.md §2 (names, shapes, stored dtypes).
    """
    t = cfg.text_config
    H, V, la = t.hidden_size, t.vocab_size, t.linear_attn_config
    nh, d, P, C = la.num_heads, la.head_dim, t.kda_proj_size, la.short_conv_kernel_size
    bf, f32 = torch.bfloat16, torch.float32
    specs: list[WeightSpec] = []

    def lin(name: str, out_f: int, in_f: int, std: float | None = None) -> None:
        specs.append(WeightSpec(name, (out_f, in_f), bf, "normal", in_f ** -0.5 if std is None else std))

    def norm(name: str, n: int, dtype: torch.dtype = bf) -> None:
        specs.append(WeightSpec(name, (n,), dtype, "one_plus", 0.1))

    specs.append(WeightSpec("model.embed_tokens.weight", (V, H), bf, "normal", 1.0))
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", H)
        norm(p + "post_attention_layernorm.weight", H)
        norm(p + "self_attention_res_norm.weight", H)
        lin(p + "self_attention_res_proj.weight", 1, H, 0.5 * H ** -0.5)
        norm(p + "mlp_res_norm.weight", H)
        lin(p + "mlp_res_proj.weight", 1, H, 0.5 * H ** -0.5)
        a = p + "self_attn."
        if t.is_mla_layer(i):
            n, r, dv, L, qr = t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank, t.q_lora_rank
            lin(a + "q_a_proj.weight", qr, H)
            norm(a + "q_a_layernorm.weight", qr)
            lin(a + "q_b_proj.weight", nh * (n + r), qr)
            lin(a + "kv_a_proj_with_mqa.weight", L + r, H)
            norm(a + "kv_a_layernorm.weight", L)
            lin(a + "kv_b_proj.weight", nh * (n + dv), L)
            lin(a + "g_proj.weight", nh * dv, H)
            lin(a + "o_proj.weight", H, nh * dv)
        else:
            for x in "qkv":
                lin(a + f"{x}_proj.weight", P, H)
            for x in "qkv":
                specs.append(WeightSpec(a + f"{x}_conv1d.weight", (P, 1, C), f32, "normal", 0.5))
            lin(a + "f_a_proj.weight", d, H)
            lin(a + "f_b_proj.weight", P, d)
            specs.append(WeightSpec(a + "A_log", (_alog_len(t),), f32, "alog", 0.5, valid=nh))
            specs.append(WeightSpec(a + "dt_bias", (P,), f32, "normal", 1.0))
            lin(a + "b_proj.weight", nh, H)
            lin(a + "g_proj.weight", P, H)
            norm(a + "o_norm.weight", d, f32)
            lin(a + "o_proj.weight", H, P)
        if t.is_dense_layer(i):
            I = t.intermediate_size
            lin(p + "mlp.gate_proj.weight", I, H)
            lin(p + "mlp.up_proj.weight", I, H)
            lin(p + "mlp.down_proj.weight", H, I)
        else:
            m = p + "block_sparse_moe."
            E, Z, Fi, Fs = t.num_experts, t.routed_expert_hidden_size, t.moe_intermediate_size, \
                t.moe_intermediate_size * t.num_shared_experts
            lin(m + "gate.weight", E, H)
            specs.append(WeightSpec(m + "gate.e_score_correction_bias", (E,), f32, "normal", 0.1))
            lin(m + "routed_expert_down_proj.weight", Z, H)
            norm(m + "routed_expert_norm.weight", Z)
            lin(m + "routed_expert_up_proj.weight", H, Z)
            for e in range(E):
                lin(m + f"experts.{e}.w1.weight", Fi, Z)
                lin(m + f"experts.{e}.w3.weight", Fi, Z)
                lin(m + f"experts.{e}.w2.weight", Z, Fi)
            if Fs:
                lin(m + "shared_experts.gate_proj.weight", Fs, H)
                lin(m + "shared_experts.up_proj.weight", Fs, H)
                lin(m + "shared_experts.down_proj.weight", H, Fs)
    norm("model.norm.weight", H)
    norm("model.output_attn_res_norm.weight", H)
    lin("model.output_attn_res_proj.weight", 1, H, 0.5 * H ** -0.5)
    lin("lm_head.weight", V, H, 2.0 * H ** -0.5)
    return specs


def random_weights(cfg: K3HFConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for ``cfg`` with a fixed seed, in their stored dtypes, on the CPU.

    Deterministic: one ``torch.Generator`` seeded with ``seed`` draws the tensors in
    :func:`weight_specs` order (equal seeds give bit-equal tensors on every machine).

    Returns:
        name -> tensor (contiguous).
    """
    gen = torch.Generator().manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for s in weight_specs(cfg):
        if s.init == "zeros":
            x = torch.zeros(s.shape)
        else:
            x = torch.randn(s.shape, generator=gen) * s.std
            if s.init == "one_plus":
                x = x + 1.0
            elif s.init == "alog":
                x[s.valid:] = 0.0
        out[s.name] = x.to(s.dtype).contiguous()
    return out


def check_weights(cfg: K3HFConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    """Check that ``tensors`` holds exactly the checkpoint of ``cfg`` (names and shapes).

    Raises:
        K3WeightsError: a tensor is missing, unexpected or has the wrong shape (first few listed).
    """
    specs = {s.name: s for s in weight_specs(cfg)}
    missing = sorted(set(specs) - set(tensors))
    extra = sorted(set(tensors) - set(specs))
    bad = [f"{n}: expected {specs[n].shape}, got {tuple(tensors[n].shape)}"
           for n in specs if n in tensors and tuple(tensors[n].shape) != specs[n].shape]
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)})")
        if extra:
            parts.append(f"unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''} ({len(extra)})")
        if bad:
            parts.append(f"wrong shapes {bad[:3]}")
        raise K3WeightsError(f"K3 weights do not match the config: {'; '.join(parts)}. Regenerate the checkpoint "
                             "with `workbench model generate` or fix config.json.")


@dataclasses.dataclass
class LayerWeights:
    """One decoder layer: the AttnRes and pre-norm weights, the attention (KDA or MLA), the FFN."""

    index: int
    kind: str  # "kda" | "mla"
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    self_attention_res_norm: torch.Tensor
    self_attention_res_proj: torch.Tensor
    mlp_res_norm: torch.Tensor
    mlp_res_proj: torch.Tensor
    attn: KDAWeights | MLAWeights
    ffn: MLPWeights | LatentMoEWeights


@dataclasses.dataclass
class K3Cache:
    """Decode state of B sequences: one entry per layer (:class:`KDAState` or :class:`MLACache`).

    Attributes:
        layers: per-layer state, index = layer index (:class:`StaticMLACache` for MLA when ``static``).
        length: tokens processed per sequence so far, as the host counts forward calls (a replayed CUDA
            graph advances the device state only; a static cache's own count is each MLA layer's
            ``position``).
        static: fixed storage (:meth:`K3Model.new_static_cache`): a forward over it never synchronises
            with the host, so a decode step can be captured into a CUDA graph.
    """

    layers: list[KDAState | MLACache | StaticMLACache]
    length: int = 0
    static: bool = False


class K3Model:
    """K3 / K3-mini forward over explicit caches (see the module docstring).

    Args:
        config: a validated ``kimi_k3`` config.
        tensors: the checkpoint (names of :func:`weight_specs`).
        dtype: compute dtype of activations and bf16-stored weights (fp32 tensors stay fp32).
        device: where to run.

    Raises:
        K3WeightsError: the tensors do not match the config.
    """

    def __init__(self, config: K3HFConfig, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        check_weights(config, tensors)
        self.config, self.text = config, config.text_config
        self.dtype, self.device = dtype, torch.device(device)
        t = self.text

        def w(name: str) -> torch.Tensor:
            x = tensors[name]
            keep32 = name.endswith(FP32_WEIGHTS)
            return x.to(device=self.device, dtype=torch.float32 if keep32 else dtype).contiguous()

        self.embed_tokens = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.output_attn_res_norm = w("model.output_attn_res_norm.weight")
        self.output_attn_res_proj = w("model.output_attn_res_proj.weight")
        self.routing = RoutingSettings(top_k=t.num_experts_per_token, n_group=t.num_expert_group,
                                       topk_group=t.topk_group, renormalize=t.moe_renormalize,
                                       routed_scaling_factor=t.routed_scaling_factor)
        self.layers: list[LayerWeights] = []
        for i in range(t.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            if t.is_mla_layer(i):
                attn: KDAWeights | MLAWeights = MLAWeights(**{f.name: w(a + f.name + ".weight")
                                                               for f in dataclasses.fields(MLAWeights)})
            else:
                attn = KDAWeights(**{f.name: w(a + f.name + ("" if f.name in ("A_log", "dt_bias") else ".weight"))
                                     for f in dataclasses.fields(KDAWeights)})
            if t.is_dense_layer(i):
                ffn: MLPWeights | LatentMoEWeights = MLPWeights(
                    *(w(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")))
            else:
                m = p + "block_sparse_moe."
                E = t.num_experts
                ffn = LatentMoEWeights(
                    gate=w(m + "gate.weight"), e_score_correction_bias=w(m + "gate.e_score_correction_bias"),
                    routed_expert_down_proj=w(m + "routed_expert_down_proj.weight"),
                    routed_expert_norm=w(m + "routed_expert_norm.weight"),
                    routed_expert_up_proj=w(m + "routed_expert_up_proj.weight"),
                    w1=torch.stack([w(m + f"experts.{e}.w1.weight") for e in range(E)]),
                    w3=torch.stack([w(m + f"experts.{e}.w3.weight") for e in range(E)]),
                    w2=torch.stack([w(m + f"experts.{e}.w2.weight") for e in range(E)]),
                    shared=MLPWeights(*(w(m + f"shared_experts.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))),
                )
            self.layers.append(LayerWeights(
                i, "mla" if t.is_mla_layer(i) else "kda",
                *(w(p + f"{n}.weight") for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                                                 "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj")),
                attn=attn, ffn=ffn))

    # ---- caches ------------------------------------------------------------------------------

    def new_cache(self, batch: int, *, page_tokens: int = 64, max_tokens: int | None = None) -> K3Cache:
        """Fresh decode state for ``batch`` sequences.

        Args:
            batch: B sequences (all advance together).
            page_tokens: MLA cache growth unit (tokens).
            max_tokens: MLA cache limit (tokens); default ``max_position_embeddings``.
        """
        t, la = self.text, self.text.linear_attn_config
        limit = t.max_position_embeddings if max_tokens is None else max_tokens
        layers: list[KDAState | MLACache] = []
        for lw in self.layers:
            if lw.kind == "mla":
                layers.append(MLACache(batch, t.kv_lora_rank, t.qk_rope_head_dim, dtype=self.dtype, device=self.device,
                                       page_tokens=page_tokens, max_tokens=limit))
            else:
                layers.append(KDAState.zeros(batch, la.num_heads, la.head_dim, la.short_conv_kernel_size, self.device))
        return K3Cache(layers)

    def new_static_cache(self, batch: int, capacity: int) -> K3Cache:
        """Fresh decode state in fixed storage for a step captured as a CUDA graph (see :class:`K3Cache`).

        Args:
            batch: B sequences (all advance together).
            capacity: MLA slots per sequence (tokens): the longest context the steps reach. Attention
                runs over all of them (masked), so a larger capacity costs time at every step.

        Raises:
            ValueError: ``capacity`` below 1 or above ``max_position_embeddings``.
        """
        t, la = self.text, self.text.linear_attn_config
        if not 1 <= capacity <= t.max_position_embeddings:
            raise ValueError(f"K3Model.new_static_cache: capacity {capacity} must lie in [1, max_position_embeddings "
                             f"{t.max_position_embeddings}]; raise max_position_embeddings in the config for longer contexts.")
        layers: list[KDAState | MLACache | StaticMLACache] = []
        for lw in self.layers:
            if lw.kind == "mla":
                layers.append(StaticMLACache(batch, t.kv_lora_rank, t.qk_rope_head_dim, capacity=capacity,
                                             dtype=self.dtype, device=self.device))
            else:
                layers.append(KDAState.zeros(batch, la.num_heads, la.head_dim, la.short_conv_kernel_size, self.device))
        return K3Cache(layers, static=True)

    # ---- forward -----------------------------------------------------------------------------

    def ffn(self, lw: LayerWeights, x: torch.Tensor, *, capturable: bool = False) -> torch.Tensor:
        """The layer's FFN on (N, H) rows: dense SiTU MLP (layer 0) or LatentMoE (``capturable``: its
        sync-free form, see :func:`k3_model.layers.latent_moe`)."""
        t = self.text
        b1, b2 = t.activation_situ_beta, t.activation_situ_linear_beta
        if isinstance(lw.ffn, MLPWeights):
            return situ_mlp(lw.ffn, x, b1, b2)
        return latent_moe(lw.ffn, x, self.routing, beta=b1, linear_beta=b2, eps=t.rms_norm_eps, capturable=capturable)

    def attention(self, lw: LayerWeights, x: torch.Tensor, state: KDAState | MLACache | StaticMLACache, *,
                  absorbed: bool) -> torch.Tensor:
        """The layer's attention on (B, T, H) sequences with its state. A KDA state that tracks positions
        (a speculative verification step, :meth:`KDAState.track_positions`) runs the T tokens one at a time,
        each a decode step of the ``kda_decode`` op, and keeps the state after each."""
        t, la = self.text, self.text.linear_attn_config
        if lw.kind == "kda":
            run = lambda xs: kda_forward(lw.attn, xs, state, heads=la.num_heads, head_dim=la.head_dim,  # noqa: E731
                                         lower_bound=la.gate_lower_bound, eps=t.rms_norm_eps)
            if getattr(state, "positions", None) is None:
                return run(x)
            outs = []
            for i in range(x.shape[1]):
                outs.append(run(x[:, i:i + 1].contiguous()))
                state.positions.append((state.recurrent.clone(), state.conv.clone()))
            return torch.cat(outs, dim=1)
        return mla_forward(lw.attn, x, state, heads=t.num_attention_heads, nope=t.qk_nope_head_dim,
                           rope=t.qk_rope_head_dim, v_dim=t.v_head_dim, kv_lora_rank=t.kv_lora_rank,
                           eps=t.rms_norm_eps, absorbed=absorbed)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: K3Cache, *, mla_absorbed: bool | None = None) -> torch.Tensor:
        """Run T new tokens of each of B sequences; updates ``cache``.

        The residual stream is AttnRes (§4.1): per token, stored block vectors plus a running prefix;
        each sublayer's input is a depth-softmax mix of them; layers ``i % attn_res_block_size == 0``
        store the prefix as a new block before their attention.

        Args:
            tokens: (B, T) int64 token ids (T = 1 for a decode step).
            cache: the sequences' state (B must match). A static cache (:meth:`new_static_cache`) skips
                the host-side checks of the token ids and the length (they would synchronise); the
                caller vouches for them (the decode step feeds back its own argmax).
            mla_absorbed: MLA form; default absorbed for T == 1 (decode), expanded otherwise (prefill).

        Returns:
            (B, T, V) float32 logits.

        Raises:
            ValueError: token ids out of range, or the cache's batch does not match.

        Source: k3_architecture.md §4.1 (wiring), §4.6 (final norm and head).
        """
        return self.forward_groups([(tokens, cache)], mla_absorbed=mla_absorbed)[0]

    @torch.no_grad()
    def forward_groups(self, groups: Sequence[tuple[torch.Tensor, K3Cache]], *,
                       mla_absorbed: bool | None = None, capturable: bool = False) -> list[torch.Tensor]:
        """One forward over several groups of sequences, each with its own token count and cache.

        A mixed step (one sequence prefilling a chunk while others decode, as a serving engine's chunked
        prefill batches them): the rows of every group are flattened into one (N, H) batch, N = sum of
        B_g * T_g, for every layer except attention, which runs per group over the group's cache. So the
        MoE routing op sees all N tokens in one call, as it does in a serving engine. With one group this
        is :meth:`forward`.

        Args:
            groups: ``(tokens (B_g, T_g) int64, cache)`` per group; the caches are distinct.
            mla_absorbed: MLA form for every group; default per group, absorbed when T_g == 1.
            capturable: no host synchronisation (a forward captured as a CUDA graph over ordinary caches whose
                storage holds the step's tokens): the host checks of the token ids and the context are skipped
                (the caller makes them once) and the MoE reads its layout with fixed shapes, as with a static
                cache.

        Returns:
            (B_g, T_g, V) float32 logits per group, in order.

        Raises:
            ValueError: no group, a static cache together with other groups, token ids out of range,
                or a context beyond ``max_position_embeddings``.

        Source: k3_architecture.md §4.1 (wiring), §4.6 (final norm and head).
        """
        t = self.text
        if not groups:
            raise ValueError("K3Model.forward_groups: give at least one (tokens, cache) group.")
        if len(groups) > 1 and any(c.static for _, c in groups):
            raise ValueError("K3Model.forward_groups: a static cache (a captured decode step) runs alone; "
                             "pass it to forward().")
        sizes = [(int(tok.shape[0]), int(tok.shape[1])) for tok, _ in groups]
        static = groups[0][1].static
        capturable = capturable or static
        for tok, cache in groups:
            if capturable:
                continue  # host checks would synchronise inside a captured step (see forward)
            if int(tok.min()) < 0 or int(tok.max()) >= t.vocab_size:
                raise ValueError(f"K3Model.forward: token ids must lie in [0, {t.vocab_size}); got "
                                 f"[{int(tok.min())}, {int(tok.max())}].")
            if cache.length + tok.shape[1] > t.max_position_embeddings:
                raise ValueError(f"K3Model.forward: {cache.length + tok.shape[1]} tokens exceed max_position_embeddings "
                                 f"{t.max_position_embeddings}.")
        absorbed = [(T == 1) if mla_absorbed is None else mla_absorbed for _, T in sizes]
        eps = t.rms_norm_eps
        rows = [B * T for B, T in sizes]
        ids = [tok.reshape(-1).to(self.device) for tok, _ in groups]
        h0 = self.embed_tokens[ids[0] if len(ids) == 1 else torch.cat(ids)]  # (N, H)
        blocks: list[torch.Tensor] = []
        prefix: torch.Tensor | None = h0
        for lw in self.layers:
            a_in = attn_res_mix(torch.stack([*blocks, prefix], 1), lw.self_attention_res_norm,
                                lw.self_attention_res_proj, eps)
            if t.writes_attn_res_block(lw.index):
                blocks.append(prefix)
                prefix = None
            a_norm = rms_norm(a_in, lw.input_layernorm, eps)
            parts, start = [], 0
            for (_, cache), (B, T), n, ab in zip(groups, sizes, rows, absorbed):
                parts.append(self.attention(lw, a_norm[start:start + n].view(B, T, -1), cache.layers[lw.index],
                                            absorbed=ab).reshape(n, -1))
                start += n
            y = parts[0] if len(parts) == 1 else torch.cat(parts)
            prefix = y if prefix is None else prefix + y
            m_in = attn_res_mix(torch.stack([*blocks, prefix], 1), lw.mlp_res_norm, lw.mlp_res_proj, eps)
            prefix = prefix + self.ffn(lw, rms_norm(m_in, lw.post_attention_layernorm, eps), capturable=capturable)
        out = attn_res_mix(torch.stack([*blocks, prefix], 1), self.output_attn_res_norm, self.output_attn_res_proj, eps)
        logits = F.linear(rms_norm(out, self.norm, eps), self.lm_head).float()
        for (_, cache), (_, T) in zip(groups, sizes):
            cache.length += T
        return [lg.view(B, T, -1) for lg, (B, T) in zip(logits.split(rows), sizes)]

    def num_parameters(self) -> int:
        """Parameters of the checkpoint (elements)."""
        return sum(int(torch.tensor(s.shape).prod()) for s in weight_specs(self.config))
