"""Independent float64 oracle and output checker for the K3 DSpark draft-verification task.

Written from the math (Leviathan et al. 2023, Algorithm 1; kernel_targets.md §2.3), not from the
model's code: one request at a time, one position at a time, stopping at the first rejection (only
the positions a request reaches are ever scored), in float64 with Python control flow.

Exactness. Greedy requests are integer logic on the exact input logits: the checker demands exact
tokens. Sampled requests are exact given the random draws (inputs), except where a decision lies
within fp32 rounding of its boundary: there the checker accepts either outcome and follows the
candidate's branch (as the MoE task accepts near-tie swaps). The margins:

* ``REL_PROB = 1e-4``: relative error allowed on every target probability. An fp32 implementation
  divides by the temperature (|z| up to ~200 here), subtracts the max, exponentiates and normalizes
  over up to 163840 terms: ~200 * 2^-24 (3e-5 relative from the rounding of z) + the sum's rounding
  (<1e-6 pairwise/tree), so 1e-4 leaves a 3x headroom. kernel_targets.md §2.6 asks fp32 target
  probabilities to rtol 1e-5; the decisions are checked 10x looser than that because a candidate may
  compute in another order (x / T vs x * (1/T), log domain).
* ``EPS_MASS = 1e-4``: the top-p boundary. A token whose "strictly larger" mass lies within 1e-4 of
  top_p may be kept or dropped (an fp32 cumulative sum over up to 163840 sorted probabilities has an
  absolute error of about sqrt(V) * 2^-24 ≈ 2.4e-5 when its terms round independently).
  The probabilities' bounds then cover both choices.

* ``P_UNDERFLOW = 2**-100``: a target probability below it may be exactly 0 in fp32 (``exp`` of a logit
  gap beyond ~87 nats underflows to a subnormal or, with flush-to-zero, to 0; a low temperature makes
  such gaps: 20 logits at T = 0.2). Its lower bound is 0, so at u = 0 the draft may be rejected (the
  fp32 probability is 0) or accepted (the exact one is not). Session 20: continuous temperature draws
  down to 0.02 met this at u = 0.

A decision is ambiguous only when the quantity it compares sits inside those bounds; with the
task's inputs this happens in well under 1 of 10^4 decisions, so nearly every row is compared
token for token.

Source: shared/reference/kernel_targets.md §2.3 (math), §2.5 (edge cases), §2.6 (tolerances);
k3_model/ops/dspark_verify.py module docstring (the contract: draws as inputs, strict u < p/q,
exponential race, top-k/top-p rules, tie rules); tasks/k3_dspark_verify/task.toml.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

OUTPUTS = ("output_token_ids", "num_accepted_tokens")
PLACEHOLDER = -1
REL_PROB = 1e-4
EPS_MASS = 1e-4
P_UNDERFLOW = 2.0 ** -100
MAX_MESSAGES = 20


class Dist(NamedTuple):
    """The target distribution at one position of one sampled request, with rounding bounds.

    Attributes:
        p: (V,) float64 probabilities (sum 1), exact math on the input logits.
        lo, hi: (V,) float64 bounds an fp32 implementation's probabilities may take (``lo <= p <= hi``);
            ``None`` unless asked for.
    """

    p: torch.Tensor
    lo: torch.Tensor | None
    hi: torch.Tensor | None


def target_dist(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float, bounds: bool = False) -> Dist:
    """Temperature, top-k, softmax, top-p and renormalization of one position, in float64.

    Args:
        logits_row: (V,) logits (any float dtype; converted exactly to float64).
        temperature: > 0.
        top_k: ``0 < k < V`` keeps every token whose logit is >= the k-th largest; otherwise off.
        top_p: in (0, 1]; < 1 keeps token j iff the mass of the tokens with strictly larger
            probability (after top-k) is < top_p.
        bounds: also compute ``lo``/``hi``: ``REL_PROB`` relative, plus tokens within ``EPS_MASS`` of
            the top-p boundary counted as either kept or dropped.

    Returns:
        :class:`Dist`.

    Source: module docstring; kernel_targets.md §2.1 step 2 (vLLM ``apply_top_k_top_p``: top-k on the
    logits, then top-p over the renormalized probabilities).
    """
    x = logits_row.double()
    V = x.numel()
    idx = None  # the top-k support (None: every token)
    if 0 < top_k < V:
        idx = torch.nonzero(x >= torch.topk(x, top_k).values[-1]).flatten()
        x = x[idx]
    pi = torch.softmax(x / temperature, 0)
    keep = sure = maybe = None
    if top_p < 1.0:
        vals, order = torch.sort(pi, descending=True, stable=True)
        first = torch.searchsorted(-vals, -vals, side="left")  # first member of each tie group
        above = torch.empty_like(vals).scatter_(0, order, (torch.cumsum(vals, 0) - vals)[first])
        keep = above < top_p
        sure = above < top_p - EPS_MASS
        maybe = ~sure & (above < top_p + EPS_MASS)
    p = pi if keep is None else torch.where(keep, pi, 0.0)
    p = p / p.sum()

    def full(v: torch.Tensor) -> torch.Tensor:
        return v if idx is None else torch.zeros(V, dtype=torch.float64).index_copy_(0, idx, v)

    if not bounds:
        return Dist(full(p), None, None)
    if keep is None:
        lo = p * (1 - REL_PROB)
        return Dist(full(p), full(torch.where(p < P_UNDERFLOW, 0.0, lo)), full(p * (1 + REL_PROB)))
    s_sure, s_maybe = float(pi[sure].sum()), float(pi[maybe].sum())
    hi = torch.where(sure | maybe, pi / s_sure, 0.0) * (1 + REL_PROB)
    lo = torch.where(sure, pi / (s_sure + s_maybe), 0.0) * (1 - REL_PROB)
    return Dist(full(p), full(torch.where(lo < P_UNDERFLOW, 0.0, lo)), full(hi))


def _argmax_first(v: torch.Tensor) -> int:
    """Lowest index of the maximum (NaN-free input)."""
    return int(torch.nonzero(v == v.max())[0])


def race_winner(weights: torch.Tensor, noise: torch.Tensor) -> int:
    """Exponential race: ``argmax_t weights[t] / noise[t]`` (ties: lowest id) — a categorical draw
    proportional to ``weights`` when ``noise`` ~ Exp(1) i.i.d.

    Source: kernel_targets.md §2.1 (``sample_recovered_tokens_kernel``: argmax(prob / Q)).
    """
    return _argmax_first(weights / noise.double())


def race_allowed(w_lo: torch.Tensor, w_hi: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(V,) bool: tokens that can win the race for some weights between ``w_lo`` and ``w_hi``."""
    e = noise.double()
    s_hi = w_hi / e
    return (s_hi > 0) & (s_hi >= float((w_lo / e).max()))


