"""The dispatcher: latency-specialized only when switched on, merged, and in the declared scope;
every decision recorded with its reason."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from k3_model import dispatch
from k3_model.dispatch import (
    DispatchError,
    OpScope,
    ScopeError,
    declared_scope,
    forward_context,
    parse_scope,
    record_trace,
)
from k3_model.ops.moe_dispatch import align_capacity, moe_route_dispatch

OPMOD = "k3_model.kernels.moe_dispatch"


@pytest.fixture
def fake_kernel(monkeypatch):
    """Install a fake merged kernel for moe_dispatch that marks its outputs, and clear the cache."""
    calls = []

    def entry(router_logits, e_score_correction_bias, token_valid, **kw):
        calls.append(router_logits.shape[0])
        from k3_model.ops.moe_dispatch import moe_route_dispatch_standard

        moe_route_dispatch_standard(router_logits, e_score_correction_bias, token_valid, **kw)

    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = OpScope(devices=("cpu",), requests_min=1, requests_max=16)
    mod.moe_route_dispatch = entry
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    yield calls
    dispatch._MODULES.clear()


def _call(T: int, E: int = 32, K: int = 4):
    cap, nb = align_capacity(T, K, E, 16)
    outs = dict(topk_weights=torch.empty(T, K), topk_ids=torch.empty(T, K, dtype=torch.int32),
                sorted_token_ids=torch.empty(cap, dtype=torch.int32), expert_ids=torch.empty(nb, dtype=torch.int32),
                num_tokens_post_padded=torch.empty(1, dtype=torch.int32))
    moe_route_dispatch(torch.randn(T, E), torch.zeros(E), torch.ones(T, dtype=torch.bool), top_k=K, n_group=1,
                       topk_group=1, renormalize=True, routed_scaling_factor=1.0, block_size=16, **outs)
    return outs


def test_in_scope_decode_runs_latency_specialized(fake_kernel):
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _call(8)
    assert tr.implementations() == ["latency_specialized"]
    assert fake_kernel == [8]
    assert "in scope" in tr.decisions[0].reason


@pytest.mark.parametrize(
    "backend, phase, T, reason",
    [("standard", "decode", 8, "decode_backend is standard"),
     ("latency_specialized", "prefill", 8, "phase 'prefill' not in ['decode']"),
     ("latency_specialized", "mixed", 8, "phase 'mixed'"),
     ("latency_specialized", "decode", 17, "requests 17 outside [1, 16]")],
)
def test_out_of_scope_falls_back_with_reason(fake_kernel, backend, phase, T, reason):
    with record_trace() as tr, forward_context(decode_backend=backend, phase=phase):
        _call(T)
    assert tr.implementations() == ["standard"]
    assert reason in tr.decisions[0].reason
    assert fake_kernel == []


def test_no_forward_context_is_standard_and_says_so(fake_kernel):
    with record_trace() as tr:
        _call(4)
    assert tr.decisions[0].implementation == "standard"
    assert tr.decisions[0].reason == "no forward context: step phase unknown"


def test_nothing_merged_is_reported(monkeypatch):
    # a kernel folder holding only its README imports as a namespace package (no __file__)
    monkeypatch.setitem(sys.modules, OPMOD, types.ModuleType(OPMOD))
    monkeypatch.setattr(dispatch, "_MODULES", {})
    assert declared_scope("moe_dispatch") is None
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _call(2)
    assert tr.decisions[0].reason == "no latency-specialized kernel merged for moe_dispatch"


def test_malformed_kernel_raises_instead_of_silent_fallback(monkeypatch):
    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = "cpu decode 1-64"  # neither an OpScope nor a dict
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    with forward_context(decode_backend="latency_specialized", phase="decode"):
        with pytest.raises(DispatchError, match="SCOPE must be a k3_model.dispatch.OpScope or a plain dict"):
            _call(2)


def test_missing_entry_point_raises(monkeypatch):
    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = OpScope(devices=("cpu",))
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    with forward_context(decode_backend="latency_specialized", phase="decode"):
        with pytest.raises(DispatchError, match="entry point 'moe_route_dispatch' is missing"):
            _call(2)


def test_bad_backend_name_is_a_clear_error():
    with pytest.raises(ValueError, match="decode_backend 'fast' is not one of"):
        with forward_context(decode_backend="fast", phase="decode"):
            pass


def test_standard_op_rejects_wrong_output_buffer():
    T, E, K = 2, 8, 2
    with pytest.raises(ValueError, match="output sorted_token_ids must be"):
        moe_route_dispatch(torch.randn(T, E), torch.zeros(E), torch.ones(T, dtype=torch.bool), top_k=K, n_group=1,
                           topk_group=1, renormalize=True, routed_scaling_factor=1.0, block_size=16,
                           topk_weights=torch.empty(T, K), topk_ids=torch.empty(T, K, dtype=torch.int32),
                           sorted_token_ids=torch.empty(3, dtype=torch.int32), expert_ids=torch.empty(2, dtype=torch.int32),
                           num_tokens_post_padded=torch.empty(1, dtype=torch.int32))


def test_group_limited_topk_negative_scores_stays_in_kept_group():
    # kernel_targets.md §3.4 / vLLM PR #13474: masked groups must be -inf, not 0
    cap, nb = align_capacity(1, 2, 8, 16)
    outs = dict(topk_weights=torch.empty(1, 2), topk_ids=torch.empty(1, 2, dtype=torch.int32),
                sorted_token_ids=torch.empty(cap, dtype=torch.int32), expert_ids=torch.empty(nb, dtype=torch.int32),
                num_tokens_post_padded=torch.empty(1, dtype=torch.int32))
    logits = torch.tensor([[2.0, 1, 0, 0, -1, -1, -2, -2]])
    moe_route_dispatch(logits, torch.full((8,), -1.0), torch.ones(1, dtype=torch.bool), top_k=2, n_group=4,
                       topk_group=1, renormalize=True, routed_scaling_factor=1.0, block_size=16, **outs)
    assert sorted(outs["topk_ids"][0].tolist()) == [0, 1]
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    got = dict(zip(outs["topk_ids"][0].tolist(), outs["topk_weights"][0].tolist()))
    assert got[0] == pytest.approx(float(s[0] / s.sum()), rel=1e-6)
    assert got[1] == pytest.approx(float(s[1] / s.sum()), rel=1e-6)


# --- Scope is data, not code (issue 12 item 4) ---------------------------------------------------------
# A SCOPE whose containers are code can answer ``in`` one way and list itself another: the activation
# guard reads the listing (``to_dict``), the dispatcher asks ``in``. These objects tell exactly that lie.


class _LyingPhases(tuple):
    """Lists only ("decode",) but says yes to every phase."""

    def __contains__(self, item):
        return True


class _LyingBatches:
    """Iterates 1..64 (what was tested) but contains every batch size."""

    def __iter__(self):
        return iter(range(1, 65))

    def __contains__(self, item):
        return True


class _Str(str):
    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


class _Big(int):
    """64 when printed, larger than any batch when compared."""

    def __ge__(self, other):
        return True


class _CoversAll(OpScope):
    def covers(self, batch):
        return True, "in scope (says the subclass)"


def _fake_module(monkeypatch, scope, entry=None):
    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = scope
    mod.moe_route_dispatch = entry or (lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    return mod


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": ("cpu",), "phases": _LyingPhases(("decode",))},
     f"OpScope field 'phases' must be a plain tuple of str; got {__name__}._LyingPhases "
     "(a subclass of tuple/list: its __contains__ and __iter__ can disagree). "
     "Write it as a literal, e.g. phases=(\"decode\",)."),
    ({"devices": ("cpu",), "tp_sizes": _LyingBatches()},
     f"OpScope field 'tp_sizes' must be a plain tuple of int; got {__name__}._LyingBatches."),
    ({"devices": (_Str("cpu"),)},
     f"OpScope field 'devices' item 0 must be exactly str; got {__name__}._Str."),
    ({"devices": ("cpu",), "tp_sizes": (True,)}, "OpScope field 'tp_sizes' item 0 must be exactly int; got bool."),
    ({"devices": ("cpu",), "requests_max": _Big(64)},
     f"OpScope field 'requests_max' must be exactly int; got {__name__}._Big."),
    ({"devices": ("cpu",), "requests_max": 64.0}, "OpScope field 'requests_max' must be exactly int; got float."),
    ({"devices": ()}, "OpScope field 'devices' is empty, so the kernel could never run"),
    ({"devices": ("cpu",), "requests_min": 0}, "OpScope requests range [0, 64] is empty or below 1"),
    ({"devices": ("cpu",), "requests_min": 65}, "OpScope requests range [65, 64] is empty or below 1"),
])
def test_opscope_construction_rejects_what_is_not_plain_data(kwargs, message):
    with pytest.raises(ScopeError) as info:
        OpScope(**kwargs)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, DispatchError)


def test_opscope_normalises_lists_to_plain_tuples():
    s = OpScope(devices=["cpu"], phases=["decode"], tp_sizes=[1, 2], dtypes=["float32"], requests_min=1, requests_max=8)
    assert (s.devices, s.phases, s.tp_sizes, s.dtypes) == (("cpu",), ("decode",), (1, 2), ("float32",))
    assert all(type(getattr(s, f)) is tuple for f in ("devices", "phases", "tp_sizes", "dtypes"))
    assert s.to_dict() == {"devices": ("cpu",), "phases": ("decode",), "tp_sizes": (1, 2), "dtypes": ("float32",),
                           "requests_min": 1, "requests_max": 8, "query_len_min": 1, "query_len_max": 1}


def test_dict_literal_scope_is_accepted_and_is_what_the_dispatcher_uses(monkeypatch):
    calls = []

    def entry(router_logits, e_score_correction_bias, token_valid, **kw):
        calls.append(router_logits.shape[0])
        from k3_model.ops.moe_dispatch import moe_route_dispatch_standard

        moe_route_dispatch_standard(router_logits, e_score_correction_bias, token_valid, **kw)

    _fake_module(monkeypatch, {"devices": ["cpu"], "phases": ("decode",), "requests_min": 2, "requests_max": 4}, entry)
    scope = declared_scope("moe_dispatch")
    assert scope == OpScope(devices=("cpu",), phases=("decode",), tp_sizes=(1,), dtypes=("float32",),
                            requests_min=2, requests_max=4)
    assert type(scope) is OpScope and type(scope.devices) is tuple
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        for T in (1, 2, 4, 5):
            _call(T)
    assert tr.implementations() == ["standard", "latency_specialized", "latency_specialized", "standard"]
    assert calls == [2, 4]
    assert tr.decisions[3].reason == "out of declared scope: requests 5 outside [2, 4]"


@pytest.mark.parametrize("scope, message", [
    ({"devices": ("cpu",), "phases": _LyingPhases(("decode",))},
     "k3_model.kernels.moe_dispatch (k3_model/kernels/moe_dispatch/): OpScope field 'phases' must be a plain tuple"),
    ({"devices": ("cpu",), "requests_max": _Big(64)},
     "k3_model.kernels.moe_dispatch (k3_model/kernels/moe_dispatch/): OpScope field 'requests_max' must be exactly int"),
    ({"devices": ("cpu",), "batch_limit": 64},
     "k3_model.kernels.moe_dispatch (k3_model/kernels/moe_dispatch/): SCOPE has key(s) that are not OpScope fields "
     "(batch_limit); expected keys among devices, phases, tp_sizes, dtypes, requests_min, requests_max, query_len_min, "
     "query_len_max, rows_max, shapes."),
    ({"phases": ("decode",)}, "k3_model.kernels.moe_dispatch (k3_model/kernels/moe_dispatch/): SCOPE lacks 'devices'"),
    (None, "k3_model.kernels.moe_dispatch (k3_model/kernels/moe_dispatch/): SCOPE must be a k3_model.dispatch.OpScope "
           "or a plain dict declaring where the kernel runs; no SCOPE is defined."),
    (types.MappingProxyType({"devices": ("cpu",)}), "k3_model.kernels.moe_dispatch (k3_model/kernels/moe_dispatch/): "
                                                    "SCOPE must be a k3_model.dispatch.OpScope or a plain dict"),
])
def test_scope_that_is_not_data_is_refused_before_any_call(monkeypatch, scope, message):
    _fake_module(monkeypatch, scope)
    with pytest.raises(ScopeError) as info:
        declared_scope("moe_dispatch")
    assert str(info.value).startswith(message)
    with forward_context(decode_backend="latency_specialized", phase="prefill"):
        with pytest.raises(ScopeError):  # never a silent fallback, never the kernel
            _call(2)


def test_opscope_subclass_is_refused(monkeypatch):
    """A subclass's ``covers`` is code: it could say yes to prefill while its fields say decode."""
    _fake_module(monkeypatch, _CoversAll(devices=("cpu",)))
    with pytest.raises(ScopeError, match=re.escape(f"got {__name__}._CoversAll (a subclass of OpScope")):
        declared_scope("moe_dispatch")


