"""K3 configs: real and mini sizes, HF parsing, validation errors."""

import pytest

from k3_model.config import K3_MINI, K3_REAL, K3Config, K3ConfigError


def test_real_and_mini_routing_sizes():
    assert (K3_REAL.num_experts, K3_REAL.num_experts_per_token, K3_REAL.hidden_size) == (896, 16, 7168)
    assert (K3_MINI.num_experts, K3_MINI.num_experts_per_token, K3_MINI.hidden_size) == (32, 4, 256)
    assert K3_REAL.decode_backend == "standard"


def test_from_hf_reads_text_config_and_override():
    cfg = {"model_type": "kimi_k3", "text_config": {"hidden_size": 7168, "num_experts": 896,
           "num_experts_per_token": 16, "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
           "moe_renormalize": True, "rms_norm_eps": 1e-5, "moe_router_activation_func": "sigmoid"}}
    c = K3Config.from_hf(cfg, decode_backend="latency_specialized")
    assert c.num_experts == 896 and c.decode_backend == "latency_specialized"


def test_from_hf_errors_are_clear():
    with pytest.raises(K3ConfigError, match="lacks 'num_experts'"):
        K3Config.from_hf({"text_config": {"hidden_size": 8, "num_experts_per_token": 2}})
    with pytest.raises(K3ConfigError, match="sigmoid-scored"):
        K3Config.from_hf({"hidden_size": 8, "num_experts": 8, "num_experts_per_token": 2,
                          "moe_router_activation_func": "softmax"})
    with pytest.raises(K3ConfigError, match="multiple of n_group"):
        K3Config.from_hf({"hidden_size": 8, "num_experts": 9, "num_experts_per_token": 2, "num_expert_group": 2})
