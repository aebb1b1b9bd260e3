"""The TP all-reduce + residual + RMSNorm task: spec rules, input grid, reference, checker, standard
path, the Triton kernel's math (interpreted on CPU) and the multi-rank harness pieces."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from guards.cases import build_case, rank_inputs
from guards.correctness import same_bits
from tests.conftest import REPO_ROOT
from workbench.errors import TaskSpecError
from workbench.taskspec import load_task, load_task_file

TASK = load_task(REPO_ROOT, "k3_allreduce_rmsnorm")
sys.path.insert(0, str(TASK.root))
import inputs as ar_inputs  # noqa: E402
import reference as ar_ref  # noqa: E402

TOL = TASK.correctness.tolerance
EPS = {"eps": 1e-5}


def _bf16_sum(parts: torch.Tensor) -> torch.Tensor:
    acc = parts[0].clone()
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r]
    return acc


# ------------------------------------------------------------------ spec


def _write_spec(tmp_path: Path, edit) -> Path:
    d = tmp_path / "k3_allreduce_rmsnorm"
    d.mkdir()
    text = (TASK.root / "task.toml").read_text()
    (d / "task.toml").write_text(edit(text))
    for f in ("reference.py", "inputs.py"):
        (d / f).write_text((TASK.root / f).read_text())
    return d / "task.toml"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace('inplace = true\ndescription = "bf16(R\'', 'description = "bf16(R\'', 1)
     .replace('[outputs.x]\nshape = ["T", "D"]', '[outputs.out]\nshape = ["T", "D"]\ninplace = true', 1)
     .replace("[correctness.tolerance.x]", "[correctness.tolerance.out]")
     .replace('identical_across_ranks = ["x", "residual"]', 'identical_across_ranks = ["residual"]'),
     "no input 'out'"),
    (lambda s: s.replace('identical_across_ranks = ["x", "residual"]', 'identical_across_ranks = ["x", "y"]'),
     "names 'y', which is not an output"),
    (lambda s: s.replace("tp_sizes = [1, 2, 4, 8]", "tp_sizes = [1, 2, 4]"), "world size W = 8 is outside"),
    (lambda s: s.replace('world_size_axis = "W"', 'world_size_axis = "Z"'), "world_size_axis 'Z' is not in [axes]"),
    (lambda s: "\n".join(l for l in s.splitlines() if not l.startswith("devices_reason")),
     "leaves a device out; say why in perf.devices_reason"),
    (lambda s: s.replace('shape = ["T", "D"]\ndtype = "bfloat16"\nper_rank = true', 'shape = ["T", "D"]\ndtype = "bfloat16"\ninplace = true', 1),
     "'inplace' applies to outputs only"),
])
def test_spec_rejects_inconsistent_distributed_fields(tmp_path, edit, message):
    with pytest.raises(TaskSpecError) as err:
        load_task_file(_write_spec(tmp_path, edit))
    assert message in str(err.value)


def test_per_rank_inputs_are_stacked_and_sliced_per_rank():
    w = TASK.workload("k3_w4_t3")
    case = build_case(TASK, w, seed=1)
    assert case.world_size == 4 and case.per_rank == ("x",)
    assert tuple(case.inputs_a["x"].shape) == (4, 3, 7168)
    r2 = rank_inputs(case.inputs_a, case.per_rank, 2)
    assert torch.equal(r2["x"], case.inputs_a["x"][2]) and r2["residual"] is case.inputs_a["residual"]
    assert r2["x"].data_ptr() != case.inputs_a["x"][2].data_ptr()  # a copy: ranks never share storage
    entry = case.request_entry(3)
    assert tuple(entry["inputs_a"]["x"].shape) == (3, 7168) and entry["world_size"] == 4
    assert entry["outputs"]["x"]["inplace"] and entry["outputs"]["residual"]["inplace"]


# ------------------------------------------------------------------ inputs: the exact grid


@pytest.mark.parametrize("case, W", [("realistic", 8), ("large_magnitude", 8), ("negative_zero", 4), ("zero_rows", 2)])
def test_grid_makes_every_fp32_summation_order_exact(case, W):
    d = ar_inputs.make_inputs({"W": W, "T": 8, "D": 512}, 7, case)
    parts = d["x"].float()
    forward = sum(parts[r] for r in range(W)) + d["residual"].float()
    backward = d["residual"].float() + sum(parts[r] for r in reversed(range(W)))
    pairwise = parts.view(W // 2, 2, 8, 512).sum(1).sum(0) + d["residual"].float() if W % 2 == 0 else forward
    exact = parts.double().sum(0) + d["residual"].double()
    assert torch.equal(forward.double(), exact) and torch.equal(backward.double(), exact)
    assert torch.equal(pairwise.double(), exact)


def test_order_sensitive_case_gives_rank_rotated_sums_other_bits_yet_within_tolerance():
    """Off the grid, a rank that sums from its own partial first ends with other bits than rank 0,
    while every order stays within the residual's 1-ulp tolerance (so only the cross-rank bitwise
    check can catch it)."""
    d = ar_inputs.make_inputs({"W": 4, "T": 16, "D": 7168}, 0, "order_sensitive")
    parts = d["x"].float()

    def summed(order):
        acc = parts[order[0]].clone()
        for r in order[1:]:
            acc = acc + parts[r]
        return acc.to(torch.bfloat16)

    rank0 = summed([0, 1, 2, 3])
    rotated = [summed([(r + i) % 4 for i in range(4)]) for r in range(1, 4)]
    assert all(int((a != rank0).sum()) > 0 for a in rotated)
    want = ar_ref.reference(d, EPS)
    tolerances = load_task(REPO_ROOT, "k3_allreduce_rmsnorm").correctness.tolerance
    tol = tolerances["residual"]
    for a in rotated:
        assert ar_ref.check(d, EPS, {"x": want["x"], "residual": a}, want, {"residual": tol, "x": tolerances["x"]}) == []
    with pytest.raises(ValueError, match="needs W >= 3"):
        ar_inputs.make_inputs({"W": 2, "T": 4, "D": 64}, 3, "order_sensitive")


def test_accumulation_trap_separates_bf16_from_fp32_accumulation():
    for W, ulps in ((4, 2.0), (8, 4.0)):
        d = ar_inputs.make_inputs({"W": W, "T": 4, "D": 64}, 3, "accumulation_trap")
        want = ar_ref.reference(d, EPS)["residual"]
        bad = _bf16_sum(d["x"]).float()
        err_ulp = ((bad - want.float()).abs() / ar_ref.ulp(want)).max().item()
        assert err_ulp == ulps
    with pytest.raises(ValueError, match="needs W >= 3"):
        ar_inputs.make_inputs({"W": 2, "T": 4, "D": 64}, 3, "accumulation_trap")


def test_nan_inf_case_puts_them_in_the_last_rank_only():
    d = ar_inputs.make_inputs({"W": 4, "T": 4, "D": 64}, 3, "nan_inf")
    assert torch.isnan(d["x"][3, 0]).sum() == 1 and torch.isinf(d["x"][3, 1]).sum() == 1
    assert torch.isfinite(d["x"][:3]).all()
    want = ar_ref.reference(d, EPS)
    assert torch.isnan(want["x"][0]).all()  # a NaN poisons its token's norm
    assert torch.isfinite(want["x"][2:]).all()


# ------------------------------------------------------------------ reference and checker


def _realistic(W=4, T=6, D=256, seed=1):
    d = ar_inputs.make_inputs({"W": W, "T": T, "D": D}, seed, "realistic")
    return d, ar_ref.reference(d, EPS)


def test_reference_matches_the_formula_and_check_accepts_it():
    d, want = _realistic()
    acc = d["x"].double().sum(0)
    a = acc.float().to(torch.bfloat16)
    r = (a.float() + d["residual"].float()).to(torch.bfloat16)
    assert torch.equal(want["residual"], r)
    assert ar_ref.check(d, EPS, {k: v.clone() for k, v in want.items()}, want, TOL) == []


def _low_mantissa_element(t: torch.Tensor) -> tuple[int, int]:
    """(row, col) of a large element whose mantissa is below 1.25 (where 3 ulp exceed 2^-6 relative)."""
    f = t.float().abs()
    m = f / torch.exp2(torch.floor(torch.log2(f.clamp(min=2.0 ** -126))))
    score = torch.where(m < 1.25, f, torch.zeros_like(f))
    return divmod(int(score.argmax()), t.shape[1])


def test_check_rejects_two_ulp_on_the_residual_and_three_on_the_output():
    d, want = _realistic()
    got = {k: v.clone() for k, v in want.items()}
    got["residual"][1, 5] = float(want["residual"][1, 5].float() + 2 * ar_ref.ulp(want["residual"][1, 5]))
    msgs = ar_ref.check(d, EPS, got, want, TOL)
    assert len(msgs) == 1 and msgs[0].startswith(
        "residual: 1 element(s) beyond 1 bf16 eps x max(|expected|, |got|); first at (1, 5)")
    got = {k: v.clone() for k, v in want.items()}
    i, j = _low_mantissa_element(want["x"])
    got["x"][i, j] = float(want["x"][i, j].float() + 3 * ar_ref.ulp(want["x"][i, j]))
    msgs = ar_ref.check(d, EPS, got, want, TOL)
    assert len(msgs) == 1 and msgs[0].startswith("x: 1 element(s) beyond 2 bf16 eps x max(|expected|, |got|)")
    got["x"][i, j] = float(want["x"][i, j].float() + ar_ref.ulp(want["x"][i, j]))  # 1 ulp: a rounding mode
    assert ar_ref.check(d, EPS, got, want, TOL) == []


def test_bound_does_not_tighten_just_below_a_power_of_two():
    """Expected 0.99609375 (just below 1), got 1.0078125: 3 ulp of the expected value (the old bound,
    2 ulp of it + atol, rejected it) but 1.2 ulp of the larger; vLLM's native RMSNorm rounds this way
    (issue 12). The new bound is the same relative width on both sides of the power of two."""
    D = 64
    want_row = torch.ones(1, D, dtype=torch.bfloat16)
    want_row[0, 0] = 0.99609375
    want = {"x": want_row, "residual": want_row.clone()}
    got = {"x": want_row.clone(), "residual": want_row.clone()}
    got["x"][0, 0] = 1.0078125
    w, g = want["x"][0, 0].float(), got["x"][0, 0].float()
    old_bound = 2 * ar_ref.ulp(w) + TOL["x"].atol * want["x"].float().pow(2).mean().sqrt()
    assert float((g - w).abs()) > float(old_bound)  # what the old checker rejected
    assert ar_ref.check({}, EPS, got, want, TOL) == []
    # the same relative error above the power of two passes too, and 4 ulp of the smaller value does not
    got["x"][0, 0] = 1.01953125
    assert ar_ref.check({}, EPS, got, want, TOL)[0].startswith("x: 1 element(s) beyond 2 bf16 eps")
    for m in (1.0, 1.25, 1.5, 1.75, 1.9921875):  # relative width: rtol x the larger magnitude everywhere
        b = ar_ref.bound(torch.tensor([m]), torch.tensor([m]), TOL["x"].rtol, 0.0, torch.zeros(1))
        assert float(b) == pytest.approx(m * 2.0 ** -6)
    # the residual's 1-eps bound keeps 1 ulp in and 2 ulp (one binade) out at every mantissa
    for m in (1.0, 1.5, 1.9765625):  # m + 2 ulp stays below 2
        x = torch.tensor([m])
        assert float(ar_ref.bound(x, x, TOL["residual"].rtol, 0.0, torch.zeros(1))) >= 2.0 ** -7
        assert float(ar_ref.bound(x + 2 ** -6, x, TOL["residual"].rtol, 0.0, torch.zeros(1))) < 2.0 ** -6


def _native_rmsnorm(d: dict, eps: float) -> dict:
    """vLLM's ``RMSNorm.forward_native`` after an fp32 all-reduce: the norm from the fp32 sum (not
    R'), ``(x * rsqrt(var + eps)).to(bf16) * weight`` (kernel_targets.md §1.1)."""
    a = d["x"].float().sum(0).to(torch.bfloat16)  # exact: the inputs' grid makes every order exact
    s = a.float() + d["residual"].float()
    out = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16) * d["weight"]
    return {"x": out, "residual": s.to(torch.bfloat16)}


