"""K3-mini with the good CPU kernel of every op it dispatches merged at once (issue 14's done-when): a
standalone greedy decode with ``decode_backend=latency_specialized`` takes each kernel on its decode
steps (lse_merge once the MLA cache holds two pages: split-KV), keeps prefill on the standard path, and
emits the standard path's tokens.

The kernels are the tasks' ``lean-torch-cpu`` fixtures, copied into a temporary folder placed first on
``k3_model.kernels.__path__`` (moe_dispatch's is merged on main already; the copy is the same kernel).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import k3_model.kernels as kernels_pkg
from k3_model import dispatch
from k3_model.decode import generate
from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
from k3_model.model import DISPATCHED_OPS, K3Model, random_weights

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = {op: ROOT / "tasks" / f"k3_{op}" / "fixtures" / "good" / "lean-torch-cpu" / "k3_model" / "kernels" / op
            for op in DISPATCHED_OPS}


@pytest.fixture
def every_kernel_merged(tmp_path, monkeypatch):
    root = tmp_path / "kernels"
    for op, src in FIXTURES.items():
        shutil.copytree(src, root / op)
    monkeypatch.setattr(kernels_pkg, "__path__", [str(root), *kernels_pkg.__path__])
    for name in ("_MODULES", "_KEYS", "_ROUTES", "_SCOPES"):
        monkeypatch.setattr(dispatch, name, {})
    for op in FIXTURES:  # a kernel module imported earlier in this process (main's moe_dispatch) is set aside
        for name in [m for m in sys.modules if m == f"k3_model.kernels.{op}" or m.startswith(f"k3_model.kernels.{op}.")]:
            monkeypatch.delitem(sys.modules, name)
    yield root
    for op in FIXTURES:
        for name in [m for m in sys.modules if m == f"k3_model.kernels.{op}" or m.startswith(f"k3_model.kernels.{op}.")]:
            del sys.modules[name]


def test_each_dispatched_op_takes_its_merged_kernel_on_decode_steps(every_kernel_merged):
    cfg = parse_hf_config(k3_mini_hf_config())
    model = K3Model(cfg, random_weights(cfg, 0))
    prompts = torch.randint(0, 3840, (4, 12), generator=torch.Generator().manual_seed(3))
    std = generate(model, prompts, 5, page_tokens=4)
    with dispatch.record_trace() as tr:
        ls = generate(model, prompts, 5, page_tokens=4, decode_backend="latency_specialized")
    assert torch.equal(ls.tokens, std.tokens)  # every kernel is contract-equivalent in float32
    by_op = {op: [d for d in tr.decisions if d.op == op] for op in DISPATCHED_OPS}
    for op, decisions in by_op.items():
        decode = [d for d in decisions if d.phase == "decode"]
        assert decode and all(d.implementation == "latency_specialized" for d in decode), (
            op, {(d.implementation, d.reason) for d in decode})
        assert all(d.implementation == "standard" for d in decisions if d.phase == "prefill"), op
    # the kernels ran from the merged copies, not from main's folders
    for op in DISPATCHED_OPS:
        assert Path(sys.modules[f"k3_model.kernels.{op}"].__file__).is_relative_to(every_kernel_merged), op
    # 12 prompt tokens in pages of 4 (3 pages and more): every decode step merges split-KV partials in each of
    # the 3 MLA layers; 5 new tokens are the prefill's 1 and 4 decode steps
    assert len([d for d in by_op["lse_merge"] if d.phase == "decode"]) == 3 * 4


def test_verification_steps_take_the_kernels_that_claim_them(every_kernel_merged):
    """Issue 21: on K3-mini's speculative verification steps (phase ``spec_verify``, 1 + D query tokens a
    request) the lean kernels, which claim query lengths up to 8, run: moe_dispatch over the step's B x 8
    rows, kda_decode once per query position, small_m_gemm on each request's projections (8 rows, within its
    ``rows_max`` of 16); the greedy tokens stay the plain loop's. lse_merge claims verification steps too, but
    K3-mini's verification runs MLA in the expanded form (T > 1, ``K3Model.forward_groups``), so it is not
    called there."""
    from k3_model.decode import SyntheticDrafter, generate_speculative

    cfg = parse_hf_config(k3_mini_hf_config())
    model = K3Model(cfg, random_weights(cfg, 0))
    prompts = torch.randint(0, 3840, (3, 12), generator=torch.Generator().manual_seed(3))
    reference = generate(model, prompts, 12, page_tokens=4).tokens
    with dispatch.record_trace() as tr:
        res = generate_speculative(model, prompts, 4, drafter=SyntheticDrafter(reference, 3, model.text.vocab_size),
                                   num_draft_tokens=7, page_tokens=4, decode_backend="latency_specialized")
    assert torch.equal(res.tokens[:, :4], reference[:, :4])
    verify = [d for d in tr.decisions if d.phase == "spec_verify"]
    by_op = {op: [d for d in verify if d.op == op] for op in DISPATCHED_OPS}
    for op, decisions in by_op.items():
        assert all(d.implementation == "latency_specialized" and d.query_len == 8 for d in decisions), (
            op, {(d.implementation, d.reason) for d in decisions})
    assert by_op["moe_dispatch"] and by_op["kda_decode"] and by_op["small_m_gemm"] and not by_op["lse_merge"]
    assert {d.rows for d in by_op["moe_dispatch"]} <= {8 * a for a in (1, 2, 3)}  # requests x (1 + 7 drafts)
    assert {d.rows for d in by_op["small_m_gemm"]} <= {1, 8}  # a KDA position, or a request's 8 MLA tokens
