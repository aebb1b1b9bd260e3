"""Task spec loading: the real task loads; every kind of bad spec fails naming file, field, expected, got."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pydantic
import pytest

from workbench.errors import TaskSpecError
from workbench.taskspec import (
    check_constraint,
    eval_constraint,
    eval_dim,
    list_task_ids,
    load_task,
    load_task_file,
    shape_names,
)

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "tasks" / "k3_moe_dispatch"


def test_real_task_loads_with_k3_and_mini_sizes():
    t = load_task(REPO, "k3_moe_dispatch")
    assert t.task_id == "k3_moe_dispatch"
    assert t.allowed_paths == ("k3_model/kernels/moe_dispatch/**",)
    experts = {w.axes["E"] for w in t.correctness.workloads}
    assert {896, 32} <= experts  # real K3 and K3-mini both appear
    assert {w.axes["K"] for w in t.correctness.workloads if w.axes["E"] == 896} == {16}
    assert set(t.perf.workloads) <= {w.name for w in t.correctness.workloads}
    assert "k3_moe_dispatch" in list_task_ids(REPO)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        t.op = "x"  # type: ignore[misc]


def _task_with(tmp_path: Path, edit) -> Path:
    d = tmp_path / "tasks" / "k3_moe_dispatch"
    shutil.copytree(SRC, d, ignore=shutil.ignore_patterns("fixtures", "__pycache__"))
    p = d / "task.toml"
    p.write_text(edit(p.read_text()))
    return p


@pytest.mark.parametrize(
    "edit, must_contain",
    [
        (lambda s: s.replace('op = "moe_dispatch"', 'op = "moe_dispatch"\nfavourite_colour = "red"'),
         ["field 'favourite_colour'", "unknown field", "got 'red'"]),
        (lambda s: s.replace('shape = ["T", "E"]', 'shape = ["T", "N"]', 1),
         ["undefined axis 'N'", "defined axes", "Add it to [axes]"]),
        (lambda s: s.replace('workloads = ["k3_t1",', 'workloads = ["k3_t999",'),
         ["perf.workloads names 'k3_t999'", "every perf shape must also be a correctness shape"]),
        (lambda s: s.replace('source = "shared/reference/kernel_targets.md §3.5 (fp32 weights rtol 1e-5, atol 1e-6)"\n', ""),
         ["correctness.tolerance.topk_weights.source", "required field is missing"]),
        (lambda s: s.replace('allowed_paths = ["k3_model/kernels/moe_dispatch/**"]', 'allowed_paths = ["guards/**"]'),
         ["must lie under k3_model/"]),
        (lambda s: s.replace('allowed_paths = ["k3_model/kernels/moe_dispatch/**"]', 'allowed_paths = ["k3_model/../guards/**"]'),
         ["must be relative and stay inside the tree"]),
        (lambda s: s.replace('requests_max = 64', 'requests_max = 0'), ["scope.requests_max"]),
        (lambda s: s.replace('dtype = "float32"', 'dtype = "float33"', 1), ["inputs.router_logits.dtype", "float33"]),
        (lambda s: s.replace('axes = { T = 1, Q = 1, E = 896, K = 16, G = 1, TG = 1, B = 16 }', 'axes = { T = 1, E = 896 }', 1),
         ["workload 'k3_t1' sets axes ['E', 'T']", "expected exactly"]),
        (lambda s: s.replace('name = "k3_t2"', 'name = "k3_t1"', 1), ["name 'k3_t1' appears twice"]),
        (lambda s: s.replace('shape = ["T*K + E*(B-1)"]', 'shape = ["__import__(1)"]'), ["uses Call", "allowed"]),
        (lambda s: s + '\n[scope]\ndevices = ["cpu"]\n', ["not valid TOML"]),  # duplicate table
    ],
)
def test_bad_spec_names_file_field_expected_got(tmp_path, edit, must_contain):
    p = _task_with(tmp_path, edit)
    with pytest.raises(TaskSpecError) as ei:
        load_task_file(p)
    msg = str(ei.value)
    assert "k3_moe_dispatch" in msg and str(p.parent) in msg or "task.toml" in msg
    for fragment in must_contain:
        assert fragment in msg, (fragment, msg)


def test_unknown_task_lists_known_ones():
    with pytest.raises(TaskSpecError, match="known tasks: .*k3_moe_dispatch"):
        load_task(REPO, "no_such_task")


def test_missing_reference_is_named(tmp_path):
    p = _task_with(tmp_path, lambda s: s)
    (p.parent / "reference.py").unlink()
    with pytest.raises(TaskSpecError, match="reference.py is missing"):
        load_task_file(p)


def test_loader_owned_fields_are_refused(tmp_path):
    p = _task_with(tmp_path, lambda s: 'task_id = "other"\n' + s)
    with pytest.raises(TaskSpecError, match="set by the loader"):
        load_task_file(p)


@pytest.mark.parametrize(
    "expr, axes, value",
    [("T", {"T": 7}, 7), ("T*K + E*(B-1)", {"T": 2, "K": 16, "E": 896, "B": 16}, 2 * 16 + 896 * 15),
     ("cdiv(T*K + E*(B-1), B)", {"T": 1, "K": 1, "E": 1, "B": 16}, 1), ("cdiv(17, 16)", {}, 2),
     ("max(T, 4) // 2", {"T": 9}, 4), ("1", {}, 1)],
)
def test_eval_dim(expr, axes, value):
    assert eval_dim(expr, axes) == value


def test_eval_dim_rejects_unknown_axis_and_code():
    with pytest.raises(ValueError, match="needs axis 'Q'"):
        eval_dim("Q + 1", {"T": 1})
    with pytest.raises(ValueError, match="allowed"):
        eval_dim("T.bit_length()", {"T": 1})
    assert shape_names("cdiv(T*K, B)") == {"T", "K", "B"}


# --- declared input domain ([domain], issue 12 item 5 / issue 19) ---

@pytest.mark.parametrize(
    "edit, must_contain",
    [
        (lambda s: s.replace("[domain.axes.T]\nmin = 1\n", "[domain.axes.T]\nmin = 1\nstep = 2\n"),
         ["field 'domain.axes.T.step'", "unknown field"]),
        (lambda s: s.replace("[domain.axes.T]\nmin = 1\n", "[domain.axes.T]\nchoices = [1, 2]\nmin = 1\n"),
         ["domain.axes.T", "exactly one form"]),
        (lambda s: s.replace("[domain.axes.B]\nchoices = [16, 32, 64, 128]\nrealistic = [16]",
                             "[domain.axes.B]\nchoices = [16, 32, 64, 128]\nrealistic = [256]"),
         ["domain.axes.B", "realistic value 256 is not among the choices"]),
        (lambda s: s.replace('constraints = ["E % G == 0",', 'constraints = ["__import__(\'os\')", "E % G == 0",'),
         ["domain", "uses Call", "allowed: axis and parameter names"]),
        (lambda s: s.replace('constraints = ["E % G == 0",', 'constraints = ["E % Z == 0", "E % G == 0",'),
         ["domain.constraints: 'E % Z == 0' names 'Z'", "neither an axis nor a declared param"]),
        (lambda s: s.replace('constraints = ["E % G == 0",', 'constraints = ["K <= 8", "E % G == 0",'),
         ["correctness workload 'k3_t1' violates domain constraint 'K <= 8'"]),
        (lambda s: s.replace("[domain.axes.B]\nchoices = [16, 32, 64, 128]", "[domain.axes.B]\nchoices = [16, 32, 128]"),
         ["workload 'k3_t64_b64': axis B = 64 is outside domain.axes.B"]),
        (lambda s: s.replace("[domain.axes.T]\nmin = 1\nmax = 512", "[domain.axes.T]\nmin = 1\nmax = 1024"),
         ["domain.axes.T allows [1, 1024], so token rows [1, 1024], outside the scope's token rows range [1, 512]"]),
        (lambda s: re.sub(r"\[domain\.params\.renormalize\]\n.*?\n\n", "", s, flags=re.S),
         ["domain.params must declare exactly the params the workloads set", "missing ['renormalize']"]),
        (lambda s: s.replace('cases = ["realistic", "bias_shift", "tiny_scale", "wide_bias"]', 'cases = ["realistic", "tiny_scale", "wide_bias"]'),
         ["regime or overlay 'bias_shift' is named by no input's 'cases'"]),
        (lambda s: s.replace('cases = ["realistic", "padding_rows"]', 'cases = ["realistic", "padding_rowz"]'),
         ["inputs.token_valid.cases names regime 'padding_rowz'", "known:"]),
        (lambda s: s.replace('requires = "T >= 2"', 'requires = "T >= "'), ["not a valid expression"]),
        (lambda s: s.replace('case = "far_negative"', 'case = "far_negative+padded"'),
         ["workload 'edge_far_negative'", "overlay 'padded', which is not in [domain.overlays]", "known: padding_rows"]),
        (lambda s: s.replace('case = "far_negative"', 'case = "far_negative+padding_rows"').replace(
            "axes = { T = 6, Q = 1, E = 64, K = 6, G = 1, TG = 1, B = 16 }", "axes = { T = 1, Q = 1, E = 64, K = 6, G = 1, TG = 1, B = 16 }"),
         ["workload 'edge_far_negative'", "overlay 'padding_rows' requires 'T >= 2'"]),
        (lambda s: s.replace("[domain.overlays.padding_rows]", "[domain.overlays.ties]"),
         ["'ties' is both a regime and an overlay"]),
        (lambda s: s.replace('apply = "pad_rows"', 'apply = "pad rows"'), ["domain.overlays.padding_rows.apply"]),
        (lambda s: s.replace('cost_source = "the reference', 'cost_sourc = "the reference'),
         ["cost_sourc", "unknown field"]),
        (lambda s: s.replace("[domain.params.routed_scaling_factor]\nmin = 0.25", "[domain.params.routed_scaling_factor]\nmin = 0.0"),
         ["domain.params.routed_scaling_factor", "'log' needs min > 0"]),
    ],
)
def test_bad_domain_names_file_field_expected_got(tmp_path, edit, must_contain):
    p = _task_with(tmp_path, edit)
    with pytest.raises(TaskSpecError) as e:
        load_task_file(p)
    msg = str(e.value)
    assert str(p) in msg
    for m in must_contain:
        assert m in msg, (m, msg)


def test_every_task_declares_its_domain():
    for tid in list_task_ids(REPO):
        t = load_task(REPO, tid)
        assert t.domain is not None, tid
        assert set(t.domain.axes) == set(t.axes) and set(t.domain.inputs) == set(t.inputs)
        assert "realistic" in t.domain.regimes and t.domain.regimes["realistic"].realistic


@pytest.mark.parametrize("expr, values, expected", [
    ("E % G == 0", {"E": 896, "G": 8}, True),
    ("E % G == 0", {"E": 60, "G": 8}, False),
    ("K <= E // G * TG", {"K": 8, "E": 256, "G": 8, "TG": 4}, True),
    ("1 <= TG <= G", {"TG": 5, "G": 4}, False),
    ("renormalize or G == 1", {"renormalize": False, "G": 2}, False),
    ("not renormalize and cdiv(T, 2) >= 3", {"renormalize": False, "T": 5}, True),
    ("B * (D + 1) * V * Q <= 4194304", {"B": 64, "D": 7, "V": 4096, "Q": 2}, True),
])
def test_eval_constraint(expr, values, expected):
    assert eval_constraint(expr, values) is expected


def test_eval_constraint_refuses_non_bool_missing_names_and_code():
    with pytest.raises(ValueError, match="not True/False"):
        eval_constraint("E - G", {"E": 2, "G": 1})
    with pytest.raises(ValueError, match="needs 'G'"):
        eval_constraint("E % G == 0", {"E": 2})
    with pytest.raises(ValueError, match="divides by zero"):
        eval_constraint("E % G == 0", {"E": 2, "G": 0})
    for bad in ("E.real > 0", "E[0] > 0", "'a' == 'a'", "open('x') == 1", "lambda: 1"):
        with pytest.raises(ValueError, match="uses"):
            check_constraint(bad)


def test_a_target_the_checkout_does_not_define_is_the_tasks_error():
    """A new user's finding: a task.toml whose target names no function made every candidate's
    correctness FAIL ("the candidate's code did not complete") with exit 1; the task loads with a clear
    error now, naming the task.toml (exit 2 from the CLI)."""
    from workbench.errors import TaskSpecError
    from workbench.taskspec import check_target

    t = load_task(REPO, "k3_moe_dispatch")
    check_target(REPO, t)  # the real target passes
    with pytest.raises(TaskSpecError, match=r"k3_model/ops/moe_dispatch.py defines no top-level 'nope'; it "
                                            r"defines .*moe_route_dispatch.*\. Fix 'target'"):
        check_target(REPO, t.model_copy(update={"target": "k3_model.ops.moe_dispatch:nope"}))
    with pytest.raises(TaskSpecError, match=r"names module k3_model.ops.no_such_op, but neither "
                                            r"k3_model/ops/no_such_op.py nor k3_model/ops/no_such_op/__init__.py"):
        check_target(REPO, t.model_copy(update={"target": "k3_model.ops.no_such_op:f"}))
