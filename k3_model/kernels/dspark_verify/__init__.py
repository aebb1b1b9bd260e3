"""Latency-specialized K3 DSpark draft verification for decode batches (CPU, bf16 logits).

Lazy where the standard path is exhaustive: greedy requests take one argmax over their own
positions (on the bf16 logits, no fp32 copy); sampled requests are advanced position by position,
batched over the requests still verifying, so a position after a request's first rejection is never
scored; top-p looks at the 1024 most probable tokens and sorts the whole row only when the nucleus
is larger. Same contract as ``k3_model.ops.dspark_verify.dspark_verify``.
"""

from __future__ import annotations

import torch

from k3_model.dispatch import OpScope

SCOPE = OpScope(devices=("cpu",), phases=("spec_verify",), tp_sizes=(1,), dtypes=("bfloat16",), requests_min=1, requests_max=64,
                query_len_min=2, query_len_max=9)
_CANDIDATES = 1024


def _nucleus_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(A, V) bool: token j kept iff the mass of strictly more probable tokens is < top_p."""
    A, V = probs.shape
    m = min(_CANDIDATES, V)
    vals = probs.topk(m, dim=-1).values  # descending
    above = vals.cumsum(-1) - vals
    first = torch.searchsorted(-vals.contiguous(), -vals.contiguous(), side="left")
    above = above.gather(-1, first)
    inside = above < top_p.unsqueeze(1)
    n_in = inside.sum(-1)
    smallest = vals.gather(-1, (n_in - 1).clamp_min(0).unsqueeze(1))
    # the nucleus ends inside the candidates when some candidate is out and the smallest kept value
    # is not tied with the m-th (a tie group cut by m would need the full row)
    ok = (n_in < m) | (m == V)
    ok &= (smallest.squeeze(1) > vals[:, -1]) | (m == V)
    keep = probs >= smallest
    for r in (~ok).nonzero().flatten().tolist():
        s, order = probs[r].sort(descending=True)
        a = (s.cumsum(0) - s)[torch.searchsorted(-s, -s, side="left")]
        keep[r] = torch.zeros(V, dtype=torch.bool).scatter_(0, order, a < top_p[r])
    return keep


def _target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(A, V) fp32 target probabilities of A sampled rows at one position each."""
    x = logits.float()
    A, V = x.shape
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    if bool(k_on.any()):
        mk = int(k[k_on].max())
        kth = x.topk(mk, dim=-1).values.gather(-1, (k.clamp(1, mk) - 1).unsqueeze(1))
        x = x.masked_fill((x < kth) & k_on.unsqueeze(1), float("-inf"))
    z = x / temperature.unsqueeze(1)
    probs = z.softmax(-1)
    p_on = top_p < 1.0
    if bool(p_on.any()):
        rows = p_on.nonzero().flatten()
        keep = _nucleus_mask(probs[rows], top_p[rows])
        kept = probs[rows].masked_fill(~keep, 0.0)
        probs[rows] = kept / kept.sum(-1, keepdim=True)
    return probs


def dspark_verify(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                  uniform_draws, exponential_noise, *, max_draft_tokens, output_token_ids, num_accepted_tokens):
    """See ``k3_model.ops.dspark_verify.dspark_verify`` (shapes, dtypes, semantics)."""
    B, D1, V = target_logits.shape
    n = num_draft_tokens.long()
    out = torch.full((B, D1), -1, dtype=torch.int32)
    acc = torch.zeros(B, dtype=torch.int32)
    greedy = temperature == 0.0
    g_rows = greedy.nonzero().flatten()
    if g_rows.numel():
        am = target_logits[g_rows].argmax(-1)  # (G, D+1) on bf16: exact, lowest id on ties
        cols = torch.arange(D1 - 1)
        gn = n[g_rows]
        match = (draft_token_ids[g_rows].long() == am[:, :-1]) & (cols.unsqueeze(0) < gn.unsqueeze(1))
        a = match.long().cumprod(1).sum(1)
        rows_out = torch.where(cols.unsqueeze(0) < a.unsqueeze(1), am[:, :-1], torch.full_like(am[:, :-1], -1))
        out[g_rows, :-1] = rows_out.int()
        out[g_rows, a] = am.gather(1, a.unsqueeze(1)).squeeze(1).int()
        acc[g_rows] = a.int()
    active = (~greedy).nonzero().flatten()
    i = 0
    while active.numel():
        ni = n[active]
        done = ni == i  # bonus position reached
        if bool(done.any()):
            rows = active[done]
            p = _target_probs(target_logits[rows, i], temperature[rows], top_k[rows], top_p[rows])
            out[rows, i] = (p / exponential_noise[rows]).argmax(-1).int()
            acc[rows] = i
            active = active[~done]
            if not active.numel():
                break
        p = _target_probs(target_logits[active, i], temperature[active], top_k[active], top_p[active])
        d = draft_token_ids[active, i].long()
        p_d = p.gather(1, d.unsqueeze(1)).squeeze(1)
        if draft_probs is not None:
            q = draft_probs[active, i]
            q_d = q.gather(1, d.unsqueeze(1)).squeeze(1)
        else:
            q_d = torch.ones_like(p_d)
        ok = (q_d > 0) & (uniform_draws[active, i] < p_d / q_d)
        out[active[ok], i] = d[ok].int()
        rej = ~ok
        if bool(rej.any()):
            rows = active[rej]
            pr = p[rej]
            if draft_probs is not None:
                r = (pr - q[rej]).clamp_min(0.0)
            else:
                r = pr.scatter(1, d[rej].unsqueeze(1), 0.0)
            r = torch.where(r.sum(-1, keepdim=True) == 0, pr, r)
            out[rows, i] = (r / exponential_noise[rows]).argmax(-1).int()
            acc[rows] = i
        active = active[ok]
        i += 1
    output_token_ids.copy_(out)
    num_accepted_tokens.copy_(acc)
