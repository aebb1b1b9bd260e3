"""The kda_decode op's standard path against the recurrence written out here (kernel_targets.md §5.1),
its slot contract (padding rows, untouched slots), its argument checks and dispatch, and K3-mini's KDA
layer calling it on decode steps with unchanged numbers."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3_model import dispatch
from k3_model.layers import KDAState, KDAWeights, _causal_conv_silu, kda_forward, kda_recurrence, rms_norm
from k3_model.ops.kda_decode import kda_decode, kda_gate


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(B=3, H=2, K=5, V=3, S=6, seed=0):
    g = _g(seed)
    return {"q": torch.randn(B, H, K, generator=g), "k": torch.randn(B, H, K, generator=g),
            "v": torch.randn(B, H, V, generator=g), "raw_g": torch.randn(B, H, K, generator=g),
            "raw_beta": torch.randn(B, H, generator=g), "A_log": 0.5 * torch.randn(H, generator=g),
            "dt_bias": torch.randn(H * K, generator=g), "state": torch.randn(S, H, V, K, generator=g),
            "state_indices": torch.randperm(S - 1, generator=g)[:B].to(torch.int32) + 1}


def _step_by_hand(d, b, h, lower_bound=-5.0):
    """One (sequence, head) in float64 with plain loops over the channels: (o (V,), S_new (V, K))."""
    q, k, v = (d[n][b, h].double() for n in ("q", "k", "v"))
    K = q.numel()
    q = q / math.sqrt(float((q * q).sum()) + 1e-6) / math.sqrt(K)
    k = k / math.sqrt(float((k * k).sum()) + 1e-6)
    a = math.exp(float(d["A_log"][h]))
    g = [lower_bound / (1 + math.exp(-a * (float(d["raw_g"][b, h, c]) + float(d["dt_bias"][h * K + c]))))
         for c in range(K)]
    beta = 1 / (1 + math.exp(-float(d["raw_beta"][b, h])))
    S = d["state"][int(d["state_indices"][b]), h].double().clone()
    for c in range(K):
        S[:, c] *= math.exp(g[c])
    u = beta * (v - S @ k)
    S += torch.outer(u, k)
    return S @ q, S


def _run(d, lower_bound=-5.0):
    d = {n: t.clone() for n, t in d.items()}
    B, H, _ = d["q"].shape
    out = torch.full((B, H, d["v"].shape[2]), float("nan"))
    kda_decode(**d, lower_bound=lower_bound, out=out)
    return out, d["state"]


def test_one_step_matches_the_recurrence_written_out():
    d = _inputs(seed=1)
    out, state = _run(d)
    for b in range(3):
        for h in range(2):
            o, S = _step_by_hand(d, b, h)
            torch.testing.assert_close(out[b, h].double(), o, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state[int(d["state_indices"][b]), h].double(), S, rtol=1e-5, atol=1e-6)


def test_lower_bound_is_the_argument():
    d = _inputs(seed=2)
    out, _ = _run(d, lower_bound=-2.0)
    o, _ = _step_by_hand(d, 1, 0, lower_bound=-2.0)
    torch.testing.assert_close(out[1, 0].double(), o, rtol=1e-5, atol=1e-6)


def test_gate_lies_between_the_lower_bound_and_zero():
    g = kda_gate(torch.tensor([[[-1e3, 0.0, 1e3]]]), torch.zeros(1), torch.zeros(3), -5.0)
    assert g.tolist() == [[[-0.0, -2.5, -5.0]]]


def test_padding_rows_output_zero_and_touch_no_slot_whatever_they_hold():
    """Rows with index 0 and -1 hold NaN inputs; the null slot holds NaN: outputs 0, every slot but the
    active rows' keeps its bits (slot -1 is not the last slot)."""
    d = _inputs(B=4, S=7, seed=3)
    d["state_indices"] = torch.tensor([5, 0, -1, 2], dtype=torch.int32)
    for n in ("q", "k", "v", "raw_g"):
        d[n][1:3] = float("nan")
    d["state"][0] = float("nan")
    before = d["state"].clone()
    out, state = _run(d)
    assert out[1:3].eq(0).all() and torch.isfinite(out).all()
    for s in (0, 1, 3, 4, 6):
        assert torch.equal(state[s].view(torch.int32), before[s].view(torch.int32)), s
    for b, s in ((0, 5), (3, 2)):
        o, S = _step_by_hand(d, b, 1)
        torch.testing.assert_close(out[b, 1].double(), o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[s, 1].double(), S, rtol=1e-5, atol=1e-6)