def test_scope_tampered_after_construction_is_refused(monkeypatch):
    """A frozen OpScope can still be written with object.__setattr__; parsing re-validates every field."""
    s = OpScope(devices=("cpu",))
    object.__setattr__(s, "phases", _LyingPhases(("decode",)))
    _fake_module(monkeypatch, s)
    with pytest.raises(ScopeError, match="OpScope field 'phases' must be a plain tuple of str"):
        declared_scope("moe_dispatch")


def test_scope_is_read_once_and_later_changes_change_nothing(monkeypatch):
    """Guards and dispatcher share the object parsed at import; rebinding or mutating SCOPE later is ignored."""
    mod = _fake_module(monkeypatch, OpScope(devices=("cpu",), requests_min=1, requests_max=16))
    first = declared_scope("moe_dispatch")
    assert first == mod.SCOPE and first is not mod.SCOPE  # a private copy
    mod.SCOPE = OpScope(devices=("cpu",), phases=("decode", "prefill"), requests_min=1, requests_max=128)
    assert declared_scope("moe_dispatch") is first
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _call(17)
    with record_trace() as tr2, forward_context(decode_backend="latency_specialized", phase="prefill"):
        _call(8)
    assert tr.implementations() == ["standard"] and tr2.implementations() == ["standard"]
    assert tr.decisions[0].reason == "out of declared scope: requests 17 outside [1, 16]"


