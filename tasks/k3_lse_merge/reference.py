"""Reference and checker of the LSE-merge task (split-KV / DCP combine of partial attention outputs).

Independent of ``k3_model``: the math of kernel_targets.md §4.2 in float64, chunk by chunk, with every
edge case spelled out (NaN/+inf LSE = empty chunk, all-empty row -> output 0 and LSE -inf, a term of
weight 0 contributes 0 even when its partial output is NaN).

Source: shared/reference/kernel_targets.md §4.2 (reference math), §4.4 (edge cases), §4.5 (tolerance).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

OUTPUTS = ("out", "out_lse")
MAX_MESSAGES = 6


def reference(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The merged output and LSE.

    Args:
        inputs: ``outs`` (N, B, H, D) float32 partial outputs, ``lses`` (N, B, H) float32 LSEs.
        params: ``base_e`` (True: natural log; False: log2).

    Returns:
        ``out`` (B, H, D) float32 and ``out_lse`` (B, H) float32 (rounded once from float64).
    """
    outs = inputs["outs"].detach().cpu().double()
    lse = inputs["lses"].detach().cpu().double()
    base = math.e if bool(params["base_e"]) else 2.0
    ln_base = math.log(base)
    empty = torch.isnan(lse) | (lse == math.inf) | (lse == -math.inf)
    lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
    m = lse.amax(dim=0)
    all_empty = empty.all(dim=0)  # (B, H)
    m = torch.where(all_empty, torch.zeros_like(m), m)
    total = m + torch.log(torch.exp((lse - m) * ln_base).sum(dim=0)) / ln_base  # -inf when all empty
    out = torch.zeros(outs.shape[1:], dtype=torch.float64)
    for r in range(outs.shape[0]):
        w = torch.exp((lse[r] - total) * ln_base)  # NaN on all-empty rows, 0 on empty chunks
        live = ~empty[r] & ~all_empty & (w > 0)
        term = torch.where(live.unsqueeze(-1), w.unsqueeze(-1) * outs[r], torch.zeros_like(outs[r]))
        out += term
    total = torch.where(all_empty, torch.full_like(total, -math.inf), total)
    return {"out": out.float(), "out_lse": total.float()}


FP32_EPS = 2.0 ** -23
LSE_SLACK_ULPS = 2.0
"""fp32 ulps of |L| added to the output's relative bound (:func:`lse_slack`)."""


def lse_slack(lse: torch.Tensor) -> torch.Tensor:
    """Extra relative error of every weight that comes from rounding the merged LSE to fp32: the
    contract's weights ``exp(l_r - L)`` (kernel_targets.md §4.2, vLLM's DCP kernel) take ``L`` in fp32,
    off by up to half an ulp of ``|L|``, which moves every weight by that much relative (2e-3 at
    ``|L| = 2e4``, negligible at realistic ``|L| < 20``). ``LSE_SLACK_ULPS`` x ulp(|L|) per row, 0 on
    all-empty rows.

    Args:
        lse: (B, H) the reference's merged LSE (float64; -inf on all-empty rows).

    Returns:
        (B, H) float64 dimensionless slack (multiplied by the row's largest live |o_r|).
    """
    mag = torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse))
    return LSE_SLACK_ULPS * FP32_EPS * mag


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any], got: Mapping[str, torch.Tensor],
          want: Mapping[str, torch.Tensor], tolerance: Mapping[str, Any]) -> list[str]:
    """Compare a candidate's outputs with :func:`reference`'s.

    ``out``: never NaN or inf (the inputs' live chunks are finite); ``|got - want| <= rtol * |want| +
    (atol + lse_slack) * scale`` where ``scale`` is the row's largest ``|o_r|`` over its live chunks (the
    magnitude the weighted sum rounds at; 0 on an all-empty row, whose output must be exactly 0) and
    ``lse_slack`` the rounding of ``L`` to fp32 (:func:`lse_slack`). ``out_lse``: -inf
    exactly where the reference has it (all-empty rows), never NaN or +inf, else ``|got - want| <= atol
    + rtol * |want|``.

    Args:
        inputs, params: as for :func:`reference`.
        got: the candidate's ``out`` and ``out_lse``.
        want: :func:`reference`'s outputs.
        tolerance: output name -> object with ``rtol``, ``atol`` (``out``: x the row's max live |o_r|;
            ``out_lse``: absolute, in the LSE's base) and ``source``.

    Returns:
        One-line mismatch descriptions; empty when the outputs are right.

    Source: kernel_targets.md §4.5 (merged LSE atol 1e-5; empty-row semantics exact, no NaN anywhere);
    task.toml [correctness.tolerance].
    """
    msgs: list[str] = []
    for name in OUTPUTS:
        g, w = got.get(name), want[name]
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            desc = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            msgs.append(f"{name}: expected {tuple(w.shape)} {w.dtype}, got {desc}")
    if msgs:
        return msgs
    g_out, w_out = got["out"].detach().cpu().double(), want["out"].double()
    g_lse, w_lse = got["out_lse"].detach().cpu().double(), want["out_lse"].double()

    nan = torch.isnan(g_out)
    if nan.any():
        msgs.append(f"out: {int(nan.sum())} NaN element(s), first at (b, h, d) = {_first(nan)}; the merge never "
                    "produces NaN (an empty chunk weighs 0, an all-empty row is 0: kernel_targets.md §4.4)")
    inf = torch.isinf(g_out)
    if inf.any():
        msgs.append(f"out: {int(inf.sum())} infinite element(s), first at {_first(inf)}; expected finite values")
    outs = inputs["outs"].detach().cpu().double()
    lses = inputs["lses"].detach().cpu().double()
    live = ~(torch.isnan(lses) | torch.isinf(lses))  # (N, B, H)
    mag = torch.where(live.unsqueeze(-1), outs.abs(), torch.zeros_like(outs)).nan_to_num(nan=0.0, posinf=0.0)
    scale = mag.amax(dim=(0, 3)).unsqueeze(-1)
    tol = tolerance["out"]
    bound = tol.rtol * w_out.abs() + (tol.atol + lse_slack(w_lse).unsqueeze(-1)) * scale.expand_as(w_out)
    err = (g_out - w_out).abs()
    bad = ~(err <= bound) & ~nan & ~inf
    if bad.any():
        i = _first(bad)
        msgs.append(f"out: {int(bad.sum())} element(s) beyond rtol {tol.rtol:g} x |expected| + (atol {tol.atol:g} + 2 ulp of |L|) "
                    f"x row max |o_r|; first at (b, h, d) = {i}: expected {float(w_out[i]):.9g}, got {float(g_out[i]):.9g} "
                    f"(allowed {float(bound[i]):.3g})")

    tol = tolerance["out_lse"]
    w_empty = w_lse == -math.inf
    if torch.isnan(g_lse).any():
        msgs.append(f"out_lse: NaN at (b, h) = {_first(torch.isnan(g_lse))}; expected -inf on all-empty rows and finite "
                    "values elsewhere (kernel_targets.md §4.4)")
    elif not torch.equal(g_lse == -math.inf, w_empty) or (g_lse == math.inf).any():
        diff = (g_lse == -math.inf) != w_empty
        where = _first(diff) if diff.any() else _first(g_lse == math.inf)
        msgs.append(f"out_lse: infinities differ from the reference at (b, h) = {where}: expected "
                    f"{float(w_lse[where]):.9g}, got {float(g_lse[where]):.9g} (-inf exactly on rows whose chunks are "
                    "all empty)")
    else:
        fin = ~w_empty
        bound = tol.atol + tol.rtol * w_lse.abs()
        bad = fin & ~((g_lse - w_lse).abs() <= bound)
        if bad.any():
            i = _first(bad)
            msgs.append(f"out_lse: {int(bad.sum())} element(s) beyond atol {tol.atol:g} + rtol {tol.rtol:g} x |expected|; "
                        f"first at (b, h) = {i}: expected {float(w_lse[i]):.9g}, got {float(g_lse[i]):.9g}")
    return msgs[:MAX_MESSAGES]