def test_zero_query_and_key_normalise_to_zero_not_nan():
    d = _inputs(B=1, S=2, seed=4)
    d["q"].zero_()
    d["k"].zero_()
    out, state = _run(d)
    assert out.eq(0).all()
    S0 = d["state"][1]
    torch.testing.assert_close(state[1], S0 * torch.exp(kda_gate(d["raw_g"][0], d["A_log"], d["dt_bias"], -5.0)).unsqueeze(1))


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(q=d["q"].double()), "q must be (3, 2, 5) float32; got (3, 2, 5) torch.float64"),
    (lambda d: d.update(state=d["state"][:, :, :, :4].contiguous()), "state must be (S, 2, 3, 5) float32"),
    (lambda d: d.update(state_indices=d["state_indices"].float()), "state_indices must be (3,) int32 or int64"),
    (lambda d: d.update(state_indices=torch.tensor([1, 2, 6], dtype=torch.int32)), "holds slot 6 but the pool has 6 slots"),
    (lambda d: d.update(state=d["state"].transpose(2, 3).contiguous().transpose(2, 3)), "state must be contiguous"),
    (lambda d: d.update(A_log=torch.zeros(4)), "A_log must be (2,) float32"),
])
def test_argument_errors_say_what_to_fix(change, message):
    d = _inputs()
    change(d)
    with pytest.raises(ValueError) as e:
        kda_decode(**d, out=torch.empty(3, 2, 3))
    assert str(e.value).startswith("k3_model.ops.kda_decode.kda_decode: ") and message in str(e.value)


def test_the_op_goes_through_the_dispatcher():
    d = _inputs()
    with dispatch.record_trace() as tr, dispatch.forward_context(decode_backend="latency_specialized", phase="decode"):
        kda_decode(**d, out=torch.empty(3, 2, 3))
    assert [(x.op, x.phase, x.rows) for x in tr.decisions] == [("kda_decode", "decode", 3)]
    if dispatch.declared_scope("kda_decode", "cpu") is None:  # main: no kernel merged
        assert tr.decisions[0].implementation == "standard"
        assert "no latency-specialized kernel merged for kda_decode" in tr.decisions[0].reason
    else:  # a user's `review approve` merged one: the dispatcher decides by its scope
        assert tr.decisions[0].implementation in ("standard", "latency_specialized")


# ---- K3-mini's KDA layer -------------------------------------------------------------------------------