@pytest.mark.parametrize("case", ["realistic", "negative_zero", "large_magnitude", "zero_rows", "nan_inf"])
def test_check_accepts_vllm_native_rounding(case):
    """task.toml says native rounding is covered; the old bound rejected it on 15 of 120 draws."""
    for seed in range(8):
        d = ar_inputs.make_inputs({"W": 4, "T": 16, "D": 7168}, seed, case)
        want = ar_ref.reference(d, EPS)
        assert ar_ref.check(d, EPS, _native_rmsnorm(d, EPS["eps"]), want, TOL) == [], (case, seed)


def test_check_treats_zero_signs_alike_and_nan_positions_exactly():
    d = ar_inputs.make_inputs({"W": 4, "T": 4, "D": 64}, 3, "nan_inf")
    want = ar_ref.reference(d, EPS)
    got = {k: v.clone() for k, v in want.items()}
    zeros = want["residual"] == 0
    got["residual"][zeros] = -0.0
    assert ar_ref.check(d, EPS, got, want, TOL) == []
    got["x"][0] = 0.0  # NaN scrubbed from the poisoned token
    msgs = ar_ref.check(d, EPS, got, want, TOL)
    assert msgs and msgs[0].startswith("x: NaN at other elements than the reference")
    got = {k: v.clone() for k, v in want.items()}
    got["residual"][1] = 1.0  # the +inf element made finite
    assert ar_ref.check(d, EPS, got, want, TOL)[0].startswith("residual: infinities differ")
    assert ar_ref.check(d, EPS, {"x": want["x"]}, want, TOL) == ["residual: expected (4, 64) torch.bfloat16, got NoneType"]