def _residual(p: torch.Tensor, q: torch.Tensor | None, draft: int) -> torch.Tensor:
    """``max(p - q, 0)``, or ``p`` with the draft zeroed (one-hot q); ``p`` if that is all zero."""
    if q is None:
        r = p.clone()
        r[draft] = 0.0
    else:
        r = (p - q.double()).clamp_min(0.0)
    return r if float(r.sum()) > 0 else p


def _validate(inputs: Mapping[str, torch.Tensor], D: int) -> None:
    """Value checks of the contract.

    Raises:
        ValueError: a value outside the contract (which value, where, what is allowed).
    """
    logits = inputs["target_logits"]
    B, D1, V = logits.shape
    n = inputs["num_draft_tokens"]
    if D1 != D + 1:
        raise ValueError(f"k3_dspark_verify reference: target_logits has {D1} positions; expected D+1 = {D + 1}.")
    if bool(((n < 0) | (n > D)).any()):
        raise ValueError(f"k3_dspark_verify reference: num_draft_tokens must lie in [0, {D}]; got {n.tolist()}.")
    t = inputs["temperature"]
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"k3_dspark_verify reference: temperature must be finite and >= 0 (0.0 = greedy, no -1 "
                         f"sentinel); got {t.tolist()}.")
    tp = inputs["top_p"]
    if bool(((tp <= 0) | (tp > 1)).any()):
        raise ValueError(f"k3_dspark_verify reference: top_p must lie in (0, 1]; got {tp.tolist()}.")
    # top_k: any int32 is legal; k <= 0 or k >= V is off (target_dist), as the op's contract says
    ids = inputs["draft_token_ids"]
    for b in range(B):
        row = ids[b, : int(n[b])]
        if bool(((row < 0) | (row >= V)).any()):
            raise ValueError(f"k3_dspark_verify reference: draft_token_ids[{b}, :{int(n[b])}] must lie in [0, {V}); "
                             f"got {row.tolist()}.")
    u = inputs["uniform_draws"]
    if bool(((u < 0) | (u >= 1)).any()):
        raise ValueError("k3_dspark_verify reference: uniform_draws must lie in [0, 1).")
    e = inputs["exponential_noise"]
    if not bool(torch.isfinite(e).all()) or bool((e <= 0).any()):
        raise ValueError("k3_dspark_verify reference: exponential_noise must be positive and finite.")


