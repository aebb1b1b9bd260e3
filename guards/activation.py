"""Activation guard: proof that the candidate's path really ran, exactly where it claims.

Reads the scope the candidate's kernel declares, the files the child imported and the dispatch trace
recorded during the correctness run. FAIL when no kernel is merged for the op, when none of the
candidate's changed Python files was imported (its change never ran: e.g. a kernel file no package
imports, or a change on top of a kernel already merged that leaves the running code as it was), when the declared scope reaches beyond
the task's scope (claims what was never tested), when a configuration inside the declared scope did
not run the latency-specialized implementation, or when one outside it did, or when the declared scope
is not plain data. "Inside the declared scope" is decided by the dispatcher's own rule: the reported
scope is parsed with :func:`k3_model.dispatch.parse_scope` and asked with :func:`k3_model.dispatch.route`
(the op's judged shape domain, then ``OpScope.covers``), so the guard and the dispatcher cannot read one
scope two ways. A configuration outside the shapes a kernel declares (``OpScope.shapes``) must run the
standard path; shape rules reaching beyond the task's ``[domain.axes]`` are an over-claim, like a batch
range beyond the task's.

Source: issue 2 guard 3; issue 12 item 4; DESIGN.md "K3 ops and the decode backend".
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from guards.base import GuardContext
from guards.verdict import Evidence, Status, Verdict
from k3_model.dispatch import BatchInfo, OpScope, ScopeError, op_shape_domain, parse_scope, route, shape_rule_admits

logger = logging.getLogger(__name__)

LS = "latency_specialized"


def _op_module(task) -> None:
    """Import the task's op module from the workbench's own checkout (never candidate code), so the op's
    shape axes and judged domain are registered with the dispatcher (:func:`k3_model.dispatch.register_op_shapes`)."""
    importlib.import_module(task.target.split(":")[0])


def case_shapes(task, axes: dict) -> dict[str, int]:
    """The op's shape axes of one configuration (task axis values named as the op registered them)."""
    _op_module(task)
    return {a: axes[a] for a in (op_shape_domain(task.op) or {}) if a in axes}


