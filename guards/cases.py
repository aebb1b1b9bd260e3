"""Turn a task's workloads into concrete cases (inputs, output specs, op arguments).

Task modules (``reference.py``, ``inputs.py``) are loaded from the workbench's own checkout, by file
path: tasks are folders, not packages, and adding one needs no code change here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from workbench.errors import TaskSpecError
from workbench.taskspec import (
    DomainSpec,
    DomainValueSpec,
    TaskSpec,
    WorkloadSpec,
    check_constraint,
    eval_constraint,
    eval_dim,
)

INT_POISON = -7777
"""Value written into integer outputs before each call (never a valid id, index or count)."""


def load_task_module(task: TaskSpec, name: str) -> ModuleType:
    """Import ``tasks/<id>/<name>.py`` under a private module name.

    Raises:
        TaskSpecError: the file is missing or raises on import.
    """
    path = Path(task.root) / f"{name}.py"
    mod_name = f"_wb_task_{task.task_id}_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise TaskSpecError(f"Task {task.task_id!r}: {path} cannot be loaded; it must be a Python file.")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:
        raise TaskSpecError(f"Task {task.task_id!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    sys.modules[mod_name] = mod
    return mod


def untouched(task: TaskSpec, what: str, inputs: tuple[dict[str, Any], ...], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: the task's ``reference``, ``check`` or a metamorphic relation, called on the judge's own
    input tensors (``inputs``, handed to it among ``args``), which it must leave as given.

    The judge hands task code its inputs themselves, not copies: a copy of every input per call was a large
    part of a judgment at K3 sizes (a small_m_gemm judgment holds 2 GB of inputs; session 28's profile).
    Instead each input tensor's in-place version counter (shared with its views) is read before and after
    the call, so a write through torch (``x.mul_``, ``out=x``, a view's ``copy_``) is an error, not a silent
    change of the inputs every later check reads. Writes torch does not count (``.data``, a numpy view) are
    not seen: no task's code makes them (``tests/guards/test_task_code_inputs.py`` runs every task's reference,
    check and relations on the smallest workload of each input regime, the check on a right and on a wrong
    output, and compares the inputs' bits).

    Args:
        task: the task (named in the error).
        what: the code called, e.g. ``"reference.reference"`` (named in the error).
        inputs: the input dicts among ``args`` (name -> tensor or other value).
        fn, args: the task's function and its arguments.

    Raises:
        TaskSpecError: the call wrote one of its input tensors in place.
    """
    import torch

    before = [(k, v, v._version) for d in inputs for k, v in d.items()
              if isinstance(v, torch.Tensor) and not v.is_inference()]  # an inference tensor has no version counter
    out = fn(*args)
    moved = sorted({k for k, v, version in before if v._version != version})
    if moved:
        raise TaskSpecError(f"Task {task.task_id!r}: tasks/{task.task_id}/{what.split('.')[0]}.py {what} wrote its "
                            f"input(s) {', '.join(moved)} in place; task code must leave the inputs it is given "
                            "unchanged (compute into new tensors, e.g. x = x * s rather than x.mul_(s)).")
    return out


@dataclasses.dataclass(frozen=True)
class Twin:
    """The metamorphic pair of a case: its second call's inputs are ``transform(inputs_a)``.

    Attributes:
        invariance: the ``[domain.invariances]`` entry (its name).
        relation: the name of the relation function in the task's ``reference.py``.
        info: what the transform returned for the relation (plain data: a permutation, a shift).
    """

    invariance: str
    relation: str
    info: dict[str, Any]


@dataclasses.dataclass
class Case:
    """One concrete configuration with its inputs.

    Attributes:
        workload: the workload it came from (for random draws: a copy with the batch redrawn).
        inputs_a: inputs for the first and third call.
        inputs_b: other inputs of the same shapes for the second call (buffers reused): an independent
            draw, or the transformed twin of ``inputs_a`` when ``twin`` is set.
        kwargs: scalar op arguments (params + axis_params).
        output_specs: name -> {shape, dtype, poison}.
        twin: the metamorphic pair (``None``: ``inputs_b`` is an independent draw).
        phase, requests, query_len: the step (the task's ``ScopeSpec.step``: phase, and requests and query
            tokens per request as counts), given to ``k3_model.dispatch.forward_context`` in the child;
            ``None`` counts: the op's rows, query length 1.
    """

    workload: WorkloadSpec
    inputs_a: dict[str, Any]
    inputs_b: dict[str, Any]
    kwargs: dict[str, Any]
    output_specs: dict[str, dict[str, Any]]

    world_size: int = 1
    per_rank: tuple[str, ...] = ()
    twin: Twin | None = None
    phase: str = "decode"
    requests: int | None = None
    query_len: int | None = None

    @property
    def name(self) -> str:
        return self.workload.name

    def request_entry(self, rank: int = 0) -> dict[str, Any]:
        """The form the child of TP rank ``rank`` reads (per-rank inputs sliced to that rank's tensor)."""
        return {
            "name": self.name,
            "phase": self.phase,
            "requests": self.requests,
            "query_len": self.query_len,
            "kwargs": self.kwargs,
            "inputs_a": rank_inputs(self.inputs_a, self.per_rank, rank),
            "inputs_b": rank_inputs(self.inputs_b, self.per_rank, rank),
            "outputs": self.output_specs,
            "world_size": self.world_size,
        }


def rank_inputs(inputs: dict[str, Any], per_rank: tuple[str, ...], rank: int) -> dict[str, Any]:
    """The inputs one TP rank sees: ``per_rank`` tensors (stacked ``[W, ...]``) sliced to ``[rank]``.

    The slices are contiguous copies, so ranks never share storage.
    """
    return {k: (v[rank].clone().contiguous() if k in per_rank else v) for k, v in inputs.items()}


def _derive_seed(seed: int, *parts: str) -> int:
    h = hashlib.sha256(("|".join([str(seed), *parts])).encode()).digest()
    return int.from_bytes(h[:4], "little")


def op_kwargs(task: TaskSpec, w: WorkloadSpec) -> dict[str, Any]:
    """Scalar keyword arguments of the op for workload ``w``."""
    return {**w.params, **{kw: w.axes[ax] for kw, ax in task.axis_params.items()}}


