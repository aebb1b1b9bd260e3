"""The real Kimi K3 config format (``kimi_k3`` with a ``kimi_linear`` text_config), parsed and validated.

``K3HFConfig`` is the whole ``config.json``; ``K3TextConfig`` its ``text_config`` (every field the
model reads, plus HF boilerplate tolerated and kept). Validation checks what the model relies on:
the 1-indexed KDA / full-attention layer lists partition ``1..num_hidden_layers``; the activation is
SiTU; routing is sigmoid + ``noaux_tc`` with one group; MLA is NoPE with an output gate; KDA uses the
bounded full-rank gate. :func:`k3_mini_hf_config` is K3-mini as ``config.json``.

Source: shared/reference/k3_architecture.md §1 (config.json, 1-indexed layer lists), §3 (layer plan),
§9 (K3-mini); issue 6 (MLA keeps kv_lora_rank 512 and the 64-wide rope slice).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from k3_model.config import K3Config, K3ConfigError


class _Cfg(BaseModel):
    # HF configs carry boilerplate (top_k, max_length, ...): keep it, never reject it.
    model_config = ConfigDict(frozen=True, extra="allow")


class LinearAttnConfig(_Cfg):
    """``text_config.linear_attn_config``: where KDA runs and its shapes.

    Attributes:
        full_attn_layers: 1-indexed layers running gated NoPE MLA (K3: every 4th plus the last).
        kda_layers: 1-indexed layers running KDA (all others).
        num_heads: KDA heads (= MLA heads in K3: 96).
        head_dim: KDA key = value width d (128 in K3).
        short_conv_kernel_size: causal depthwise conv width (4).
        gate_lower_bound: bounded decay gate, g in (lower_bound, 0) per step (-5.0).
        use_full_rank_gate: full-rank sigmoid output gate ``g_proj`` (True in K3).
    """

    full_attn_layers: tuple[int, ...]
    kda_layers: tuple[int, ...]
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    short_conv_kernel_size: int = Field(default=4, ge=1)
    gate_lower_bound: float = Field(default=-5.0, lt=0)
    use_full_rank_gate: bool = True


class K3TextConfig(_Cfg):
    """``text_config`` of a ``kimi_k3`` checkpoint (``model_type: kimi_linear``).

    Units: widths in elements; ``*_beta`` dimensionless; ``rms_norm_eps`` absolute.
    See k3_architecture.md §1 for K3's values and §4 for what each field does.
    """

    model_type: Literal["kimi_linear"] = "kimi_linear"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    hidden_act: str = "situ"
    activation_situ_beta: float = Field(default=4.0, gt=0)
    activation_situ_linear_beta: float = Field(default=25.0, gt=0)
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    initializer_range: float = Field(default=0.02, gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    attn_res_block_size: int = Field(gt=0)
    linear_attn_config: LinearAttnConfig
    q_lora_rank: int = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    first_k_dense_replace: int = Field(default=1, ge=0)
    moe_layer_freq: int = Field(default=1, gt=0)
    num_experts: int = Field(gt=0)
    num_experts_per_token: int = Field(gt=0)
    num_shared_experts: int = Field(ge=0)
    moe_intermediate_size: int = Field(gt=0)
    routed_expert_hidden_size: int = Field(gt=0)
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    use_grouped_topk: bool = True
    num_expert_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    topk_method: str = "noaux_tc"
    num_nextn_predict_layers: int = Field(default=0, ge=0)
    quantization_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> K3TextConfig:
        la, L = self.linear_attn_config, self.num_hidden_layers
        full, kda = list(la.full_attn_layers), list(la.kda_layers)
        if sorted(full + kda) != list(range(1, L + 1)):
            raise ValueError(
                f"linear_attn_config.full_attn_layers {full} and kda_layers {kda} must partition the 1-indexed "
                f"layers 1..{L} (each layer exactly once)"
            )
        checks = (
            (self.hidden_act == "situ", f"hidden_act must be 'situ' (SiTU-GLU in every FFN); got {self.hidden_act!r}"),
            (self.moe_router_activation_func == "sigmoid",
             f"moe_router_activation_func must be 'sigmoid'; got {self.moe_router_activation_func!r}"),
            (self.topk_method == "noaux_tc", f"topk_method must be 'noaux_tc'; got {self.topk_method!r}"),
            (self.mla_use_nope, "mla_use_nope must be true (K3's MLA applies no rotary embedding)"),
            (self.mla_use_output_gate, "mla_use_output_gate must be true (K3's MLA has a sigmoid output gate)"),
            (la.use_full_rank_gate, "linear_attn_config.use_full_rank_gate must be true (K3's KDA output gate)"),
            (self.latent_moe_use_norm, "latent_moe_use_norm must be true (Normalized LatentMoE)"),
            (self.num_key_value_heads == self.num_attention_heads,
             f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
             f"({self.num_attention_heads}) (MLA expands to full heads)"),
            (la.num_heads == self.num_attention_heads,
             f"linear_attn_config.num_heads ({la.num_heads}) must equal num_attention_heads "
             f"({self.num_attention_heads}) (KDA and MLA share the head count in K3)"),
            (self.num_experts_per_token <= self.num_experts,
             f"num_experts_per_token ({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})"),
            (self.num_experts % self.num_expert_group == 0 and self.topk_group <= self.num_expert_group,
             f"num_experts ({self.num_experts}), num_expert_group ({self.num_expert_group}) and topk_group "
             f"({self.topk_group}) are inconsistent"),
            (self.first_k_dense_replace <= L,
             f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds num_hidden_layers ({L})"),
            (self.moe_layer_freq == 1, f"moe_layer_freq must be 1 (every layer after the dense ones is MoE); "
                                       f"got {self.moe_layer_freq}"),
            (self.num_nextn_predict_layers == 0, "num_nextn_predict_layers must be 0 (K3 ships no MTP layers)"),
            (not self.tie_word_embeddings, "tie_word_embeddings must be false (K3's lm_head is untied)"),
        )
        for ok, why in checks:
            if not ok:
                raise ValueError(why)
        return self

    # ---- derived facts the model uses -------------------------------------------------------

    def is_mla_layer(self, i: int) -> bool:
        """Whether 0-based layer ``i`` runs gated NoPE MLA (else KDA). Source: §1 (1-indexed lists)."""
        return (i + 1) in self.linear_attn_config.full_attn_layers

    def is_dense_layer(self, i: int) -> bool:
        """Whether 0-based layer ``i`` uses the dense SiTU MLP (else LatentMoE). Source: §3."""
        return i < self.first_k_dense_replace

    def writes_attn_res_block(self, i: int) -> bool:
        """Whether layer ``i`` stores the running prefix as a new AttnRes block. Source: §4.1."""
        return i % self.attn_res_block_size == 0

    @property
    def kda_proj_size(self) -> int:
        """P = KDA heads x head_dim (elements)."""
        return self.linear_attn_config.num_heads * self.linear_attn_config.head_dim

    @property
    def mla_qk_head_dim(self) -> int:
        """nope + rope width of one MLA query/key head (elements); the score scale is its -1/2 power."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def routing_config(self, name: str = "kimi_k3", **overrides: Any) -> K3Config:
        """The :class:`k3_model.config.K3Config` the MoE routing op reads (kept for the moe_dispatch task)."""
        return K3Config.from_hf(self.model_dump(), name=name, **overrides)