def _kda_weights(nh=3, d=16, H=32, R=8, seed=5):
    g = _g(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    P = nh * d
    return KDAWeights(r(P, H) * .2, r(P, H) * .2, r(P, H) * .2, r(P, 1, 4), r(P, 1, 4), r(P, 1, 4), r(R, H) * .2,
                      r(P, R) * .3, r(max(nh, d)) * .5, r(P), r(nh, H) * .2, r(P, H) * .2, 1 + .1 * r(d), r(H, P) * .2)


def _decode_steps(w, x, state, n_prefill, kw):
    # decode steps get contiguous (B, 1, H) inputs, as in the model (RMSNorm outputs): F.linear over a strided
    # (B, 1, H) view takes torch's batched-GEMV path, whose bits differ from one GEMM over the B rows
    return torch.cat([kda_forward(w, x[:, :n_prefill], state, **kw)] +
                     [kda_forward(w, x[:, t:t + 1].contiguous(), state, **kw) for t in range(n_prefill, x.shape[1])], 1)


def _token_loop_forward(w, x, state, *, heads, head_dim, lower_bound, eps):
    """kda_forward as it was before the op (every chunk through the token loop), for a bitwise comparison."""
    B, T, _ = x.shape
    q, cq = _causal_conv_silu(F.linear(x, w.q_proj), w.q_conv1d, state.conv[:, 0])
    k, ck = _causal_conv_silu(F.linear(x, w.k_proj), w.k_conv1d, state.conv[:, 1])
    v, cv = _causal_conv_silu(F.linear(x, w.v_proj), w.v_conv1d, state.conv[:, 2])
    state.conv.copy_(torch.stack([cq, ck, cv], dim=1))
    q, k, v = (t.view(B, T, heads, head_dim) for t in (q, k, v))
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * head_dim ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    g = kda_gate(F.linear(F.linear(x, w.f_a_proj), w.f_b_proj).view(B, T, heads, head_dim), w.A_log, w.dt_bias,
                 lower_bound)
    o = kda_recurrence(q, k, v, g, torch.sigmoid(F.linear(x, w.b_proj).float()), state.recurrent)
    gate = torch.sigmoid(F.linear(x, w.g_proj).float()).view(B, T, heads, head_dim)
    return F.linear((rms_norm(o, w.o_norm, eps) * gate).reshape(B, T, -1).to(x.dtype), w.o_proj)


def test_layer_decode_steps_call_the_op_and_equal_the_token_loop_bit_for_bit():
    """Prefill 5 tokens, decode 4 (the op, one call per step): bitwise the outputs and state of the same
    steps through the token loop (the layer before the op): the op's standard path is the loop's float32
    math for one token, so the model's numbers did not change."""
    w, x = _kda_weights(), torch.randn(2, 9, 32, generator=_g(6))
    kw = dict(heads=3, head_dim=16, lower_bound=-5.0, eps=1e-5)
    s1, s2 = KDAState.zeros(2, 3, 16, 4, "cpu"), KDAState.zeros(2, 3, 16, 4, "cpu")
    with dispatch.record_trace() as tr, dispatch.forward_context(decode_backend="latency_specialized", phase="decode"):
        stepped = _decode_steps(w, x, s1, 5, kw)
    assert [(d.op, d.rows) for d in tr.decisions if d.op == "kda_decode"] == [("kda_decode", 2)] * 4
    # each step's five input projections (q/k/v/f_a/b) run the small_m_gemm op
    assert [(d.op, d.rows) for d in tr.decisions if d.op != "kda_decode"] == [("small_m_gemm", 2)] * 20
    loop = torch.cat([_token_loop_forward(w, x[:, :5], s2, **kw)] +
                     [_token_loop_forward(w, x[:, t:t + 1].contiguous(), s2, **kw) for t in range(5, 9)], 1)
    assert torch.equal(stepped, loop) and torch.equal(s1.recurrent, s2.recurrent)
    assert s1.slots[0].eq(0).all() and s1.recurrent.data_ptr() == s1.slots[1].data_ptr()


def test_layer_decode_on_a_state_without_a_pool_copies_through_one():
    """A state built from plain tensors (the vLLM plugin's snapshots) decodes the same as a pooled one."""
    w, x = _kda_weights(), torch.randn(2, 7, 32, generator=_g(7))
    kw = dict(heads=3, head_dim=16, lower_bound=-5.0, eps=1e-5)
    pooled = KDAState.zeros(2, 3, 16, 4, "cpu")
    plain = KDAState(pooled.recurrent.clone(), pooled.conv.clone())
    assert plain.slots is None and plain.decode_pool()[1]
    a, b = _decode_steps(w, x, pooled, 4, kw), _decode_steps(w, x, plain, 4, kw)
    assert torch.equal(a, b) and torch.equal(pooled.recurrent, plain.recurrent)


def test_kda_recurrence_step_matches_the_op_on_the_same_inputs():
    """The layer's token loop (prefill) and the op agree on one token given the same raw inputs."""
    d = _inputs(B=2, H=3, K=8, V=8, S=3, seed=8)
    d["state_indices"] = torch.tensor([1, 2], dtype=torch.int32)
    out, state = _run(d)
    q = F.normalize(d["q"], dim=-1, eps=0) / math.sqrt(8)  # |q| >> 1e-3: the eps is negligible here
    S = d["state"][1:].clone()
    o = kda_recurrence(q.unsqueeze(1), F.normalize(d["k"], dim=-1).unsqueeze(1), d["v"].unsqueeze(1),
                       kda_gate(d["raw_g"], d["A_log"], d["dt_bias"], -5.0).unsqueeze(1),
                       torch.sigmoid(d["raw_beta"]).unsqueeze(1), S)
    torch.testing.assert_close(out, o[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[1:], S, rtol=1e-5, atol=1e-6)
