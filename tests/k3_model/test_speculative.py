"""K3-mini's speculative decode loop (issue 21 item 3): the synthetic drafter's acceptance length, lossless
greedy output, the per-request cache rollback, seeded sampling, the verification's backend, bad arguments."""

import pytest
import torch

from k3_model.decode import SyntheticDrafter, acceptance_length, generate, generate_speculative, split_cache
from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
from k3_model.layers import KDAState, MLACache
from k3_model.model import K3Model, random_weights

CHUNK = PAGE = 16


@pytest.fixture(scope="module")
def model():
    cfg = parse_hf_config(k3_mini_hf_config())
    return K3Model(cfg, random_weights(cfg, 0))


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 3840, (3, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Greedy tokens of the plain decode loop, 8 more than the speculative runs emit (the last drafts)."""
    return generate(model, prompts, 32, prefill_chunk=CHUNK, page_tokens=PAGE).tokens


def _spec(model, prompts, reference, al, **kw):
    return generate_speculative(model, prompts, 24, drafter=SyntheticDrafter(reference, al, model.text.vocab_size),
                                num_draft_tokens=kw.pop("D", 7), prefill_chunk=CHUNK, page_tokens=PAGE, **kw)


@pytest.mark.parametrize("al", [1, 6, 8])
def test_greedy_speculative_decoding_emits_the_greedy_tokens_at_the_synthetic_acceptance_length(model, prompts,
                                                                                                reference, al):
    res = _spec(model, prompts, reference, al)
    assert torch.equal(res.tokens, reference[:, :24])  # lossless: rejected drafts never reach the output
    # every request accepts al - 1 drafts a step until it has its 24 tokens (the first comes from the prompt)
    steps = -(-23 // al)
    assert res.accepted.shape == (steps, 3)
    assert (res.accepted == al - 1).all() and (res.acceptance_length() == al).all()
    assert res.verify_implementations == {"dspark_verify:standard": steps}
    decode = [s for s in res.steps if s["phase"] == "spec_verify"]  # verification steps (issue 21)
    assert len(decode) == steps and all(s["tokens"] == 3 * 8 and s["requests"] == 3 for s in decode)
    assert (res.num_drafts == 7).all() and res.verify_reasons == ["decode_backend is standard"]
    # the MoE routing sees every request's 1 + D rows in one call per layer (8 LatentMoE layers)
    assert decode[0]["implementations"]["moe_dispatch:standard"] == 8
    assert decode[0]["implementations"]["kda_decode:standard"] > 0  # KDA runs the 8 tokens as decode steps


def test_rollback_leaves_each_request_where_a_plain_prefill_of_its_tokens_does(model, prompts, reference):
    """After the speculative run each request's caches hold prompt + consumed tokens, equal (to rounding) to a
    cache that prefilled exactly those tokens: no rejected draft survives in the MLA cache or the KDA state."""
    import k3_model.decode as decode

    ends = []
    real = decode.split_cache

    def keep(*a, **k):  # the per-request caches the loop advances; they end in its final state
        ends.extend(real(*a, **k))
        return ends

    decode.split_cache = keep
    try:
        res = _spec(model, prompts, reference, 3, D=5)
    finally:
        decode.split_cache = real
    assert torch.equal(res.tokens, reference[:, :24])
    for b, got in enumerate(ends):
        consumed = int(res.emitted[:, b].sum())  # 1 + emitted - 1: the last emitted token is not run yet
        full = torch.cat([prompts[b:b + 1], reference[b:b + 1, :consumed]], 1)
        cache = model.new_cache(1, page_tokens=PAGE)
        model.forward(full, cache)
        assert got.length == full.shape[1] == 40 + consumed
        for mine, ref in zip(got.layers, cache.layers):
            if isinstance(mine, KDAState):
                assert torch.allclose(mine.recurrent, ref.recurrent, atol=2e-4, rtol=1e-3)
                assert torch.allclose(mine.conv, ref.conv, atol=1e-5)
                assert mine.positions is None  # tracking ended with the rewind
            else:
                assert mine.length == ref.length
                assert torch.allclose(mine.view()[0], ref.view()[0], atol=2e-4, rtol=1e-3)


def test_sampled_requests_are_seeded_and_mix_with_greedy_ones(model, prompts, reference):
    kw = {"temperature": torch.tensor([0.0, 0.1, 1.0]), "top_k": torch.tensor([0, 0, 20], dtype=torch.int32),
          "top_p": torch.tensor([1.0, 0.9, 1.0]), "logits_dtype": torch.bfloat16}
    a = _spec(model, prompts, reference, 6, seed=3, **kw)
    assert torch.equal(a.tokens, _spec(model, prompts, reference, 6, seed=3, **kw).tokens)
    assert not torch.equal(a.tokens[1:], _spec(model, prompts, reference, 6, seed=4, **kw).tokens[1:])
    assert ((a.accepted >= -1) & (a.accepted <= 7)).all()
    # a finished request leaves the batch: its later entries are -1 and it emits nothing there
    done = (a.accepted == -1)
    assert bool(done.any()) and (a.emitted[done] == 0).all()
    assert a.tokens.shape == (3, 24) and int(a.tokens.min()) >= 0


def test_latency_specialized_verification_emits_the_standard_tokens(model, prompts, reference):
    """Main's merged CPU kernel (bf16 logits) verifies inside the loop; the model stays on the standard path."""
    kw = {"temperature": torch.tensor([0.0, 0.1, 0.8]), "top_k": torch.tensor([0, 0, 50], dtype=torch.int32),
          "top_p": torch.tensor([1.0, 0.9, 1.0]), "logits_dtype": torch.bfloat16, "seed": 2}
    std = _spec(model, prompts, reference, 6, **kw)
    ls = _spec(model, prompts, reference, 6, verify_backend="latency_specialized", **kw)
    assert ls.verify_implementations == {"dspark_verify:latency_specialized": ls.accepted.shape[0]}
    assert torch.equal(ls.tokens, std.tokens) and torch.equal(ls.accepted, std.accepted)
    assert all(k.endswith(":standard") for s in ls.steps for k in s["implementations"] if not k.startswith("dspark"))


def test_per_request_acceptance_lengths_and_ragged_draft_counts(model, prompts, reference):
    """Request 0 drafts 7 with AL 6, request 1 drafts 3 that are all right (its bonus token every step),
    request 2 drafts none (bonus only): lossless, and each accepts what its drafter promises."""
    drafter = SyntheticDrafter(reference, [6, 8, 1], model.text.vocab_size, draft_counts=[7, 3, 0])
    res = generate_speculative(model, prompts, 24, drafter=drafter, num_draft_tokens=7, prefill_chunk=CHUNK,
                               page_tokens=PAGE)
    assert torch.equal(res.tokens, reference[:, :24])
    taken = res.accepted >= 0
    assert (res.accepted[:, 0][taken[:, 0]] == 5).all() and (res.accepted[:, 1][taken[:, 1]] == 3).all()
    assert (res.accepted[:, 2] == 0).all() and (res.num_drafts[:, 2] == 0).all()
    assert (res.num_drafts[:, 1][taken[:, 1]] == 3).all()
    assert res.steps[-1]["tokens"] == 1 + 0  # only request 2 is left: its input token, no drafts
    with pytest.raises(ValueError, match="draft counts >= 0"):
        SyntheticDrafter(reference, 6, 10, draft_counts=[1, -1, 2])
    with pytest.raises(ValueError, match="one per request"):
        SyntheticDrafter(reference, [6, 6], 10)


def test_a_sampled_first_token_obeys_top_k(model, prompts, reference):
    """top-k 1 leaves one token: a sampled request's first token is then the greedy one, at any temperature
    (the first draw uses the request's own target distribution, not the bare softmax)."""
    kw = {"temperature": torch.tensor([2.0, 2.0, 2.0]), "top_k": torch.ones(3, dtype=torch.int32),
          "top_p": torch.ones(3), "logits_dtype": torch.bfloat16}
    for seed in (0, 1, 2):
        res = _spec(model, prompts, reference, 6, seed=seed, **kw)
        assert torch.equal(res.tokens[:, 0], reference[:, 0])


def test_acceptance_length_counts_only_the_steps_a_request_took_part_in():
    acc = torch.tensor([[5, 0], [5, 2], [-1, 0]])
    assert acceptance_length(acc).tolist() == [6.0, pytest.approx(5 / 3)]


def test_bad_arguments_and_states_are_clear_errors(model, prompts, reference):
    drafter = SyntheticDrafter(reference, 6, model.text.vocab_size)
    with pytest.raises(ValueError, match=r"num_draft_tokens must lie in \[1, 8\]; got 9"):
        generate_speculative(model, prompts, 4, drafter=drafter, num_draft_tokens=9)
    with pytest.raises(ValueError, match=r"temperature must be \(3,\) torch.float32; got \(2,\)"):
        generate_speculative(model, prompts, 4, drafter=drafter, num_draft_tokens=2, temperature=torch.zeros(2))
    with pytest.raises(ValueError, match="acceptance lengths >= 1"):
        SyntheticDrafter(reference, 0, 10)
    st = KDAState.zeros(1, 2, 4, 4, "cpu")
    with pytest.raises(ValueError, match=r"keep must lie in \[1, tokens tracked\]; got 1 \(not tracking\)"):
        st.rewind(1)
    mla = MLACache(1, 4, 2, dtype=torch.float32, device="cpu")
    mla.append(torch.zeros(1, 3, 4), torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match=r"length must lie in \[0, 3\]"):
        mla.truncate(4)
    with pytest.raises(ValueError, match="static cache cannot be split"):
        split_cache(model, model.new_static_cache(1, 8), page_tokens=PAGE)


def test_synthetic_drafter_proposes_reference_then_wrong_tokens():
    d = SyntheticDrafter(torch.tensor([[10, 11, 12, 13, 14]]), 3, 16)
    assert d.propose(0, 1, 4) == [11, 12, 14, 15]  # two right (AL - 1), then reference + 1
    assert d.propose(0, 3, 4) == [13, 14, 0, 0]  # past the reference: token 0
