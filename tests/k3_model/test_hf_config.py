"""The kimi_k3 config format: the real K3 config and K3-mini parse; broken configs fail with clear errors."""

import json

import pytest

from k3_model.config import K3_MINI, K3ConfigError
from k3_model.hf_config import k3_mini_hf_config, k3_real_hf_config, load_hf_config, parse_hf_config


def test_real_k3_layer_plan():
    t = parse_hf_config(k3_real_hf_config()).text_config
    mla = [i for i in range(93) if t.is_mla_layer(i)]
    assert len(mla) == 24 and mla[-2:] == [91, 92] and mla[:3] == [3, 7, 11]  # 23 x [K,K,K,M] + trailing MLA
    assert sum(not t.is_mla_layer(i) for i in range(93)) == 69
    assert t.is_dense_layer(0) and not t.is_dense_layer(1)
    assert [i for i in range(93) if t.writes_attn_res_block(i)] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert t.kda_proj_size == 12288 and t.kv_lora_rank + t.qk_rope_head_dim == 576
    assert t.quantization_config["format"] == "mxfp4-pack-quantized"


def test_k3_mini_keeps_every_feature():
    cfg = parse_hf_config(k3_mini_hf_config())
    t = cfg.text_config
    assert ["mla" if t.is_mla_layer(i) else "kda" for i in range(9)] == \
        ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla", "mla"]  # double trailing MLA
    assert [i for i in range(9) if t.writes_attn_res_block(i)] == [0, 4, 8]  # partial final block
    assert (t.kv_lora_rank, t.qk_rope_head_dim) == (512, 64)  # issue 6: vLLM CPU MLA needs 512 + 64
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (3840, 3842, 4095)
    assert t.routed_expert_hidden_size == t.hidden_size // 2 and t.num_shared_experts == 2
    r = t.routing_config("k3_mini")
    assert (r.num_experts, r.num_experts_per_token, r.hidden_size, r.n_group) == \
        (K3_MINI.num_experts, K3_MINI.num_experts_per_token, K3_MINI.hidden_size, K3_MINI.n_group)


def test_load_from_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(k3_mini_hf_config()))
    assert load_hf_config(tmp_path).text_config.num_hidden_layers == 9
    with pytest.raises(K3ConfigError, match="does not exist"):
        load_hf_config(tmp_path / "nope")


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(model_type="deepseek_v3"), "model_type' must be 'kimi_k3'"),
    (lambda c: c["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6]), "partition"),
    (lambda c: c["text_config"].update(hidden_act="silu"), "situ"),
    (lambda c: c["text_config"].update(mla_use_nope=False), "mla_use_nope"),
    (lambda c: c["text_config"].update(num_experts_per_token=64), "exceeds num_experts"),
    (lambda c: c["text_config"].pop("kv_lora_rank"), "text_config.kv_lora_rank': Field required; got nothing"),
    (lambda c: c.update(eos_token_id=5000), "below text_config.vocab_size"),
])
def test_invalid_configs_name_the_field(mutate, message):
    c = k3_mini_hf_config()
    mutate(c)
    with pytest.raises(K3ConfigError, match=message):
        parse_hf_config(c)
