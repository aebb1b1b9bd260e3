"""Input generators for the K3 DSpark draft-verification task, one per ``case`` in task.toml.

Every draw is deterministic for a seed (a private ``torch.Generator``, never the global RNG) and
lives on the CPU; the harness moves tensors to the device.

Realistic logits: a Zipf-like prior over the vocabulary (a few frequent tokens, a long tail), per-
position noise, and a context peak: one token leads by 4-10 logits (confident positions) or 0-4, a handful of
runner-up tokens sit close behind (so the target is often peaked, sometimes flat among a few, always
long-tailed over V). Drafts agree with the target's favourite most of the time, not always; draft
probabilities (when present) are a perturbed copy of the target's, and the draft token is
sampled from them (so q(d) > 0). Padding (columns past n_b) holds garbage a kernel must not read.

Source: tasks/k3_dspark_verify/task.toml (workloads and their ``case``); shared/reference/
kernel_targets.md §2.4 (dtypes), §2.5 (edge cases); issue 3 (bug-report cases).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

GREEDY_FRACTION = 0.4
TEMPERATURES = (0.6, 0.8, 1.0, 1.2)
TOP_KS = (1, 20, 50, 200)
TOP_PS = (0.7, 0.9, 0.95)
TEMPERATURE_RANGE = (0.02, 2.0)
"""Log-uniform range of the continuous temperature draws (half of the sampled requests). Session 20's red
team: a kernel that took every temperature below 0.25 for greedy was accepted, because the listed values
stop at 0.6 and the sweep's 0.05 is greedy in effect on realistic logits."""
TOP_P_RANGE = (0.5, 0.999)
"""Uniform range of the continuous top-p draws (half of the requests with top-p on)."""


def off_top_ks(V: int) -> tuple[int, ...]:
    """The ``top_k`` values that mean "no top-k" for a vocabulary of ``V``: 0, -1 (vLLM's old "disabled"),
    V and the largest int32 (the contract: ``0 < k < V`` keeps the k largest, anything else is off).
    Session 12's red team: a kernel cutting ``top_k = -1`` rows to their top-1 was judged correct, because
    every draw wrote 0 for "off" and the reference refused negatives."""
    return (0, -1, V, 2**31 - 1)
DRAFT_AGREEMENT = 0.85
"""Probability a one-hot draft is the target's favourite token (DSpark-like acceptance, issue 3)."""
ISSUE_LOGITS = (-8.0, -3.0, -2.0, -1.0, 0.0, 9.0, 1.0, 2.0)
"""Target logits of the mixed greedy/sampled bug-report batch (issue 3)."""


class _Draw:
    """Mutable bundle of one draw's tensors (filled by a case, then finalized)."""

    def __init__(self, B: int, D: int, V: int, gen: torch.Generator) -> None:
        self.B, self.D, self.V, self.gen = B, D, V, gen
        self.logits = torch.zeros(B, D + 1, V)
        self.drafts = torch.full((B, D), -1, dtype=torch.int32)
        self.n = torch.full((B,), D, dtype=torch.int32)
        self.q: torch.Tensor | None = None
        self.temperature = torch.zeros(B)
        self.top_k = torch.zeros(B, dtype=torch.int32)
        self.top_p = torch.ones(B)
        self.u = torch.rand(B, D, generator=gen)
        e = -torch.log1p(-torch.rand(B, V, generator=gen))  # Exp(1): -log(1 - U), U in [0, 1)
        self.noise = e.clamp_min(torch.finfo(torch.float32).tiny)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen)

    def randint(self, lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.gen)