def test_ulp_of_bf16_values():
    v = torch.tensor([1.0, 1.5, -2.0, 0.25, 3e4], dtype=torch.bfloat16)
    assert ar_ref.ulp(v).tolist() == [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -9, 2.0 ** 7]


def test_same_bits_distinguishes_zero_signs_and_nan_payloads():
    a = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert same_bits(a, a.clone())
    b = a.clone()
    b[0] = -0.0
    assert not same_bits(a, b) and torch.equal(a[:2], b[:2])
    assert not same_bits(a, a.float()) and not same_bits(a, None) and not same_bits(a, a[:2])
    assert same_bits(torch.tensor([1, 2]), torch.tensor([1, 2])) and not same_bits(torch.tensor([1, 2]), torch.tensor([1, 3]))


# ------------------------------------------------------------------ the standard path


@pytest.mark.parametrize("case", ["realistic", "negative_zero", "nan_inf", "large_magnitude", "zero_rows"])
def test_standard_path_at_one_rank_is_the_reference_bit_for_bit(case):
    from k3_model.ops.allreduce_rmsnorm import allreduce_add_rmsnorm

    d = ar_inputs.make_inputs({"W": 1, "T": 5, "D": 7168}, 2, case)
    want = ar_ref.reference(d, EPS)
    x, res = d["x"][0].clone(), d["residual"].clone()
    allreduce_add_rmsnorm(x, res, d["weight"], eps=1e-5)
    assert same_bits(res, want["residual"]) and same_bits(x, want["x"])