class _Request(NamedTuple):
    """One request's inputs, as Python values and CPU tensors (a NamedTuple: this file is loaded by
    path, outside ``sys.modules``, where dataclasses cannot resolve their annotations)."""

    logits: torch.Tensor  # (D+1, V)
    drafts: list[int]  # the n_b real drafts
    q: torch.Tensor | None  # (D, V) or None
    temperature: float
    top_k: int
    top_p: float
    u: list[float]
    noise: torch.Tensor  # (V,)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def dist(self, i: int, bounds: bool = False) -> Dist:
        return target_dist(self.logits[i], self.temperature, self.top_k, self.top_p, bounds)


def _requests(inputs: Mapping[str, torch.Tensor]) -> list[_Request]:
    dp = inputs.get("draft_probs")
    has_dp = dp is not None and dp.numel() > 0
    out = []
    for b in range(inputs["target_logits"].shape[0]):
        n = int(inputs["num_draft_tokens"][b])
        out.append(_Request(
            logits=inputs["target_logits"][b],
            drafts=inputs["draft_token_ids"][b, :n].tolist(),
            q=dp[b] if has_dp else None,
            temperature=float(inputs["temperature"][b]),
            top_k=int(inputs["top_k"][b]),
            top_p=float(inputs["top_p"][b]),
            u=inputs["uniform_draws"][b].tolist(),
            noise=inputs["exponential_noise"][b],
        ))
    return out


def verify_request(r: _Request) -> tuple[list[int], int]:
    """Emitted tokens and accepted-draft count of one request (Leviathan et al. 2023, Algorithm 1).

    Returns:
        (tokens, accepted): ``accepted`` drafts followed by one target token.
    """
    out: list[int] = []
    for i, d in enumerate(r.drafts):
        if r.greedy:
            best = _argmax_first(r.logits[i].double())
            if d != best:
                return out + [best], i
        else:
            dist = r.dist(i)
            q_d = 1.0 if r.q is None else float(r.q[i, d])
            if not (q_d > 0 and r.u[i] < float(dist.p[d]) / q_d):
                w = _residual(dist.p, None if r.q is None else r.q[i], d)
                return out + [race_winner(w, r.noise)], i
        out.append(d)
    n = len(r.drafts)
    bonus = _argmax_first(r.logits[n].double()) if r.greedy else race_winner(r.dist(n).p, r.noise)
    return out + [bonus], n


