"""Reference and checker of the TP all-reduce + residual + RMSNorm task.

Independent of ``k3_model``: the partials of all ranks are summed here in one process, in rank order,
in fp32, then the residual add and the norm follow kernel_targets.md §1.2 (the FlashInfer rounding:
one rounding of the normalised value).

Source: shared/reference/kernel_targets.md §1.2 (reference math), §1.5 (tolerances).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

OUTPUTS = ("x", "residual")
MAX_MESSAGES = 3
BF16_MANTISSA_BITS = 7
"""Explicit mantissa bits of bfloat16: one ulp of v is 2^(floor(log2|v|) - 7); bf16 eps = 2^-7."""


def reference(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """What every rank must hold after the call.

    Args:
        inputs: ``x`` bf16 [W, T, D] (all ranks' partials), ``residual`` bf16 [T, D], ``weight`` bf16 [D].
        params: ``eps`` (dimensionless).

    Returns:
        ``x``: bf16 [T, D] normalised output; ``residual``: bf16 [T, D] R'.
    """
    x, res, w = inputs["x"].cpu(), inputs["residual"].cpu(), inputs["weight"].cpu()
    acc = x[0].float()
    for r in range(1, x.shape[0]):  # rank order, fp32 (IEEE: -0.0 + -0.0 stays -0.0)
        acc = acc + x[r].float()
    a = acc.to(res.dtype)
    r_new = (a.float() + res.float()).to(res.dtype)
    rf = r_new.float()
    out = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + float(params["eps"])) * w.float()).to(res.dtype)
    return {"x": out, "residual": r_new}


def ulp(v: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each element of ``v`` (float32; the smallest normal's ulp at 0)."""
    a = v.float().abs().clamp(min=2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - BF16_MANTISSA_BITS)


def bound(g: torch.Tensor, w: torch.Tensor, rtol: float, atol_rms: float, row_rms: torch.Tensor) -> torch.Tensor:
    """Largest allowed ``|got - expected|`` per element: ``rtol * max(|expected|, |got|) + atol_rms * row_rms``.

    Relative to the larger magnitude, so the bound does not depend on where a value falls between two
    powers of two: an ulp taken from the expected value's exponent halves just below a power of two,
    and a correct rounding that lands on the power of two (vLLM's native RMSNorm: 0.99609375 expected,
    1.0078125 got, 3 ulp of the expected value but 1.2 ulp of the larger one) would be rejected. With
    ``rtol = n * 2^-7`` the bound is at least n bf16 ulp of the larger value and less than 2n of them,
    so a whole n ulp is always accepted and 2n ulp inside one binade never is.

    Args:
        g: got, float32, any shape.
        w: expected, float32, the shape of ``g``.
        rtol: relative tolerance (dimensionless; 2^-7 = one bf16 eps).
        atol_rms: absolute tolerance in units of the reference row's RMS.
        row_rms: (..., 1) float32 RMS of each reference row (non-finite elements counted as 0).

    Returns:
        float32 tensor of the shape of ``g``.

    Source: Python's ``math.isclose`` rule ``|a-b| <= rel_tol * max(|a|, |b|)`` (PEP 485);
    kernel_targets.md §1.5 (out: rtol 1.6e-2 plus 1e-3 x rms(ref); R': 1 ulp); issue 12 ("bounds
    that do not depend on where a value falls between powers of two").
    """
    return rtol * torch.maximum(g.abs(), w.abs()) + atol_rms * row_rms.expand_as(w)


def _compare(name: str, g: torch.Tensor, w: torch.Tensor, rtol: float, atol_rms: float) -> list[str]:
    gf, wf = g.float(), w.float()
    msgs = []
    nan_g, nan_w = torch.isnan(gf), torch.isnan(wf)
    if not torch.equal(nan_g, nan_w):
        i = int((nan_g != nan_w).nonzero()[0, 0]) if (nan_g != nan_w).dim() > 1 else 0
        msgs.append(f"{name}: NaN at other elements than the reference (first differing token {i}: "
                    f"{int(nan_g[i].sum())} NaN vs {int(nan_w[i].sum())} expected)")
        return msgs
    inf_w = torch.isinf(wf)
    if not torch.equal(gf[inf_w], wf[inf_w]) or torch.isinf(gf[~inf_w & ~nan_w]).any():
        msgs.append(f"{name}: infinities differ from the reference")
        return msgs
    fin = ~nan_w & ~inf_w
    row_rms = torch.nan_to_num(wf, nan=0.0, posinf=0.0, neginf=0.0).pow(2).mean(-1, keepdim=True).sqrt()
    zero = torch.zeros_like(wf)
    tol = bound(torch.where(fin, gf, zero), torch.where(fin, wf, zero), rtol, atol_rms, row_rms)
    err = torch.where(fin, (gf - wf).abs(), zero)
    bad = err > torch.where(fin, tol, zero)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        n_eps = rtol / 2.0 ** -BF16_MANTISSA_BITS
        msgs.append(f"{name}: {int(bad.sum())} element(s) beyond {n_eps:g} bf16 eps x max(|expected|, |got|)"
                    f"{f' + {atol_rms:g} x row rms' if atol_rms else ''}; first at {idx}: expected "
                    f"{float(wf[idx]):.8g}, got {float(gf[idx]):.8g} ({float(err[idx] / ulp(wf[idx])):.2f} ulp of "
                    f"the expected value, allowed {float(tol[idx]):.3g})")
    return msgs


def check(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any], got: Mapping[str, torch.Tensor],
          want: Mapping[str, torch.Tensor], tolerance: Mapping[str, Any]) -> list[str]:
    """Compare one rank's outputs with :func:`reference`'s.

    NaN and infinity positions must match exactly; finite elements within ``rtol`` x the larger of
    ``|expected|`` and ``|got|`` plus ``atol`` x the reference row's RMS (:func:`bound`; zeros of either
    sign are equal). Bitwise
    identity across ranks is checked by the correctness guard (``identical_across_ranks``).

    Args:
        inputs, params: as for :func:`reference`.
        got: the rank's ``x`` and ``residual`` after the call.
        want: :func:`reference`'s outputs.
        tolerance: output name -> object with ``rtol`` (relative; 2^-7 = one bf16 eps), ``atol`` (x row
            RMS), ``source``.

    Returns:
        One-line mismatch descriptions; empty when the outputs are right.

    Source: kernel_targets.md §1.5; task.toml [correctness.tolerance]; :func:`bound`.
    """
    msgs: list[str] = []
    for name in OUTPUTS:
        g, w = got.get(name), want[name]
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            desc = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            msgs.append(f"{name}: expected {tuple(w.shape)} {w.dtype}, got {desc}")
            continue
        tol = tolerance[name]
        msgs += _compare(name, g.detach().cpu(), w, tol.rtol, tol.atol)
    return msgs[: MAX_MESSAGES + 1]