class K3HFConfig(_Cfg):
    """A whole ``config.json`` of model_type ``kimi_k3`` (the language model part).

    Attributes:
        model_type: ``kimi_k3``.
        architectures: e.g. ``["KimiK3ForConditionalGeneration"]``.
        bos_token_id, eos_token_id, pad_token_id: special token ids (K3: V-256, V-254, V-1).
        text_config: the ``kimi_linear`` text config.
        vision_config: kept as read; K3-mini has none (out of scope, §1).
    """

    model_type: Literal["kimi_k3"] = "kimi_k3"
    architectures: tuple[str, ...] = ("KimiK3ForConditionalGeneration",)
    bos_token_id: int = Field(ge=0)
    eos_token_id: int = Field(ge=0)
    pad_token_id: int = Field(ge=0)
    tie_word_embeddings: bool = False
    text_config: K3TextConfig
    vision_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _ids_in_vocab(self) -> K3HFConfig:
        V = self.text_config.vocab_size
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, name) >= V:
                raise ValueError(f"{name} ({getattr(self, name)}) must be below text_config.vocab_size ({V})")
        return self


def parse_hf_config(data: Mapping[str, Any], *, where: str = "config.json") -> K3HFConfig:
    """Validate a parsed ``config.json`` of a ``kimi_k3`` checkpoint.

    Args:
        data: the JSON object (top level, with ``text_config``).
        where: file name used in error messages.

    Raises:
        K3ConfigError: a field is missing, has the wrong type, or breaks a K3 invariant; the message
            names the file, the field, what was expected and what was found.
    """
    if data.get("model_type") != "kimi_k3":
        raise K3ConfigError(
            f"K3 config ({where}): field 'model_type' must be 'kimi_k3'; got {data.get('model_type')!r}. "
            "Pass the top-level config.json of a Kimi K3 checkpoint."
        )
    try:
        return K3HFConfig.model_validate(dict(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = "nothing" if err["type"] == "missing" else repr(err.get("input"))[:120]
        raise K3ConfigError(
            f"K3 config ({where}): field '{loc}': {err['msg'].removeprefix('Value error, ')}; got {got}. "
            "Fix config.json (see shared/reference/k3_architecture.md §1)."
        ) from None


def load_hf_config(path: str | Path) -> K3HFConfig:
    """Read and validate ``config.json`` (a file, or a directory holding one).

    Raises:
        K3ConfigError: the file is missing, not JSON, or invalid (see :func:`parse_hf_config`).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise K3ConfigError(f"K3 config: {p} does not exist; generate a checkpoint with `workbench model generate`.")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise K3ConfigError(f"K3 config ({p}): not valid JSON ({exc}).") from None
    return parse_hf_config(data, where=str(p))


def k3_mini_hf_config() -> dict[str, Any]:
    """K3-mini as ``config.json`` (a fresh dict each call).

    Every K3 feature is kept: 9 layers with KDA at 0-based 0,1,2,4,5,6 and MLA at 3,7,8 (the double
    trailing MLA, like K3's 91,92); layer 0 dense; AttnRes blocks of 4 (writes at 0,4,8: a partial
    final block, 4 sources at the output mix); LatentMoE 32 experts top-4 in a 128-wide latent with
    2 fused shared experts; SiTU-GLU everywhere; token ids offset like K3's (bos V-256, eos V-254,
    pad V-1).

    **Differs from §9 on purpose**: MLA uses ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (K3's own
    values) instead of §9's 64 + 16, because issue 6 requires it: vLLM's CPU MLA backends (AMX_MLA,
    CPU_MLA) accept only a 512 + 64 = 576-wide latent cache. Experts are unquantized (§9's
    "bf16-experts variant", the numerics oracle): no ``quantization_config``.

    Source: k3_architecture.md §9; issue 6; shared/reference/vllm_cpu.md ("MLA attention backends only
    accept kv_lora_rank+rope = 576").
    """
    V = 4096
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": V - 256, "eos_token_id": V - 254, "pad_token_id": V - 1,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "text_config": {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "vocab_size": V, "hidden_size": 256, "num_hidden_layers": 9,
            "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 1024, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "rms_norm_eps": 1e-05, "initializer_range": 0.02, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "use_cache": True,
            "attn_res_block_size": 4,
            "linear_attn_config": {
                "full_attn_layers": [4, 8, 9], "kda_layers": [1, 2, 3, 5, 6, 7],
                "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0, "use_full_rank_gate": True},
            "q_lora_rank": 96, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
            "v_head_dim": 32, "mla_use_nope": True, "mla_use_output_gate": True,
            "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "num_experts": 32, "num_experts_per_token": 4, "num_shared_experts": 2,
            "moe_intermediate_size": 96, "routed_expert_hidden_size": 128, "latent_moe_use_norm": True,
            "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
            "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
        },
    }


def k3_real_hf_config() -> dict[str, Any]:
    """The real Kimi K3 ``config.json`` language-model fields (k3_architecture.md §1, verbatim values).

    Used to check that the parser accepts the real format; the quantization config is kept as read.
    """
    full = [4 * j for j in range(1, 24)] + [93]
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "media_placeholder_token_id": 163605, "tie_word_embeddings": False, "dtype": "bfloat16",
        "text_config": {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
            "num_attention_heads": 96, "num_key_value_heads": 96, "intermediate_size": 33792,
            "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "rms_norm_eps": 1e-05, "initializer_range": 0.02, "max_position_embeddings": 1048576,
            "tie_word_embeddings": False, "use_cache": True, "attn_res_block_size": 12,
            "linear_attn_config": {
                "full_attn_layers": full, "kda_layers": [i for i in range(1, 94) if i not in full],
                "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0, "use_full_rank_gate": True},
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16,
            "num_shared_experts": 2, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
            "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
            "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
            "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
        },
    }