def reference(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Verify every request's drafts; the canonical outputs.

    Args:
        inputs: ``target_logits`` (B, D+1, V) bfloat16/float32; ``draft_token_ids`` (B, D) int32;
            ``num_draft_tokens`` (B,) int32; ``draft_probs`` (B, D, V) float32 or empty (one-hot
            drafts); ``temperature`` (B,) float32 (0.0 = greedy); ``top_k`` (B,) int32 (0 = off);
            ``top_p`` (B,) float32 (1.0 = off); ``uniform_draws`` (B, D) float32 in [0, 1);
            ``exponential_noise`` (B, V) float32 > 0.
        params: ``max_draft_tokens`` D (int).

    Returns:
        ``output_token_ids`` (B, D+1) int32 padded with -1; ``num_accepted_tokens`` (B,) int32; CPU.

    Raises:
        ValueError: an input value outside the contract (see :func:`_validate`).

    Source: kernel_targets.md §2.3; module docstring.
    """
    inputs = {k: v.detach().cpu() for k, v in inputs.items()}
    D = int(params["max_draft_tokens"])
    _validate(inputs, D)
    B = inputs["target_logits"].shape[0]
    out = torch.full((B, D + 1), PLACEHOLDER, dtype=torch.int32)
    acc = torch.zeros(B, dtype=torch.int32)
    for b, r in enumerate(_requests(inputs)):
        toks, a = verify_request(r)
        out[b, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
        acc[b] = a
    return {"output_token_ids": out, "num_accepted_tokens": acc}


def _walk(r: _Request, row: list[int]) -> tuple[list[str], int | None]:
    """Follow a candidate's row decision by decision, allowing either outcome of a decision only
    where it lies within the rounding margins. Returns (problems, accepted count the row implies)."""
    D1 = len(row)

    def tail_ok(start: int) -> list[str]:
        bad = [j for j in range(start, D1) if row[j] != PLACEHOLDER]
        return [f"columns {bad} after the last emitted token must be -1, got {[row[j] for j in bad]}"] if bad else []

    for i, d in enumerate(r.drafts):
        tok = row[i]
        if r.greedy:
            best = _argmax_first(r.logits[i].double())
            if d == best and tok == d:
                continue
            if d != best and tok == best:
                return tail_ok(i + 1), i
            if d == best:
                return [f"column {i} (greedy): draft {d} is the target argmax and must be accepted, got {tok}"], None
            return [f"column {i} (greedy): draft {d} is not the target argmax {best}: expected {best}, got {tok}"], None
        dist = r.dist(i, bounds=True)
        q_d = 1.0 if r.q is None else float(r.q[i, d])
        u = r.u[i]
        acc_ok = q_d > 0 and u * q_d < float(dist.hi[d])
        rej_ok = not (q_d > 0) or u * q_d >= float(dist.lo[d])
        if tok == d and acc_ok:
            continue
        if rej_ok:
            if r.q is None:
                w_lo, w_hi = dist.lo.clone(), dist.hi.clone()
                w_lo[d] = w_hi[d] = 0.0
            else:
                qi = r.q[i].double()
                w_lo, w_hi = (dist.lo - qi).clamp_min(0), (dist.hi - qi).clamp_min(0)
            allowed = race_allowed(w_lo, w_hi, r.noise) if float(w_hi.sum()) > 0 else torch.zeros(len(dist.p), dtype=torch.bool)
            if float(w_lo.sum()) == 0:  # the all-zero-residual fallback (sample from p) may apply
                allowed |= race_allowed(dist.lo, dist.hi, r.noise)
            if 0 <= tok < len(allowed) and bool(allowed[tok]):
                return tail_ok(i + 1), i
            want = race_winner(_residual(dist.p, None if r.q is None else r.q[i], d), r.noise)
            return [f"column {i} (sampled): draft {d} with u={u:.6g}, p(d)={float(dist.p[d]):.6g}, q(d)={q_d:.6g} is "
                    f"{'rejected' if not acc_ok else 'accepted or rejected (near the boundary)'}; expected the residual "
                    f"race winner {want}, got {tok}"], None
        return [f"column {i} (sampled): draft {d} with u={u:.6g}, p(d)={float(dist.p[d]):.6g}, q(d)={q_d:.6g} must be "
                f"accepted (u < p/q), got {tok}"], None
    n = len(r.drafts)
    tok = row[n] if n < D1 else None
    if r.greedy:
        best = _argmax_first(r.logits[n].double())
        if tok == best:
            return tail_ok(n + 1), n
        return [f"column {n} (greedy bonus after {n} accepted drafts): expected the argmax {best}, got {tok}"], None
    dist = r.dist(n, bounds=True)
    allowed = race_allowed(dist.lo, dist.hi, r.noise)
    if tok is not None and 0 <= tok < len(allowed) and bool(allowed[tok]):
        return tail_ok(n + 1), n
    return [f"column {n} (sampled bonus after {n} accepted drafts): expected the race winner "
            f"{race_winner(dist.p, r.noise)}, got {tok}"], None


def check(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any], got: Mapping[str, torch.Tensor],
          want: Mapping[str, torch.Tensor], tolerance: Mapping[str, Any]) -> list[str]:
    """Compare a candidate's outputs with :func:`reference`'s.

    Rows equal to the reference's pass at once. A differing row is replayed decision by decision
    (:func:`_walk`): greedy decisions must be exact; a sampled decision may go either way only
    within the ``REL_PROB`` / ``EPS_MASS`` margins (module docstring), and the replay follows the
    candidate's branch. ``num_accepted_tokens[b]`` must equal the number of drafts the row accepts.

    Args:
        inputs, params: as for :func:`reference`.
        got: the candidate's outputs (name -> tensor).
        want: :func:`reference`'s outputs for the same inputs.
        tolerance: output name -> object with ``exact`` and ``source`` (both outputs are exact).

    Returns:
        One-line mismatch descriptions (output, request, column, expected, got), at most
        ``MAX_MESSAGES`` + 1; empty when the candidate is correct.

    Source: kernel_targets.md §2.6 (exact given the same draws); module docstring (margins).
    """
    cpu = lambda d: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}  # noqa: E731
    inputs, got, want = cpu(inputs), cpu(got), cpu(want)
    msgs: list[str] = []
    for name in OUTPUTS:
        g, w = got.get(name), want[name]
        if not (isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype):
            desc = "missing" if g is None else f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            msgs.append(f"{name}: expected shape {tuple(w.shape)} dtype {w.dtype}, got {desc}")
    if msgs:
        return msgs
    g_out, w_out = got["output_token_ids"], want["output_token_ids"]
    g_acc, w_acc = got["num_accepted_tokens"].tolist(), want["num_accepted_tokens"].tolist()
    reqs = None
    for b in range(g_out.shape[0]):
        if torch.equal(g_out[b], w_out[b]):
            if g_acc[b] != w_acc[b]:
                msgs.append(f"num_accepted_tokens[{b}]: expected {w_acc[b]} (the row {w_out[b].tolist()}), got {g_acc[b]}")
            continue
        reqs = reqs if reqs is not None else _requests(inputs)
        problems, implied = _walk(reqs[b], g_out[b].tolist())
        if problems:
            kind = "greedy" if reqs[b].greedy else "sampled"
            msgs += [f"output_token_ids[{b}] ({kind}, n_b={len(reqs[b].drafts)}): {p}; expected row "
                     f"{w_out[b].tolist()}, got {g_out[b].tolist()}" for p in problems[:1]]
        elif g_acc[b] != implied:
            msgs.append(f"num_accepted_tokens[{b}]: the row {g_out[b].tolist()} accepts {implied} drafts, got {g_acc[b]}")
    if len(msgs) > MAX_MESSAGES:
        msgs = msgs[:MAX_MESSAGES] + [f"... and {len(msgs) - MAX_MESSAGES} more mismatch lines"]
    return msgs


PAIR_MAX_LINES = 6


def request_permutation_relation(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                                 twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                                 info: Mapping[str, Any], params: Mapping[str, Any],
                                 tolerance: Mapping[str, Any]) -> list[str]:
    """A request's result depends on its own inputs only: permuting the batch (each request with its own
    logits, drafts, parameters and random draws) permutes the output rows, exactly.

    Exact because the random draws are inputs: a correct kernel computes each request with the same
    arithmetic wherever it sits, so only a decision within a rounding of its boundary (|u - p/q| or a
    race gap of about one fp32 ulp, some 1e-7 of the decisions) could flip with a position-dependent
    rounding. The reference check alone accepts either side of a decision inside its wider margins
    (``REL_PROB``, ``EPS_MASS``: 1e-4); the pair demands the same side for the same request.

    Args:
        inputs, outputs: the original inputs and the candidate's outputs on them.
        twin_inputs, twin_outputs: the permuted inputs (twin row ``i`` = request ``perm[i]``) and the
            candidate's outputs on them.
        info: ``{"perm": list of B ints}`` from ``inputs.permute_requests``.
        params, tolerance: unused.

    Returns:
        One line per differing row (output, twin row, original request, expected, got; at most
        ``PAIR_MAX_LINES`` + 1); empty when consistent.

    Source: kernel_targets.md §2.5 (batch independence), §2.6 (exact given the draws); issue 3 ("a
    request's result never depends on its batch mates"); task.toml [domain.invariances.batch_permutation].
    """
    perm = list(info["perm"])
    msgs: list[str] = []
    for name in OUTPUTS:
        a, t = outputs.get(name), twin_outputs.get(name)
        if not isinstance(a, torch.Tensor) or not isinstance(t, torch.Tensor) or a.shape != t.shape:
            return []  # a missing or misshapen output is the reference check's to report
        a, t = a.detach().cpu(), t.detach().cpu()
        for i, j in enumerate(perm):
            if not torch.equal(a[j], t[i]):
                kind = "greedy" if float(inputs["temperature"][j]) == 0.0 else "sampled"
                msgs.append(f"{name}[{i}] of the twin (request {j} of the original, {kind}): expected {a[j].tolist()} "
                            f"(the candidate's own result for this request on the original batch), got {t[i].tolist()}")
    if len(msgs) > PAIR_MAX_LINES:
        msgs = msgs[:PAIR_MAX_LINES] + [f"... and {len(msgs) - PAIR_MAX_LINES} more differing rows"]
    return msgs