PAIR_MAX_LINES = 3


def token_permutation_relation(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                               twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                               info: Mapping[str, Any], params: Mapping[str, Any],
                               tolerance: Mapping[str, Any]) -> list[str]:
    """Each token is reduced and normalised on its own: permuting the tokens permutes the rows of ``x``
    and ``residual``, bit for bit (the sign of zero included), except that a NaN matches any NaN: which
    payload and sign a NaN carries out of an arithmetic op is not fixed (IEEE 754 §6.2.3; a vectorised
    loop's body and its scalar tail can propagate different operands' payloads), so an honest kernel's NaN
    bits can follow the token's position (seen: the honest native-RMSNorm kernel, seed 428790219).

    Bitwise because the contract fixes the arithmetic per element (the partials summed in rank order
    in fp32, then the residual add, then the row's norm): nothing in it depends on where a token sits
    in the batch, and a kernel that reduces some tokens in another order or rounds them another way
    (still within the 1-2 ulp the reference check allows) breaks the pair.

    Args:
        inputs, outputs: the original inputs (``x`` stacked ``[W, T, D]``) and one rank's ``x`` and
            ``residual`` after the call, bf16 ``[T, D]``.
        twin_inputs, twin_outputs: the permuted inputs and the same rank's outputs on them.
        info: ``{"perm": list of T ints}`` from ``inputs.permute_tokens`` (twin token ``i`` = token ``perm[i]``).
        params, tolerance: unused.

    Returns:
        One line per output whose rows differ (first differing twin row and element, expected, got);
        empty when consistent.

    Source: kernel_targets.md §1.2 (the math per token), the task's contract (reduce in rank order, in
    fp32); task.toml [domain.invariances.token_permutation].
    """
    perm = torch.tensor(list(info["perm"]), dtype=torch.long)
    msgs: list[str] = []
    for name in OUTPUTS:
        a, t = outputs.get(name), twin_outputs.get(name)
        if not isinstance(a, torch.Tensor) or not isinstance(t, torch.Tensor) or a.shape != t.shape or a.dtype != t.dtype:
            return []  # a missing or misshapen output is the reference check's to report
        want = a.detach().cpu()[perm].contiguous()
        got = t.detach().cpu().contiguous()
        bits = {2: torch.int16, 4: torch.int32}.get(want.element_size())
        differ = (want.view(bits) != got.view(bits)) if bits is not None else (want != got)
        differ &= ~(torch.isnan(want) & torch.isnan(got))  # a NaN's payload and sign are no contract (below)
        if bool(differ.any()):
            i, d = (int(v) for v in differ.nonzero()[0])
            rows = int(differ.any(-1).sum())
            msgs.append(f"{name}[{i}, {d}] of the twin (token {int(perm[i])} of the original): expected "
                        f"{float(want[i, d]):.8g} (the candidate's own value for this token on the original batch), "
                        f"got {float(got[i, d]):.8g}; {rows} of {got.shape[0]} rows differ (bitwise)")
    return msgs[:PAIR_MAX_LINES]