def test_module_whose_scope_changes_per_read_is_read_once(monkeypatch):
    """A module class with a SCOPE property could answer the guard and the dispatcher differently."""
    reads = []

    class _Shifty(types.ModuleType):
        @property
        def SCOPE(self):
            reads.append(1)
            return OpScope(devices=("cpu",), requests_max=8 if len(reads) == 1 else 64)

    mod = _fake_module(monkeypatch, None)
    del mod.SCOPE
    mod.__class__ = _Shifty
    scope = declared_scope("moe_dispatch")
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _call(16)
    assert scope.requests_max == 8 and declared_scope("moe_dispatch") is scope
    assert tr.implementations() == ["standard"] and len(reads) == 1


def test_swapped_module_gets_its_own_parsed_scope(monkeypatch):
    """guards/_child_main.py swaps ``_MODULES[op]`` to time the base commit's kernel: each module keeps its scope."""
    cand = _fake_module(monkeypatch, OpScope(devices=("cpu",), requests_max=64))
    assert declared_scope("moe_dispatch").requests_max == 64
    base = types.ModuleType("base_kernel")
    base.__file__ = "<base>"
    base.SCOPE = OpScope(devices=("cpu",), requests_max=4)
    base.moe_route_dispatch = cand.moe_route_dispatch
    dispatch._MODULES["moe_dispatch"] = base
    assert declared_scope("moe_dispatch").requests_max == 4
    dispatch._MODULES["moe_dispatch"] = cand
    assert declared_scope("moe_dispatch").requests_max == 64