PAIR_MAX_LINES = 4


def chunk_permutation_relation(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                               twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                               info: Mapping[str, Any], params: Mapping[str, Any],
                               tolerance: Mapping[str, Any]) -> list[str]:
    """The merge is a sum over chunks: the same chunks in another order give the same ``out`` and
    ``out_lse`` up to the rounding of a reordered sum (twice the reference tolerance, since both calls
    may round), the same -inf rows, and never a NaN on one side only.

    A kernel that treats one chunk position specially (assumes chunk 0 is live, seeds its max with it)
    passes the reference check on draws where that position happens to be live and fails here.

    Args:
        inputs, outputs: the original inputs and the candidate's outputs on them.
        twin_inputs, twin_outputs: the chunks permuted (``inputs.permute_chunks``) and the outputs on them.
        info: ``{"perm": list of N ints}`` (twin chunk ``i`` = original chunk ``perm[i]``).
        params: unused. tolerance: as for :func:`check`.

    Returns:
        One line per output whose values move beyond the bound; empty when consistent.

    Source: kernel_targets.md §4.2 (a sum over chunks, order-free); task.toml
    [domain.invariances.chunk_permutation].
    """
    msgs: list[str] = []
    a_o, t_o = outputs.get("out"), twin_outputs.get("out")
    a_l, t_l = outputs.get("out_lse"), twin_outputs.get("out_lse")
    if not all(isinstance(x, torch.Tensor) for x in (a_o, t_o, a_l, t_l)) or a_o.shape != t_o.shape \
            or a_l.shape != t_l.shape:
        return []  # a missing or misshapen output is the reference check's to report
    a_o, t_o = a_o.detach().cpu().double(), t_o.detach().cpu().double()
    a_l, t_l = a_l.detach().cpu().double(), t_l.detach().cpu().double()
    outs, lses = inputs["outs"].detach().cpu().double(), inputs["lses"].detach().cpu().double()
    live = ~(torch.isnan(lses) | torch.isinf(lses))
    scale = torch.where(live.unsqueeze(-1), outs.abs(), torch.zeros_like(outs)).nan_to_num(nan=0.0).amax(dim=(0, 3))
    tol = tolerance["out"]
    bound = 2 * (tol.rtol * a_o.abs() + (tol.atol + lse_slack(a_l)).unsqueeze(-1) * scale.unsqueeze(-1))
    bad = ~((t_o - a_o).abs() <= bound) & ~(torch.isnan(a_o) & torch.isnan(t_o))
    if bad.any():
        i = _first(bad)
        msgs.append(f"out{list(i)} moves from {float(a_o[i]):.9g} to {float(t_o[i]):.9g} when the chunks are permuted "
                    f"by {list(info['perm'])} (allowed {float(bound[i]):.3g}); {int(bad.sum())} element(s) move")
    tol = tolerance["out_lse"]
    same_inf = (a_l == t_l) | (torch.isnan(a_l) & torch.isnan(t_l))
    bad = ~same_inf & ~((t_l - a_l).abs() <= 2 * (tol.atol + tol.rtol * a_l.abs()))
    if bad.any():
        i = _first(bad)
        msgs.append(f"out_lse{list(i)} moves from {float(a_l[i]):.9g} to {float(t_l[i]):.9g} when the chunks are "
                    f"permuted by {list(info['perm'])}; {int(bad.sum())} element(s) move")
    return msgs[:PAIR_MAX_LINES]
