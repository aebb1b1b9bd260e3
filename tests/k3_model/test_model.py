"""K3-mini end to end: layer plan, prefill/decode equivalence, the decode loop and its trace, checkpoints."""

import hashlib
import json

import pytest
import torch

from k3_model.decode import generate
from k3_model.generate import load_checkpoint, write_checkpoint
from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
from k3_model.layers import LatentMoEWeights, MLPWeights
from k3_model.model import K3Model, K3WeightsError, random_weights


@pytest.fixture(scope="module")
def model():
    cfg = parse_hf_config(k3_mini_hf_config())
    return K3Model(cfg, random_weights(cfg, 0))


def _prompts(B, T, seed=0):
    return torch.randint(0, 3840, (B, T), generator=torch.Generator().manual_seed(seed))


def test_layer_plan_dense_layer0_and_size(model):
    assert [lw.kind for lw in model.layers] == ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla", "mla"]
    assert isinstance(model.layers[0].ffn, MLPWeights)
    assert all(isinstance(lw.ffn, LatentMoEWeights) for lw in model.layers[1:])
    assert model.layers[1].ffn.shared.gate_proj.shape == (192, 256)  # 2 shared experts fused, full width
    assert model.layers[1].ffn.w1.shape == (32, 96, 128)  # routed experts in the 128-wide latent
    assert 17_000_000 < model.num_parameters() < 18_500_000  # §9: ~17 M (+ the 512+64 MLA latent)


def test_prefill_then_decode_equals_token_by_token(model):
    toks = _prompts(2, 12, 1)
    full = model.forward(toks, model.new_cache(2))  # one prefill chunk, expanded MLA
    c1 = model.new_cache(2, page_tokens=4)
    steps = torch.cat([model.forward(toks[:, t:t + 1], c1) for t in range(12)], 1)  # absorbed MLA each step
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    c2 = model.new_cache(2)
    mixed = torch.cat([model.forward(toks[:, :5], c2), model.forward(toks[:, 5:9], c2)] +
                      [model.forward(toks[:, t:t + 1], c2) for t in range(9, 12)], 1)
    torch.testing.assert_close(mixed, full, rtol=1e-4, atol=1e-4)
    assert c1.length == c2.length == 12


def test_generate_greedy_trace_and_teacher_forcing(model):
    p = _prompts(2, 10, 2)
    a = generate(model, p, 6, prefill_chunk=4)
    b = generate(model, p, 6, prefill_chunk=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, a.argmax)
    assert [s["phase"] for s in a.steps] == ["prefill"] * 3 + ["decode"] * 5
    assert a.implementation_counts("prefill") == {"moe_dispatch:standard": 24}  # 8 MoE layers x 3 chunks
    # 8 MoE layers and 6 KDA layers (their kda_decode step) x 5 decode steps; prefill keeps KDA's token loop;
    # the attention input projections (6 KDA layers x q/k/v/f_a/b + 3 MLA layers x q_a/q_b/kv_a = 39 a step)
    # call small_m_gemm at decode only
    assert a.implementation_counts("decode") == {"moe_dispatch:standard": 40, "kda_decode:standard": 30,
                                                 "small_m_gemm:standard": 39 * 5}
    lp = torch.log_softmax(model.forward(p, model.new_cache(2))[:, -1], -1)
    torch.testing.assert_close(a.logprobs[:, 0], lp.gather(1, a.tokens[:, :1]).squeeze(1), rtol=1e-4, atol=1e-4)
    forced = torch.full((2, 6), 7)
    f = generate(model, p, 6, forced=forced, decode_backend="latency_specialized")
    assert torch.equal(f.tokens, forced) and torch.equal(f.argmax[:, 0], a.tokens[:, 0])
    assert bool((f.margin >= 0).all())


def test_decode_backend_reaches_the_dispatcher_per_step(model):
    from k3_model import dispatch

    with dispatch.record_trace() as tr:
        generate(model, _prompts(1, 3), 2, decode_backend="latency_specialized")
    # main has the CPU moe_dispatch kernel merged (review #1): decode steps take it, prefill falls back;
    # KDA decode steps call kda_decode and every decode step's input projections small_m_gemm, for which no
    # kernel is merged
    by_phase = {(d.phase, d.implementation, d.reason.split(" (")[0]) for d in tr.decisions}
    unmerged = [op for op in ("kda_decode", "small_m_gemm") if dispatch.declared_scope(op, "cpu") is None]
    expected = {("prefill", "standard", "out of declared scope: phase 'prefill' not in ['decode', 'spec_verify']"),
                ("decode", "latency_specialized", "in scope")}
    expected |= {("decode", "standard", f"no latency-specialized kernel merged for {op}") for op in unmerged}
    if len(unmerged) == 2:  # main
        assert by_phase == expected, by_phase
    else:  # a user's `review approve` merged more kernels: they add decisions of their own
        assert expected <= by_phase, by_phase


def test_temperature_sampling_is_seeded(model):
    p = _prompts(1, 4, 3)
    a = generate(model, p, 8, temperature=1.0, seed=5)
    assert torch.equal(a.tokens, generate(model, p, 8, temperature=1.0, seed=5).tokens)
    assert not torch.equal(a.tokens, generate(model, p, 8, temperature=1.0, seed=6).tokens)


def test_generate_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="prompts must be"):
        generate(model, torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="forced must be"):
        generate(model, _prompts(1, 2), 2, forced=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids must lie"):
        model.forward(torch.tensor([[4096]]), model.new_cache(1))


def test_checkpoint_round_trip_is_deterministic(tmp_path, model):
    files = write_checkpoint(tmp_path / "a", seed=0, with_tokenizer=False)
    write_checkpoint(tmp_path / "b", seed=0, with_tokenizer=False)
    names = sorted(p.name for p in files)
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    digest = lambda d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    loaded = load_checkpoint(tmp_path / "a")
    p = _prompts(1, 5)
    assert torch.equal(loaded.forward(p, loaded.new_cache(1)), model.forward(p, model.new_cache(1)))
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert t["model.layers.0.self_attn.A_log"].dtype == torch.float32 and t["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(t["model.layers.0.self_attn.A_log"][4:], torch.zeros(60))  # padded like K3's [128]
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 16
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(K3WeightsError, match="wrong shapes"):
        load_checkpoint(tmp_path / "a")
