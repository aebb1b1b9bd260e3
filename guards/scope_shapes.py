"""Random draws inside the shapes a kernel declares (``OpScope.shapes``, issue 19 item 1).

The correctness guard draws its random configurations over the task's whole ``[domain]`` before it
knows the kernel's scope (the child reports it). A draw outside the kernel's declared shapes runs the
standard path (the dispatcher routes it there, the activation guard expects that), so it says nothing
about the kernel: a kernel declaring ``D multiple_of 8`` would meet about one draw in eight. For each
such draw this module makes a counterpart moved into the declared shapes (each axis to the nearest
value the declaration and the domain both admit, constraints and cost limits kept), which the guard
runs in a second child: the kernel is judged by as many random draws as a kernel without shape rules.
The task's fixed workloads get the same treatment: they hold the edge cases (a uniform draw of exactly
0, tied maxima), and a kernel declaring ``V >= 4096`` must not leave behind every edge workload
written at ``V = 1024`` (session 11: the bad DSpark fixture accepting ``u <= p/q`` was accepted so).

Source: issue 19 item 1 ("the activation guard/correctness must judge a kernel only on the shapes it
declares"); :func:`k3_model.dispatch.route` (what "inside" means).
"""

from __future__ import annotations

from typing import Any

from guards.cases import _legal
from k3_model.dispatch import ScopeError, parse_scope, shape_rule_admits
from workbench.taskspec import DomainValueSpec, TaskSpec, WorkloadSpec, eval_constraint

SUFFIX = "-in-shapes"
"""Appended to a random draw's name for its counterpart inside the declared shapes."""


def admitted_near(spec: DomainValueSpec, rule: dict[str, Any], value: int) -> list[int]:
    """Values the domain ``spec`` and the declared ``rule`` both admit, nearest to ``value`` first (ties:
    the smaller first); for a range only the nearest admitted value below and above ``value`` and the
    smallest admitted one.

    Args:
        spec: the task's ``[domain.axes.<axis>]``.
        rule: a normalised ``OpScope.shapes[axis]`` rule.
        value: the drawn size.
    """
    if spec.choices is not None:
        vals = [c for c in spec.choices if type(c) is int and shape_rule_admits(rule, c)]
    elif "choices" in rule:
        vals = [c for c in rule["choices"] if spec.contains(c) and shape_rule_admits(rule, c)]
    else:
        m = rule.get("multiple_of", 1)
        lo, hi = max(int(spec.min), rule.get("min", 1)), min(int(spec.max), rule.get("max", int(spec.max)))
        first = -(-lo // m) * m
        vals = [x for x in {(min(value, hi) // m) * m, -(-max(value, lo) // m) * m, first}
                if lo <= x <= hi and shape_rule_admits(rule, x)]
    return sorted(vals, key=lambda c: (abs(c - value), c))


def into_shapes(task: TaskSpec, w: WorkloadSpec, shapes: dict[str, dict[str, Any]]) -> WorkloadSpec | None:
    """``w`` with every axis the declared ``shapes`` exclude moved to the nearest value they admit that
    keeps the workload legal (domain constraints, the regime's ``requires``, and the cost constraints
    when ``w`` meets them: a fixed workload at real K3 sizes may exceed them and is not dropped for
    that); ``w`` itself when it is inside already; ``None`` when no legal value is found for some axis,
    or when ``w``'s case is no domain regime (its inputs fit its own configuration only).
    """
    dom = task.domain
    axes = dict(w.axes)
    moved = []
    # a fixed workload may exceed the draws' cost limits (real K3 sizes): it is not held to them then.
    # Its case must be a domain regime (a generator for any legal configuration): a case written for
    # one configuration (an issue's worked example) cannot be moved
    costed = dom is not None and dom.satisfied({**axes, **dict(w.params)})
    if dom is not None and dom.regime_of(w.case) not in dom.regimes:
        return None if any(a in axes and not shape_rule_admits(r, axes[a]) for a, r in shapes.items()) else w
    free = dom
    if dom is not None and not costed:  # a draw beyond the cost cap stays under the ceiling; a K3-size fixed one is free
        under = all(eval_constraint(c, {**axes, **dict(w.params)}) for c in dom.cost_ceiling)
        free = dom.model_copy(update={"cost_constraints": dom.cost_ceiling if under else ()})

    def legal(values: dict[str, int]) -> bool:
        return _legal(free, values, dict(w.params), w.case)

    for axis, rule in shapes.items():
        if axis not in axes or shape_rule_admits(rule, axes[axis]) or dom is None or axis not in dom.axes:
            continue
        pick = next((c for c in admitted_near(dom.axes[axis], rule, axes[axis]) if legal({**axes, axis: c})), None)
        if pick is None:
            return None
        moved.append(f"{axis} {axes[axis]} -> {pick}")
        axes[axis] = pick
    if not moved:
        return w
    return w.model_copy(update={"name": f"{w.name}{SUFFIX}", "axes": axes,
                                "note": f"{w.note}; moved into the declared shapes: {', '.join(moved)}"})


def followups(task: TaskSpec, scope: dict | None, draws: list[WorkloadSpec]) -> list[WorkloadSpec]:
    """The counterparts, inside the kernel's declared shapes, of the workloads ``draws`` outside them.

    Args:
        scope: the scope the child reported (``OpScope.to_dict`` form) or ``None``.
        draws: the run's workloads, fixed and random.

    Returns:
        One workload per entry of ``draws`` that lies outside the declared shapes and can be moved
        inside (named ``<name>-in-shapes``), in their order; empty when the scope declares no shapes or
        is not plain scope data (the activation guard rejects that one).
    """
    if scope is None or task.domain is None:
        return []
    try:
        shapes = parse_scope(dict(scope), where="the reported scope").shapes
    except (ScopeError, TypeError, ValueError):
        return []
    out = []
    for w in draws:
        moved = into_shapes(task, w, shapes)
        if moved is not None and moved is not w:
            out.append(moved)
    return out