def output_specs(task: TaskSpec, axes: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Concrete shapes, dtypes and poison values of the outputs."""
    specs = {}
    for name, t in task.outputs.items():
        poison = t.poison
        if poison is None:
            poison = float("nan") if t.dtype.startswith(("float", "bfloat")) else (True if t.dtype == "bool" else INT_POISON)
        specs[name] = {"shape": [eval_dim(d, axes) for d in t.shape], "dtype": t.dtype, "poison": poison,
                       "inplace": t.inplace, "poison_random": t.poison is None}
    return specs


CANDIDATES_PER_DRAW = 48
"""Random configurations generated per draw; the one covering the most new values and pairs is kept."""
MAX_TRIES = 5000
"""Rejection-sampling attempts for one configuration that meets the domain's constraints."""
PAIR_TRIES = 200
"""Attempts for one configuration holding a given pair of cells; none found: the pair counts as
infeasible under the constraints (e.g. G = 1 with TG = 8 under TG <= G) and is not targeted again."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """A part of one dimension's legal values that coverage counts as one value.

    Attributes:
        lo, hi: a point (``lo == hi``) or an inclusive sub-range of a min/max range.
        log: draw inside the sub-range log-uniformly.
    """

    lo: Any
    hi: Any
    log: bool = False

    @property
    def point(self) -> bool:
        return self.lo == self.hi and type(self.lo) is type(self.hi)

    def holds(self, v: Any) -> bool:
        if self.point:
            return v == self.lo and type(v) is type(self.lo)
        return type(v) is not bool and isinstance(v, (int, float)) and self.lo <= v <= self.hi


def value_cells(spec: DomainValueSpec) -> list[Cell]:
    """The coverage cells of one axis or parameter, points first.

    Choices: one cell each. A range: its two edges, each realistic value, then the inside (integers:
    up to three geometrically spaced bins between the edges; floats: one bin), so edges and the
    model's values are drawn as often as the whole inside.
    """
    if spec.choices is not None:
        return [Cell(c, c) for c in spec.choices]
    lo, hi = spec.min, spec.max
    points: list[Any] = []
    for v in (lo, hi, *spec.realistic):
        if not any(v == q and type(v) is type(q) for q in points):
            points.append(v)
    cells = [Cell(v, v) for v in points]
    if spec.is_int_range:
        a, b = int(lo) + 1, int(hi) - 1  # type: ignore[arg-type]
        n = min(3, b - a + 1)
        if n > 0:
            if a >= 1 and b / a >= 4:  # geometric bins: small values are as likely as large ones
                cuts = [a, *(round(a * (b / a) ** (k / n)) for k in range(1, n)), b + 1]
            else:
                cuts = [a + (b - a + 1) * k // n for k in range(n)] + [b + 1]
            cells += [Cell(x, y - 1, log=False) for x, y in zip(cuts, cuts[1:]) if y - 1 >= x]
    elif hi > lo:  # type: ignore[operator]
        cells.append(Cell(float(lo), float(hi), log=spec.log))  # type: ignore[arg-type]
    return cells


def _draw_in(cell: Cell, rng: random.Random, is_int: bool) -> Any:
    if cell.point:
        return cell.lo
    if is_int:
        if cell.log and cell.lo >= 1:
            return min(cell.hi, max(cell.lo, int(round(math.exp(rng.uniform(math.log(cell.lo), math.log(cell.hi + 1)) - 0.5)))))
        return rng.randint(cell.lo, cell.hi)
    x = math.exp(rng.uniform(math.log(cell.lo), math.log(cell.hi))) if cell.log else rng.uniform(cell.lo, cell.hi)
    return min(cell.hi, max(cell.lo, float(f"{x:.6g}")))  # 6 significant digits: readable, still legal


@dataclasses.dataclass(frozen=True)
class _Dim:
    kind: str  # "axis", "param", "regime", "overlay" or "feature"
    name: str
    cells: tuple[Cell, ...]
    is_int: bool


def _dims(dom: DomainSpec, regimes: tuple[str, ...] | None = None,
          overlays: tuple[str, ...] | None = None, variants: bool = True) -> list[_Dim]:
    """Coverage dimensions: the axes, the params, the regime, the overlays (cells: off, on; these are
    drawn, in this order), then the declared features (derived from the drawn values; cells: holds,
    does not hold). ``regimes``/``overlays``: those drawn (default: all); an overlay left out is off."""
    dims = [_Dim("axis", n, tuple(value_cells(s)), True) for n, s in dom.axes.items()]
    dims += [_Dim("param", n, tuple(value_cells(s)), s.is_int_range) for n, s in dom.params.items()]
    dims.append(_Dim("regime", "case", tuple(Cell(r, r) for r in dom.regimes if regimes is None or r in regimes), False))
    dims += [_Dim("overlay", n, (Cell(False, False), Cell(True, True)), False)
             for n in dom.overlays if overlays is None or n in overlays]
    # an overlay's variants (how many rows it pads): a dimension of their own, counted only where the overlay is
    # on, so each variant meets every axis value and param while the regimes meet the overlay itself
    dims += [_Dim("variant", n, tuple(Cell(v, v) for v in dom.overlays[n].variants), False)
             for n in dom.overlays if variants and (overlays is None or n in overlays) and dom.overlays[n].variants]
    dims += [_Dim("feature", n, (Cell(True, True), Cell(False, False)), False) for n in dom.features]
    return dims


def join_case(regime: str, overlays: tuple[str, ...] | list[str] = ()) -> str:
    """The ``case`` string of a regime with overlays: ``"wide_bias+padding_rows"``."""
    return "+".join((regime, *overlays))


def case_slug(case: str) -> str:
    """A case as a workload-name part: ``"wide_bias+padding_rows:few"`` -> ``"wide-bias-with-padding-rows-few"``."""
    return case.replace("+", "-with-").replace(":", "-").replace("_", "-")


def _feature_cells(dom: DomainSpec, values: dict[str, Any]) -> list[int | None]:
    """Cell index (0: holds, 1: does not) of each declared feature for ``values`` (axes and params);
    ``None`` where the expression names something ``values`` lacks (a workload written without it)."""
    out: list[int | None] = []
    for feat in dom.features.values():
        try:
            out.append(0 if eval_constraint(feat.expr, values) else 1)
        except ValueError:
            out.append(None)
    return out


def _cell_index(dim: _Dim, v: Any) -> int | None:
    return next((i for i, c in enumerate(dim.cells) if c.holds(v)), None)


def _legal(dom: DomainSpec, axes: dict[str, int], params: dict[str, Any], case: str) -> bool:
    """Whether a configuration meets the domain's constraints and its regime's and overlays' ``requires``
    (``case``: a regime, or a regime with overlays; an unknown one is not legal)."""
    values = {**axes, **params}
    if not dom.satisfied(values):
        return False
    try:
        regime, overlays = dom.split_case(case)
    except ValueError:
        return False
    if regime not in dom.regimes:
        return False
    reqs = [dom.regimes[regime].requires] + [dom.overlays[dom.overlay_of(o)[0]].requires for o in overlays]
    return all(not r or eval_constraint(r, values) for r in reqs)


def domain_draws(task: TaskSpec, seed: int, n: int | None = None, *, regimes: tuple[str, ...] | None = None,
                 overlays: tuple[str, ...] | None = None, covered: list[WorkloadSpec] | None = None,
                 salt: str = "domain_draws", variants: bool = True) -> list[tuple[dict[str, int], dict[str, Any], str]]:
    """``n`` configurations ``(axes, params, case)`` drawn over every axis, param, regime and overlay of
    the domain; ``case`` is the regime, followed by the overlays drawn on (:func:`join_case`).

    AETG-style pairwise coverage, seeded. Each draw first picks the most valuable cell pair (of two
    dimensions) that neither the fixed workloads nor earlier draws covered, pins those two cells, and
    keeps, of ``CANDIDATES_PER_DRAW`` random legal configurations holding them, the one covering the
    most new cells and pairs. A candidate draws the dimensions in declared order (axes, params, the
    regime); each picks uniformly among its cells whose drawn value meets the ``constraints``,
    ``cost_constraints`` and regime ``requires`` already decidable, a value uniform inside the
    cell; a dead end restarts. A pair with no legal configuration in ``PAIR_TRIES`` attempts counts
    as infeasible and is not targeted again; once every pair is covered, draws are the best of
    ``CANDIDATES_PER_DRAW`` unpinned candidates. A new cell counts ``1000 / cells(dim)``, a new pair
    ``1 / (cells(a) * cells(b))``: every dimension, and every pair of dimensions, weighs the same in
    total, so the few combinations of two small dimensions (block size x groups) are targeted first
    instead of drowning among the many of two large ones, while the values inside cells stay random.
    Pinning makes such a pair a certainty where the best of random candidates made it likely:
    of ``k3_moe_dispatch``'s 32 draws, 5 of 100 seeds (1000-1099) left a B x G pair undrawn before
    (B = 32 with G = 1 in one CI run, which accepted a bad fixture), none since; runs leaving any
    pair of two dimensions with <= 16 cell pairs undrawn fell from 21 to 13 of 100 (the rest are
    K x renormalize). A task's ``[domain.features]`` (derived conditions such as ``TG < G``) are
    dimensions of two cells computed from the drawn values: a pair pinning one is found by drawing
    again until the condition holds (``PAIR_TRIES``), so each regime meets each feature cell in every
    run where that is legal (session 11: the wide bias with groups dropped). Each ``[domain.overlays]``
    entry is a drawn dimension (off, on; on only where its ``requires`` holds), so every regime meets
    every overlay (session 13's red team: padding rows, then a regime of their own, never met a wide
    bias). Deterministic for a seed.

    Args:
        task: a task with a ``[domain]``.
        seed: the run-time seed.
        n: draws (default ``correctness.random_draws``).
        regimes: the regimes drawn (default: every regime of the domain).
        overlays: the overlays drawn (default: every overlay of the domain; the others stay off).
        variants: cover each overlay's ``variants`` as a dimension (False: an overlay on draws any variant).
        covered: the workloads whose cells and pairs count as covered already (default: the fixed
            correctness workloads).
        salt: mixed into the seed, so another user of the draws (perf) gets other draws for one seed.

    Raises:
        TaskSpecError: the task has no domain, no regime is left to draw, or no legal configuration
            was found in ``MAX_TRIES``.
    """
    dom = task.domain
    if dom is None:
        raise TaskSpecError(f"Task {task.task_id!r}: no [domain] declared; random draws over the domain need one.")
    n = task.correctness.random_draws if n is None else n
    rng = random.Random(_derive_seed(seed, salt))
    dims = _dims(dom, regimes, overlays, variants)
    nd = sum(d.kind != "feature" for d in dims)  # drawn dimensions: axes, params, the regime, the overlays
    ri = next(i for i, d in enumerate(dims) if d.kind == "regime")
    if not dims[ri].cells:
        raise TaskSpecError(f"Task {task.task_id!r}: none of the regimes {list(regimes or ())} is in its [domain.regimes] "
                            f"{sorted(dom.regimes)}; draws need at least one.")
    singles: set[tuple[int, int]] = set()
    pairs: set[tuple[int, int, int, int]] = set()

    overlay_of = {i: next(j for j, e in enumerate(dims) if e.kind == "overlay" and e.name == d.name)
                  for i, d in enumerate(dims) if d.kind == "variant"}

    def cover(idx: list[int | None]) -> tuple[set, set]:
        idx = [None if i in overlay_of and idx[overlay_of[i]] != 1 else v for i, v in enumerate(idx)]
        s1 = {(d, i) for d, i in enumerate(idx) if i is not None}
        s2 = {(a, idx[a], b, idx[b]) for a in range(len(idx)) for b in range(a + 1, len(idx))
              if idx[a] is not None and idx[b] is not None}
        return s1, s2

    for w in task.correctness.workloads if covered is None else covered:
        try:
            w_regime, w_over = dom.split_case(w.case)
        except ValueError:
            w_regime, w_over = w.case, ()
        on = dict(dom.overlay_of(o) for o in w_over)
        vals = [w.axes.get(d.name) if d.kind == "axis" else w.params.get(d.name) if d.kind == "param"
                else w_regime if d.kind == "regime" else d.name in on if d.kind == "overlay"
                else on.get(d.name) or None for d in dims[:nd]]
        s1, s2 = cover([_cell_index(d, v) for d, v in zip(dims, vals)]
                       + _feature_cells(dom, {**w.axes, **w.params}))
        singles |= s1
        pairs |= s2

    exprs = [(c, check_constraint(c)) for c in dom.constraints + dom.cost_constraints]
    requires = {r: (spec.requires, check_constraint(spec.requires) if spec.requires else set())
                for r, spec in dom.regimes.items()}
    overlay_requires = {o: spec.requires for o, spec in dom.overlays.items()}

    # The constraints decidable once dimension ``di`` is drawn: those naming it and only dimensions drawn
    # up to it (the names drawn before a dimension are the same in every candidate: declared order).
    decidable: list[list[str]] = []
    drawn: set[str] = set()
    for d in dims[:nd]:
        if d.kind in ("regime", "overlay", "variant"):
            decidable.append([])
            continue
        drawn.add(d.name)
        decidable.append([c for c, used in exprs if d.name in used and used <= drawn])

    def candidate(forced: dict[int, int] | None = None, tries: int = MAX_TRIES) -> tuple[list[int], list[Any]] | None:
        # Dimensions in declared order; each picks uniformly among its cells whose drawn value meets
        # every constraint already decidable (so a tightly constrained value, e.g. G = 1 forcing
        # TG = 1, is as likely as the others instead of being lost to rejection sampling). ``forced``
        # (dimension -> cell) pins the target pair's two cells. None: nothing legal in ``tries``.
        forced = dict(forced or {})
        for vi, oi in overlay_of.items():  # a pinned variant needs its overlay on
            if vi in forced:
                forced[oi] = 1
        for _ in range(tries):
            idx: list[int] = []
            vals: list[Any] = []
            known: dict[str, Any] = {}
            for di, d in enumerate(dims[:nd]):
                opts = []
                cells = [forced[di]] if di in forced else range(len(d.cells))
                for i in cells:
                    v = _draw_in(d.cells[i], rng, d.is_int)
                    env = {**known, d.name: v} if d.kind in ("axis", "param") else known
                    todo = decidable[di]
                    if d.kind == "regime" and requires[v][0]:
                        todo = [requires[v][0]]
                    if d.kind == "overlay" and v and overlay_requires[d.name]:
                        todo = [overlay_requires[d.name]]
                    if all(eval_constraint(c, env) for c in todo):
                        opts.append((i, v))
                if not opts:
                    break
                i, v = opts[rng.randrange(len(opts))]
                idx.append(i)
                vals.append(v)
                if d.kind in ("axis", "param"):
                    known[d.name] = v
            else:
                axes = {d.name: v for d, v in zip(dims, vals) if d.kind == "axis"}
                params = {d.name: v for d, v in zip(dims, vals) if d.kind == "param"}
                feats = _feature_cells(dom, {**axes, **params})
                if any(forced.get(nd + j, f) != f for j, f in enumerate(feats)):
                    continue  # a pinned feature cell does not hold: draw again
                if _legal(dom, axes, params, _case_of(vals)):
                    return idx + feats, vals
        return None

    def _case_of(vals: list[Any]) -> str:
        variant = {d.name: v for d, v in zip(dims[:nd], vals) if d.kind == "variant"}
        return join_case(vals[ri], [f"{d.name}:{variant[d.name]}" if d.name in variant else d.name
                                    for d, v in zip(dims[:nd], vals) if d.kind == "overlay" and v])

    def any_candidate() -> tuple[list[int], list[Any]]:
        found = candidate()
        if found is None:
            raise TaskSpecError(f"Task {task.task_id!r}: no configuration meeting the [domain] constraints was found in "
                                f"{MAX_TRIES} random tries; the constraints are too tight or contradictory.")
        return found

    def score(idx: list[int]) -> float:
        s1, s2 = cover(list(idx))
        return (1000 * sum(1 / len(dims[d].cells) for d, _ in s1 - singles)
                + sum(1 / (len(dims[a].cells) * len(dims[b].cells)) for a, _, b, _ in s2 - pairs))

    data_dims = {"regime", "overlay", "feature"}

    def pair_weight(a: int, ia: int, b: int, ib: int) -> float:
        ca, cb = len(dims[a].cells), len(dims[b].cells)
        # a regime meeting an overlay or a feature cell comes first among the pairs: those conditions on the
        # data are what a wrong kernel keys on (padding rows with a wide bias, an empty chunk with a large LSE)
        data = 1.0 if {dims[a].kind, dims[b].kind} <= data_dims and "regime" in {dims[a].kind, dims[b].kind} else 0.0
        return (1000 / ca * ((a, ia) not in singles) + 1000 / cb * ((b, ib) not in singles) + 1 / (ca * cb) + data)

    own = {frozenset((vi, oi)) for vi, oi in overlay_of.items()}  # an overlay and its variants: one thing
    every_pair = [(a, ia, b, ib) for a in range(len(dims)) for b in range(a + 1, len(dims))
                  if frozenset((a, b)) not in own
                  for ia in range(len(dims[a].cells)) for ib in range(len(dims[b].cells))]
    dead: set[tuple[int, int, int, int]] = set()  # target pairs no legal configuration was found for

    def seeded() -> tuple[list[int], list[Any]] | None:
        """The best of ``CANDIDATES_PER_DRAW`` candidates holding the most valuable pair not yet
        covered (AETG's seeding); None once every pair is covered or found infeasible."""
        while True:
            open_pairs = [q for q in every_pair if q not in pairs and q not in dead]
            if not open_pairs:
                return None
            top = max(pair_weight(*q) for q in open_pairs)
            best_pairs = [q for q in open_pairs if pair_weight(*q) == top]
            a, ia, b, ib = best_pairs[rng.randrange(len(best_pairs))]
            first = candidate({a: ia, b: ib}, PAIR_TRIES)
            if first is None:
                dead.add((a, ia, b, ib))
                continue
            found = [first] + [c for c in (candidate({a: ia, b: ib}, PAIR_TRIES)
                                           for _ in range(CANDIDATES_PER_DRAW - 1)) if c is not None]
            return max(found, key=lambda c: score(c[0]))

    any_candidate()  # an unsatisfiable domain is an error at once, not after every pair was tried
    out = []
    for _ in range(n):
        best = seeded()
        if best is None:  # every pair covered: plain random draws, the most new coverage kept
            best = max((any_candidate() for _ in range(CANDIDATES_PER_DRAW)), key=lambda c: score(c[0]))
        idx, vals = best
        s1, s2 = cover(list(idx))
        singles |= s1
        pairs |= s2
        out.append(({d.name: v for d, v in zip(dims, vals) if d.kind == "axis"},
                    {d.name: v for d, v in zip(dims, vals) if d.kind == "param"}, _case_of(vals)))
    return out


PLAIN_REGIME = "realistic"
"""The regime of the plain draw beyond the cost cap (:func:`beyond_cost_draws`): every task declares it."""


def _push_to_ceiling(dom: DomainSpec, values: dict[str, Any], under: Callable[[dict[str, Any]], bool],
                     rng: random.Random, ragged: bool) -> dict[str, Any]:
    """``values`` with each axis raised (in random order, repeated until no axis rises) as far as ``under``
    (constraints and ceiling) allows.

    Aligned: to the largest of the axis's choices, or of its max and realistic values. Ragged: every
    integer range axis is first made odd (one below an even value, where the axis's min allows), then
    raised to the largest *odd* value that fits (63 where 64 would, 2^k - 1 rather than 2^k), so the
    draw at the ceiling ends in a partial tile of every power-of-two width; an axis with choices is
    raised as when aligned. Fit is searched by bisection (the ceilings are products of axes, monotone
    in each) and checked on each value kept.

    Source: CI of session 14's stop: a kernel dropping the last partial block of 8 rows above 2^23
    elements was accepted on a seed whose ceiling draw had B = 64 and whose other draw was too small.
    """
    values = dict(values)
    if ragged:
        for name, spec in dom.axes.items():
            if (spec.choices is None and values[name] % 2 == 0 and values[name] - 1 >= int(spec.min)
                    and under({**values, name: values[name] - 1})):  # (an axis another one is bound by stays)
                values[name] -= 1
    order = rng.sample(list(dom.axes), len(dom.axes))
    for _ in range(len(order) + 1):  # again until nothing rises: raising one axis can let another rise
        before = dict(values)  # (a constraint such as "B <= 64 * Q" couples two axes)
        for name in order:
            spec = dom.axes[name]
            cur = values[name]
            if spec.choices is not None or not ragged:
                opts = sorted({c for c in spec.choices} if spec.choices is not None
                              else {int(spec.max), *(int(v) for v in spec.realistic), cur}, reverse=True)
                for v in opts:
                    if v > cur and under({**values, name: v}):
                        values[name] = v
                        break
                continue
            lo, hi = int(cur), int(spec.max)  # largest fitting value in [cur, max]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if under({**values, name: mid}) else (lo, mid - 1)
            v = lo if lo % 2 else lo - 1
            if v > cur and under({**values, name: v}):
                values[name] = v
        if values == before:
            break
    return values


def beyond_cost_draws(task: TaskSpec, seed: int, n: int | None = None) -> list[tuple[dict[str, int], dict[str, Any], str]]:
    """``n`` configurations ``(axes, params, case)`` that break a cost constraint but stay under the ceiling.

    The cost constraints keep most draws cheap; the op's legal (and served) sizes go beyond them. So
    each run also draws here, among configurations meeting the domain's constraints and its
    ``cost_ceiling`` and breaking at least one cost constraint: the first two are pushed up to the
    ceiling (:func:`_push_to_ceiling`: the first to aligned sizes, the second to odd ones), the others
    stay random. The second is plain: regime ``realistic`` (``PLAIN_REGIME``; the first legal one
    when a task has none), no overlay, because a fast path an agent adds for large serving shapes
    runs on exactly those inputs and an extreme regime or overlay often sends the call elsewhere. The
    others' regime and overlays are drawn uniformly among the legal ones; the params by cell. None
    when the task has no cost constraints, or its cost constraints admit every configuration drawn
    (``MAX_TRIES`` candidates). Deterministic for a seed.

    Args:
        task: a task with a ``[domain]``.
        seed: the run-time seed.
        n: draws (default ``[domain] beyond_cost_draws``).

    Source: session 14's red team (``bench/results/cpu/red_team_session14.md``: a kernel wrong only on
    inputs above 2^23 elements was accepted while ``cost_constraints`` capped every draw at 2^22); CI of
    session 14's stop (the same kernel, whose fast path runs when every chunk is live and drops the last
    partial block of 8 rows, accepted on a seed whose draws beyond the cap missed that conjunction).
    """
    dom = task.domain
    if dom is None or not dom.cost_constraints or not dom.cost_ceiling:
        return []
    n = dom.beyond_cost_draws if n is None else n
    if n <= 0:
        return []
    rng = random.Random(_derive_seed(seed, "beyond_cost_draws"))
    dims = _dims(dom)

    def under(values: dict[str, Any]) -> bool:
        return dom.satisfied(values, cost=False) and all(eval_constraint(c, values) for c in dom.cost_ceiling)

    def fits(values: dict[str, Any]) -> bool:
        return under(values) and not dom.satisfied(values)

    def one() -> dict[str, Any] | None:
        for _ in range(MAX_TRIES):
            values = {d.name: _draw_in(d.cells[rng.randrange(len(d.cells))], rng, d.is_int)
                      for d in dims if d.kind in ("axis", "param")}
            if fits(values):
                return values
        return None

    def case_for(values: dict[str, Any], plain: bool) -> str:
        regimes = [r for r, spec in dom.regimes.items() if not spec.requires or eval_constraint(spec.requires, values)]
        if plain:  # the serving distribution, where a size-specialised fast path lives
            return PLAIN_REGIME if PLAIN_REGIME in regimes else regimes[0]
        on = [o if not spec.variants else f"{o}:{spec.variants[rng.randrange(len(spec.variants))]}"
              for o, spec in dom.overlays.items()
              if (not spec.requires or eval_constraint(spec.requires, values)) and rng.random() < 0.5]
        return join_case(regimes[rng.randrange(len(regimes))], on)

    out = []
    for i in range(n):
        values = one()
        if values is None:
            break
        if i < 2:  # pushed to the ceiling: the first on aligned sizes, the second on ragged ones
            pushed = _push_to_ceiling(dom, values, under, rng, ragged=i == 1)
            values = pushed if fits(pushed) else values
        out.append(({k: values[k] for k in dom.axes}, {k: values[k] for k in dom.params}, case_for(values, plain=i == 1)))
    return out


def invariance_applies(dom: DomainSpec, name: str, axes: dict[str, int], params: dict[str, Any], case: str) -> bool:
    """Whether the checked invariance ``name`` (a metamorphic pair) applies to a configuration: it has
    a transform, the case's regime is among its ``regimes`` (any when empty) and its ``requires`` holds."""
    inv = dom.invariances.get(name)
    regime = dom.regime_of(case)
    if inv is None or not inv.checked or (inv.regimes and regime not in inv.regimes):
        return False
    return not inv.requires or eval_constraint(inv.requires, {**axes, **params})


def random_workloads(task: TaskSpec, seed: int) -> list[WorkloadSpec]:
    """``correctness.random_draws`` workloads drawn at run time.

    With a ``[domain]``: every axis, param and input regime drawn by :func:`domain_draws`; each
    workload is named ``random-<i>-<case>`` and carries its axes, params and case (regime and overlays);
    then :func:`beyond_cost_draws` (``random-beyond-cost-<i>-<case>``: sizes past the cost cap).
    Every draw that a checked invariance (``[domain.invariances]`` with transform and relation)
    applies to gets one as its metamorphic pair (``invariance``): among those that apply, the one
    given to the fewest draws so far (declared order on a tie), so the pairs alternate.
    Without a domain: a ``random_template`` workload with the batch axis redrawn uniformly in
    ``ScopeSpec.batch_range`` (no pairs).
    """
    if task.domain is not None:
        dom = task.domain
        used = {n: 0 for n, inv in dom.invariances.items() if inv.checked}
        beyond = beyond_cost_draws(task, seed) if task.correctness.random_draws else []  # no draws: none of these either
        drawn = [(f"random-{i}", d, "drawn from [domain] at run time") for i, d in enumerate(domain_draws(task, seed))]
        drawn += [(f"random-beyond-cost-{i}", d, "drawn beyond [domain] cost_constraints, under cost_ceiling, at run time")
                  for i, d in enumerate(beyond)]
        out = []
        for name, (axes, params, case), note in drawn:
            fits = [n for n in used if invariance_applies(dom, n, axes, params, case)]
            inv = min(fits, key=lambda n: used[n]) if fits else ""
            if inv:
                used[inv] += 1
            out.append(WorkloadSpec(name=f"{name}-{case_slug(case)}", axes=axes, params=params, case=case,
                                    phase=task.scope.step(axes)[0], invariance=inv, note=note))
        return out
    rng = random.Random(_derive_seed(seed, "random_workloads"))
    templates = [w for w in task.correctness.workloads if w.random_template]
    out = []
    for i in range(task.correctness.random_draws):
        t = rng.choice(templates)
        axes = dict(t.axes)
        axes[task.scope.batch_axis] = rng.randint(*task.scope.batch_range(axes))
        out.append(t.model_copy(update={"name": f"random-{i}-{t.name}", "axes": axes, "random_template": False}))
    return out


@dataclasses.dataclass(frozen=True)
class ShrinkResult:
    """What :func:`shrink` found.

    Attributes:
        workload: the smallest configuration found that still fails (the input workload if none).
        steps: the accepted simplifications in order, e.g. ``"T 37 -> 1"``.
        calls: how many times the predicate was called.
    """

    workload: WorkloadSpec
    steps: tuple[str, ...]
    calls: int


def _toward(spec: DomainValueSpec, cur: Any) -> list[Any]:
    """Simpler values than ``cur``, most aggressive first: choices listed before it; for a range the
    minimum, then halfway points toward ``cur`` (integers), or the first realistic value (floats)."""
    if spec.choices is not None:
        i = next((k for k, c in enumerate(spec.choices) if c == cur and type(c) is type(cur)), len(spec.choices))
        return list(spec.choices[:i])
    if spec.is_int_range:
        lo, out, gap = int(spec.min), [], int(cur) - int(spec.min)  # type: ignore[arg-type]
        while gap > 0:
            out.append(int(cur) - gap)
            gap //= 2
        return [v for v in dict.fromkeys([lo, *out]) if v < cur]
    simple = [spec.realistic[0]] if spec.realistic else [spec.min]
    return [v for v in simple if v != cur]


def shrink(task: TaskSpec, workload: WorkloadSpec, still_fails: Callable[[WorkloadSpec], bool],
           max_calls: int = 32) -> ShrinkResult:
    """Shrink a failing workload to a minimal one that still fails (hypothesis-style, deterministic).

    Passes over the dimensions until nothing changes or ``max_calls`` predicate calls are spent:
    first each overlay (dropped), then the regime (toward the domain's ``realistic`` regimes, overlays
    kept), then every axis in declared order
    (toward the domain minimum: the earlier choices, or the range minimum and then halfway points),
    then every param (toward its first choice or first realistic value). A simpler candidate is kept
    when it meets the domain's constraints, cost constraints and the regime's ``requires`` and
    ``still_fails`` returns True for it; no candidate is asked twice. The result never fails less than the input: it is either
    the input or a candidate the predicate confirmed. A workload's metamorphic pair (``invariance``)
    goes along to every candidate it still applies to (:func:`invariance_applies`), and is dropped
    from the others (a relation that broke then no longer fails there, so the shrinker keeps it).

    Args:
        task: a task with a ``[domain]``.
        workload: a failing workload (axes, params, ``case`` = regime and overlays).
        still_fails: runs the candidate on one workload; True when it is still wrong there. Exceptions
            propagate.
        max_calls: predicate budget (each call is a child run in the correctness guard).

    Returns:
        A :class:`ShrinkResult`; the workload is named ``<name>-shrunk`` when anything changed.

    Raises:
        TaskSpecError: the task has no domain.
    """
    dom = task.domain
    if dom is None:
        raise TaskSpecError(f"Task {task.task_id!r}: no [domain] declared; shrinking works over the domain.")
    axes, params, case = dict(workload.axes), dict(workload.params), workload.case
    pair = workload.invariance
    steps: list[str] = []
    calls = 0

    asked: set[str] = set()

    def attempt(a: dict, p: dict, r: str, what: str) -> bool:
        nonlocal calls, axes, params, case, pair
        key = repr((sorted(a.items()), sorted(p.items()), r))
        if calls >= max_calls or key in asked or not _legal(dom, a, p, r):
            return False
        asked.add(key)
        calls += 1
        # the metamorphic pair goes along where it applies (a permutation of one token does not)
        inv = workload.invariance if workload.invariance and invariance_applies(dom, workload.invariance, a, p, r) else ""
        cand = workload.model_copy(update={"name": f"{workload.name}-shrunk", "axes": a, "params": p, "case": r,
                                           "invariance": inv})
        if still_fails(cand):
            axes, params, case, pair = a, p, r, inv
            steps.append(what)
            return True
        return False

    changed = True
    while changed and calls < max_calls:
        changed = False
        regime, overlays = dom.split_case(case) if dom.regime_of(case) in dom.regimes else (case, ())
        for o in overlays:
            if attempt(axes, params, join_case(regime, [x for x in overlays if x != o]), f"overlay {o} dropped"):
                changed = True
                regime, overlays = dom.split_case(case)
                break
        simple = [r for r, spec in dom.regimes.items() if spec.realistic] or ["realistic"]
        if regime not in simple:
            for r in simple:
                if attempt(axes, params, join_case(r, overlays), f"regime {regime} -> {r}"):
                    changed = True
                    break
        for name, spec in dom.axes.items():
            for v in _toward(spec, axes[name]):
                if attempt({**axes, name: v}, params, case, f"{name} {axes[name]} -> {v}"):
                    changed = True
                    break
        for name, spec in dom.params.items():
            if name not in params:
                continue
            for v in _toward(spec, params[name]):
                if attempt(axes, {**params, name: v}, case, f"{name} {params[name]!r} -> {v!r}"):
                    changed = True
                    break
    if not steps:
        return ShrinkResult(workload, (), calls)
    w = workload.model_copy(update={"name": f"{workload.name}-shrunk", "axes": axes, "params": params, "case": case,
                                    "invariance": pair, "note": f"shrunk from {workload.name}: " + "; ".join(steps)})
    return ShrinkResult(w, tuple(steps), calls)


def _check_drawn(task: TaskSpec, w: WorkloadSpec, inp: Any, what: str) -> None:
    import torch

    for name, spec in task.inputs.items():
        t = inp.get(name) if isinstance(inp, dict) else None
        shape = tuple(eval_dim(d, w.axes) for d in spec.shape)
        if spec.per_rank:
            shape = (task.world_size(w), *shape)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != getattr(torch, spec.dtype):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TaskSpecError(
                f"Task {task.task_id!r}: {what} for workload {w.name!r} returned input {name!r} as "
                f"{got}; expected {shape} {spec.dtype}."
            )


def _twin(task: TaskSpec, w: WorkloadSpec, inputs_a: dict[str, Any], seed: int) -> tuple[dict[str, Any], Twin]:
    """The transformed twin of ``inputs_a`` for workload ``w``'s metamorphic pair.

    Raises:
        TaskSpecError: the invariance is unknown or unchecked, its transform (``inputs.py``) or relation
            (``reference.py``) function is missing, the transform fails, or it returns other names,
            shapes or dtypes than the inputs, or ``info`` that is not a dict.
    """
    dom = task.domain
    inv = dom.invariances.get(w.invariance) if dom is not None else None
    if inv is None or not inv.checked:
        raise TaskSpecError(f"Task {task.task_id!r}: workload {w.name!r} names invariance {w.invariance!r}, which is "
                            "not a [domain.invariances] entry with a transform and a relation.")
    for mod_name, fn_name in (("inputs", inv.transform), ("reference", inv.relation)):
        if not callable(getattr(load_task_module(task, mod_name), fn_name, None)):
            raise TaskSpecError(f"Task {task.task_id!r}: invariance {w.invariance!r} names {fn_name!r}, which is not a "
                                f"function of tasks/{task.task_id}/{mod_name}.py; define it or fix the name in task.toml.")
    fn = getattr(load_task_module(task, "inputs"), inv.transform)
    try:
        twin, info = fn({k: v.clone() for k, v in inputs_a.items()}, dict(w.axes), dict(op_kwargs(task, w)),
                        _derive_seed(seed, w.name, "twin", repr(sorted(w.axes.items()))))
    except Exception as exc:
        raise TaskSpecError(f"Task {task.task_id!r}: inputs.{inv.transform} (invariance {w.invariance!r}) failed for "
                            f"workload {w.name!r}: {type(exc).__name__}: {exc}") from exc
    _check_drawn(task, w, twin, f"inputs.{inv.transform} (invariance {w.invariance!r})")
    if not isinstance(info, dict):
        raise TaskSpecError(f"Task {task.task_id!r}: inputs.{inv.transform} returned info of type {type(info).__name__}; "
                            "expected a dict of plain data (the relation's arguments).")
    return {k: twin[k].contiguous() for k in task.inputs}, Twin(w.invariance, inv.relation, info)


def draw_inputs(task: TaskSpec, w: WorkloadSpec, seed: int, what: str = "make_inputs") -> dict[str, Any]:
    """One draw of workload ``w``'s inputs: ``inputs.make_inputs(axes, seed, regime)``, then each overlay
    of its case (``"<regime>+<overlay>..."``) in order, by its ``apply`` function in ``inputs.py`` with a
    seed derived from ``seed`` and the overlay's name. Contiguous tensors (a case with a ``layout`` overlay
    keeps the strides it made), checked against the task's input shapes and dtypes.

    Raises:
        TaskSpecError: the case names an unknown overlay, ``make_inputs`` or an overlay fails, an
            overlay's function is missing, or a tensor does not match the task's inputs.
    """
    inputs_mod = load_task_module(task, "inputs")
    regime, overlays = w.case, ()
    if task.domain is not None and "+" in w.case:
        try:
            regime, overlays = task.domain.split_case(w.case)
        except ValueError as exc:
            raise TaskSpecError(f"Task {task.task_id!r}: workload {w.name!r}: {exc}") from exc
    try:
        inp = inputs_mod.make_inputs(dict(w.axes), seed, regime)
    except Exception as exc:
        raise TaskSpecError(
            f"Task {task.task_id!r}: inputs.make_inputs failed for {what} workload {w.name!r} "
            f"(case {regime!r}): {type(exc).__name__}: {exc}"
        ) from exc
    for o in overlays:
        o, variant = task.domain.overlay_of(o)  # type: ignore[union-attr]
        fn_name = task.domain.overlays[o].apply  # type: ignore[union-attr]
        fn = getattr(inputs_mod, fn_name, None)
        if not callable(fn):
            raise TaskSpecError(f"Task {task.task_id!r}: overlay {o!r} names {fn_name!r}, which is not a function of "
                                f"tasks/{task.task_id}/inputs.py; define it or fix 'apply' in task.toml.")
        try:
            kw = {"variant": variant} if variant else {}
            inp = fn(inp, dict(w.axes), _derive_seed(seed, "overlay", o), **kw)
        except Exception as exc:
            raise TaskSpecError(f"Task {task.task_id!r}: inputs.{fn_name} (overlay {o!r}) failed for {what} workload "
                                f"{w.name!r}: {type(exc).__name__}: {exc}") from exc
    _check_drawn(task, w, inp, f"inputs for {w.case!r}")
    layout = any(task.domain.overlays[task.domain.overlay_of(o)[0]].layout for o in overlays)  # type: ignore[union-attr]
    if layout:  # strides as the overlay made them (unit inner stride, no overlap: checked), values as drawn
        for k in task.inputs:
            t = inp[k]
            if t.dim() and (t.stride(-1) != 1 or any(t.stride(i) < t.shape[i + 1] * t.stride(i + 1)
                                                     for i in range(t.dim() - 1))):
                raise TaskSpecError(f"Task {task.task_id!r}: a layout overlay of workload {w.name!r} made input {k!r} "
                                    f"with strides {tuple(t.stride())} for shape {tuple(t.shape)}; keep a unit "
                                    "inner stride and rows that do not overlap.")
        return {k: inp[k] for k in task.inputs}
    return {k: inp[k].contiguous() for k in task.inputs}


def build_case(task: TaskSpec, w: WorkloadSpec, seed: int) -> Case:
    """Inputs (two independent draws, or a draw and its transformed twin) and output specs for one workload.

    With ``w.invariance`` (a metamorphic pair) the second call's inputs are the invariance's
    ``transform`` of the first draw (:func:`_twin`) and the case carries a :class:`Twin`; otherwise
    they are a second independent draw.

    Raises:
        TaskSpecError: ``make_inputs`` or the transform fails or returns tensors that do not match the
            task's inputs.
    """
    draws = []
    twin: Twin | None = None
    for part in ("a", "b"):
        if part == "b" and w.invariance:
            twin_inputs, twin = _twin(task, w, draws[0], seed)
            draws.append(twin_inputs)
            break
        draws.append(draw_inputs(task, w, _derive_seed(seed, w.name, part, repr(sorted(w.axes.items())))))
    per_rank = tuple(k for k, spec in task.inputs.items() if spec.per_rank)
    phase, requests, query_len, _rows = task.scope.step(w.axes, w.phase)
    return Case(w, draws[0], draws[1], op_kwargs(task, w), output_specs(task, w.axes), world_size=task.world_size(w),
                per_rank=per_rank, twin=twin, phase=phase, requests=requests, query_len=query_len)


def perf_inputs(task: TaskSpec, w: WorkloadSpec, seed: int, j: int) -> dict[str, Any]:
    """Inputs of call ``j`` of perf workload ``w`` (deterministic in ``seed``).

    Raises:
        TaskSpecError: ``make_inputs`` fails for the workload.
    """
    return draw_inputs(task, w, _derive_seed(seed, w.name, "perf", str(j)), "perf")


def perf_rotation(task: TaskSpec, w: WorkloadSpec, seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` independent input draws for one perf workload (:func:`perf_inputs` for ``j < n``).

    Different data in different buffers on every call: a cache keyed by pointer, shape or content
    never hits while timed, and the parent can check the outputs of any timed call.

    Raises:
        TaskSpecError: ``make_inputs`` fails for the workload.
    """
    return [perf_inputs(task, w, seed, j) for j in range(n)]


CASE_THREADS = 2
"""Threads that build the correctness cases of a task with large inputs (:func:`correctness_cases`): each
configuration's draws come from generators seeded by (seed, workload), so the cases are the same built in any
order. small_m_gemm's 45 cases (2 GB) took 5.1 s on one thread and 2.2 s on two, dspark_verify's 8.6 and 4.6 s;
MoE's 62 small ones 0.05 s on one and 0.55 s on two (by hand, session 29)."""
CASE_THREADS_ELEMENTS = 1 << 22
"""Input elements of all configurations (by the task's declared input shapes) from which the cases are built on
:data:`CASE_THREADS` threads."""


def correctness_cases(task: TaskSpec, seed: int) -> list[Case]:
    """The fixed workloads plus the run-time random draws, with inputs, in that order (built on
    :data:`CASE_THREADS` threads when the first case's inputs reach :data:`CASE_THREADS_BYTES`).

    Raises:
        TaskSpecError: as :func:`build_case`, for the first workload (in order) that fails.
    """
    import concurrent.futures

    ws = list(task.correctness.workloads) + random_workloads(task, seed)
    elements = sum(math.prod(eval_dim(d, w.axes) for d in spec.shape) for w in ws for spec in task.inputs.values())
    if elements < CASE_THREADS_ELEMENTS:
        return [build_case(task, w, seed) for w in ws]
    with concurrent.futures.ThreadPoolExecutor(CASE_THREADS, thread_name_prefix="wb-cases") as pool:
        return list(pool.map(lambda w: build_case(task, w, seed), ws))
