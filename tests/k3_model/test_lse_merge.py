"""The lse_merge op's standard path against math written out here (kernel_targets.md §4.2, §4.4), its
argument checks, and its dispatch."""

import math

import pytest
import torch

from k3_model import dispatch
from k3_model.ops.lse_merge import lse_merge

INF = float("inf")


def _merge(outs, lses, base_e=True):
    N, B, H, D = outs.shape
    out, out_lse = torch.full((B, H, D), 7.0), torch.full((B, H), 7.0)
    lse_merge(outs, lses, base_e=base_e, out=out, out_lse=out_lse)
    return out, out_lse


def test_two_chunks_give_the_softmax_over_their_union():
    """Attention over 6 keys split 4 + 2: the merged output and LSE equal the unsplit softmax's."""
    g = torch.Generator().manual_seed(0)
    scores, values = torch.randn(6, generator=g) * 3, torch.randn(6, 5, generator=g)
    parts = [(scores[:4], values[:4]), (scores[4:], values[4:])]
    outs = torch.stack([torch.softmax(s, 0) @ v for s, v in parts]).view(2, 1, 1, 5)
    lses = torch.stack([torch.logsumexp(s, 0) for s, _ in parts]).view(2, 1, 1)
    out, out_lse = _merge(outs, lses)
    torch.testing.assert_close(out.view(5), torch.softmax(scores, 0) @ values, rtol=1e-6, atol=1e-6)
    assert abs(float(out_lse) - float(torch.logsumexp(scores, 0))) < 1e-5


def test_base_two_lses_merge_with_exp2_and_return_log2():
    outs = torch.tensor([1.0, 3.0]).view(2, 1, 1, 1)
    out, out_lse = _merge(outs, torch.tensor([1.0, 3.0]).view(2, 1, 1), base_e=False)  # weights 2 : 8
    assert float(out) == pytest.approx((2 * 1 + 8 * 3) / 10, rel=1e-6)
    assert float(out_lse) == pytest.approx(math.log2(10), rel=1e-6)


@pytest.mark.parametrize("marker", [-INF, INF, float("nan")])
@pytest.mark.parametrize("base_e", [True, False])
def test_empty_chunks_weigh_zero_even_with_nan_outputs_and_all_empty_rows_are_zero(marker, base_e):
    """Rows: (0) chunk 1 empty with a NaN output, (1) both chunks empty (NaN and inf outputs)."""
    outs = torch.tensor([[[[2.0]], [[float("nan")]]], [[[float("nan")]], [[INF]]]])  # (N=2, B=2, H=1, D=1)
    lses = torch.tensor([[[0.5], [marker]], [[marker], [marker]]])
    out, out_lse = _merge(outs, lses, base_e)
    assert out.view(-1).tolist() == [2.0, 0.0]
    assert float(out_lse[0]) == pytest.approx(0.5) and float(out_lse[1]) == -INF


def test_large_lses_do_not_overflow():
    """LSEs near +-1e4 (exp overflows fp32 above 88.7): finite and right to the rounding of L in fp32
    (ulp(1e4) = 1e-3 moves each weight by up to 5e-4 relative: reference.py lse_slack)."""
    outs = torch.tensor([1.0, -1.0]).view(2, 1, 1, 1)
    for shift in (1e4, -1e4):
        lses = torch.tensor([shift, shift + math.log(3.0)]).view(2, 1, 1)
        r = math.exp(float(lses[1, 0, 0]) - float(lses[0, 0, 0]))  # ~3, from the fp32 inputs
        out, out_lse = _merge(outs, lses)
        assert float(out) == pytest.approx((1 - r) / (1 + r), rel=2e-3)
        assert float(out_lse) == pytest.approx(float(lses[0, 0, 0]) + math.log1p(r), abs=2e-3)


def test_inputs_are_not_modified():
    outs, lses = torch.randn(3, 2, 4, 8), torch.tensor([[[1.0, INF, float("nan"), -INF]] * 2] * 3)
    before = (outs.clone(), lses.clone())
    _merge(outs, lses)
    assert torch.equal(outs, before[0]) and torch.equal(lses.isnan(), before[1].isnan())
    assert torch.equal(lses.nan_to_num(), before[1].nan_to_num())


@pytest.mark.parametrize("bad, message", [
    (dict(lses=torch.zeros(2, 1, 3)), r"lses must be \(2, 1, 4\) float32"),
    (dict(lses=torch.zeros(2, 1, 4, dtype=torch.float64)), r"lses must be \(2, 1, 4\) float32"),
    (dict(out=torch.zeros(1, 4, 8, dtype=torch.bfloat16)), r"out must be \(1, 4, 8\) torch.float32"),
    (dict(out_lse=torch.zeros(4, 1)), r"out_lse must be \(1, 4\) float32"),
    (dict(outs=torch.zeros(2, 1, 8, 4).transpose(2, 3)), "outs must be contiguous"),
    (dict(outs=torch.zeros(1, 4, 8)), r"outs must be \(N, B, H, D\)"),
])
def test_arguments_outside_the_contract_are_clear_errors(bad, message):
    args = dict(outs=torch.zeros(2, 1, 4, 8), lses=torch.zeros(2, 1, 4), out=torch.zeros(1, 4, 8),
                out_lse=torch.zeros(1, 4))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        lse_merge(args["outs"], args["lses"], out=args["out"], out_lse=args["out_lse"])


def test_the_op_is_dispatched_with_its_rows_as_batch_and_its_shape_axes():
    with dispatch.record_trace() as tr, dispatch.forward_context(decode_backend="latency_specialized", phase="decode"):
        _merge(torch.zeros(3, 5, 4, 8), torch.zeros(3, 5, 4))
        _merge(torch.zeros(17, 5, 4, 8), torch.zeros(17, 5, 4))  # N = 17: outside the judged shapes
    assert [(d.op, d.rows) for d in tr.decisions] == [("lse_merge", 5)] * 2
    # the first call runs a merged kernel if the checkout has one (a user's `review approve` merges it), else the
    # standard path; the second is outside every judged shape, so it is standard either way
    assert tr.decisions[0].implementation in ("standard", "latency_specialized")
    assert tr.decisions[1].implementation == "standard"
    assert "N 17 above 16" in tr.decisions[1].reason or "no latency-specialized kernel" in tr.decisions[1].reason