def test_memoised_routes_follow_the_module_swap_and_the_batch(monkeypatch):
    """``select`` memoises ``route`` per (op, scope, batch, ...): swapping the base commit's kernel in and
    out (guards/_child_main.py) and changing the batch still give each call its own decision and reason."""
    cand = _fake_module(monkeypatch, OpScope(devices=("cpu",), requests_max=64))
    base = types.ModuleType("base_kernel")
    base.__file__ = "<base>"
    base.SCOPE = OpScope(devices=("cpu",), requests_max=4)
    base.moe_route_dispatch = cand.moe_route_dispatch
    monkeypatch.setattr(dispatch, "_ROUTES", {})
    seen = []
    for mod, T in ((cand, 16), (cand, 16), (base, 16), (base, 4), (cand, 16), (base, 16)):
        dispatch._MODULES["moe_dispatch"] = mod
        with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
            _call(T)
        seen.append((tr.decisions[0].implementation, tr.decisions[0].reason))
    assert [s[0] for s in seen] == ["latency_specialized", "latency_specialized", "standard", "latency_specialized",
                                    "latency_specialized", "standard"]
    assert seen[0] == seen[1] == seen[4] and seen[2] == seen[5]
    assert seen[2][1] == "out of declared scope: requests 16 outside [1, 4]", seen[2]
    assert len(dispatch._ROUTES) == 3  # (cand, 16), (base, 16), (base, 4)


