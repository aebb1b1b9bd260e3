"""K3 configuration: the fields the K3 ops read, for the real Kimi K3 and for K3-mini.

Source: shared/reference/k3_architecture.md and shared/reference/kernel_targets.md "Model facts"
(K3 text_config: hidden 7168, 896 routed experts, top-16, n_group 1, topk_group 1, sigmoid scoring,
noaux_tc with e_score_correction_bias, renormalize, routed_scaling_factor 1.0, rms_norm_eps 1e-5;
K3-mini §9: hidden 256, 32 experts, top-4).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DECODE_BACKENDS = ("standard", "latency_specialized")
"""Values of the ``decode_backend`` switch: the standard path, or latency-specialized kernels in scope."""


class K3ConfigError(ValueError):
    """A K3 config is malformed (field, expected, got)."""


class K3Config(BaseModel):
    """The K3 text config fields the ops use.

    Attributes:
        name: a label for logs (``"kimi_k3"``, ``"k3_mini"``).
        hidden_size: model width H (elements).
        num_experts: routed experts E.
        num_experts_per_token: top-k K.
        n_group: expert groups for group-limited top-k (1 = no grouping, as in K3).
        topk_group: groups kept per token.
        routed_scaling_factor: multiplies the renormalized routing weights (dimensionless).
        renormalize: renormalize the selected unbiased scores to sum to 1.
        rms_norm_eps: RMSNorm epsilon.
        decode_backend: ``standard`` or ``latency_specialized`` (the opt-in switch).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    hidden_size: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    num_experts_per_token: int = Field(gt=0)
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    renormalize: bool = True
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    decode_backend: Literal["standard", "latency_specialized"] = "standard"

    @model_validator(mode="after")
    def _consistent(self) -> K3Config:
        if self.num_experts % self.n_group:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        per_group = self.num_experts // self.n_group
        if self.num_experts_per_token > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_token ({self.num_experts_per_token}) exceeds the experts in the kept "
                f"groups ({self.topk_group} x {per_group})"
            )
        return self

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, name: str = "kimi_k3", **overrides: Any) -> K3Config:
        """Read the routing fields from a HF ``kimi_k3`` config (``text_config`` of model_type kimi_linear).

        Args:
            config: the parsed config.json (top level, with ``text_config``) or the text config itself.
            name: label for logs.
            overrides: fields to set explicitly (e.g. ``decode_backend``).

        Raises:
            K3ConfigError: a required key is missing or a value is invalid.
        """
        text = config.get("text_config", config)
        keymap = {
            "hidden_size": "hidden_size",
            "num_experts": "num_experts",
            "num_experts_per_token": "num_experts_per_token",
            "n_group": "num_expert_group",
            "topk_group": "topk_group",
            "routed_scaling_factor": "routed_scaling_factor",
            "renormalize": "moe_renormalize",
            "rms_norm_eps": "rms_norm_eps",
        }
        values: dict[str, Any] = {"name": name}
        for field, key in keymap.items():
            if key in text:
                values[field] = text[key]
            elif field in ("hidden_size", "num_experts", "num_experts_per_token"):
                raise K3ConfigError(
                    f"K3 config {name!r}: text_config lacks {key!r} (needed for {field}); "
                    "expected a kimi_linear text config."
                )
        if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise K3ConfigError(
                f"K3 config {name!r}: moe_router_activation_func is "
                f"{text['moe_router_activation_func']!r}; K3 routing is sigmoid-scored."
            )
        values.update(overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise K3ConfigError(f"K3 config {name!r}: {exc.errors()[0]['msg']}") from None


K3_REAL = K3Config(
    name="kimi_k3",
    hidden_size=7168,
    num_experts=896,
    num_experts_per_token=16,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
)
"""The real Kimi K3 routing config (source: kernel_targets.md "Model facts")."""

K3_MINI = K3Config(
    name="k3_mini",
    hidden_size=256,
    num_experts=32,
    num_experts_per_token=4,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
)
"""K3-mini, the CPU test model (source: kernel_targets.md §9)."""
