"""Library peers for ``workbench bench`` (workbench/peers.py, tasks/*/peers.py): declaration, discovery,
the not-run reasons and the configurations a peer cannot run. The timing itself needs CUDA (bench)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from workbench.peers import Peer, task_peers
from workbench.taskspec import load_task

ROOT = Path(__file__).resolve().parents[2]


def _noop_build(inputs, kwargs):
    return lambda: None


def test_moe_declares_quack_and_flashinfer_and_says_why_they_do_not_run_here():
    peers = task_peers(load_task(ROOT, "k3_moe_dispatch"))
    assert [p.name for p in peers] == ["quack_topk", "flashinfer_routing"]
    info = {p.name: p.describe() for p in peers}
    assert info["quack_topk"]["distribution"] == "quack-kernels"
    assert "no block alignment" in info["quack_topk"]["covers"]
    pytest.importorskip("torch")
    try:
        import quack.topk  # noqa: F401
    except Exception:
        assert info["quack_topk"]["status"] == "not run"
        assert info["quack_topk"]["reason"].startswith("quack-kernels is not importable here")
        assert "pip install -e '.[peers]'" in info["quack_topk"]["reason"]
    else:
        assert info["quack_topk"] == {**info["quack_topk"], "status": "run", "reason": None}


def test_quack_peer_refuses_configurations_it_cannot_compute():
    peers = {p.name: p for p in task_peers(load_task(ROOT, "k3_moe_dispatch"))}
    q = peers["quack_topk"]
    ok = {"n_group": 1, "top_k": 16}
    assert q.applies({"E": 896}, ok) is None
    assert "G > 1" in q.applies({"E": 896}, {"n_group": 8, "top_k": 16})
    assert "power-of-two k" in q.applies({"E": 896}, {"n_group": 1, "top_k": 6})
    assert "4096" in q.applies({"E": 5000}, ok)


def test_a_task_without_peers_has_none_and_a_bad_declaration_is_named(tmp_path):
    assert task_peers(types.SimpleNamespace(root=str(tmp_path), task_id="nopeers")) == []
    (tmp_path / "peers.py").write_text("PEERS = ['not a peer']\n")
    with pytest.raises(TypeError, match=r"peers\.py: PEERS must be a list of workbench\.peers\.Peer; got list"):
        task_peers(types.SimpleNamespace(root=str(tmp_path), task_id="badpeers"))


def test_a_declared_peer_without_adapter_is_listed_as_not_run_with_its_note():
    peers = task_peers(load_task(ROOT, "k3_dspark_verify"))
    assert [p.name for p in peers] == ["flashinfer_chain_speculative"]
    d = peers[0].describe()
    assert d["status"] == "not run"
    assert d["reason"].startswith("no adapter written yet: FlashInfer never imported on the project's H200")


def test_peer_names_become_result_keys_so_odd_names_are_refused():
    with pytest.raises(ValueError, match="letters, digits and '_'"):
        Peer(name="flash-infer", distribution="x", module="x", covers="x", build=_noop_build)
    p = Peer(name="lib_a1", distribution="surely-not-installed-dist", module="surely_not_a_module_here",
             covers="all", build=_noop_build)
    d = p.describe()
    assert d["status"] == "not run" and d["version"] is None
    assert "surely-not-installed-dist is not importable here (ModuleNotFoundError" in d["reason"]


def test_kda_declares_fla_with_an_adapter():
    """FLA's fused recurrent KDA is declared with an adapter, listed as not run where FLA is missing."""
    peers = task_peers(load_task(ROOT, "k3_kda_decode"))
    assert [p.name for p in peers] == ["fla_fused_recurrent"]
    peer = peers[0]
    assert peer.distribution == "fla-core" and peer.build is not None
    info = peer.describe()
    if info["status"] == "not run":
        assert info["reason"].startswith("fla-core is not importable here")


@pytest.mark.gpu
def test_kda_fla_peer_computes_the_op_on_cuda():
    """Where FLA and CUDA are here, the peer's step matches the task's reference (active rows)."""
    pytest.importorskip("fla.ops.kda.fused_recurrent")
    import torch

    peer = task_peers(load_task(ROOT, "k3_kda_decode"))[0]
    import importlib.util

    root = ROOT / "tasks" / "k3_kda_decode"
    mods = {}
    for name in ("inputs", "reference"):
        spec = importlib.util.spec_from_file_location(f"_kda_{name}", root / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    task = load_task(ROOT, "k3_kda_decode")
    w = task.workload("k3_b8")
    x = mods["inputs"].make_inputs(w.axes, 3, w.case or "realistic")
    x["state_indices"] = x["state_indices"].abs().clamp(min=1)  # no padding rows: the peer has none
    want = mods["reference"].reference(x, w.params)
    cuda = {n: t.cuda() for n, t in x.items()}
    peer.build(cuda, w.params)()  # the adapter runs (on its own copies)
    from guards.cases import load_task_module

    state, out = cuda["state"].clone(), torch.empty_like(cuda["v"].unsqueeze(1))
    load_task_module(task, "peers").fla_step(cuda, lower_bound=w.params["lower_bound"], state=state,
                                             slots=cuda["state_indices"].int(), out=out)
    torch.cuda.synchronize()
    got = {"out": out.squeeze(1).cpu(), "state": state.cpu()}
    assert mods["reference"].check(x, w.params, got, want, task.correctness.tolerance) == []


def test_small_m_gemm_cublas_peer_computes_the_op_within_the_task_tolerance():
    """The cuBLAS peer (F.linear) is the whole op: on the task's inputs (here on CPU, where F.linear is
    the same call) its output passes the task's checker against the float64 reference."""
    import torch

    from guards.cases import load_task_module

    task = load_task(ROOT, "k3_small_m_gemm")
    (peer,) = task_peers(task)
    assert peer.name == "cublas_linear" and peer.describe()["status"] != "not run"
    inputs = load_task_module(task, "inputs").make_inputs({"M": 5, "N": 300, "K": 257}, 3, "realistic")
    ref = load_task_module(task, "reference")
    got = peer.build(inputs, {})()
    assert got.shape == (5, 300) and got.dtype == torch.float32
    assert ref.check(inputs, {}, {"out": got}, ref.reference(inputs, {}), task.correctness.tolerance) == []
    wrong = got.clone()
    wrong[2, 7] += 1e-3
    assert ref.check(inputs, {}, {"out": wrong}, ref.reference(inputs, {}), task.correctness.tolerance) != []