def test_standard_routed_as_a_kernel_takes_the_kernel_route_and_runs_the_standard_path(monkeypatch):
    """The perf guard's baseline stand-in (``StandardRoutedAsKernel``): routed with the kernel's scope, it runs
    and records the standard path, in scope and out of it, and computes what the standard path computes."""
    calls = []
    cand = _fake_module(monkeypatch, OpScope(devices=("cpu",), requests_max=8))
    cand.moe_route_dispatch = lambda *a, **k: calls.append("kernel")
    stand_in = dispatch.StandardRoutedAsKernel(declared_scope("moe_dispatch"))
    dispatch._MODULES["moe_dispatch"] = stand_in
    torch.manual_seed(0)
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        got = _call(8)
    torch.manual_seed(0)
    with forward_context(decode_backend="standard", phase="decode"):
        want = _call(8)
    assert calls == [] and tr.implementations() == ["standard"]
    assert tr.decisions[0].reason.startswith("the standard path routed as a kernel (in scope (phase decode, requests 8")
    assert all(torch.equal(got[k], want[k]) for k in want)
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _call(9)
    assert tr.decisions[0].reason == "out of declared scope: requests 9 outside [1, 8]" and calls == []
    # the stand-in costs what the kernel route costs: its scope is not parsed again, its reason is memoized
    # (session 24's red team: a new f-string a call, ~0.1 us, and a second parse of the scope in warm-up)
    monkeypatch.setattr(dispatch, "parse_scope", lambda *a, **k: pytest.fail("the stand-in's scope parsed again"))
    monkeypatch.setattr(dispatch, "_SCOPES", {})
    reasons = []
    for _ in range(2):
        with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
            _call(8)
        reasons.append(tr.decisions[0].reason)
    assert reasons[0] is reasons[1] and reasons[0].startswith("the standard path routed as a kernel")
    with pytest.raises(TypeError, match="expected an OpScope"):
        dispatch.StandardRoutedAsKernel({"devices": ("cpu",)})


def test_registering_op_shapes_empties_the_route_memo(monkeypatch):
    """A newly registered shape domain changes what ``route`` answers, so the memo starts again."""
    monkeypatch.setattr(dispatch, "_ROUTES", {("x",): (None, True, "stale")})
    monkeypatch.setattr(dispatch, "_OP_SHAPES", {})
    dispatch.register_op_shapes("memo_probe_op", {"N": {"min": 1}})
    assert dispatch._ROUTES == {}


