"""K3 layer invariants (k3_architecture.md §9 list), each against math written out independently here."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3_model import dispatch
from k3_model.layers import (
    SPLIT_KV_MIN_PAGES,
    KDAState,
    KDAWeights,
    LatentMoEWeights,
    MLACache,
    MLAWeights,
    MLPWeights,
    RoutingSettings,
    attn_res_mix,
    kda_forward,
    kda_gate,
    kda_recurrence,
    latent_moe,
    mla_forward,
    rms_norm,
    route,
    situ_glu,
    split_kv_pages,
)


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ---- AttnRes ------------------------------------------------------------------------------------

def test_attn_res_zero_proj_is_uniform_average_not_residual_sum():
    src = torch.randn(3, 4, 16, generator=_g(0))
    out = attn_res_mix(src, torch.rand(16, generator=_g(1)) + 0.5, torch.zeros(1, 16), 1e-5)
    torch.testing.assert_close(out, src.mean(1), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out, src.sum(1))


def test_attn_res_softmax_over_depth_of_raw_sources():
    src = torch.randn(2, 3, 8, generator=_g(2)) * torch.tensor([1.0, 5.0, 0.2]).view(1, 3, 1)
    nw, pw = torch.rand(8, generator=_g(3)), torch.randn(1, 8, generator=_g(4))
    out = attn_res_mix(src, nw, pw, 1e-5)
    for n in range(2):
        logits = [float((src[n, j] / math.sqrt(float(src[n, j].pow(2).mean()) + 1e-5) * nw * pw[0]).sum())
                  for j in range(3)]
        p = torch.softmax(torch.tensor(logits), 0)
        torch.testing.assert_close(out[n], sum(p[j] * src[n, j] for j in range(3)), rtol=1e-5, atol=1e-6)
    single = src[:, :1]
    assert torch.equal(attn_res_mix(single, nw, pw, 1e-5), single[:, 0])  # first layer: identity


# ---- SiTU, RMSNorm ------------------------------------------------------------------------------

def test_situ_values_and_silu_limit():
    g, u = torch.tensor([-3.0, -0.5, 0.0, 1.0, 6.0]), torch.tensor([2.0, -1.0, 3.0, 40.0, 0.5])
    want = [4 * math.tanh(a / 4) / (1 + math.exp(-a)) * 25 * math.tanh(b / 25) for a, b in zip(g.tolist(), u.tolist())]
    torch.testing.assert_close(situ_glu(g, u, 4.0, 25.0), torch.tensor(want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(situ_glu(g, u, 1e6, 1e6), F.silu(g) * u, rtol=1e-5, atol=1e-5)
    assert abs(float(situ_glu(torch.tensor(100.0), torch.tensor(1000.0), 4.0, 25.0)) - 4 * 25) < 1e-3  # soft caps


def test_rms_norm_value():
    x = torch.tensor([[3.0, 4.0]])
    torch.testing.assert_close(rms_norm(x, torch.tensor([1.0, 2.0]), 0.0),
                               torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]]))


# ---- KDA ----------------------------------------------------------------------------------------

def _kda_weights(H=24, nh=2, d=8, R=8, C=4, seed=0):
    g = _g(seed)
    P = nh * d
    r = lambda *s, std=0.3: torch.randn(*s, generator=g) * std  # noqa: E731
    alog = torch.zeros(max(nh, d))
    alog[:nh] = r(nh)
    return KDAWeights(r(P, H), r(P, H), r(P, H), r(P, 1, C, std=0.5), r(P, 1, C, std=0.5), r(P, 1, C, std=0.5),
                      r(R, H), r(P, R), alog, r(P, std=1.0), r(nh, H), r(P, H), 1 + r(d, std=0.1), r(H, P))


def _kda_reference(w, x, nh, d, lb, eps):
    """Token-by-token K3 KDA with per-head Python loops, K-first state, S = (I - b k k^T) D S + b k v^T."""
    B, T, H = x.shape
    P, C = nh * d, w.q_conv1d.shape[-1]
    out = torch.zeros(B, T, H)
    for b in range(B):
        S = [torch.zeros(d, d) for _ in range(nh)]  # [K, V]
        hist = {n: [torch.zeros(P)] * (C - 1) for n in "qkv"}
        for t in range(T):
            xt = x[b, t]
            conv = {}
            for n, wp, taps in (("q", w.q_proj, w.q_conv1d), ("k", w.k_proj, w.k_conv1d), ("v", w.v_proj, w.v_conv1d)):
                window = hist[n] + [wp @ xt]  # C inputs, oldest first; tap C-1 = current token
                conv[n] = F.silu(sum(taps[:, 0, j] * window[j] for j in range(C)))
                hist[n] = window[1:]
            raw_g = w.f_b_proj @ (w.f_a_proj @ xt)
            beta = torch.sigmoid(w.b_proj @ xt)
            gate = torch.sigmoid(w.g_proj @ xt)
            o_all = []
            for h in range(nh):
                sl = slice(h * d, (h + 1) * d)
                q, k, v = conv["q"][sl], conv["k"][sl], conv["v"][sl]
                q = q / math.sqrt(float(q @ q) + 1e-6) / math.sqrt(d)
                k = k / math.sqrt(float(k @ k) + 1e-6)
                gh = lb * torch.sigmoid(math.exp(float(w.A_log[h])) * (raw_g[sl] + w.dt_bias[sl]))
                D = torch.diag(torch.exp(gh))
                S[h] = (torch.eye(d) - beta[h] * torch.outer(k, k)) @ D @ S[h] + beta[h] * torch.outer(k, v)
                o = S[h].T @ q
                o = o / math.sqrt(float(o.pow(2).mean()) + eps) * w.o_norm
                o_all.append(o * gate[sl])
            out[b, t] = w.o_proj @ torch.cat(o_all)
    return out


def test_kda_matches_step_by_step_reference_and_carries_state_across_chunks():
    w, nh, d = _kda_weights(), 2, 8
    x = torch.randn(2, 11, 24, generator=_g(5))
    want = _kda_reference(w, x, nh, d, -5.0, 1e-5)
    st = KDAState.zeros(2, nh, d, 4, "cpu")
    got = kda_forward(w, x, st, heads=nh, head_dim=d, lower_bound=-5.0, eps=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    st2 = KDAState.zeros(2, nh, d, 4, "cpu")  # prefill 6, then decode one token at a time
    parts = [kda_forward(w, x[:, :6], st2, heads=nh, head_dim=d, lower_bound=-5.0, eps=1e-5)]
    parts += [kda_forward(w, x[:, t:t + 1], st2, heads=nh, head_dim=d, lower_bound=-5.0, eps=1e-5) for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(parts, 1), got, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st2.recurrent, st.recurrent, rtol=1e-5, atol=1e-6)


def test_kda_gate_is_bounded_and_ignores_alog_padding():
    raw = torch.randn(3, 2, 8, generator=_g(6)) * 50
    alog = torch.tensor([0.3, -0.2] + [7.0] * 6)  # padding past the 2 heads must be ignored
    g = kda_gate(raw, alog, torch.zeros(16), -5.0)
    assert bool(((g > -5.0) & (g < 0)).all() | ((g >= -5.0) & (g <= 0)).all())
    want = -5.0 * torch.sigmoid(math.exp(0.3) * raw[:, 0])
    torch.testing.assert_close(g[:, 0], want)


def test_kda_recurrence_state_layout_is_v_first():
    # one step from zero state with beta=1: S = v k^T, o = S q = v (k.q)
    q, k, v = (torch.randn(1, 1, 1, 4, generator=_g(i)) for i in (7, 8, 9))
    S = torch.zeros(1, 1, 4, 4)
    o = kda_recurrence(q, k, v, torch.zeros(1, 1, 1, 4), torch.ones(1, 1, 1), S)
    torch.testing.assert_close(S[0, 0], torch.outer(v[0, 0, 0], k[0, 0, 0]))
    torch.testing.assert_close(o[0, 0, 0], v[0, 0, 0] * float(k.flatten() @ q.flatten()))


# ---- MLA ----------------------------------------------------------------------------------------

def _mla(H=32, nh=2, n=8, r=64, dv=8, L=512, qr=16, seed=0):
    g = _g(seed)
    rr = lambda *s: torch.randn(*s, generator=g) * s[-1] ** -0.5  # noqa: E731
    return MLAWeights(rr(qr, H), 1 + 0.1 * torch.randn(qr, generator=g), rr(nh * (n + r), qr), rr(L + r, H),
                      1 + 0.1 * torch.randn(L, generator=g), rr(nh * (n + dv), L), rr(nh * dv, H), rr(H, nh * dv))


def _mla_naive_loops(w, x, nh, n, r, dv, L, eps):
    """Per-token, per-head MHA expansion with explicit loops (no cache, full causal history)."""
    B, T, H = x.shape
    out = torch.zeros(B, T, H)
    for b in range(B):
        c = [rms_norm(w.kv_a_proj_with_mqa[:L] @ x[b, s], w.kv_a_layernorm, eps) for s in range(T)]
        kpe = [w.kv_a_proj_with_mqa[L:] @ x[b, s] for s in range(T)]
        for t in range(T):
            q = (w.q_b_proj @ rms_norm(w.q_a_proj @ x[b, t], w.q_a_layernorm, eps)).view(nh, n + r)
            o = []
            for h in range(nh):
                kv = [(w.kv_b_proj.view(nh, n + dv, L)[h] @ c[s]) for s in range(t + 1)]
                sc = torch.tensor([float(q[h, :n] @ kv[s][:n] + q[h, n:] @ kpe[s]) / math.sqrt(n + r) for s in range(t + 1)])
                p = torch.softmax(sc, 0)
                o.append(sum(p[s] * kv[s][n:] for s in range(t + 1)))
            out[b, t] = w.o_proj @ (torch.cat(o) * torch.sigmoid(w.g_proj @ x[b, t]))
    return out


@pytest.mark.parametrize("absorbed", [False, True])
def test_mla_matches_naive_expansion(absorbed):
    w, x = _mla(), torch.randn(2, 6, 32, generator=_g(11))
    want = _mla_naive_loops(w, x, 2, 8, 64, 8, 512, 1e-5)
    cache = MLACache(2, 512, 64, dtype=torch.float32, device="cpu", page_tokens=4)
    kw = dict(heads=2, nope=8, rope=64, v_dim=8, kv_lora_rank=512, eps=1e-5)
    got = torch.cat([mla_forward(w, x[:, :3], cache, absorbed=absorbed, **kw)] +
                    [mla_forward(w, x[:, t:t + 1], cache, absorbed=True, **kw) for t in range(3, 6)], 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert cache.length == 6 and cache.pages_allocated == 2 and cache.latent.shape[1] == 8


def test_mla_absorbed_chunk_with_pages_beyond_early_queries_matches_naive():
    """Absorbed over T = 8 new tokens in pages of 3: the split-KV path runs, and the first queries see
    no key of the last pages (empty chunks, LSE -inf, NaN partial outputs) which must weigh 0."""
    w, x = _mla(), torch.randn(2, 8, 32, generator=_g(12))
    want = _mla_naive_loops(w, x, 2, 8, 64, 8, 512, 1e-5)
    cache = MLACache(2, 512, 64, dtype=torch.float32, device="cpu", page_tokens=3)
    kw = dict(heads=2, nope=8, rope=64, v_dim=8, kv_lora_rank=512, eps=1e-5)
    with dispatch.record_trace() as tr:
        got = mla_forward(w, x, cache, absorbed=True, **kw)
    assert split_kv_pages(cache) == 3 and [d.op for d in tr.decisions] == ["lse_merge"]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _decode_run(w, x, page_tokens, kw):
    """Prefill x[:, :-4] (expanded), then decode the last 4 tokens one at a time (absorbed)."""
    cache = MLACache(x.shape[0], 512, 64, dtype=x.dtype, device="cpu", page_tokens=page_tokens)
    mla_forward(w, x[:, :-4], cache, absorbed=False, **kw)
    return torch.cat([mla_forward(w, x[:, t:t + 1], cache, absorbed=True, **kw)
                      for t in range(x.shape[1] - 4, x.shape[1])], 1), cache


def test_split_kv_decode_equals_unsplit_attention_to_fp32_rounding():
    """Decode over 300 tokens in pages of 64 (5 pages: split, 5 chunks merged by the lse_merge op)
    against one page of 4096 (no split, one softmax): equal to fp32 rounding (measured 3.7e-7 of the
    largest output; the bound is ~16 fp32 eps)."""
    w = _mla(seed=3)
    x = torch.randn(3, 300, 32, generator=_g(13)) * 2.0
    kw = dict(heads=2, nope=8, rope=64, v_dim=8, kv_lora_rank=512, eps=1e-5)
    with dispatch.record_trace() as tr:
        split, cache = _decode_run(w, x, 64, kw)
    assert split_kv_pages(cache) == 5 >= SPLIT_KV_MIN_PAGES
    assert [d.rows for d in tr.decisions if d.op == "lse_merge"] == [3] * 4
    with dispatch.record_trace() as tr1:
        whole, cache1 = _decode_run(w, x, 4096, kw)
    assert split_kv_pages(cache1) == 0 and not [d for d in tr1.decisions if d.op == "lse_merge"]
    scale = whole.abs().amax()
    assert float((split - whole).abs().max() / scale) < 2e-6  # fp32 eps 1.2e-7: a handful of roundings


def test_split_kv_merge_goes_through_the_dispatcher_op():
    w, x = _mla(), torch.randn(2, 10, 32, generator=_g(14))
    kw = dict(heads=2, nope=8, rope=64, v_dim=8, kv_lora_rank=512, eps=1e-5)
    cache = MLACache(2, 512, 64, dtype=torch.float32, device="cpu", page_tokens=4)
    mla_forward(w, x[:, :9], cache, absorbed=False, **kw)
    with dispatch.record_trace() as tr, dispatch.forward_context(decode_backend="latency_specialized", phase="decode"):
        mla_forward(w, x[:, 9:], cache, absorbed=True, **kw)
    merges = [d for d in tr.decisions if d.op == "lse_merge"]
    assert [(d.op, d.phase, d.rows) for d in merges] == [("lse_merge", "decode", 2)]
    # a merged lse_merge kernel (a user's `review approve`) or the standard path: the dispatcher decides
    assert merges[0].implementation in ("standard", "latency_specialized")
    # the decode step's input projections (q_a, q_b, kv_a) go through small_m_gemm
    assert [d.op for d in tr.decisions if d.op != "lse_merge"] == ["small_m_gemm"] * 3


def test_mla_cache_limit_is_a_clear_error():
    cache = MLACache(1, 512, 64, dtype=torch.float32, device="cpu", page_tokens=4, max_tokens=5)
    cache.append(torch.zeros(1, 5, 512), torch.zeros(1, 5, 64))
    with pytest.raises(ValueError, match="exceed the declared limit max_tokens=5"):
        cache.append(torch.zeros(1, 1, 512), torch.zeros(1, 1, 64))


# ---- LatentMoE ----------------------------------------------------------------------------------

def _moe(H=16, E=8, Z=8, Fi=6, seed=0):
    g = _g(seed)
    rr = lambda *s: torch.randn(*s, generator=g) * s[-1] ** -0.5  # noqa: E731
    return LatentMoEWeights(rr(E, H), 0.1 * torch.randn(E, generator=g), rr(Z, H), 1 + 0.1 * torch.randn(Z, generator=g),
                            rr(H, Z), rr(E, Fi, Z), rr(E, Fi, Z), rr(E, Z, Fi),
                            MLPWeights(rr(2 * Fi, H), rr(2 * Fi, H), rr(H, 2 * Fi)))


R = RoutingSettings(top_k=3, n_group=1, topk_group=1, renormalize=True, routed_scaling_factor=1.0)


def _moe_reference(w, x, k, norm_after_sum=True):
    out = []
    for xt in x:
        s = torch.sigmoid(w.gate @ xt)
        ids = torch.topk(s + w.e_score_correction_bias, k).indices.tolist()
        wts = s[ids] / s[ids].sum()
        z = w.routed_expert_down_proj @ xt
        ex = [w.w2[e] @ situ_glu(w.w1[e] @ z, w.w3[e] @ z, 4.0, 25.0) for e in ids]
        if norm_after_sum:
            lat = rms_norm(sum(a * b for a, b in zip(wts, ex)), w.routed_expert_norm, 1e-5)
        else:  # the wrong variant: norm each expert's output
            lat = sum(a * rms_norm(b, w.routed_expert_norm, 1e-5) for a, b in zip(wts, ex))
        sh = w.shared.down_proj @ situ_glu(w.shared.gate_proj @ xt, w.shared.up_proj @ xt, 4.0, 25.0)
        out.append(w.routed_expert_up_proj @ lat + sh)
    return torch.stack(out)


def test_latent_moe_matches_reference_norm_after_sum_shared_on_full_width():
    w, x = _moe(), torch.randn(5, 16, generator=_g(20))
    got = latent_moe(w, x, R, beta=4.0, linear_beta=25.0, eps=1e-5)
    torch.testing.assert_close(got, _moe_reference(w, x, 3), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, _moe_reference(w, x, 3, norm_after_sum=False), rtol=1e-3, atol=1e-3)
    w.w2.zero_()  # routed experts silent: the output is exactly the shared experts on the full-width x
    sh = F.linear(situ_glu(F.linear(x, w.shared.gate_proj), F.linear(x, w.shared.up_proj), 4.0, 25.0), w.shared.down_proj)
    torch.testing.assert_close(latent_moe(w, x, R, beta=4.0, linear_beta=25.0, eps=1e-5), sh)


def test_topk_selects_on_biased_scores_but_weighs_unbiased():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0])  # lifts the weakest expert into the top 3
    out = route(logits, bias, R)
    assert sorted(out["topk_ids"][0].tolist()) == [0, 1, 7]
    s = torch.sigmoid(logits[0, [0, 1, 7]])
    want = dict(zip([0, 1, 7], (s / s.sum()).tolist()))
    for e, wt in zip(out["topk_ids"][0].tolist(), out["topk_weights"][0].tolist()):
        assert abs(wt - want[e]) < 1e-6
    assert abs(float(out["topk_weights"].sum()) - 1.0) < 1e-6


def test_moe_goes_through_the_dispatcher_op():
    w, x = _moe(), torch.randn(4, 16, generator=_g(21))
    with dispatch.record_trace() as tr, dispatch.forward_context(decode_backend="latency_specialized", phase="prefill"):
        latent_moe(w, x, R, beta=4.0, linear_beta=25.0, eps=1e-5)
    assert [(d.op, d.implementation, d.phase, d.rows) for d in tr.decisions] == \
        [("moe_dispatch", "standard", "prefill", 4)]