def realistic_logits(B: int, P: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """(B, P, V) float32 language-model-like logits.

    Zipf prior ``-1.1 * log(rank + 1)`` over a random ranking of the vocabulary, N(0, 1.5^2) noise
    per token, then a context peak: the best token leads the rest by U(4, 10) logits at 60% of the
    positions (confident) or U(0, 4) (uncertain), and 2-8 runner-ups sit U(1, 6) below the best.
    """
    rank = torch.randperm(V, generator=gen).float()
    prior = -1.1 * torch.log1p(rank)
    x = prior + 1.5 * torch.randn(B, P, V, generator=gen)
    top = x.amax(-1)
    n_runner = 8
    ids = torch.randint(0, V, (B, P, n_runner + 1), generator=gen)
    confident = torch.rand(B, P, generator=gen) < 0.6
    lead = torch.where(confident, 4.0 + 6.0 * torch.rand(B, P, generator=gen), 4.0 * torch.rand(B, P, generator=gen))
    runner = top.unsqueeze(-1) + lead.unsqueeze(-1) - 1.0 - 5.0 * torch.rand(B, P, n_runner, generator=gen)
    used = torch.randint(2, n_runner + 1, (B, P, 1), generator=gen)
    runner = torch.where(torch.arange(n_runner).view(1, 1, -1) < used, runner, x.gather(-1, ids[..., 1:]))
    x.scatter_(-1, ids[..., 1:], runner)
    x.scatter_(-1, ids[..., :1], (top + lead + 0.01).unsqueeze(-1))
    return x


def _garbage_padding(d: _Draw) -> None:
    """Fill what lies past each request's n_b with values that change the result if read."""
    cols = torch.arange(d.D + 1)
    pad_pos = cols.view(1, -1) > d.n.view(-1, 1).long()  # logits rows past the bonus position
    for b, i in pad_pos.nonzero().tolist():
        junk = 30.0 * d.rand(d.V) - 15.0
        junk[int(d.randint(0, d.V, 1))] = 1.0e4
        d.logits[b, i] = junk
    pad_draft = cols[: d.D].view(1, -1) >= d.n.view(-1, 1).long()
    d.drafts = torch.where(pad_draft, torch.full_like(d.drafts, -1), d.drafts)
    if d.q is not None and bool(pad_draft.any()):
        junk_q = torch.zeros_like(d.q).scatter_(-1, d.randint(0, d.V, d.B, d.D, 1), 1.0)
        d.q = torch.where(pad_draft.unsqueeze(-1), junk_q, d.q)


def _sampling_params(d: _Draw, greedy_fraction: float) -> None:
    """Per-request temperature (0.0 = greedy), top-k (off: :func:`off_top_ks`) and top-p (1.0 = off).

    Half of the sampled temperatures come from :data:`TEMPERATURES`, half log-uniform over
    :data:`TEMPERATURE_RANGE`; half of the top-k values that are on come from :data:`TOP_KS`, half
    log-uniform over [1, V - 1] (any k a request may ask for); half of the top-p values that are on come
    from :data:`TOP_PS`, half uniform over :data:`TOP_P_RANGE`. Session 20's red team: a kernel that cut
    every top-k above 256 to 256 was accepted, because no draw asked for 200 < k < V."""
    B = d.B
    pick = lambda xs: torch.tensor(xs)[d.randint(0, len(xs), B)]  # noqa: E731
    greedy = d.rand(B) < greedy_fraction
    lo, hi = (torch.log(torch.tensor(x)) for x in TEMPERATURE_RANGE)
    smooth_t = torch.exp(lo + (hi - lo) * d.rand(B))
    temps = torch.where(d.rand(B) < 0.5, pick(TEMPERATURES).float(), smooth_t)
    d.temperature = torch.where(greedy, torch.zeros(B), temps)
    off = pick(off_top_ks(d.V)).int()  # "off" in every spelling the contract allows
    wide_k = torch.exp(torch.log(torch.tensor(float(max(d.V - 1, 1)))) * d.rand(B)).floor().clamp(1, max(d.V - 1, 1))
    ks = torch.where(d.rand(B) < 0.5, pick(TOP_KS).float(), wide_k).int()
    d.top_k = torch.where(d.rand(B) < 0.6, off, ks).int()
    smooth_p = TOP_P_RANGE[0] + (TOP_P_RANGE[1] - TOP_P_RANGE[0]) * d.rand(B)
    ps = torch.where(d.rand(B) < 0.5, pick(TOP_PS).float(), smooth_p)
    d.top_p = torch.where(d.rand(B) < 0.5, torch.ones(B), ps)


def _drafts(d: _Draw, with_probs: bool) -> None:
    """Drafts for positions 0..D-1: from a perturbed copy of the target (probabilities when asked)."""
    x = d.logits[:, : d.D]
    if with_probs:
        q_logits = x + 0.7 * torch.randn(x.shape, generator=d.gen)
        d.q = torch.softmax(q_logits, -1)
        e = (-torch.log1p(-d.rand(*d.q.shape))).clamp_min(1e-30)
        d.drafts = (d.q / e).argmax(-1).int()  # d ~ q (exponential race)
    else:
        favourite = x.argmax(-1)
        other = x.topk(min(5, d.V), dim=-1).indices.gather(-1, d.randint(0, min(5, d.V), d.B, d.D, 1)).squeeze(-1)
        rand_tok = d.randint(0, d.V, d.B, d.D)
        alt = torch.where(d.rand(d.B, d.D) < 0.8, other, rand_tok)
        d.drafts = torch.where(d.rand(d.B, d.D) < DRAFT_AGREEMENT, favourite, alt).int()


def _ragged(d: _Draw, full_fraction: float = 0.7) -> None:
    d.n = torch.where(d.rand(d.B) < full_fraction, torch.full((d.B,), d.D), d.randint(0, d.D + 1, d.B)).int()


def _base(d: _Draw, with_probs: bool, greedy_fraction: float) -> None:
    # Rounded to bf16 first, so every choice below (favourite token, ties) sees the exact input values.
    d.logits = realistic_logits(d.B, d.D + 1, d.V, d.gen).to(torch.bfloat16).float()
    _sampling_params(d, greedy_fraction)
    _drafts(d, with_probs)


def _realistic(d: _Draw, with_probs: bool) -> None:
    _base(d, with_probs, GREEDY_FRACTION)
    _ragged(d)


def _greedy(d: _Draw, with_probs: bool) -> None:
    _base(d, with_probs, 1.0)
    _ragged(d)


def _sampled(d: _Draw, with_probs: bool) -> None:
    _base(d, with_probs, 0.0)
    _ragged(d)


def _zero_drafts(d: _Draw, with_probs: bool) -> None:
    """Every request has n_b = 0 (mixed prefill/decode): only the bonus token, at column 0."""
    _base(d, with_probs, GREEDY_FRACTION)
    d.n.zero_()


def _all_accepted(d: _Draw, with_probs: bool) -> None:
    """Drafts are the target argmax (always inside top-k/top-p) and u = 0: every draft accepted
    (u < p(d)/q(d) holds whenever p(d) > 0 and q(d) > 0); the bonus lands at column n_b."""
    _base(d, with_probs, GREEDY_FRACTION)
    d.drafts = d.logits[:, : d.D].argmax(-1).int()
    d.u.zero_()
    if d.q is not None:  # make sure q(d) > 0 where it matters
        d.q.scatter_(-1, d.drafts.long().unsqueeze(-1), 0.5)
        d.q /= d.q.sum(-1, keepdim=True)
    _ragged(d)


def _none_accepted(d: _Draw, with_probs: bool) -> None:
    """Every first draft is rejected: drafts are the target's least likely token (outside top-k when
    on, p(d) < 1e-15 otherwise; with draft probabilities q(d) is raised to 0.5) and u >= 0.5."""
    _base(d, with_probs, GREEDY_FRACTION)
    d.drafts = d.logits[:, : d.D].argmin(-1).int()
    d.u = 0.5 + 0.5 * d.rand(d.B, d.D) * (1 - 1e-6)
    if d.q is not None:
        d.q.scatter_(-1, d.drafts.long().unsqueeze(-1), 0.0)
        d.q *= 0.5 / d.q.sum(-1, keepdim=True)
        d.q.scatter_(-1, d.drafts.long().unsqueeze(-1), 0.5)
    d.n = torch.full((d.B,), d.D, dtype=torch.int32)


def _issue_mixed(d: _Draw, with_probs: bool) -> None:
    """Issue 3: logits [-8, -3, -2, -1, 0, 9, 1, 2] at every position, one draft each.

    Rows: 0 greedy with draft 5 (accept, then the bonus 5); 1 sampled (T=1, top-k 3) with draft 0
    (outside the top-3: rejected, the recovered token is one of the ids 5, 7, 6); 2 greedy with draft
    0 (rejected, emits 5); 3 sampled (T=0.5, top-p 0.9: only token 5 is kept) with draft 5
    (accepted, bonus 5).
    """
    if (d.B, d.D, d.V) != (4, 1, 8) or with_probs:
        raise ValueError(f"inputs case 'issue_mixed' needs B=4, D=1, V=8 and no draft probabilities (Q=1); "
                         f"got B={d.B}, D={d.D}, V={d.V}, draft probabilities {with_probs}.")
    d.logits = torch.tensor(ISSUE_LOGITS).expand(4, 2, 8).clone()
    d.drafts = torch.tensor([[5], [0], [0], [5]], dtype=torch.int32)
    d.n = torch.ones(4, dtype=torch.int32)
    d.temperature = torch.tensor([0.0, 1.0, 0.0, 0.5])
    d.top_k = torch.tensor([0, 3, 0, 0], dtype=torch.int32)
    d.top_p = torch.tensor([1.0, 1.0, 1.0, 0.9])


def _batch_mates(d: _Draw, with_probs: bool) -> None:
    """One probe request copied into rows 0, B//2 and B-1 (same logits, drafts, draws, params); the
    other rows differ in every sampling parameter (greedy, top-k 1, top-p 0.7, no drafts). The probe
    rows must come out identical whatever their neighbours."""
    if d.B < 8:
        raise ValueError(f"inputs case 'batch_mates' needs B >= 8 (a probe plus different neighbours); got B={d.B}.")
    _base(d, with_probs, 0.5)
    _ragged(d)
    d.temperature[1], d.top_k[2], d.top_p[3] = 0.0, 1, 0.7
    d.n[1] = 0
    probe = [0, d.B // 2, d.B - 1]
    d.temperature[0], d.top_k[0], d.top_p[0], d.n[0] = 0.8, 50, 0.95, d.D
    for b in probe[1:]:
        d.logits[b], d.drafts[b], d.n[b], d.u[b], d.noise[b] = d.logits[0], d.drafts[0], d.n[0], d.u[0], d.noise[0]
        d.temperature[b], d.top_k[b], d.top_p[b] = d.temperature[0], d.top_k[0], d.top_p[0]
        if d.q is not None:
            d.q[b] = d.q[0]


def _q_zero(d: _Draw, with_probs: bool) -> None:
    """Draft probabilities give the draft token q(d) = 0 at some positions: must reject (never a
    division by zero), and the residual max(p - q, 0) may then recover the draft token itself."""
    if not with_probs:
        raise ValueError("inputs case 'q_zero' needs draft probabilities (Q=2).")
    _base(d, True, 0.0)
    hit = d.rand(d.B, d.D) < 0.5
    drafts = d.logits[:, : d.D].argmax(-1)
    d.drafts = torch.where(hit, drafts, d.drafts.long()).int()
    zeroed = d.q.scatter(-1, drafts.unsqueeze(-1), 0.0)
    zeroed /= zeroed.sum(-1, keepdim=True)
    d.q = torch.where(hit.unsqueeze(-1), zeroed, d.q)
    d.u = d.rand(d.B, d.D) * 0.5


def _params_sweep(d: _Draw, with_probs: bool) -> None:
    """Each request its own extreme: top-k 1, top-k = V (off), top-k > V (off), top-p 0.01 (only the
    favourite), top-p just below 1, temperature 0.05 and 3.0, greedy, both filters at once."""
    _base(d, with_probs, 0.0)
    _ragged(d, 0.8)
    rows = [(1.0, 1, 1.0), (1.0, d.V, 1.0), (1.0, d.V + 7, 1.0), (1.0, 0, 0.01), (1.0, 0, 0.999),
            (0.05, 0, 1.0), (3.0, 0, 1.0), (0.0, 5, 0.5), (0.7, 10, 0.8)]
    for b in range(d.B):
        t, k, p = rows[b % len(rows)]
        d.temperature[b], d.top_k[b], d.top_p[b] = t, k, p


def _greedy_ties(d: _Draw, with_probs: bool) -> None:
    """Greedy requests over integer logits in [-3, 3]: the maximum is tied between several ids;
    drafts are a random tied maximum, so only the lowest tied id is accepted (torch.argmax's rule)."""
    _base(d, with_probs, 1.0)
    d.logits = d.randint(-3, 4, d.B, d.D + 1, d.V).float()
    tied = d.logits[:, : d.D] == d.logits[:, : d.D].amax(-1, keepdim=True)
    score = torch.where(tied, d.rand(d.B, d.D, d.V), torch.full((d.B, d.D, d.V), -1.0))
    d.drafts = score.argmax(-1).int()
    _ragged(d)


def _top_p_tiny(d: _Draw, with_probs: bool) -> None:
    """Sampled requests with top-p at its lower edge (1e-7, 1e-4, 0.01: only the most probable
    token, ties kept) or just below 1 (0.9999), some with top-k 1 or 2 as well; drafts as realistic."""
    _base(d, with_probs, 0.0)
    _ragged(d)
    ps = torch.tensor([1e-7, 1e-4, 0.01, 0.9999])
    d.top_p = ps[d.randint(0, len(ps), d.B)]
    d.top_k = torch.where(d.rand(d.B) < 0.3, d.randint(1, 3, d.B), torch.zeros(d.B, dtype=torch.int64)).int()


def _u_zero(d: _Draw, with_probs: bool) -> None:
    """Uniform draws of exactly 0 at half the positions, against drafts the target gives probability 0
    (top-k 1 and a draft that is not the favourite) as well as positive: accept iff 0 < p/q, so a draft
    of target probability 0 must be rejected even at u = 0 (a ``u <= p/q`` test accepts it)."""
    _base(d, with_probs, 0.0)
    _ragged(d)
    d.u = torch.where(d.rand(d.B, d.D) < 0.5, torch.zeros(d.B, d.D), d.u)
    d.top_k = torch.where(d.rand(d.B) < 0.5, torch.ones(d.B, dtype=torch.int32), d.top_k)
    if d.V >= 2:
        second = d.logits[:, : d.D].topk(2, dim=-1).indices[..., 1]
        d.drafts = torch.where(d.rand(d.B, d.D) < 0.5, second, d.drafts.long()).int()
        if d.q is not None:  # keep q(d) > 0 for the replaced drafts
            d.q.scatter_(-1, d.drafts.long().unsqueeze(-1), 0.25)
            d.q /= d.q.sum(-1, keepdim=True)


def _sampling_knobs(d: _Draw, with_probs: bool) -> None:
    """Every request sampled, its knobs over their whole legal ranges (temperature log-uniform over
    :data:`TEMPERATURE_RANGE`, top-k off, log-uniform over [1, V - 1] or uniform over [V / 8, V - 1]
    (a cut deep in the tail), top-p off or uniform over
    :data:`TOP_P_RANGE`), on logits where each knob changes the outcome: a flat N(0, 0.5^2) body, so a
    wide top-k cuts real mass (the tokens past rank 256 hold most of it at V = 4096), and 2-4 leaders
    within 0.5 logits of each other, so a low temperature still samples among them (it is not greedy).
    Session 20's red team: kernels taking T < 0.25 for greedy, or cutting top-k to 256, passed every
    other draw."""
    _base(d, with_probs, 0.0)
    B, P, V = d.B, d.D + 1, d.V
    x = 0.5 * torch.randn(B, P, V, generator=d.gen)
    n_lead = min(4, V)
    ids = torch.stack([torch.randperm(V, generator=d.gen)[:n_lead] for _ in range(B * P)]).view(B, P, n_lead)
    lead = x.amax(-1, keepdim=True) + 1.0 + 0.5 * d.rand(B, P, n_lead)
    used = d.randint(2, n_lead + 1, B, P, 1) if n_lead >= 2 else torch.ones(B, P, 1, dtype=torch.int64)
    lead = torch.where(torch.arange(n_lead).view(1, 1, -1) < used, lead, x.gather(-1, ids))
    d.logits = x.scatter(-1, ids, lead).to(torch.bfloat16).float()
    lo, hi = (torch.log(torch.tensor(v)) for v in TEMPERATURE_RANGE)
    d.temperature = torch.exp(lo + (hi - lo) * d.rand(B))
    wide_k = torch.exp(torch.log(torch.tensor(float(max(V - 1, 1)))) * d.rand(B)).floor().clamp(1, max(V - 1, 1))
    large_k = (V / 8 + (V - 1 - V / 8) * d.rand(B)).floor().clamp(1, max(V - 1, 1))  # cuts the tail, keeps most
    pick = d.randint(0, 3, B)
    d.top_k = torch.where(pick == 0, torch.zeros(B), torch.where(pick == 1, wide_k, large_k)).int()
    d.top_p = torch.where(d.rand(B) < 0.5, torch.ones(B), TOP_P_RANGE[0] + (TOP_P_RANGE[1] - TOP_P_RANGE[0]) * d.rand(B))
    _drafts(d, with_probs)
    _ragged(d)


CASES: dict[str, Callable[[_Draw, bool], None]] = {
    "realistic": _realistic,
    "greedy": _greedy,
    "sampled": _sampled,
    "zero_drafts": _zero_drafts,
    "all_accepted": _all_accepted,
    "none_accepted": _none_accepted,
    "issue_mixed": _issue_mixed,
    "batch_mates": _batch_mates,
    "q_zero": _q_zero,
    "params_sweep": _params_sweep,
    "greedy_ties": _greedy_ties,
    "top_p_tiny": _top_p_tiny,
    "u_zero": _u_zero,
    "sampling_knobs": _sampling_knobs,
}
"""Case name -> filler ``(draw, with_draft_probs) -> None``."""


def make_inputs(axes: Mapping[str, int], seed: int, case: str = "realistic") -> dict[str, torch.Tensor]:
    """Draw the op's inputs for one workload.

    Args:
        axes: B (requests), D (max drafts), V (vocabulary), Q (2: draft probabilities given,
            1: absent, ``draft_probs`` then has 0 rows).
        seed: RNG seed; equal seeds give equal tensors.
        case: one of :data:`CASES` (their docstrings say what each draws).

    Returns:
        ``target_logits`` (B, D+1, V) bfloat16; ``draft_token_ids`` (B, D) int32 (-1 past n_b);
        ``num_draft_tokens`` (B,) int32; ``draft_probs`` (B*(Q-1), D, V) float32; ``temperature``
        (B,) float32; ``top_k`` (B,) int32; ``top_p`` (B,) float32; ``uniform_draws`` (B, D) float32;
        ``exponential_noise`` (B, V) float32; all contiguous CPU tensors.

    Raises:
        ValueError: unknown case (the message lists the known ones), or axes the case cannot use.

    Source: task.toml workloads; kernel_targets.md §2.4 (dtypes), §2.5 (edge cases).
    """
    if case not in CASES:
        raise ValueError(f"Task 'k3_dspark_verify' (tasks/k3_dspark_verify/inputs.py): unknown input case {case!r}; "
                         f"known cases: {', '.join(CASES)}. Fix the workload's case in task.toml.")
    B, D, V, Q = (int(axes[k]) for k in ("B", "D", "V", "Q"))
    if B < 1 or D < 1 or V < 2 or Q not in (1, 2):
        raise ValueError(f"k3_dspark_verify inputs: need B >= 1, D >= 1, V >= 2 and Q in (1, 2); got B={B}, D={D}, "
                         f"V={V}, Q={Q}.")
    gen = torch.Generator().manual_seed(int(seed))
    d = _Draw(B, D, V, gen)
    CASES[case](d, Q == 2)
    _garbage_padding(d)
    q = d.q if d.q is not None else torch.zeros(0, D, V)
    return {
        "target_logits": d.logits.to(torch.bfloat16).contiguous(),
        "draft_token_ids": d.drafts.int().contiguous(),
        "num_draft_tokens": d.n.int().contiguous(),
        "draft_probs": q.float().contiguous(),
        "temperature": d.temperature.float().contiguous(),
        "top_k": d.top_k.int().contiguous(),
        "top_p": d.top_p.float().contiguous(),
        "uniform_draws": d.u.float().contiguous(),
        "exponential_noise": d.noise.float().contiguous(),
    }


# Metamorphic twin (task.toml [domain.invariances.batch_permutation]; issue 19 item 2).

_PER_REQUEST = ("target_logits", "draft_token_ids", "num_draft_tokens", "temperature", "top_k", "top_p",
                "uniform_draws", "exponential_noise")
"""Inputs whose first dimension is the request (``draft_probs`` too when it has B rows, Q = 2)."""


def permute_requests(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, int], params: Mapping[str, object],
                     seed: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The batch with its requests permuted, each with its own logits, drafts, draft probabilities,
    sampling parameters and random draws: twin row ``i`` is original request ``perm[i]``.

    ``perm`` is uniform over the permutations of B requests other than the identity (one is redrawn
    as a rotation by one). ``draft_probs`` is permuted when it has B rows and left as it is (0 rows,
    Q = 1) otherwise.

    Args:
        inputs: as :func:`make_inputs` returns.
        axes: the workload's axes (B >= 2: task.toml ``requires``).
        params: the op's scalar arguments (unused).
        seed: RNG seed of the permutation.

    Returns:
        (twin inputs, ``{"perm": perm}``) with ``perm`` a list of B ints.

    Raises:
        ValueError: B < 2 (a permutation of one request is the identity).

    Source: task.toml [domain.invariances.batch_permutation]; kernel_targets.md §2.5 (batch independence).
    """
    B = int(inputs["target_logits"].shape[0])
    if B < 2:
        raise ValueError(f"k3_dspark_verify permute_requests: needs B >= 2 requests (task.toml requires 'B >= 2'); got B={B}.")
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(int(seed)))
    if bool((perm == torch.arange(B)).all()):
        perm = torch.roll(perm, 1)
    twin = {k: v.clone() for k, v in inputs.items()}
    for k in _PER_REQUEST:
        twin[k] = inputs[k][perm].contiguous()
    if inputs["draft_probs"].shape[0] == B:
        twin["draft_probs"] = inputs["draft_probs"][perm].contiguous()
    return twin, {"perm": perm.tolist()}
