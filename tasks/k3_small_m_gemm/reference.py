"""Reference and checker of the small-M GEMM task (attention input projections at decode).

Independent of ``k3_model``: ``out = x W^T`` in float64 over the whole K (exact to far below fp32's
rounding for these sizes), rounded once to float32, and a per-element bound at the scale every fp32
summation order rounds at.

Source: shared/reference/kernel_targets.md §6.2 (reference math: fp32 accumulation over the full K, one
rounding; split-K with fp32 partials), §6.4 (edge cases), §6.5 (tolerance).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

OUTPUTS = ("out",)
MAX_MESSAGES = 6
PAIR_MAX_LINES = 4
F64_MEMO_ENTRIES = 4
"""float64 copies of input tensors kept (:func:`_f64`): the judge runs this reference and then the check on the
same input tensors, and W at K3's (2112, 7168) takes ~64 ms to convert and is 120 MB as float64 (by hand, session 29)."""

_F64: dict[tuple, tuple] = {}
_F64_LOCK = threading.Lock()  # the judge checks a workload's kept calls on two threads (guards.perf.CallCheck)


def _f64(t: torch.Tensor, *, magnitude: bool = False) -> torch.Tensor:
    """``t`` as a float64 CPU tensor (``|t|`` with ``magnitude``), converted once while ``t`` lives unchanged (its
    in-place version counter): a copy, never written, shared by the calls that ask for it."""
    import weakref

    key = (id(t), magnitude)
    with _F64_LOCK:
        hit = _F64.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    d = t.detach().to("cpu", torch.float64, copy=True)  # a copy even of a float64 CPU tensor: abs_ writes it
    if magnitude:
        d = d.abs_()
    with _F64_LOCK:
        for k in [k for k, v in _F64.items() if v[0]() is None]:
            del _F64[k]
        while len(_F64) >= F64_MEMO_ENTRIES:
            del _F64[next(iter(_F64))]
        _F64[key] = (weakref.ref(t), t._version, d)
    return d


def reference(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The projection ``x W^T``.

    Args:
        inputs: ``x`` (M, K) float32, ``weight`` (N, K) float32.
        params: none.

    Returns:
        ``out`` (M, N) float32, rounded once from float64.
    """
    x = inputs["x"].detach().cpu().double()
    return {"out": (x @ _f64(inputs["weight"]).t()).float()}


def abs_scale(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``sqrt(K) sum_k |x[m, k]| |W[n, k]|`` (M, N) float64: the accumulation slack of an fp32 dot product
    in any summation order, split-K included (the partial sums it rounds at are bounded by the sum of
    |products|; rounding errors of K additions grow like sqrt(K): kernel_targets.md §6.5's sqrt(K) scale);
    0 exactly on a zero row of x."""
    x = inputs["x"].detach().cpu().double().abs()
    return (x @ _f64(inputs["weight"], magnitude=True).t()) * math.sqrt(x.shape[1])


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any], got: Mapping[str, torch.Tensor],
          want: Mapping[str, torch.Tensor], tolerance: Mapping[str, Any]) -> list[str]:
    """Compare a candidate's output with :func:`reference`'s.

    ``out``: never NaN or inf (finite inputs); ``|got - want| <= rtol * |want| + atol * S`` per element,
    where ``S = sqrt(K) sum_k |x[m, k] W[n, k]|`` (:func:`abs_scale`): a zero row of x must give exactly 0.

    Args:
        inputs, params: as for :func:`reference`.
        got: the candidate's ``out``.
        want: :func:`reference`'s output.
        tolerance: ``{"out": object with rtol, atol (x S), source}``.

    Returns:
        One-line mismatch descriptions; empty when the output is right.

    Source: kernel_targets.md §6.5; task.toml [correctness.tolerance.out].
    """
    g, w = got.get("out"), want["out"]
    if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
        desc = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
        return [f"out: expected {tuple(w.shape)} {w.dtype}, got {desc}"]
    msgs: list[str] = []
    g_out, w_out = g.detach().cpu().double(), w.double()
    bad_val = ~torch.isfinite(g_out)
    if bad_val.any():
        msgs.append(f"out: {int(bad_val.sum())} NaN or infinite element(s), first at (m, n) = {_first(bad_val)}; "
                    "the inputs are finite, so is x W^T")
    tol = tolerance["out"]
    scale = abs_scale(inputs)
    bound = tol.rtol * w_out.abs() + tol.atol * scale
    err = (g_out - w_out).abs()
    bad = ~(err <= bound) & ~bad_val
    if bad.any():
        i = _first(bad)
        zero_rows = int((scale[:, 0] == 0).sum()) if scale.shape[1] else 0
        msgs.append(f"out: {int(bad.sum())} element(s) beyond rtol {tol.rtol:g} x |expected| + atol {tol.atol:g} x "
                    f"sqrt(K) sum_k |x w|; first at (m, n) = {i}: expected {float(w_out[i]):.9g}, got {float(g_out[i]):.9g} "
                    f"(allowed {float(bound[i]):.3g}; {zero_rows} zero row(s) of x must give exactly 0)")
    return msgs[:MAX_MESSAGES]


def row_permutation_relation(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                             twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                             info: Mapping[str, Any], params: Mapping[str, Any],
                             tolerance: Mapping[str, Any]) -> list[str]:
    """Rows are independent: the same rows of x in another order give the same rows of out, up to twice
    the reference bound (both calls may round, each in its own order).

    A kernel whose result for a row depends on its position or on the other rows (a split chosen by M, a
    special first or last row) can pass the reference where that position is harmless and fails here.

    Args:
        inputs, outputs: the original inputs and the candidate's output on them.
        twin_inputs, twin_outputs: the rows permuted (``inputs.permute_rows``) and the output on them.
        info: ``{"perm": list of M ints}`` (twin row ``i`` = original row ``perm[i]``).
        params: unused. tolerance: as for :func:`check`.

    Returns:
        One line when rows move beyond the bound; empty when consistent.

    Source: kernel_targets.md §6.4 (batch invariance); task.toml [domain.invariances.row_permutation].
    """
    a, t = outputs.get("out"), twin_outputs.get("out")
    if not isinstance(a, torch.Tensor) or not isinstance(t, torch.Tensor) or a.shape != t.shape:
        return []  # a missing or misshapen output is the reference check's to report
    perm = torch.tensor(list(info["perm"]), dtype=torch.long)
    a, t = a.detach().cpu().double()[perm], t.detach().cpu().double()
    tol = tolerance["out"]
    bound = 2 * (tol.rtol * a.abs() + tol.atol * abs_scale(twin_inputs))
    bad = ~((a - t).abs() <= bound) & ~(torch.isnan(a) & torch.isnan(t))
    if not bad.any():
        return []
    i = _first(bad)
    return [f"out row {i[0]} of the permuted call (original row {int(perm[i[0]])}), column {i[1]}, moves from "
            f"{float(a[i]):.9g} to {float(t[i]):.9g} when the rows are permuted by {list(info['perm'])} (allowed "
            f"{float(bound[i]):.3g}); {int(bad.sum())} element(s) move"][:PAIR_MAX_LINES]
