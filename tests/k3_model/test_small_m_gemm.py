"""The small_m_gemm op's standard path against math written out here (kernel_targets.md §6.2, §6.4), its
argument checks, its dispatch, and K3-mini's decode projections through it."""

import pytest
import torch
import torch.nn.functional as F

from k3_model import dispatch
from k3_model.layers import in_proj
from k3_model.ops.small_m_gemm import small_m_gemm


def _gemm(x, w):
    out = torch.full((x.shape[0], w.shape[0]), 7.0, dtype=x.dtype)
    small_m_gemm(x, w, out=out)
    return out


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("M, N, K", [(1, 3, 5), (2, 577, 256), (5, 1001, 1037), (16, 96, 7), (64, 4, 256)])
def test_rows_times_weight_transposed_to_float64_rounding(M, N, K):
    """out[m, n] = sum_k x[m, k] W[n, k]: against a float64 dot product per element (odd and tail sizes)."""
    x, w = torch.randn(M, K, generator=_g(M)), torch.randn(N, K, generator=_g(N)) * 0.02
    want = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    assert bool(((_gemm(x, w).double() - want).abs() <= 2.4e-7 * K ** 0.5 * scale + 2.4e-7 * want.abs()).all())


def test_written_out_small_case_is_exact():
    x = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    w = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.25, 2.0]])
    assert _gemm(x, w).tolist() == [[-2.0, 7.0], [0.0, 0.0]]  # a zero (padding) row gives exactly 0


def test_standard_path_is_bit_for_bit_f_linear_on_the_models_decode_rows():
    """K3-mini's projections before the op: F.linear over (B, 1, H); the op must not change a bit."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 1, 256, generator=_g(3)).to(dtype)
        w = (torch.randn(576, 256, generator=_g(4)) * 0.02).to(dtype)
        assert torch.equal(in_proj(x, w), F.linear(x, w))
        xp = torch.randn(5, 4, 256, generator=_g(5)).to(dtype)  # a prefill chunk: F.linear itself
        assert torch.equal(in_proj(xp, w), F.linear(xp, w))


def test_a_row_view_of_a_wider_buffer_is_handled():
    """A sliced single-row view is contiguous but not packed (kernel_targets.md §6.4): row stride > K."""
    buf = torch.randn(4, 300, generator=_g(6))
    x, w = buf[:, :256], torch.randn(33, 256, generator=_g(7))
    assert x.stride() == (300, 1)
    torch.testing.assert_close(_gemm(x, w), x.contiguous() @ w.t(), rtol=0, atol=0)
    one = buf[2:3, 10:266]
    torch.testing.assert_close(_gemm(one, w), one.contiguous() @ w.t(), rtol=0, atol=0)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Batch invariance (kernel_targets.md §6.4): row m alone or among 16 agrees to the rounding of a dot
    product (BLAS may sum in another order for another M: the task's bound, sqrt(K) x sum |x w| x 2^-22)."""
    x, w = torch.randn(16, 512, generator=_g(8)), torch.randn(300, 512, generator=_g(9))
    full = _gemm(x, w)
    bound = 2 * 2.4e-7 * 512 ** 0.5 * (x.abs() @ w.abs().t())
    for m in (0, 7, 15):
        assert bool(((_gemm(x[m:m + 1], w)[0] - full[m]).abs() <= bound[m]).all())


def test_inputs_are_not_modified():
    x, w = torch.randn(3, 64), torch.randn(10, 64)
    before = (x.clone(), w.clone())
    _gemm(x, w)
    assert torch.equal(x, before[0]) and torch.equal(w, before[1])


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.zeros(2, 1, 8)), r"x must be \(M, K\) and weight \(N, K\)"),
    (dict(weight=torch.zeros(4, 7)), r"weight must be \(N, 8\)"),
    (dict(weight=torch.zeros(4, 8, dtype=torch.bfloat16)), "x and weight must share one dtype"),
    (dict(x=torch.zeros(2, 8, dtype=torch.int32), weight=torch.zeros(4, 8, dtype=torch.int32)), "share one dtype"),
    (dict(out=torch.zeros(4, 2)), r"out must be \(2, 4\) torch.float32"),
    (dict(out=torch.zeros(2, 4, dtype=torch.float64)), r"out must be \(2, 4\) torch.float32"),
    (dict(x=torch.zeros(8, 2).t()), "x must have unit inner stride"),
    (dict(weight=torch.zeros(8, 4).t()), "weight must be packed row-major"),
    (dict(out=torch.zeros(4, 2).t()), "out must be packed row-major"),
])
def test_arguments_outside_the_contract_are_clear_errors(bad, message):
    args = dict(x=torch.zeros(2, 8), weight=torch.zeros(4, 8), out=torch.zeros(2, 4))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        small_m_gemm(args["x"], args["weight"], out=args["out"])


def test_the_op_is_dispatched_with_its_rows_as_batch_and_its_shape_axes():
    with dispatch.record_trace() as tr, dispatch.forward_context(decode_backend="latency_specialized", phase="decode"):
        _gemm(torch.zeros(5, 8), torch.zeros(4, 8))
        _gemm(torch.zeros(3, 8000), torch.zeros(4, 8000))  # K = 8000: outside the judged shapes
    assert [(d.op, d.rows) for d in tr.decisions] == [("small_m_gemm", 5), ("small_m_gemm", 3)]
    # the first call runs a merged kernel if the checkout has one (a user's `review approve` merges it), else the
    # standard path; the second is outside every judged shape, so it is standard either way
    assert tr.decisions[0].implementation in ("standard", "latency_specialized")
    assert tr.decisions[1].implementation == "standard"
    assert "K 8000 above 7168" in tr.decisions[1].reason or "no latency-specialized kernel" in tr.decisions[1].reason


def test_decode_projections_go_through_the_op_and_prefill_does_not():
    w = torch.randn(96, 256, generator=_g(10))
    with dispatch.record_trace() as tr:
        with dispatch.forward_context(decode_backend="latency_specialized", phase="prefill"):
            in_proj(torch.randn(2, 7, 256), w)
        with dispatch.forward_context(decode_backend="latency_specialized", phase="decode"):
            in_proj(torch.randn(3, 1, 256), w)
    assert [(d.op, d.phase, d.rows) for d in tr.decisions] == [("small_m_gemm", "decode", 3)]
