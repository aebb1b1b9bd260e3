"""Reference and checker of the KDA decode task (one Kimi Delta Attention step over a slot pool).

Independent of ``k3_model``: the math of kernel_targets.md §5.1 in float64, sequence by sequence, with
the slot contract of §5.2 spelled out (index <= 0: output 0, no slot touched).

Source: shared/reference/kernel_targets.md §5.1 (recurrence, K3 gate, L2 norm), §5.2 (state layout
[slots, H, V, K], index <= 0), §5.5 (edge cases), §5.6 (tolerance: relative RMSE).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

OUTPUTS = ("out", "state")
MAX_MESSAGES = 6
L2_EPS = 1e-6
"""Inside the square root: q / sqrt(|q|^2 + 1e-6) (kernel_targets.md §5.1, §5.5)."""


def _step(q, k, v, raw_g, raw_beta, A_log, dt_bias, S, lower_bound: float):
    """One sequence, float64: q, k (H, K), v (H, V), raw_g (H, K), raw_beta (H,), S (H, V, K).
    Returns (o (H, V), S_new (H, V, K))."""
    H, K = q.shape
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS) / math.sqrt(K)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    g = lower_bound * torch.sigmoid(torch.exp(A_log).unsqueeze(-1) * (raw_g + dt_bias.view(H, K)))
    beta = torch.sigmoid(raw_beta)
    S = S * torch.exp(g).unsqueeze(1)  # decay key channels (the last axis of the V-first state)
    u = beta.unsqueeze(-1) * (v - torch.einsum("hvk,hk->hv", S, k))
    S = S + u.unsqueeze(-1) * k.unsqueeze(1)
    return torch.einsum("hvk,hk->hv", S, q), S


def reference(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The step's output and the state pool after it.

    Args:
        inputs: ``q``, ``k`` (B, H, K), ``v`` (B, H, V), ``raw_g`` (B, H, K), ``raw_beta`` (B, H), ``A_log``
            (H,), ``dt_bias`` (H*K,), ``state`` (S, H, V, K) float32; ``state_indices`` (B,) int.
        params: ``lower_bound`` (float, < 0).

    Returns:
        ``out`` (B, H, V) float32 (0 on padding rows) and ``state`` (S, H, V, K) float32: the input pool
        with each active row's slot replaced by its updated state (rounded once from float64).
    """
    lb = float(params["lower_bound"])
    d = {n: inputs[n].detach().cpu() for n in inputs}
    B, H, _ = d["q"].shape
    V = d["v"].shape[2]
    out = torch.zeros((B, H, V), dtype=torch.float32)
    state = d["state"].clone()
    A_log, dt_bias = d["A_log"].double(), d["dt_bias"].double()
    for b in range(B):
        slot = int(d["state_indices"][b])
        if slot <= 0:
            continue
        o, s_new = _step(d["q"][b].double(), d["k"][b].double(), d["v"][b].double(), d["raw_g"][b].double(),
                         d["raw_beta"][b].double(), A_log, dt_bias, d["state"][slot].double(), lb)
        out[b] = o.float()
        state[slot] = s_new.float()
    return {"out": out, "state": state}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32)


def _rel_rmse_rows(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor):
    """Per leading index in ``rows``: (rms(got - want), rms(want)) in float64; NaN where got is not finite."""
    g, w = got[rows].double().flatten(1), want[rows].double().flatten(1)
    return (g - w).pow(2).mean(1).sqrt(), w.pow(2).mean(1).sqrt()