def test_standard_path_rejects_a_contract_breach_with_a_clear_error():
    from k3_model.ops.allreduce_rmsnorm import allreduce_add_rmsnorm

    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual must match x"):
        allreduce_add_rmsnorm(x, torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), eps=1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        allreduce_add_rmsnorm(x, x.clone(), torch.ones(8), eps=1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        allreduce_add_rmsnorm(torch.zeros(8, 2, dtype=torch.bfloat16).t(), x.clone(), torch.ones(8, dtype=torch.bfloat16), eps=1e-5)


# ------------------------------------------------------------------ the Triton kernel's math, interpreted


def test_triton_kernel_math_matches_the_reference_under_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    kernel = TASK.root / "fixtures/good/triton-nccl-cuda/k3_model/kernels/allreduce_rmsnorm/__init__.py"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, sys, torch
        sys.path.insert(0, {str(REPO_ROOT)!r}); sys.path.insert(0, {str(TASK.root)!r})
        spec = importlib.util.spec_from_file_location("kern", {str(kernel)!r})
        kern = importlib.util.module_from_spec(spec); spec.loader.exec_module(kern)
        import inputs, reference
        from workbench.taskspec import load_task
        from pathlib import Path
        tol = load_task(Path({str(REPO_ROOT)!r}), "k3_allreduce_rmsnorm").correctness.tolerance
        bad = []
        for case, W, T, D in [("realistic", 3, 5, 7168), ("accumulation_trap", 4, 3, 256), ("nan_inf", 4, 4, 256),
                              ("negative_zero", 2, 4, 72), ("zero_rows", 2, 6, 256), ("large_magnitude", 8, 4, 256)]:
            d = inputs.make_inputs({{"W": W, "T": T, "D": D}}, 3, case)
            want = reference.reference(d, {{"eps": 1e-5}})
            parts = d["x"].reshape(W * T, D).contiguous()
            res, x = d["residual"].clone(), torch.empty(T, D, dtype=torch.bfloat16)
            block, warps = kern._launch_cfg(D)
            kern._reduce_add_norm[(T,)](parts, res, d["weight"], x, 0, T, D, 1e-5, W=W, NORM=True, BLOCK=block, num_warps=warps)
            bad += [case + ": " + m for m in reference.check(d, {{"eps": 1e-5}}, {{"x": x, "residual": res}}, want, tol)]
            x2 = torch.empty_like(x)  # the two-shot norm kernel gives the same bits from R'
            kern._norm[(T,)](res, d["weight"], x2, D, 1e-5, BLOCK=block, num_warps=warps)
            if not torch.equal(x2.view(torch.int16), x.view(torch.int16)):
                bad.append(case + ": norm kernel differs")
        print("MISMATCHES", bad)
    """))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MISMATCHES []" in out.stdout, out.stdout[-2000:]


@pytest.mark.gpu
def test_triton_kernel_on_the_gpu_matches_the_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import importlib.util

    kernel = TASK.root / "fixtures/good/triton-nccl-cuda/k3_model/kernels/allreduce_rmsnorm/__init__.py"
    spec = importlib.util.spec_from_file_location("_ar_kernel_gpu", kernel)
    kern = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kern)
    for case, W, T in [("realistic", 4, 64), ("accumulation_trap", 8, 16), ("nan_inf", 4, 4), ("negative_zero", 2, 33),
                       ("large_magnitude", 4, 8), ("zero_rows", 2, 6)]:
        d = ar_inputs.make_inputs({"W": W, "T": T, "D": 7168}, 5, case)
        want = ar_ref.reference(d, EPS)
        parts = d["x"].reshape(W * T, 7168).cuda()
        res, x = d["residual"].cuda(), torch.empty(T, 7168, dtype=torch.bfloat16, device="cuda")
        block, warps = kern._launch_cfg(7168)
        kern._reduce_add_norm[(T,)](parts, res, d["weight"].cuda(), x, 0, T, 7168, 1e-5, W=W, NORM=True,
                                    BLOCK=block, num_warps=warps)
        assert ar_ref.check(d, EPS, {"x": x.cpu(), "residual": res.cpu()}, want, TOL) == [], case
        if case != "nan_inf":
            assert same_bits(res.cpu(), want["residual"]), case  # one rounding each, as the reference