def shape_excess(shapes: dict, task) -> list[str]:
    """Ways declared shape rules (``OpScope.shapes``) reach beyond the task's ``[domain.axes]``: a listed
    choice the domain lacks, a ``min``/``max`` past the domain's ends, or rules no domain value meets
    (the kernel would never run). Empty list: they fit.

    Source: issue 19 item 1 (declared shapes in scope); a declared set must equal what the task tests,
    as for the batch range.
    """
    out = []
    dom = task.domain
    for axis, rule in shapes.items():
        spec = None if dom is None else dom.axes.get(axis)
        if spec is None:
            out.append(f"shapes axis {axis} has no [domain.axes.{axis}] in the task, so no shape of it is judged")
            continue
        if spec.choices is not None:
            values = [c for c in spec.choices if type(c) is int]
            lo, hi, legal = min(values), max(values), f"choices {values}"
        else:
            lo, hi, legal = int(spec.min), int(spec.max), f"[{spec.min}, {spec.max}]"
        extra = [c for c in rule.get("choices", ()) if not spec.contains(c)]
        if extra:
            out.append(f"shapes {axis} choices {extra} not in the task's domain {axis} {legal}")
        if rule.get("min", lo) < lo or rule.get("max", hi) > hi:
            out.append(f"shapes {axis} [{rule.get('min', lo)}, {rule.get('max', hi)}] exceeds the task's domain "
                       f"{axis} {legal}")
        if spec.choices is not None:
            empty = not any(shape_rule_admits(rule, c) for c in values)
        elif "choices" in rule:
            empty = not any(lo <= c <= hi and shape_rule_admits(rule, c) for c in rule["choices"])
        else:
            m, a, b = rule.get("multiple_of", 1), max(lo, rule.get("min", lo)), min(hi, rule.get("max", hi))
            empty = -(-a // m) * m > b
        if empty and not extra:
            out.append(f"shapes {axis} {rule} admits no value of the task's domain {axis} {legal}: the kernel "
                       "would never run")
    return out


def scope_excess(claimed: dict, task_scope, task=None) -> list[str]:
    """Ways the claimed scope exceeds the task's declared scope (empty list: it fits); with ``task``, also
    declared shape rules beyond its domain (:func:`shape_excess`)."""
    out = []
    for field, allowed in (("devices", task_scope.devices), ("phases", task_scope.phases),
                           ("tp_sizes", task_scope.tp_sizes), ("dtypes", task_scope.dtypes)):
        extra = sorted(set(claimed.get(field, ())) - set(allowed))
        if extra:
            out.append(f"{field} {extra} not in the task's {list(allowed)}")
    for k, what in (("requests", "requests"), ("query_len", "query length")):
        lo, hi = getattr(task_scope, f"{k}_min"), getattr(task_scope, f"{k}_max")
        if claimed.get(f"{k}_min", 1) < lo or claimed.get(f"{k}_max", 0) > hi:
            note = " (query length = 1 + draft tokens per request)" if k == "query_len" else ""
            out.append(f"{what} [{claimed.get(f'{k}_min')}, {claimed.get(f'{k}_max')}] exceeds the task's [{lo}, {hi}]"
                       + note)
    if task is not None and claimed.get("shapes"):
        out += shape_excess(claimed["shapes"], task)
    return out


def scope_expectation(ctx, backend: str = LS) -> dict:
    """The request field that makes a child importing the candidate's kernel fail unless it parses the very
    ``SCOPE`` the correctness run declared (``ctx.artifacts.scope``; ``guards/_child_main.py``): ``{}`` for a
    standard-path request (``backend`` other than ``latency_specialized``). A SCOPE computed at import (from
    a random draw, the time, the environment) could differ between processes, so the scope judged and the
    scope timed or served would differ (session 24's red team, helper-27). ``{}`` too when no scope was
    declared (a guard run without the correctness guard before it; in the pipeline the activation guard has
    failed such a candidate already)."""
    declared = ctx.artifacts.scope
    return {"expect_scope": declared} if backend == LS and declared is not None else {}


def claimed_scope(claimed: dict, op: str | None = None) -> OpScope:
    """The scope the child reported (``OpScope.to_dict`` with lists), parsed by the dispatcher's rules
    (with ``op``: its ``shapes`` axes checked against the op's, whose module must be imported).

    Raises:
        ScopeError: it is not plain data (the child's dispatcher would have refused it too).
    """
    return parse_scope(dict(claimed), where="the declared scope the correctness child reported", op=op)


def claims(claimed: dict | OpScope, *, phase: str, requests: int, query_len: int = 1, rows: int | None = None,
           device: str, dtype: str, tp: int = 1, op: str | None = None, shapes: dict[str, int] | None = None) -> bool:
    """Whether a configuration lies inside a claimed scope: the dispatcher's own rule
    (:func:`k3_model.dispatch.route` with ``op``: the op's judged shape domain and the kernel's
    ``shapes``; without: ``OpScope.covers`` alone).

    Args:
        phase, requests, query_len: the step (``ScopeSpec.step``: counts).
        rows: the op's token rows in the call (count); ``None``: ``requests``.
        op: the op name (its module imported, so its shape domain is registered); ``None``: no shape check
            beyond the scope's own ``shapes``.
        shapes: the configuration's shape axes (:func:`case_shapes`).

    Raises:
        ScopeError: ``claimed`` is a dict that is not plain scope data.
    """
    scope = claimed if type(claimed) is OpScope else claimed_scope(claimed)
    batch_info = BatchInfo(phase, requests, query_len, requests if rows is None else rows, device, dtype, tp,
                           dict(shapes or {}))
    return (route(op, scope, batch_info) if op is not None else scope.covers(batch_info))[0]


def scope_verdict(claimed: dict | None, task, device: str, tested_tp: list[int]) -> Verdict | None:
    """The activation guard's FAIL for a declared scope this run cannot vouch for, or ``None``.

    Fails a scope that is not plain data, that exceeds the task's (``scope_excess``), or that claims a
    device or TP size this run does not judge (a scope must equal what was tested).

    Args:
        claimed: the scope the child reported (``OpScope.to_dict`` with lists); ``None``: none declared
            (not judged here: the guard says no kernel is merged).
        device: the run's device.
        tested_tp: the world sizes the run's configurations use.
    """
    if claimed is None:
        return None
    try:
        _op_module(task)
        scope = claimed_scope(claimed, task.op)
    except ScopeError as exc:
        return Verdict(
            guard="activation", status=Status.FAIL,
            summary=f"The declared scope is not plain data: {exc}",
            evidence=(Evidence(name="declared_scope", value=str(claimed)[:300], path=f"k3_model/kernels/{task.op}/"),),
        )
    claimed = {k: list(v) if isinstance(v, tuple) else v for k, v in scope.to_dict().items()}
    excess = scope_excess(claimed, task.scope, task)
    untested = sorted(set(claimed["devices"]) - {device})
    if untested and not excess:
        excess = [f"devices {untested} were not judged in this run (device {device}); a scope must equal what "
                  f"was tested: drop them from SCOPE, or ship one kernel per device and judge each there"]
    untested_tp = sorted(set(claimed["tp_sizes"]) - set(tested_tp))
    if untested_tp and not excess:
        excess = [f"tp_sizes {untested_tp} were not judged in this run (world sizes tested on {device}: "
                  f"{sorted(set(tested_tp))}); a scope must equal what was tested: drop them from SCOPE, or judge "
                  f"the kernel on a machine with enough GPUs"]
    if excess:
        return Verdict(
            guard="activation", status=Status.FAIL,
            summary=f"The kernel claims a scope the task does not test: {excess[0]}.",
            evidence=tuple(Evidence(name="scope_excess", value=e) for e in excess),
        )
    return None


def files_for_other_devices(op: str, device: str, worktree, changed: list[str]) -> list[str]:
    """Changed files under ``k3_model/kernels/<op>/`` that do not serve ``device``: with a device
    subpackage ``<op>/<device>/`` in the candidate (``k3_model.dispatch.kernel_key``), everything outside
    it; without one, the files of other devices' subpackages (``<op>/<other device>/``).

    Source: k3_model/dispatch.py ``kernel_key`` (one kernel package per device, each judged there).
    """
    from pathlib import Path

    from k3_model.dispatch import KERNEL_DEVICES

    root = f"k3_model/kernels/{op}/"
    mine = f"{root}{device}/"
    has_sub = device in KERNEL_DEVICES and (Path(worktree) / mine / "__init__.py").is_file()
    out = []
    for f in changed:
        if not f.startswith(root) or Path(f).name == "README.md":
            continue
        sub = _served_by_subpackage(op, f)
        if (sub != device) if has_sub else (sub is not None and sub != device):
            out.append(f)
    return sorted(out)


def _served_by_subpackage(op: str, path: str) -> str | None:
    """The device whose subpackage ``k3_model/kernels/<op>/<device>/`` holds ``path``, or ``None``."""
    from k3_model.dispatch import KERNEL_DEVICES

    return next((d for d in KERNEL_DEVICES if path.startswith(f"k3_model/kernels/{op}/{d}/")), None)


def base_scope_devices(text: str) -> list[str] | None:
    """The ``devices`` of the ``SCOPE = OpScope(devices=...)`` (or ``SCOPE = {"devices": ...}``) assignment
    in a kernel package's source, read without running it; ``None`` when it is not a literal there."""
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SCOPE" for t in node.targets)):
            continue
        value = None
        if isinstance(node.value, ast.Call):
            value = next((k.value for k in node.value.keywords if k.arg == "devices"), None)
        elif isinstance(node.value, ast.Dict):
            value = next((v for k, v in zip(node.value.keys, node.value.values)
                          if isinstance(k, ast.Constant) and k.value == "devices"), None)
        try:
            devices = ast.literal_eval(value) if value is not None else None
        except ValueError:
            return None
        if isinstance(devices, (tuple, list)) and all(isinstance(d, str) for d in devices):
            return list(devices)
        return None
    return None


def base_devices_changed(op: str, device: str, repo_root, base_commit: str, changed: list[str]) -> list[str]:
    """Devices other than ``device`` that the op's package (``k3_model/kernels/<op>/`` outside device
    subpackages) serves at the base, when the candidate changes that package; empty when it changes none
    of it, when the base has no kernel there, or when the base serves ``device`` only. A SCOPE that is not
    a literal counts as serving every device (``["unknown: SCOPE is not a literal"]``).

    Source: k3_model/dispatch.py ``kernel_key`` (one kernel package per device, each judged there).
    """
    import git

    root = f"k3_model/kernels/{op}/"
    flat = [f for f in changed if f.startswith(root) and Path(f).name != "README.md"
            and _served_by_subpackage(op, f) is None]
    if not flat:
        return []
    try:
        text = (git.Repo(repo_root).commit(base_commit).tree / f"{root}__init__.py").data_stream.read().decode()
    except (KeyError, ValueError, UnicodeDecodeError):
        return []  # nothing merged in the op's package at the base
    devices = base_scope_devices(text)
    if devices is None:
        return ["unknown: SCOPE is not a literal"]
    return sorted(set(devices) - {device})


class ActivationGuard:
    """Checks the recorded dispatch decisions against the declared scope."""

    name = "activation"
    reads = ("changed_paths", "scope", "scope_verdict", "imported_files", "tested_tp_sizes", "cases", "traces",
             "case_objects")
    writes: tuple[str, ...] = ()

    def check(self, ctx: GuardContext) -> Verdict:
        task = ctx.task
        if ctx.artifacts.cases is None and ctx.artifacts.scope_verdict is None:
            raise RuntimeError("activation guard needs the correctness guard's trace; run correctness first")
        claimed = ctx.artifacts.scope
        if claimed is None:
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=f"No latency-specialized kernel is merged for op {task.op!r}: the candidate's path never runs.",
                evidence=(Evidence(name="declared_scope", value="none", path=f"k3_model/kernels/{task.op}/"),),
            )
        early = ctx.artifacts.scope_verdict
        if early is not None:  # found before correctness ran (guards/correctness.py): no configuration ran
            return early
        other = files_for_other_devices(task.op, ctx.device, ctx.worktree, ctx.artifacts.changed_paths or [])
        if other:
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=(f"The candidate changes {len(other)} file(s) that serve other devices than {ctx.device}, the "
                         f"device of this run (first: {other[0]}): a run judges the kernel package serving its device "
                         f"only (k3_model/kernels/{task.op}/{ctx.device}/ when it exists, else the op's package outside "
                         "other devices' subpackages). Judge those files on their device, in a candidate of their own."),
                evidence=tuple(Evidence(name="changed_for_other_device", value=f) for f in other),
            )
        served = base_devices_changed(task.op, ctx.device, ctx.repo_root, ctx.base_commit,
                                      ctx.artifacts.changed_paths or [])
        if served:
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=(f"The candidate changes k3_model/kernels/{task.op}/, the package that serves {served} at the "
                         f"base (its SCOPE there), judged on {ctx.device} only: a change to it would reach devices this "
                         f"run does not judge. Put a {ctx.device} kernel in k3_model/kernels/{task.op}/{ctx.device}/ "
                         f"(docs/usage.md \"One kernel package per device\"), or judge the change on {served}."),
                evidence=(Evidence(name="base_scope_devices", value=str(served),
                                   path=f"k3_model/kernels/{task.op}/__init__.py"),),
            )
        bad = scope_verdict(claimed, task, ctx.device, ctx.artifacts.tested_tp_sizes or [1])
        if bad is not None:
            return bad
        scope = claimed_scope(claimed, task.op)
        # from here on only the parsed value, as the dispatcher (lists: the form the child reports)
        claimed = {k: list(v) if isinstance(v, tuple) else v for k, v in scope.to_dict().items()}
        changed_py = sorted(p for p in ctx.artifacts.changed_paths or [] if p.endswith(".py")
                            and (ctx.worktree / p).is_file())
        ran_files = set(ctx.artifacts.imported_files or [])
        if not set(changed_py) & ran_files:
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=("None of the candidate's changed Python files ran: the dispatcher ran code the base "
                         "already had" if changed_py else
                         "The candidate changes no Python source, so nothing it changed can run") + ".",
                evidence=(Evidence(name="changed_python_files", value=", ".join(changed_py) or "none"),
                          Evidence(name="imported_kernel_files", value=", ".join(
                              f for f in sorted(ran_files) if f.startswith("k3_model/kernels/")) or "none")),
            )
        dtype = task.inputs[task.scope.dtype_input].dtype
        wrong, ran, expected_ls = [], 0, 0
        for case in ctx.artifacts.cases:
            wphase = next((c.workload.phase for c in ctx.artifacts.case_objects if c.name == case["name"]), None)
            phase, requests, query_len, rows = task.scope.step(case["axes"], wphase)
            batch = case["axes"][task.scope.batch_axis]
            expect = LS if claims(scope, phase=phase, requests=requests, query_len=query_len, rows=rows,
                                  device=ctx.device, dtype=dtype,
                                  tp=case.get("world_size", 1), op=task.op,
                                  shapes=case_shapes(task, case["axes"])) else "standard"
            expected_ls += expect == LS
            decisions = [d for calls in ctx.artifacts.traces.get(case["name"], []) for d in calls
                         if d.get("op") == task.op]
            for d in decisions:  # the child's dispatch decisions, shown here under -v (the child logs to its pipe)
                logger.debug("%s: dispatch %s -> %s (%s; %s rows, %s requests, query length %s, phase %s)",
                             case["name"], d.get("op"), d.get("implementation"), d.get("reason"), d.get("rows"),
                             d.get("requests"), d.get("query_len"), d.get("phase"))
            seen = [d.get("implementation") for d in decisions]
            if not seen:
                wrong.append((case["name"], batch, expect, "never dispatched"))
            elif any(s != expect for s in seen):
                wrong.append((case["name"], batch, expect, ",".join(sorted(set(seen)))))
            elif expect == LS:
                ran += 1
        if expected_ls == 0:
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=f"No tested configuration on {ctx.device} lies inside the kernel's declared scope, so its path never ran.",
                evidence=(Evidence(name="declared_scope", value=str(claimed)), Evidence(name="device", value=ctx.device)),
            )
        if wrong:
            name, batch, expect, seen = wrong[0]
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=f"{len(wrong)} configuration(s) ran the wrong implementation; first: {name} "
                        f"({task.scope.batch_axis} = {batch}) expected {expect}, ran {seen}.",
                evidence=tuple(Evidence(name="wrong_implementation", value=f"expected {e}, ran {s}",
                                        path=f"{n} {task.scope.batch_axis}={b}")
                               for n, b, e, s in wrong[:20]),
            )
        return Verdict(
            guard=self.name, status=Status.PASS,
            summary=f"The latency-specialized path ran in all {ran} configurations inside its declared scope "
                    f"and the standard path everywhere else.",
            evidence=(Evidence(name="configs_latency_specialized", value=ran, unit="count"),
                      Evidence(name="declared_scope", value=str(claimed))),
        )