def test_lying_scope_in_a_kernel_module_fails_at_import(monkeypatch, tmp_path):
    """The real import path: ``OpScope(...)`` in the module body refuses the container, the dispatcher says where."""
    pkg = tmp_path / "lying_scope_op"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from k3_model.dispatch import OpScope\n"
        "class Phases(tuple):\n"
        "    def __contains__(self, item):\n"
        "        return True\n"
        "SCOPE = OpScope(devices=('cpu',), phases=Phases(('decode',)))\n"
        "def lying_scope_op(*a, **k):\n"
        "    pass\n")
    import k3_model.kernels as kernels

    monkeypatch.setattr(kernels, "__path__", [*kernels.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "k3_model.kernels.lying_scope_op", raising=False)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    with pytest.raises(ScopeError) as info:
        declared_scope("lying_scope_op")
    assert str(info.value) == (
        "k3_model.kernels.lying_scope_op (k3_model/kernels/lying_scope_op/): invalid SCOPE while importing the "
        "kernel: OpScope field 'phases' must be a plain tuple of str; got k3_model.kernels.lying_scope_op.Phases "
        "(a subclass of tuple/list: its __contains__ and __iter__ can disagree). "
        "Write it as a literal, e.g. phases=(\"decode\",).")


def test_parse_scope_returns_a_fresh_equal_object():
    s = OpScope(devices=("cpu", "cuda"), tp_sizes=(1, 2), requests_max=32)
    p = parse_scope(s)
    assert p == s and p is not s
    assert parse_scope({"devices": ("cpu", "cuda"), "tp_sizes": [1, 2], "requests_max": 32}) == s


def _device_packages(tmp_path, monkeypatch, op: str, cuda_devices: str) -> None:
    """``k3_model/kernels/<op>/`` (SCOPE cpu) with a ``cuda/`` subpackage (SCOPE ``cuda_devices``), on a
    temporary entry of ``k3_model.kernels.__path__``."""
    import k3_model.kernels as pkg

    scope = 'SCOPE = OpScope(devices=({}), phases=("decode",), tp_sizes=(1,), dtypes=("float32",), requests_min=1, requests_max=64)\n'
    head = "from k3_model.dispatch import OpScope\n"
    (tmp_path / op / "cuda").mkdir(parents=True)
    (tmp_path / op / "__init__.py").write_text(head + scope.format('"cpu",') + "def run():\n    return 'cpu kernel'\n")
    (tmp_path / op / "cuda" / "__init__.py").write_text(head + scope.format(cuda_devices) + "def run():\n    return 'cuda kernel'\n")
    monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(tmp_path)])
    monkeypatch.setattr(dispatch, "_MODULES", {})
    monkeypatch.setattr(dispatch, "_KEYS", {})
    for name in (f"k3_model.kernels.{op}", f"k3_model.kernels.{op}.cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_device_subpackage_serves_its_device_and_the_op_package_the_others(tmp_path, monkeypatch):
    _device_packages(tmp_path, monkeypatch, "zz_two_devices", '"cuda",')
    assert dispatch.kernel_key("zz_two_devices", "cuda") == "zz_two_devices.cuda"
    assert dispatch.kernel_key("zz_two_devices", "cpu") == "zz_two_devices"
    assert dispatch.kernel_key("zz_two_devices", "mps") == "zz_two_devices"  # no subpackages for other types
    assert declared_scope("zz_two_devices", "cuda").devices == ("cuda",)
    assert declared_scope("zz_two_devices", "cpu").devices == ("cpu",)
    fn = dispatch.select("zz_two_devices", "run", lambda: "standard", 4, "cuda", "float32")
    assert fn() == "standard"  # no forward context: the standard path, as always
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        on_cuda = dispatch.select("zz_two_devices", "run", lambda: "standard", 4, "cuda", "float32")
        on_cpu = dispatch.select("zz_two_devices", "run", lambda: "standard", 4, "cpu", "float32")
    assert (on_cuda(), on_cpu()) == ("cuda kernel", "cpu kernel")
    assert tr.implementations() == ["latency_specialized", "latency_specialized"]


def test_a_device_subpackage_claiming_another_device_is_a_scope_error(tmp_path, monkeypatch):
    _device_packages(tmp_path, monkeypatch, "zz_greedy_sub", '"cpu", "cuda"')
    with pytest.raises(ScopeError, match=r"zz_greedy_sub/cuda/\): a device subpackage's SCOPE lists devices "
                                         r"\['cpu', 'cuda'\]; it serves 'cuda' only"):
        declared_scope("zz_greedy_sub", "cuda")