def check(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any], got: Mapping[str, torch.Tensor],
          want: Mapping[str, torch.Tensor], tolerance: Mapping[str, Any]) -> list[str]:
    """Compare a candidate's outputs with :func:`reference`'s.

    ``out``: exactly 0 on padding rows; on every active row ``rms(got - want) <= rtol * rms(want) + atol``
    over the row's H x V values (fla's relative RMSE, per sequence so one wrong sequence cannot hide in a
    large batch), never NaN or inf. ``state``: every slot no active row names keeps its bits (the null
    slot 0 and padding rows' slots included); every active row's slot meets the same relative-RMSE bound
    over its H x V x K values.

    Args:
        inputs, params: as for :func:`reference` (the inputs as they were before the call).
        got: the candidate's ``out`` and ``state`` (the pool after the call).
        want: :func:`reference`'s outputs.
        tolerance: output name -> object with ``rtol`` (of the row's RMS), ``atol`` (absolute RMS) and
            ``source``.

    Returns:
        One-line mismatch descriptions; empty when the outputs are right.

    Source: kernel_targets.md §5.6 (relative RMSE ``|a - b|_2 / |a|_2``; untouched slots exact, padding
    rows exact zeros); task.toml [correctness.tolerance].
    """
    msgs: list[str] = []
    for name in OUTPUTS:
        g, w = got.get(name), want[name]
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            desc = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            msgs.append(f"{name}: expected {tuple(w.shape)} {w.dtype}, got {desc}")
    if msgs:
        return msgs
    idx = inputs["state_indices"].detach().cpu().long()
    active = idx > 0
    g_out, w_out = got["out"].detach().cpu(), want["out"]
    pad_rows = (~active).nonzero().flatten()
    if len(pad_rows):
        nz = g_out[pad_rows].flatten(1).ne(0).any(1)  # NaN != 0 too
        if nz.any():
            b = int(pad_rows[nz.nonzero()[0, 0]])
            msgs.append(f"out: padding row b = {b} (state_indices[b] = {int(idx[b])} <= 0) holds non-zero values, "
                        f"e.g. {float(g_out[b].flatten()[g_out[b].flatten().ne(0)][0]):.6g}; padding rows output "
                        "exactly 0 (kernel_targets.md §5.2, rtp-llm PR 899)")
    rows = active.nonzero().flatten()
    tol = tolerance["out"]
    if len(rows):
        err, mag = _rel_rmse_rows(g_out, w_out, rows)
        bad = ~(err <= tol.rtol * mag + tol.atol)
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            b = int(rows[i])
            msgs.append(f"out: {int(bad.sum())} of {len(rows)} active row(s) beyond relative RMSE {tol.rtol:g} (+ atol "
                        f"{tol.atol:g}); first b = {b} (slot {int(idx[b])}): rms error {float(err[i]):.3g} against rms "
                        f"{float(mag[i]):.3g} (relative {float(err[i] / max(float(mag[i]), 1e-300)):.3g})")

    S = inputs["state"].shape[0]
    touched = torch.zeros(S, dtype=torch.bool)
    touched[idx[active]] = True
    before, after = _bits(inputs["state"]), _bits(got["state"])
    moved = (before != after).flatten(1).any(1) & ~touched
    if moved.any():
        s = int(moved.nonzero()[0, 0])
        why = ("the null slot, which padding rows must not touch" if s == 0 else
               "named by a padding row" if bool((idx == s).any()) else "named by no row of this batch")
        msgs.append(f"state: {int(moved.sum())} slot(s) changed that no active row owns; first slot {s} ({why}); "
                    "every other slot keeps its bits (kernel_targets.md §5.5)")
    slots = idx[active]
    tol = tolerance["state"]
    if len(slots):
        err, mag = _rel_rmse_rows(got["state"].detach().cpu(), want["state"], slots)
        bad = ~(err <= tol.rtol * mag + tol.atol)
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            msgs.append(f"state: {int(bad.sum())} of {len(slots)} updated slot(s) beyond relative RMSE {tol.rtol:g} "
                        f"(+ atol {tol.atol:g}); first slot {int(slots[i])} (row b = {int(rows[i])}): rms error "
                        f"{float(err[i]):.3g} against rms {float(mag[i]):.3g} (relative "
                        f"{float(err[i] / max(float(mag[i]), 1e-300)):.3g})")
    return msgs[:MAX_MESSAGES]


PAIR_MAX_LINES = 4


def row_permutation_relation(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                             twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                             info: Mapping[str, Any], params: Mapping[str, Any],
                             tolerance: Mapping[str, Any]) -> list[str]:
    """Sequences are independent: the same rows in another batch order (each with its slot) give the
    same outputs permuted and the same pool, up to twice the reference tolerance (both calls may round).

    A kernel that treats one batch position specially (row 0 always active, a tail handled apart) can pass
    the reference on draws where that position happens to be harmless and fails here.

    Args:
        inputs, outputs: the original inputs and the candidate's outputs on them.
        twin_inputs, twin_outputs: the rows permuted (``inputs.permute_rows``) and the outputs on them.
        info: ``{"perm": list of B ints}`` (twin row ``i`` = original row ``perm[i]``).
        params: unused. tolerance: as for :func:`check`.

    Returns:
        One line per output that moves beyond the bound; empty when consistent.

    Source: kernel_targets.md §5.1 (one recurrence per sequence); task.toml [domain.invariances.row_permutation].
    """
    msgs: list[str] = []
    a_o, t_o, a_s, t_s = (x.get(n) for x, n in ((outputs, "out"), (twin_outputs, "out"), (outputs, "state"),
                                                 (twin_outputs, "state")))
    if not all(isinstance(x, torch.Tensor) for x in (a_o, t_o, a_s, t_s)) or a_o.shape != t_o.shape \
            or a_s.shape != t_s.shape:
        return []  # a missing or misshapen output is the reference check's to report
    perm = torch.tensor(list(info["perm"]), dtype=torch.long)
    a_o, t_o = a_o.detach().cpu().double()[perm], t_o.detach().cpu().double()
    a_s, t_s = a_s.detach().cpu().double(), t_s.detach().cpu().double()
    for name, a, t in (("out", a_o, t_o), ("state", a_s, t_s)):
        tol = tolerance[name]
        fin = torch.isfinite(a).flatten(1).all(1) & torch.isfinite(t).flatten(1).all(1)
        err = (a - t).flatten(1).pow(2).mean(1).sqrt()
        mag = a.flatten(1).pow(2).mean(1).sqrt()
        same = (a == t).flatten(1).all(1) | (torch.isnan(a) == torch.isnan(t)).flatten(1).all(1) & ~fin
        bad = ~same & ~(err <= 2 * (tol.rtol * mag + tol.atol))
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            where = f"twin row {i} (original row {int(perm[i])})" if name == "out" else f"slot {i}"
            msgs.append(f"{name} at {where} moves by rms {float(err[i]):.3g} (rms {float(mag[i]):.3g}) when the batch "
                        f"rows are permuted by {list(info['perm'])}; {int(bad.sum())} row(s)/slot(s) move")
    return msgs[:PAIR_MAX_LINES]
